"""Bias (and its gradient), dense masks, soft-cap and ALiBi: each, combined
with each other and with the masks, against the reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close
from tests.cases import compare_with_reference, jax_nn_attention, random_inputs
from tests.conftest import KERNEL_IMPL

B, T, S, N, K, H = 2, 100, 90, 4, 2, 32
_keys = jax.random.split(jax.random.key(42), 8)


def _bias(shape):
  return jax.random.normal(_keys[0], shape)


def _mask(shape, p=0.7):
  return jax.random.bernoulli(_keys[1], p, shape)


def _packed(n, seed):
  return jnp.sort(jax.random.randint(jax.random.key(seed), (B, n), 0, 3), 1)


SEGMENTS = (_packed(T, 1), _packed(S, 2))
SLOPES = jnp.linspace(0.05, 0.8, N)
SINKS = jnp.array([-1.0, 0.5, 2.0, 6.0])

VARIANTS = {
    # Bias: every broadcast pattern, each with its gradient.
    "bias_BNTS": dict(bias=_bias((B, N, T, S))),
    "bias_1NTS": dict(bias=_bias((1, N, T, S))),
    "bias_B1TS": dict(bias=_bias((B, 1, T, S))),
    "bias_B11S": dict(bias=_bias((B, 1, 1, S))),
    "bias_1NT1": dict(bias=_bias((1, N, T, 1))),
    "bias_1111": dict(bias=_bias((1, 1, 1, 1))),
    "bias_TS_3d": dict(bias=_bias((T, S))),
    # A bias over queries only: its gradient sums each row's dS over keys.
    "bias_1NT1_sinks": dict(bias=_bias((1, N, T, 1)), sinks=SINKS),
    "bias_B1T1_dropout": dict(bias=_bias((B, 1, T, 1)), dropout_rate=0.3,
                              dropout_rng=jax.random.key(3), is_causal=True),
    # Dense boolean masks, read tile by tile.
    "mask_BNTS": dict(mask=_mask((B, N, T, S))),
    "mask_B11S": dict(mask=_mask((B, 1, 1, S), 0.5)),
    "mask_11T1": dict(mask=_mask((1, 1, T, 1), 0.8)),
    "soft_cap": dict(logits_soft_cap=2.5),
    "alibi_N": dict(alibi_slopes=SLOPES),
    "alibi_BN": dict(alibi_slopes=jax.random.uniform(_keys[2], (B, N))),
    # Pairs.
    "bias_causal": dict(bias=_bias((1, N, T, S)), is_causal=True),
    "mask_window": dict(mask=_mask((B, 1, T, S)), local_window_size=(20, 5)),
    "soft_cap_causal": dict(logits_soft_cap=1.0, is_causal=True),
    "alibi_segments": dict(alibi_slopes=SLOPES, segment_ids=SEGMENTS),
    "bias_mask": dict(bias=_bias((B, N, T, S)), mask=_mask((1, N, T, S))),
    "soft_cap_bias": dict(logits_soft_cap=3.0, bias=_bias((B, 1, 1, S))),
    # Triples and more.
    "cap_alibi_causal": dict(logits_soft_cap=4.0, alibi_slopes=SLOPES,
                             is_causal=True),
    "bias_segments_lengths": dict(bias=_bias((B, N, T, S)),
                                  segment_ids=SEGMENTS,
                                  key_value_seq_lengths=jnp.array([70, 3])),
    "everything": dict(bias=_bias((B, 1, T, S)), mask=_mask((1, N, T, S), 0.9),
                       logits_soft_cap=5.0, alibi_slopes=SLOPES,
                       local_window_size=(30, 10), segment_ids=SEGMENTS,
                       query_seq_lengths=jnp.array([100, 60])),
}


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_reference(name, implementation):
  compare_with_reference(VARIANTS[name], implementation=implementation)


@pytest.mark.parametrize("name", ["bias_B11S", "soft_cap_bias", "everything"])
def test_variant_version1_matches_reference(name):
  compare_with_reference(VARIANTS[name], version=1)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_row_bias_gradient_low_precision(implementation):
  """A bias over queries only, head dim 256, bfloat16: its gradient (the
  sum of each row's dS over keys, exactly the logsumexp's cotangent here)
  as accurate as plain attention's. Summing P (dP - D) with D from the
  bfloat16 output missed by 7e-3 (twice the bound; H200, 2026-12-01)."""
  kwargs = dict(bias=jax.random.normal(_keys[4], (1, 1, 512, 1)),
                key_value_seq_lengths=jnp.array([550]), is_causal=True)
  compare_with_reference(kwargs, jnp.bfloat16, shape=(1, 512, 600, 4, 2, 256),
                         implementation=implementation, block_sizes=None,
                         garbage=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_variants_low_precision_gqa(dtype):
  kwargs = dict(bias=jax.random.normal(_keys[3], (1, 8, 255, 300)),
                logits_soft_cap=8.0, alibi_slopes=jnp.linspace(0.01, 0.1, 8),
                is_causal=True)
  compare_with_reference(kwargs, dtype, shape=(1, 255, 300, 8, 2, 96))


def test_mask_that_hides_everything_gives_zeros():
  empty = compare_with_reference(dict(mask=jnp.zeros((1, 1, T, S), bool)))
  assert empty.all()


def test_bias_gradient_is_not_computed_unless_asked():
  q, k, v, _ = random_inputs(1, 64, 64, 2, 2, 32, jnp.float32)
  bias = _bias((1, 2, 64, 64))

  def loss(q, bias):
    return jnp.sum(jax_flash.flash_attention(q, k, v, bias,
                                             implementation=KERNEL_IMPL))

  def hlo(argnums):
    return jax.jit(jax.grad(loss, argnums=argnums)).lower(
        q, bias).compile().as_text()

  assert "flash_attention_backward_dbias" in hlo((0, 1))
  assert "flash_attention_backward_dbias" not in hlo((0,))


def test_bias_and_mask_match_jax_nn():
  q, k, v, _ = random_inputs(B, T, S, N, K, H, jnp.float32)
  bias, mask = _bias((B, N, T, S)), _mask((B, 1, T, S), 0.9)
  ours, lse = jax_flash.flash_attention(q, k, v, bias, mask,
                                        implementation=KERNEL_IMPL,
                                        return_residual=True)
  theirs = jax_nn_attention(q, k, v, bias, mask)
  sees = jnp.isfinite(lse)[..., None]
  assert_attention_close(jnp.where(sees, ours, 0), jnp.where(sees, theirs, 0))


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("kwargs", [
    dict(), dict(is_causal=True),
    dict(key_value_seq_lengths=jnp.array([90, 0]), logits_soft_cap=3.0),
], ids=["plain", "causal", "lengths_cap"])
def test_sinks_and_their_gradient(implementation, kwargs):
  """Per-head sink logits in the denominator: outputs, logsumexp (finite
  even for rows that see no key) and gradients, the sinks' included."""
  q, k, v, do = random_inputs(B, T, S, N, K, H, jnp.float32)
  names = ("out", "lse", "dq", "dk", "dv", "dsinks")

  def run(attention, **extra):
    def f(q, k, v, sinks):
      return attention(q, k, v, sinks=sinks, return_residual=True, **kwargs,
                       **extra)
    (out, lse), vjp = jax.vjp(f, q, k, v, SINKS)
    dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
    return dict(zip(names, (out, lse) + vjp((do, dlse))))

  got = jax.jit(lambda: run(jax_flash.flash_attention,
                            implementation=implementation))()
  ref = run(jax_flash.reference_attention)
  assert np.isfinite(np.asarray(got["lse"])).all()
  assert_attention_close(got, ref)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("head_dim, value_head_dim, dtype, kwargs", [
    (48, 24, "float32", dict(is_causal=True)),
    (32, 80, "float32", dict(bias=jnp.ones((1, N, T, S)) * 0.3,
                             key_value_seq_lengths=jnp.array([90, 31]))),
    (64, 128, "bfloat16", dict(local_window_size=(20, 0))),
], ids=["smaller", "larger_bias_lengths", "bf16_window"])
def test_value_head_dim_of_its_own(implementation, head_dim, value_head_dim,
                                   dtype, kwargs):
  """Value [B, S, K, Hv] with Hv != H (multi-head latent attention): the
  output has Hv; forward and gradients against the reference."""
  compare_with_reference(kwargs, jnp.dtype(dtype),
                         shape=(B, T, S, N, K, head_dim),
                         implementation=implementation,
                         value_head_dim=value_head_dim)


@pytest.mark.parametrize("scale", [0.088, 1.0, -0.5, 0.0])
@pytest.mark.parametrize("soft_cap", [None, 20.0])
def test_factored_logits_are_the_logits(scale, soft_cap):
  """`Scores.factored_logits2` (the Mosaic kernels' row max and FMA): t * c
  is `logits2`, and for plain scores with a positive scale, or only a
  soft-cap, the row max of t times c is bitwise the row max of the logits
  (the forward's m)."""
  from jax_flash.core.scores import LOG2E, Scores
  scores = Scores(scale=scale, soft_cap=soft_cap)
  qk = 30.0 * jax.random.normal(jax.random.key(0), (64, 128))
  qk = qk.at[3].set(-jnp.inf)  # A hidden row, as the forward's mask makes.
  t, c, _ = scores.factored_logits2(qk)
  s2, _ = scores.logits2(qk)
  assert c > 0
  np.testing.assert_array_equal(t * c, s2)
  if scores.plain and scale > 0:
    assert t is qk
    np.testing.assert_array_equal(t.max(axis=1) * c, s2.max(axis=1))
  elif soft_cap is not None:  # t the tanh: the row max of t times c too.
    assert c == soft_cap * LOG2E and float(jnp.nanmax(jnp.abs(t))) <= 1.0
    np.testing.assert_array_equal(t.max(axis=1) * c, s2.max(axis=1))
  else:
    assert c == 1.0


@pytest.mark.parametrize("scale, soft_cap", [(0.088, None), (1.0, 20.0),
                                              (-0.5, None)])
@pytest.mark.parametrize("q_first, k_first, causal, slope", [
    (q, k, causal, slope)
    for q, k in ((64, 0), (4096, 1024), (131008, 0), (256, 256), (0, 64))
    for causal, slope in ((True, 0.7), (False, 0.7), (False, -0.3))
    if not causal or q + 63 >= k])  # A causal tile with a key seen.
@pytest.mark.parametrize("transposed", [False, True])
def test_alibi_vectors_are_alibi(scale, soft_cap, q_first, k_first, causal,
                                 slope, transposed):
  """`tiles.with_alibi` (the Mosaic kernels' `alibi_vectors`): on a tile
  of scores without ALiBi in t * c form, its row and column vectors give
  the base-2 logits with ALiBi as `Scores.logits2` forms them from
  |i - j|: on a causal mask wherever the key is at or before its query,
  without one everywhere (keys on both sides; a negative slope too);
  near the diagonal, far from it and at 128k positions, the dK/dV
  kernel's transposed tile too."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu.tiles import with_alibi
  mask = Mask(is_causal=causal)
  qk = 5.0 * jax.random.normal(jax.random.key(1), (64, 128))
  rows = q_first + jnp.arange(64)[:, None]
  cols = k_first + jnp.arange(128)[None, :]
  want, _ = Scores(scale=scale, soft_cap=soft_cap, alibi=True).logits2(
      qk, rows, cols, slope=slope)
  t, c, _ = Scores(scale=scale, soft_cap=soft_cap).factored_logits2(qk)
  q_rel, k_rel = q_first - k_first + jnp.arange(64), jnp.arange(128)
  if transposed:  # Keys down, queries across.
    got = with_alibi(t.T, c, slope, q_rel, k_rel, 1, mask).T * c
  else:
    got = with_alibi(t, c, slope, q_rel, k_rel, 0, mask) * c
  seen = rows >= cols if causal else jnp.ones(qk.shape, bool)
  assert bool(seen.any())
  np.testing.assert_allclose(np.where(seen, got, 0.0),
                             np.where(seen, want, 0.0),
                             rtol=2e-6, atol=2e-4 * (1 + abs(c)))


@pytest.mark.parametrize("q_first, slope", [(64, 0.7), (4096, 0.25),
                                             (131008, 0.5), (200, -0.3)])
def test_alibi_fold_is_alibi(q_first, slope):
  """`MosaicBlockSizes.alibi_fold` on a causal mask: the tile's logits
  without ALiBi's query term (`with_alibi(..., fold=True)`) and that term
  as a row vector (`alibi_row`) joining the online softmax's max and shift
  (`softmax_step(row=...)`, two key tiles in turn) give the logsumexp of
  the logits with ALiBi as `Scores.logits2` forms them, and the
  backward's P from the logsumexp less the row term (`_lse_tile`) is
  2**(logits - lse); without a causal mask the fold changes nothing."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu.flash_bwd import _lse_tile
  from pallas_kernels.mosaic_gpu.tiles import (alibi_row, softmax_step,
                                               with_alibi)
  causal, rows = Mask(is_causal=True), q_first + jnp.arange(64)
  qk = 5.0 * jax.random.normal(jax.random.key(2), (64, 256))
  cols = q_first - 128 + jnp.arange(256)  # Keys before and after the rows.
  seen = rows[:, None] >= cols[None, :]
  want, _ = Scores(scale=0.088, alibi=True).logits2(
      qk, rows[:, None], cols[None, :], slope=slope)
  want = jnp.where(seen, want, -jnp.inf)
  lse_want = jnp.log2(jnp.exp2(want - want.max(1, keepdims=True)).sum(1)) \
      + want.max(1)
  t, c, _ = Scores(scale=0.088).factored_logits2(qk)
  m, l = jnp.full(64, -jnp.inf), jnp.zeros(64)
  for j in range(2):  # Key tiles of 128, each based at its first key.
    tile = slice(128 * j, 128 * (j + 1))
    q_rel, k_rel = rows - cols[128 * j], jnp.arange(128)
    folded = with_alibi(t[:, tile], c, slope, q_rel, k_rel, 0, causal,
                        fold=True)
    whole = with_alibi(t[:, tile], c, slope, q_rel, k_rel, 0, causal)
    np.testing.assert_allclose(
        np.where(seen[:, tile], folded * c + alibi_row(slope, q_rel)[:, None],
                 0.0), np.where(seen[:, tile], whole * c, 0.0),
        rtol=2e-6, atol=2e-4 * (1 + abs(c)))
    s = jnp.where(seen[:, tile], folded, -jnp.inf)
    _, m, l, _ = softmax_step(s, c, m, l, row=alibi_row(slope, q_rel))
    p = jnp.exp2(folded * c - _lse_tile(lse_want, (64, 128), 0,
                                        (slope, q_rel)))
    np.testing.assert_allclose(
        np.where(seen[:, tile], p, 0.0),
        np.where(seen[:, tile], jnp.exp2(want[:, tile] - lse_want[:, None]),
                 0.0), rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(m + jnp.log2(l), lse_want, rtol=1e-6, atol=2e-4)
  q_rel, k_rel = rows - cols[0], jnp.arange(256)
  np.testing.assert_array_equal(  # Keys on both sides: no fold.
      with_alibi(t, c, slope, q_rel, k_rel, 0, Mask(), fold=True),
      with_alibi(t, c, slope, q_rel, k_rel, 0, Mask()))


def test_alibi_vectors_default_rule():
  """`MosaicBlockSizes.alibi_vectors=None`: vectors for tiles of at most
  `ALIBI_VECTORS_MAX_COLUMNS` columns, whatever the mask; True: every
  tile; False: none; nothing to do without ALiBi."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu import config
  from pallas_kernels.mosaic_gpu.tiles import alibi_by_vectors
  alibi = Scores(scale=0.1, alibi=True)
  widest = config.ALIBI_VECTORS_MAX_COLUMNS

  def vectors(option, mask, columns, scores=alibi):
    blocks = jax_flash.MosaicBlockSizes(alibi_vectors=option)
    return alibi_by_vectors(mask, scores, blocks, columns) is not None
  causal = Mask(is_causal=True)
  for mask in (causal, Mask(), Mask(window_left=50, window_right=1)):
    assert vectors(None, mask, widest) and vectors(None, mask, 64)
    assert not vectors(None, mask, 2 * widest)
    assert vectors(True, mask, 2 * widest) and not vectors(False, mask, 64)
  assert not vectors(True, causal, 64, Scores(scale=0.1))
  assert dataclasses.replace(alibi, alibi=False) == alibi_by_vectors(
      causal, alibi, jax_flash.MosaicBlockSizes(), 64)


@pytest.mark.parametrize("kwargs", [
    {}, dict(is_causal=True),
    dict(local_window_size=(100, 20), dropout_rate=0.2,
         dropout_rng=jax.random.key(3)),
    dict(segment_ids=(jnp.repeat(jnp.arange(4), 128)[None],
                      jnp.repeat(jnp.arange(4), 10)[None]))])
def test_dkdv_runs_split_over_the_queries_match_reference(kwargs):
  """Few keys against many queries: the Triton dK/dV kernel splits each key
  tile's query tiles into runs (here 4 of 8 tiles: 2 programs against 132
  multiprocessors), whose float32 shares are summed: gradients against
  the reference."""
  from pallas_kernels.triton import flash_bwd
  from tests.cases import SMALL_BLOCKS
  assert flash_bwd.dkdv_splits(2, 512 // SMALL_BLOCKS.block_q_dkv, 132) == 4
  assert flash_bwd.dkdv_splits(300, 64, 132) == 1
  compare_with_reference(kwargs, jnp.float32, shape=(1, 512, 40, 2, 1, 32),
                         implementation=KERNEL_IMPL)
