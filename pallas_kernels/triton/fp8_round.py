"""FP8 rounding kernels: max |x| per (batch, KV head) and the e4m3 values,
as `jax_flash.core.fp8`'s `amax` and `quantize` define them, bitwise.

Both read x [B, L, N, H] where it lies, a head at a time, in tiles of
rows by the head dim padded to a power of two (`TILE_ELEMENTS` in all),
one program a tile, so each element is read once and written (as e4m3)
once, in x's shape and layout (no reshape after the kernel: XLA may turn
one into transposes). XLA's own ops for the same work may pick
transposed layouts for the reduction and copy the inputs to them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.core import fp8 as fp8_lib
from pallas_kernels.triton import tiles

TILE_ELEMENTS = 16384  # A program's tile: rows * padded columns.
NUM_WARPS = 4


def _tiles(x):
  """(H padded to a power of two, rows a tile, tiles along L) of x."""
  padded = pl.next_power_of_2(x.shape[3])
  rows = max(1, TILE_ELEMENTS // padded)
  return padded, rows, pl.cdiv(x.shape[1], rows)


def _spec(length, padded):
  return pl.BlockSpec((None, length, None, padded),
                      lambda i, b, n: (b, 0, n, 0))


def _tile(x_ref, rows, length, head_dim):
  """(this program's first row, its tile of x in float32, 0 past L and H)."""
  start = pl.program_id(0) * rows
  return start, tiles.load_tile(x_ref, start, rows, row_bound=length,
                                head_dim=head_dim).astype(jnp.float32)


def _amax_kernel(x_ref, out_ref, *, rows, length, head_dim):
  a = jnp.abs(_tile(x_ref, rows, length, head_dim)[1])
  # Not finite (NaN compares false) counts as 0.
  out_ref[...] = jnp.max(jnp.where(a < jnp.inf, a, 0.0), axis=0)


def amax(x, num_kv_heads: int, *, interpret: bool = False):
  """`fp8.amax`: float32 [B, K], max |x| of finite values. x [B, L, N, H]."""
  batch, length, num_heads, head_dim = x.shape
  if x.size == 0:
    return jnp.zeros((batch, num_kv_heads), jnp.float32)
  padded, rows, num_tiles = _tiles(x)
  partial = pl.pallas_call(
      functools.partial(_amax_kernel, rows=rows, length=length,
                        head_dim=head_dim),
      grid=(num_tiles, batch, num_heads),
      in_specs=[_spec(length, padded)],
      out_specs=pl.BlockSpec((None, None, None, padded),
                             lambda i, b, n: (i, b, n, 0)),
      out_shape=jax.ShapeDtypeStruct((num_tiles, batch, num_heads, padded),
                                     jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
      name="fp8_amax",
  )(x)
  group = partial.reshape(num_tiles, batch, num_kv_heads, -1)
  return jnp.max(group, axis=(0, 3))


def _quantize_kernel(x_ref, inverse_ref, out_ref, *, rows, length,
                     head_dim):
  start, x = _tile(x_ref, rows, length, head_dim)
  # x / scale exactly: the scale is a power of two whose reciprocal is a
  # normal float32 (`fp8.MIN_SCALE`). |y| <= 448 for finite x; others
  # become NaN, as XLA's conversion makes them (the GPU's saturates).
  y = x * inverse_ref[...]
  y = jnp.where(jnp.abs(y) <= fp8_lib.E4M3_MAX, y, jnp.nan)
  tiles.store_tile(out_ref, start, y.astype(fp8_lib.E4M3), row_bound=length,
                   head_dim=head_dim)


def quantize(x, scale, num_kv_heads: int, *, interpret: bool = False):
  """`fp8.quantize`: x [B, L, N, H] as e4m3 values x / scale, scale [B, K]
  float32 powers of two (`fp8.scale_of`)."""
  batch, length, num_heads, head_dim = x.shape
  if x.size == 0:
    return jnp.zeros(x.shape, fp8_lib.E4M3)
  group = num_heads // num_kv_heads
  padded, rows, num_tiles = _tiles(x)
  return pl.pallas_call(
      functools.partial(_quantize_kernel, rows=rows, length=length,
                        head_dim=head_dim),
      grid=(num_tiles, batch, num_heads),
      in_specs=[_spec(length, padded),
                pl.BlockSpec((None, None),
                             lambda i, b, n: (b, jax.lax.div(n, group)))],
      out_specs=_spec(length, padded),
      out_shape=jax.ShapeDtypeStruct(x.shape, fp8_lib.E4M3),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
      name="fp8_quantize",
  )(x, (1 / scale).astype(jnp.float32))


ROUNDING = fp8_lib.Rounding("triton", amax, quantize)
INTERPRET = fp8_lib.Rounding(
    "interpret", functools.partial(amax, interpret=True),
    functools.partial(quantize, interpret=True))
