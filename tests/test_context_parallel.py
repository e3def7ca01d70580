"""The per-device work of the all_gather context parallelism: a chunk of
the queries at its offset in the sequence against all keys, forward and
backward, on each backend (real kernels on a GPU, interpreted on the CPU),
as the matching rows of the whole call compute it. (The sharded calls
themselves: tests/test_sharding.py on 8 simulated devices.)"""
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _dispatch, _primitive, attention
from jax_flash.core import checks, softmax
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.options import STRATEGIES
from jax_flash.core.scores import Scores
from jax_flash.testing import assert_attention_close
from tests.cases import random_inputs
from tests.conftest import KERNEL_IMPL, ON_GPU

DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32


@pytest.mark.parametrize("implementation", ["xla", KERNEL_IMPL])
@pytest.mark.parametrize("case", [
    # (T, S, heads, kv heads, head dim, rows of the chunk, offsets, options)
    (256, 256, 4, 2, 64, 64, (64, 192), dict(is_causal=True)),
    (200, 300, 4, 1, 32, 50, (0, 150), dict(is_causal=True)),
    (256, 256, 2, 2, 128, 128, (128, 64),
     dict(local_window_size=(40, 8), logits_soft_cap=20.0)),
    (192, 192, 4, 4, 64, 96, (96, 0), {}),
    (256, 256, 4, 2, 64, 64, (64, 192),
     dict(is_causal=True, alibi_slopes=jnp.linspace(0.02, 0.2, 8).reshape(
         2, 4))),
], ids=["causal", "cross_causal_mqa", "window_softcap", "full",
        "alibi_causal"])
def test_query_chunk_at_offsets_matches_whole_rows(case, implementation):
  t, s, n, kh, h, rows, offsets, options = case
  q, k, v, _ = random_inputs(2, t, s, n, kh, h, DTYPE, seed=t + rows)
  do = random_inputs(2, rows, 1, n, 1, h, DTYPE, seed=rows)[0]
  starts = jnp.asarray(offsets, jnp.int32)

  def chunk_of(x):  # Rows [offset, offset + rows) of each sequence.
    return jnp.stack([jax.lax.dynamic_slice_in_dim(x[b], starts[b], rows)
                      for b in range(2)])

  def whole(q, k, v):
    out = jax_flash.reference_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), **options)
    return chunk_of(out)

  want, vjp = jax.vjp(whole, q, k, v)
  want_grads = vjp(do.astype(jnp.float32))

  soft_cap = options.get("logits_soft_cap")
  window = options.get("local_window_size")
  mask = Mask(is_causal=options.get("is_causal", False),
              window_left=None if window is None else window[0],
              window_right=None if window is None else window[1])
  slopes = options.get("alibi_slopes")  # ALiBi sees positions, not rows.
  scores = Scores(scale=h ** -0.5, soft_cap=soft_cap,
                  alibi=slopes is not None)
  p = checks.check_qkv(q, k, v)
  plan = _dispatch.select(implementation, q, p, q.dtype, mask=mask,
                          scores=scores)
  cfg = attention.config(plan, None, p, q.dtype, mask, scores,
                         is_causal=mask.is_causal)
  qc = chunk_of(q)
  operands = Operands(q_offsets=starts, alibi_slopes=slopes)
  out, lse = jax.jit(_primitive._chunk_forward, static_argnums=4)(
      qc, k, v, operands, cfg)
  delta = softmax.backward_delta(out, do)
  dq, dk, dv, _ = jax.jit(_primitive._chunk_backward, static_argnums=8)(
      qc, k, v, operands, delta, lse, do, jnp.zeros_like(lse), cfg)
  assert_attention_close(
      {"out": out, "dq": dq, "dk": dk, "dv": dv},
      {"out": want, "dq": chunk_of(want_grads[0]), "dk": want_grads[1],
       "dv": want_grads[2]}, DTYPE)


def test_cost_model_orders_the_strategies():
  """`plan.cost`, elements a device sends: all_to_all the least where
  it runs; ring_all_to_all (all_to_all over 4 of 8 devices, a ring of 2)
  under all_gather with few KV heads; ring never under all_gather."""
  from jax_flash.context_parallel import plan
  shape = dict(p=8, q_rows=16, kv_rows=16, heads=8, kv_heads=4,
               head_dims=64, kv_seq=True, inner=4)
  for balanced in (False, True):
    cost = {s: plan.cost(s, balanced=balanced, **shape)
            for s in STRATEGIES[1:]}
    q, kv = 16 * 8 * 64, 16 * 4 * 64
    assert cost["all_to_all"] == (q + kv) * 7 // 8
    assert cost["ring_all_to_all"] == ((q + kv) * 3 // 4 + kv
                                       + (q + kv if balanced else 0))
    assert cost["all_gather"] == kv * 7 + (q if balanced else 0)
    assert (cost["all_to_all"] < cost["ring_all_to_all"]
            < cost["all_gather"] <= cost["ring"])


@pytest.mark.parametrize("p, picked", [(4, "all_gather"), (8, "ring")])
def test_auto_sends_the_least_within_memory(p, picked):
  """`plan.plan` with "auto" where all_to_all cannot run (6 heads over 4
  or 8 devices: no whole groups): all_gather sends the least, and holds
  the whole K and V (`plan.held`): within `MEMORY_SLACK` of the ring's
  holdings on 4 devices, past it on 8, where the ring runs."""
  from types import SimpleNamespace as Of

  from jax.sharding import PartitionSpec as P

  from jax_flash.context_parallel import plan
  sharded = Of(spec=P(None, "sp"))
  arrays = [Of(shape=(1, 1024, 6, 64), dtype=jnp.bfloat16,
                sharding=sharded)] * 3
  cfg = Of(context_parallel="auto", mask=Mask(is_causal=True),
           scores=Scores(scale=0.125))
  split = plan.plan(Of(shape={"sp": p}), arrays, cfg, lambda *_: None, {})
  assert (split.seq, split.strategy) == ("sp", picked)
  local = dict(p=p, q_rows=1024 // p, kv_rows=1024 // p, heads=6,
               kv_heads=6, head_dims=128, kv_seq=True)
  memory = {s: plan.held(s, **local) for s in ("all_gather", "ring")}
  assert (memory["all_gather"] <= plan.MEMORY_SLACK * memory["ring"]) == (
      p == 4)
  assert plan.cost("all_gather", balanced=True, **local) < plan.cost(
      "ring", balanced=True, **local)


@pytest.mark.parametrize("strategy, operands, mask, lengths, why", [
    ("ring", dict(dense_mask=1, tile_kinds=1), Mask(), (64, 64),
     "ring runs no mask."),
    ("ring", dict(bias=1, alibi_slopes=1), Mask(is_causal=True), (64, 64),
     "ring runs no bias."),
    ("ring", {}, Mask(window_left=8, window_right=8), (64, 64),
     "ring runs causal or full masks and causal sliding windows"),
    ("ring", {}, Mask(is_causal=True), (64, 32), "ring runs self-attention"),
    ("ring_all_to_all", dict(bias=1, sinks=1), Mask(), (64, 64),
     "ring_all_to_all runs no bias."),
    ("ring", dict(q_offsets=1), Mask(), (64, 64),
     "ring runs no query offsets."),
])
def test_a_strategy_that_cannot_run_the_arguments_is_named(
    strategy, operands, mask, lengths, why):
  """`plan.refused_by` (whatever the sharding) and `plan.check_named`: a
  ValueError naming the strategy, the argument in `flash_attention`'s
  words and the strategies that can run the call; "auto" never refused."""
  from jax_flash.context_parallel import plan
  refused = plan.refused_by(Operands(**operands), mask, *lengths)
  with pytest.raises(ValueError) as e:
    plan.check_named(strategy, refused)
  assert f"context_parallel={strategy!r} cannot run this call" in str(e.value)
  assert why in str(e.value)
  can = [s for s in STRATEGIES[1:] if s not in refused]
  assert strategy not in can and can, refused
  assert f"Strategies that can: {', '.join(map(repr, can))}" in str(e.value)
  plan.check_named("auto", refused)
  assert plan.refused_by(Operands(q_ids=1, kv_ids=1, sinks=1),
                         Mask(is_causal=True, has_ids=True), 64, 64) == {}


def test_merging_two_parts_equals_merging_them_stacked():
  """`softmax.merge_two` (the ring's step) is `softmax.merge` of the two
  parts stacked, rows where one part or both saw no key (lse -inf)
  included: those weigh 0, and a row no part saw is 0 with lse -inf."""
  keys = jax.random.split(jax.random.key(0), 4)
  o = jax.random.normal(keys[0], (2, 2, 5, 3, 8))
  lse = jax.random.normal(keys[1], (2, 2, 5, 3))
  lse = lse.at[0, :, 1].set(-jnp.inf).at[1, :, 2].set(-jnp.inf)
  lse = lse.at[:, :, 4].set(-jnp.inf)
  want_o, want_lse = softmax.merge(o, lse, axis=0)
  got_o, got_lse = softmax.merge_two(o[0], lse[0],
                                     o[1].astype(jnp.bfloat16), lse[1])
  assert jnp.allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6), (
      jnp.max(jnp.abs(got_lse - want_lse)))
  want_o = softmax.merge(o.at[1].set(o[1].astype(jnp.bfloat16)), lse,
                         axis=0)[0]
  assert jnp.allclose(got_o, want_o, rtol=1e-6, atol=1e-6)
  assert not jnp.any(jnp.isnan(got_o)) and jnp.all(got_o[:, 4] == 0)
  assert jnp.all(got_lse[:, 4] == -jnp.inf)
