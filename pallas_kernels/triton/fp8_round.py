"""FP8 rounding kernels: max |x| per (batch, KV head) and the e4m3 values,
as `jax_flash.spec.fp8`'s `amax` and `quantize` define them, bitwise.

Both read x [B, L, N, H] where it lies, as [B, L, K, G * H] (a KV head's
G query heads side by side), in tiles of `ROWS` rows by the columns
padded to a power of two, one program a tile, so each element is read
once and written (as e4m3) once, in the layout the input has. XLA's own
ops for the same work may pick transposed layouts for the reduction and
copy the inputs to them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.spec import fp8 as fp8_lib
from pallas_kernels.triton import tiles

TILE_ELEMENTS = 16384  # A program's tile: rows * padded columns.
NUM_WARPS = 4


def _layout(x, num_kv_heads: int):
  """(x as [B, L, K, C], C, padded C, rows a tile, tiles along L)."""
  b, length, n, h = x.shape
  columns = n // num_kv_heads * h
  padded = pl.next_power_of_2(columns)
  rows = max(1, TILE_ELEMENTS // padded)
  return (x.reshape(b, length, num_kv_heads, columns), columns, padded, rows,
          pl.cdiv(length, rows))


def _spec(length, padded):
  return pl.BlockSpec((None, length, None, padded),
                      lambda i, b, k: (b, 0, k, 0))


def _amax_kernel(x_ref, out_ref, *, rows, length, columns):
  start = pl.program_id(0) * rows
  a = jnp.abs(tiles.load_tile(x_ref, start, rows, row_bound=length,
                              head_dim=columns).astype(jnp.float32))
  # Not finite (NaN compares false) counts as 0.
  out_ref[...] = jnp.max(jnp.where(a < jnp.inf, a, 0.0), axis=0)


def amax(x, num_kv_heads: int, *, interpret: bool = False):
  """`fp8.amax`: float32 [B, K], max |x| of finite values. x [B, L, N, H]."""
  x4, columns, padded, rows, num_tiles = _layout(x, num_kv_heads)
  batch, length = x.shape[:2]
  partial = pl.pallas_call(
      functools.partial(_amax_kernel, rows=rows, length=length,
                        columns=columns),
      grid=(num_tiles, batch, num_kv_heads),
      in_specs=[_spec(length, padded)],
      out_specs=pl.BlockSpec((None, None, None, padded),
                             lambda i, b, k: (i, b, k, 0)),
      out_shape=jax.ShapeDtypeStruct(
          (num_tiles, batch, num_kv_heads, padded), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
      name="fp8_amax",
  )(x4)
  return jnp.max(partial, axis=(0, 3))


def _quantize_kernel(x_ref, inverse_ref, out_ref, *, rows, length, columns):
  start = pl.program_id(0) * rows
  x = tiles.load_tile(x_ref, start, rows, row_bound=length,
                      head_dim=columns).astype(jnp.float32)
  # x / scale exactly: the scale is a power of two whose reciprocal is a
  # normal float32 (`fp8.MIN_SCALE`). |y| <= 448 for finite x; others
  # become NaN, as XLA's conversion makes them (the GPU's saturates).
  y = x * inverse_ref[...]
  y = jnp.where(jnp.abs(y) <= fp8_lib.E4M3_MAX, y, jnp.nan)
  tiles.store_tile(out_ref, start, y.astype(fp8_lib.E4M3), row_bound=length,
                   head_dim=columns)


def quantize(x, scale, num_kv_heads: int, *, interpret: bool = False):
  """`fp8.quantize`: x [B, L, N, H] as e4m3 values x / scale, scale [B, K]
  float32 powers of two (`fp8.scale_of`)."""
  x4, columns, padded, rows, num_tiles = _layout(x, num_kv_heads)
  batch, length = x.shape[:2]
  out = pl.pallas_call(
      functools.partial(_quantize_kernel, rows=rows, length=length,
                        columns=columns),
      grid=(num_tiles, batch, num_kv_heads),
      in_specs=[_spec(length, padded),
                pl.BlockSpec((None, None), lambda i, b, k: (b, k))],
      out_specs=_spec(length, padded),
      out_shape=jax.ShapeDtypeStruct(x4.shape, fp8_lib.E4M3),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
      name="fp8_quantize",
  )(x4, (1 / scale).astype(jnp.float32))
  return out.reshape(x.shape)


ROUNDING = fp8_lib.Rounding("triton", amax, quantize)
INTERPRET = fp8_lib.Rounding(
    "interpret", functools.partial(amax, interpret=True),
    functools.partial(quantize, interpret=True))
