"""The Mosaic GPU kernels (forward, dK/dV, dQ, decode) and their variants
lower for an H200 on the CPU (the dispatch's choices: tests/test_dispatch.py;
host-side schedules: tests/test_schedules.py).

`jax.jit(...).lower(lowering_platforms=("cuda",))` under an abstract mesh
whose device is an "NVIDIA H200" runs the Pallas Mosaic GPU lowering here:
layout inference, the wgmma shape rules and the shared-memory budget, so a
bad tile or layout fails on the CPU. (ptxas runs when XLA compiles on the
GPU; the kernel's numbers are checked there: tests/test_gpu.py.)
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

import jax_flash
from jax_flash.core.mask import Mask
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu import config, flash_fwd, layout
from pallas_kernels.mosaic_gpu.backend import MosaicGpuBackend
from tests.lowering import (H200, MOSAIC_BACKWARD, MOSAIC_CALL,
                            TRITON_BACKWARD, kernel_modules,
                            kernel_operands, lower_decode, lower_flex,
                            lower_forward, lower_grad, sequence_copies)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
# 520 keys: not a multiple of the dK/dV kernel's 128-row tile (padded).
@pytest.mark.parametrize("kv_len", [512, 520])
def test_mosaic_forward_and_backward_lower(dtype, head_dim, causal, kv_len):
  """Head dim 256: dK and dV split between the warpgroups, one dQ
  warpgroup (shared memory and registers); the same kernels' code."""
  text = lower_grad("mosaic", (2, 256, kv_len, 8, 2, head_dim), dtype,
                    is_causal=causal)
  assert "flash_attention_forward_mosaic" in text
  for name in MOSAIC_BACKWARD:
    assert name in text
  for name in TRITON_BACKWARD:
    assert name not in text


def test_mosaic_backward_tiles_by_keyword():
  blocks = jax_flash.MosaicBlockSizes(block_q_dkv=128, block_kv_dkv=64,
                                      block_q_dq=64, block_kv_dq=128,
                                      num_stages_bwd=3)
  text = lower_grad("mosaic", (1, 256, 384, 4, 4, 64), jnp.bfloat16,
                    block_sizes=blocks)
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("heads, kv_heads, splits", [
    (8, 8, 4), (8, 2, 4), (16, 2, 8), (71, 1, 8), (71, 1, 71), (64, 1, 3)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_dkv_head_splits_lower(heads, kv_heads, splits, head_dim):
  """dkv_head_splits: the dK/dV kernel over KV heads x shares of the
  group (the last share smaller where the group does not divide), the
  partials summed in float32 after it."""
  blocks = dataclasses.replace(
      jax_flash.MosaicBlockSizes.get_default(head_dim, is_causal=True),
      dkv_head_splits=splits)
  text = lower_grad("mosaic", (2, 200, 200, heads, kv_heads, head_dim),
                    jnp.bfloat16, is_causal=True, block_sizes=blocks)
  assert all(name in text for name in MOSAIC_BACKWARD)
  share = -(-(heads // kv_heads) // min(splits, heads // kv_heads))
  parts = -(-(heads // kv_heads) // share)
  if parts > 1:
    assert re.search(rf"tensor<2x\d+x{kv_heads}x{parts}x{head_dim}xf32>",
                     text)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("q_len, kv_len", [(77, 77), (300, 1003), (1, 1),
                                          (1, 300), (300, 1)])
def test_mosaic_takes_any_length(head_dim, q_len, kv_len):
  """XLA pads to the tiles, a length of 1 too (TMA's strides: 16-byte
  multiples); the kernels mask keys past kv_len."""
  text = lower_grad("mosaic", (1, q_len, kv_len, 4, 2, head_dim),
                    jnp.bfloat16, is_causal=True)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_mosaic_reads_any_length_in_place(causal, head_dim):
  """Lengths that are multiples of 8 but not of the tiles (448 queries on
  1504 keys) and lengths off a multiple of 8 (1500 keys): the kernels read
  Q, K, V, dO and write O and the gradients where they lie (tiles reach
  past the ends; untiled copies in column parts at 1500 keys), so the forward+backward holds no pad or slice
  of them."""
  for kv_len in (1504, 1500):
    text = lower_grad("mosaic", (2, 448, kv_len, 4, 2, head_dim),
                      jnp.bfloat16, is_causal=causal)
    assert all(name in text for name in MOSAIC_BACKWARD)
    assert sequence_copies(text) == [], (kv_len, sequence_copies(text))


@pytest.mark.parametrize("head_dim, block_kv, parts", [
    (128, 128, ((0, 128),)), (64, 256, ((0, 64),)),
    (72, 256, ((0, 64), (64, 16))), (40, 256, ((0, 32), (32, 16))),
    (24, 128, ((0, 32),)),
    (200, 64, ((0, 64), (64, 64), (128, 64), (192, 16))),
    # V's 80- and 96-row tiles take no 64-column atom (their swizzle
    # follows their rows); 40 bytes a row of 20 are no TMA stride.
    (72, 80, None), (136, 96, None), (20, 256, None)])
def test_column_parts_of_a_head_dim(head_dim, block_kv, parts):
  cols = layout.Columns.of(jnp.bfloat16, head_dim, block_kv)
  assert (cols and cols.parts) == parts
  if parts and len(parts) > 1:
    assert cols.untiled == (True, True)


@pytest.mark.parametrize("head_dim, length, contraction", [
    (128, 256, 64), (64, 257, 64), (80, 256, 16), (80, 257, 64),
    (40, 77, 32), (32, 256, 32), (24, 256, 32)])
def test_a_matmul_over_tile_rows_takes_them_by_its_swizzle(head_dim, length,
                                                           contraction):
  """wgmma's K group is its operand's swizzle in elements: 128-byte rows
  take 64 rows at a time, 64-byte rows 32, 160-byte rows (head dim 80 in
  one part, 32-byte swizzle) 16; the widest part decides."""
  cols = layout.Columns.of(jnp.bfloat16, head_dim, 128, length, length)
  assert cols.contraction_rows(jnp.bfloat16) == contraction


@pytest.mark.parametrize("length, block, multiple, rows", [
    (257, 128, 64, 64), (300, 128, 64, 64), (257, 64, 64, 64),
    (256, 128, 64, 128), (330, 128, 32, 96), (200, 64, 32, 32),
    (77, 128, 16, 80), (1, 64, 16, 16), (64, 64, 64, 64)])
def test_last_streamed_tile_computes_rows_up_to_the_length(length, block,
                                                           multiple, rows):
  assert layout.tail_rows(length, block, multiple) == rows


@pytest.mark.parametrize("head_dim, block_kv, lengths, parts", [
    (80, 320, (257, 257), ((0, 64), (64, 16))),
    (128, 128, (448, 1500), ((0, 64), (64, 64))),
    (112, 128, (1000, 1003), ((0, 64), (64, 32), (96, 16))),
    (80, 320, (256, 256), ((0, 80),)),
    (192, 96, (1000, 1003), ((0, 192),))])
def test_wide_head_dims_at_lengths_off_8_run_in_parts(head_dim, block_kv,
                                                      lengths, parts):
  """A head dim wider than a swizzle atom at a length off a multiple of 8
  runs in parts one atom wide, read in place (no tiled copy, no pad);
  where V's tiles cannot take them (96 rows) it stays one part, copied."""
  cols = layout.Columns.of(jnp.bfloat16, head_dim, block_kv, *lengths)
  assert cols.parts == parts
  assert cols.copies(*lengths) == (parts == ((0, 192),))


@pytest.mark.parametrize("head_dim, kwargs", [
    (72, {}), (40, dict(is_causal=True)), (200, dict(is_causal=True)),
    (24, {}), (72, dict(dropout_rate=0.1, dropout_rng=jax.random.key(0),
                        logits_soft_cap=20.0)),
    (72, dict(block_sizes=jax_flash.MosaicBlockSizes(block_kv=128,
                                                     persistent=True),
              is_causal=True))])
def test_head_dims_off_16_run_in_column_parts_in_place(head_dim, kwargs):
  """Head dims off a multiple of 16 (DiT's 72, a UNet's 40): the forward
  reads Q, K, V and writes O in column parts (`layout.Columns`) where they
  lie: no pad or slice of them; at 80-row K/V tiles (no 64-column part
  for V) the head dim is padded to 80 as before."""
  shape = (2, 1000, 1003, 8, 2)
  text = lower_forward(shape, head_dim, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert sequence_copies(text) == []
  text = lower_forward(shape, 72, block_sizes=jax_flash.MosaicBlockSizes(
      block_kv=80))
  assert ("tensor<2x1000x8x72xbf16>", "tensor<2x1000x8x80xbf16>") in (
      sequence_copies(text))


@pytest.mark.parametrize("head_dim", [32, 64])
def test_tiles_one_swizzle_atom_wide_read_any_length_in_place(head_dim):
  """Head dims 32 and 64 (tiles one swizzle atom wide, copied untiled:
  `tiles.tile_buffer`) at lengths off a multiple of 8 (448 on 1500 keys):
  neither the forward nor the backward holds a pad or slice. Wider head
  dims at such lengths run in parts one atom wide (`layout.Columns`: 64 +
  64 at 128, 64 + 16 at 80), read in place too; at 96-row K/V tiles (head
  dim 192: V's tiles take no 64-column atom) the forward's K and V are
  padded to 1504, its backward's parts read them in place."""
  shape = (2, 448, 1500, 4, 2)
  assert "flash_attention_forward_mosaic" in lower_forward(shape, head_dim)
  assert sequence_copies(lower_grad("mosaic", (*shape, head_dim))) == []
  for wide in (80, 128):
    assert sequence_copies(lower_forward(shape, wide)) == []
  pads = {("tensor<2x1500x2x192xbf16>", "tensor<2x1504x2x192xbf16>")}
  assert set(sequence_copies(lower_forward(shape, 192))) == pads
  assert set(sequence_copies(lower_grad("mosaic", (*shape, 192)))) == pads


def test_keys_padded_at_the_source_are_read_in_place():
  """Keys padded once by the caller to a multiple of 8 and hidden by
  segment ids (docs/performance.md): no pad, slice or select of a
  [B, S, K, H] array around the kernels; lengths instead zero the padded
  rows (they may hold NaN) with a select over K and V."""
  q_ids = jnp.zeros((2, 448), jnp.int32)
  kv_ids = jnp.broadcast_to(jnp.arange(1504) >= 1500, (2, 1504)).astype(
      jnp.int32)
  selects = r"stablehlo\.select[^\n]*tensor<\d+x\d+x\d+x\d+xbf16>"
  text = lower_grad("mosaic", (2, 448, 1504, 4, 2, 64), jnp.bfloat16,
                    segment_ids=(q_ids, kv_ids))
  assert sequence_copies(text) == [] and not re.findall(selects, text)
  text = lower_grad("mosaic", (2, 448, 1504, 4, 2, 64), jnp.bfloat16,
                    key_value_seq_lengths=jnp.array([1500, 1500]))
  assert re.findall(selects, text)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("kwargs", [
    dict(), dict(local_window_size=100, sinks=jnp.zeros((8,)),
                 logits_soft_cap=30.0)], ids=["causal", "window_sinks_cap"])
def test_mosaic_decodes_a_prompt_chunk(page_size, kwargs):
  """65 or more new tokens: the Mosaic forward with query offsets and key
  ids (a paged cache gathered first), named or by default on an H200."""
  for implementation in ("mosaic", None):
    text = lower_decode(implementation, 300, page_size, **kwargs)
    assert "flash_attention_forward_mosaic" in text, implementation


def test_mosaic_decodes_a_few_tokens_against_a_contiguous_cache():
  """Short chunks against a contiguous cache at head dim 128: the Mosaic
  split-KV kernel, named or by default on an H200; against a paged cache,
  or with more query rows than a CTA takes, Triton's split-KV kernel
  ("pallas", the default), and naming Mosaic says why."""
  for implementation in ("mosaic", "pallas", None):
    text = lower_decode(implementation, 8)
    assert "flash_attention_decode_mosaic" in text, implementation
  for implementation in ("pallas", None):
    assert MOSAIC_CALL not in lower_decode(implementation, 8, 16)
  with pytest.raises(ValueError, match="fewer only where the cache is "
                     "contiguous .* got 8"):
    lower_decode("mosaic", 8, 16)
  with pytest.raises(ValueError, match="query rows .* at most 64"):
    lower_decode("mosaic", 17)  # 4 query heads a KV head x 17 > 64.


@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("heads_per_cta", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_split_kv_decode_lowers_within_shared_memory(
    head_dim, heads_per_cta, consumers):
  """The Mosaic split-KV decode kernel lowers for an H200 at its default
  stage count, bounded by shared memory (at head dim 256 and with two
  consumers' outputs), tiles of one KV head or both, on 5 CTAs (runs
  crossing groups: two Q buffers, one at head dim 256)."""
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu import flash_decode as mosaic_decode
  q = jax.ShapeDtypeStruct((3, 1, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((3, 1000, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)
  assert mosaic_decode.max_stages(head_dim, 64, 2, consumers) == {
      (64, 1): 12, (128, 1): 5, (256, 1): 1,  # Two Q buffers (one: 2).
      (64, 2): 10, (128, 2): 4, (256, 2): 0}[head_dim, consumers]

  def f(q, k, v, lengths):
    return mosaic_decode.flash_decode(
        q, k, v, lengths, scores=Scores(scale=0.1), mask=Mask(is_causal=True),
        heads_per_cta=heads_per_cta, consumers=consumers, num_ctas=5)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    lower = lambda: jax.jit(f).trace(q, kv, kv, lengths).lower(
        lowering_platforms=("cuda",)).as_text()
    if head_dim == 256 and consumers == 2:
      with pytest.raises(ValueError, match="exceed shared memory"):
        lower()
    else:
      assert MOSAIC_CALL in lower()


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_forward_lowers_with_named_barriers(causal):
  """The consumers' schedule on hardware barriers (`named_barriers`): the
  same kernel with bar.sync / bar.arrive in place of the mbarrier."""
  blocks = jax_flash.MosaicBlockSizes(named_barriers=True)
  named = lower_grad("mosaic", (1, 300, 1003, 4, 2, 128), jnp.bfloat16,
                     is_causal=causal, block_sizes=blocks)
  plain = lower_grad("mosaic", (1, 300, 1003, 4, 2, 128), jnp.bfloat16,
                     is_causal=causal)
  for barrier_id in (4, 5, 6, 7):
    for op in (f"bar.sync {barrier_id}, 256", f"bar.arrive {barrier_id}, 256"):
      assert op in named and op not in plain


@pytest.mark.parametrize("kwargs", [
    dict(), dict(is_causal=True),
    dict(is_causal=True, local_window_size=100, logits_soft_cap=30.0,
         sinks=jnp.zeros((8,))),
    dict(segment_ids=(jnp.zeros((2, 300), jnp.int32),
                      jnp.zeros((2, 1003), jnp.int32))),
    dict(mask=jnp.ones((1, 1, 300, 1003), bool),
         dropout_rate=0.1, dropout_rng=jax.random.key(0)),
], ids=["plain", "causal", "window_cap_sinks", "segments", "dense_dropout"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_forward_lowers_with_a_cta_per_multiprocessor(
    kwargs, head_dim, monkeypatch):
  """`persistent`: the forward's grid is one CTA a multiprocessor (fewer
  when there are fewer items), each looping over its items."""
  grids = []
  launch = flash_fwd.plgpu.kernel

  def kernel(body, **kw):
    grids.append(kw["grid"])
    return launch(body, **kw)
  monkeypatch.setattr(flash_fwd.plgpu, "kernel", kernel)
  monkeypatch.setattr(flash_fwd, "num_multiprocessors", lambda: 7)
  blocks = jax_flash.MosaicBlockSizes.get_default(
      head_dim, kwargs.get("is_causal", False))
  blocks = dataclasses.replace(blocks, persistent=True)
  text = lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
                    block_sizes=blocks, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert grids.count((7,)) == 1, grids  # 48 items of 128 rows on 7 CTAs.


def test_producer_registers_set_every_kernels_split():
  """`producer_registers` is each kernel's `setmaxnreg` split: the producer
  warpgroup's count, the consumers' the rest."""
  modules = kernel_modules(lower_grad(
      "mosaic", (1, 300, 1003, 4, 2, 128), is_causal=True,
      block_sizes=jax_flash.MosaicBlockSizes(producer_registers=24)))
  assert len(modules) == 3
  for module in modules.values():
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in module
    assert "setmaxnreg.inc.sync.aligned.u32 240;" in module
    assert "u32 40;" not in module and "u32 232;" not in module


def test_dv_before_ds_changes_the_dkv_kernel():
  """(Serialized modules are compared only for a difference: the same
  kernel lowered twice need not match byte for byte.)"""
  shape = (1, 300, 1003, 4, 2, 128)
  plain = kernel_modules(lower_grad("mosaic", shape, is_causal=True))
  other = kernel_modules(lower_grad(
      "mosaic", shape, is_causal=True,
      block_sizes=jax_flash.MosaicBlockSizes(dv_before_ds=True)))
  assert plain.keys() == other.keys() and len(plain) == 3
  assert plain["flash_attention_dkv_mosaic"] != other[
      "flash_attention_dkv_mosaic"]


@pytest.mark.parametrize("kwargs", [
    dict(), dict(is_causal=True),
    dict(is_causal=True, local_window_size=100, logits_soft_cap=30.0,
         sinks=jnp.zeros((8,))),
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0),
         segment_ids=(jnp.zeros((2, 300), jnp.int32),
                      jnp.zeros((2, 1003), jnp.int32))),
    dict(mask=jnp.ones((1, 1, 300, 1003), bool),
         alibi_slopes=jnp.full((8,), 0.1)),
    dict(num_stages_bwd=3),
], ids=["plain", "causal", "window_cap_sinks", "dropout_segments",
        "dense_mask_alibi", "three_stages"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_dq_lowers_without_the_dq_kernel(kwargs, head_dim):
  """`fused_dq`: the dK/dV kernel adds dQ in place into a float32 buffer
  (its custom call aliases that operand), and no dQ kernel runs; with the
  masks and scores of the shared description, and 3 pipeline stages (what
  shared memory holds). Head dim 128 exchanges dS between the warpgroups,
  64 does not (`config.fused_dq_columns`)."""
  kwargs = dict(kwargs)
  blocks = jax_flash.MosaicBlockSizes(
      fused_dq=True, num_stages_bwd=kwargs.pop("num_stages_bwd", 2))
  text = lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
                    block_sizes=blocks, **kwargs)
  assert set(kernel_modules(text)) == {"flash_attention_forward_mosaic",
                                        "flash_attention_dkv_mosaic"}
  dkv = next(line for line in text.splitlines()
             if "flash_attention_dkv_mosaic" in line and "mosaic_gpu" in line)
  assert "output_operand_aliases" in dkv


@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_takes_score_modifications_forward_and_backward(head_dim):
  text = lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                    is_causal=True, logits_soft_cap=30.0,
                    alibi_slopes=jnp.ones((1, 4)))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_flex_runs_the_mosaic_kernels(head_dim):
  """A mask_mod (its tile-range table read in the kernels) and a score_mod
  that close over no array: the Mosaic forward, dK/dV and dQ, picked by
  the default dispatch on an H200."""
  text = lower_flex(None, lambda b, h, q, k: (q >= k) & (q - k < 4 << h),
                    lambda s, b, h, q, k: s - 0.1 * (h + 1) * jnp.abs(q - k),
                    head_dim=head_dim)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("kwargs", [
    dict(sinks=jnp.zeros((8,))),
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0),
         dropout_broadcast=True, logits_soft_cap=30.0)],
    ids=["sinks", "dropout", "dropout_broadcast_soft_cap"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_takes_sinks_and_dropout(kwargs, head_dim):
  """Sinks and dropout in the forward, dK/dV and dQ kernels."""
  text = lower_grad("mosaic", (1, 300, 1003, 8, 2, head_dim), jnp.bfloat16,
                    is_causal=True, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True), dict(), dict(is_causal=True, persistent=True),
    dict(is_causal=True, local_window_size=(100, 0), logits_soft_cap=30.0),
    dict(segment_ids=(jnp.zeros((2, 300), jnp.int32),
                      jnp.zeros((2, 1003), jnp.int32)))],
    ids=["causal", "full", "persistent", "window_softcap", "segments"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_forward_lowers_with_80_row_key_tiles(head_dim, kwargs):
  """K/V tiles of 80 rows (FA3's at head dim 256): V's tile takes a 32-byte
  swizzle (the P V matmul contracts over 80) and the forward no reduction
  scratch, which puts head dim 256 inside the H200's shared memory (Mosaic
  checks it when lowering); 1003 keys end in a partial tile."""
  kwargs = dict(kwargs)
  blocks = jax_flash.MosaicBlockSizes(
      block_q=64, block_kv=80, persistent=kwargs.pop("persistent", False))
  assert blocks.smem_bytes(head_dim, 2) <= config.SMEM_BYTES
  assert not blocks.reduction_scratch()
  text = lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
                    block_sizes=blocks, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def test_swizzle_of_a_tile_follows_its_contracted_rows():
  """V's tile for P V (`smem_transforms(..., rows)`): the widest swizzle
  whose elements divide both its rows and head dim."""
  def swizzle(minor, rows=None):
    return layout.smem_transforms(jnp.bfloat16, minor, rows)[1].swizzle
  assert swizzle(256) == swizzle(256, 128) == swizzle(256, 64) == 128
  assert swizzle(256, 80) == 32 and swizzle(256, 96) == 64
  assert swizzle(96, 128) == 64


def test_80_row_key_tiles_take_tile_kinds():
  """A dense mask's tile kinds (64 x 64 blocks) regridded to 80-row key
  tiles that straddle them (`mask._regrid`; its tables are checked against
  the mask in tests/test_flex.py): the Mosaic forward and backward."""
  blocks = jax_flash.MosaicBlockSizes(block_q=64, block_kv=80)
  text = lower_grad("mosaic", (1, 300, 1003, 4, 2, 256), block_sizes=blocks,
                    mask=jnp.ones((1, 1, 300, 1003), bool))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("num_mask_heads", [1, 4], ids=["shared", "per_head"])
def test_mosaic_takes_dense_masks_when_named(head_dim, num_mask_heads):
  """A dense mask read tile by tile in the forward, dK/dV (transposed) and
  dQ kernels, a broadcast head dim kept in global memory; lengths no tile
  divides."""
  mask = jnp.ones((1, num_mask_heads, 300, 1003), bool)
  text = lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                    is_causal=True, mask=mask)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)
  assert not any(name in text for name in TRITON_BACKWARD)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bias_shape", [(1, 1, 300, 1003), (1, 4, 300, 1003),
                                        (1, 4, 1, 1003), (1, 1, 300, 1),
                                        (1, 1, 1, 1)],
                         ids=["shared", "per_head", "keys", "rows", "scalar"])
def test_mosaic_takes_a_bias(head_dim, bias_shape):
  """A bias in the forward, dK/dV and dQ kernels (a row or column vector
  broadcast in registers, a scalar), with a dense mask; its gradient from
  the Triton dbias kernel. A bias per (query, key) pair: the Mosaic forward,
  then the Triton backward (`_dispatch.backward`: the Mosaic dK/dV kernel
  would need a transposed copy of it)."""
  b, t, s, n, k = 1, 300, 1003, 4, 2
  q = jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, k, head_dim), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct(bias_shape, jnp.float32)
  mask = jnp.ones((1, n, 1, s), bool)  # Per head, so it stays dense.

  def loss(q, k, v, bias):
    out = jax_flash.flash_attention(q, k, v, bias=bias, mask=mask,
                                    is_causal=True, implementation="mosaic")
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
        q, kv, kv, bias).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_forward_mosaic" in text
  per_pair = bias_shape[2] > 1 and bias_shape[3] > 1
  backward = TRITON_BACKWARD if per_pair else MOSAIC_BACKWARD
  assert all(name in text for name in backward)
  assert not any(name in text for name in MOSAIC_BACKWARD if per_pair)
  assert "flash_attention_backward_dbias" in text


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_takes_lengths_and_segment_ids(head_dim):
  """Ids (lengths, segments) in the forward, dK/dV and dQ kernels: their
  range tables and the id predicate on boundary tiles."""
  ids = (jnp.zeros((1, 300), jnp.int32), jnp.zeros((1, 1003), jnp.int32))
  text = lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                    is_causal=True, segment_ids=ids,
                    query_seq_lengths=jnp.array([200]),
                    key_value_seq_lengths=jnp.array([900]))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)
  assert not any(name in text for name in TRITON_BACKWARD)


@pytest.mark.parametrize("head_dim", [96, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_head_dims_96_and_192_lower_unpadded(head_dim, causal):
  """No padding to a power of two: 96 (64-byte swizzle, the 128 kernels'
  structure) and 192 (the 256 kernels': dK and dV split, one dQ
  warpgroup)."""
  text = lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                    is_causal=causal)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)
  assert f"{head_dim}xbf16" in text  # The kernels' operands are unpadded.


def test_profiler_is_on_only_when_its_directory_is_named(monkeypatch):
  """$JAX_FLASH_MOSAIC_PROFILE_DIR turns Mosaic GPU's profiler on for the
  kernels traced after it is set (the lowering then needs a GPU: the trace
  is written by a host callback); unset, the kernels carry no profiler."""
  from pallas_kernels.mosaic_gpu import config
  monkeypatch.delenv(config.PROFILE_DIR_ENV, raising=False)
  assert config.compiler_params().profile_space == 0
  monkeypatch.setenv(config.PROFILE_DIR_ENV, "/tmp/traces")
  params = config.compiler_params()
  assert (params.profile_space, params.profile_dir) == (
      config.PROFILE_EVENTS, "/tmp/traces")
  assert params.approx_math
  monkeypatch.setenv(config.PROFILE_EVENTS_ENV, "1040")  # 16k keys.
  assert config.compiler_params().profile_space == 1040
  monkeypatch.setenv(config.PROFILE_EVENTS_ENV, "lots")
  with pytest.raises(ValueError, match="JAX_FLASH_MOSAIC_PROFILE_EVENTS"):
    config.compiler_params()


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_kernels_lower_with_64_bit_types_on(implementation):
  """`jax_enable_x64` on: the forward, backward and decode kernels lower
  as they do with it off (the library traces and lowers them in int32)."""
  kwargs = dict(is_causal=True, key_value_seq_lengths=np.array([900]),
                segment_ids=(np.zeros((1, 300), np.int64),
                             np.zeros((1, 1003), np.int64)))
  want = lower_grad(implementation, (1, 300, 1003, 4, 2, 128), **kwargs)
  with jax.enable_x64(True):
    got = lower_grad(implementation, (1, 300, 1003, 4, 2, 128), **kwargs)
    q = jax.ShapeDtypeStruct((2, 1, 4, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(
        mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
      jax.jit(lambda q, k, v: jax_flash.flash_decode(
          q, k, v, kv_lengths=np.array([1000, 3]),
          implementation=implementation)).trace(q, cache, cache).lower(
              lowering_platforms=("cuda",))
  assert got.count("custom_call") == want.count("custom_call")


@pytest.mark.parametrize(
    "head_dim, value_head_dim, kv_len, kernel_dim, forward_dim, backward_dim",
    [(80, 80, 300, 80, 80, 80), (72, 72, 300, 80, 72, 72),
     (72, 72, 2000, 80, 72, 80), (20, 20, 300, 32, 32, 32),
     (192, 128, 300, 192, 192, 192), (128, 64, 300, 128, 128, 128),
     (64, 128, 300, 128, 128, 128)])
def test_head_dims_run_at_a_multiple_of_16(head_dim, value_head_dim, kv_len,
                                           kernel_dim, forward_dim,
                                           backward_dim):
  """Q, K and V reach the kernels with their own head dims where the
  column parts read them in place (`layout.Columns`: 72 in the forward, and
  in the backward up to `config.BACKWARD_PARTS_MAX_KV_LEN` keys), else with
  `config.kernel_head_dim` columns (a multiple of 16: zero columns added
  only where the head dims are not, or differ); the gradients come back at
  the inputs' own head dims."""
  assert config.kernel_head_dim(head_dim, value_head_dim) == kernel_dim
  q = jax.ShapeDtypeStruct((1, 256, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_len, 2, head_dim), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, kv_len, 2, value_head_dim), jnp.bfloat16)

  def loss(q, k, v):
    return jnp.sum(jax_flash.flash_attention(
        q, k, v, is_causal=True, implementation="mosaic").astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert [g.shape for g in traced.out_info] == [q.shape, k.shape, v.shape]
  for kernel, dim in (("flash_attention_forward_mosaic", forward_dim),
                      *((name, backward_dim) for name in MOSAIC_BACKWARD)):
    operands = kernel_operands(text, kernel)
    assert operands and all(o.endswith(f"x{dim}") for o in operands)


@pytest.mark.parametrize("head_dim, causal, kv_len, block_kv", [
    (64, False, 197, 256), (64, True, 197, 128), (48, False, 80, 80),
    (48, False, 77, 96), (32, False, 77, 96), (80, False, 80, 80),
    (80, False, 77, 128), (40, False, 77, 96), (72, False, 70, 128),
    (128, False, 30, 64), (64, False, 1500, 256), (128, False, 104, 112),
    (128, False, 100, 128), (256, False, 77, 64)])
def test_short_keys_take_one_tile_of_their_length(head_dim, causal, kv_len,
                                                  block_kv):
  """Keys fewer than the default K/V tile's rows run in one tile of their
  length rounded up to 16 rows (at least 64: 80 for 80 tokens at head
  dim 80), or to a multiple of the widest column part where tiles are
  copied untiled (the head dim at 32 and 64; 32 at head dim 40, 64 at
  72; any head dim at a length off a multiple of 8: 64 at 80 on 77
  keys), whose V tiles then keep a row's swizzle and are read in place
  (`short_kv_tile`)."""
  blocks = jax_flash.MosaicBlockSizes.get_default(head_dim, causal,
                                                  kv_len=kv_len)
  assert blocks.block_kv == block_kv


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True),
                                              (256, True)])
def test_fp8_forward_lowers_in_e4m3(head_dim, causal):
  """fp8=True on an H200: the Mosaic forward with e4m3 operands (QK^T and
  P V in FP8 wgmma; V transposed), the bf16 Mosaic backward; the default
  picks it too."""
  for implementation in ("mosaic", None):
    text = lower_grad(implementation, (2, 256, 520, 8, 2, head_dim),
                      is_causal=causal, fp8=True)
    assert "flash_attention_forward_mosaic" in text
    assert all(name in text for name in MOSAIC_BACKWARD)
    assert "f8E4M3FN" in text


def test_fp8_descale_inputs_run_the_mosaic_forward_as_they_are():
  """float8 inputs with the caller's scales: the Mosaic FP8 forward reads
  the e4m3 arrays themselves (no rounding or max of their own: no
  reduction and no conversion to e4m3 outside the kernel)."""
  q8 = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.float8_e4m3fn)
  kv8 = jax.ShapeDtypeStruct((2, 520, 2, 128), jnp.float8_e4m3fn)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    for implementation in ("mosaic", None):
      text = jax.jit(lambda q, k, v: jax_flash.flash_attention(
          q, k, v, descale=(0.5, 0.25, 1.0), is_causal=True,
          implementation=implementation)).trace(q8, kv8, kv8).lower(
              lowering_platforms=("cuda",)).as_text()
      assert "flash_attention_forward_mosaic" in text
      assert "stablehlo.reduce" not in text
      assert "-> tensor<2x256x8x128xf8E4M3FN>" not in text


def test_fp8_true_quantizes_each_input_once():
  """fp8=True's forward on a Hopper GPU: each input read by one max kernel
  and one rounding kernel (`pallas_kernels.triton.fp8_round`), no
  conversion to e4m3 by XLA, and the kernel reads the e4m3 values the
  rounding made (not a second quantization of the rounded values); with
  implementation="xla", XLA's ops: one max and one conversion an input."""
  q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 520, 2, 128), jnp.bfloat16)
  # The inputs' conversions (the blockwise forward converts P too).
  converts = r"stablehlo.convert.*-> tensor<2x(256|520)x[0-9x]*xf8E4M3FN>"
  for implementation in (None, "xla"):
    with jax.sharding.use_abstract_mesh(
        mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
      text = jax.jit(lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=True, fp8=True,
          implementation=implementation)).trace(q, kv, kv).lower(
              lowering_platforms=("cuda",)).as_text()
    kernels = re.findall(r'name = "(fp8_[a-z]*)"', text)
    if implementation is None:
      assert "flash_attention_forward_mosaic" in text
      assert kernels == ["fp8_amax", "fp8_quantize"] * 3
      assert not re.findall(converts, text)
      assert text.count("stablehlo.reduce") == 3  # The kernels' partials.
    else:
      assert not kernels
      assert len(re.findall(converts, text)) == 3


def test_fp8_rounding_is_xlas_where_xla_may_split_the_arrays(monkeypatch):
  """`_dispatch.fp8_rounding`: the Triton kernels on one Hopper GPU (or
  inside shard_map, every axis manual), XLA's ops where jit may split the
  arrays over several devices (a kernel has no partitioning rule) and
  for implementation="xla"."""
  from jax_flash import _dispatch
  from jax_flash.core import fp8
  from pallas_kernels.triton import fp8_round
  q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
  one_gpu = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)
  with jax.sharding.use_abstract_mesh(one_gpu):
    assert _dispatch.fp8_rounding(None, q) is fp8_round.ROUNDING
    assert _dispatch.fp8_rounding("mosaic", q) is fp8_round.ROUNDING
    assert _dispatch.fp8_rounding("xla", q) is fp8.XLA
  on_cpu = jax.device_put(jnp.zeros((1, 8, 1, 8)), jax.devices("cpu")[0])
  assert _dispatch.fp8_rounding(None, on_cpu) is fp8.XLA
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  with jax.sharding.use_abstract_mesh(one_gpu):
    assert _dispatch.fp8_rounding(None, q) is fp8.XLA
  manual = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200,
                                 axis_types=(jax.sharding.AxisType.Manual,))
  with jax.sharding.use_abstract_mesh(manual):
    assert _dispatch.fp8_rounding(None, q) is fp8_round.ROUNDING


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True),
                                              (128, False), (256, True)])
def test_fp8_backward_lowers_in_e4m3(head_dim, causal):
  """`MosaicBlockSizes.fp8_backward`: both backward kernels on e4m3 tiles,
  with Q^T and dO^T ([B, N, H, T'], e4m3) made for the dK/dV kernel and
  K^T ([B, K, H, S']) for the dQ kernel, beside the forward's V^T;
  without it, only V^T; by default, the FP8 backward at head dims 128
  and 256."""
  shape = (2, 256, 520, 8, 2, head_dim)
  transposed = re.compile(rf"tensor<2x(8|2)x{head_dim}x\d+xf8E4M3FN>")
  for on in (True, False):
    text = lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                      block_sizes=jax_flash.MosaicBlockSizes(
                           fp8_backward=on, block_kv=64))
    assert all(name in text for name in MOSAIC_BACKWARD)
    heads = {m.group(1) for m in transposed.finditer(text)}
    assert heads == ({"8", "2"} if on else {"2"})
  # The default: the FP8 backward at head dims 128 and 256, its dO
  # rounded by the Triton kernels as the inputs are.
  text = lower_grad(None, shape, is_causal=causal, fp8=True)
  heads = {m.group(1) for m in transposed.finditer(text)}
  fp8_backward = head_dim in (128, 256)
  assert heads == ({"8", "2"} if fp8_backward else {"2"})
  kernels = re.findall(r'name = "(fp8_[a-z]*)"', text)
  assert sorted(kernels) == sorted(["fp8_amax", "fp8_quantize"]
                                   * (3 + fp8_backward))


@pytest.mark.parametrize("head_dim, causal, persistent", [
    (64, True, True), (128, False, False), (256, True, False)])
def test_fp8_forward_overlaps_by_default(head_dim, causal, persistent):
  """FP8 calls get `MosaicBlockSizes.overlap` by default (the forward
  lowers with it, persistent or not); a bf16 call that asks for it is
  told it is the FP8 forward's."""
  problem = Problem(batch=2, q_len=256, kv_len=520, num_heads=8,
                    num_kv_heads=2, head_dim=head_dim, unbatched=False)
  for kind in ("amax", "descale"):
    blocks = MosaicGpuBackend().config(
        None, problem, jnp.bfloat16, is_causal=causal,
        scores=Scores(scale=0.1, fp8=kind), mask=Mask(is_causal=causal))
    assert blocks.overlap
  blocks = jax_flash.MosaicBlockSizes(
      block_kv=config.FP8_BLOCK_KV[head_dim][not causal],
      persistent=persistent, overlap=True)
  text = lower_grad("mosaic", (2, 256, 520, 8, 2, head_dim),
                    is_causal=causal, fp8=True, block_sizes=blocks)
  assert "flash_attention_forward_mosaic" in text
  with pytest.raises(ValueError, match="overlap=True is the FP8 forward's"):
    lower_grad("mosaic", (2, 256, 520, 8, 2, head_dim), is_causal=causal,
               block_sizes=jax_flash.MosaicBlockSizes(overlap=True))


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True),
                                              (256, True)])
def test_fp8_stmatrix_stores_lower(head_dim, causal):
  """`MosaicBlockSizes.e4m3_stmatrix`: the FP8 forward and backward lower
  with their e4m3 tiles stored by `stmatrix` (other kernels), V^T, Q^T,
  dO^T and K^T permuted to meet them. (Off, the default, lowers the
  programs of the commits before the field: scripts/lowered_programs.py.)"""
  shape = (2, 256, 520, 8, 2, head_dim)
  blocks = functools.partial(jax_flash.MosaicBlockSizes, fp8_backward=True,
                             block_kv=64)
  on = lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                  block_sizes=blocks(e4m3_stmatrix=True))
  off = lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                   block_sizes=blocks())
  assert all(name in on for name in MOSAIC_BACKWARD)
  assert on != off




@pytest.mark.parametrize("head_dim, causal, overlap", [
    (64, False, True), (128, True, True), (128, False, False),
    (256, True, True)])
def test_fp8_registers_operands_lower(head_dim, causal, overlap):
  """`MosaicBlockSizes.e4m3_registers` and `e4m3_registers_bwd`: the FP8
  kernels lower with their e4m3 tiles handed to wgmma from registers (the
  forward's P, overlapped and carried to the next step or not; the FP8
  backward's P^T, dS^T and dS), programs of their own, on the default's
  tiles."""
  shape = (2, 256, 520, 8, 2, head_dim)
  blocks = functools.partial(
      jax_flash.MosaicBlockSizes, overlap=overlap, fp8_backward=True,
      block_kv=config.FP8_BLOCK_KV[head_dim][not causal])
  on = lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                  block_sizes=blocks(e4m3_registers=True,
                                     e4m3_registers_bwd=True))
  off = lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                   block_sizes=blocks(e4m3_stmatrix=True))
  assert all(name in on for name in MOSAIC_BACKWARD)
  assert "flash_attention_forward_mosaic" in on
  assert on != off


@pytest.mark.parametrize("head_dim, causal, registers", [
    (128, True, True), (128, False, False), (256, True, True),
    (64, False, False)])
def test_fp8_ds_bound_lowers(head_dim, causal, registers):
  """`MosaicBlockSizes.fp8_ds_bound`: both FP8 backward kernels lower with
  dS scaled by one bound a (batch, KV head) (no row maxima, no rescale),
  dS through shared memory or from registers, head dims split or not;
  programs of their own."""
  shape = (2, 256, 520, 8, 2, head_dim)
  blocks = functools.partial(
      jax_flash.MosaicBlockSizes, overlap=True, fp8_backward=True,
      e4m3_registers_bwd=registers, e4m3_stmatrix=not registers,
      block_kv=config.FP8_BLOCK_KV[head_dim][not causal])
  on, off = (kernel_modules(lower_grad(
      "mosaic", shape, is_causal=causal, fp8=True,
      block_sizes=blocks(fp8_ds_bound=bound))) for bound in (True, False))
  assert set(MOSAIC_BACKWARD) <= on.keys() == off.keys()
  for name in MOSAIC_BACKWARD:
    assert on[name] != off[name], name


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(is_causal=True, local_window_size=(100, 0), logits_soft_cap=30.0,
         dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    dict(is_causal=False)], ids=["causal", "window_cap_dropout", "full"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_vectors_lower(kwargs, head_dim):
  """`MosaicBlockSizes.alibi_vectors`: True, the three kernels add ALiBi
  from a row and a column vector (programs of their own, with or without
  a causal mask); None (the default), vectors where a tile has at most
  `ALIBI_VECTORS_MAX_COLUMNS` columns, positions elsewhere
  (`tests/test_variants.py::test_alibi_vectors_default_rule`)."""
  shape = (2, 256, 520, 8, 2, head_dim)
  slopes = jnp.linspace(0.1, 0.8, 8)
  default = jax_flash.MosaicBlockSizes.get_default(
      head_dim, is_causal=kwargs["is_causal"])
  on, off, rule = (kernel_modules(lower_grad(
      "mosaic", shape, alibi_slopes=slopes, **kwargs,
      block_sizes=dataclasses.replace(default, alibi_vectors=vectors)))
      for vectors in (True, False, None))
  assert len(on) == 3 and on.keys() == off.keys() == rule.keys()
  columns = {"flash_attention_forward_mosaic": default.block_kv,
             "flash_attention_dkv_mosaic": default.block_q_dkv,
             "flash_attention_dq_mosaic": default.block_kv_dq}
  for name in on:
    assert on[name] != off[name], name
    width = next(n for prefix, n in columns.items()
                 if name.startswith(prefix))
    vectors = width <= config.ALIBI_VECTORS_MAX_COLUMNS
    # (Not == the other: a module's bytes hold a few process-dependent
    # ones after other lowerings in the process.)
    assert rule[name] != (off[name] if vectors else on[name]), name


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(is_causal=True, local_window_size=(100, 0), logits_soft_cap=30.0),
    dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))],
    ids=["causal", "window_cap", "dropout"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_fold_lowers(kwargs, head_dim):
  """`MosaicBlockSizes.alibi_fold` on causal masks: each of the three
  kernels lowers with ALiBi's query term in the row max or the logsumexp
  (programs of their own: the formula is checked in
  `tests/test_variants.py::test_alibi_fold_is_alibi`)."""
  shape = (2, 256, 520, 8, 2, head_dim)
  slopes = jnp.linspace(0.1, 0.8, 8)
  default = jax_flash.MosaicBlockSizes.get_default(
      head_dim, is_causal=True, kv_len=520)
  blocks = dataclasses.replace(default, alibi_vectors=True,
                               block_kv=min(default.block_kv, 128))
  fold, plain = (kernel_modules(lower_grad(
      "mosaic", shape, alibi_slopes=slopes, **kwargs,
      block_sizes=dataclasses.replace(blocks, alibi_fold=on)))
      for on in (True, False))
  assert len(fold) == 3 and fold.keys() == plain.keys()
  for name in fold:
    assert fold[name] != plain[name], name
