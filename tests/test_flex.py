"""flex_attention: user-written mask_mod / score_mod against dense
references, gradients to closed-over arrays, and the block classification;
on the blockwise loops and on the Triton kernels (interpreted on the CPU,
real on a GPU: every mask_mod whose arrays are read element by element,
score_mods that close over no array)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close
from jax_flash.core import mask as mask_lib
from jax_flash.core import mods
from tests.cases import plain_attention, random_inputs
from tests.conftest import KERNEL_IMPL

B, T, S, N, K, H = 2, 100, 90, 4, 2, 32
BLOCK = (32, 16)  # Several tiles of each kind at these lengths.
IDS = jnp.sort(jax.random.randint(jax.random.key(11), (B, T), 0, 4), axis=1)
WINDOWS = jnp.array([4, 8, 16, 1000])  # Per-head left windows.
SLOPES = jnp.linspace(0.1, 0.8, N)
TABLE = jax.random.normal(jax.random.key(12), (T + S + 1,))  # Relative bias.


def causal(b, h, q, k):
  return q >= k


def prefix_lm(b, h, q, k):  # The first 20 positions see each other.
  return (k < 20) | (q >= k)


def document(b, h, q, k):  # Closes over an id array (self-attention).
  return IDS[b, q] == IDS[b, jnp.minimum(k, T - 1)]


def sliding(b, h, q, k):  # Per-head windows, causal.
  return (q >= k) & (q - k <= WINDOWS[h])


def alibi(s, b, h, q, k):
  return s - SLOPES[h] * jnp.abs(q - k)


def soft_cap(s, b, h, q, k):
  return 20.0 * jnp.tanh(s / 20.0)


def window_formula(b, h, q, k):  # Per-head windows, closing over no array.
  return (q >= k) & (q - k <= 4 << h)


def alibi_formula(s, b, h, q, k):
  return s - 0.1 * (h + 1) * jnp.abs(q - k)


def dense(fn, b=B, n=N, t=T, s=S):
  """fn on the whole [B, N, T, S] index grid."""
  idx = [jnp.arange(x)[tuple(slice(None) if a == i else None
                             for a in range(4))] for i, x in enumerate(
                                 (b, n, t, s))]
  return jnp.broadcast_to(fn(*idx), (b, n, t, s))


# name: (mask_mod or None, score_mod or None, reference kwargs, q/k lengths)
EXAMPLES = {
    "causal": (causal, None, dict(is_causal=True), S),
    "prefix_lm": (prefix_lm, None, dict(mask=dense(prefix_lm)), S),
    "document_causal": (jax_flash.and_masks(causal, document), None,
                        dict(is_causal=True, segment_ids=IDS), T),
    "per_head_sliding_window": (sliding, None, dict(mask=dense(sliding)), S),
    "alibi": (causal, alibi, dict(is_causal=True, alibi_slopes=SLOPES), S),
    "soft_cap": (None, soft_cap, dict(logits_soft_cap=20.0), S),
    "or_masks": (jax_flash.or_masks(causal, lambda b, h, q, k: k >= S - 5),
                 None, dict(mask=dense(lambda b, h, q, k: (q >= k) |
                                       (k >= S - 5))), S),
    "per_head_window_formula": (window_formula, None,
                                dict(mask=dense(window_formula)), S),
    "alibi_formula": (causal, alibi_formula, dict(
        is_causal=True, alibi_slopes=0.1 * (jnp.arange(N) + 1.0)), S),
}
# What the kernels take: every example (the arrays a mod closes over are
# read element by element).
KERNEL_EXAMPLES = tuple(EXAMPLES)


@pytest.mark.parametrize("implementation, name", [
    *(("xla", name) for name in EXAMPLES),
    *((KERNEL_IMPL, name) for name in KERNEL_EXAMPLES)])
def test_example_matches_dense_reference(implementation, name):
  mask_mod, score_mod, ref_kwargs, s_len = EXAMPLES[name]
  q, k, v, do = random_inputs(B, T, s_len, N, K, H, jnp.float32)
  block_mask = None
  if mask_mod is not None:
    block_mask = jax_flash.create_block_mask(mask_mod, B, N, T, s_len,
                                             block_size=BLOCK)

  def run(attention):
    (out, lse), vjp = jax.vjp(lambda q, k, v: attention(q, k, v), q, k, v)
    dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
    return dict(zip(("out", "lse", "dq", "dk", "dv"),
                    (out, lse) + vjp((do, dlse))))

  flex = lambda q, k, v: jax_flash.flex_attention(
      q, k, v, score_mod, block_mask, return_residual=True,
      implementation=implementation)
  # The forward's backend in the attention primitive's parameters.
  (cfg,) = [e.params["cfg"] for e in jax.make_jaxpr(flex)(q, k, v).eqns
            if "cfg" in e.params]
  assert (cfg.plan.forward.name == "xla") == (implementation == "xla")
  got = jax.jit(lambda q, k, v: run(flex))(q, k, v)
  ref = run(lambda q, k, v: jax_flash.reference_attention(
      q, k, v, return_residual=True, **ref_kwargs))
  assert_attention_close(got, ref)


@pytest.mark.parametrize("implementation", ["xla", KERNEL_IMPL])
def test_learned_relative_bias_gets_its_gradient(implementation):
  """T5-style: a bias table indexed by q - k, closed over by score_mod. On
  the kernels (which read the table element by element), its gradient
  comes from the blockwise loops, the rest from the kernels."""
  q, k, v, do = random_inputs(B, T, S, N, K, H, jnp.float32)
  block_mask = jax_flash.create_block_mask(causal, None, None, T, S,
                                           block_size=BLOCK)

  def loss(q, k, v, table):
    out = jax_flash.flex_attention(
        q, k, v, lambda s, b, h, qi, ki: s + table[qi - ki + S], block_mask,
        implementation=implementation)
    return jnp.sum(out * do)

  backend = "XlaBackend" if implementation == "xla" else "TritonBackend"
  assert backend in str(jax.make_jaxpr(loss)(q, k, v, TABLE))

  def ref_loss(q, k, v, table):
    bias = table[jnp.arange(T)[:, None] - jnp.arange(S)[None] + S]
    return jnp.sum(jax_flash.reference_attention(
        q, k, v, bias, is_causal=True) * do)

  names = ("dq", "dk", "dv", "dtable")
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, TABLE)
  ref = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(q, k, v, TABLE)
  assert np.abs(np.asarray(got[3])).sum() > 0
  assert_attention_close(dict(zip(names, got)), dict(zip(names, ref)))


def test_bfloat16_within_plain_attentions_error():
  q, k, v, do = random_inputs(1, 255, 255, 8, 2, 64, jnp.bfloat16)
  block_mask = jax_flash.create_block_mask(causal, None, None, 255, 255)
  out = jax_flash.flex_attention(q, k, v, block_mask=block_mask)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = jax_flash.reference_attention(*up, is_causal=True)
  plain = plain_attention(jnp.bfloat16)(q, k, v, is_causal=True)
  assert_attention_close(out, ref, jnp.bfloat16, baseline=plain)


def test_block_kinds_match_brute_force():
  block_mask = jax_flash.create_block_mask(sliding, None, N, T, S,
                                           block_size=BLOCK)
  kinds = np.asarray(block_mask.kinds)
  vis = np.asarray(dense(sliding, 1, N))
  bq, bk = BLOCK
  for n in range(N):
    for i in range(kinds.shape[2]):
      for j in range(kinds.shape[3]):
        tile = vis[0, n, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        expect = (jax_flash.flex.FULL if tile.all() else
                  jax_flash.flex.PARTIAL if tile.any() else
                  jax_flash.flex.EMPTY)
        assert kinds[0, n, i, j] == expect, (n, i, j)
  # A window of 4 on head 0 leaves most of its tiles empty (never visited).
  assert (kinds[0, 0] == jax_flash.flex.EMPTY).mean() > 0.5


def test_row_that_sees_no_key_gives_zero_and_zero_gradients():
  q, k, v, do = random_inputs(B, T, S, N, K, H, jnp.float32)
  block_mask = jax_flash.create_block_mask(
      lambda b, h, qi, ki: (qi >= 50) & (qi >= ki), None, None, T, S,
      block_size=BLOCK)
  out, lse = jax_flash.flex_attention(q, k, v, block_mask=block_mask,
                                      return_residual=True)
  assert not np.asarray(out[:, :50]).any()
  assert np.isneginf(np.asarray(lse[:, :50])).all()
  dq = jax.grad(lambda q: jnp.sum(jax_flash.flex_attention(
      q, k, v, block_mask=block_mask) * do))(q)
  assert np.isfinite(np.asarray(dq)).all() and not np.asarray(dq[:, :50]).any()


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v, bm: jax_flash.flex_attention(
        q, k, v, block_mask=jax_flash.create_block_mask(
            lambda b, h, qi, ki: qi - ki <= WINDOWS.sum(), None, N, T, S),
        implementation="interpret"),
     r"one element at a time .* whole closed-over array used at once "
     r"\(by `reduce_sum`\)"),
    (lambda q, k, v, bm: jax_flash.flex_attention(
        q, k, v, lambda s, b, h, qi, ki: s * SLOPES.max(), bm,
        implementation="interpret"),
     r"a score_mod's arrays one element at a time .* \(by `reduce_max`\)"),
    (lambda q, k, v, bm: jax_flash.flex_attention(
        q, k, v, block_mask=jax_flash.create_block_mask(
            causal, None, None, T, S, block_size=24),
        implementation="interpret"),
     "power-of-two block sizes"),
    (lambda q, k, v, bm: jax_flash.flex_attention(q[:, :64], k, v,
                                                  block_mask=bm),
     r"block_mask was made for \(T, S\) = \(100, 90\)"),
    (lambda q, k, v, bm: jax_flash.flex_attention(q, k, v,
                                                  block_mask=jnp.ones(3)),
     "block_mask must come from jax_flash.create_block_mask"),
    (lambda q, k, v, bm: jax_flash.create_block_mask(causal, 0, None, 4, 4),
     "B must be None or an int >= 1"),
])
def test_bad_flex_arguments(call, match):
  q, k, v, _ = random_inputs(B, T, S, N, K, H, jnp.float32)
  bm = jax_flash.create_block_mask(causal, None, None, T, S)
  with pytest.raises(ValueError, match=match):
    call(q, k, v, bm)


def test_ids_traced_under_jit_with_gradients():
  """The block mask built inside jit from a traced id array; gradients."""
  q, k, v, do = random_inputs(B, T, T, N, K, H, jnp.float32)

  @jax.jit
  def grads(q, k, v, ids):
    mask_mod = jax_flash.and_masks(
        causal, lambda b, h, qi, ki: ids[b, qi] == ids[b, ki])
    block_mask = jax_flash.create_block_mask(mask_mod, B, None, T, T,
                                             block_size=BLOCK)
    return jax.grad(lambda q, k, v: jnp.sum(jax_flash.flex_attention(
        q, k, v, block_mask=block_mask) * do), argnums=(0, 1, 2))(q, k, v)

  ref = jax.grad(lambda q, k, v: jnp.sum(jax_flash.reference_attention(
      q, k, v, is_causal=True, segment_ids=IDS) * do), argnums=(0, 1, 2))(
          q, k, v)
  assert_attention_close(grads(q, k, v, IDS), ref)


@pytest.mark.parametrize("rows, cols", [(16, 16), (64, 32), (8, 128),
                                        (80, 24), (48, 80), (96, 112)])
@pytest.mark.parametrize("transposed", [False, True])
def test_kinds_tile_table_covers_the_mask(rows, cols, transposed):
  """The kernels' tile ranges made of a mask_mod's kinds (at other tile
  sizes than the block mask's): every visible pair's tile is visited, every
  tile of the full range is wholly visible."""
  block_mask = jax_flash.create_block_mask(window_formula, B, N, T, S,
                                           block_size=(32, 16))
  kinds = np.asarray(block_mask.kinds)
  combined = np.where((kinds == mask_lib.FULL).all(1), mask_lib.FULL,
                      np.where((kinds == mask_lib.EMPTY).all(1),
                               mask_lib.EMPTY, mask_lib.PARTIAL))
  mask = mask_lib.Mask(mod=window_formula, mod_tiles=(32, 16))
  table = np.asarray(mask_lib.kinds_block_table(
      jnp.asarray(combined, jnp.int8), mask, rows, cols, T, S,
      transposed=transposed))
  vis = np.asarray(dense(window_formula))  # [B, N, T, S]
  if transposed:
    vis = vis.transpose(0, 1, 3, 2)
  for b in range(B):
    for r in range(table.shape[1]):
      lo, full_lo, full_hi, hi = table[b, r]
      tile_rows = vis[b, :, r * rows:(r + 1) * rows]
      seen = np.nonzero(tile_rows.any(axis=(0, 1)))[0] // cols
      assert all(lo <= c < hi for c in seen), (b, r)
      for c in range(full_lo, full_hi):
        assert tile_rows[:, :, c * cols:(c + 1) * cols].all(), (b, r, c)


# The Mosaic GPU kernels (an H100/H200) take mask_mods and score_mods that
# close over no array: multi-tile, unaligned lengths, GQA, low precision,
# each head dim they take. name: (mask_mod, score_mod, reference kwargs of
# the shape's heads, (B, T, S, N, K, H), dtype)
def _mosaic_flex_cases():
  shape = lambda t, s, n: (1, n, t, s)  # dense(fn, b, n, t, s)
  return {
      "causal_alibi_h128_gqa": (
          causal, alibi_formula,
          lambda b, t, s, n: dict(is_causal=True,
                                  alibi_slopes=0.1 * (jnp.arange(n) + 1.0)),
          (2, 1000, 1003, 8, 2, 128), jnp.bfloat16),
      "prefix_lm_h64_mha": (
          prefix_lm, None,
          lambda b, t, s, n: dict(mask=dense(prefix_lm, *shape(t, s, n))),
          (1, 512, 700, 4, 4, 64), jnp.float16),
      "window_formula_soft_cap_h256": (
          window_formula, soft_cap,
          lambda b, t, s, n: dict(mask=dense(window_formula, *shape(t, s, n)),
                                  logits_soft_cap=20.0),
          (1, 300, 300, 4, 2, 256), jnp.bfloat16),
      # 96-row K/V tiles (head dim 192's default) over the block mask's
      # 128-row blocks.
      "prefix_lm_soft_cap_h192_gqa": (
          prefix_lm, soft_cap,
          lambda b, t, s, n: dict(mask=dense(prefix_lm, *shape(t, s, n)),
                                  logits_soft_cap=20.0),
          (1, 1000, 1003, 8, 2, 192), jnp.bfloat16),
  }


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_mosaic_flex_cases()))
def test_mosaic_flex_matches_dense_reference(name):
  mask_mod, score_mod, ref_kwargs, shape, dtype = _mosaic_flex_cases()[name]
  b, t, s, n, k, h = shape
  q, k, v, do = random_inputs(b, t, s, n, k, h, dtype)
  block_mask = jax_flash.create_block_mask(mask_mod, None, None, t, s)
  ref_kwargs = ref_kwargs(b, t, s, n)

  def run(attention, inputs):
    (out, lse), vjp = jax.vjp(attention, *inputs)
    dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(
        lse.shape)
    return dict(zip(("out", "lse", "dq", "dk", "dv"),
                    (out, lse) + vjp((do.astype(out.dtype), dlse))))

  flex = lambda q, k, v: jax_flash.flex_attention(
      q, k, v, score_mod, block_mask, return_residual=True,
      implementation="mosaic")
  assert "mosaic_gpu" in jax.jit(flex).lower(q, k, v).as_text()
  got = jax.jit(lambda *x: run(flex, x))(q, k, v)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = run(lambda *x: jax_flash.reference_attention(
      *x, return_residual=True, **ref_kwargs), up)
  plain = run(lambda *x: plain_attention(dtype)(
      *x, return_residual=True, **ref_kwargs), (q, k, v))
  assert_attention_close(got, ref, dtype, baseline=plain)


DOCS = jnp.arange(64, dtype=jnp.int32) // 10
DOCS2 = jnp.stack([DOCS, DOCS[::-1]])
PERM = jax.random.permutation(jax.random.key(5), 64).astype(jnp.int32)


# mask_mods reading closed-over arrays as a kernel does (one element per
# index), against plain evaluation on the arrays; indices past the ends too.
@pytest.mark.parametrize("fn", [
    lambda b, h, q, k: DOCS[q] == DOCS[k],
    lambda b, h, q, k: DOCS2[b, q] >= DOCS2[b, k],
    lambda b, h, q, k: DOCS2[b][q] == DOCS2[b][k],
    lambda b, h, q, k: jnp.take(DOCS, q) == jnp.take(DOCS, k),  # Fill mode.
    lambda b, h, q, k: DOCS[PERM[q % 64]] <= DOCS[k] + WINDOWS[h],
    lambda b, h, q, k: (q >= k) & (q - k <= WINDOWS[h]),
    lambda b, h, q, k: jnp.take(DOCS2[b], q) == DOCS2[b, k],
    lambda b, h, q, k: DOCS2.at[b, q].get(mode="fill", fill_value=-1) >= k % 7,
], ids=["ids", "batch_ids", "row_then_ids", "take", "nested", "per_head",
        "take_of_a_row", "fill_past_the_end"])
def test_element_reads_equal_plain_evaluation(fn):
  mod, consts = jax_flash.flex._elementwise(fn, 4, float_first=False)
  readers = tuple(mods.ArrayReader(c.shape, c.dtype,
                                   lambda idx, c=c: c[idx]) for c in consts)
  rows = jnp.arange(-3, 70, dtype=jnp.int32)[:, None]
  cols = jnp.arange(-2, 68, dtype=jnp.int32)[None, :]
  for b, h in ((0, 0), (1, 3)):
    want = mod(jnp.int32(b), jnp.int32(h), rows, cols, consts=consts)
    got = mod(jnp.int32(b), jnp.int32(h), rows, cols, consts=readers)
    np.testing.assert_array_equal(got, want)
  assert mods.unsupported_reads(mod, consts, 4) is None


@pytest.mark.parametrize("fn, match", [
    (lambda b, h, q, k: q - k <= DOCS.max(), "whole closed-over array used "
     "at once \\(by `reduce_max`\\)"),
    (lambda b, h, q, k: jax.lax.dynamic_slice(DOCS, (q,), (2,))[1] == k,
     "a slice of 2 of 64 entries"),
    (lambda b, h, q, k: jnp.take(DOCS, jnp.stack([q, k])).sum() > 3,
     "a gather of more than one element"),
])
def test_reads_a_kernel_cannot_make_are_named(fn, match):
  mod, consts = jax_flash.flex._elementwise(fn, 4, float_first=False)
  assert re.search(match, mods.unsupported_reads(mod, consts, 4))
  # The blockwise loops still run it.
  q, k, v, _ = random_inputs(1, 64, 64, 2, 1, 16, jnp.float32)
  bm = jax_flash.create_block_mask(fn, None, None, 64, 64, block_size=16)
  dense_mask = dense(lambda *idx: mod(*idx, consts=consts), 1, 1, 64, 64)
  out = jax_flash.flex_attention(q, k, v, block_mask=bm)
  ref = jax_flash.reference_attention(q, k, v, mask=dense_mask)
  assert_attention_close(out, ref)


PREFIX = jnp.array(20)  # A 0-d array.
ALLOWED = jnp.arange(S) % 3 != 0  # Boolean.
THRESHOLDS = jnp.linspace(0.0, 50.0, N)  # Float, per head.


@pytest.mark.parametrize("mask_mod", [
    lambda b, h, q, k: (k < PREFIX) | (q >= k),
    lambda b, h, q, k: ALLOWED[k] & (q >= k),
    lambda b, h, q, k: (q - k).astype(jnp.float32) <= THRESHOLDS[h],
], ids=["zero_d", "bool", "float_per_head"])
def test_kernels_read_arrays_of_any_rank_and_dtype(mask_mod):
  q, k, v, do = random_inputs(B, T, S, N, K, H, jnp.float32)
  block_mask = jax_flash.create_block_mask(mask_mod, None, N, T, S,
                                           block_size=BLOCK)
  mod, consts = jax_flash.flex._elementwise(mask_mod, 4, float_first=False)
  ref_mask = dense(lambda *idx: mod(*idx, consts=consts))

  def run(attention):
    out, vjp = jax.vjp(attention, q, k, v)
    return dict(zip(("out", "dq", "dk", "dv"), (out,) + vjp(do)))
  got = jax.jit(lambda q, k, v: run(lambda q, k, v: jax_flash.flex_attention(
      q, k, v, block_mask=block_mask, implementation=KERNEL_IMPL)))(q, k, v)
  ref = run(lambda q, k, v: jax_flash.reference_attention(q, k, v,
                                                          mask=ref_mask))
  assert_attention_close(got, ref)
