"""The Flax modules against flax's own, with the same parameters, and the
training example."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jax_flash.linen
import jax_flash.nnx
from examples import train_lm
from jax_flash.testing import relative_error, tolerance
from tests.conftest import KERNEL_IMPL

B, T, D = 2, 37, 64
X = jax.random.normal(jax.random.key(0), (B, T, D))
LENGTHS = jnp.array([30, T])
VALID = (jnp.arange(T)[None] < LENGTHS[:, None])  # [B, T]
PADDING_MASK = nnx.make_attention_mask(VALID, VALID)  # [B, 1, T, T]
TOL = tolerance(jnp.float32)  # float32 end to end.


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
  """flax's attention (and every Dense) at full float32: XLA's default on a
  GPU is TF32 (about 5e-4 relative), our kernels are full float32."""
  with jax.default_matmul_precision("highest"):
    yield


def _nnx_pair(**kwargs):
  args = dict(num_heads=4, in_features=D, qkv_features=64, decode=False,
              **kwargs)
  ref = nnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0))
  ours = jax_flash.nnx.FlashAttention(**args, implementation=KERNEL_IMPL,
                                      rngs=nnx.Rngs(0))
  return ours, ref


def _assert_same_params(a, b):
  a, b = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def _assert_close_grads(grads, ref_grads):
  """Every parameter's gradient within TOL.grad of the whole gradient's norm.

  (Per leaf relative errors mislead for gradients that are 0 in exact
  arithmetic, like the key projection's bias: softmax ignores a per-row
  constant.)
  """
  leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(leaves) == len(ref_leaves)
  scale = np.sqrt(sum(float(jnp.sum(r ** 2)) for r in ref_leaves))
  for g, r in zip(leaves, ref_leaves):
    assert g.shape == r.shape
    assert float(jnp.linalg.norm((g - r).ravel())) <= TOL.grad * scale


def _valid_rows(x, mask):
  """Rows that see no key differ by design (0 here, mean of V in flax)."""
  return x if mask is None else jnp.where(VALID[..., None], x, 0.0)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("setting", ["causal", "padding", "both"])
def test_nnx_module_matches_flax(num_kv_heads, setting):
  ours, ref = _nnx_pair(num_kv_heads=num_kv_heads)
  _assert_same_params(ours, ref)  # A drop-in: same names, shapes, values.
  causal = setting in ("causal", "both")
  mask = PADDING_MASK if setting in ("padding", "both") else None
  cot = jax.random.normal(jax.random.key(1), (B, T, D))

  @nnx.jit
  def loss_and_grads(module):
    def loss(m):
      out = _valid_rows(m(X, mask=mask, is_causal=causal), mask)
      return jnp.sum(out * cot), out
    return nnx.value_and_grad(loss, has_aux=True)(module)

  (_, out), grads = loss_and_grads(ours)
  (_, ref_out), ref_grads = loss_and_grads(ref)
  assert relative_error(out, ref_out) <= TOL.out
  _assert_close_grads(grads, ref_grads)


def test_attention_fn_drop_in_and_extra_batch_dims():
  x = jax.random.normal(jax.random.key(2), (2, 3, T, D))
  ref = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False,
                               rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(
      num_heads=4, in_features=D, decode=False, rngs=nnx.Rngs(0),
      attention_fn=lambda *a, **k: jax_flash.nnx.dot_product_attention(
          *a, implementation=KERNEL_IMPL, **k))
  mask = nnx.make_causal_mask(jnp.ones((2, 3, T)))  # [2, 3, 1, T, T]
  assert relative_error(ours(x, mask=mask), ref(x, mask=mask)) <= TOL.out


def test_sow_weights_falls_back_to_flax():
  ours, ref = _nnx_pair()
  out = ours(X, sow_weights=True)
  assert relative_error(out, ref(X)) <= TOL.out


def test_nnx_decode_with_kv_cache_matches_causal_forward():
  ours, _ = _nnx_pair(num_kv_heads=2)
  full = ours(X, is_causal=True)
  ours.init_cache((B, T, D))
  steps = [ours(X[:, i:i + 1], decode=True) for i in range(9)]
  assert relative_error(jnp.concatenate(steps, axis=1), full[:, :9]) <= (
      TOL.out)


def test_nnx_dropout_trains_and_is_off_when_deterministic():
  ours, _ = _nnx_pair(dropout_rate=0.3)
  a = ours(X, deterministic=False, rngs=nnx.Rngs(dropout=1))
  b = ours(X, deterministic=True)
  c = ours(X, deterministic=True)
  assert relative_error(a, b) > 0.01
  np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("causal", [False, True])
def test_linen_module_matches_flax(causal):
  ref = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
  ours = jax_flash.linen.FlashAttention(num_heads=4, qkv_features=64,
                                        is_causal=causal,
                                        implementation=KERNEL_IMPL)
  params = ref.init(jax.random.key(3), X)
  assert jax.tree.structure(params) == jax.tree.structure(
      ours.init(jax.random.key(3), X))
  mask = nn.make_causal_mask(jnp.ones((B, T))) if causal else None
  cot = jax.random.normal(jax.random.key(4), (B, T, D))

  def loss(p, module, **kw):
    return jnp.sum(module.apply(p, X, **kw) * cot)

  grads = jax.jit(jax.grad(lambda p: loss(p, ours)))(params)
  ref_grads = jax.jit(jax.grad(lambda p: loss(p, ref, mask=mask)))(params)
  assert relative_error(ours.apply(params, X),
                        ref.apply(params, X, mask=mask)) <= TOL.out
  _assert_close_grads(grads, ref_grads)


def test_linen_attention_fn_with_padding_mask():
  ref = nn.MultiHeadDotProductAttention(num_heads=4)
  # linen passes only the keywords the function's signature names: a partial
  # keeps them, a lambda(*a, **k) would get none.
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=functools.partial(
          jax_flash.linen.dot_product_attention, implementation=KERNEL_IMPL))
  params = ref.init(jax.random.key(5), X)
  mask = nn.make_attention_mask(VALID, VALID)
  out = _valid_rows(ours.apply(params, X, mask=mask), mask)
  ref_out = _valid_rows(ref.apply(params, X, mask=mask), mask)
  assert relative_error(out, ref_out) <= TOL.out


def _tiny_model(seed=0):
  return train_lm.LanguageModel(vocab=20, max_len=32, d_model=64, layers=2,
                                heads=4, kv_heads=2,
                                implementation=KERNEL_IMPL,
                                rngs=nnx.Rngs(seed))


def test_training_step_lowers_the_loss():
  model = _tiny_model()
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jax.random.randint(jax.random.key(6), (4, 33), 0, 20)
  before = float(train_lm.eval_step(model, tokens))
  for _ in range(3):
    train_lm.train_step(model, optimizer, tokens)
  assert float(train_lm.eval_step(model, tokens)) < before - 0.05


def test_checkpoint_round_trip(tmp_path):
  model, other = _tiny_model(0), _tiny_model(1)
  tokens = jax.random.randint(jax.random.key(7), (2, 33), 0, 20)
  assert float(train_lm.eval_step(model, tokens)) != float(
      train_lm.eval_step(other, tokens))
  path = str(tmp_path / "params.msgpack")
  train_lm.save_params(model, path)
  train_lm.load_params(other, path)
  _assert_same_params(other, model)
  assert float(train_lm.eval_step(model, tokens)) == float(
      train_lm.eval_step(other, tokens))


def test_generation_uses_the_cache_and_matches_full_forward():
  model = _tiny_model()
  prompt = np.array([[1, 2, 3]], np.int32)
  sample = train_lm.generate(model, prompt, 5, 1e-4, 0)  # ~greedy
  assert len(sample) == 8 and sample[:3] == [1, 2, 3]
  model = _tiny_model()  # Fresh, no cache: the full causal forward.
  logits = model(jnp.asarray([sample[:-1]]), jnp.arange(7)[None])
  assert list(np.asarray(jnp.argmax(logits[0, 2:], -1))) == sample[3:]


def test_cudnn_comparison_model_samples_with_the_cache():
  """train_lm --implementation cudnn: flax's attention with jax.nn's kernel;
  sampling passes flax's cache mask (in the computation's dtype) to jax.nn,
  which wants it boolean."""
  model = train_lm.LanguageModel(vocab=20, max_len=16, d_model=32, layers=1,
                                 heads=2, kv_heads=2, implementation="cudnn",
                                 rngs=nnx.Rngs(0))
  sample = train_lm.generate(model, np.array([[1, 2]], np.int32), 4, 1e-4, 0)
  assert len(sample) == 6 and sample[:2] == [1, 2]


def test_nnx_decode_feeds_several_tokens_at_once(monkeypatch):
  calls = []
  real = jax_flash.nnx.flash_decode
  monkeypatch.setattr(jax_flash.nnx, "flash_decode",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  ours, _ = _nnx_pair(num_kv_heads=2)
  full = ours(X, is_causal=True)
  ours.init_cache((B, T, D))
  chunks = [ours(X[:, i:i + 5], decode=True) for i in range(0, T, 5)]
  assert relative_error(jnp.concatenate(chunks, axis=1), full) <= TOL.out
  assert len(calls) == len(chunks)  # The cache was read by flash_decode.


def test_linen_swap_keeps_flax_parameter_names_and_checkpoint(tmp_path):
  """A compact linen model written with flax's attention saves a checkpoint;
  the same model with FlashAttention swapped in (automatic naming, no
  `name=`) loads it and computes the same function."""
  from flax import serialization

  def model(attention_cls):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = attention_cls(num_heads=4, qkv_features=64)(x)
        return attention_cls(num_heads=4, qkv_features=64)(x)
    return Model()

  flax_model = model(nn.MultiHeadDotProductAttention)
  ours = model(functools.partial(jax_flash.linen.FlashAttention,
                                 implementation=KERNEL_IMPL))
  params = flax_model.init(jax.random.key(8), X)
  path = tmp_path / "params.msgpack"
  path.write_bytes(serialization.to_bytes(params))
  template = ours.init(jax.random.key(9), X)
  assert jax.tree.structure(template) == jax.tree.structure(params)
  assert set(params["params"]) == {"MultiHeadDotProductAttention_0",
                                   "MultiHeadDotProductAttention_1"}
  loaded = serialization.from_bytes(template, path.read_bytes())
  assert relative_error(ours.apply(loaded, X),
                        flax_model.apply(params, X)) <= TOL.out


def test_nnx_sinks_parameter_trains_and_matches_the_reference():
  ours = jax_flash.nnx.FlashAttention(num_heads=4, in_features=D,
                                      qkv_features=64, num_kv_heads=2,
                                      decode=False, sinks=True,
                                      implementation=KERNEL_IMPL,
                                      rngs=nnx.Rngs(0))
  ours.sinks[...] = jnp.array([-1.0, 0.0, 1.0, 3.0])
  cot = jax.random.normal(jax.random.key(14), (B, T, D))

  def manual(m, sinks):  # The projections, then the reference with sinks.
    q = m.query(X)
    k, v = m.key(X), m.value(X)
    out = jax_flash.reference_attention(q, k, v, is_causal=True, sinks=sinks)
    return jnp.sum(m.out(out) * cot)

  @nnx.jit
  def loss_and_grads(m):
    return nnx.value_and_grad(lambda m: jnp.sum(m(X, is_causal=True) * cot))(m)

  value, grads = loss_and_grads(ours)
  ref_value, ref_dsinks = jax.value_and_grad(manual, argnums=1)(
      ours, ours.sinks[...])
  assert abs(float(value) - float(ref_value)) <= TOL.out * abs(float(ref_value))
  assert relative_error(grads["sinks"][...], ref_dsinks) <= TOL.grad
  # Decoding with the cache uses the same sinks.
  full = ours(X, is_causal=True)
  ours.init_cache((B, T, D))
  steps = [ours(X[:, i:i + 9], decode=True) for i in range(0, T, 9)]
  assert relative_error(jnp.concatenate(steps, axis=1), full) <= TOL.out


def test_linen_sinks_parameter_trains_and_matches_the_reference():
  ours = jax_flash.linen.FlashAttention(num_heads=4, qkv_features=64,
                                        sinks=True, is_causal=True,
                                        implementation=KERNEL_IMPL)
  params = ours.init(jax.random.key(3), X)["params"]
  assert params["sinks"].shape == (4,) and not params["sinks"].any()
  params = dict(params, sinks=jnp.array([-1.0, 0.0, 1.0, 3.0]))
  cot = jax.random.normal(jax.random.key(15), (B, T, D))

  def manual(p):  # The projections, then the reference with sinks.
    q, k, v = (jnp.einsum("btd,dnh->btnh", X, p[n]["kernel"]) + p[n]["bias"]
               for n in ("query", "key", "value"))
    out = jax_flash.reference_attention(q, k, v, is_causal=True,
                                        sinks=p["sinks"])
    out = jnp.einsum("btnh,nhd->btd", out, p["out"]["kernel"])
    return jnp.sum((out + p["out"]["bias"]) * cot)

  loss = jax.jit(jax.value_and_grad(
      lambda p: jnp.sum(ours.apply({"params": p}, X) * cot)))
  (value, grads), (ref_value, ref_grads) = loss(params), jax.value_and_grad(
      manual)(params)
  assert abs(float(value) - float(ref_value)) <= TOL.out * abs(float(ref_value))
  assert relative_error(grads["sinks"], ref_grads["sinks"]) <= TOL.grad
  assert relative_error(grads["query"]["kernel"],
                        ref_grads["query"]["kernel"]) <= TOL.grad
  # Without sinks=True the module has flax's parameters only.
  plain = jax_flash.linen.FlashAttention(num_heads=4, qkv_features=64)
  assert "sinks" not in plain.init(jax.random.key(3), X)["params"]


def test_linen_sinks_in_cached_decoding():
  """linen's decode=True cache (one token a call, its own mask) attends with
  the same sinks as the full causal call."""
  params = jax_flash.linen.FlashAttention(
      num_heads=4, qkv_features=64, sinks=True, is_causal=True).init(
          jax.random.key(3), X)["params"]
  params = dict(params, sinks=jnp.array([-1.0, 0.0, 1.0, 3.0]))
  full = jax_flash.linen.FlashAttention(
      num_heads=4, qkv_features=64, sinks=True, is_causal=True).apply(
          {"params": params}, X)
  decoder = jax_flash.linen.FlashAttention(num_heads=4, qkv_features=64,
                                           sinks=True, decode=True)
  cache = decoder.init(jax.random.key(3), X)["cache"]
  steps = []
  for i in range(T):
    out, update = decoder.apply({"params": params, "cache": cache},
                                X[:, i:i + 1], mutable=["cache"])
    cache = update["cache"]
    steps.append(out)
  assert relative_error(jnp.concatenate(steps, axis=1), full) <= TOL.out


def test_modules_reachable_from_the_package_and_flax_imported_lazily():
  import subprocess
  import sys
  code = ("import sys, jax_flash; assert 'flax' not in sys.modules; "
          "jax_flash.nnx.FlashAttention; jax_flash.linen.FlashAttention; "
          "assert 'flax' in sys.modules")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_modules_check_their_options_when_built(kind):
  build = {
      "nnx": lambda **kw: jax_flash.nnx.FlashAttention(
          num_heads=2, in_features=8, rngs=nnx.Rngs(0), **kw),
      "linen": lambda **kw: jax_flash.linen.FlashAttention(num_heads=2, **kw),
  }[kind]
  with pytest.raises(ValueError, match="implementation must be one of"):
    build(implementation="cuda")
  with pytest.raises(ValueError, match="block_sizes must be"):
    build(block_sizes=64)
  with pytest.raises(ValueError, match="context_parallel must be one of"):
    build(context_parallel="ulysses")


def test_linen_module_is_named_as_flax_names_its_own_and_reports_its_class():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      ours = jax_flash.linen.FlashAttention(num_heads=2, implementation="xla")
      return ours(x) + nn.MultiHeadDotProductAttention(num_heads=2)(x)

  params = Model().init(jax.random.key(0), jnp.ones((1, 4, 32)))["params"]
  assert sorted(params) == ["MultiHeadDotProductAttention_0",
                            "MultiHeadDotProductAttention_1"]
  assert type(jax_flash.linen.FlashAttention(num_heads=2)).__name__ == (
      "FlashAttention")
