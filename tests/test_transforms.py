"""jit, grad, vmap, checkpoint, value_and_grad in a model; forward mode
(jvp, linearize) and its compositions; determinism."""
import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close
from tests.cases import SMALL_BLOCKS, Case, inputs
from tests.conftest import KERNEL_IMPL, ON_GPU, OPTIMIZATION_LEVEL_0

CASE = Case(2, 100, 70, 4, 2, 32, "float32", True)


def _flash(q, k, v):
  return jax_flash.flash_attention(q, k, v, is_causal=True,
                                   implementation=KERNEL_IMPL,
                                   block_sizes=SMALL_BLOCKS)


def _ref(q, k, v):
  return jax_flash.reference_attention(q, k, v, is_causal=True)


def _loss(attn, do):
  return lambda q, k, v: jnp.sum(attn(q, k, v) * do)


def test_jit_grad_wrt_query_key_value():
  q, k, v, do = inputs(CASE)
  grads = jax.jit(jax.grad(_loss(_flash, do), argnums=(0, 1, 2)))(q, k, v)
  ref = jax.grad(_loss(_ref, do), argnums=(0, 1, 2))(q, k, v)
  assert_attention_close(grads, ref)


def test_vmap_over_extra_leading_axis():
  q, k, v, do = inputs(CASE)
  stack = lambda x: jnp.stack([x, 2 * x, -x])  # [3, B, ...]
  qs, ks, vs, dos = map(stack, (q, k, v, do))
  out = jax.jit(jax.vmap(_flash))(qs, ks, vs)
  ref = jax.vmap(_ref)(qs, ks, vs)
  assert_attention_close(out, ref)
  loss = lambda attn: lambda q, k, v: jnp.sum(jax.vmap(attn)(q, k, v) * dos)
  grads = jax.jit(jax.grad(loss(_flash), argnums=(0, 1, 2)))(qs, ks, vs)
  ref_grads = jax.grad(loss(_ref), argnums=(0, 1, 2))(qs, ks, vs)
  assert_attention_close(grads, ref_grads)


@pytest.mark.parametrize("mapped", ["bias", "lengths", "dropout", "sinks"])
def test_vmap_with_operands_equals_each_slice(mapped):
  """The batching rule: the mapped axis folds into the batch axis with the
  per-batch operands tiled or folded along (bias, lengths), or the call
  runs once per slice (dropout, whose bits depend on the batch index; sinks
  mapped along the axis). Each slice of the vmapped value and gradient
  equals the call on that slice alone."""
  q, k, v, do = inputs(CASE)
  qs = jnp.stack([q, 2 * q])
  options = dict(bias=jax.random.normal(jax.random.key(4), (1, 4, 100, 70)),
                 key_value_seq_lengths=jnp.array([70, 20]),
                 dropout_rate=0.3, dropout_rng=jax.random.key(5),
                 sinks=jnp.linspace(-1.0, 1.0, 4))
  if mapped != "dropout":
    del options["dropout_rate"], options["dropout_rng"]
  stacked = {"bias": jnp.stack([options["bias"], -options["bias"]]),
             "lengths": jnp.array([[70, 20], [5, 70]]),
             "sinks": jnp.stack([options["sinks"], 2 * options["sinks"]])}
  name = {"lengths": "key_value_seq_lengths"}.get(mapped, mapped)
  axis = stacked.get(mapped)

  def f(q, x):
    kwargs = dict(options, **({name: x} if x is not None else {}))
    return jnp.sum(jax_flash.flash_attention(
        q, k, v, is_causal=True, implementation=KERNEL_IMPL,
        block_sizes=SMALL_BLOCKS, **kwargs) * do)

  value_and_grad = jax.value_and_grad(f)
  per_slice = "scan" in str(jax.make_jaxpr(jax.vmap(f))(qs, axis))
  assert per_slice == (mapped in ("dropout", "sinks")), mapped
  got = jax.jit(jax.vmap(value_and_grad))(qs, axis)
  for i in range(2):
    want = value_and_grad(qs[i], None if axis is None else axis[i])
    assert_attention_close({"out": got[0][i], "dq": got[1][i]},
                           {"out": want[0], "dq": want[1]})


@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_checkpoint(policy):
  """jax.checkpoint, also with a policy that saves nothing (the forward
  runs again in the backward)."""
  q, k, v, do = inputs(CASE)
  policy = policy and getattr(jax.checkpoint_policies, policy)
  f = jax.checkpoint(_loss(_flash, do), policy=policy)
  grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
  ref = jax.grad(_loss(_ref, do), argnums=(0, 1, 2))(q, k, v)
  assert_attention_close(grads, ref)


def test_value_and_grad_in_a_model():
  """A one-layer attention model: projections, attention, readout."""
  b, t, d, n, kh, h = 2, 33, 64, 4, 2, 32
  keys = jax.random.split(jax.random.key(3), 6)
  params = {
      "wq": jax.random.normal(keys[0], (d, n * h)) / np.sqrt(d),
      "wk": jax.random.normal(keys[1], (d, kh * h)) / np.sqrt(d),
      "wv": jax.random.normal(keys[2], (d, kh * h)) / np.sqrt(d),
      "wo": jax.random.normal(keys[3], (n * h, d)) / np.sqrt(n * h),
  }
  x = jax.random.normal(keys[4], (b, t, d))
  y = jax.random.normal(keys[5], (b, t, d))

  def loss(params, attn):
    q = (x @ params["wq"]).reshape(b, t, n, h)
    k = (x @ params["wk"]).reshape(b, t, kh, h)
    v = (x @ params["wv"]).reshape(b, t, kh, h)
    out = attn(q, k, v).reshape(b, t, n * h) @ params["wo"]
    return jnp.mean((out - y) ** 2)

  value, grads = jax.jit(jax.value_and_grad(lambda p: loss(p, _flash)))(params)
  ref_value, ref_grads = jax.value_and_grad(lambda p: loss(p, _ref))(params)
  assert_attention_close({"out": value, "params": grads},
                         {"out": ref_value, "params": ref_grads})


def test_gradients_are_deterministic():
  case = Case(1, 255, 255, 8, 2, 64, "bfloat16", True)
  q, k, v, do = inputs(case)
  f = jax.jit(jax.grad(_loss(_flash, do), argnums=(0, 1, 2)))
  first = jax.device_get(f(q, k, v))
  f = jax.jit(jax.grad(_loss(_flash, do), argnums=(0, 1, 2)))  # Recompiled.
  jax.clear_caches()
  chex.assert_trees_all_equal(first, f(q, k, v))


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_second_order_is_a_clear_error_and_the_reference_gives_it(
    implementation):
  q, k, v, _ = inputs(CASE)

  def grad_norm(attention, **kwargs):
    f = lambda q: jnp.sum(attention(q, k, v, is_causal=True, **kwargs) ** 2)
    return lambda q: jnp.sum(jax.grad(f)(q) ** 2)

  with pytest.raises(NotImplementedError, match="cannot themselves be "
                     "differentiated .* use jax_flash.reference_attention"):
    jax.grad(grad_norm(jax_flash.flash_attention,
                       implementation=implementation))(q)
  tangent_norm = lambda q: jnp.sum(jax.jvp(
      lambda q: _flash(q, k, v), (q,), (jnp.ones_like(q),))[1] ** 2)
  with pytest.raises(NotImplementedError, match="grad of jvp"):
    jax.grad(tangent_norm)(q)
  hessian_vector = jax.grad(grad_norm(jax_flash.reference_attention))(q)
  assert np.isfinite(np.asarray(hessian_vector)).all()


# Forward mode: the tangents of the output and the logsumexp against the
# reference's, for tangents of every input at once; a mask, a score
# modification and an operand (bias) that gets a tangent too.
@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(local_window_size=(20, 5), logits_soft_cap=5.0,
         key_value_seq_lengths=jnp.array([70, 33])),
], ids=["causal", "window_softcap_lengths"])
def test_jvp_and_linearize_match_the_reference(implementation, kwargs):
  q, k, v, _ = inputs(CASE)
  bias = jax.random.normal(jax.random.key(3), (1, 4, 100, 70))
  tangents = tuple(jax.random.normal(jax.random.key(10 + i), x.shape)
                   for i, x in enumerate((q, k, v, bias)))

  def run(attention):
    f = lambda q, k, v, bias: attention(q, k, v, bias, return_residual=True,
                                        **kwargs)
    _, (t_out, t_lse) = jax.jvp(f, (q, k, v, bias), tangents)
    linear = jax.linearize(lambda q: f(q, k, v, bias)[0], q)[1]
    return {"out": t_out, "lse": t_lse, "dq": linear(tangents[0])}

  got = jax.jit(lambda: run(lambda *a, **kw: jax_flash.flash_attention(
      *a, implementation=implementation, **kw)))()
  assert_attention_close(got, run(jax_flash.reference_attention))


@pytest.mark.skipif(ON_GPU, reason="a GPU run compiles at XLA's default")
def test_forward_mode_at_xla_default_optimization():
  """The forward-mode cases again with XLA's default optimizations (this
  process compiles at level 0): the tangents are finite and right whatever
  XLA fuses or folds (the running max is a constant to AD, so no tangent
  counts the entries tied for it)."""
  env = dict(os.environ, JAX_FLASH_XLA_DEFAULT_OPTIMIZATION="1",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
                 OPTIMIZATION_LEVEL_0, "").strip())
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       f"{__file__}::test_jvp_and_linearize_match_the_reference"],
      capture_output=True, text=True, env=env, timeout=600,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert "4 passed" in result.stdout, result.stdout[-2000:]


def test_forward_mode_composes_with_vmap_jit_and_checkpoint():
  """vmap of jvp, jvp of vmap (the mapped axis folded into the batch), and
  reverse mode under jax.checkpoint (which JAX derives from forward mode:
  its transpose runs the kernels' backward)."""
  q, k, v, do = inputs(CASE)
  qs = jnp.stack([q, 2 * q])
  dq = jnp.cos(q)

  def both(attention):
    tangent = lambda q: jax.jvp(lambda q: attention(q, k, v), (q,), (dq,))[1]
    grad = jax.grad(jax.checkpoint(_loss(attention, do)), argnums=(0, 1, 2))
    return {"out": jax.jit(jax.vmap(tangent))(qs),
            "lse": jax.jvp(jax.vmap(lambda q: attention(q, k, v)), (qs,),
                           (jnp.stack([dq, dq]),))[1],
            "dq": jax.jit(grad)(q, k, v)}

  assert_attention_close(both(_flash), both(_ref))


def _python_calls(fn, *args) -> list[str]:
  """The Python functions a warm call of `fn` enters (jit's C++ path: none).

  Two calls warm it: the process's first one imports the kernel packages,
  whose new config options change the key of jit's cache once."""
  import sys
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  names = []

  def profile(frame, event, arg):
    if event == "call":
      names.append(frame.f_code.co_qualname)

  sys.setprofile(profile)
  try:
    fn(*args)
  finally:
    sys.setprofile(None)
  return names


@pytest.mark.parametrize("call", ["forward", "grad", "jvp", "flex", "decode"])
def test_a_warm_jitted_call_runs_no_python(call):
  """jit's C++ dispatch takes every entry point: a warm jitted call runs no
  Python function (a primitive JAX cannot dispatch from C++ costs about
  0.1 ms of Python a call)."""
  q, k, v, do = inputs(CASE)
  fns = {
      "forward": lambda q: _flash(q, k, v),
      "grad": lambda q: jax.grad(_loss(_flash, do))(q, k, v),
      "jvp": lambda q: jax.jvp(lambda q: _flash(q, k, v), (q,), (q,))[1],
      "flex": lambda q: jax_flash.flex_attention(
          q, k, v, block_mask=jax_flash.create_block_mask(
              lambda b, h, i, j: i >= j, None, None, 100, 70, block_size=32),
          implementation=KERNEL_IMPL),
      "decode": lambda q: jax_flash.flash_decode(
          q[:, :1], k, v, kv_lengths=jnp.array([70, 33]),
          implementation=KERNEL_IMPL),
  }
  assert _python_calls(jax.jit(fns[call]), q) == []


def test_layers_trace_and_lower_each_kernel_once(monkeypatch):
  """Four layers of the same attention in one program: its forward and its
  backward are traced once each and lowered as one function each, called
  from every layer."""
  from jax_flash import _dispatch, _primitive
  # Another test in this process may have traced the same call already.
  for cached in (_primitive._forward_jit, _primitive._backward_jit):
    monkeypatch.setattr(_primitive, cached.__name__,
                        functools.cache(cached.__wrapped__))
  traced = []
  for name in ("forward", "backward"):
    original = getattr(_dispatch.XlaBackend, name)

    def counting(self, *args, original=original, name=name, **kwargs):
      traced.append(name)
      return original(self, *args, **kwargs)

    monkeypatch.setattr(_dispatch.XlaBackend, name, counting)
  x = jax.random.normal(jax.random.key(0), (2, 64, 4, 32))

  def model(x):
    for layer in range(4):
      x = x + jax_flash.flash_attention(x * (layer + 1), x, x, is_causal=True,
                                        implementation="xla")
    return jnp.sum(x)

  text = jax.jit(jax.grad(model)).lower(x).as_text()
  assert sorted(traced) == ["backward", "forward"]
  assert text.count("func.func private @forward") == 1
  assert text.count("call @forward") == 4
  assert text.count("func.func private @backward") == 1
