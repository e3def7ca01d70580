"""The Mosaic GPU kernels' shared tile work: what the forward, the backward and
the decode kernel each do with a tile of refs.

Layouts of a consumer warpgroup's values (`ROW`, `COL`), the tile ranges a
CTA's row tile visits (`cta_row_tile`, `table_ranges`, `range_table`: the
band's intersected with a mask_mod's or the ids' table), tiles of a
per-(query, key) operand (`pair_tile`), a score tile's logits (`logits2`),
its visible pairs (`visible`) and the online softmax's step
(`online_softmax`), ids (`load_ids`, `pad_ids`), dropout
(`needs_positions`, `dropped`), the kernels' refs split into inputs,
extras and outputs (`split_refs`), untiled copies of tiles one swizzle
atom wide (`tile_buffer`, `tile_views`), a column part's index
(`columns`), and a producer's wait on the last releases of its ring
(`await_last_releases`). The host-side layout decisions they follow are
`layout`'s. Built on the backend-neutral `jax_flash.core`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core import dropout
from jax_flash.core import fp8 as fp8_lib
from jax_flash.core.mask import (KV_PAD_ID, Q_PAD_ID, Mask, id_block_table,
                                  intersect_ranges, intersect_tables,
                                  kinds_block_table, without_full_tiles)
from jax_flash.core.padding import pad_to
from jax_flash.core.scores import LOG2E, Scores
from pallas_kernels.mosaic_gpu.config import ALIBI_VECTORS_MAX_COLUMNS
from pallas_kernels.mosaic_gpu.layout import smem_transforms

ROW = plgpu.Layout.WGMMA.reduce(1)  # One value per row of a wgmma tile.
COL = plgpu.Layout.WGMMA.reduce(0)  # One value per column.


def await_last_releases(loaded, stages: int, *free):
  """A producer's wait, after its last load, on the consumers' release of
  each of the last `stages` slots of `loaded` (traced) tiles, for each
  barrier array in `free`: every completion of a barrier is waited."""
  for i in range(stages):
    last = loaded - stages + i

    @pl.when(last >= 0)
    def _():
      slot = lax.rem(last, stages)
      for barrier in free:
        plgpu.barrier_wait(barrier.at[slot])


def columns(start: int, width: int, head_dim: int):
  """The index of columns [start, start + width) of a ref with head_dim
  columns: a static slice where they lie inside, else one with a traced
  start (a static slice past a ref's end is refused at trace time; TMA
  reads zeros past it and drops stores there)."""
  if start + width <= head_dim:
    return pl.ds(start, width)
  return pl.ds(lax.axis_index("wg") * 0 + start, width)


def tile_buffer(shape, dtype, transforms, whole_atoms: bool):
  """Scratch for [..., rows, head dim] tiles that TMA copies and wgmma
  reads, with `transforms` (`smem_transforms`). With `whole_atoms`
  (`one_atom_wide`), two views of the same bytes (`tile_views`): swizzled
  only, for the copies, and tiled too, for wgmma and register stores."""
  tiled = plgpu.SMEM(shape, dtype, transforms=transforms)
  if not whole_atoms:
    return tiled
  return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=transforms[1:]),
                        tiled)


def tile_views(buffer, whole_atoms: bool):
  """(the view TMA copies through, the view wgmma reads) of a
  `tile_buffer`'s ref."""
  return tuple(buffer) if whole_atoms else (buffer, buffer)


def cta_row_tile(mask: Mask, axis: str, num_tiles: int):
  """The row tile a CTA owns, from its index along grid axis `axis` (of
  `num_tiles`): reversed under a causal mask, so the tiles that see the
  most key tiles start first and the last wave of CTAs holds short ones
  (the hardware starts CTAs in grid order; tokamax does the same)."""
  index = lax.axis_index(axis)
  return num_tiles - 1 - index if mask.is_causal else index


def table_ranges(mask: Mask, ranges, table_ref, batch, row_tile):
  """`ranges` (lo, full_lo, full_hi, hi) intersected with row `row_tile` of
  a range table ref [Bm, row tiles, 4] (`range_table`; Bm is 1 or B), read
  as scalars from global memory (`ranges` itself without a table); no tile
  full with a dense mask."""
  if table_ref is not None:
    b = batch if table_ref.shape[0] > 1 else 0
    ranges = intersect_ranges(ranges, tuple(table_ref[b, row_tile, c]
                                            for c in range(4)))
  return without_full_tiles(mask, ranges)


def pair_tile(ref, batch, head, rows, cols):
  """ref[batch, head, rows, cols] (a `pad_pairs` ref in global memory) as a
  [rows, cols] tile in the wgmma layout: each dim of 1 broadcast, a row or
  column vector loaded once and broadcast in registers."""
  b = batch if ref.shape[0] > 1 else 0
  h = head if ref.shape[1] > 1 else 0
  shape = (rows.size, cols.size)
  if ref.shape[2] > 1 and ref.shape[3] > 1:
    return plgpu.load(ref.at[b, h, rows, cols], layout=plgpu.Layout.WGMMA,
                      optimized=False)
  if ref.shape[2] > 1:  # One value per row.
    x = plgpu.load(ref.at[b, h, rows, 0], layout=ROW, optimized=False)
    return lax.broadcast_in_dim(x, shape, [0])
  if ref.shape[3] > 1:  # One value per column.
    x = plgpu.load(ref.at[b, h, 0, cols], layout=COL, optimized=False)
    return lax.broadcast_in_dim(x, shape, [1])
  return plgpu.layout_cast(jnp.full(shape, ref[b, h, 0, 0]),
                           plgpu.Layout.WGMMA)


def logits2(scores: Scores, s, rows, cols, *, slope, bias_ref, pair, batch,
            head):
  """(t, c, aux) of a raw score tile `s` (`Scores.factored_logits2`: base-2
  logits t * c): with the ALiBi `slope` (None without) and the tile `pair`
  (rows, cols slices) of a bias ref (None without); rows, cols: the tile's
  positions, or None where the scores need none."""
  bias = (None if bias_ref is None else
          pair_tile(bias_ref, batch, head, *pair).astype(jnp.float32))
  return scores.factored_logits2(s, rows, cols, slope=slope, bias=bias,
                                 batch=batch, head=head)


def visible(mask: Mask, rows, cols, kv_len, *, dense_ref, pair, batch, head,
            q_offset=0, **ids):
  """The boolean tile of pairs `mask` shows (`Mask.visible` on positions
  rows, cols; ids: q_ids, kv_ids broadcast to the tile) and a dense mask's
  tile `pair` shows (dense_ref: None without one)."""
  ok = mask.visible(rows, cols, kv_len, q_offset=q_offset, batch=batch,
                    head=head, **ids)
  if dense_ref is not None:
    ok = ok & (pair_tile(dense_ref, batch, head, *pair) != 0)
  return ok


def softmax_step(s, c, m, l, *, log2_scale: float = 0.0, row=None):
  """One tile of the online softmax on base-2 logits s * c + row (hidden
  pairs -inf; row: a term [rows] every logit of a row shares, or None):
  (p, m_new, l_new, alpha) with the running row max m and sum l updated,
  p = 2**(s c + row - m_new + log2_scale) (P scaled by 2**log2_scale at
  no cost, l summing the scaled P; the row term joins the shift, not each
  logit) and alpha = 2**(m - m_new), the factor that rescales the
  accumulator to m_new (a row that has seen no key keeps max -inf and p
  0)."""
  tile_max = s.max(axis=1) * c
  m_new = jnp.maximum(m, tile_max if row is None else tile_max + row)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_safe)
  shift = m_safe - log2_scale if log2_scale else m_safe
  if row is not None:
    shift = shift - row
  p = jnp.exp2(s * c - lax.broadcast_in_dim(shift, s.shape, [0]))
  return p, m_new, l * alpha + p.sum(axis=1), alpha


def rescaled(acc, alpha):
  """acc [rows, Hv] (or a tuple of column parts) times alpha [rows]."""
  return jax.tree.map(
      lambda a: a * lax.broadcast_in_dim(alpha, a.shape, [0]), acc)


def online_softmax(s, c, m, l, acc, *, log2_scale: float = 0.0, row=None):
  """`softmax_step` with the accumulator acc rescaled: (p, m_new, l_new,
  acc)."""
  p, m_new, l, alpha = softmax_step(s, c, m, l, log2_scale=log2_scale,
                                    row=row)
  return p, m_new, l, rescaled(acc, alpha)


def present(extras) -> list:
  """The arrays of `extras` (a dataclass of optional arrays, or a tuple)
  that are not None, in order: a kernel's inputs after its fixed ones."""
  if dataclasses.is_dataclass(extras):
    extras = [getattr(extras, f.name) for f in dataclasses.fields(extras)]
  return [x for x in extras if x is not None]


def split_refs(refs, num_inputs: int, extras):
  """A kernel's refs as (inputs, extras' refs, outputs): `extras` are the
  optional inputs after the first num_inputs (`present`), as a dataclass
  of them (its refs in the same fields) or a tuple, None for those absent
  (their ref is then None)."""
  inputs, rest = refs[:num_inputs], iter(refs[num_inputs:])
  if dataclasses.is_dataclass(extras):
    extra_refs = dataclasses.replace(extras, **{
        f.name: next(rest) for f in dataclasses.fields(extras)
        if getattr(extras, f.name) is not None})
  else:
    extra_refs = tuple(None if x is None else next(rest) for x in extras)
  return inputs, extra_refs, tuple(rest)


def load_ids(ids_ref, batch, start, size: int, layout):
  """ids_ref[batch, start:start + size] (int32, global memory) in `layout`
  (ROW or COL of a wgmma tile), or None without ids."""
  if ids_ref is None:
    return None
  return plgpu.load(ids_ref.at[batch, pl.ds(start, size)], layout=layout,
                    optimized=False)


def keys_at_or_before(mask: Mask) -> bool:
  """Whether every pair `mask` shows has its key at or before its query
  (the band's right bound <= 0, as on a causal mask)."""
  _, right = mask.band()
  return right is not None and right <= 0


def alibi_by_vectors(mask: Mask, scores: Scores, blocks,
                     columns: int) -> Scores | None:
  """The scores without ALiBi where a tile of `columns` columns adds it
  from a row and a column vector (`with_alibi`), else None (ALiBi, if
  any, formed from two position tiles): with ALiBi among the scores and
  `blocks.alibi_vectors` (None: for tiles of at most
  `ALIBI_VECTORS_MAX_COLUMNS` columns)."""
  wanted = blocks.alibi_vectors
  if wanted is None:
    wanted = columns <= ALIBI_VECTORS_MAX_COLUMNS
  if not (wanted and scores.alibi):
    return None
  return dataclasses.replace(scores, alibi=False)


def with_alibi(t, c, slope, q_rel, k_rel, q_dim: int, mask: Mask, *,
               fold: bool = False):
  """t - (slope * log2(e) / c) |q - k|: a tile of base-2 logits t * c
  (`Scores.factored_logits2`) with ALiBi, from the vectors of its query
  and key positions less one base (the key tile's first), q_rel and k_rel
  (int32, in the layouts of tile dims q_dim and 1 - q_dim; the dK/dV
  kernel's tiles have their queries across, q_dim 1), each scaled once
  by a = slope log2(e) / c, then broadcast. Where `mask` shows keys at or
  before their queries, two additions a pair: t + a k - a q (with `fold`
  t + a k alone, the caller adding `alibi_row(slope, q_rel)` to each
  query's logits); elsewhere t - sign(a) |a k - a q| (a subtraction, |.|
  and a multiply-add)."""
  a = slope * (LOG2E / c)
  folded = fold and keys_at_or_before(mask)
  q_term = None if folded else lax.broadcast_in_dim(
      q_rel.astype(jnp.float32) * a, t.shape, [q_dim])
  k_term = lax.broadcast_in_dim(k_rel.astype(jnp.float32) * a, t.shape,
                                [1 - q_dim])
  if folded:
    return t + k_term
  if keys_at_or_before(mask):
    return t + k_term - q_term
  return t - jnp.abs(k_term - q_term) * jnp.where(a < 0, -1.0, 1.0)


def alibi_row(slope, q_rel):
  """-slope log2(e) q_rel: the base-2 query term `with_alibi(..., fold=True)`
  leaves out, a vector in q_rel's layout."""
  return q_rel.astype(jnp.float32) * (-LOG2E * slope)


def alibi_folded(mask: Mask, blocks) -> bool:
  """Whether ALiBi's query term joins the row max or the logsumexp
  (`BlockSizes.alibi_fold` on a mask whose keys are at or before their
  queries), where ALiBi goes by vectors."""
  return blocks.alibi_fold and keys_at_or_before(mask)


def vector_iota(size: int, layout):
  """int32 [size] 0, 1, ... in `layout` (`ROW` or `COL`)."""
  return plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)


def needs_positions(mask: Mask, scores: Scores) -> bool:
  """Whether every tile (not only boundary ones) needs its rows' and
  columns' positions: for a mask_mod, a score_mod, ALiBi or dropout."""
  return (mask.mod is not None or scores.mod is not None or scores.alibi
          or scores.dropout)


def dropped(x, scores: Scores, seed_ref, batch, head, rows, cols):
  """x * keep / (1 - rate) (`dropout.dropped`, the bits of every backend)
  for query head `head`, or x without dropout; seed_ref: int32 [4] in
  global memory."""
  if not scores.dropout:
    return x
  if scores.dropout_broadcast:
    batch = head = jnp.int32(0)
  return dropout.dropped(x, seed_ref, scores.dropout_rate,
                         batch, head, rows, cols)


def range_table(mask: Mask, tile_kinds, q_ids, kv_ids, block_rows: int,
                block_cols: int, q_len: int, kv_len: int, num_row_tiles: int,
                *, transposed: bool = False):
  """The tile-range table of a kernel's row tiles (query tiles, or key
  tiles with `transposed`), int32 [Bm, num_row_tiles, 4]: the tile kinds'
  (a mask_mod's or a dense mask's: `mask.kinds_block_table`) intersected
  with the ids' (`mask.id_block_table`), padded with empty rows past the
  lengths (the kernel's padding reads them); None without either."""
  tables = []
  if tile_kinds is not None:
    tables.append(kinds_block_table(tile_kinds, mask, block_rows, block_cols,
                                    q_len, kv_len, transposed=transposed))
  if mask.has_ids:
    rows, cols = (kv_ids, q_ids) if transposed else (q_ids, kv_ids)
    tables.append(id_block_table(rows, cols, block_rows, block_cols))
  if not tables:
    return None
  return intersect_tables(
      [jnp.pad(t, ((0, 0), (0, num_row_tiles - t.shape[1]), (0, 0)))
       for t in tables])


def pad_ids(q_ids, kv_ids, q_rows: int, kv_rows: int):
  """Query and key ids padded to a kernel's rows with ids that match
  nothing (`mask.Q_PAD_ID`, `KV_PAD_ID`); (None, None) without ids."""
  if q_ids is None:
    return None, None
  return (pad_to(q_ids, 1, q_rows, Q_PAD_ID),
          pad_to(kv_ids, 1, kv_rows, KV_PAD_ID))


# An e4m3 tile stored by `stmatrix` (or handed to wgmma from registers)
# holds its columns permuted within each window of E4M3_WINDOW: stored
# column 4 t + 2 h + b is column 8 h + 2 t + b (t < 4, h < 2, b < 2).
E4M3_WINDOW = 16


def _as_8bit_layout(x):
  """An e4m3 FragmentedArray in the wgmma accumulator's layout as one in
  Mosaic GPU's 8-bit wgmma layout, by its registers alone: a thread's two
  column pairs of adjacent 8-column tiles become one 32-bit word (the
  columns of each E4M3_WINDOW permuted, as `E4m3Tiles.permute` says)."""
  pairs = x.registers  # [row tiles, 8-column tiles, 1, 1, halves, ...]
  words = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape(x.shape), object)
  for idx in np.ndindex(words.shape):
    words[idx] = mgpu_utils.vector_concat(
        [pairs[(idx[0], 2 * idx[1] + h, *idx[2:])] for h in range(2)])
  return mgpu.FragmentedArray(_registers=words,
                              _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)


@dataclasses.dataclass(frozen=True)
class E4m3Tiles:
  """How the FP8 kernels' e4m3 tiles (P, P^T, dS, dS^T) leave the wgmma
  accumulator's layout for the matmul that reads them (`BlockSizes`'
  e4m3_stmatrix, e4m3_registers and e4m3_registers_bwd): stored to
  shared memory as they are (Mosaic GPU's own store writes 8-bit values
  by 16-bit stores), or with `stmatrix`: each thread's registers
  regrouped into Mosaic GPU's 8-bit wgmma layout (`_as_8bit_layout`),
  which it stores by `stmatrix`; with `registers` those regrouped
  registers are wgmma's left operand (`operand`), with no store. Both
  permute each window of E4M3_WINDOW columns, so the operand the tile
  meets, along the contracted axis, is permuted alike (`permute`)."""
  stmatrix: bool = False
  registers: bool = False

  def store(self, x, ref):
    """e4m3 x ([rows, cols], the accumulator's layout; rows a multiple of
    64, cols of E4M3_WINDOW) into ref, an e4m3 [rows, cols] tile
    (`layout.smem_transforms`)."""
    if not self.stmatrix:
      ref[...] = x
      return
    tiling, swizzle = smem_transforms(fp8_lib.E4M3, ref.shape[-1])

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,
                                  plgpu.RefType((tiling, swizzle))))
    def store(_, x, smem):
      _as_8bit_layout(x).store_tiled(smem, swizzle.swizzle)
    store(x, ref)

  def operand(self, x, ref):
    """e4m3 x as wgmma's left operand: x's registers in the 8-bit wgmma
    layout (`registers`), else x stored into ref (`store`), returned."""
    if self.registers:
      @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                         return_type=plgpu.ShapeDtypeStruct(
                             x.shape, x.dtype, plgpu.Layout.WGMMA_8BIT))
      def regroup(_, x):
        return _as_8bit_layout(x)
      return regroup(x)
    self.store(x, ref)
    plgpu.commit_smem()
    return ref

  def no_operand(self, shape):
    """What a loop carries as the left operand before a tile's (zeros of
    `shape` in the 8-bit wgmma layout with `registers`, else None: the
    operand is in shared memory)."""
    if not self.registers:
      return None
    return plgpu.layout_cast(jnp.zeros(shape, fp8_lib.E4M3),
                             plgpu.Layout.WGMMA_8BIT)

  def permute(self, x, axis: int = -1):
    """x with its `axis` (a multiple of E4M3_WINDOW long) permuted as
    `store` (or `operand`) permutes a tile's columns: the operand the tile
    meets in a matmul, along the contracted axis (x itself with neither
    `stmatrix` nor `registers`)."""
    if not (self.stmatrix or self.registers):
      return x
    axis %= x.ndim
    shape = x.shape
    view = x.reshape(*shape[:axis], shape[axis] // E4M3_WINDOW, 2, 4, 2,
                     *shape[axis + 1:])
    return jnp.swapaxes(view, axis + 1, axis + 2).reshape(shape)
