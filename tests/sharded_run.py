"""Run by tests/test_sharding.py in a fresh process with 8 host devices.

A scenario runs each of its cases in `failures.case(...)`, which records a
failing case and goes on, and ends with `failures.report`, which raises
once listing every failing case (or prints that all matched)."""
import contextlib
import os
import re
import sys
import traceback
import typing
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash.core.options import STRATEGIES  # noqa: E402
from jax_flash.testing import relative_error, tolerance  # noqa: E402
from tests.cases import random_inputs  # noqa: E402


class Failures:
  """The failing cases of this process's scenario."""

  def __init__(self):
    self.failed = []

  @contextlib.contextmanager
  def case(self, *labels):
    """Runs the `with` body as one case: a failure is recorded, not raised."""
    try:
      yield
    except Exception as e:  # Recorded; `report` raises.
      traceback.print_exc(limit=4)
      name = " ".join(_label(x) for x in labels)
      self.failed.append(f"{name}: {type(e).__name__}: {str(e)[:600]}")

  def report(self, success: str):
    if self.failed:
      raise AssertionError(f"{len(self.failed)} failing cases:\n"
                           + "\n".join(self.failed))
    print(success)


def _label(x) -> str:
  """A case's label: arrays by dtype and shape, others by a short repr."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{x.dtype}{list(x.shape)}"
  if callable(x):
    return getattr(x, "__name__", type(x).__name__)
  if isinstance(x, dict):
    return "{" + ", ".join(f"{k}={_label(v)}" for k, v in x.items()) + "}"
  return repr(x)[:80]


failures = Failures()


def _assert_refused(lower_call, strategy: str, why: str):
  """lower_call() raises a ValueError as the call traces, naming `strategy`
  as unable to run the call, saying `why` and what can."""
  try:
    lower_call()
  except ValueError as e:
    assert f"context_parallel={strategy!r} cannot run this call" in str(e)
    assert why in str(e) and "Strategies that can: " in str(e), str(e)
  else:
    raise AssertionError(f"{strategy} ran where it should say: {why}")


def _assert_falls_back(call, args, reference, strategy: str, why: str):
  """call(*args) (a strategy named that cannot run the arguments'
  sharding) warns, naming `strategy` and saying `why`, and gives
  `reference` (one device's result) by another strategy."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = call(*args)
  said = [str(w.message) for w in caught
          if f"context_parallel={strategy!r} cannot run" in str(w.message)]
  assert said and why in said[0] and "instead" in said[0], said
  assert relative_error(out, reference) <= tolerance(jnp.float32).out


def main(num_kv_heads):
  assert jax.device_count() == 8
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  b, t, n, h = 4, 96, 8, 32
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h))
  k = jax.random.normal(keys[1], (b, t, num_kv_heads, h))
  v = jax.random.normal(keys[2], (b, t, num_kv_heads, h))
  do = jax.random.normal(keys[3], (b, t, n, h))

  def loss(q, k, v):
    out = jax_flash.flash_attention(q, k, v, is_causal=True,
                                    implementation="interpret")
    return jnp.sum(out * do), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  (_, out), grads = jax.jit(grad)(q, k, v)  # One device.
  heads = NamedSharding(mesh, P("data", None, "model", None))
  kv_spec = heads if num_kv_heads % 4 == 0 else NamedSharding(mesh, P("data"))
  qs = jax.device_put(q, heads)
  ks, vs = (jax.device_put(x, kv_spec) for x in (k, v))
  sharded = jax.jit(grad)
  hlo = sharded.lower(qs, ks, vs).compile().as_text()
  (_, out_s), grads_s = sharded(qs, ks, vs)
  gathers = hlo.count("all-gather")
  errors = [relative_error(out_s, out)] + [
      relative_error(a, b) for a, b in zip(grads_s, grads)]
  print(f"kv_heads={num_kv_heads} all-gathers={gathers} "
        f"out_sharding={out_s.sharding.spec} errors={errors}")
  assert max(errors) == 0.0, errors  # Bitwise: each shard is the same program.
  _on_explicit_axes(grad, (q, k, v), (out, *grads), num_kv_heads)
  # vmap over a leading axis (custom_partitioning needs our vmap rule).
  stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
  outs = jax.jit(jax.vmap(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, implementation="interpret")))(*stacked)
  minus = jax_flash.flash_attention(-q, -k, -v, is_causal=True,
                                    implementation="interpret")
  np.testing.assert_array_equal(outs[0], out)
  np.testing.assert_array_equal(outs[1], minus)
  # Inside shard_map (its checks of varying values on): each device's
  # block, forward and gradient, as the whole call computes it.
  per_device = jax.shard_map(
      lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=True, implementation="interpret"),
      mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  grad_q = lambda f: jax.grad(lambda q: jnp.sum(f(q, k, v) * do))(q)
  whole = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, implementation="interpret")
  np.testing.assert_array_equal(jax.jit(per_device)(q, k, v), out)
  np.testing.assert_allclose(jax.jit(lambda q: grad_q(per_device))(q),
                             grad_q(whole), rtol=1e-5, atol=1e-5)
  if num_kv_heads % 4 == 0:  # Heads shard whole GQA groups: all local.
    assert gathers == 0, gathers
    assert tuple(out_s.sharding.spec)[:3] == ("data", None, "model")
  # Sequence-sharded query, key and value (over "model"): all-to-all
  # context parallelism, no all-gather (bitwise equal to one device where
  # 4 divides the KV heads); the output left sequence-sharded.
  seq = NamedSharding(mesh, P("data", "model"))
  sharded = jax.jit(grad)
  args = [jax.device_put(x, seq) for x in (q, k, v)]
  hlo = sharded.lower(*args).compile().as_text()
  (_, out_s), grads_s = sharded(*args)
  errors = [relative_error(out_s, out)] + [
      relative_error(a, b) for a, b in zip(grads_s, grads)]
  print(f"sequence-sharded: all-gathers={hlo.count('all-gather(')} "
        f"all-to-alls={hlo.count('all-to-all(')} errors={errors}")
  assert tuple(out_s.sharding.spec)[:2] == ("data", "model")
  if num_kv_heads % 4 == 0:
    assert max(errors) == 0.0, errors
    assert hlo.count("all-gather(") == 0 and hlo.count("all-to-all(") > 0
    _module_on_a_sequence_mesh(mesh, num_kv_heads)
  else:  # 1 KV head: sent as 4 copies, one a device's query heads, its
    # dK/dV summed over them (float32 sums: within tolerance).
    assert max(errors) <= tolerance(jnp.float32).grad, errors
    assert hlo.count("all-gather(") == 0 and hlo.count("all-to-all(") > 0


def _on_explicit_axes(grad, args, expected, num_kv_heads):
  """`grad` on a mesh with Explicit axes (shardings in the arrays' types,
  `jax.make_mesh`'s default), split over batch and heads and, where 4
  divides the KV heads, over the sequence: one device's results bitwise,
  the output sharded as the query."""
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  heads = P("data", None, "model", None)
  specs = [(heads, heads if num_kv_heads % 4 == 0 else P("data"))]
  if num_kv_heads % 4 == 0:
    specs.append((P("data", "model"),) * 2)
  for q_spec, kv_spec in specs:
    q, k, v = (jax.device_put(x, NamedSharding(mesh, s))
               for x, s in zip(args, (q_spec, kv_spec, kv_spec)))
    (_, out), grads = jax.jit(grad)(q, k, v)
    errors = [relative_error(a, b) for a, b in zip((out, *grads), expected)]
    print(f"explicit axes {q_spec}: out_sharding={out.sharding.spec} "
          f"errors={errors}")
    assert max(errors) == 0.0, errors
    assert tuple(out.sharding.spec)[:3] == (tuple(q_spec) + (None,))[:3]
  # Decoding a batch-sharded cache: one device's output (within float32's
  # rounding: a device's batch may pick other KV splits), sharded as the
  # query.
  q, k, v = args[0][:, -1:], args[1], args[2]
  lengths = jnp.array([96, 50, 7, 81])
  decode = jax.jit(lambda q, k, v, lengths: jax_flash.flash_decode(
      q, k, v, kv_lengths=lengths, implementation="interpret"))
  batch = NamedSharding(mesh, P("data"))
  out = decode(*(jax.device_put(x, batch) for x in (q, k, v, lengths)))
  error = relative_error(out, decode(q, k, v, lengths))
  assert error <= tolerance(jnp.float32).out, error
  assert tuple(out.sharding.spec)[:1] == ("data",), out.sharding
  print("explicit axes: decode matches one device")


def _module_on_a_sequence_mesh(mesh, num_kv_heads):
  """nnx's FlashAttention on activations sharded along the sequence: its
  projections keep them sharded, the attention runs all-to-all, and no
  activation is gathered; the result as on one device."""
  from flax import nnx
  attn = jax_flash.nnx.FlashAttention(
      num_heads=8, num_kv_heads=num_kv_heads, in_features=32, decode=False,
      rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (4, 96, 32))
  graph, state = nnx.split(attn)
  step = jax.jit(lambda state, x: nnx.merge(graph, state)(x, is_causal=True))
  want = step(state, x)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
  hlo = step.lower(state, xs).compile().as_text()
  got = step(state, xs)
  print(f"module on a sequence mesh: all-gathers={hlo.count('all-gather(')} "
        f"all-to-alls={hlo.count('all-to-all(')} "
        f"error={relative_error(got, want)}")
  assert hlo.count("all-gather(") == 0 and hlo.count("all-to-all(") > 0
  assert relative_error(got, want) < 1e-5  # The projections: float32 sums.
  # The strategy named at construction: all_gather of K and V alone.
  attn = jax_flash.nnx.FlashAttention(
      num_heads=8, num_kv_heads=num_kv_heads, in_features=32, decode=False,
      context_parallel="all_gather", rngs=nnx.Rngs(0))
  graph, state = nnx.split(attn)
  step = jax.jit(lambda state, x: nnx.merge(graph, state)(x, is_causal=True))
  hlo = step.lower(state, xs).compile().as_text()
  got = step(state, xs)
  print(f"all_gather module: all-gathers={hlo.count('all-gather(')} "
        f"all-to-alls={hlo.count('all-to-all(')} "
        f"error={relative_error(got, want)}")
  assert hlo.count("all-gather(") == 2 and hlo.count("all-to-all(") == 0
  assert relative_error(got, want) < 1e-5


def context_parallel():
  """Each strategy and mask on a sequence-sharded mesh axis ("model", 4
  devices; batch over "data"; ring_all_to_all: the sequence over both):
  output and gradients within float32's tolerance of one device, no
  all-gather of the queries (with all_gather only K and V are gathered;
  none with all_to_all), and a strategy that cannot run the sharding
  refused by name."""
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  bound = tolerance(jnp.float32)
  seq = NamedSharding(mesh, P("data", "model"))
  layouts = {  # Keys' sharding: as the queries, whole, or (queries too)
               # the sequence over both axes.
      "seq": seq, "whole": NamedSharding(mesh, P("data")),
      "seq2": NamedSharding(mesh, P(None, ("data", "model")))}
  b, n, h = 2, 8, 32
  cases = [  # (strategy, kv heads, T, S, keys' layout, options)
      ("all_gather", 2, 96, 96, "seq", dict(is_causal=True)),
      ("all_gather", 2, 96, 96, "seq", {}),
      ("all_gather", 2, 96, 96, "seq", dict(local_window_size=(20, 5),
                                            logits_soft_cap=5.0)),
      ("all_gather", 2, 64, 128, "seq", dict(is_causal=True)),  # T != S
      ("auto", 2, 96, 72, "whole", dict(is_causal=True)),  # Whole keys.
      ("auto", 1, 96, 96, "seq", dict(is_causal=True, scale=0.3)),
      ("all_to_all", 4, 96, 96, "seq", dict(local_window_size=(20, 5))),
      # Fewer KV heads than devices: each sent as copies, one a device's
      # query heads (4 of 1, 2 of 2), dK/dV summed over them.
      ("all_to_all", 1, 96, 96, "seq", dict(is_causal=True)),
      ("all_to_all", 2, 96, 96, "seq", dict(local_window_size=(20, 5),
                                            logits_soft_cap=5.0)),
      # Queries at offsets of their own: added to each chunk's.
      ("all_gather", 2, 96, 96, "seq", dict(
          is_causal=True, query_offset=jnp.array([5, 40]),
          alibi_slopes=jnp.linspace(0.1, 0.8, 8))),
      ("all_to_all", 4, 96, 96, "seq", dict(is_causal=True,
                                            query_offset=jnp.array([5, 40]))),
      ("ring", 2, 96, 96, "seq", dict(is_causal=True)),
      ("ring", 4, 96, 96, "seq", dict(logits_soft_cap=5.0)),
      # Sliding windows over chunks of 24: keys 30 back lie in 3 of the 4
      # chunks (a query's own and 2 before), 20 back in 2; the ring's
      # steps past them are not run.
      ("ring", 2, 96, 96, "seq", dict(is_causal=True,
                                      local_window_size=(30, 0))),
      ("ring", 4, 96, 96, "seq", dict(local_window_size=(20, 0),
                                      logits_soft_cap=5.0)),
      # The sequence over both axes (8 chunks): all_to_all over "model" (4
      # KV heads, one a device), a ring over "data" of blocks; "auto"
      # picks all_to_all over all 8 (each KV head sent as 2 copies: it
      # sends the least).
      ("ring_all_to_all", 4, 128, 128, "seq2", dict(is_causal=True)),
      ("ring_all_to_all", 4, 128, 128, "seq2",
       dict(local_window_size=(40, 0))),
      ("ring_all_to_all", 4, 128, 128, "seq2", dict(logits_soft_cap=5.0)),
      ("auto", 4, 128, 128, "seq2", dict(is_causal=True)),
      ("ring_all_to_all", 2, 128, 128, "seq2", dict(is_causal=True)),
  ]
  for strategy, kv_heads, t, s, layout, options in cases:
    with failures.case(strategy, kv_heads, t, s, layout, options):
      q, k, v, do = random_inputs(b, t, s, n, kv_heads, h, jnp.float32,
                                  seed=t + s + kv_heads)

      def loss(q, k, v):
        out = jax_flash.flash_attention(q, k, v, context_parallel=strategy,
                                        **options)
        return jnp.sum(out * do), out

      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
      (_, out), grads = grad(q, k, v)
      q_spec = layouts["seq2" if layout == "seq2" else "seq"]
      args = [jax.device_put(q, q_spec)] + [jax.device_put(x, layouts[layout])
                                            for x in (k, v)]
      hlo = grad.lower(*args).compile().as_text()
      (_, out_s), grads_s = grad(*args)
      errors = [relative_error(out_s, out)] + [
          relative_error(x, y) for x, y in zip(grads_s, grads)]
      gathered = [line.split("=")[1].split()[0] for line in hlo.splitlines()
                  if " all-gather(" in line]
      print(f"context_parallel={strategy} kv_heads={kv_heads} T={t} S={s} "
            f"keys {layout} {options}: all-gathers {gathered} "
            f"all-to-alls={hlo.count('all-to-all(')} "
            f"permutes={hlo.count('collective-permute(')} errors={errors}")
      assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors
      assert out_s.sharding.is_equivalent_to(q_spec, 4), out_s.sharding
      if strategy == "auto":  # all_to_all where the keys are split.
        strategy = "all_gather" if layout == "whole" else "all_to_all"
      assert (hlo.count("all-to-all(") > 0) == (
          strategy in ("all_to_all", "ring_all_to_all"))
      if strategy == "all_to_all":
        # Head-sized exchanges: Q, K, V in and O out, then Q, K, V, dO in and
        # dQ, dK, dV out; D = rowsum(dO * O) travels in O's place.
        moved = [re.search(r"\w+\[[\d,]*\]", line.split("=", 1)[1])[0]
                 for line in hlo.splitlines() if " all-to-all(" in line]
        assert sum(x.endswith(f",{h}]") for x in moved) == 11, moved
      # Only K and V are gathered ([1, S, kv heads, H]), and only by
      # all_gather when the keys are sharded.
      want = [f"f32[1,{s},{kv_heads},{h}]"] * 4 if (
          strategy == "all_gather" and layout != "whole") else []
      assert [g.split("{")[0] for g in gathered] == want, gathered
      if strategy.startswith("ring") or (options.get("is_causal")
                                         and strategy == "all_gather"):
        # The ring's steps; balanced halves.
        assert hlo.count("collective-permute(") > 0
      if strategy == "ring" and "local_window_size" in options:
        # The backward's loop runs one step a key chunk the window reaches.
        trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"',
                                            hlo)]
        reach = options["local_window_size"][0]
        assert max(trips) == (reach - 1) // (t // 4) + 2, trips
  _fp8_context_parallel(mesh, seq, bound)
  q_one, kv_one, _, _ = random_inputs(b, 96, 96, 6, 1, h, jnp.float32,
                                      seed=8)
  q, kv = (jax.device_put(x, seq) for x in (q_one, kv_one))
  # Refused whatever the sharding: a ValueError as the call traces.
  for strategy, options, why in (
      ("ring", dict(local_window_size=8), "ring runs causal or full masks"),
      ("ring_all_to_all", dict(local_window_size=8),
       "ring runs causal or full masks"),
      ("ring", dict(mask=jnp.ones((96, 96), bool)), "ring runs no mask."),
      ("ring_all_to_all", dict(bias=jnp.zeros((96, 96))),
       "ring_all_to_all runs no bias.")):
    with failures.case(strategy, options, why):
      _assert_refused(
          lambda: jax.jit(lambda q, k: jax_flash.flash_attention(
              q, k, k, context_parallel=strategy, **options)).lower(q, kv),
          strategy, why)
  # Refused by the sharding (known in XLA's partitioner): a warning, and
  # the cheapest strategy that can run it runs it.
  reference = jax_flash.flash_attention(q_one, kv_one, kv_one,
                                        implementation="xla")
  for strategy, why in (
      ("all_to_all", "the 6 query heads a device holds do not split "
       "into whole groups of its 1 KV heads over the 4 devices"),
      ("ring_all_to_all", "needs the sequence sharded over several mesh")):
    with failures.case(strategy, why):
      _assert_falls_back(jax.jit(lambda q, k: jax_flash.flash_attention(
          q, k, k, context_parallel=strategy, implementation="xla")),
                         (q, kv), reference, strategy, why)
  failures.report("context_parallel: every case matches one device")


def all_to_all_forward_one_block():
  """A forward alone over sequence chunks whose whole sequence is one
  block of the blockwise path: XLA's CPU compiler (jax 0.11.2) hung
  inlining its one-trip loop in the program custom_partitioning builds
  (in a fresh process: the first compile). It compiles and matches one
  device."""
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  q, k, v, _ = random_inputs(2, 128, 128, 8, 4, 32, jnp.float32, seed=3)
  forward = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, context_parallel="all_to_all"))
  chunks = NamedSharding(mesh, P(None, "model"))
  error = relative_error(
      forward(*(jax.device_put(x, chunks) for x in (q, k, v))),
      forward(q, k, v))
  print(f"all_to_all forward alone at 128 tokens: error={error}")
  assert error <= tolerance(jnp.float32).out, error


def _fp8_context_parallel(mesh, seq, bound):
  """fp8=True sequence-sharded: its e4m3 operands (`Operands.fp8_q`, ...)
  split with the queries and keys (all_gather, all_to_all; on the CPU the
  blockwise path does not read them, and XLA drops their collectives),
  and the result is one device's; a ring, whose pairs would not get
  them, is refused by name."""
  b, n, kv_heads, h = 2, 8, 4, 32
  q, k, v, do = random_inputs(b, 96, 96, n, kv_heads, h, jnp.float32, seed=7)
  for strategy, options in (("all_gather", dict(is_causal=True)),
                            ("all_to_all", {})):
    with failures.case(strategy, options):
      def loss(q, k, v):
        out = jax_flash.flash_attention(q, k, v, context_parallel=strategy,
                                        fp8=True, **options)
        return jnp.sum(out * do), out

      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
      (_, out), grads = grad(q, k, v)
      args = [jax.device_put(x, seq) for x in (q, k, v)]
      hlo = grad.lower(*args).compile().as_text()
      (_, out_s), grads_s = grad(*args)
      errors = [relative_error(out_s, out)] + [
          relative_error(x, y) for x, y in zip(grads_s, grads)]
      print(f"fp8 context_parallel={strategy} {options}: errors={errors}")
      assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors
      if strategy == "all_gather":
        assert f"f32[1,96,{kv_heads},{h}]" in "".join(
            line for line in hlo.splitlines() if " all-gather(" in line)
      else:
        assert "all-gather(" not in hlo and hlo.count("all-to-all(") > 0
  _assert_refused(
      lambda: jax.jit(lambda q, k, v: jax_flash.flash_attention(
          q, k, v, fp8=True, is_causal=True, context_parallel="ring")).lower(
              *(jax.device_put(x, seq) for x in (q, k, v))),
      "ring", "ring runs no fp8.")


def _operand_setup():
  """The mesh (2 x 4: "data", "model"), shardings and optional operands
  `operands` and `operands_by_strategy` share."""
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  bound = tolerance(jnp.float32)
  b, t, n, kv_heads, h = 2, 64, 4, 4, 32
  q, k, v, do = random_inputs(b, t, t, n, kv_heads, h, jnp.float32, seed=3)
  keys = jax.random.split(jax.random.key(4), 4)
  segments = jnp.sort(jax.random.randint(keys[0], (b, t), 0, 3), axis=1)
  full_bias = jax.random.normal(keys[1], (b, n, t, t))
  dense = jax.random.bernoulli(keys[2], 0.8, (b, 1, t, t))
  per_head = jax.random.bernoulli(keys[3], 0.7, (b, n, t, t))
  shared_bias = jax.random.normal(keys[3], (1, 1, t, t))
  causal = jax_flash.create_block_mask(lambda bb, hh, qi, ki: qi >= ki,
                                       None, None, t, t)
  heads = NamedSharding(mesh, P("data", None, "model", None))
  seq = NamedSharding(mesh, P("data", "model"))
  sinks = jnp.linspace(-1.0, 1.0, n)
  return dict(mesh=mesh, bound=bound, b=b, t=t, n=n, h=h, q=q, k=k, v=v,
              do=do, keys=keys, segments=segments, full_bias=full_bias,
              dense=dense, per_head=per_head, shared_bias=shared_bias,
              causal=causal, heads=heads, seq=seq, sinks=sinks)


def operands():
  """Calls with optional operands (ids, lengths, sinks, ALiBi, a bias and
  a dense mask, flex's tile kinds, dropout) on inputs sharded over batch
  ("data") and heads ("model"): each device runs its shard, every operand
  split along its own batch and head dims (none gathered), gradients of
  operands that broadcast over a split summed across it; results as on
  one device, dropout's keep bits too (its seed shifted to each device's
  place). Sequence-sharded ("model"), all_to_all with ids, ALiBi, sinks,
  dropout, a dense mask and a bias (per head, or shared: its gradient
  summed and cut back to chunks). (A mod reading the batch or head index
  keeps the call whole: tests/test_sharding.py finds such mods.)"""
  env = _operand_setup()
  (mesh, bound, b, n, q, k, v, do, segments, full_bias, dense, per_head,
   shared_bias, causal, heads, seq, sinks) = (env[name] for name in (
       "mesh", "bound", "b", "n", "q", "k", "v", "do", "segments",
       "full_bias", "dense", "per_head", "shared_bias", "causal", "heads",
       "seq", "sinks"))
  def call(options, implementation="interpret"):
    """The kernels interpreted where they handle an operand's split
    themselves (ids, lengths, ALiBi, dropout's bits, a dense mask's
    tiles), else the blockwise path ("xla": the same split, compiled in
    a third of the time)."""
    return lambda q, k, v, x: jax_flash.flash_attention(
        q, k, v, implementation=implementation, **options(x))
  segments_sinks_alibi_dropout = call(lambda x: dict(
      is_causal=True, segment_ids=segments, sinks=x,
      alibi_slopes=jnp.linspace(0.01, 0.3, b * n).reshape(b, n),
      dropout_rate=0.3, dropout_rng=jax.random.key(5)))
  cases = [  # (name, fn(q, k, v, x), x (differentiated), q/k/v's sharding,
             #  x's spec, whether no [.., .., .., ..] array is gathered)
      ("segments_sinks_alibi_dropout", segments_sinks_alibi_dropout, sinks,
       heads, P("model"), True),
      ("lengths_softcap_bias_mask", call(lambda x: dict(
          query_seq_lengths=jnp.array([64, 7]),
          key_value_seq_lengths=jnp.array([30, 61]), logits_soft_cap=5.0,
          bias=x, mask=dense)),
       full_bias, heads, P("data", "model"), True),
      ("shared_bias", call(lambda x: dict(bias=x, is_causal=True), "xla"),
       shared_bias, heads, P(), True),
      ("flex_positions", lambda q, k, v, x: jax_flash.flex_attention(
          q, k, v, score_mod=lambda s, bb, hh, qi, ki: s - 0.05 * abs(qi - ki),
          block_mask=causal, implementation="interpret"),
       jnp.zeros(()), heads, P(), True),
      ("sequence: segments_sinks_alibi_dropout", segments_sinks_alibi_dropout,
       sinks, seq, P(), True),
      # A dense mask (all_to_all), shared by the heads or per head.
      ("sequence: dense mask and ids", call(lambda x: dict(
          mask=dense, segment_ids=segments, sinks=x), "xla"), sinks, seq,
       P(), True),
      ("sequence: dense mask per head, causal", call(lambda x: dict(
          mask=per_head, is_causal=True, sinks=x)), sinks, seq, P(), True),
      # A bias (all_to_all): per head, and shared by the heads and the
      # batch (its gradient's partials summed and cut back to chunks).
      ("sequence: bias and dense mask", call(lambda x: dict(
          bias=x, mask=dense), "xla"), full_bias, seq, P(), True),
      ("sequence: shared bias, causal", call(lambda x: dict(
          bias=x, is_causal=True), "xla"), shared_bias, seq, P(), True),
  ]
  for name, fn, x, sharding, x_spec, split in cases:
    with failures.case(name, fn, x, sharding, x_spec, split):
      def loss(q, k, v, x):
        out = fn(q, k, v, x)
        return jnp.sum(out * do), out

      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                        has_aux=True))
      (_, out), grads = grad(q, k, v, x)
      args = [jax.device_put(a, sharding) for a in (q, k, v)] + [
          jax.device_put(x, NamedSharding(mesh, x_spec))]
      hlo = grad.lower(*args).compile().as_text()
      (_, out_s), grads_s = grad(*args)
      errors = [relative_error(out_s, out)] + [
          relative_error(a, c) for a, c in zip(grads_s, grads)
          if jnp.any(c != 0)]
      gathered = [line.split("=")[1].split()[0] for line in hlo.splitlines()
                  if " all-gather(" in line]
      print(f"operands {name}: all-gathers {gathered} "
            f"all-to-alls={hlo.count('all-to-all(')} errors={errors}")
      assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors
      # Ids ([B, T] int32), the sinks' gradient ([N]) and a dense mask or
      # bias shared by the heads ([.., 1, T, S]; all_to_all: each device needs
      # every head's rows) may be gathered (sequence-sharded); no query, key,
      # value or per-head bias.
      tensors = [g for g in gathered if g.split("{")[0].count(",") >= 3
                 and not g.split("[")[1].split(",")[1] == "1"]
      assert (not tensors) == split, (name, gathered)
      if sharding is seq:
        assert (hlo.count("all-to-all(") > 0) == split, name
  failures.report("operands: every case matches one device")


def operands_by_strategy():
  """Sequence-sharded calls with optional operands, each strategy named:
  all_gather with ids, ALiBi, sinks, a bias, dropout and a dense mask,
  ring with ids, sinks and dropout; results as on one device, with the
  collectives each strategy promises."""
  env = _operand_setup()
  mesh, bound, b, t, n, h, keys, segments, dense, per_head, seq, sinks = (
      env[name] for name in ("mesh", "bound", "b", "t", "n", "h", "keys",
                             "segments", "dense", "per_head", "seq",
                             "sinks"))
  # all_gather with ids, ALiBi and sinks (2 KV heads) named (causal:
  # balanced halves); "auto" chooses all_to_all (each KV head sent as 2
  # copies over the sequence's 4 devices: it sends the least, the ids
  # gathered whole). Ring with ids and sinks, and ALiBi (each pair at its
  # queries' offset from its keys). all_gather with a bias sharded along the
  # queries (its rows cut with the queries, every key's column on each
  # device): not gathered, its gradient sharded so. all_gather with dropout.
  q, k, v, do = random_inputs(b, t, t, n, 2, h, jnp.float32, seed=6)
  alibi = jnp.linspace(0.01, 0.3, b * n).reshape(b, n)
  rows = NamedSharding(mesh, P("data", None, "model", None))
  # (strategy, options(x), x, x's sharding, implementation): the kernels
  # interpreted where their own handling of an operand is split (ids and
  # offsets, dropout's bits, a dense mask's tiles), else the blockwise
  # path (the same split; it compiles in a third of the time).
  sequence_cases = [
      ("all_gather", lambda x: dict(is_causal=True, segment_ids=segments,
                                    sinks=x, alibi_slopes=alibi),
       sinks, None, "interpret"),
      ("auto", lambda x: dict(segment_ids=segments, sinks=x,
                              alibi_slopes=alibi), sinks, None, "xla"),
      ("ring", lambda x: dict(is_causal=True, segment_ids=segments, sinks=x),
       sinks, None, "interpret"),
      ("ring", lambda x: dict(segment_ids=segments, sinks=x),
       sinks, None, "xla"),
      ("ring", lambda x: dict(is_causal=True, segment_ids=segments, sinks=x,
                              alibi_slopes=alibi), sinks, None, "interpret"),
      ("ring", lambda x: dict(sinks=x, alibi_slopes=alibi, dropout_rate=0.3,
                              dropout_rng=jax.random.key(8)),
       sinks, None, "xla"),
      # Dropout on a ring: each pair's bits drawn at its rows and columns
      # in the whole sequence (balanced halves when causal; a window's
      # pairs at query offsets).
      ("ring", lambda x: dict(is_causal=True, segment_ids=segments, sinks=x,
                              dropout_rate=0.3,
                              dropout_rng=jax.random.key(5)),
       sinks, None, "interpret"),
      ("ring", lambda x: dict(sinks=x, dropout_rate=0.3,
                              dropout_rng=jax.random.key(6)),
       sinks, None, "xla"),
      ("ring", lambda x: dict(is_causal=True, local_window_size=(20, 0),
                              sinks=x, dropout_rate=0.3,
                              dropout_rng=jax.random.key(7)),
       sinks, None, "xla"),
      # Lengths on a ring: rows past them zeroed first, their pad ids
      # matching no other.
      ("ring", lambda x: dict(is_causal=True, sinks=x,
                              query_seq_lengths=jnp.array([t - 5, t // 2]),
                              key_value_seq_lengths=jnp.array([t, t // 2])),
       sinks, None, "xla"),
      ("ring", lambda x: dict(segment_ids=segments, sinks=x,
                              query_seq_lengths=jnp.array([t, 37]),
                              key_value_seq_lengths=jnp.array([50, t])),
       sinks, None, "xla"),
      ("all_gather", lambda x: dict(is_causal=True, bias=x),
       jax.random.normal(keys[1], (b, n, t, t)), rows, "xla"),
      # Dropout: the keep bits of the queries' positions, as on one device.
      ("all_gather", lambda x: dict(is_causal=True, segment_ids=segments,
                                    sinks=x, dropout_rate=0.3,
                                    dropout_rng=jax.random.key(5)),
       sinks, None, "interpret"),
      # Dense masks: rows cut with the queries, each chunk's tile kinds
      # taken from its rows (balanced halves when causal).
      ("all_gather", lambda x: dict(is_causal=True, mask=dense, sinks=x),
       sinks, None, "interpret"),
      ("all_gather", lambda x: dict(mask=per_head, segment_ids=segments,
                                    sinks=x), sinks, None, "xla"),
  ]
  for strategy, options, x, x_sharding, impl in sequence_cases:
    with failures.case(strategy, options, x, x_sharding, impl):
      def loss(q, k, v, x):
        out = jax_flash.flash_attention(q, k, v, implementation=impl,
                                        context_parallel=strategy, **options(x))
        return jnp.sum(out * do), out

      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                        has_aux=True))
      (_, out), grads = grad(q, k, v, x)
      args = [jax.device_put(a, seq) for a in (q, k, v)] + [
          x if x_sharding is None else jax.device_put(x, x_sharding)]
      hlo = grad.lower(*args).compile().as_text()
      (_, out_s), grads_s = grad(*args)
      errors = [relative_error(out_s, out)] + [
          relative_error(a, c) for a, c in zip(grads_s, grads)]
      gathered = [line.split("=")[1].split()[0].split("{")[0]
                  for line in hlo.splitlines() if " all-gather(" in line]
      named = sorted(options(x))
      print(f"operands sequence {strategy} {named}: all-gathers {gathered} "
            f"all-to-alls={hlo.count('all-to-all(')} errors={errors}")
      assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors
      # all_gather: K and V ([1, T, 2, H]; forward and backward) and the key
      # ids ([1, T]) gathered; ring: no array gathered, key chunks and ids
      # permuted; all_to_all ("auto"): the ids gathered, the rest
      # exchanged; never the queries.
      if strategy == "ring":
        assert not gathered and hlo.count("collective-permute(") > 0, gathered
      elif strategy == "auto":
        assert [g for g in gathered if g.count(",") >= 3] == [], gathered
        assert hlo.count("all-to-all(") > 0
      else:
        assert sorted(g for g in gathered if g.count(",") >= 3) == [
            f"f32[1,{t},2,{h}]"] * 4, gathered
        assert ("segment_ids" in named) == (f"s32[1,{t}]" in gathered)
        assert hlo.count("all-to-all(") == 0
      if x_sharding is not None:
        assert grads_s[3].sharding.is_equivalent_to(x_sharding, x.ndim)
  _all_gather_structured_mask(mesh, seq, bound)
  for strategy, options, why in (
      ("ring", dict(mask=dense), "ring runs no mask."),
      ("ring", dict(bias=dense * 1.0), "ring runs no bias.")):
    with failures.case(strategy, options, why):
      _assert_refused(
          lambda: jax.jit(lambda q: jax_flash.flash_attention(
              q, q, q, segment_ids=segments, context_parallel=strategy,
              **options)).lower(jax.device_put(q, seq)), strategy, why)
  failures.report("operands by strategy: every case matches one device")


def _all_gather_structured_mask(mesh, seq, bound):
  """all_gather with a dense mask whose 64 x 64 tiles are empty, full or
  partial by place (256 tokens: a tile row a device, two halves of one
  when causal): each chunk must take the tile kinds of its own rows."""
  b, t, n, h = 2, 256, 4, 32
  q, k, v, do = random_inputs(b, t, t, n, 2, h, jnp.float32, seed=7)
  rows, cols = jnp.arange(t)[:, None], jnp.arange(t)[None]
  mask = ((rows // 64 + cols // 64) % 3 != 0) | (rows == cols)
  mask = (mask & ~((rows % 64 == 5) & (cols // 64 == 1)))[None, None]
  for causal in (False, True):
    with failures.case(causal):
      def loss(q, k, v):
        out = jax_flash.flash_attention(
            q, k, v, implementation="interpret", context_parallel="all_gather",
            is_causal=causal, mask=mask)
        return jnp.sum(out * do), out

      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
      (_, out), grads = grad(q, k, v)
      (_, out_s), grads_s = grad(*(jax.device_put(a, seq) for a in (q, k, v)))
      errors = [relative_error(out_s, out)] + [
          relative_error(a, c) for a, c in zip(grads_s, grads)]
      print(f"operands sequence all_gather structured mask causal={causal}: "
            f"errors={errors}")
      assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors


class _OnChunks(typing.NamedTuple):
  local: object  # The shard_map'd call: (q, k, v, chunked) -> (out, lse).
  grad: object  # Jitted gradients of sum(out * dO) through `local`.
  args: tuple  # (q, k, v, chunked)
  results: tuple  # ((out, lse) chunked, (out, lse) whole, grad errors)


def _on_chunks(mesh, keys, shape, options, chunked, **strategy):
  """One call of `options` on random inputs of `shape` (B, T, N, K, H) and
  the per-chunk arrays `chunked`: inside a shard_map over "sp" with
  sequence_axis (and `strategy`'s keywords) and as the whole call on one
  device, with the relative errors of the first's gradients."""
  b, t, n, kv_heads, h = shape
  q = jax.random.normal(keys[0], (b, t, n, h))
  k = jax.random.normal(keys[1], (b, t, kv_heads, h))
  v = jax.random.normal(keys[2], (b, t, kv_heads, h))
  do = jax.random.normal(keys[3], (b, t, n, h))
  call = lambda q, k, v, c, **kw: jax_flash.flash_attention(
      q, k, v, implementation="xla", **options, **c, **kw)
  specs = jax.tree.map(
      lambda x: P(None, None, "sp") if x.ndim == 4 else P(None, "sp"),
      chunked)
  local = jax.shard_map(
      lambda q, k, v, c: call(q, k, v, c, sequence_axis="sp",
                              return_residual=True, **strategy),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (specs,),
      out_specs=(P(None, "sp"),) * 2)
  whole = jax.jit(lambda q, k, v: call(q, k, v, chunked,
                                       return_residual=True))(q, k, v)
  loss = lambda f: jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(f(q, k, v) * do), argnums=(0, 1, 2)))
  grad = loss(lambda q, k, v: local(q, k, v, chunked)[0])
  grads = loss(lambda q, k, v: call(q, k, v, chunked))(q, k, v)
  errors = [relative_error(a, w) for a, w in zip(grad(q, k, v), grads)]
  return _OnChunks(local, grad, (q, k, v, chunked),
                   (jax.jit(local)(q, k, v, chunked), whole, errors))


def sequence_axis():
  """flash_attention(..., sequence_axis="sp") inside a shard_map (its
  checks of varying values on) over 4 devices of sequence chunks: every
  feature as the whole call on one device, output, logsumexp and
  gradients within float32's tolerance (all_to_all gives each device whole
  sequences of its heads, the same arithmetic but for XLA's vectorizing
  of other shapes and, where K < 4 repeats the KV heads, their gradients
  summed in another order); the compiled program all-to-alls and gathers
  only the ids and a mask's rows; bad uses named."""
  mesh = jax.make_mesh((2, 4), ("data", "sp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  b, t, n, h = 2, 64, 8, 32
  keys = jax.random.split(jax.random.key(0), 8)
  ids = jnp.sort(jax.random.randint(keys[4], (b, t), 0, 3), axis=1)
  bias = jax.random.normal(keys[5], (b, n, t, t))
  mask = jax.random.bernoulli(keys[6], 0.8, (b, 1, t, t))
  cases = {  # name: (KV heads, options, per-chunk arrays)
      "causal_gqa_repeated": (2, dict(is_causal=True), {}),
      "segments_alibi_sinks": (8, dict(
          alibi_slopes=jnp.linspace(0.01, 0.1, n),
          sinks=jnp.linspace(-1.0, 1.0, n)), dict(segment_ids=ids)),
      "dropout_soft_cap_window": (4, dict(
          dropout_rate=0.2, dropout_rng=jax.random.key(3),
          logits_soft_cap=20.0, local_window_size=(20, 5)), {}),
      "lengths_bias_mqa": (1, dict(
          query_seq_lengths=jnp.array([64, 40]),
          key_value_seq_lengths=jnp.array([50, 64])), dict(bias=bias)),
      "mask_causal_fp8": (4, dict(is_causal=True, fp8=True),
                          dict(mask=mask)),
  }
  for name, (kv_heads, options, chunked) in cases.items():
    with failures.case(name, kv_heads, options, chunked):
      run = _on_chunks(mesh, keys, (b, t, n, kv_heads, h), options, chunked)
      (got, got_lse), (want, want_lse), errors = run.results
      hlo = jax.jit(run.local).lower(*run.args).compile().as_text()
      finite = jnp.isfinite(want_lse)  # -inf past a query length.
      np.testing.assert_array_equal(jnp.isfinite(got_lse), finite)
      out_errors = [relative_error(got, want), relative_error(
          jnp.where(finite, got_lse, 0.0), jnp.where(finite, want_lse, 0.0))]
      print(f"sequence_axis {name}: all-to-alls={hlo.count('all-to-all(')} "
            f"all-gathers={hlo.count('all-gather(')} out, lse errors="
            f"{out_errors} grad errors={errors}")
      bound = tolerance(jnp.float32)
      assert max(out_errors) <= bound.out and max(errors) <= bound.grad, (
          out_errors, errors)
      assert hlo.count("all-to-all(") >= 4
      assert hlo.count("all-gather(") == ("segment_ids" in chunked) + (
          "mask" in chunked), hlo.count("all-gather(")
  q = run.args[0]
  bad = {"sequence_axis='nope' names no axis": dict(sequence_axis="nope"),
         "context_parallel='ring_all_to_all' with sequence_axis":
             dict(sequence_axis="sp", context_parallel="ring_all_to_all")}
  for match, kw in bad.items():
    with failures.case(match, kw):
      try:
        jax.jit(jax.shard_map(
            lambda q: jax_flash.flash_attention(q, q, q, **kw), mesh=mesh,
            in_specs=P(None, "sp"), out_specs=P(None, "sp")))(q)
      except ValueError as e:
        assert match in str(e), e
      else:
        raise AssertionError(f"no error for {kw}")
  q6 = jnp.ones((b, t, 6, h))
  try:
    jax.jit(jax.shard_map(
        lambda q: jax_flash.flash_attention(q, q, q, sequence_axis="sp"),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))(q6)
  except ValueError as e:
    assert "N=6 must be a multiple of 4" in str(e), e
  else:
    raise AssertionError("no error for 6 heads on 4 devices")
  _modules_on_sequence_chunks(mesh)
  failures.report("every sequence_axis case matches one device")


def _gathered_shapes(hlo):
  """The result shapes of a compiled program's all-gathers."""
  return re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(", hlo)


def sequence_axis_strategies():
  """flash_attention(..., sequence_axis="sp", context_parallel="ring" or
  "all_gather") inside a shard_map (its checks of varying values on) over
  4 devices of sequence chunks: the strategy's per-device function inside
  the primitive, output, logsumexp and gradients within float32's
  tolerance of the whole call on one device; a ring's program gathers
  nothing (K/V chunks pass by collective-permute), all_gather's gathers K
  and V (and key ids) but never Q; what a strategy does not take named."""
  mesh = jax.make_mesh((2, 4), ("data", "sp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  b, t, n, h = 2, 64, 8, 32
  keys = jax.random.split(jax.random.key(1), 8)
  ids = jnp.sort(jax.random.randint(keys[4], (b, t), 0, 3), axis=1)
  cases = {  # name: (strategy, KV heads, options, per-chunk arrays)
      "ring_causal_gqa": ("ring", 2, dict(is_causal=True), {}),
      "ring_segments_sinks_dropout_soft_cap": ("ring", 8, dict(
          sinks=jnp.linspace(-1.0, 1.0, n), dropout_rate=0.2,
          dropout_rng=jax.random.key(3), logits_soft_cap=20.0),
                                               dict(segment_ids=ids)),
      "ring_causal_window": ("ring", 4, dict(local_window_size=(20, 0)),
                             {}),
      "all_gather_causal_gqa": ("all_gather", 2, dict(is_causal=True), {}),
      "all_gather_alibi_window_soft_cap": ("all_gather", 4, dict(
          alibi_slopes=jnp.linspace(0.01, 0.1, n), logits_soft_cap=20.0,
          local_window_size=(20, 5)), {}),
      "all_gather_segments_dropout_causal": ("all_gather", 8, dict(
          is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(4)),
                                             dict(segment_ids=ids)),
      "all_gather_fp8_causal_mqa": ("all_gather", 1, dict(
          is_causal=True, fp8=True), {}),
  }
  for name, (strategy, kv_heads, options, chunked) in cases.items():
    with failures.case(name, strategy, kv_heads, options, chunked):
      run = _on_chunks(mesh, keys, (b, t, n, kv_heads, h), options, chunked,
                       context_parallel=strategy)
      (got, got_lse), (want, want_lse), errors = run.results
      out_errors = [relative_error(got, want), relative_error(got_lse,
                                                              want_lse)]
      hlo = run.grad.lower(*run.args[:3]).compile().as_text()
      gathered = _gathered_shapes(hlo)
      print(f"sequence_axis {name}: all-gathers={gathered} "
            f"collective-permutes={hlo.count('collective-permute')} "
            f"out, lse errors={out_errors} grad errors={errors}")
      bound = tolerance(jnp.float32)
      assert max(out_errors) <= bound.out and max(errors) <= bound.grad, (
          out_errors, errors)
      if strategy == "ring":
        assert not gathered and hlo.count("collective-permute") > 0, gathered
      else:  # K and V whole (the backward's too), no Q.
        assert [g for g in gathered if g.count(",") == 3] == [
            f"{b},{t},{kv_heads},{h}"] * 2, gathered
  bad = {"ring runs no fp8.": ("ring", dict(fp8=True)),
         "key_value_seq_lengths with sequence_axis": (
             "all_gather", dict(key_value_seq_lengths=jnp.array([9, 64]))),
         "bias with sequence_axis": (
             "all_gather", dict(bias=jnp.ones((b, 1, t // 4, t))))}
  q = jnp.ones((b, t, n, h))
  for match, (strategy, kw) in bad.items():
    with failures.case(match, strategy, kw):
      try:
        jax.jit(jax.shard_map(
            lambda q: jax_flash.flash_attention(
                q, q, q, sequence_axis="sp", context_parallel=strategy, **kw),
            mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))(q)
      except ValueError as e:
        assert match in str(e), e
      else:
        raise AssertionError(f"no error for {strategy} {kw}")
  ring = jax.shard_map(
      lambda q: jax_flash.flash_attention(q, q, q, sequence_axis="sp",
                                          context_parallel="ring"),
      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  try:
    jax.jit(lambda q: jax.jvp(ring, (q,), (q,)))(q)
  except NotImplementedError as e:
    assert "forward-mode" in str(e), e
  else:
    raise AssertionError("no error for jvp of a ring on an axis")
  failures.report("every sequence_axis strategy case matches one device")


def _modules_on_sequence_chunks(mesh):
  """nnx's and linen's FlashAttention built with sequence_axis="sp",
  called inside a shard_map on sequence chunks (their parameters
  replicated): the whole sequence's result, chunked."""
  from flax import nnx
  x = jax.random.normal(jax.random.key(5), (2, 64, 32))
  chunks = dict(in_specs=(P(), P(None, "sp")), out_specs=P(None, "sp"))
  attn = jax_flash.nnx.FlashAttention(
      num_heads=8, num_kv_heads=2, in_features=32, decode=False,
      rngs=nnx.Rngs(0))
  graph, state = nnx.split(attn)
  whole = nnx.merge(graph, state)(x, is_causal=True)
  local = jax_flash.nnx.FlashAttention(
      num_heads=8, num_kv_heads=2, in_features=32, decode=False,
      sequence_axis="sp", rngs=nnx.Rngs(0))
  graph, state = nnx.split(local)
  got = jax.jit(jax.shard_map(
      lambda state, x: nnx.merge(graph, state)(x, is_causal=True),
      mesh=mesh, **chunks))(state, x)
  nnx_error = relative_error(got, whole)
  module = jax_flash.linen.FlashAttention(num_heads=8, qkv_features=32,
                                          is_causal=True)
  params = module.init(jax.random.key(1), x)
  want = module.apply(params, x)
  module = jax_flash.linen.FlashAttention(num_heads=8, qkv_features=32,
                                          is_causal=True, sequence_axis="sp")
  got = jax.jit(jax.shard_map(lambda params, x: module.apply(params, x),
                              mesh=mesh, **chunks))(params, x)
  linen_error = relative_error(got, want)
  print(f"modules on sequence chunks: nnx {nnx_error}, linen {linen_error}")
  assert max(nnx_error, linen_error) <= tolerance(jnp.float32).out, (
      nnx_error, linen_error)


def memory_per_device():
  """A causal forward+backward sharded along the sequence over P = 2, 4 and
  8 devices (bf16, 8 heads of 64, 8192 tokens): a device's arguments and
  outputs are one device's / P, and its temporaries (XLA's
  compiled memory) fall as 1 / P with ring and all_to_all, the strategies
  that hold chunks of the keys (all_gather holds them whole); at 65,536
  tokens over 8 devices, the default's temporaries are at most 1.5x one
  device's / 8, and at 32,768 the ring's."""
  tokens, heads, head_dim = 8192, 8, 64

  def memory(strategy, p, random_cotangent=False):
    sharding, options = None, {}
    if p > 1:
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("sp",),
                               axis_types=(jax.sharding.AxisType.Auto,))
      sharding = NamedSharding(mesh, P(None, "sp"))
      options = dict(context_parallel=strategy)
    x = jax.ShapeDtypeStruct((1, tokens, heads, head_dim), jnp.bfloat16,
                             sharding=sharding)
    # A random cotangent: a weighted sum (an all-ones one lets XLA
    # simplify one device's program more than a chunk's).
    w = jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sharding)

    def loss(q, k, v, w):
      out = jax_flash.flash_attention(q, k, v, is_causal=True,
                                      implementation="xla", **options)
      out = out.astype(jnp.float32)
      return jnp.sum(out * w) if random_cotangent else jnp.sum(out)

    m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        x, x, x, w).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes,
            m.temp_size_in_bytes)

  one_io, one_temp = memory(None, 1)
  for strategy in ("ring", "all_to_all"):
    temps = {}
    for p in (2, 4, 8):
      io, temps[p] = memory(strategy, p)
      print(f"memory {strategy} P={p}: arguments and outputs "
            f"{io / 2**20:.1f} MiB, temporaries {temps[p] / 2**20:.1f} MiB "
            f"({temps[p] * p / one_temp:.2f}x one device's / P)")
      # (Up to the few bytes of the output tuple's table.)
      assert abs(io * p - one_io) < 2**10 * p, (strategy, p, io, one_io)
      # Within 25% of 1 / P: the share of a chunk that moves, (P - 1) / P,
      # grows with P (whole keys, as all_gather holds, would be 4x at 8).
      assert temps[p] * p <= 1.25 * temps[2] * 2, (strategy, temps)
    assert temps[8] < one_temp / 2, (strategy, temps, one_temp)
  # The target at 65,536 tokens: the default ("auto": all_to_all, the
  # heads dividing the devices) within 1.5x one device's / 8.
  tokens = 65536
  _, one_temp = memory(None, 1)
  _, temp = memory("auto", 8)
  print(f"memory auto P=8, {tokens} tokens: temporaries "
        f"{temp / 2**20:.1f} MiB ({temp * 8 / one_temp:.2f}x one device's "
        f"/ 8)")
  assert temp * 8 <= 1.5 * one_temp, (temp, one_temp)
  # The ring at 32,768 tokens, its backward in four groups of heads
  # (`ring.head_groups`), a random cotangent: within 1.5x too.
  tokens = 32768
  _, one_temp = memory(None, 1, random_cotangent=True)
  _, temp = memory("ring", 8, random_cotangent=True)
  print(f"memory ring P=8, {tokens} tokens: temporaries "
        f"{temp / 2**20:.1f} MiB ({temp * 8 / one_temp:.2f}x one device's "
        f"/ 8)")
  assert temp * 8 <= 1.5 * one_temp, (temp, one_temp)
  print("memory: a device's share falls as 1 / P")


# The optional arguments of the strategy matrix (`matrix`), each with a
# causal mask unless it sets its own. b = 2, T = S = 64, 8 query heads.
def _matrix_arguments(keys, t, n):
  return {
      "causal": dict(is_causal=True),
      "no mask": {},
      "window": dict(is_causal=True, local_window_size=(20, 0)),
      "segment_ids": dict(is_causal=True, segment_ids=jnp.sort(
          jax.random.randint(keys[0], (2, t), 0, 3), axis=1)),
      "lengths": dict(is_causal=True, query_seq_lengths=jnp.array([t, 37]),
                      key_value_seq_lengths=jnp.array([50, t])),
      "mask": dict(mask=jax.random.bernoulli(keys[1], 0.8, (2, 1, t, t))),
      "bias": dict(bias=jax.random.normal(keys[2], (2, n, t, t))),
      "alibi_slopes": dict(is_causal=True,
                           alibi_slopes=jnp.linspace(0.01, 0.3, n)),
      "sinks": dict(is_causal=True, sinks=jnp.linspace(-1.0, 1.0, n)),
      "logits_soft_cap": dict(is_causal=True, logits_soft_cap=5.0),
      "dropout_rate": dict(is_causal=True, dropout_rate=0.3,
                           dropout_rng=jax.random.key(5)),
      "dropout_broadcast": dict(dropout_rate=0.3, dropout_broadcast=True,
                                dropout_rng=jax.random.key(6)),
  }


# The cells of the matrix a strategy refuses, as the refusal names them.
_MATRIX_REFUSED = {
    "ring": {"mask": "ring runs no mask.", "bias": "ring runs no bias."},
    "ring_all_to_all": {"mask": "ring_all_to_all runs no mask.",
                        "bias": "ring_all_to_all runs no bias."},
}


def matrix(num_kv_heads):
  """Every strategy ("auto" and each named one) x every optional argument
  of `_matrix_arguments`, 8 query heads on `num_kv_heads`, the sequence
  over 8 devices (a 2 x 4 mesh, both axes: ring_all_to_all's ring over
  the first, all_to_all over the second): each cell matches one device
  (output and q, k, v's gradients within float32's tolerance), its
  output sharded as the queries, the named strategy run (its collectives
  in the program, no warning of another), or is refused as the call
  traces, naming the argument (`_MATRIX_REFUSED`). The blockwise path
  ("xla"): the kernels' own handling of split operands is covered by
  `operands_by_strategy`."""
  mesh = jax.make_mesh((2, 4), ("ring", "a2a"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  seq = NamedSharding(mesh, P(None, ("ring", "a2a")))
  bound = tolerance(jnp.float32)
  b, t, n, h = 2, 64, 8, 16
  q, k, v, do = random_inputs(b, t, t, n, num_kv_heads, h, jnp.float32,
                              seed=num_kv_heads)
  args = [jax.device_put(a, seq) for a in (q, k, v)]
  picked = {}
  for name, options in _matrix_arguments(
      jax.random.split(jax.random.key(9), 3), t, n).items():
    def loss(q, k, v, strategy):
      out = jax_flash.flash_attention(q, k, v, implementation="xla",
                                      context_parallel=strategy, **options)
      return jnp.sum(out * do), out

    def grad(strategy):
      return jax.jit(jax.value_and_grad(
          lambda q, k, v: loss(q, k, v, strategy), argnums=(0, 1, 2),
          has_aux=True))
    (_, out), grads = grad("auto")(q, k, v)  # One device's.
    for strategy in STRATEGIES:
      with failures.case(num_kv_heads, name, strategy):
        why = _MATRIX_REFUSED.get(strategy, {}).get(name)
        if why:
          _assert_refused(lambda: grad(strategy).lower(*args), strategy, why)
          continue
        if picked.get(name) == strategy:
          continue  # "auto" ran this very program.
        with warnings.catch_warnings():
          warnings.simplefilter("error")  # No strategy in another's place.
          call = grad(strategy)
          hlo = call.lower(*args).compile().as_text()
          (_, out_s), grads_s = call(*args)
        errors = [relative_error(out_s, out)] + [
            relative_error(x, y) for x, y in zip(grads_s, grads)]
        assert errors[0] <= bound.out and max(errors[1:]) <= bound.grad, errors
        assert out_s.sharding.is_equivalent_to(seq, 4), out_s.sharding
        ran = _strategy_in(hlo, b, t, num_kv_heads, h)
        assert ran != "whole", ran  # (The queries' sequence stays split.)
        assert strategy in ("auto", ran), (strategy, ran)
        if strategy == "auto":
          picked[name] = ran
  print(f"matrix kv_heads={num_kv_heads}: auto picks " + ", ".join(
      f"{name}: {s}" for name, s in picked.items()))
  failures.report(f"matrix kv_heads={num_kv_heads}: every cell matches one "
                  "device or is refused by name")


def _strategy_in(hlo: str, b: int, t: int, kv_heads: int, h: int) -> str:
  """The strategy a compiled program ran, from its collectives: all_gather
  gathers whole K and V ([b, t, kv_heads, h] float32, forward and
  backward: 4), the all-to-alls of all_to_all and ring_all_to_all move
  heads (the latter's ring permutes too), a ring permutes alone; "whole"
  where anything else of Q, K or V's shape is gathered."""
  kv = f"f32[{b},{t},{kv_heads},{h}]"
  lines = [line for line in hlo.splitlines() if " all-gather(" in line]
  gathered = [g for g in (line.split("=")[1].split()[0].split("{")[0]
                          for line in lines)
              if re.fullmatch(rf"f32\[{b},{t},\d+,{h}\]", g)]
  if gathered:
    return "all_gather" if gathered == [kv] * 4 else "whole"
  if "all-to-all(" in hlo:
    return ("ring_all_to_all" if "collective-permute(" in hlo
            else "all_to_all")
  return "ring" if "collective-permute(" in hlo else "whole"

if __name__ == "__main__":
  if sys.argv[1] == "sequence_axis_strategies":
    sequence_axis_strategies()
  elif sys.argv[1] == "sequence_axis":
    sequence_axis()
  elif sys.argv[1] == "context_parallel":
    context_parallel()
  elif sys.argv[1] == "operands":
    operands()
  elif sys.argv[1] == "operands_by_strategy":
    operands_by_strategy()
  elif sys.argv[1] == "memory_per_device":
    memory_per_device()
  elif sys.argv[1] == "matrix":
    matrix(int(sys.argv[2]))
  elif sys.argv[1] == "all_to_all_forward_one_block":
    all_to_all_forward_one_block()
  else:
    main(int(sys.argv[1]))
