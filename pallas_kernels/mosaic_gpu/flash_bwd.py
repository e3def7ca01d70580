"""FlashAttention-2 backward (Dao 2023, Algorithm 2) for Hopper, in Pallas Mosaic GPU.

Two kernels. Each CTA runs two consumer warpgroups (one in the dQ kernel
above head dim 128) and a TMA producer warpgroup of its own, as the forward
does: the producer streams tiles through `num_stages_bwd` shared-memory
slots and refills a slot once each consumer has released it; the matmuls
are wgmma. Tiles are held in the head dim's column parts (`tiles.Columns`,
`backward_columns`), so Q, K, V and dO are read and the gradients written
where they lie at any length; a consumer whose rows all lie past the end
only releases its slots, and one streaming the sequence's last tile runs
it on the rows up to the end, in the matmuls' groups of rows
(`tiles.tail_rows`: 257 keys take 320 rows in 128-row tiles, not 384).

* dK/dV: a CTA owns 2 * block_kv_dkv key rows of one (batch, KV head); each
  consumer keeps its block_kv_dkv rows of K and V in shared memory and dK, dV
  in wgmma accumulators, and loops over (query tile, query head of the group):
  S^T = K Q^T, P^T = exp2(S^T - L), dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - D), dK += dS^T Q. The query heads of a group are summed
  in the loop, in a fixed order: no per-query-head buffer, no atomics.
* dQ: a CTA owns 2 * block_q_dq query rows of one (batch, head); each consumer
  keeps its Q and dO tiles in shared memory and loops over key tiles:
  S = Q K^T and dP = dO V^T (issued back to back), P, dS = P (dP - D),
  dQ += dS K.

Tiles come from the shared mask description (`mask.q_block_ranges` /
`kv_block_ranges`, the CTA's rows, and the range table of a mask_mod or of
ids; ids are compared on boundary tiles); tiles inside its full range skip
the predicate (hidden pairs get P = 0). Scores go through the shared
`Scores.factored_logits2` and their derivative through `Scores.dqk`
(soft-cap, ALiBi, a score_mod); dropout scales P^T in dV and dP with the
forward's keep bits (`dropout.dropped`). D = rowsum(dO * O) - dlse
(`softmax.backward_delta`, the caller's) and the
logsumexp in base 2 come from XLA (a row that sees no key gets L = +inf, so
its P is 0, never NaN). Every gradient is written once, by one CTA, in a
fixed order: bitwise deterministic.

With `scores.fp8` (`BlockSizes.fp8_backward`, head dims 64, 128, 256) every
matmul is an e4m3 wgmma on the call's e4m3 values and dO quantized as they
are (`fp8_backward_operands`): FP8 wgmma takes only K-major operands, so the
dK/dV kernel also streams Q^T and dO^T and the dQ kernel K^T (transposed by
XLA); P^T enters dV as P * 448, and dS (dS^T) through shared memory as e4m3
values of dS * 448 over its row's running maximum of |dS|, the dK or dQ
accumulator rescaled when that maximum grows (`_quantize_ds`).

With `BlockSizes.fused_dq` (head dims 64, 128; an option) the dK/dV kernel also
forms dQ += dS K for each query tile it visits and adds it by TMA
reduce-add into float32 zeros (`_accumulate_dq`), and the dQ kernel does
not run: 5 matmuls a tile pair instead of 7, but dQ's additions land in an
order that varies, so dQ is not bitwise deterministic.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core import fp8 as fp8_lib
from jax_flash.core import softmax
from jax_flash.core.mask import Mask, cdiv, kv_block_ranges, q_block_ranges
from jax_flash.core.operands import Operands
from jax_flash.core.padding import pad_pairs, pad_to, round_up
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu.config import (DKV_CTAS, FUSED_DQ_HEAD_DIMS,
                                              BlockSizes, compiler_params,
                                              fused_dq_columns)
from pallas_kernels.mosaic_gpu.layout import (COMPUTE_WGS, Columns,
                                              backward_columns, dq_warpgroups,
                                              smem_transforms, split_dkv,
                                              tail_rows, tma_rows)
from pallas_kernels.mosaic_gpu.tiles import (COL, ROW, E4m3Tiles,
                                             alibi_by_vectors,
                                             alibi_folded, alibi_row,
                                             await_last_releases,
                                             columns, cta_row_tile, dropped,
                                             load_ids, logits2,
                                             needs_positions, pad_ids,
                                             present, range_table,
                                             split_refs,
                                             table_ranges, tile_buffer,
                                             tile_views, vector_iota,
                                             visible, with_alibi)


def _meet(barrier):
  """Both consumer warpgroups reach this point before either goes on
  (`barrier`: an mbarrier of their two arrivals)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def _iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim,
                                layout=plgpu.Layout.WGMMA)


def _probabilities(s, lse, masked, *, mask: Mask, scores: Scores,
                   kv_len: int, positions, rows_cols, ids, pair, refs, batch,
                   head, c_scale=None, alibi_rel=None, fold=False):
  """(P, aux) of a raw score tile `s`: P = 2**(s2 - lse) with s2 its base-2
  logits (`Scores.factored_logits2`, with the bias tile `pair` of bias_ref:
  for plain scores one FMA a pair) and lse the base-2 logsumexp broadcast to
  the tile (+inf for rows that saw no key: P is 0 there); P is 0 at hidden
  pairs where `masked` (traced: a boundary tile): the mask description's
  predicate and the dense mask's tile. refs: (slopes_ref, bias_ref,
  dense_ref), each None when absent; rows_cols: the tile's positions or
  None (then `positions()` computes them for the predicate); c_scale, a
  factor of the logits (FP8: Q's and K's scales) or None; alibi_rel:
  `with_alibi`'s (q_rel, k_rel, q_dim) where the tile adds ALiBi as
  vectors (`scores` then without it), else None; fold: its query term
  left to lse (`_lse_tile`)."""
  slopes_ref, bias_ref, dense_ref = refs
  slope = None if slopes_ref is None else slopes_ref[batch, head]
  s, c, aux = logits2(
      scores, s, *(rows_cols or (None, None)), slope=slope,
      bias_ref=bias_ref, pair=pair, batch=batch, head=head)
  if c_scale is not None:
    c = c * c_scale
  if alibi_rel is not None:
    s = with_alibi(s, c, slope, *alibi_rel, mask, fold=fold)
  p = jnp.exp2(s * c - lse)

  def hidden():
    ok = visible(mask, *(rows_cols or positions()), kv_len,
                 dense_ref=dense_ref, pair=pair, batch=batch, head=head, **ids)
    return jnp.where(ok, p, 0.0)
  return lax.cond(masked, hidden, lambda: p), aux


def _lse_tile(lse, shape, q_dim: int, folded=None):
  """The logsumexp lse (a vector over the tile's queries, along tile dim
  q_dim) broadcast to a tile of `shape`. folded: None, or ALiBi's (slope,
  q_rel) where its query term is folded (`alibi_folded`): lse less that
  term first, one subtraction a query instead of an addition a pair."""
  if folded is not None:
    lse = lse - alibi_row(*folded)
  return lax.broadcast_in_dim(lse, shape, [q_dim])


def _part_views(layout: Columns, head_dim: int, *buffer_groups):
  """(views, columns): for each group of buffers (one a column part of
  `layout`), each part's (copy, wgmma) views (`tiles.tile_views`); and
  the parts' column indices of a ref with head_dim columns."""
  untiled = all(layout.untiled)
  views = [[tile_views(x, untiled) for x in group] for group in buffer_groups]
  return views, [columns(start, width, head_dim)
                 for start, width in layout.parts]


def _release(ring, *barriers):
  """Waits for each (ready, free) barrier pair's slot `ring` to be filled
  and releases it: a ring step of a consumer with no rows of its own."""
  for ready, free in barriers:
    plgpu.barrier_wait(ready.at[ring])
    plgpu.barrier_arrive(free.at[ring])


def _parts(views, slot, rows=None):
  """The wgmma views of each column part's tile in `slot` (its first
  `rows` rows, or all)."""
  return [mma.at[slot] if rows is None else mma.at[slot, pl.ds(0, rows)]
          for _, mma in views]


def _with_tail(step, on_last, block: int, tail: int, n, carry, **kwargs):
  """Ring step n of a consumer streaming `block`-row tiles: `step(n, carry,
  width=...)` on every row, or on the first `tail` rows (`tail_rows`) of
  the sequence's last tile, where `on_last(n)`."""
  if tail == block:
    return step(n, carry, width=block, **kwargs)
  last = on_last(n)
  pl.when(last)(lambda: step(n, carry, width=tail, **kwargs))
  pl.when(~last)(lambda: step(n, carry, width=block, **kwargs))
  return carry


def _store(tiles, index, dtype):
  """Writes gradient tiles, each (copy view, wgmma view, value, out_ref,
  columns): the values into the tiles' shared memory, then by TMA to
  out_ref[*index, columns]; waits for the stores."""
  for _, mma, grad, _, _ in tiles:
    mma[...] = grad.astype(dtype)
  plgpu.commit_smem()
  for copy, _, _, out_ref, cols in tiles:
    plgpu.copy_smem_to_gmem(copy, out_ref.at[(*index, cols)],
                            commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0)


def _zeros(shape, layout=plgpu.Layout.WGMMA):
  """float32 zeros in a register layout (an accumulator's, or ROW)."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)


# Rows of dS whose largest |dS| is below this are stored as zeros: 448 over
# a smaller maximum could overflow float32 (and 0 times it be NaN).
_DS_FLOOR = 2.0 ** -100


def _quantize_ds(ds, m, ds_smem, e4m3: E4m3Tiles, bound: bool = False):
  """FP8's dS tile (float32 [rows, cols], an accumulator's layout) as
  e4m3 values of dS * 448 / m_new, wgmma's left operand (`e4m3.operand`:
  stored into ds_smem, or in registers), m_new the running maximum of
  each row's |dS| (m: the rows' maximum before this tile, 0 at first);
  returns (the operand, m_new, alpha = m / m_new), by which the caller
  rescales the rows of the accumulator this tile's product adds to (the
  online softmax's trick: the accumulator then holds the sum at the
  scale m_new / 448). With `bound` (`BlockSizes.fp8_ds_bound`) m is a
  bound on every |dS| (`ds_bound`, from the first tile on): m_new is m
  and alpha None (no rescale)."""
  if bound:
    inverse = jnp.where(m > _DS_FLOOR, fp8_lib.E4M3_MAX / m, 0.0)
    ds8 = e4m3.operand((ds * lax.broadcast_in_dim(inverse, ds.shape, [0]))
                        .astype(fp8_lib.E4M3), ds_smem)
    return ds8, m, None
  m_new = jnp.maximum(m, jnp.abs(ds).max(axis=1))
  positive = m_new > _DS_FLOOR
  alpha = jnp.where(positive, m / m_new, 1.0)
  inverse = jnp.where(positive, fp8_lib.E4M3_MAX / m_new, 0.0)
  ds8 = e4m3.operand((ds * lax.broadcast_in_dim(inverse, ds.shape, [0]))
                      .astype(fp8_lib.E4M3), ds_smem)
  return ds8, m_new, alpha


def _fp8_product(acc, alpha, a, b_smem):
  """acc * alpha (per row; None: 1) + a @ b_smem, by wgmma on e4m3 tiles
  (a: a tile in shared memory or registers, `E4m3Tiles.operand`)."""
  def product(refs):
    plgpu.wgmma(refs[0], a, b_smem)
  if alpha is not None:
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  return pl.run_state(product)((plgpu.ACC.init(acc),))[0]


def _ds_scale_start(cta, rows: int):
  """The FP8 kernels' dS scale carry before the first tile: the rows'
  maxima of |dS| (zeros), or with `fp8_ds_bound` the (batch, KV head)'s
  bound on |dS| (`ds_bound`, the scales' last column) on every row."""
  zeros = _zeros((rows,), ROW)
  if not cta.blocks.fp8_ds_bound:
    return zeros
  return zeros + cta.extras.scales[cta.batch, cta.kv_head, 5]


def ds_bound(do, v, delta, num_kv_heads: int):
  """float32 [B, K]: a bound on |dS| = |P (dP - D)| over each (batch, KV
  head)'s query heads, rows and keys, from P <= 1, |dP_ij| <= ||dO_i||
  ||V_j|| and |D_i|: max_i ||dO_i|| max_j ||V_j|| + max_i |D_i|, 1.25 times
  over (dO and V reach the kernels rounded to e4m3, each element within
  1/16 of itself). do [B, T, N, H], v [B, S, K, H] (the values the kernels
  multiply, dequantized), delta [B, N, T] (D)."""
  b, t, n, _ = do.shape
  norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), -1))
  do_max = norm(do).reshape(b, t, num_kv_heads, n // num_kv_heads).max(
      axis=(1, 3))
  d_max = jnp.abs(delta.astype(jnp.float32)).reshape(
      b, num_kv_heads, -1).max(axis=-1)
  return 1.25 * (do_max * norm(v).max(axis=1) + d_max)


@dataclasses.dataclass(frozen=True)
class Extras:
  """The backward kernels' optional inputs, each None when absent (in the
  launcher arrays, in a kernel their refs): a kernel's range table (the
  dK/dV kernel's transposed, `range_table`), ALiBi slopes [B, N], query
  and key ids [B, T], [B, S] (padded past the kernels' tiles), the dropout
  seed [4], a dense mask and a bias (`pad_pairs`; the dK/dV kernel's
  transposed), with `fused_dq` the float32 dQ the dK/dV kernel adds into
  [B, T, N, H], and with FP8 Q^T and dO^T [B, N, H, T'] (the dK/dV
  kernel's), K^T [B, K, H, S'] (the dQ kernel's) and the scales [B, K, 5]
  (`fp8_backward_operands`)."""
  table: object = None
  slopes: object = None
  q_ids: object = None
  kv_ids: object = None
  seed: object = None
  dense: object = None
  bias: object = None
  dq_sum: object = None
  qt: object = None
  dot: object = None
  kt: object = None
  scales: object = None


@dataclasses.dataclass(frozen=True)
class _Dkv:
  """What every part of a dK/dV CTA reads: refs, shared memory, statics
  and the warpgroup's own values (`_dkv_cta`)."""
  refs: tuple  # (q, k, v, do, lse, delta, dk, dv)
  extras: Extras
  scratch: dict
  mask: Mask
  scores: Scores
  blocks: BlockSizes
  group: object  # Query heads this CTA takes: its share of the group.
  kv_len: int
  layout: Columns
  fp8: bool
  views: tuple  # (K's, V's, Q's, dO's) per column part.
  part_columns: list
  e4m3: E4m3Tiles
  split: bool
  batch: object
  kv_head: object  # K's and V's head,
  out_head: object  # and dK's and dV's (a share's partial: dkv_head_splits).
  wg: object
  kv_start: object
  ranges: tuple  # (lo, full_lo, full_hi, hi) of query tiles.
  last_tile: object
  tail: int
  steps: object
  slot: int  # This warpgroup's K/V copy.
  kv_own: tuple  # (K's, V's) views of its copy.
  rows: object  # Its key rows.
  first_head: object

  def q_tile(self, i):
    """The query tile of step i (the last one past the range)."""
    return jnp.minimum(self.ranges[0] + i, self.last_tile)

  def step_index(self, n):
    """(query tile step i, head of the group g, ring slot) of step n."""
    return (lax.div(n, self.group), lax.rem(n, self.group),
            lax.rem(n, self.blocks.num_stages_bwd))


def _group_share(heads, group: int, splits: int):
  """(KV head, the offset of this CTA's first query head in the group, its
  query heads) of a dK/dV CTA at grid index `heads`: the whole group of
  its KV head, or with `splits` a share of ceil(group / splits) heads (the
  last may be smaller)."""
  if splits == 1:
    return heads, 0, group
  share = pl.cdiv(group, splits)
  kv_head, part = lax.div(heads, splits), lax.rem(heads, splits)
  return kv_head, part * share, jnp.minimum(share, group - part * share)


def _dkv_cta(refs, extras: Extras, scratch, head_splits: int = 1,
             **statics) -> _Dkv:
  """The `_Dkv` of a dK/dV kernel's refs, `Extras` of refs and scratch
  (`head_splits`: CTAs a KV head, `_group_share`)."""
  q_ref = refs[0]
  layout, blocks, mask = statics["layout"], statics["blocks"], statics["mask"]
  k_buffers, v_buffers, q_buffers, do_buffers, _, _ = scratch["buffers"]
  views, part_columns = _part_views(layout, q_ref.shape[3], k_buffers,
                                    v_buffers, q_buffers, do_buffers)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  q_len = q_ref.shape[1]
  split = split_dkv(layout.width)
  batch, out_head = lax.axis_index("batch"), lax.axis_index("heads")
  kv_head, offset, group = _group_share(out_head, statics["group"],
                                        head_splits)
  wg = lax.axis_index("wg")
  cta_rows = bkv if split else COMPUTE_WGS * bkv
  tile_start = lax.axis_index("kv_seq") * cta_rows
  kv_start = tile_start if split else tile_start + wg * bkv
  ranges = table_ranges(
      mask, q_block_ranges(mask, tile_start, cta_rows, bq, q_len),
      extras.table, batch, lax.axis_index("kv_seq"))
  last_tile = cdiv(q_len, bq) - 1
  # The last Q/dO tile's rows computed on (`fused_dq` and FP8: whole tiles).
  tail = bq if "fused" in scratch or statics["fp8"] else tail_rows(
      q_len, bq, layout.contraction_rows(q_ref.dtype))
  # One step at least: keys no query sees get a fully masked tile (P = 0),
  # so their dK/dV are written as zeros by the same code. A step: (query
  # tile, head of the group).
  lo, _, _, hi = ranges
  steps = jnp.maximum(hi - lo, 1) * group
  slot = 0 if split else wg
  kv_own = tuple([(copy.at[slot], mma.at[slot]) for copy, mma in v]
                 for v in views[:2])
  rows = pl.ds(kv_start, bkv)
  first_head = kv_head * statics["group"]
  if head_splits > 1:
    first_head = first_head + offset
  return _Dkv(refs=refs, extras=extras, scratch=scratch, views=views,
              part_columns=part_columns,
              e4m3=E4m3Tiles(blocks.e4m3_stmatrix, blocks.e4m3_registers_bwd),
              split=split,
              batch=batch, kv_head=kv_head, out_head=out_head, wg=wg,
              kv_start=kv_start, ranges=ranges, last_tile=last_tile,
              tail=tail, steps=steps, slot=slot, kv_own=kv_own, rows=rows,
              first_head=first_head, **{**statics, "group": group})


def _dkv_producer(cta: _Dkv):
  """Streams the (query tile, query head) steps' Q and dO tiles, L and D
  rows through the ring: Q with L and D once the slot's Q is released
  (`q_free`, after dK's matmul), dO once its dO is (`do_free`, after
  dV's); with FP8 Q^T and dO^T beside them."""
  q_ref, _, _, do_ref, lse_ref, delta_ref, _, _ = cta.refs
  _, _, q_views, do_views = cta.views
  _, q_ready, do_ready = cta.scratch["ready"]
  q_free, do_free = cta.scratch["free"]
  lse_smem2, delta_smem2 = cta.scratch["buffers"][4:]
  bq, stages = cta.blocks.block_q_dkv, cta.blocks.num_stages_bwd
  if cta.fp8:
    (qt_smem, dot_smem), _ = cta.scratch["fp8"]["ring"]
  plgpu.set_max_registers(cta.blocks.producer_registers, action="decrease")

  @pl.loop(0, cta.steps)
  def _(n):
    i, g, ring = cta.step_index(n)
    tile = (cta.batch, pl.ds(cta.q_tile(i) * bq, bq), cta.first_head + g)

    @pl.when(n >= stages)
    def _():
      plgpu.barrier_wait(q_free.at[ring])
    for (copy, _), cols in zip(q_views, cta.part_columns):
      plgpu.copy_gmem_to_smem(q_ref.at[(*tile, cols)], copy.at[ring],
                              q_ready.at[ring])
    if cta.fp8:
      plgpu.copy_gmem_to_smem(cta.extras.qt.at[tile[0], tile[2], :, tile[1]],
                              qt_smem.at[ring], q_ready.at[ring])
    for ref, smem in ((lse_ref, lse_smem2), (delta_ref, delta_smem2)):
      plgpu.copy_gmem_to_smem(ref.at[cta.batch, cta.first_head + g, tile[1]],
                              smem.at[ring], q_ready.at[ring])

    @pl.when(n >= stages)
    def _():
      plgpu.barrier_wait(do_free.at[ring])
    for (copy, _), cols in zip(do_views, cta.part_columns):
      plgpu.copy_gmem_to_smem(do_ref.at[(*tile, cols)], copy.at[ring],
                              do_ready.at[ring])
    if cta.fp8:
      plgpu.copy_gmem_to_smem(cta.extras.dot.at[tile[0], tile[2], :,
                                                tile[1]],
                              dot_smem.at[ring], do_ready.at[ring])
  await_last_releases(cta.steps, stages, q_free, do_free)


def _load_kv(cta: _Dkv):
  """This warpgroup's K and V rows (its copy's) into shared memory."""
  _, k_ref, v_ref = cta.refs[:3]
  kv_ready = cta.scratch["ready"][0]
  for own, ref, ready in ((cta.kv_own[0], k_ref, kv_ready.at[0, cta.slot]),
                          (cta.kv_own[1], v_ref, kv_ready.at[1, cta.slot])):
    for (copy, _), cols in zip(own, cta.part_columns):
      plgpu.copy_gmem_to_smem(ref.at[cta.batch, cta.rows, cta.kv_head, cols],
                              copy, ready)


def _e4m3_buffers(cta: _Dkv):
  """This warpgroup's shared-memory P^T and dS^T tiles (None, None where
  they stay in registers: `E4m3Tiles.registers`)."""
  if cta.e4m3.registers:
    return None, None
  fp8_smem = cta.scratch["fp8"]
  return fp8_smem["p"].at[cta.wg], fp8_smem["ds"].at[cta.wg]


def _fp8_products(cta: _Dkv, carry, dv_acc, p, delta, ring, do_smem):
  """FP8's dV += P^T dO (into dv_acc, running while dS^T forms), dP^T = V
  dO^T, dS^T and dK += dS^T Q for one step, on carry (dK, the running row
  maxima of |dS^T|)."""
  dk, m = carry
  fp8_smem = cta.scratch["fp8"]
  (qt_smem, dot_smem), _ = fp8_smem["ring"]
  _, q_ready, do_ready = cta.scratch["ready"]
  q_free, do_free = cta.scratch["free"]
  scales_ref = cta.extras.scales
  pt_smem, ds_smem = _e4m3_buffers(cta)
  pt = cta.e4m3.operand((p * fp8_lib.E4M3_MAX).astype(fp8_lib.E4M3), pt_smem)
  plgpu.barrier_wait(do_ready.at[ring])

  def dp_dv(acc):
    plgpu.wgmma(acc, cta.kv_own[1][0][1], do_smem.T)
    plgpu.wgmma(dv_acc, pt, dot_smem.at[ring].T)
    return plgpu.wgmma_accumulator_load(acc, wait_n=1)  # dV runs.
  dp = pl.run_scoped(dp_dv, plgpu.ACC(p.shape, jnp.float32))
  ds = p * (dp * scales_ref[cta.batch, cta.kv_head, 1] - delta)
  ds8, m, alpha = _quantize_ds(ds, m, ds_smem, cta.e4m3,
                               cta.blocks.fp8_ds_bound)
  dk = _fp8_product(dk, alpha, ds8, qt_smem.at[ring].T)
  plgpu.barrier_arrive(do_free.at[ring])  # dV's matmul is done too.
  plgpu.barrier_arrive(q_free.at[ring])
  return dk, m


def _fp8_split(cta: _Dkv, carry, p, delta, ring, do_smem):
  """`_fp8_products` above head dim 128 (`split_dkv`), on carry (this
  warpgroup's accumulator, the row maxima of |dS^T|): warpgroup 0 adds
  P^T dO to dV's, warpgroup 1 forms dP^T and dS^T and adds dS^T Q to
  dK's."""
  fp8_smem, wg = cta.scratch["fp8"], cta.wg
  (qt_smem, dot_smem), _ = fp8_smem["ring"]
  _, q_ready, do_ready = cta.scratch["ready"]
  q_free, do_free = cta.scratch["free"]

  pt_smem, ds_smem = _e4m3_buffers(cta)

  def dv_part(carry):
    acc, m = carry
    pt = cta.e4m3.operand((p * fp8_lib.E4M3_MAX).astype(fp8_lib.E4M3),
                          pt_smem)
    plgpu.barrier_wait(do_ready.at[ring])
    return _fp8_product(acc, None, pt, dot_smem.at[ring].T), m

  def dk_part(carry):
    acc, m = carry
    plgpu.barrier_wait(do_ready.at[ring])

    def dp_t(dp_acc):
      plgpu.wgmma(dp_acc, cta.kv_own[1][0][1], do_smem.T)
      return dp_acc[...]
    dp = pl.run_scoped(dp_t, plgpu.ACC(p.shape, jnp.float32))
    ds8, m, alpha = _quantize_ds(
        p * (dp * cta.extras.scales[cta.batch, cta.kv_head, 1] - delta), m,
        ds_smem, cta.e4m3, cta.blocks.fp8_ds_bound)
    return _fp8_product(acc, alpha, ds8, qt_smem.at[ring].T), m
  carry = lax.cond(wg == 0, dv_part, dk_part, carry)
  plgpu.barrier_arrive(do_free.at[ring])
  plgpu.barrier_arrive(q_free.at[ring])
  return carry


def _dkv_probabilities(cta: _Dkv, i, s, lse, width, head, kv_ids):
  """(P^T, aux, the tile's positions or None) of step i's scores S^T
  ([its key rows, `width` query rows]): `_probabilities` on its query
  tile, masked on a boundary tile of the range."""
  mask, bq, extras = cta.mask, cta.blocks.block_q_dkv, cta.extras
  shape = (cta.blocks.block_kv_dkv, width)
  lo, full_lo, full_hi, _ = cta.ranges

  def positions():  # Transposed: queries across, keys down.
    return cta.q_tile(i) * bq + _iota(shape, 1), cta.kv_start + _iota(shape, 0)
  no_alibi = alibi_by_vectors(mask, cta.scores, cta.blocks, bq)
  rows_cols = (positions() if needs_positions(mask, no_alibi or cta.scores)
               else None)
  alibi_rel = None
  if no_alibi is not None:  # Queries across (COL), keys down (ROW).
    alibi_rel = (cta.q_tile(i) * bq - cta.kv_start + vector_iota(width, COL),
                 vector_iota(shape[0], ROW), 1)
  fold = alibi_rel is not None and alibi_folded(mask, cta.blocks)
  ids = {}
  if mask.has_ids:
    q_ids = load_ids(extras.q_ids, cta.batch, cta.q_tile(i) * bq, width, COL)
    ids = dict(q_ids=lax.broadcast_in_dim(q_ids, shape, [1]),
               kv_ids=lax.broadcast_in_dim(kv_ids, shape, [0]))
  tile = lo + i
  p, aux = _probabilities(
      s, _lse_tile(lse, shape, 1, (extras.slopes[cta.batch, head],
                                   alibi_rel[0]) if fold else None),
      (tile < full_lo) | (tile >= full_hi), mask=mask,
      scores=no_alibi or cta.scores, kv_len=cta.kv_len, positions=positions,
      rows_cols=rows_cols, ids=ids,
      # Keys down, queries across.
      pair=(cta.rows, pl.ds(cta.q_tile(i) * bq, width)),
      refs=(extras.slopes, extras.bias, extras.dense), batch=cta.batch,
      head=head, c_scale=(extras.scales[cta.batch, cta.kv_head, 0]
                          if cta.fp8 else None), alibi_rel=alibi_rel,
      fold=fold)
  return p, aux, rows_cols


def _dkv_step(cta: _Dkv, n, carry, accs, kv_ids, width):
  """Step n on the first `width` rows of its Q/dO tile (`tail_rows`): S^T
  = K Q^T, P^T, then dV += P^T dO, dP^T = V dO^T, dS^T and dK += dS^T Q
  (in FP8 `_fp8_products`; above head dim 128 the warpgroups split dV and
  dK: `_dkv_split_products`)."""
  i, g, ring = cta.step_index(n)
  shape = (cta.blocks.block_kv_dkv, width)
  head = cta.first_head + g
  _, _, q_views, do_views = cta.views
  lse_smem2, delta_smem2 = cta.scratch["buffers"][4:]
  q_smems, do_smems = (_parts(views, ring, width)
                       for views in (q_views, do_views))
  plgpu.barrier_wait(cta.scratch["ready"][1].at[ring])

  def scores_t(acc):
    for (_, k_smem), q_smem in zip(cta.kv_own[0], q_smems):
      plgpu.wgmma(acc, k_smem, q_smem.T)
    lse, delta = (plgpu.load(x.at[ring, pl.ds(0, width)], layout=COL)
                  for x in (lse_smem2, delta_smem2))
    return acc[...], lse, delta
  s, lse, delta = pl.run_scoped(scores_t, plgpu.ACC(shape, jnp.float32))
  p, aux, rows_cols = _dkv_probabilities(cta, i, s, lse, width, head,
                                         kv_ids)
  if cta.fp8:
    delta = lax.broadcast_in_dim(delta, shape, [1])
    if cta.split:
      return _fp8_split(cta, carry, p, delta, ring, do_smems[0])
    return _fp8_products(cta, carry, accs[0], p, delta, ring, do_smems[0])
  def drop(x):  # P^T or dP^T with dropout (the forward's bits).
    return dropped(x, cta.scores, cta.extras.seed, cta.batch, head,
                   *(rows_cols or (None, None)))
  plgpu.barrier_wait(cta.scratch["ready"][2].at[ring])
  products = _dkv_split_products if cta.split else _dkv_products
  products(cta, (n, i, head, ring), accs, p, aux, delta, drop, q_smems,
           do_smems)
  return carry


def _dp_parts(cta: _Dkv, acc, do_smems):
  """dP^T = V dO^T, issued."""
  for (_, v_smem), do_smem in zip(cta.kv_own[1], do_smems):
    plgpu.wgmma(acc, v_smem, do_smem.T)


def _dkv_split_products(cta: _Dkv, step, accs, p, aux, delta, drop,
                        q_smems, do_smems):
  """Above head dim 128: warpgroup 0 adds P^T dO to dV's accumulators,
  warpgroup 1 forms dP^T and dS^T and adds dS^T Q to dK's; then the
  step's dO and Q are released. step: (n, its query tile step, head, ring
  slot)."""
  ring = step[3]
  dtype, wg = cta.refs[0].dtype, cta.wg
  shape = p.shape

  @pl.when(wg == 0)
  def _():
    p16 = drop(p).astype(dtype)
    for acc, do_smem in zip(accs, do_smems):
      plgpu.wgmma(acc, p16, do_smem)
    plgpu.wgmma_wait(0)

  @pl.when(wg == 1)
  def _():
    pd = cta.scores.dqk(p, aux)  # Before dP: aux dies (fewer registers).

    def dp_only(acc):
      _dp_parts(cta, acc, do_smems)
      return acc[...]
    dp = drop(pl.run_scoped(dp_only, plgpu.ACC(shape, jnp.float32)))
    ds = (pd * (dp - lax.broadcast_in_dim(delta, shape, [1]))).astype(dtype)
    for acc, q_smem in zip(accs, q_smems):
      plgpu.wgmma(acc, ds, q_smem)
    plgpu.wgmma_wait(0)
  q_free, do_free = cta.scratch["free"]
  plgpu.barrier_arrive(do_free.at[ring])
  plgpu.barrier_arrive(q_free.at[ring])


def _dkv_products(cta: _Dkv, step, accs, p, aux, delta, drop, q_smems,
                  do_smems):
  """dV += P^T dO, dP^T = V dO^T, dS^T and dK += dS^T Q (with `fused_dq`,
  also dQ += dS K: `_accumulate_dq`), releasing dO after dV and Q after
  dK. step: (n, its query tile step, head, ring slot)."""
  n, i, head, ring = step
  dtype, num_parts = cta.refs[0].dtype, len(cta.layout.parts)
  shape = p.shape
  dk_accs, dv_accs = accs[:num_parts], accs[num_parts:]
  # With modified scores (aux), P's copy for dV and P times the scores'
  # derivative for dS are formed before dP, so that P and aux die.
  p16 = None if aux is None else drop(p).astype(dtype)
  pd = cta.scores.dqk(p, aux)

  def dp_t(acc):
    _dp_parts(cta, acc, do_smems)
    p_16 = drop(p).astype(dtype) if p16 is None else p16
    for dv_acc, do_smem in zip(dv_accs, do_smems):
      plgpu.wgmma(dv_acc, p_16, do_smem)
    # dV still runs, unless `dv_before_ds` waits for it (P's copy dies).
    return plgpu.wgmma_accumulator_load(
        acc, wait_n=0 if cta.blocks.dv_before_ds else num_parts)
  dp = drop(pl.run_scoped(dp_t, plgpu.ACC(shape, jnp.float32)))
  ds = (pd * (dp - lax.broadcast_in_dim(delta, shape, [1]))).astype(dtype)
  for dk_acc, q_smem in zip(dk_accs, q_smems):
    plgpu.wgmma(dk_acc, ds, q_smem)
  plgpu.wgmma_wait(num_parts)  # dV is done (dK may run): dO may go.
  q_free, do_free = cta.scratch["free"]
  plgpu.barrier_arrive(do_free.at[ring])
  fused = cta.scratch.get("fused")
  if fused is not None:
    bq = cta.blocks.block_q_dkv
    _accumulate_dq(ds, cta.views[0][0][1], cta.extras.dq_sum.at[
        cta.batch, pl.ds(cta.q_tile(i) * bq, bq), head], fused, cta.wg,
                   parity=lax.rem(n, 2))
  plgpu.wgmma_wait(0)
  plgpu.barrier_arrive(q_free.at[ring])


def _dkv_release(cta: _Dkv, n, carry):
  """A step of a warpgroup whose key rows all lie at or past kv_len."""
  _, q_ready, do_ready = cta.scratch["ready"]
  q_free, do_free = cta.scratch["free"]
  _release(cta.step_index(n)[2], (q_ready, q_free), (do_ready, do_free))
  return carry


def _dkv_fp8_store(cta: _Dkv, run):
  """FP8: the steps (`run`), then dK (rows scaled by m, dS^T's row maxima,
  and Q's scale) and dV (dO's scale) through the bfloat16 staging that
  takes the Q^T/dO^T ring's memory once both warpgroups are done."""
  bkv, width = cta.blocks.block_kv_dkv, cta.layout.width
  scales_ref = cta.extras.scales
  batch, kv_head, slot = cta.batch, cta.kv_head, cta.slot
  _, out_smem = cta.scratch["fp8"]["ring"]
  dk_ref, dv_ref = cta.refs[6:]
  zeros = (_zeros((bkv, width)), _ds_scale_start(cta, bkv))
  if cta.split:  # One accumulator a warpgroup, carried: dV's or dK's.
    acc, m = run(carry=zeros)
    dk = dv = acc
  else:
    def run_fp8(dv_acc):
      dk, m = run(dv_acc, carry=zeros)
      return dk, m, dv_acc[...]
    dk, m, dv = pl.run_scoped(run_fp8, plgpu.ACC((bkv, width), jnp.float32))
  _meet(cta.scratch.get("done"))  # Both are done with the shared memory.
  index = (batch, cta.rows, kv_head)

  def dk_tile():
    scale = lax.broadcast_in_dim(m * scales_ref[batch, kv_head, 3],
                                 dk.shape, [0])
    return (out_smem.at[0, slot], out_smem.at[0, slot], dk * scale, dk_ref,
            cta.part_columns[0])

  def dv_tile():
    return (out_smem.at[1, slot], out_smem.at[1, slot],
            dv * scales_ref[batch, kv_head, 2], dv_ref, cta.part_columns[0])
  if cta.split:
    pl.when(cta.wg == 0)(lambda: _store([dv_tile()], index, dv_ref.dtype))
    pl.when(cta.wg == 1)(lambda: _store([dk_tile()], index, dk_ref.dtype))
  else:
    _store([dk_tile(), dv_tile()], index, dk_ref.dtype)


def _dkv_consumer(cta: _Dkv):
  """A consumer warpgroup: its K and V rows, the steps, then dK and dV
  (dK times the softmax scale) through K's and V's shared memory."""
  bkv, bq = cta.blocks.block_kv_dkv, cta.blocks.block_q_dkv
  kv_ready, done = cta.scratch["ready"][0], cta.scratch.get("done")
  if cta.split:
    pl.when(cta.wg == 0)(lambda: _load_kv(cta))  # One copy; both wait on it.
  else:
    _load_kv(cta)
  kv_ids = load_ids(cta.extras.kv_ids, cta.batch, cta.kv_start, bkv, ROW)
  plgpu.barrier_wait(kv_ready.at[0, cta.slot])
  plgpu.barrier_wait(kv_ready.at[1, cta.slot])

  def run(*accs, carry=None):
    carry = lax.fori_loop(0, cta.steps, functools.partial(
        _with_tail, functools.partial(_dkv_step, cta),
        lambda n: cta.q_tile(cta.step_index(n)[0]) == cta.last_tile, bq,
        cta.tail, accs=accs, kv_ids=kv_ids), carry)
    return carry if cta.fp8 else [acc[...] for acc in accs]
  if cta.fp8:
    _dkv_fp8_store(cta, run)
    return
  accumulators = [plgpu.ACC((bkv, width), jnp.float32)
                  for _, width in cta.layout.parts]
  grads = pl.run_scoped(run, *accumulators * (1 if cta.split else 2))
  # Both read the other's K or V (above head dim 128, or `fused_dq`'s
  # dS K): neither overwrites them before both are done.
  if done is not None:
    _meet(done)
  index = (cta.batch, cta.rows, cta.out_head)
  dtype, scale = cta.refs[0].dtype, cta.scores.scale
  (k_own, v_own), (dk_ref, dv_ref) = cta.kv_own, cta.refs[6:]

  def tiles(views, values, out_ref):
    return [(*view, value, out_ref, cols) for view, value, cols in
            zip(views, values, cta.part_columns)]
  if cta.split:
    pl.when(cta.wg == 0)(lambda: _store(tiles(v_own, grads, dv_ref), index,
                                        dtype))
    pl.when(cta.wg == 1)(lambda: _store(
        tiles(k_own, [g * scale for g in grads], dk_ref), index, dtype))
  else:
    num_parts = len(cta.layout.parts)
    _store(tiles(k_own, [g * scale for g in grads[:num_parts]], dk_ref) +
           tiles(v_own, grads[num_parts:], dv_ref), index, dtype)


def _dkv_kernel(refs, extras: Extras, scratch, head_splits: int = 1,
                **statics):
  """The dK/dV kernel: refs (q, k, v, do, lse, delta, dk, dv): q/do [B, T,
  N, H], k/v and dk/dv [B, S, K, H], lse/delta [B, N, T'] (T' >= T: whole
  tiles); keys at or past kv_len (<= S: XLA's padding) are masked, tiles
  past T or S read zeros and store nothing there. `extras`: `Extras` of
  refs (with `blocks.fused_dq`, `dq_sum`, to which the kernel adds dS K:
  scratch's `fused` holds its buffers, `_accumulate_dq`). `layout`: the
  head dim's column parts, each with tiles of its own, and whether TMA
  copies them untiled (`layout.Columns`; the last part may reach past H).

  Warpgroup 2 streams the (query tile, query head) steps' Q and dO tiles,
  L and D rows through `num_stages_bwd` slots (`_dkv_producer`); the two
  consumers own `block_kv_dkv` key rows each (`_dkv_consumer`), a
  consumer with no key rows (257 keys: the last CTA's second) only
  releasing its slots.

  Head dims above 128 (`split_dkv`): dK and dV together would need H
  registers a thread, so the CTA owns block_kv_dkv key rows that both
  warpgroups share (one K/V copy in shared memory): warpgroup 0
  accumulates dV, warpgroup 1 dK, each recomputing S^T (5 matmuls a step
  instead of 4).

  With `fp8` (whole tiles): Q, K, V and dO are e4m3, `extras.qt` and
  `extras.dot` hold Q and dO transposed, [B, N, H, T'] (streamed beside Q
  and dO: dV and dK contract over queries, and FP8 wgmma takes only
  K-major operands), `extras.scales` [B, K, 5] (`fp8_backward_operands`);
  dK is carried as a value (its rows rescale), and so is dV where the
  warpgroups split them; scratch's `fp8` holds the Q^T/dO^T ring, whose
  memory stages dK and dV for the store once both warpgroups are done,
  and each warpgroup's e4m3 P^T and dS^T.
  """
  cta = _dkv_cta(refs, extras, scratch, head_splits, **statics)
  pl.when(cta.wg == COMPUTE_WGS)(lambda: _dkv_producer(cta))

  @pl.when(cta.wg < COMPUTE_WGS)
  def _():
    plgpu.set_max_registers(cta.blocks.consumer_registers(COMPUTE_WGS),
                            action="increase")
    if cta.split or scratch.get("done") is not None:
      # Both warpgroups share their rows' work (or, with fp8, the memory
      # dK's and dV's staging takes after it).
      _dkv_consumer(cta)
      return
    # A warpgroup with no key rows (257 keys: the last CTA's second) only
    # releases its slots, so the other's 64 rows run alone.
    idle = cta.kv_start >= cta.kv_len
    pl.when(idle)(lambda: lax.fori_loop(
        0, cta.steps, functools.partial(_dkv_release, cta), None))
    pl.when(~idle)(lambda: _dkv_consumer(cta))


def _accumulate_dq(ds, k_smem2, dq_tile_ref, fused, wg, *, parity):
  """dQ += dS K for one query tile, in the dK/dV kernel (`fused_dq`).

  ds: this warpgroup's dS^T [its key rows, query rows] (16-bit, registers);
  k_smem2: both warpgroups' K tiles; dq_tile_ref: float32 [query rows, H]
  in global memory. The warpgroup stores its dS^T in shared memory
  (`fused["ds"][parity]`, two sets so a step's store never meets a read of
  the step before) and forms `config.fused_dq_columns(H)` columns of dS K
  (A: a stored dS^T transposed; a float32 accumulator): at H = 128
  columns [wg H/2, (wg+1) H/2) over both warpgroups' keys, after both meet
  at `fused["ds_ready"]` (and at the kernel's `done` after their loops,
  before K's shared memory takes dK); at H = 64 all columns over its own keys. Then a TMA
  reduce-add through `fused["dq"][wg]` adds them to dq_tile_ref, after
  waiting until its previous add has read that buffer."""
  ds_smem = fused["ds"].at[parity]
  ds_smem.at[wg][...] = ds
  plgpu.commit_smem()
  head_dim = dq_tile_ref.shape[-1]
  width = fused_dq_columns(head_dim)
  if width < head_dim:  # Both warpgroups' keys, half the columns each.
    _meet(fused["ds_ready"])
    cols, sources = pl.ds(wg * width, width), range(COMPUTE_WGS)
  else:  # Its own keys, every column.
    cols, sources = pl.ds(0, width), (wg,)

  def dq_columns(acc):
    for w in sources:
      plgpu.wgmma(acc, ds_smem.at[w].T, k_smem2.at[w, :, cols])
    return acc[...]
  dq = pl.run_scoped(dq_columns, plgpu.ACC((ds.shape[1], width), jnp.float32))
  stage = fused["dq"].at[wg]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = dq
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage, dq_tile_ref.at[:, cols], reduction_op="add")


@dataclasses.dataclass(frozen=True)
class _Dq:
  """What every part of a dQ CTA reads (`_dq_cta`)."""
  refs: tuple  # (q, k, v, do, lse, delta, dq)
  extras: Extras
  scratch: dict
  mask: Mask
  scores: Scores
  blocks: BlockSizes
  group: int
  kv_len: int
  layout: Columns
  fp8: bool
  views: tuple  # (Q's, dO's, K's, V's) per column part.
  part_columns: list
  e4m3: E4m3Tiles
  wgs: int
  batch: object
  head: object
  kv_head: object
  wg: object
  q_start: object
  ranges: tuple  # (lo, full_lo, full_hi, hi) of key tiles.
  last_tile: object
  steps: object
  rows: object  # Its query rows.

  def kv_tile(self, j):
    """The key tile of step j (the last one past the range)."""
    return jnp.minimum(self.ranges[0] + j, self.last_tile)


def _dq_cta(refs, extras: Extras, scratch, **statics) -> _Dq:
  """The `_Dq` of a dQ kernel's refs, `Extras` of refs and scratch."""
  q_ref, lse_ref = refs[0], refs[4]
  layout, blocks, mask = statics["layout"], statics["blocks"], statics["mask"]
  views, part_columns = _part_views(layout, q_ref.shape[3],
                                    *scratch["buffers"])
  wgs = dq_warpgroups(layout.width)
  bq, bkv = blocks.block_q_dq, blocks.block_kv_dq
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  kv_head = lax.div(head, jnp.int32(statics["group"]))
  wg = lax.axis_index("wg")
  q_tile = cta_row_tile(mask, "q_seq", lse_ref.shape[2] // (wgs * bq))
  tile_start = q_tile * (wgs * bq)
  q_start = tile_start + wg * bq
  ranges = table_ranges(
      mask, kv_block_ranges(mask, tile_start, wgs * bq, bkv,
                            statics["kv_len"]),
      extras.table, batch, q_tile)
  last_tile = cdiv(statics["kv_len"], bkv) - 1
  lo, _, _, hi = ranges
  steps = jnp.maximum(hi - lo, 1)  # A row that sees nothing: dQ = 0.
  return _Dq(refs=refs, extras=extras, scratch=scratch, views=views,
             part_columns=part_columns,
             e4m3=E4m3Tiles(blocks.e4m3_stmatrix, blocks.e4m3_registers_bwd),
             wgs=wgs, batch=batch,
             head=head, kv_head=kv_head, wg=wg, q_start=q_start,
             ranges=ranges, last_tile=last_tile, steps=steps,
             rows=pl.ds(q_start, bq), **statics)


def _dq_producer(cta: _Dq):
  """Streams K and V tiles through the ring, each slot refilled once the
  consumers release it (K after dQ's matmul, V after dP's); with FP8 K^T
  beside K."""
  _, k_ref, v_ref = cta.refs[:3]
  _, _, k_views, v_views = cta.views
  _, k_ready, v_ready = cta.scratch["ready"]
  k_free, v_free = cta.scratch["free"]
  bkv, stages = cta.blocks.block_kv_dq, cta.blocks.num_stages_bwd
  plgpu.set_max_registers(cta.blocks.producer_registers, action="decrease")

  @pl.loop(0, cta.steps)
  def _(j):
    ring = lax.rem(j, stages)
    tile = (cta.batch, pl.ds(cta.kv_tile(j) * bkv, bkv), cta.kv_head)
    for views, ref, ready, free in ((k_views, k_ref, k_ready, k_free),
                                    (v_views, v_ref, v_ready, v_free)):
      @pl.when(j >= stages)
      def _():
        plgpu.barrier_wait(free.at[ring])
      for (copy, _), cols in zip(views, cta.part_columns):
        plgpu.copy_gmem_to_smem(ref.at[(*tile, cols)], copy.at[ring],
                                ready.at[ring])
      if cta.fp8 and ref is k_ref:
        plgpu.copy_gmem_to_smem(
            cta.extras.kt.at[cta.batch, cta.kv_head, :, tile[1]],
            cta.scratch["fp8"]["kt"].at[ring], ready.at[ring])
  await_last_releases(cta.steps, stages, k_free, v_free)


def _dq_step(cta: _Dq, j, carry, dq_accs, lse, delta, q_ids, width):
  """Step j on the first `width` rows of its K/V tile (`tail_rows`): S =
  Q K^T and dP = dO V^T, P, dS, then dQ += dS K (in FP8 with dS scaled per
  row: `_quantize_ds`)."""
  mask, extras, fp8 = cta.mask, cta.extras, cta.fp8
  bq, bkv = cta.blocks.block_q_dq, cta.blocks.block_kv_dq
  q_views, do_views, k_views, v_views = cta.views
  _, k_ready, v_ready = cta.scratch["ready"]
  k_free, v_free = cta.scratch["free"]
  num_parts = len(cta.layout.parts)
  ring = lax.rem(j, cta.blocks.num_stages_bwd)
  k_smems, v_smems = (_parts(views, ring, width)
                      for views in (k_views, v_views))
  q_smems, do_smems = _parts(q_views, cta.wg), _parts(do_views, cta.wg)
  shape = (bq, width)
  ids = {}
  if mask.has_ids:
    kv_ids = load_ids(extras.kv_ids, cta.batch, cta.kv_tile(j) * bkv, width,
                      COL)
    ids = dict(q_ids=lax.broadcast_in_dim(q_ids, shape, [0]),
               kv_ids=lax.broadcast_in_dim(kv_ids, shape, [1]))

  def positions():
    return cta.q_start + _iota(shape, 0), cta.kv_tile(j) * bkv + _iota(shape,
                                                                       1)
  no_alibi = alibi_by_vectors(mask, cta.scores, cta.blocks, bkv)
  rows_cols = (positions() if needs_positions(mask, no_alibi or cta.scores)
               else None)
  alibi_rel = None
  if no_alibi is not None:  # Queries down (ROW), keys across (COL).
    alibi_rel = (cta.q_start - cta.kv_tile(j) * bkv + vector_iota(bq, ROW),
                 vector_iota(width, COL), 0)
  fold = alibi_rel is not None and alibi_folded(mask, cta.blocks)

  def s_dp(s_acc, dp_acc):
    plgpu.barrier_wait(k_ready.at[ring])
    for q_smem, k_smem in zip(q_smems, k_smems):
      plgpu.wgmma(s_acc, q_smem, k_smem.T)
    plgpu.barrier_wait(v_ready.at[ring])
    for do_smem, v_smem in zip(do_smems, v_smems):
      plgpu.wgmma(dp_acc, do_smem, v_smem.T)
    s = plgpu.wgmma_accumulator_load(s_acc, wait_n=num_parts)  # dP runs.
    lo, full_lo, full_hi, _ = cta.ranges
    tile = lo + j
    p, aux = _probabilities(
        s, _lse_tile(lse, shape, 0, (extras.slopes[cta.batch, cta.head],
                                     alibi_rel[0]) if fold else None),
        (tile < full_lo) | (tile >= full_hi), mask=mask,
        scores=no_alibi or cta.scores, kv_len=cta.kv_len,
        positions=positions, rows_cols=rows_cols,
        ids=ids, pair=(cta.rows, pl.ds(cta.kv_tile(j) * bkv, width)),
        refs=(extras.slopes, extras.bias, extras.dense), batch=cta.batch,
        head=cta.head,
        c_scale=extras.scales[cta.batch, cta.kv_head, 0] if fp8 else None,
        alibi_rel=alibi_rel, fold=fold)
    # P times the scores' derivative, all dS needs of P and aux.
    return cta.scores.dqk(p, aux), dp_acc[...]
  pd, dp = pl.run_scoped(s_dp, plgpu.ACC(shape, jnp.float32),
                         plgpu.ACC(shape, jnp.float32))
  plgpu.barrier_arrive(v_free.at[ring])
  if fp8:  # carry: dQ and the running row maxima of |dS|.
    dq, m = carry
    fp8_smem = cta.scratch["fp8"]
    ds_smem = None if cta.e4m3.registers else fp8_smem["ds"].at[cta.wg]
    ds8, m, alpha = _quantize_ds(
        pd * (dp * extras.scales[cta.batch, cta.kv_head, 1]
              - lax.broadcast_in_dim(delta, shape, [0])), m, ds_smem,
        cta.e4m3, cta.blocks.fp8_ds_bound)
    dq = _fp8_product(dq, alpha, ds8, fp8_smem["kt"].at[ring].T)
    plgpu.barrier_arrive(k_free.at[ring])
    return dq, m
  dp = dropped(dp, cta.scores, extras.seed, cta.batch, cta.head,
               *(rows_cols or (None, None)))
  ds = (pd * (dp - lax.broadcast_in_dim(delta, shape, [0]))).astype(
      cta.refs[0].dtype)
  for dq_acc, k_smem in zip(dq_accs, k_smems):
    plgpu.wgmma(dq_acc, ds, k_smem)
  plgpu.wgmma_wait(0)
  plgpu.barrier_arrive(k_free.at[ring])
  return carry


def _dq_release(cta: _Dq, j, carry):
  """A step of a warpgroup whose query rows all lie at or past q_len."""
  _, k_ready, v_ready = cta.scratch["ready"]
  k_free, v_free = cta.scratch["free"]
  _release(lax.rem(j, cta.blocks.num_stages_bwd), (k_ready, k_free),
           (v_ready, v_free))
  return carry


def _dq_consumer(cta: _Dq):
  """A consumer warpgroup: its Q and dO rows, L and D, the steps, then dQ
  (times the softmax scale) through Q's shared memory."""
  q_ref, _, _, do_ref, lse_ref, delta_ref, dq_ref = cta.refs
  q_views, do_views, _, _ = cta.views
  q_ready = cta.scratch["ready"][0]
  batch, head, rows, wg = cta.batch, cta.head, cta.rows, cta.wg
  bq, bkv, kv_len = cta.blocks.block_q_dq, cta.blocks.block_kv_dq, cta.kv_len
  for views, ref, ready in ((q_views, q_ref, q_ready.at[0, wg]),
                            (do_views, do_ref, q_ready.at[1, wg])):
    for (copy, _), cols in zip(views, cta.part_columns):
      plgpu.copy_gmem_to_smem(ref.at[batch, rows, head, cols], copy.at[wg],
                              ready)
  lse = plgpu.load(lse_ref.at[batch, head, rows], layout=ROW,
                   optimized=False)
  delta = plgpu.load(delta_ref.at[batch, head, rows], layout=ROW,
                     optimized=False)
  q_ids = load_ids(cta.extras.q_ids, batch, cta.q_start, bq, ROW)
  plgpu.barrier_wait(q_ready.at[0, wg])
  plgpu.barrier_wait(q_ready.at[1, wg])
  dtype = q_ref.dtype

  def run(*dq_accs, carry=None):
    carry = lax.fori_loop(0, cta.steps, functools.partial(
        _with_tail, functools.partial(_dq_step, cta),
        lambda j: cta.kv_tile(j) == cta.last_tile, bkv,
        bkv if cta.fp8 else tail_rows(kv_len, bkv,
                                      cta.layout.contraction_rows(dtype)),
        dq_accs=dq_accs, lse=lse, delta=delta, q_ids=q_ids), carry)
    return carry if cta.fp8 else [acc[...] for acc in dq_accs]
  if cta.fp8:  # dS's row scales (m / 448), K's and the softmax scale.
    dq, m = run(carry=(_zeros((bq, cta.layout.width)),
                       _ds_scale_start(cta, bq)))
    out = cta.scratch["fp8"]["out"].at[wg]
    _store([(out, out, dq * lax.broadcast_in_dim(
        m * cta.extras.scales[batch, cta.kv_head, 4], dq.shape, [0]),
             dq_ref, cta.part_columns[0])], (batch, rows, head),
           dq_ref.dtype)
    return
  dq = pl.run_scoped(run, *[plgpu.ACC((bq, width), jnp.float32)
                            for _, width in cta.layout.parts])
  _store([(copy.at[wg], mma.at[wg], part * cta.scores.scale, dq_ref, cols)
          for (copy, mma), part, cols in zip(q_views, dq, cta.part_columns)],
         (batch, rows, head), dtype)


def _dq_kernel(refs, extras: Extras, scratch, **statics):
  """The dQ kernel: refs (q, k, v, do, lse, delta, dq): q/do/dq [B, T, N,
  H], k/v [B, S, K, H], lse/delta [B, N, T'] (T' >= T: whole tiles); keys
  at or past kv_len (<= S: XLA's padding) are masked, tiles past T or S
  read zeros and store nothing there. `extras`: `Extras` of refs.
  `layout`: the head dim's column parts (`layout.Columns`, as
  `_dkv_kernel`'s). The last warpgroup streams K and V tiles
  (`_dq_producer`); each consumer owns `block_q_dq` query rows
  (`_dq_consumer`), a consumer with no query rows (257 queries: the last
  CTA's second) only releasing its slots.

  With `fp8` (as `_dkv_kernel`'s): `extras.kt` holds K transposed, [B, K,
  H, S'] (for dQ += dS K), streamed beside K; dQ is carried as a value
  and staged in scratch's `fp8` buffers, with each warpgroup's e4m3 dS."""
  cta = _dq_cta(refs, extras, scratch, **statics)
  pl.when(cta.wg == cta.wgs)(lambda: _dq_producer(cta))

  @pl.when(cta.wg < cta.wgs)
  def _():
    plgpu.set_max_registers(cta.blocks.consumer_registers(cta.wgs),
                            action="increase")
    idle = cta.q_start >= cta.refs[0].shape[1]
    pl.when(idle)(lambda: lax.fori_loop(
        0, cta.steps, functools.partial(_dq_release, cta), None))
    pl.when(~idle)(lambda: _dq_consumer(cta))


def fp8_backward_operands(operands: Operands, do, softmax_scale: float,
                          q_rows: int, kv_rows: int,
                          rounding: fp8_lib.Rounding, e4m3: E4m3Tiles,
                          delta=None):
  """(q8, k8, v8, do8, (qt8, dot8, kt8), scales) for the FP8 backward: the
  call's e4m3 values (`Operands.fp8_q`, ...) and dO quantized as the
  inputs are (`jax_flash.core.fp8`, by `rounding`), zero rows up to
  q_rows queries and kv_rows keys; Q, dO and K transposed to [B, heads,
  H, rows], their rows permuted as the e4m3 tiles they meet are stored
  (`e4m3`: P^T, dS^T and dS); scales [B, K, 5] float32: Q's times K's (the logits), V's
  times dO's (dP), dO's / 448 (dV from P * 448), Q's and K's times
  softmax_scale / 448 (dK and dQ from dS * 448 over its row maxima), and
  given D (`delta`, [B, N, T]: `BlockSizes.fp8_ds_bound`) a sixth, the
  bound on |dS| (`ds_bound`)."""
  num_kv_heads = operands.fp8_k.shape[2]
  sq, sk, sv = (operands.fp8_scales[..., i] for i in range(3))
  sdo = fp8_lib.scales(do, num_kv_heads, rounding)
  do8 = rounding.quantize(do, sdo, num_kv_heads)
  q8, do8 = (pad_to(x, 1, q_rows) for x in (operands.fp8_q, do8))
  k8, v8 = (pad_to(x, 1, kv_rows) for x in (operands.fp8_k, operands.fp8_v))
  transposed = tuple(e4m3.permute(x.transpose(0, 2, 3, 1))
                     for x in (q8, do8, k8))
  scale = softmax_scale / fp8_lib.E4M3_MAX
  columns = [sq * sk, sv * sdo, sdo / fp8_lib.E4M3_MAX, sq * scale,
             sk * scale]
  if delta is not None:
    columns.append(ds_bound(
        fp8_lib.dequantize(do8, sdo, num_kv_heads),
        fp8_lib.dequantize(v8, sv, num_kv_heads), delta, num_kv_heads))
  scales = jnp.stack(columns, axis=-1).astype(jnp.float32)
  return q8, k8, v8, do8, transposed, scales


@dataclasses.dataclass(frozen=True)
class _Launch:
  """What both backward kernels' launches share (`flash_backward`)."""
  mask: Mask
  scores: Scores
  blocks: BlockSizes
  layout: Columns
  operands: Operands
  q_len: int
  kv_len: int
  tp: int  # Queries and keys the kernels' tiles cover.
  sp: int
  kv_cols: int  # Both kernels' key tiles cover.
  kv_rows: int  # A dK/dV CTA's key rows.
  wgs: int  # The dQ kernel's consumer warpgroups.
  split: bool
  dtype: object
  out_dtype: object
  fp8: bool
  ids: tuple  # (q_ids, kv_ids) padded to both kernels' tiles.
  num_heads: int
  num_kv_heads: int
  batch: int

  @property
  def widths(self):
    return [w for _, w in self.layout.parts]

  @property
  def kernel_args(self) -> dict:
    return dict(mask=self.mask, scores=self.scores, blocks=self.blocks,
                group=self.num_heads // self.num_kv_heads,
                kv_len=self.kv_len, layout=self.layout, fp8=self.fp8)

  def buffers(self, lead, rows):
    """One tile buffer a column part, [*lead, rows, width]."""
    untiled = all(self.layout.untiled)
    return tuple(tile_buffer((*lead, rows, w), self.dtype,
                             smem_transforms(self.dtype, w), untiled)
                 for w in self.widths)

  def table(self, transposed: bool):
    """The range table of one kernel's CTA rows, or None."""
    blocks, ops = self.blocks, self.operands
    kinds_and_ids = (ops.tile_kinds, ops.q_ids, ops.kv_ids)
    if transposed:
      return range_table(self.mask, *kinds_and_ids, self.kv_rows,
                         blocks.block_q_dkv, self.q_len, self.kv_len,
                         self.sp // self.kv_rows, transposed=True)
    rows = self.wgs * blocks.block_q_dq
    return range_table(self.mask, *kinds_and_ids, rows, blocks.block_kv_dq,
                       self.q_len, self.kv_len, self.tp // rows)

  def body(self, kernel, extras: Extras):
    """A kernel's body: its refs (6 inputs, extras, outputs) split."""
    def run(*refs, **scratch):
      inputs, extra_refs, outputs = split_refs(refs, 6, extras)
      kernel(inputs + outputs, extra_refs, scratch, **self.kernel_args)
    return run

  def fp8_tiles(self, shape, minor):
    """An e4m3 tile buffer for wgmma, its minor dim `minor` wide."""
    e4m3 = fp8_lib.E4M3
    return plgpu.SMEM(shape, e4m3, transforms=smem_transforms(e4m3, minor))

  def staging(self, shape):
    """FP8's bfloat16 buffer that gradient tiles are stored through."""
    return plgpu.SMEM(shape, self.out_dtype, transforms=smem_transforms(
        self.out_dtype, self.layout.width))


def _dq_call(launch: _Launch, inputs, kt8, fp8_scales):
  """The dQ kernel's launch: grid (heads, query tiles, batch)."""
  blocks, ops, fp8 = launch.blocks, launch.operands, launch.fp8
  tp, kv_cols, wgs = launch.tp, launch.kv_cols, launch.wgs
  parts, stages = len(launch.widths), blocks.num_stages_bwd
  dq_rows, kv_tile = blocks.block_q_dq, blocks.block_kv_dq
  extras = Extras(
      table=launch.table(False), slopes=ops.alibi_slopes,
      q_ids=launch.ids[0], kv_ids=launch.ids[1], seed=ops.dropout_seed,
      dense=pad_pairs(ops.dense_mask, tp, kv_cols),
      bias=pad_pairs(ops.bias, tp, kv_cols), kt=kt8, scales=fp8_scales)
  scratch = dict(
      buffers=(launch.buffers((wgs,), dq_rows),
               launch.buffers((wgs,), dq_rows),
               launch.buffers((stages,), kv_tile),
               launch.buffers((stages,), kv_tile)),
      # One arrival a column part's copy (and K's slot: K^T's with fp8).
      ready=(plgpu.Barrier(num_arrivals=parts, num_barriers=(2, wgs)),
             plgpu.Barrier(num_arrivals=parts + fp8, num_barriers=stages),
             plgpu.Barrier(num_arrivals=parts, num_barriers=stages)),
      free=(plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2)
  if fp8:
    width = launch.layout.width
    scratch["fp8"] = dict(
        kt=launch.fp8_tiles((stages, width, kv_tile), kv_tile),
        out=launch.staging((wgs, dq_rows, width)))
    if not blocks.e4m3_registers_bwd:  # Each warpgroup's dS.
      scratch["fp8"]["ds"] = launch.fp8_tiles((wgs, dq_rows, kv_tile),
                                              kv_tile)
  q = inputs[0]
  return plgpu.kernel(
      launch.body(_dq_kernel, extras),
      out_type=jax.ShapeDtypeStruct(q.shape, launch.out_dtype),
      scratch_types=scratch,
      grid=(launch.num_heads, tp // (wgs * dq_rows), launch.batch),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=compiler_params(),
      kernel_name="flash_attention_dq_mosaic",
  )(*inputs, *present(extras))


def head_splits(blocks: BlockSizes, group: int, ctas: int, fp8: bool) -> int:
  """The dK/dV kernel's CTAs a KV head (`ctas`: the grid's without a
  split): `blocks.dkv_head_splits`, or where None the fewest that give
  `DKV_CTAS`, as many as give every share of the group a head (1 with FP8
  or `fused_dq`)."""
  if fp8 or blocks.fused_dq:
    return 1
  splits = blocks.dkv_head_splits
  if splits is None:
    splits = pl.cdiv(DKV_CTAS, ctas)
  return pl.cdiv(group, pl.cdiv(group, min(splits, group)))


def _dkv_call(launch: _Launch, inputs, qt8, dot8, fp8_scales):
  """The dK/dV kernel's launch: grid (KV heads x `head_splits`, key tiles,
  batch), the shares' partial dK and dV summed here in float32; with
  `fused_dq` also dQ (float32, unscaled). Returns (dk, dv, dq or None)."""
  blocks, ops, fp8 = launch.blocks, launch.operands, launch.fp8
  tp, kv_cols, width = launch.tp, launch.kv_cols, launch.layout.width
  parts, stages = len(launch.widths), blocks.num_stages_bwd
  dkv_rows, copies = blocks.block_kv_dkv, 1 if launch.split else COMPUTE_WGS
  bq_dkv, dtype = blocks.block_q_dkv, launch.dtype
  k = inputs[1]
  b, s, kv_heads, h = k.shape
  splits = head_splits(blocks, launch.num_heads // kv_heads,
                       kv_heads * (launch.sp // launch.kv_rows) * b, fp8)
  kv_out = jax.ShapeDtypeStruct((b, s, kv_heads * splits, h),
                                launch.out_dtype)
  # With `fused_dq` the dK/dV kernel adds dS K into float32 zeros in place
  # (a mutable array: the kernel's operand aliases it).
  assert not blocks.fused_dq or width in FUSED_DQ_HEAD_DIMS, launch.widths
  dq_sum = (jax.new_ref(jnp.zeros((launch.batch, tp, launch.num_heads,
                                   width), jnp.float32))
            if blocks.fused_dq else None)
  extras = Extras(
      table=launch.table(True), slopes=ops.alibi_slopes,
      q_ids=launch.ids[0], kv_ids=launch.ids[1], seed=ops.dropout_seed,
      dense=pad_pairs(ops.dense_mask, tp, kv_cols, transposed=True),
      bias=pad_pairs(ops.bias, tp, kv_cols, transposed=True),
      dq_sum=dq_sum, qt=qt8, dot=dot8, scales=fp8_scales)
  scratch = dict(
      buffers=(launch.buffers((copies,), dkv_rows),
               launch.buffers((copies,), dkv_rows),
               launch.buffers((stages,), bq_dkv),
               launch.buffers((stages,), bq_dkv),
               plgpu.SMEM((stages, bq_dkv), jnp.float32),
               plgpu.SMEM((stages, bq_dkv), jnp.float32)),
      # One arrival a column part's copy (and Q's slot: L's and D's; with
      # fp8 each slot's transposed tile too).
      ready=(plgpu.Barrier(num_arrivals=parts, num_barriers=(2, copies)),
             plgpu.Barrier(num_arrivals=parts + 2 + fp8,
                           num_barriers=stages),
             plgpu.Barrier(num_arrivals=parts + fp8, num_barriers=stages)),
      free=(plgpu.Barrier(num_arrivals=COMPUTE_WGS,
                          num_barriers=stages),) * 2)
  # Both warpgroups read K/V of the other's rows (head dims above 128, or
  # `fused_dq`'s exchange of dS): they meet at `done` before writing dK/dV
  # through K/V's shared memory.
  exchange = blocks.fused_dq and fused_dq_columns(width) < width
  if launch.split or exchange or fp8:
    scratch["done"] = plgpu.Barrier(num_arrivals=COMPUTE_WGS)
  if fp8:  # The Q^T and dO^T ring, whose memory dK's and dV's staging takes
    # after the loop; each warpgroup's P^T and dS^T (unless in registers).
    scratch["fp8"] = dict(
        ring=plgpu.RefUnion(
            (launch.fp8_tiles((stages, width, bq_dkv), bq_dkv),
             launch.fp8_tiles((stages, width, bq_dkv), bq_dkv)),
            launch.staging((2, copies, dkv_rows, width))))
    if not blocks.e4m3_registers_bwd:
      scratch["fp8"].update(
          p=launch.fp8_tiles((COMPUTE_WGS, dkv_rows, bq_dkv), bq_dkv),
          ds=launch.fp8_tiles((COMPUTE_WGS, dkv_rows, bq_dkv), bq_dkv))
  if blocks.fused_dq:
    dq_width = fused_dq_columns(width)
    scratch["fused"] = dict(
        ds=plgpu.SMEM((2, COMPUTE_WGS, dkv_rows, bq_dkv), dtype,
                      transforms=smem_transforms(dtype, bq_dkv)),
        dq=plgpu.SMEM((COMPUTE_WGS, bq_dkv, dq_width), jnp.float32,
                      transforms=smem_transforms(jnp.float32, dq_width)),
        **({"ds_ready": plgpu.Barrier(num_arrivals=COMPUTE_WGS)}
           if exchange else {}))
  kernel = (_dkv_kernel if splits == 1 else
            functools.partial(_dkv_kernel, head_splits=splits))
  dk, dv = plgpu.kernel(
      launch.body(kernel, extras),
      out_type=(kv_out, kv_out),
      scratch_types=scratch,
      grid=(kv_heads * splits, launch.sp // launch.kv_rows, launch.batch),
      grid_names=("heads", "kv_seq", "batch"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=compiler_params(),
      kernel_name="flash_attention_dkv_mosaic",
  )(*inputs, *present(extras))
  if splits > 1:  # The shares' partials, summed in a fixed order.
    dk, dv = (x.reshape(b, s, kv_heads, splits, h).astype(jnp.float32)
              .sum(3).astype(x.dtype) for x in (dk, dv))
  return dk, dv, dq_sum


def flash_backward(q, k, v, operands: Operands, delta, lse, do, *,
                   mask: Mask, scores: Scores, block_sizes: BlockSizes,
                   fp8_rounding: fp8_lib.Rounding = fp8_lib.XLA):
  """(dq, dk, dv) from the forward's lse (natural log, [B, N, T]), dO and
  D = rowsum(dO * O) - dlse (`delta`, float32 [B, N, T]).

  `operands` (`jax_flash.core.operands`): those the call has, as the
  forward reads them (the dropout's keep bits scale P in dV and dP; a
  bias's gradient is not computed here; sinks and query offsets are not
  read: the sinks' share is in L).

  q/do [B, T, N, H], k/v [B, S, K, H] (K divides N), bf16 or fp16, H
  where `backward_columns` takes it (the backend pads others to a multiple
  of 16), any T and S: the kernels read Q, dO, K and V and write the
  gradients where they lie, in tiles that may reach past the last row and
  column (TMA reads zeros there, and L = +inf for those queries, so they
  add nothing; stores past the ends are dropped), and mask keys past S.
  With `scores.fp8` (head dims 64, 128 and 256, no fused_dq): the call's e4m3
  values (`operands`) and dO quantized as they are
  (`fp8_backward_operands`, by `fp8_rounding`) in every matmul, whole
  tiles (XLA pads the e4m3 arrays to them), gradients in bfloat16.
  GPU only (the interpreter cannot run a wgmma with a register operand);
  tests lower it for CUDA on the CPU.
  """
  q_len, kv_len = q.shape[1], k.shape[1]
  blocks = block_sizes
  fp8 = bool(scores.fp8)
  layout = (Columns(((0, q.shape[3]),), (False, False)) if fp8 else
            backward_columns(q.dtype, q.shape[3], q_len, kv_len, blocks))
  split, wgs = split_dkv(layout.width), dq_warpgroups(layout.width)
  kv_rows = blocks.block_kv_dkv * (1 if split else COMPUTE_WGS)
  q_rows = math.lcm(wgs * blocks.block_q_dq, blocks.block_q_dkv)
  # The kernels' tiles cover tp queries and sp keys (L, D, ids and per-pair
  # operands are padded to them).
  tp, sp = round_up(q_len, q_rows), round_up(kv_len, kv_rows)
  # L in base 2, +inf for rows that see no key (lse = -inf) and for
  # padding, so P = exp2(S - L) is 0 there, never NaN.
  delta = pad_to(delta, 2, tp)
  lse2 = pad_to(jnp.where(lse == -jnp.inf, jnp.inf, lse * softmax.LOG2E), 2,
                tp, jnp.inf)
  untiled = all(layout.untiled)
  kv_cols = round_up(sp, blocks.block_kv_dq)  # Both kernels' key tiles.
  qt8 = dot8 = kt8 = fp8_scales = None
  if fp8:
    q, k, v, do, (qt8, dot8, kt8), fp8_scales = fp8_backward_operands(
        operands, do, scores.scale, tp, kv_cols, fp8_rounding,
        E4m3Tiles(blocks.e4m3_stmatrix, blocks.e4m3_registers_bwd),
        delta if blocks.fp8_ds_bound else None)
  else:
    q, do = (pad_to(x.astype(q.dtype), 1, tma_rows(q_len, untiled))
             for x in (q, do))
    k, v = (pad_to(x, 1, tma_rows(kv_len, untiled)) for x in (k, v))
  launch = _Launch(
      mask=mask, scores=scores, blocks=blocks, layout=layout,
      operands=operands, q_len=q_len, kv_len=kv_len, tp=tp, sp=sp,
      kv_cols=kv_cols, kv_rows=kv_rows, wgs=wgs, split=split,
      dtype=q.dtype, out_dtype=jnp.dtype(jnp.bfloat16) if fp8 else q.dtype,
      fp8=fp8,
      # Ids and per-pair operands padded once to both kernels' rows (the
      # dK/dV kernel reads the per-pair ones transposed).
      ids=pad_ids(operands.q_ids, operands.kv_ids, tp, kv_cols),
      num_heads=q.shape[2], num_kv_heads=k.shape[2], batch=q.shape[0])
  inputs = (q, k, v, do, lse2, delta)
  if not blocks.fused_dq:
    dq = _dq_call(launch, inputs, kt8, fp8_scales)
  dk, dv, dq_sum = _dkv_call(launch, inputs, qt8, dot8, fp8_scales)
  if blocks.fused_dq:
    dq = (dq_sum[...] * scores.scale).astype(q.dtype)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
