"""The Mosaic GPU kernels (forward, dK/dV, dQ) lower for an H200 on the CPU,
and the dispatch picks them where they take the call.

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
from jax_flash.core.mask import Mask, kv_block_ranges
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu import config, flash_fwd, layout, scheduling
from pallas_kernels.mosaic_gpu.backend import MosaicGpuBackend

H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                               platform="gpu")
MOSAIC_CALL = "mosaic_gpu"  # The custom call of a Mosaic GPU kernel.
TRITON_FORWARD = "flash_attention_forward"


def _lower_grad(implementation, shape=(2, 256, 512, 8, 2, 128),
                dtype=jnp.bfloat16, **kwargs):
  b, t, s, n, k, h = shape
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, k, h), dtype)

  def loss(q, k, v):
    out = jax_flash.flash_attention(q, k, v, implementation=implementation,
                                    **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


MOSAIC_BACKWARD = ("flash_attention_dkv_mosaic", "flash_attention_dq_mosaic")
TRITON_BACKWARD = ("flash_attention_backward_dkdv",
                   "flash_attention_backward_dq")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
# 520 keys: not a multiple of the dK/dV kernel's 128-row tile (padded).
@pytest.mark.parametrize("kv_len", [512, 520])
def test_mosaic_forward_and_backward_lower(dtype, head_dim, causal, kv_len):
  """Head dim 256: dK and dV split between the warpgroups, one dQ
  warpgroup (shared memory and registers); the same kernels' code."""
  text = _lower_grad("mosaic", (2, 256, kv_len, 8, 2, head_dim), dtype,
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
  text = _lower_grad("mosaic", (1, 256, 384, 4, 4, 64), jnp.bfloat16,
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
  text = _lower_grad("mosaic", (2, 200, 200, heads, kv_heads, head_dim),
                     jnp.bfloat16, is_causal=True, block_sizes=blocks)
  assert all(name in text for name in MOSAIC_BACKWARD)
  share = -(-(heads // kv_heads) // min(splits, heads // kv_heads))
  parts = -(-(heads // kv_heads) // share)
  if parts > 1:
    assert re.search(rf"tensor<2x\d+x{kv_heads}x{parts}x{head_dim}xf32>",
                     text)


def test_head_splits_give_every_share_a_head():
  from pallas_kernels.mosaic_gpu.flash_bwd import head_splits
  blocks = lambda s: jax_flash.MosaicBlockSizes(dkv_head_splits=s)
  assert head_splits(blocks(8), 71, 64, fp8=False) == 8  # Shares of 9, 8.
  assert head_splits(blocks(7), 8, 64, fp8=False) == 4  # Shares of 2.
  assert head_splits(blocks(200), 64, 64, fp8=False) == 64
  assert head_splits(blocks(8), 71, 64, fp8=True) == 1
  assert head_splits(jax_flash.MosaicBlockSizes(dkv_head_splits=8,
                                                fused_dq=True), 8, 64,
                     fp8=False) == 1
  with pytest.raises(ValueError, match="dkv_head_splits=0 must be"):
    blocks(0)


@pytest.mark.parametrize("group, ctas, splits", [
    (71, 64, 15), (64, 64, 16), (32, 128, 8), (16, 256, 4), (8, 512, 2),
    (4, 1024, 1), (1, 64, 1), (3, 64, 3), (8, 100, 8)])
def test_default_head_splits_reach_the_ctas(group, ctas, splits):
  """None: the fewest shares giving `config.DKV_CTAS` CTAs (the group's
  heads at most; shares as even as the group allows)."""
  from pallas_kernels.mosaic_gpu.flash_bwd import head_splits
  assert head_splits(jax_flash.MosaicBlockSizes(), group, ctas,
                     fp8=False) == splits


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("q_len, kv_len", [(77, 77), (300, 1003), (1, 1),
                                          (1, 300), (300, 1)])
def test_mosaic_takes_any_length(head_dim, q_len, kv_len):
  """XLA pads to the tiles, a length of 1 too (TMA's strides: 16-byte
  multiples); the kernels mask keys past kv_len."""
  text = _lower_grad("mosaic", (1, q_len, kv_len, 4, 2, head_dim),
                     jnp.bfloat16, is_causal=True)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def _sequence_copies(text):
  """The pads and slices of 4-D bf16 arrays (Q, K, V, O, dO and gradients:
  the [B, T, N, H] copies XLA would make around the kernels) in a lowered
  program's text, as 'op: operand -> result' types."""
  shape = r"tensor<\d+x\d+x\d+x\d+xbf16>"
  return re.findall(rf"stablehlo\.(?:pad|slice)[^\n]*?({shape})[^\n]*?-> "
                    rf"({shape})", text)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_mosaic_reads_any_length_in_place(causal, head_dim):
  """Lengths that are multiples of 8 but not of the tiles (448 queries on
  1504 keys) and lengths off a multiple of 8 (1500 keys): the kernels read
  Q, K, V, dO and write O and the gradients where they lie (tiles reach
  past the ends; untiled copies in column parts at 1500 keys), so the forward+backward holds no pad or slice
  of them."""
  for kv_len in (1504, 1500):
    text = _lower_grad("mosaic", (2, 448, kv_len, 4, 2, head_dim),
                       jnp.bfloat16, is_causal=causal)
    assert all(name in text for name in MOSAIC_BACKWARD)
    assert _sequence_copies(text) == [], (kv_len, _sequence_copies(text))


def _lower_forward(shape, head_dim, **kwargs):
  b, t, s, n, k = shape
  q = jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, k, head_dim), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, implementation="mosaic", **kwargs)).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()


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
  text = _lower_forward(shape, head_dim, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert _sequence_copies(text) == []
  text = _lower_forward(shape, 72, block_sizes=jax_flash.MosaicBlockSizes(
      block_kv=80))
  assert ("tensor<2x1000x8x72xbf16>", "tensor<2x1000x8x80xbf16>") in (
      _sequence_copies(text))


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
  assert "flash_attention_forward_mosaic" in _lower_forward(shape, head_dim)
  assert _sequence_copies(_lower_grad("mosaic", (*shape, head_dim))) == []
  for wide in (80, 128):
    assert _sequence_copies(_lower_forward(shape, wide)) == []
  pads = {("tensor<2x1500x2x192xbf16>", "tensor<2x1504x2x192xbf16>")}
  assert set(_sequence_copies(_lower_forward(shape, 192))) == pads
  assert set(_sequence_copies(_lower_grad("mosaic", (*shape, 192)))) == pads


def test_keys_padded_at_the_source_are_read_in_place():
  """Keys padded once by the caller to a multiple of 8 and hidden by
  segment ids (docs/performance.md): no pad, slice or select of a
  [B, S, K, H] array around the kernels; lengths instead zero the padded
  rows (they may hold NaN) with a select over K and V."""
  q_ids = jnp.zeros((2, 448), jnp.int32)
  kv_ids = jnp.broadcast_to(jnp.arange(1504) >= 1500, (2, 1504)).astype(
      jnp.int32)
  selects = r"stablehlo\.select[^\n]*tensor<\d+x\d+x\d+x\d+xbf16>"
  text = _lower_grad("mosaic", (2, 448, 1504, 4, 2, 64), jnp.bfloat16,
                     segment_ids=(q_ids, kv_ids))
  assert _sequence_copies(text) == [] and not re.findall(selects, text)
  text = _lower_grad("mosaic", (2, 448, 1504, 4, 2, 64), jnp.bfloat16,
                     key_value_seq_lengths=jnp.array([1500, 1500]))
  assert re.findall(selects, text)


@pytest.mark.parametrize("name, shape, dtype, kwargs, mosaic", [
    ("eligible", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(is_causal=True), True),
    ("odd_q_len", (2, 300, 512, 8, 2, 128), jnp.bfloat16, {}, True),
    ("odd_kv_len", (2, 256, 521, 8, 2, 128), jnp.bfloat16, {}, True),
    # Up to 320 keys (the dispatch's `NEXT_IS_FASTER`) the Triton kernels
    # where the Mosaic forward would copy arrays (`test_short_keys_...` below).
    ("short_keys", (2, 256, 300, 8, 2, 192), jnp.bfloat16, {}, False),
    ("short_keys_in_parts", (2, 256, 300, 8, 2, 128), jnp.bfloat16, {},
     True),
    ("head_dim_96", (2, 256, 512, 8, 2, 96), jnp.bfloat16, {}, True),
    ("head_dim_192", (2, 256, 512, 8, 2, 192), jnp.bfloat16, {}, True),
    ("head_dim_80", (2, 256, 512, 8, 2, 80), jnp.bfloat16,
     dict(is_causal=True), True),
    ("head_dim_72_padded", (2, 256, 512, 8, 2, 72), jnp.bfloat16, {}, True),
    ("head_dim_264", (2, 256, 512, 8, 2, 264), jnp.bfloat16, {}, False),
    ("float32", (2, 256, 512, 8, 2, 128), jnp.float32, {}, False),
    ("window", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(local_window_size=64), True),
    ("causal_window", (2, 256, 512, 8, 2, 64), jnp.bfloat16,
     dict(is_causal=True, local_window_size=(100, 0)), True),
    ("soft_cap", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(logits_soft_cap=30.0), True),
    ("alibi", (2, 256, 512, 8, 2, 64), jnp.bfloat16,
     dict(is_causal=True, alibi_slopes=jnp.ones((2, 8))), True),
    ("bias", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(bias=jnp.zeros((1, 1, 256, 512))), True),
    ("dense_mask", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(mask=jnp.ones((2, 1, 256, 512), bool)), True),
    ("sinks", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(sinks=jnp.zeros((8,))), True),
    ("dropout", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), True),
    ("lengths", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(key_value_seq_lengths=jnp.array([512, 3])), True),
    ("segment_ids", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(segment_ids=(jnp.zeros((2, 256), jnp.int32),
                       jnp.zeros((2, 512), jnp.int32))), True),
    ("version_1", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(version=1), False),
])
def test_pallas_picks_mosaic_where_it_takes_the_call(name, shape, dtype,
                                                     kwargs, mosaic):
  text = _lower_grad("pallas", shape, dtype, **kwargs)
  assert (MOSAIC_CALL in text) == mosaic, name
  if not mosaic:
    assert TRITON_FORWARD in text


@pytest.mark.parametrize("shape, causal, forward, backward", [
    ((2, 256, 300, 8, 2, 192), False, "triton", "triton"),
    ((2, 256, 300, 8, 2, 128), False, "mosaic", "mosaic"),
    ((4, 257, 257, 4, 4, 80), False, "mosaic", "mosaic"),
    ((4, 197, 197, 8, 8, 64), True, "mosaic", "mosaic"),
    ((4, 256, 256, 4, 4, 72), False, "mosaic", "mosaic"),
    ((4, 256, 256, 4, 4, 64), False, "mosaic", "mosaic"),
    ((4, 77, 77, 4, 4, 64), True, "mosaic", "triton"),
    ((4, 300, 77, 4, 4, 40), False, "mosaic", "triton"),
    ((4, 300, 77, 4, 4, 20), False, "triton", "triton"),
    ((4, 300, 300, 4, 4, 20), False, "triton", "triton")])
def test_short_keys_pick_each_direction_by_its_copies(shape, causal, forward,
                                                      backward):
  """Up to 320 keys (`_dispatch.NEXT_IS_FASTER`) the default runs the Triton
  forward where XLA would copy arrays around the Mosaic one (a length off
  8 read tiled: 300 at head dim 192; a head dim padded: 20) and the Mosaic
  forward where it reads them in place (197 tokens at head dim 64, head
  dims 72 and 40 in column parts, 128 and 80 in parts at lengths off 8);
  the Triton backward after a Triton forward, up to
  128 keys, and where the Mosaic backward
  would pad head dims (20), the Mosaic one elsewhere (it reads any length
  and head dim 72 in place)."""
  text = _lower_grad("pallas", shape, is_causal=causal)
  assert ("flash_attention_forward_mosaic" in text) == (forward == "mosaic")
  names = MOSAIC_BACKWARD if backward == "mosaic" else TRITON_BACKWARD
  others = TRITON_BACKWARD if backward == "mosaic" else MOSAIC_BACKWARD
  assert all(n in text for n in names) and not any(n in text for n in others)


def test_mosaic_named_runs_short_keys_too():
  """`slower` only steers the choice when no backend is named."""
  text = _lower_grad("mosaic", (2, 197, 197, 4, 4, 64))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def test_mosaic_named_for_a_call_it_cannot_take_says_why():
  with pytest.raises(ValueError, match=r"head_dim \(last axis of query, "
                     r"key\) must be at most 256 for the Mosaic GPU kernels, "
                     "got 264"):
    _lower_grad("mosaic", (2, 256, 512, 8, 2, 264))
  with pytest.raises(ValueError, match="query dtype must be bfloat16 or "
                     "float16 for the Mosaic GPU kernels, got float32"):
    _lower_grad("mosaic", dtype=jnp.float32)


def _lower_decode(implementation, q_len, page_size=None, **kwargs):
  q = jax.ShapeDtypeStruct((2, q_len, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if page_size is None:
    cache = jax.ShapeDtypeStruct((2, 2048, 2, 128), jnp.bfloat16)
    f = lambda q, n, c: jax_flash.flash_decode(
        q, c, c, kv_lengths=n, implementation=implementation, **kwargs)
    args = (q, lengths, cache)
  else:
    pages = jax.ShapeDtypeStruct((4096 // page_size, page_size, 2, 128),
                                 jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 2048 // page_size), jnp.int32)
    f = lambda q, n, p, t: jax_flash.flash_decode(
        q, kv_lengths=n, key_pages=p, value_pages=p, page_table=t,
        implementation=implementation, **kwargs)
    args = (q, lengths, pages, table)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(f).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("kwargs", [
    dict(), dict(local_window_size=100, sinks=jnp.zeros((8,)),
                 logits_soft_cap=30.0)], ids=["causal", "window_sinks_cap"])
def test_mosaic_decodes_a_prompt_chunk(page_size, kwargs):
  """65 or more new tokens: the Mosaic forward with query offsets and key
  ids (a paged cache gathered first), named or by default on an H200."""
  for implementation in ("mosaic", None):
    text = _lower_decode(implementation, 300, page_size, **kwargs)
    assert "flash_attention_forward_mosaic" in text, implementation


def test_mosaic_decodes_a_few_tokens_against_a_contiguous_cache():
  """Short chunks against a contiguous cache at head dim 128: the Mosaic
  split-KV kernel, named or by default on an H200; against a paged cache,
  or with more query rows than a CTA takes, Triton's split-KV kernel
  ("pallas", the default), and naming Mosaic says why."""
  for implementation in ("mosaic", "pallas", None):
    text = _lower_decode(implementation, 8)
    assert "flash_attention_decode_mosaic" in text, implementation
  for implementation in ("pallas", None):
    assert MOSAIC_CALL not in _lower_decode(implementation, 8, 16)
  with pytest.raises(ValueError, match="fewer only where the cache is "
                     "contiguous .* got 8"):
    _lower_decode("mosaic", 8, 16)
  with pytest.raises(ValueError, match="query rows .* at most 64"):
    _lower_decode("mosaic", 17)  # 4 query heads a KV head x 17 > 64.


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


@pytest.mark.parametrize("groups, tiles, ctas", [
    (256, 512, 132), (32, 512, 132), (3, 7, 132), (12, 16, 5), (1, 1, 4)])
def test_decode_schedule_streams_each_tile_once_balanced(groups, tiles, ctas):
  """The Mosaic decode kernel's stream-K schedule: CTAs' runs cover the
  flattened tiles once and differ by at most one tile; a group's owner is
  the first CTA whose run crosses it and its written parts are exactly
  the CTAs that do; no run crosses more than `segments` groups."""
  bounds, segments, owners, crossed = scheduling.stream_k(groups, tiles, ctas)
  used = len(bounds) - 1
  assert used == min(ctas, groups * tiles)
  assert bounds[0] == 0 and bounds[-1] == groups * tiles
  assert np.ptp(np.diff(bounds)) <= 1 and np.all(np.diff(bounds) >= 1)
  crossing = {}
  for cta in range(used):
    for t in range(bounds[cta], bounds[cta + 1]):
      crossing.setdefault(t // tiles, set()).add(cta)
  assert segments == max(
      len({t // tiles for t in range(bounds[c], bounds[c + 1])})
      for c in range(used))
  for g in range(groups):
    named = {owners[g] + m for m in np.flatnonzero(crossed[g])}
    assert named == crossing[g], g
    assert owners[g] == min(crossing[g])


def test_mosaic_without_a_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation='mosaic' .* needs a "
                     "GPU"):
    jax_flash.flash_attention(q, q, q, implementation="mosaic")


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_forward_lowers_with_named_barriers(causal):
  """The consumers' schedule on hardware barriers (`named_barriers`): the
  same kernel with bar.sync / bar.arrive in place of the mbarrier."""
  blocks = jax_flash.MosaicBlockSizes(named_barriers=True)
  named = _lower_grad("mosaic", (1, 300, 1003, 4, 2, 128), jnp.bfloat16,
                      is_causal=causal, block_sizes=blocks)
  plain = _lower_grad("mosaic", (1, 300, 1003, 4, 2, 128), jnp.bfloat16,
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
  text = _lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
                     block_sizes=blocks, **kwargs)
  assert "flash_attention_forward_mosaic" in text
  assert grids.count((7,)) == 1, grids  # 48 items of 128 rows on 7 CTAs.


@pytest.mark.parametrize("mask", [Mask(), Mask(is_causal=True),
                                  Mask(is_causal=True, window_left=300)],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("batch,heads,tiles,programs", [
    (8, 16, 16, 132), (1, 16, 128, 132), (4, 16, 32, 132), (1, 2, 3, 5),
    (2, 3, 8, 7), (1, 1, 4, 4)])
def test_persistent_schedule_covers_every_item_once(
    mask, batch, heads, tiles, programs, monkeypatch):
  """`persistent_order` and `cta_schedule`: the persistent CTAs' items are
  every (batch, head, query tile) exactly once; a CTA's work (key tiles by
  the band, plus one an item) exceeds the mean by at most one item, and
  under a causal mask by at most 2% (or 3 tiles);
  a round before the last TAIL_ROUNDS (sorted by weight) holds the items of as
  few (batch, head) as it can (they share K/V in L2)."""
  rows = block_kv = 128
  kv_len = tiles * rows
  order = scheduling.persistent_order(mask, programs, batch, heads, tiles,
                                     rows, block_kv, kv_len)
  assert (order is None) == (mask == Mask())
  lo, _, _, hi = kv_block_ranges(mask, jnp.arange(tiles) * rows, rows,
                                 block_kv, kv_len)
  weight = np.broadcast_to(np.asarray(hi - lo), (tiles,)) + 1
  np.testing.assert_array_equal(
      scheduling.band_tiles(mask, tiles, rows, block_kv, kv_len) + 1, weight)
  seen, work, rounds = [], [], {}
  for pid in range(programs):
    monkeypatch.setattr(flash_fwd.lax, "axis_index",
                        lambda name, pid=pid: jnp.int32(pid))
    count, item_id, coords = flash_fwd.cta_schedule(
        mask, programs, batch, heads, tiles,
        None if order is None else jnp.asarray(order))
    items = [tuple(int(x) for x in coords(item_id(i)))
             for i in range(int(count))]
    seen += items
    work.append(sum(weight[t] for _, _, t in items))
    for i, (b, h, _) in enumerate(items):
      rounds.setdefault(i, set()).add((b, h))
  assert sorted(seen) == [(b, h, t) for b in range(batch)
                          for h in range(heads) for t in range(tiles)]
  excess = max(work) - np.mean(work)
  assert excess <= weight.max(), work  # At most one item more than its share.
  if mask == Mask(is_causal=True):  # Balanced within 2% (1-3 tiles at 2k).
    assert excess <= max(3, 0.02 * np.mean(work)), work
  local = len(rounds) - (0 if order is None else scheduling.TAIL_ROUNDS)
  for i in range(local):
    assert len(rounds[i]) <= -(-programs // tiles) + 1, (i, rounds[i])


@pytest.mark.parametrize("head_dim,kv_len,mask,persistent", [
    (128, 2048, Mask(), True), (64, 1000, Mask(), True),
    (128, 16384, Mask(), True), (96, 2048, Mask(), True),
    (256, 1024, Mask(), False), (128, 2048, Mask(is_causal=True), True),
    (64, 1024, Mask(window_left=100, window_right=100), False),
    (64, 1024, Mask(has_ids=True, segments_only=True), False),
    (64, 1024, Mask(is_causal=True, has_q_offsets=True), False),
    (64, 1024, None, False)])
def test_default_is_persistent_only_without_a_mask_but_causality(
    head_dim, kv_len, mask, persistent):
  """The default tiles run the persistent forward where it measured
  faster: no mask but causality (items weighed by the band), head dims
  64, 96 and 128."""
  problem = Problem(batch=2, q_len=kv_len, kv_len=kv_len, num_heads=8,
                    num_kv_heads=8, head_dim=head_dim, unbatched=False)
  blocks = MosaicGpuBackend().config(
      None, problem, jnp.bfloat16,
      is_causal=mask is not None and mask.is_causal, mask=mask)
  assert blocks.persistent is persistent


@pytest.mark.parametrize("head_dim,kv_len,causal,block_kv", [
    (64, 1024, True, 128), (64, 2048, True, 128), (64, 2049, True, 256),
    (64, 16384, True, 256), (64, 1024, False, 256), (128, 1024, True, 128),
    (192, 1024, True, 96), (192, 16384, False, 96), (256, 1024, True, 64),
    (256, 4096, False, 64), (256, 4097, False, 80), (256, 16384, True, 80)])
def test_default_key_tiles_follow_head_dim_causality_and_length(
    head_dim, kv_len, causal, block_kv):
  """Head dim 64 causal takes 128-key tiles up to SHORT_KV_LEN keys (faster
  at 1k/2k on the H200, slower at 4k/16k), 256 above and non-causal; head
  dim 192 96-key tiles; 256 64, or 80 above LONG_KV_LEN keys."""
  problem = Problem(batch=2, q_len=kv_len, kv_len=kv_len, num_heads=8,
                    num_kv_heads=8, head_dim=head_dim, unbatched=False)
  blocks = MosaicGpuBackend().config(
      None, problem, jnp.bfloat16, is_causal=causal,
      mask=Mask(is_causal=causal))
  assert blocks.block_kv == block_kv


def test_persistent_forward_names_what_it_cannot_take():
  with pytest.raises(ValueError, match="persistent=True needs "
                     "named_barriers=False"):
    jax_flash.MosaicBlockSizes(persistent=True, named_barriers=True)


def _kernel_modules(text):
  """{kernel name: its serialized Mosaic GPU module} of a lowered text,
  without the dump file name's process-wide counter."""
  modules = {}
  for line in text.splitlines():
    name = re.search(r"flash_attention_\w+_mosaic", line)
    if "mosaic_gpu" in line and name:
      modules[name.group(0)] = re.sub(
          r"(dump_basename\\00\w+?)_\d+\\00", r"\1\\00",
          line.split("module = ", 1)[1])
  return modules


def test_producer_registers_set_every_kernels_split():
  """`producer_registers` is each kernel's `setmaxnreg` split: the producer
  warpgroup's count, the consumers' the rest."""
  modules = _kernel_modules(_lower_grad(
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
  plain = _kernel_modules(_lower_grad("mosaic", shape, is_causal=True))
  other = _kernel_modules(_lower_grad(
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
  text = _lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
                     block_sizes=blocks, **kwargs)
  assert set(_kernel_modules(text)) == {"flash_attention_forward_mosaic",
                                        "flash_attention_dkv_mosaic"}
  dkv = next(line for line in text.splitlines()
             if "flash_attention_dkv_mosaic" in line and "mosaic_gpu" in line)
  assert "output_operand_aliases" in dkv


@pytest.mark.parametrize("head_dim", [96, 256])
def test_fused_dq_names_the_head_dims_it_takes(head_dim):
  with pytest.raises(ValueError, match=r"fused_dq=True needs a head_dim in "
                     rf"\(64, 128\), got {head_dim}"):
    _lower_grad("mosaic", (1, 256, 256, 4, 4, head_dim),
                block_sizes=jax_flash.MosaicBlockSizes(fused_dq=True))


def _schedule_calls(monkeypatch, wg, first, lo, hi, steps):
  """Warpgroup `wg`'s hardware-barrier ops, (op, id), as the forward's
  consumer makes them: warpgroup 1 opens half a step behind, key tiles
  [lo, hi) are computed (arrive and wait after Q K^T, arrive after the
  softmax, wait before P V), the rest of [first, steps) only released,
  and warpgroup 0 closes."""
  ops = []
  monkeypatch.setattr(flash_fwd, "_hardware_barrier",
                      lambda op, barrier_id: ops.append((op, barrier_id)))
  schedule = flash_fwd._Schedule(None, wg)
  if wg == 1:
    schedule.both(1)
  for j in range(first, steps):
    schedule.both(0)
    if lo <= j < hi:
      schedule.arrive(1)
      schedule.wait(1)
    else:
      schedule.both(1)
  if wg == 0:
    schedule.both(0)
  return ops


def _run_hardware_barriers(programs, rng):
  """Runs each warpgroup's (op, id) list in a random interleaving under
  `bar.arrive` / `bar.sync` semantics (a barrier completes at two
  warpgroups' arrivals, whoever they are; `sync` blocks until the one it
  joined completes). Returns the arrivers of each completion, or None
  on a deadlock."""
  pc = [0] * len(programs)
  blocked = [None] * len(programs)  # (barrier id, its generation).
  arrivals, generation, completions = {}, {}, []
  while any(pc[w] < len(p) for w, p in enumerate(programs)):
    ready = [w for w, p in enumerate(programs)
             if pc[w] < len(p) and blocked[w] is None]
    if not ready:
      return None
    w = ready[rng.integers(len(ready))]
    op, barrier_id = programs[w][pc[w]]
    pc[w] += 1
    arrivals.setdefault(barrier_id, []).append(w)
    gen = generation.get(barrier_id, 0)
    if op == "sync":
      blocked[w] = (barrier_id, gen)
    if len(arrivals[barrier_id]) == 2:
      completions.append(arrivals.pop(barrier_id))
      generation[barrier_id] = gen + 1
      blocked = [None if b == (barrier_id, gen) else b for b in blocked]
  return completions


@pytest.mark.parametrize("ranges", [
    ((0, 3), (0, 3)),  # Both warpgroups need every tile.
    ((0, 2), (0, 5)),  # Causal: warpgroup 0 releases the last three.
    ((2, 5), (0, 3)),  # Each releases what the other needs.
    ((0, 0), (1, 4)),  # Warpgroup 0 needs none.
])
def test_named_barrier_schedule_pairs_each_arrival_with_the_others_wait(
    monkeypatch, ranges):
  """In any interleaving, every hardware barrier completes with one
  arrival from each warpgroup, and nothing deadlocks: a warpgroup running
  ahead through tiles it only releases never arrives twice at a barrier
  the other has not yet waited on."""
  first = min(lo for lo, _ in ranges)
  steps = max(hi for _, hi in ranges)
  programs = [_schedule_calls(monkeypatch, wg, first, lo, hi, steps)
              for wg, (lo, hi) in enumerate(ranges)]
  rng = np.random.default_rng(0)
  for _ in range(200):
    completions = _run_hardware_barriers(programs, rng)
    assert completions is not None, "deadlock"
    assert all(sorted(arrivers) == [0, 1] for arrivers in completions)


def test_mosaic_block_sizes_are_validated():
  with pytest.raises(ValueError, match="block_q=48 must be a multiple of 64"):
    jax_flash.MosaicBlockSizes(block_q=48)
  with pytest.raises(ValueError, match="block_kv=72 must be a multiple of "
                     "16 from 64 up"):
    jax_flash.MosaicBlockSizes(block_kv=72)
  with pytest.raises(ValueError, match="block_kv=48 must be a multiple of "
                     "16 from 64 up"):
    jax_flash.MosaicBlockSizes(block_kv=48)
  with pytest.raises(ValueError, match="block_kv_dq=80 must be a multiple "
                     "of 64"):
    jax_flash.MosaicBlockSizes(block_kv_dq=80)
  with pytest.raises(ValueError, match="named_barriers=1 must be a bool"):
    jax_flash.MosaicBlockSizes(named_barriers=1)
  with pytest.raises(ValueError, match="dv_before_ds=0 must be a bool"):
    jax_flash.MosaicBlockSizes(dv_before_ds=0)
  with pytest.raises(ValueError, match="fp8_backward=1 must be a bool"):
    jax_flash.MosaicBlockSizes(fp8_backward=1)
  with pytest.raises(ValueError, match="fp8_backward=True needs "
                     "fused_dq=False"):
    jax_flash.MosaicBlockSizes(fp8_backward=True, fused_dq=True)
  with pytest.raises(ValueError, match="overlap=1 must be a bool"):
    jax_flash.MosaicBlockSizes(overlap=1)
  with pytest.raises(ValueError, match="overlap=True needs "
                     "named_barriers=False"):
    jax_flash.MosaicBlockSizes(overlap=True, named_barriers=True)
  with pytest.raises(ValueError, match="producer_registers=20 must be a "
                     "multiple of 8 in"):
    jax_flash.MosaicBlockSizes(producer_registers=20)
  assert jax_flash.MosaicBlockSizes().consumer_registers(2) == 232
  assert jax_flash.MosaicBlockSizes(
      producer_registers=24).consumer_registers(2) == 240
  with pytest.raises(ValueError, match="shared memory"):
    _lower_grad("mosaic", (2, 256, 512, 8, 2, 256),
                block_sizes=jax_flash.MosaicBlockSizes(block_kv=128,
                                                       num_stages=4))
  with pytest.raises(ValueError, match="shared memory in the backward"):
    _lower_grad("mosaic", (2, 256, 512, 8, 2, 128),
                block_sizes=jax_flash.MosaicBlockSizes(block_kv_dq=256,
                                                       num_stages_bwd=3))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_takes_score_modifications_forward_and_backward(head_dim):
  text = _lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                     is_causal=True, logits_soft_cap=30.0,
                     alibi_slopes=jnp.ones((1, 4)))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def _lower_flex(implementation, mask_mod, score_mod=None, t=300, s=520,
                head_dim=128):
  q = jax.ShapeDtypeStruct((2, t, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, s, 2, head_dim), jnp.bfloat16)
  block_mask = jax_flash.create_block_mask(mask_mod, None, None, t, s)

  def loss(q, k, v):
    out = jax_flash.flex_attention(q, k, v, score_mod, block_mask,
                                   implementation=implementation)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_flex_runs_the_mosaic_kernels(head_dim):
  """A mask_mod (its tile-range table read in the kernels) and a score_mod
  that close over no array: the Mosaic forward, dK/dV and dQ, picked by
  the default dispatch on an H200."""
  text = _lower_flex(None, lambda b, h, q, k: (q >= k) & (q - k < 4 << h),
                     lambda s, b, h, q, k: s - 0.1 * (h + 1) * jnp.abs(q - k),
                     head_dim=head_dim)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def test_flex_mod_the_mosaic_lowering_lacks_runs_triton():
  """floor is not among the primitives the Mosaic kernels take in a mod:
  the default picks Triton; naming Mosaic says why."""
  mod = lambda b, h, q, k: jnp.floor(q / 2.0) >= jnp.floor(k / 2.0)
  text = _lower_flex(None, mod)
  assert MOSAIC_CALL not in text and TRITON_FORWARD in text
  with pytest.raises(ValueError, match=r"cannot run a mask_mod/score_mod "
                     r"made of \['floor'\]"):
    _lower_flex("mosaic", mod)


def test_flex_mask_mod_reading_an_array_runs_triton():
  """Document ids closed over by the mask_mod: the Mosaic kernels cannot
  read them, so the default picks Triton; naming Mosaic says why."""
  ids = jnp.arange(300) // 70
  mod = lambda b, h, q, k: ids[q] == ids[jnp.minimum(k, 299)]
  text = _lower_flex(None, mod)
  assert MOSAIC_CALL not in text and TRITON_FORWARD in text
  with pytest.raises(ValueError, match="cannot read the arrays a mask_mod "
                     "or score_mod closes over"):
    _lower_flex("mosaic", mod)


def test_flex_score_mod_reading_a_table_runs_triton():
  """A relative-bias table closed over by the score_mod: the default on an
  H200 runs Triton's forward, dK/dV and dQ kernels, which read the table
  element by element, and the blockwise loops for the table's gradient
  (here unused: XLA drops them); naming Mosaic says why."""
  table = jnp.linspace(-1.0, 1.0, 300 + 520 + 1)
  mod = lambda s, b, h, q, k: s + table[q - k + 520]
  causal = lambda b, h, q, k: q >= k
  text = _lower_flex(None, causal, mod)
  assert MOSAIC_CALL not in text
  assert all(name in text for name in (TRITON_FORWARD,) + TRITON_BACKWARD)
  with pytest.raises(ValueError, match="cannot read the arrays a mask_mod "
                     "or score_mod closes over"):
    _lower_flex("mosaic", causal, mod)


@pytest.mark.parametrize("kwargs", [
    dict(sinks=jnp.zeros((8,))),
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0),
         dropout_broadcast=True, logits_soft_cap=30.0)],
    ids=["sinks", "dropout", "dropout_broadcast_soft_cap"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_takes_sinks_and_dropout(kwargs, head_dim):
  """Sinks and dropout in the forward, dK/dV and dQ kernels."""
  text = _lower_grad("mosaic", (1, 300, 1003, 8, 2, head_dim), jnp.bfloat16,
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
  text = _lower_grad("mosaic", (2, 300, 1003, 8, 2, head_dim),
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
  text = _lower_grad("mosaic", (1, 300, 1003, 4, 2, 256), block_sizes=blocks,
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
  text = _lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
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
  text = _lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                     is_causal=True, segment_ids=ids,
                     query_seq_lengths=jnp.array([200]),
                     key_value_seq_lengths=jnp.array([900]))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)
  assert not any(name in text for name in TRITON_BACKWARD)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_query_offsets_run_the_mosaic_forward_and_triton_backward(head_dim):
  """query_offset: the Mosaic forward reads the offsets as scalars; its
  backward declines them, so the plan's backward is Triton's."""
  text = _lower_grad("pallas", (2, 256, 512, 8, 2, head_dim), jnp.bfloat16,
                     is_causal=True, query_offset=jnp.array([256, 3]),
                     alibi_slopes=jnp.linspace(0.1, 0.8, 8))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in TRITON_BACKWARD)
  assert not any(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("head_dim", [96, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_head_dims_96_and_192_lower_unpadded(head_dim, causal):
  """No padding to a power of two: 96 (64-byte swizzle, the 128 kernels'
  structure) and 192 (the 256 kernels': dK and dV split, one dQ
  warpgroup)."""
  text = _lower_grad("mosaic", (1, 300, 1003, 4, 2, head_dim), jnp.bfloat16,
                     is_causal=causal)
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)
  assert f"{head_dim}xbf16" in text  # The kernels' operands are unpadded.


@pytest.mark.parametrize("transposed", [False, True])
def test_mosaic_range_table_of_a_mask_mod_and_ids(transposed):
  """`tiles.range_table` (the Mosaic kernels' tile ranges, on the CPU:
  plain XLA): a mask_mod's kinds intersected with segment ids' ranges; every
  visible pair's tile is visited, every tile of the full range is wholly
  visible, the rows the kernel pads with are empty."""
  import numpy as np
  from jax_flash.core import mask as mask_lib
  from pallas_kernels.mosaic_gpu.tiles import range_table
  b, t, s, rows, cols = 2, 200, 300, 64, 32
  mod = lambda _b, _h, q, k: (q >= k) | (k < 40)
  block_mask = jax_flash.create_block_mask(mod, None, None, t, s,
                                           block_size=(16, 16))
  kinds = block_mask.kinds[:, 0].astype(jnp.int8)
  q_ids = jnp.sort(jax.random.randint(jax.random.key(0), (b, t), 0, 3), 1)
  kv_ids = jnp.sort(jax.random.randint(jax.random.key(1), (b, s), 0, 3), 1)
  mask = mask_lib.Mask(has_ids=True, mod=mod, mod_tiles=(16, 16))
  padded = 8  # Row tiles the kernel runs: more than the lengths need.
  table = np.asarray(range_table(mask, kinds, q_ids, kv_ids, rows, cols, t,
                                 s, padded, transposed=transposed))
  assert table.shape == (b, padded, 4)
  qi, ki = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = (np.asarray(mod(0, 0, qi, ki)) &
         (np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]))
  if transposed:
    vis = vis.transpose(0, 2, 1)
  for batch in range(b):
    for r in range(padded):
      lo, full_lo, full_hi, hi = table[batch, r]
      tile = vis[batch, r * rows:(r + 1) * rows]
      if not tile.size:  # Past the length: nothing to visit.
        assert lo == hi, (batch, r)
        continue
      seen = np.nonzero(tile.any(axis=0))[0] // cols
      assert all(lo <= c < hi for c in seen), (batch, r)
      for c in range(full_lo, full_hi):
        assert tile[:, c * cols:(c + 1) * cols].all(), (batch, r, c)
  if not transposed:  # Some query tiles skip the predicate on some keys.
    assert (table[..., 2] > table[..., 1]).any()


def test_pad_pairs_keeps_broadcast_dims_and_hides_the_padding():
  """`core.padding.pad_pairs` (plain XLA, what the Mosaic kernels read a
  dense mask or bias from): full dims padded with 0 to the kernels' rows,
  dims of 1 kept (broadcast in registers), the last two swapped for dK/dV."""
  from jax_flash.core.padding import pad_pairs
  x = jnp.arange(2 * 3 * 5 * 7, dtype=jnp.float32).reshape(2, 3, 5, 7) + 1
  padded = pad_pairs(x, 8, 16)
  assert padded.shape == (2, 3, 8, 16)
  assert (padded[:, :, :5, :7] == x).all()
  assert not padded[:, :, 5:].any() and not padded[:, :, :, 7:].any()
  assert (pad_pairs(x, 8, 16, transposed=True) == padded.swapaxes(2, 3)).all()
  assert pad_pairs(x[:, :, :1], 8, 16).shape == (2, 3, 1, 16)
  assert pad_pairs(x[:1, :, :, :1], 8, 16, transposed=True).shape == (
      1, 3, 1, 8)
  assert pad_pairs(None, 8, 16) is None


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
  want = _lower_grad(implementation, (1, 300, 1003, 4, 2, 128), **kwargs)
  with jax.enable_x64(True):
    got = _lower_grad(implementation, (1, 300, 1003, 4, 2, 128), **kwargs)
    q = jax.ShapeDtypeStruct((2, 1, 4, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(
        mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
      jax.jit(lambda q, k, v: jax_flash.flash_decode(
          q, k, v, kv_lengths=np.array([1000, 3]),
          implementation=implementation)).trace(q, cache, cache).lower(
              lowering_platforms=("cuda",))
  assert got.count("custom_call") == want.count("custom_call")


def _kernel_operands(text, kernel):
  """The operand types of the first call of Mosaic GPU kernel `kernel`."""
  call = next(line for line in text.splitlines()
              if MOSAIC_CALL in line and kernel in line)
  return re.findall(r"tensor<([0-9x]+)x(?:bf16|f16)>", call)


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
    operands = _kernel_operands(text, kernel)
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
    text = _lower_grad(implementation, (2, 256, 520, 8, 2, head_dim),
                       is_causal=causal, fp8=True)
    assert "flash_attention_forward_mosaic" in text
    assert all(name in text for name in MOSAIC_BACKWARD)
    assert "f8E4M3FN" in text


@pytest.mark.parametrize("shape, kwargs, match", [
    ((2, 256, 520, 8, 2, 96), {}, r"head dims \(64, 128, 256\)"),
    ((2, 256, 520, 8, 2, 64), dict(logits_soft_cap=30.0), "no soft-cap"),
    ((2, 256, 520, 8, 2, 64), dict(local_window_size=(64, 0)),
     "only a causal mask"),
])
def test_fp8_calls_the_forward_lacks_say_why(shape, kwargs, match):
  """Named, the Mosaic backend says what its FP8 forward lacks; the
  default runs such a call on the blockwise path."""
  with pytest.raises(ValueError, match=match):
    _lower_grad("mosaic", shape, fp8=True, **kwargs)
  text = _lower_grad(None, shape, fp8=True, **kwargs)
  assert MOSAIC_CALL not in text and "flash_attention_forward" not in text


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
    text = _lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                       block_sizes=jax_flash.MosaicBlockSizes(
                           fp8_backward=on, block_kv=64))
    assert all(name in text for name in MOSAIC_BACKWARD)
    heads = {m.group(1) for m in transposed.finditer(text)}
    assert heads == ({"8", "2"} if on else {"2"})
  # The default: the FP8 backward at head dims 128 and 256, its dO
  # rounded by the Triton kernels as the inputs are.
  text = _lower_grad(None, shape, is_causal=causal, fp8=True)
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
  text = _lower_grad("mosaic", (2, 256, 520, 8, 2, head_dim),
                     is_causal=causal, fp8=True, block_sizes=blocks)
  assert "flash_attention_forward_mosaic" in text
  with pytest.raises(ValueError, match="overlap=True is the FP8 forward's"):
    _lower_grad("mosaic", (2, 256, 520, 8, 2, head_dim), is_causal=causal,
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
  on = _lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                   block_sizes=blocks(e4m3_stmatrix=True))
  off = _lower_grad("mosaic", shape, is_causal=causal, fp8=True,
                    block_sizes=blocks())
  assert all(name in on for name in MOSAIC_BACKWARD)
  assert on != off


@pytest.mark.parametrize("head_dim, on", [(64, False), (128, True),
                                          (256, False)])
def test_fp8_stores_by_stmatrix_by_default_at_128(head_dim, on):
  """fp8=True's default tiles store e4m3 tiles by `stmatrix` at head dim
  128 only (`config.FP8_STMATRIX_DEFAULT_HEAD_DIMS`); a call's own
  BlockSizes keep theirs."""
  problem = Problem(batch=2, q_len=2048, kv_len=2048, num_heads=8,
                    num_kv_heads=2, head_dim=head_dim, unbatched=False)
  scores = Scores(scale=head_dim ** -0.5, fp8="amax")
  backend = MosaicGpuBackend()
  blocks = backend.config(None, problem, jnp.bfloat16, is_causal=True,
                          scores=scores, mask=Mask(is_causal=True))
  assert blocks.e4m3_stmatrix == on
  own = jax_flash.MosaicBlockSizes(block_kv=64)
  assert not backend.config(own, problem, jnp.bfloat16, is_causal=True,
                            scores=scores,
                            mask=Mask(is_causal=True)).e4m3_stmatrix
