"""Host-side layout decisions of the Mosaic GPU kernels, made at trace
time from shapes alone: how many consumer warpgroups a kernel runs
(`COMPUTE_WGS`, `dq_warpgroups`, `split_dkv`), the rows a sequence array
needs (`tma_rows`) and a streamed sequence's last tile runs on
(`tail_rows`), shared-memory swizzles (`smem_transforms`, `one_atom_wide`),
and a head dim's column parts in the forward (`Columns`) and the backward
(`backward_columns`)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core.padding import round_up
from pallas_kernels.mosaic_gpu.config import (BACKWARD_PARTS_MAX_KV_LEN,
                                              HEAD_DIM_MULTIPLE,
                                              MIN_KERNEL_HEAD_DIM,
                                              BlockSizes, kernel_head_dim)

COMPUTE_WGS = 2


def tma_rows(length: int, whole_atoms: bool = False) -> int:
  """Rows a kernel's sequence array (Q, K, V, O, dO and the gradients)
  has for `length` positions. Tiles reaching past the last row are not
  padded: the TMA unit reads zeros there and drops stores past it. A tiled
  copy views a [rows, head dim] tile's rows in groups of 8, so the array
  needs the next multiple of 8 (XLA pads only lengths that are not one);
  with `whole_atoms` (`one_atom_wide`: the tiles are copied untiled,
  `tile_buffer`) it needs none."""
  return length if whole_atoms else round_up(length, 8)


def tail_rows(length: int, block: int, multiple: int) -> int:
  """Rows of the last `block`-row tile of a sequence of `length` that a
  consumer streaming those tiles computes on: the rows up to the length
  rounded up to `multiple` (`Columns.contraction_rows`: a matmul over the
  tile's rows takes them in groups of its swizzle's elements), so that
  257 keys in 128-row tiles take 256 + 64 rows, not 384. The tile's TMA
  copy still covers `block` rows (zeros past the length)."""
  return min(block, round_up(length % block or block, multiple))


def smem_transforms(dtype, minor_dim: int, rows: int | None = None):
  """Tiling and swizzle for a [rows, minor_dim] tile read by wgmma; with
  `rows`, for the right operand of a matmul over them (P V: wgmma wants its
  contracted dim a multiple of the swizzle's elements), the largest swizzle
  whose elements divide both (32 bytes for 80-row tiles)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_dim * itemsize * 8)
  while rows is not None and rows % (swizzle // itemsize):
    swizzle //= 2
  elems = swizzle // itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def one_atom_wide(dtype, head_dim: int, *rows: int) -> bool:
  """Whether [rows, head_dim] tiles (and V's tiles of each of `rows` rows,
  whose swizzle `smem_transforms` may narrow) are one swizzle atom wide
  (head dims 32 and 64 in 16 bits): their tiled layout is then the same
  bytes as the untiled rows, which TMA copies without grouping rows by 8
  (`tile_buffer`)."""
  return all(smem_transforms(dtype, head_dim, r)[0].tiling[1] == head_dim
             for r in (None, *rows))


@dataclasses.dataclass(frozen=True)
class Columns:
  """How the forward's tiles cover a head dim: `parts`, (start, width)
  column ranges of Q, K, V and O, each with tiles of its own in shared
  memory (one part, the whole head dim, for a multiple of 16); `untiled`,
  whether TMA copies Q's and K's tiles, and V's, untiled (`tile_buffer`)."""
  parts: tuple[tuple[int, int], ...]
  untiled: tuple[bool, bool]

  @classmethod
  def of(cls, dtype, head_dim: int, block_kv: int, q_len: int = 8,
         kv_len: int = 8) -> "Columns | None":
    """The columns of a head dim: a multiple of 16 in one part, or where
    that part's tiles would be copied tiled at a length off a multiple of 8
    (`copies`: head dims 80-256 at 257 tokens), in parts one swizzle atom
    wide (64, 32 and 16 columns in 16 bits) if V's tiles of block_kv rows
    take them; any other head dim in such parts, the last reaching past
    the head dim (TMA reads zeros there and drops O's stores), so no column
    is padded in XLA; None where TMA cannot read the arrays in place (a
    row of the head dim not a multiple of 16 bytes) or V's tiles cannot
    take the parts (`smem_transforms`)."""
    if head_dim % HEAD_DIM_MULTIPLE == 0 and head_dim >= MIN_KERNEL_HEAD_DIM:
      one = cls(((0, head_dim),), (one_atom_wide(dtype, head_dim),
                                   one_atom_wide(dtype, head_dim, block_kv)))
      if not one.copies(q_len, kv_len):
        return one
      return cls._in_parts(dtype, head_dim, block_kv) or one
    if head_dim * jnp.dtype(dtype).itemsize % 16:
      return None
    return cls._in_parts(dtype, kernel_head_dim(head_dim, head_dim), block_kv)

  @classmethod
  def _in_parts(cls, dtype, width: int, block_kv: int) -> "Columns | None":
    """`width` columns in parts one swizzle atom wide, widest first (None
    where V's tiles of block_kv rows cannot take them)."""
    parts, start = [], 0
    while width:
      part = max(w for w in (64, 32, 16) if w <= width)
      parts.append((start, part))
      start, width = start + part, width - part
    if not all(one_atom_wide(dtype, w, block_kv) for _, w in parts):
      return None
    return cls(tuple(parts), (True, True))

  def contraction_rows(self, dtype, rows: int | None = None) -> int:
    """The rows a wgmma over these tiles' rows takes at a time (its K
    group: the widest part's swizzle in elements, `smem_transforms`; with
    `rows`, that of V's tiles of so many rows)."""
    return max(smem_transforms(dtype, w, rows)[0].tiling[1]
               for _, w in self.parts)

  @property
  def width(self) -> int:
    """The columns the parts cover: the head dim, or past it."""
    return sum(w for _, w in self.parts)

  def copies(self, q_len: int, kv_len: int) -> bool:
    """Whether XLA copies a sequence array around the forward: a length off
    a multiple of 8 whose tiles are copied tiled (`tma_rows`)."""
    qk, v = self.untiled
    return bool((not qk and (q_len % 8 or kv_len % 8))
                or (not v and kv_len % 8))


def split_dkv(head_dim: int) -> bool:
  """Whether the dK/dV kernel splits dK and dV between its warpgroups."""
  return head_dim > 128


def dq_warpgroups(head_dim: int) -> int:
  """Consumer warpgroups of the dQ kernel: one above head dim 128, where two
  warpgroups' Q and dO tiles and a two-slot K/V ring (256 KiB at head dim
  256) would not fit shared memory (K/V tiles cannot shrink below 64 rows:
  they are the contraction of dQ += dS K)."""
  return 1 if head_dim > 128 else COMPUTE_WGS


def backward_columns(dtype, head_dim: int, q_len: int, kv_len: int,
                     blocks: BlockSizes) -> Columns | None:
  """The backward's column parts (`tiles.Columns`, with the 64 rows every
  kernel's tiles are a multiple of): a head dim that is a multiple of 16 in
  one part unless a length off a multiple of 8 would have its tiles copied
  tiled, any other in parts one swizzle atom wide up to
  `config.BACKWARD_PARTS_MAX_KV_LEN` keys; with `fused_dq`, whose dQ
  matmul slices K's columns, one part (rows padded, `tiles.tma_rows`).
  None where the backend pads the head dim first (to a multiple of 16)."""
  if head_dim % HEAD_DIM_MULTIPLE and (
      blocks.fused_dq or kv_len > BACKWARD_PARTS_MAX_KV_LEN):
    return None
  if blocks.fused_dq:
    return Columns.of(dtype, head_dim, 64)
  return Columns.of(dtype, head_dim, 64, q_len, kv_len)
