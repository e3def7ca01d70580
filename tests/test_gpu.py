"""GPU-only: the real kernels at realistic sizes, and what a user sees."""
import dataclasses
import itertools
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from pallas_kernels.mosaic_gpu import config, flash_fwd
from jax_flash.testing import assert_attention_close
from tests.cases import Case, compare_with_reference, inputs, plain_attention
from tests.conftest import HOPPER
from tests.test_correctness import _check

pytestmark = pytest.mark.gpu

# A wider sweep than the CPU can afford: every dtype x causal x head-dim class
# at multi-tile, unaligned lengths, with GQA.
SWEEP = [
    Case(2, t, s, 8, k, h, dtype, causal)
    for (dtype, causal, h), (t, s, k) in zip(
        itertools.product(("bfloat16", "float16", "float32"), (False, True),
                          (64, 96, 128, 256)),
        itertools.cycle([(1000, 1000, 8), (2049, 1537, 2), (777, 2048, 1)]))
]


@pytest.mark.parametrize("case", SWEEP, ids=str)
def test_sweep_matches_reference(case):
  _check(case, "pallas")


@pytest.mark.parametrize("version", [1, 2])
def test_long_sequence_bf16(version):
  case = Case(1, 8192, 8192, 4, 2, 128, "bfloat16", True)
  q, k, v, _ = inputs(case)
  out = jax_flash.flash_attention(q, k, v, is_causal=True, version=version)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = jax_flash.reference_attention(*up, is_causal=True)
  plain = plain_attention(q.dtype)(q, k, v, is_causal=True)
  assert_attention_close(out, ref, q.dtype, baseline=plain)


# The Mosaic GPU kernels, forward and backward: what they take, on the
# shapes of benchmarks/mosaic_check.py.
MOSAIC_CASES = {
    "h128_causal_gqa": Case(2, 1024, 1024, 8, 2, 128, "bfloat16", True),
    "h64_mqa_f16": Case(1, 2048, 512, 4, 1, 64, "float16", False),
    "h256_causal": Case(2, 512, 512, 4, 2, 256, "bfloat16", True),
    "t_less_than_s_causal": Case(1, 256, 1536, 8, 2, 128, "bfloat16", True),
    "kv_len_264": Case(1, 1024, 264, 4, 4, 128, "bfloat16", False),
    "kv_len_520_mqa_causal": Case(1, 512, 520, 8, 1, 64, "float16", True),
    "any_length_causal": Case(1, 1000, 1003, 8, 2, 128, "bfloat16", True),
    "any_length_h256": Case(1, 300, 1003, 4, 2, 256, "bfloat16", True),
    "h96_causal_gqa": Case(2, 1000, 1003, 8, 2, 96, "bfloat16", True),
    "h192_f16": Case(1, 512, 777, 4, 2, 192, "float16", False),
    # Past LONG_KV_LEN keys head dim 256 takes 80-row K/V tiles (every
    # one visited, the last partial: 5003 = 62 * 80 + 43).
    "h256_long_keys": Case(1, 256, 5003, 4, 2, 256, "bfloat16", False),
    # Lengths that are multiples of 8 but not of the tiles: read in place,
    # the last tiles reaching past the ends (a second warpgroup's rows
    # wholly past 72 queries; 456 = 3 * 128 + 72), outputs and gradients
    # of every batch row compared.
    "tiles_past_the_ends": Case(3, 72, 1504, 4, 2, 64, "bfloat16", False),
    "tiles_past_the_ends_causal_gqa": Case(2, 456, 456, 8, 2, 128,
                                           "bfloat16", True),
    # Lengths off a multiple of 8 at head dim 64: Q, K, V and the
    # gradients copied untiled (`tiles.tile_buffer`), unpadded.
    "odd_lengths_h64_causal_gqa": Case(2, 999, 1003, 8, 2, 64, "float16",
                                       True),
}


def _random_mask(shape, seed, visible=0.7):
  """A random boolean mask, each pair visible with probability `visible`,
  and the first query row hidden from every key (a row that sees nothing)."""
  m = jax.random.bernoulli(jax.random.key(seed), visible, shape)
  return m.at[..., 0, :].set(False)


def _structured_mask(heads, q_len, kv_len):
  """A dense mask with empty, full and partial 64 x 64 tiles (its tile kinds
  skip and spare them): head h sees keys <= its position + 64 * h, except
  the last 200 keys, with a hole of hidden pairs."""
  rows = jnp.arange(q_len)[:, None]
  cols = jnp.arange(kv_len)[None]
  h = jnp.arange(heads)[:, None, None]
  m = (cols <= rows + 64 * h) & (cols < kv_len - 200)
  return (m & ~((rows // 97 == 3) & (cols // 89 == 2)))[None]


def _packed(b, n, num, seed):
  return jnp.sort(jax.random.randint(jax.random.key(seed), (b, n), 0, num),
                  axis=1)


# The masks and score modifications of the shared description in the Mosaic
# kernels. name: (case, flash_attention's keyword arguments); NaN past the
# lengths where there are lengths.
MOSAIC_OPTIONS = {
    "causal_window_gqa": (Case(1, 1024, 1024, 8, 2, 128, "bfloat16", True),
                          dict(local_window_size=(200, 0))),
    "two_sided_window": (Case(1, 512, 768, 4, 4, 64, "float16", False),
                         dict(local_window_size=(100, 37))),
    "soft_cap_causal_gqa_any_length": (
        Case(1, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(logits_soft_cap=30.0)),
    # A soft-cap on the default tiles of head dims 64 and 128.
    "soft_cap_h64_any_length": (
        Case(2, 1000, 1003, 8, 8, 64, "bfloat16", False),
        dict(logits_soft_cap=30.0)),
    "soft_cap_h64_causal_f16": (
        Case(1, 1024, 1024, 4, 2, 64, "float16", True),
        dict(logits_soft_cap=10.0)),
    "soft_cap_h128_gqa": (Case(1, 777, 1003, 8, 2, 128, "bfloat16", False),
                          dict(logits_soft_cap=30.0)),
    "alibi_h64_f16": (Case(2, 512, 640, 4, 4, 64, "float16", False),
                      dict(alibi_slopes=jnp.linspace(0.01, 0.2, 8).reshape(
                          2, 4))),
    "soft_cap_alibi_h256_causal": (
        Case(1, 512, 512, 4, 2, 256, "bfloat16", True),
        dict(logits_soft_cap=20.0, alibi_slopes=jnp.full((1, 4), 0.05))),
    "alibi_causal_gqa": (
        Case(2, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(alibi_slopes=jnp.linspace(0.02, 1.0, 16).reshape(2, 8))),
    "alibi_window_dropout_h64": (
        Case(1, 777, 777, 4, 4, 64, "bfloat16", True),
        dict(alibi_slopes=jnp.full((1, 4), 0.3), local_window_size=(300, 0),
             dropout_rate=0.1, dropout_rng=jax.random.key(21))),
    "sinks_window_gqa": (
        Case(1, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(sinks=jnp.linspace(-3.0, 3.0, 8), local_window_size=(100, 0))),
    # The reference drops with the same keep bits (`dropout_keep_mask`).
    "dropout_causal_gqa": (
        Case(2, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(dropout_rate=0.2, dropout_rng=jax.random.key(7))),
    "dropout_broadcast_h64": (
        Case(1, 512, 640, 4, 4, 64, "float16", False),
        dict(dropout_rate=0.5, dropout_rng=jax.random.key(8),
             dropout_broadcast=True)),
    "dropout_h256_soft_cap": (
        Case(1, 512, 512, 4, 2, 256, "bfloat16", True),
        dict(dropout_rate=0.1, dropout_rng=jax.random.key(9),
             logits_soft_cap=30.0)),
    "lengths_causal_gqa": (
        Case(2, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(query_seq_lengths=jnp.array([1000, 17]),
             key_value_seq_lengths=jnp.array([640, 1003]))),
    "segments_h64_f16": (
        Case(2, 1024, 1024, 4, 4, 64, "float16", False),
        dict(segment_ids=(_packed(2, 1024, 5, 1), _packed(2, 1024, 5, 1)))),
    # Dense masks.
    "dense_mask_causal_gqa": (
        Case(1, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(mask=_random_mask((1, 1, 1000, 1003), 10))),
    "dense_mask_per_head_h64_f16": (
        Case(2, 512, 640, 4, 4, 64, "float16", False),
        dict(mask=_random_mask((2, 4, 512, 640), 11))),
    "dense_mask_h256_lengths": (
        Case(1, 512, 600, 4, 2, 256, "bfloat16", True),
        dict(mask=_random_mask((1, 4, 512, 600), 12, visible=0.9),
             key_value_seq_lengths=jnp.array([550]))),
    "dense_mask_h96_window": (
        Case(1, 700, 700, 4, 2, 96, "bfloat16", False),
        dict(mask=_random_mask((1, 1, 700, 700), 13),
             local_window_size=(128, 64))),
    "dense_mask_structured_gqa": (
        Case(1, 1000, 1003, 8, 2, 128, "bfloat16", False),
        dict(mask=_structured_mask(8, 1000, 1003))),
    "dense_mask_structured_h64_causal": (
        Case(2, 777, 900, 4, 4, 64, "float16", True),
        dict(mask=_structured_mask(1, 777, 900))),
    # 96-row K/V tiles (head dim 192's) over the mask's 64 x 64 tile kinds.
    "dense_mask_structured_h192": (
        Case(1, 1000, 1003, 4, 2, 192, "bfloat16", False),
        dict(mask=_structured_mask(4, 1000, 1003))),
    # A bias (with its gradient, from the Triton dbias kernel).
    "bias_causal_gqa": (
        Case(1, 1000, 1003, 8, 2, 128, "bfloat16", True),
        dict(bias=jax.random.normal(jax.random.key(14), (1, 8, 1000, 1003)))),
    "bias_keys_h64_f16_head_mask": (
        Case(2, 512, 640, 4, 4, 64, "float16", False),
        dict(bias=jax.random.normal(jax.random.key(15), (2, 4, 1, 640)),
             mask=jax.random.bernoulli(jax.random.key(16), 0.8,
                                       (1, 4, 1, 640)))),
    "bias_rows_h256_lengths": (
        Case(1, 512, 600, 4, 2, 256, "bfloat16", True),
        dict(bias=jax.random.normal(jax.random.key(17), (1, 1, 512, 1)),
             key_value_seq_lengths=jnp.array([550]))),
    # Head dim 64 at lengths off a multiple of 8 (untiled copies).
    "lengths_dropout_h64_odd": (
        Case(2, 999, 1003, 4, 2, 64, "bfloat16", True),
        dict(query_seq_lengths=jnp.array([999, 13]),
             key_value_seq_lengths=jnp.array([1003, 501]),
             dropout_rate=0.2, dropout_rng=jax.random.key(18))),
    "bias_soft_cap_alibi_h64_odd": (
        Case(1, 197, 1500, 4, 2, 64, "float16", False),
        dict(bias=jax.random.normal(jax.random.key(19), (1, 4, 197, 1500)),
             logits_soft_cap=20.0,
             alibi_slopes=jnp.linspace(0.01, 0.1, 4).reshape(1, 4))),
    # Head dims in column parts (`layout.Columns`) with score options.
    "dropout_soft_cap_h72_parts": (
        Case(2, 1000, 1003, 8, 2, 72, "bfloat16", True),
        dict(dropout_rate=0.2, dropout_rng=jax.random.key(20),
             logits_soft_cap=30.0)),
    "segments_sinks_h40_parts": (
        Case(2, 512, 520, 4, 2, 40, "float16", False),
        dict(segment_ids=(_packed(2, 512, 4, 4), _packed(2, 520, 4, 4)),
             sinks=jnp.linspace(-2.0, 2.0, 4))),
    "segments_lengths_h256_causal": (
        Case(1, 512, 600, 4, 2, 256, "bfloat16", True),
        dict(segment_ids=(_packed(1, 512, 3, 2), _packed(1, 600, 3, 3)),
             key_value_seq_lengths=jnp.array([550]))),
    # The backward's last streamed tile on part of its rows
    # (`layout.tail_rows`): dQ's 128-row K/V tiles on 64 of 300 % 128 keys;
    # at head dim 40 (parts 32 + 16), dK/dV's Q/dO tiles on 32 of 200 % 64
    # queries and dQ's on 96 of 330 % 128 keys.
    "tail_segments_dropout_h64": (
        Case(2, 257, 300, 4, 2, 64, "bfloat16", True),
        dict(segment_ids=(_packed(2, 257, 3, 5), _packed(2, 300, 3, 6)),
             dropout_rate=0.2, dropout_rng=jax.random.key(21))),
    "tail_dense_mask_soft_cap_h40": (
        Case(1, 200, 330, 4, 4, 40, "float16", False),
        dict(mask=_random_mask((1, 4, 200, 330), 22), logits_soft_cap=20.0)),
}


def _default_with(case, **fields):
  """The Mosaic kernels' default tiles for `case` (its head dim, causality
  and key length, as the dispatch picks them), `fields` replaced."""
  return dataclasses.replace(
      jax_flash.MosaicBlockSizes.get_default(case.head_dim, case.causal,
                                             kv_len=case.kv_len),
      **fields)


def _compare_mosaic(case, options=None, blocks=None):
  """The Mosaic kernels on `case` with flash_attention's keyword `options`
  and tiles `blocks` (None: the defaults), forward and gradients against
  the reference; NaN past the lengths where there are lengths."""
  options = options or {}
  lengths = {"query_seq_lengths", "key_value_seq_lengths"} & set(options)
  compare_with_reference(dict(is_causal=case.causal, **options), case.dtype,
                         shape=case.shape, block_sizes=blocks,
                         implementation="mosaic", garbage=bool(lengths))


@pytest.mark.parametrize("name", MOSAIC_CASES)
def test_mosaic_matches_reference(name):
  _compare_mosaic(MOSAIC_CASES[name])


@pytest.mark.parametrize("name", MOSAIC_OPTIONS)
def test_mosaic_masks_and_scores_match_reference(name):
  _compare_mosaic(*MOSAIC_OPTIONS[name])


@pytest.mark.parametrize("name", ["h128_causal_gqa", "h64_mqa_f16",
                                  "any_length_h256", "h96_causal_gqa"])
def test_mosaic_named_barriers_match_reference(name):
  """`MosaicBlockSizes(named_barriers=True)`: the forward's consumers
  staggered through hardware barriers, the default tiles otherwise."""
  case = MOSAIC_CASES[name]
  _compare_mosaic(case, blocks=_default_with(case, named_barriers=True))


@pytest.mark.parametrize("option", [dict(producer_registers=24),
                                    dict(dv_before_ds=True)],
                         ids=["producer_registers_24", "dv_before_ds"])
@pytest.mark.parametrize("name", ["h128_causal_gqa", "h64_mqa_f16"])
def test_mosaic_register_options_match_reference(name, option):
  """The register options of `MosaicBlockSizes` (forward and gradients),
  the default tiles otherwise."""
  case = MOSAIC_CASES[name]
  _compare_mosaic(case, blocks=_default_with(case, **option))


@pytest.mark.parametrize("name", ["alibi_causal_gqa",
                                  "alibi_window_dropout_h64",
                                  "soft_cap_alibi_h256_causal",
                                  "alibi_h64_f16",
                                  "bias_soft_cap_alibi_h64_odd"])
def test_mosaic_alibi_vectors_match_reference(name):
  """`MosaicBlockSizes(alibi_vectors=True)`: ALiBi added from a row and a
  column vector, on causal masks and without one (|.| of their
  difference), forward and gradients."""
  case, options = MOSAIC_OPTIONS[name]
  _compare_mosaic(case, options,
                  blocks=_default_with(case, alibi_vectors=True))


@pytest.mark.parametrize("name", ["alibi_causal_gqa",
                                  "alibi_window_dropout_h64",
                                  "soft_cap_alibi_h256_causal"])
@pytest.mark.parametrize("fold", [True, False])
def test_mosaic_alibi_fold_matches_reference(name, fold):
  """`MosaicBlockSizes.alibi_fold` on and off: ALiBi's query term in the
  forward's row max and the backward's logsumexp, or in each score,
  forward and gradients (causal masks, where it applies)."""
  case, options = MOSAIC_OPTIONS[name]
  _compare_mosaic(case, options, blocks=_default_with(
      case, alibi_vectors=True, alibi_fold=fold))


@pytest.mark.parametrize("group", [1, 4, 8, 16, 32, 64, 71])
@pytest.mark.parametrize("splits", [3, 8])
def test_mosaic_dkv_head_splits_match_reference(group, splits):
  """`MosaicBlockSizes(dkv_head_splits=...)`: the dK/dV kernel's CTAs take
  shares of a KV head's query heads (uneven where the group does not
  divide), the partials summed after it; unaligned lengths."""
  kv_heads = 2 if group <= 8 else 1
  case = Case(2, 777, 1003, group * kv_heads, kv_heads, 64, "bfloat16",
              True)
  _compare_mosaic(case, blocks=_default_with(case, dkv_head_splits=splits))


@pytest.mark.parametrize("name", [
    "causal_window_gqa", "dropout_causal_gqa", "soft_cap_alibi_h256_causal",
    "sinks_window_gqa", "lengths_causal_gqa", "dense_mask_causal_gqa"])
def test_mosaic_dkv_head_splits_with_options(name):
  case, options = MOSAIC_OPTIONS[name]
  _compare_mosaic(case, options,
                  blocks=_default_with(case, dkv_head_splits=2))


def test_mosaic_dkv_head_splits_are_deterministic():
  case = Case(4, 2048, 2048, 71, 1, 64, "bfloat16", True)
  q, k, v, _ = inputs(case)
  blocks = _default_with(case, dkv_head_splits=8)
  grad = jax.jit(jax.grad(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, implementation="mosaic",
      block_sizes=blocks).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  first, second = grad(q, k, v), grad(q, k, v)
  for a, b in zip(first, second):
    assert jnp.array_equal(a, b)


FUSED_DQ_CASES = {  # Head dims 128 and 64 (what `fused_dq` takes).
    **{name: (MOSAIC_CASES[name], {}) for name in (
        "h128_causal_gqa", "t_less_than_s_causal", "any_length_causal",
        "kv_len_264", "h64_mqa_f16", "kv_len_520_mqa_causal",
        "odd_lengths_h64_causal_gqa")},
    **{name: MOSAIC_OPTIONS[name] for name in (
        "causal_window_gqa", "soft_cap_causal_gqa_any_length",
        "dropout_causal_gqa", "lengths_causal_gqa", "dense_mask_causal_gqa",
        "sinks_window_gqa", "two_sided_window", "dropout_broadcast_h64",
        "segments_h64_f16", "dense_mask_per_head_h64_f16")},
}


@pytest.mark.parametrize("name", FUSED_DQ_CASES)
def test_mosaic_fused_dq_matches_reference(name):
  """`MosaicBlockSizes(fused_dq=True)`: dQ from the dK/dV kernel by TMA
  reduce-add, against the reference (its tolerances: the order of the
  additions varies, the sum does not)."""
  case, options = FUSED_DQ_CASES[name]
  _compare_mosaic(case, options, jax_flash.MosaicBlockSizes.get_default(
      case.head_dim, case.causal, fused_dq=True))


PERSISTENT_CASES = {  # Each CTA runs items of unequal lengths in turn.
    **{name: (MOSAIC_CASES[name], {}) for name in (
        "h128_causal_gqa", "h64_mqa_f16", "any_length_h256",
        "h96_causal_gqa", "t_less_than_s_causal", "kv_len_520_mqa_causal",
        "odd_lengths_h64_causal_gqa")},
    **{name: MOSAIC_OPTIONS[name] for name in (
        "lengths_causal_gqa", "segments_h64_f16", "dense_mask_causal_gqa",
        "sinks_window_gqa", "dropout_causal_gqa", "two_sided_window",
        "dropout_soft_cap_h72_parts", "segments_sinks_h40_parts")},
}


@pytest.mark.parametrize("name", PERSISTENT_CASES)
def test_mosaic_persistent_forward_matches_reference(name, monkeypatch):
  """`MosaicBlockSizes(persistent=True)` with 5 CTAs (in place of one a
  multiprocessor), so each runs many items and the K/V ring carries over
  from one to the next: forward and gradients against the reference."""
  monkeypatch.setattr(flash_fwd, "num_multiprocessors", lambda: 5)
  case, options = PERSISTENT_CASES[name]
  _compare_mosaic(case, options, _default_with(case, persistent=True))


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_persistent_forward_on_every_multiprocessor(causal):
  """The persistent forward with the GPU's own CTA count (a round of
  items on every multiprocessor, `persistent_order`'s table under a causal
  mask) at 2k: 256 items (of unequal length under the causal mask) on
  the GPU's multiprocessors (132 on an H200)."""
  case = Case(2, 2048, 2048, 8, 2, 128, "bfloat16", causal)
  _compare_mosaic(case, blocks=_default_with(case, persistent=True))


KV80_CASES = {  # 80-row K/V tiles: partial last tiles, masks, options.
    **{name: (MOSAIC_CASES[name], {}) for name in (
        "h256_causal", "any_length_h256", "h128_causal_gqa",
        "any_length_causal", "kv_len_264", "h192_f16")},
    **{name: MOSAIC_OPTIONS[name] for name in (
        "soft_cap_alibi_h256_causal", "dropout_h256_soft_cap",
        "lengths_causal_gqa", "segments_h64_f16", "sinks_window_gqa",
        "two_sided_window", "dense_mask_structured_gqa",
        "dense_mask_structured_h64_causal")},
}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("name", KV80_CASES)
def test_mosaic_80_row_key_tiles_match_reference(name, persistent):
  """`MosaicBlockSizes(block_kv=80)` (V's tile with a 32-byte swizzle, no
  reduction scratch: what fits head dim 256's shared memory), one CTA an
  item or persistent: forward and gradients against the reference."""
  case, options = KV80_CASES[name]
  _compare_mosaic(case, options,
                  _default_with(case, block_kv=80, persistent=persistent))


# Head dims off 64/96/128/192/256: multiples of 16 unpadded (32-byte
# swizzled rows at 80, 112, 144, 208, 240), others padded to the next
# (`config.kernel_head_dim`); a value head dim of its own (MLA); keys in
# one short tile (`config.short_kv_tile`). name: (case, value head dim).
MOSAIC_HEAD_DIMS = {
    "h80_causal_gqa": (Case(2, 1000, 1003, 8, 2, 80, "bfloat16", True), None),
    "h72_short_tokens": (Case(3, 256, 256, 4, 4, 72, "bfloat16", False),
                         None),
    "h40_cross_77_keys": (Case(2, 777, 77, 4, 4, 40, "float16", False), None),
    "h32_causal": (Case(1, 640, 640, 4, 1, 32, "bfloat16", True), None),
    "h112_f16": (Case(1, 512, 777, 4, 2, 112, "float16", False), None),
    "h144_causal": (Case(1, 512, 600, 4, 2, 144, "bfloat16", True), None),
    "h208": (Case(1, 300, 1003, 4, 2, 208, "bfloat16", False), None),
    "h240_causal_long_keys": (Case(1, 256, 5003, 4, 2, 240, "bfloat16",
                                   False), None),
    "h20_padded": (Case(1, 300, 300, 4, 4, 20, "bfloat16", False), None),
    "mla_192_128_causal": (Case(1, 1000, 1003, 8, 8, 192, "bfloat16", True),
                           128),
    "mla_128_64_gqa": (Case(2, 512, 640, 8, 2, 128, "float16", False), 64),
    "v_wider_64_128": (Case(1, 512, 512, 4, 4, 64, "bfloat16", True), 128),
    "vit_197_tokens": (Case(4, 197, 197, 12, 12, 64, "bfloat16", False),
                       None),
    # The last query tile's second warpgroup has no rows: it only releases.
    "vit_257_tokens_h80": (Case(3, 257, 257, 4, 4, 80, "bfloat16", False),
                           None),
    "whisper_cross_448_1500": (Case(2, 448, 1500, 4, 4, 64, "bfloat16",
                                    False), None),
    "h32_odd_lengths_causal": (Case(2, 1500, 1003, 4, 2, 32, "float16",
                                    True), None),
    "h64_77_keys": (Case(2, 301, 77, 4, 4, 64, "bfloat16", False), None),
    # Head dims off a multiple of 16 in column parts (`layout.Columns`):
    # 64 + 64 + 64 + 16 columns, the last reaching past 200; 32 past 24.
    "h200_parts_causal": (Case(1, 1000, 1003, 8, 2, 200, "bfloat16", True),
                          None),
    "h24_parts_f16": (Case(2, 999, 1003, 4, 2, 24, "float16", False), None),
}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("name", MOSAIC_HEAD_DIMS)
def test_mosaic_head_dims_match_reference(name, persistent, monkeypatch):
  """Forward and gradients against the reference, the default tiles, one
  CTA an item or persistent (5 CTAs, so each runs many items)."""
  case, value_head_dim = MOSAIC_HEAD_DIMS[name]
  dim = config.kernel_head_dim(case.head_dim,
                               value_head_dim or case.head_dim)
  blocks = dataclasses.replace(jax_flash.MosaicBlockSizes.get_default(
      dim, case.causal, kv_len=case.kv_len), persistent=persistent)
  monkeypatch.setattr(flash_fwd, "num_multiprocessors", lambda: 5)
  compare_with_reference(dict(is_causal=case.causal), case.dtype,
                         shape=case.shape, block_sizes=blocks,
                         implementation="mosaic",
                         value_head_dim=value_head_dim)


def test_default_on_h200_is_mosaic_where_it_takes_the_call():
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, _ = inputs(MOSAIC_CASES["h128_causal_gqa"])
  hlo = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True)).lower(q, k, v).as_text()
  assert "mosaic_gpu" in hlo


# Short keys (the dispatch's `NEXT_IS_FASTER`): the Mosaic forward where it
# reads the arrays in place, the Mosaic backward where it does and the keys
# exceed 128. name: (case, whether the forward is Mosaic's, whether
# the backward is).
DEFAULT_SHORT_KEYS = {
    "dit_h72": (Case(4, 256, 256, 4, 4, 72, "bfloat16", False), True, True),
    "vit_197_h64": (Case(4, 197, 197, 4, 4, 64, "bfloat16", False), True,
                    True),
    "vit_257_h80": (Case(2, 257, 257, 4, 4, 80, "bfloat16", False), True,
                    True),
    "clip_77_causal": (Case(4, 77, 77, 4, 4, 64, "float16", True), True,
                       False),
    # 96-row K/V tiles in column parts 32 + 16; the Triton dK/dV kernel's
    # query tiles split into runs.
    "sd_cross_h40_77_keys": (Case(2, 4096, 77, 8, 8, 40, "bfloat16", False),
                             True, False),
    "h20_77_keys": (Case(2, 300, 77, 4, 4, 20, "float16", False), False,
                    False),
}


@pytest.mark.parametrize("name", DEFAULT_SHORT_KEYS)
def test_default_short_keys_pair_the_backends(name):
  """The default's forward and backward kernels (named in the program) and
  its results against the reference."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  case, mosaic_forward, mosaic_backward = DEFAULT_SHORT_KEYS[name]
  q, k, v, _ = inputs(case)
  hlo = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_flash.flash_attention(
      q, k, v, is_causal=case.causal).astype(jnp.float32)),
                         argnums=(0, 1, 2))).lower(q, k, v).as_text()
  assert ("flash_attention_forward_mosaic" in hlo) == mosaic_forward
  assert ("flash_attention_backward_dkdv" in hlo) != mosaic_backward
  assert ("flash_attention_dkv_mosaic" in hlo) == mosaic_backward
  compare_with_reference(dict(is_causal=case.causal), case.dtype,
                         shape=case.shape, block_sizes=None,
                         implementation=None)


def test_default_implementation_on_gpu_is_pallas():
  case = Case(1, 300, 300, 2, 2, 64, "bfloat16", True)
  q, k, v, _ = inputs(case)
  hlo = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True)).lower(q, k, v).as_text()
  assert "flash_attention_forward" in hlo


def test_large_gradients_are_deterministic():
  case = Case(2, 4096, 4096, 8, 2, 128, "bfloat16", True)
  q, k, v, do = inputs(case)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      jax_flash.flash_attention(q, k, v, is_causal=True) * do),
      argnums=(0, 1, 2)))
  first = jax.device_get(f(q, k, v))
  for _ in range(3):
    chex.assert_trees_all_equal(first, f(q, k, v))


def test_no_deprecation_warning_reaches_the_user():
  script = textwrap.dedent("""
      import warnings
      warnings.simplefilter("default")
      import jax, jax.numpy as jnp
      import jax_flash
      x = jax.random.normal(jax.random.key(0), (1, 256, 2, 64), jnp.bfloat16)
      for _ in range(3):
        jax.block_until_ready(jax.grad(lambda x: jnp.sum(
            jax_flash.flash_attention(x, x, x, is_causal=True)
            .astype(jnp.float32)))(x))
      print("ran")
  """)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, env=env, timeout=300)
  assert "ran" in result.stdout, result.stderr
  assert "Pallas Triton backend is deprecated" not in result.stderr
