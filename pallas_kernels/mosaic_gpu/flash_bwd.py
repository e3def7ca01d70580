"""FlashAttention-2 backward (Dao 2023, Algorithm 2) for Hopper, in Pallas Mosaic GPU.

Two kernels. Each CTA runs two consumer warpgroups and one TMA producer
warpgroup (`plgpu.emit_pipeline_warp_specialized`: the producer streams tiles
through `num_stages_bwd` shared-memory slots, each consumer releases a slot with
its own arrival); both matmuls of a step are wgmma.

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
(`softmax.backward_delta`) and the
logsumexp in base 2 come from XLA (a row that sees no key gets L = +inf, so
its P is 0, never NaN). Every gradient is written once, by one CTA, in a
fixed order: bitwise deterministic.

With `BlockSizes.fused_dq` (head dims 64, 128; an option) the dK/dV kernel also
forms dQ += dS K for each query tile it visits and adds it by TMA
reduce-add into float32 zeros (`_accumulate_dq`), and the dQ kernel does
not run: 5 matmuls a tile pair instead of 7, but dQ's additions land in an
order that varies, so dQ is not bitwise deterministic.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.spec import softmax
from jax_flash.spec.mask import Mask, cdiv, kv_block_ranges, q_block_ranges
from jax_flash.spec.operands import Operands
from jax_flash.spec.padding import pad_pairs, pad_to, round_up
from jax_flash.spec.scores import Scores
from pallas_kernels.mosaic_gpu.config import (FUSED_DQ_HEAD_DIMS, BlockSizes,
                                              compiler_params, fused_dq_columns)
from pallas_kernels.mosaic_gpu.tiles import (COL, COMPUTE_WGS, ROW,
                                             cta_row_tile, dropped, load_ids,
                                             logits2, needs_positions,
                                             one_atom_wide, pad_ids,
                                             range_table, smem_transforms,
                                             split_refs, table_ranges,
                                             tile_buffer, tile_views, tma_rows,
                                             visible)


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
                   head):
  """(P, aux) of a raw score tile `s`: P = 2**(s2 - lse) with s2 its base-2
  logits (`Scores.factored_logits2`, with the bias tile `pair` of bias_ref:
  for plain scores one FMA a pair) and lse the base-2 logsumexp broadcast to
  the tile (+inf for rows that saw no key: P is 0 there); P is 0 at hidden
  pairs where `masked` (traced: a boundary tile): the mask description's
  predicate and the dense mask's tile. refs: (slopes_ref, bias_ref,
  dense_ref), each None when absent; rows_cols: the tile's positions or
  None (then `positions()` computes them for the predicate)."""
  slopes_ref, bias_ref, dense_ref = refs
  s, c, aux = logits2(
      scores, s, *(rows_cols or (None, None)),
      slope=None if slopes_ref is None else slopes_ref[batch, head],
      bias_ref=bias_ref, pair=pair, batch=batch, head=head)
  p = jnp.exp2(s * c - lse)

  def hidden():
    ok = visible(mask, *(rows_cols or positions()), kv_len,
                 dense_ref=dense_ref, pair=pair, batch=batch, head=head, **ids)
    return jnp.where(ok, p, 0.0)
  return lax.cond(masked, hidden, lambda: p), aux


def split_dkv(head_dim: int) -> bool:
  """Whether the dK/dV kernel splits dK and dV between its warpgroups."""
  return head_dim > 128


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref,
                slopes_ref, q_ids_ref, kv_ids_ref, seed_ref, dense_ref,
                bias_ref, dq_ref, dk_ref, dv_ref,
                k_buffer, v_buffer, ready, done, fused, *, mask: Mask,
                scores: Scores, blocks: BlockSizes, group: int, kv_len: int,
                whole_atoms: bool):
  """q/do [B, T, N, H], k/v and dk/dv [B, S, K, H], lse/delta [B, N, T']
  (T' >= T: whole tiles); keys at or past kv_len (<= S: XLA's padding) are
  masked, tiles past T or S read zeros and store nothing there. Each None when
  absent: table_ref, the range table of the CTA's key rows (transposed,
  `range_table`); slopes_ref, ALiBi slopes [B, N]; q_ids_ref / kv_ids_ref,
  ids [B, T] / [B, S] padded past the kernel's tiles; seed_ref, dropout
  seed [4]; dense_ref, bias_ref: a dense mask and a bias, transposed
  (`pad_pairs`); dq_ref, with `blocks.fused_dq` (then `fused` holds its
  scratch, `_accumulate_dq`): float32 [B, T, N, H], zeros, to which the
  kernel adds dS K. With `whole_atoms`, K and V and their gradients are
  copied untiled (`tiles.tile_buffer`).

  Head dims above 128 (`split_dkv`): dK and dV together would need H
  registers a thread, so the CTA owns block_kv_dkv key rows that both
  warpgroups share (one K/V copy in shared memory): warpgroup 0 accumulates
  dV, warpgroup 1 dK, each recomputing S^T (5 matmuls a step instead of 4).
  """
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  q_len, head_dim = q_ref.shape[1], q_ref.shape[3]
  (k_copy2, k_smem2), (v_copy2, v_smem2) = (
      tile_views(x, whole_atoms) for x in (k_buffer, v_buffer))
  dtype = q_ref.dtype
  split = split_dkv(head_dim)
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  wg = lax.axis_index("wg")
  cta_rows = bkv if split else COMPUTE_WGS * bkv
  tile_start = lax.axis_index("kv_seq") * cta_rows
  kv_start = tile_start if split else tile_start + wg * bkv
  lo, full_lo, full_hi, hi = table_ranges(
      mask, q_block_ranges(mask, tile_start, cta_rows, bq, q_len), table_ref,
      batch, lax.axis_index("kv_seq"))
  coords = needs_positions(mask, scores)
  last_tile = cdiv(q_len, bq) - 1
  # One step at least: keys no query sees get a fully masked tile (P = 0),
  # so their dK/dV are written as zeros by the same code.
  steps = jnp.maximum(hi - lo, 1)
  slot = 0 if split else wg
  k_smem, v_smem = k_smem2.at[slot], v_smem2.at[slot]
  k_copy, v_copy = k_copy2.at[slot], v_copy2.at[slot]
  rows = pl.ds(kv_start, bkv)
  first_head = kv_head * group

  def q_tile(i):
    return jnp.minimum(lo + i, last_tile)

  def load_kv():
    plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_copy,
                            ready.at[0, slot])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_copy,
                            ready.at[1, slot])

  def store(smem, copy, grad, out_ref):
    smem[...] = grad.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(copy, out_ref.at[batch, rows, kv_head])
    plgpu.wait_smem_to_gmem(0)

  def compute_split(pipeline):
    pl.when(wg == 0)(load_kv)  # One copy, both warpgroups wait on it.
    kv_ids = load_ids(kv_ids_ref, batch, kv_start, bkv, ROW)
    plgpu.barrier_wait(ready.at[0, 0])
    plgpu.barrier_wait(ready.at[1, 0])

    def run(acc):
      pipeline((acc, kv_ids))
      return acc[...]
    grad = pl.run_scoped(run, plgpu.ACC((bkv, head_dim), jnp.float32))
    _meet(done)  # Neither overwrites K or V before both are done reading.
    pl.when(wg == 0)(lambda: store(v_smem, v_copy, grad, dv_ref))
    pl.when(wg == 1)(lambda: store(k_smem, k_copy, grad * scores.scale,
                                   dk_ref))

  def compute(pipeline):
    load_kv()
    kv_ids = load_ids(kv_ids_ref, batch, kv_start, bkv, ROW)
    plgpu.barrier_wait(ready.at[0, wg])
    plgpu.barrier_wait(ready.at[1, wg])

    def run(dk_acc, dv_acc):
      pipeline((dk_acc, dv_acc, kv_ids))
      return dk_acc[...], dv_acc[...]
    dk, dv = pl.run_scoped(run, plgpu.ACC((bkv, head_dim), jnp.float32),
                           plgpu.ACC((bkv, head_dim), jnp.float32))
    if done is not None:  # `fused_dq`'s matmuls read the other's K too.
      _meet(done)
    k_smem[...] = (dk * scores.scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_copy, dk_ref.at[batch, rows, kv_head],
                            commit_group=False)
    plgpu.copy_smem_to_gmem(v_copy, dv_ref.at[batch, rows, kv_head],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  def step(index, q_smem, do_smem, lse_smem, delta_smem, q_free, do_free,
           lse_free, delta_free, carry):
    i, g = index
    shape = (bkv, bq)
    head = first_head + g

    def scores_t(acc):
      plgpu.wgmma(acc, k_smem, q_smem.T)
      lse = plgpu.load(lse_smem, layout=COL)
      delta = plgpu.load(delta_smem, layout=COL)
      plgpu.barrier_arrive(lse_free)
      plgpu.barrier_arrive(delta_free)
      return acc[...], lse, delta
    s, lse, delta = pl.run_scoped(scores_t, plgpu.ACC(shape, jnp.float32))
    def positions():  # Transposed: queries across, keys down.
      return q_tile(i) * bq + _iota(shape, 1), kv_start + _iota(shape, 0)
    rows_cols = positions() if coords else None
    ids = {}
    if mask.has_ids:
      q_ids = load_ids(q_ids_ref, batch, q_tile(i) * bq, bq, COL)
      ids = dict(q_ids=lax.broadcast_in_dim(q_ids, shape, [1]),
                 kv_ids=lax.broadcast_in_dim(carry[-1], shape, [0]))
    tile = lo + i
    p, aux = _probabilities(
        s, lax.broadcast_in_dim(lse, shape, [1]),
        (tile < full_lo) | (tile >= full_hi), mask=mask, scores=scores,
        kv_len=kv_len, positions=positions, rows_cols=rows_cols, ids=ids,
        pair=(rows, pl.ds(q_tile(i) * bq, bq)),  # Keys down, queries across.
        refs=(slopes_ref, bias_ref, dense_ref), batch=batch, head=head)

    def drop(x):  # P^T or dP^T with dropout (the forward's bits).
      return dropped(x, scores, seed_ref, batch, head, *(rows_cols or
                                                         (None, None)))

    def dp_only(acc):
      plgpu.wgmma(acc, v_smem, do_smem.T)
      return acc[...]

    if split:
      acc = carry[0]

      @pl.when(wg == 0)
      def _():
        plgpu.wgmma(acc, drop(p).astype(dtype), do_smem)
        plgpu.wgmma_wait(0)

      @pl.when(wg == 1)
      def _():
        pd = scores.dqk(p, aux)  # Before dP: aux dies (fewer registers).
        dp = drop(pl.run_scoped(dp_only, plgpu.ACC(shape, jnp.float32)))
        ds = pd * (dp - lax.broadcast_in_dim(delta, shape, [1]))
        plgpu.wgmma(acc, ds.astype(dtype), q_smem)
        plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(do_free)
      plgpu.barrier_arrive(q_free)
      return carry

    dk_acc, dv_acc, _ = carry
    # With modified scores (aux), P's copy for dV and P times the scores'
    # derivative for dS are formed before dP, so that P and aux die.
    p16 = None if aux is None else drop(p).astype(dtype)
    pd = scores.dqk(p, aux)

    def dp_t(acc):
      plgpu.wgmma(acc, v_smem, do_smem.T)
      plgpu.wgmma(dv_acc, drop(p).astype(dtype) if p16 is None else p16,
                  do_smem)
      # dV still runs, unless `dv_before_ds` waits for it (P's copy dies).
      return plgpu.wgmma_accumulator_load(
          acc, wait_n=0 if blocks.dv_before_ds else 1)
    dp = drop(pl.run_scoped(dp_t, plgpu.ACC(shape, jnp.float32)))
    ds = (pd * (dp - lax.broadcast_in_dim(delta, shape, [1]))).astype(dtype)
    plgpu.wgmma(dk_acc, ds, q_smem)
    plgpu.wgmma_wait(1)  # dV is done (dK may run): dO may go.
    plgpu.barrier_arrive(do_free)
    if fused is not None:
      _accumulate_dq(ds, k_smem2, dq_ref.at[batch, pl.ds(q_tile(i) * bq, bq),
                                            head], fused, wg,
                     parity=lax.rem(i * group + g, 2))
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(q_free)
    return carry

  transforms = smem_transforms(dtype, head_dim)
  tile_spec = plgpu.BlockSpec(
      (bq, None, head_dim), lambda i, g: (q_tile(i), first_head + g, 0),
      transforms=transforms)
  row_spec = plgpu.BlockSpec((None, bq),
                             lambda i, g: (first_head + g, q_tile(i)))
  plgpu.emit_pipeline_warp_specialized(
      step, grid=(steps, group), memory_registers=blocks.producer_registers,
      max_concurrent_steps=blocks.num_stages_bwd, wg_axis="wg",
      num_compute_wgs=COMPUTE_WGS, manual_consumed_barriers=True,
      compute_context=compute_split if split else compute,
      in_specs=[tile_spec, tile_spec, row_spec, row_spec],
  )(q_ref.at[batch], do_ref.at[batch], lse_ref.at[batch], delta_ref.at[batch])


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


def dq_warpgroups(head_dim: int) -> int:
  """Consumer warpgroups of the dQ kernel: one above head dim 128, where two
  warpgroups' Q and dO tiles and a two-slot K/V ring (256 KiB at head dim
  256) would not fit shared memory (K/V tiles cannot shrink below 64 rows:
  they are the contraction of dQ += dS K)."""
  return 1 if head_dim > 128 else COMPUTE_WGS


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref,
               slopes_ref, q_ids_ref, kv_ids_ref, seed_ref, dense_ref,
               bias_ref, dq_ref, q_buffer, do_buffer, ready, *, mask: Mask,
               scores: Scores, blocks: BlockSizes, group: int, kv_len: int,
               whole_atoms: bool):
  """q/do/dq [B, T, N, H], k/v [B, S, K, H], lse/delta [B, N, T'] (T' >=
  T: whole tiles); keys at or past kv_len (<= S: XLA's padding) are
  masked, tiles past T or S read zeros and store nothing there. Each None when absent:
  table_ref, the range table of the CTA's query rows (`range_table`);
  slopes_ref, ALiBi slopes [B, N]; q_ids_ref / kv_ids_ref, ids [B, T] /
  [B, S] padded past the kernel's tiles; seed_ref, the dropout seed [4];
  dense_ref, bias_ref: a dense mask and a bias (`pad_pairs`). With
  `whole_atoms`, Q, dO and dQ are copied untiled (`tiles.tile_buffer`)."""
  wgs = dq_warpgroups(q_ref.shape[3])
  bq, bkv = blocks.block_q_dq, blocks.block_kv_dq
  head_dim = q_ref.shape[3]
  dtype = q_ref.dtype
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  wg = lax.axis_index("wg")
  q_tile = cta_row_tile(mask, "q_seq", lse_ref.shape[2] // (wgs * bq))
  tile_start = q_tile * (wgs * bq)
  q_start = tile_start + wg * bq
  lo, full_lo, full_hi, hi = table_ranges(
      mask, kv_block_ranges(mask, tile_start, wgs * bq, bkv, kv_len),
      table_ref, batch, q_tile)
  coords = needs_positions(mask, scores)
  last_tile = cdiv(kv_len, bkv) - 1
  steps = jnp.maximum(hi - lo, 1)  # A row that sees nothing: dQ = 0.
  (q_copy, q_smem), (do_copy, do_smem) = (
      (a.at[wg], b.at[wg]) for a, b in (tile_views(x, whole_atoms)
                                        for x in (q_buffer, do_buffer)))
  rows = pl.ds(q_start, bq)

  def kv_tile(j):
    return jnp.minimum(lo + j, last_tile)

  def compute(pipeline):
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_copy,
                            ready.at[0, wg])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_copy,
                            ready.at[1, wg])
    lse = plgpu.load(lse_ref.at[batch, head, rows], layout=ROW,
                     optimized=False)
    delta = plgpu.load(delta_ref.at[batch, head, rows], layout=ROW,
                       optimized=False)
    q_ids = load_ids(q_ids_ref, batch, q_start, bq, ROW)
    plgpu.barrier_wait(ready.at[0, wg])
    plgpu.barrier_wait(ready.at[1, wg])

    def run(dq_acc):
      pipeline((dq_acc, lse, delta, q_ids))
      return dq_acc[...]
    dq = pl.run_scoped(run, plgpu.ACC((bq, head_dim), jnp.float32))
    q_smem[...] = (dq * scores.scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_copy, dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)

  def step(index, k_smem, v_smem, k_free, v_free, carry):
    (j,) = index
    dq_acc, lse, delta, q_ids = carry
    shape = (bq, bkv)
    ids = {}
    if mask.has_ids:
      kv_ids = load_ids(kv_ids_ref, batch, kv_tile(j) * bkv, bkv, COL)
      ids = dict(q_ids=lax.broadcast_in_dim(q_ids, shape, [0]),
                 kv_ids=lax.broadcast_in_dim(kv_ids, shape, [1]))

    def positions():
      return q_start + _iota(shape, 0), kv_tile(j) * bkv + _iota(shape, 1)
    rows_cols = positions() if coords else None

    def s_dp(s_acc, dp_acc):
      plgpu.wgmma(s_acc, q_smem, k_smem.T)
      plgpu.wgmma(dp_acc, do_smem, v_smem.T)
      s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # dP still runs.
      tile = lo + j
      p, aux = _probabilities(
          s, lax.broadcast_in_dim(lse, shape, [0]),
          (tile < full_lo) | (tile >= full_hi), mask=mask, scores=scores,
          kv_len=kv_len, positions=positions, rows_cols=rows_cols, ids=ids,
          pair=(rows, pl.ds(kv_tile(j) * bkv, bkv)),
          refs=(slopes_ref, bias_ref, dense_ref), batch=batch, head=head)
      # P times the scores' derivative, all dS needs of P and aux.
      return scores.dqk(p, aux), dp_acc[...]
    pd, dp = pl.run_scoped(s_dp, plgpu.ACC(shape, jnp.float32),
                           plgpu.ACC(shape, jnp.float32))
    plgpu.barrier_arrive(v_free)
    dp = dropped(dp, scores, seed_ref, batch, head,
                 *(rows_cols or (None, None)))
    ds = pd * (dp - lax.broadcast_in_dim(delta, shape, [0]))
    plgpu.wgmma(dq_acc, ds.astype(dtype), k_smem)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(k_free)
    return carry

  kv_spec = plgpu.BlockSpec((bkv, head_dim), lambda j: (kv_tile(j), 0),
                            transforms=smem_transforms(dtype, head_dim))
  kv_head = lax.div(head, jnp.int32(group))
  plgpu.emit_pipeline_warp_specialized(
      step, grid=(steps,), memory_registers=blocks.producer_registers,
      max_concurrent_steps=blocks.num_stages_bwd, wg_axis="wg",
      num_compute_wgs=wgs, manual_consumed_barriers=True,
      compute_context=compute, in_specs=[kv_spec, kv_spec],
  )(k_ref.at[batch, :, kv_head], v_ref.at[batch, :, kv_head])


def flash_backward(q, k, v, operands: Operands, o, lse, do, dlse, *,
                   mask: Mask, scores: Scores, block_sizes: BlockSizes):
  """(dq, dk, dv) of the forward's o and lse (natural log, [B, N, T]).

  `operands` (`jax_flash.spec.operands`): those the call has, as the
  forward reads them (the dropout's keep bits scale P in dV and dP; a
  bias's gradient is not computed here; sinks and query offsets are not
  read: the sinks' share is in L).

  q/o/do [B, T, N, H], k/v [B, S, K, H] (K divides N), bf16 or fp16, any T
  and S: the kernels read Q, dO, K and V where they lie, in tiles that may
  reach past the last row (`tiles.tma_rows`: a copy only where a length is
  not a multiple of 8, and at head dims 32 and 64 only of the streamed
  tiles' arrays, not of the gradients; TMA reads zeros there, and L = +inf
  for those queries, so they add nothing), mask keys past S and drop the
  gradient rows past the ends. GPU only (the interpreter cannot run a
  wgmma with a register operand); tests lower it for CUDA on the CPU.
  """
  q_len, kv_len = q.shape[1], k.shape[1]
  head_dim = q.shape[3]
  blocks = block_sizes
  split, wgs = split_dkv(head_dim), dq_warpgroups(head_dim)
  kv_rows = blocks.block_kv_dkv * (1 if split else COMPUTE_WGS)
  q_rows = math.lcm(wgs * blocks.block_q_dq, blocks.block_q_dkv)
  # The kernels' tiles cover tp queries and sp keys (L, D, ids and per-pair
  # operands are padded to them); the sequence arrays have `tma_rows`.
  tp, sp = round_up(q_len, q_rows), round_up(kv_len, kv_rows)
  # D = rowsum(dO * O) - dlse; L in base 2, +inf for rows that see no key
  # (lse = -inf) and for padding, so P = exp2(S - L) is 0 there, never NaN.
  delta = pad_to(softmax.backward_delta(o, do, dlse), 2, tp)
  lse2 = pad_to(jnp.where(lse == -jnp.inf, jnp.inf, lse * softmax.LOG2E), 2,
                tp, jnp.inf)
  # The streamed tiles (the dK/dV kernel's Q and dO, the dQ kernel's K and
  # V) are copied tiled; the tiles a CTA keeps and the gradients untiled
  # where they are one swizzle atom wide (`tiles.tile_buffer`).
  whole_atoms = one_atom_wide(q.dtype, head_dim)
  do = do.astype(q.dtype)
  q_s, do_s = (pad_to(x, 1, tma_rows(q_len)) for x in (q, do))
  k_s, v_s = (pad_to(x, 1, tma_rows(kv_len)) for x in (k, v))
  q, do = (pad_to(x, 1, tma_rows(q_len, whole_atoms)) for x in (q, do))
  k, v = (pad_to(x, 1, tma_rows(kv_len, whole_atoms)) for x in (k, v))
  batch, _, num_heads, _ = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  transforms = smem_transforms(q.dtype, head_dim)
  params = compiler_params()
  kernel_args = dict(mask=mask, scores=scores, blocks=blocks, group=group,
                     kv_len=kv_len, whole_atoms=whole_atoms)

  def tables(transposed):
    """The range table of one kernel's CTA rows, or None."""
    kinds_and_ids = (operands.tile_kinds, operands.q_ids, operands.kv_ids)
    if transposed:
      return range_table(mask, *kinds_and_ids, kv_rows, blocks.block_q_dkv,
                         q_len, kv_len, sp // kv_rows, transposed=True)
    rows = wgs * blocks.block_q_dq
    return range_table(mask, *kinds_and_ids, rows, blocks.block_kv_dq, q_len,
                       kv_len, tp // rows)

  # Ids and per-pair operands padded once to both kernels' rows (the dK/dV
  # kernel reads the per-pair ones transposed).
  kv_cols = round_up(sp, blocks.block_kv_dq)
  ids = pad_ids(operands.q_ids, operands.kv_ids, tp, kv_cols)

  def flat(refs, extras):
    """A kernel's refs (6 inputs, extras, outputs), None for absent extras."""
    inputs, extra_refs, outputs = split_refs(refs, 6, extras)
    return inputs + extra_refs + outputs

  if not blocks.fused_dq:
    dq_rows = blocks.block_q_dq
    dq_extras = (tables(False), operands.alibi_slopes, *ids,
                 operands.dropout_seed,
                 *(pad_pairs(x, tp, kv_cols)
                   for x in (operands.dense_mask, operands.bias)))
    dq = plgpu.kernel(
        lambda *refs, q_smem, do_smem, ready: _dq_kernel(
            *flat(refs, dq_extras), q_smem, do_smem, ready, **kernel_args),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=dict(
            q_smem=tile_buffer((wgs, dq_rows, head_dim), q.dtype, transforms,
                               whole_atoms),
            do_smem=tile_buffer((wgs, dq_rows, head_dim), q.dtype,
                                transforms, whole_atoms),
            ready=plgpu.Barrier(num_barriers=(2, wgs))),
        grid=(num_heads, tp // (wgs * dq_rows), batch),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=params, kernel_name="flash_attention_dq_mosaic",
    )(q, k_s, v_s, do, lse2, delta,
      *(x for x in dq_extras if x is not None))

  dkv_rows, copies = blocks.block_kv_dkv, 1 if split else COMPUTE_WGS
  kv_out = jax.ShapeDtypeStruct(k.shape, k.dtype)
  # With `fused_dq` the dK/dV kernel adds dS K into float32 zeros in place
  # (a mutable array: the kernel's operand aliases it).
  assert not blocks.fused_dq or head_dim in FUSED_DQ_HEAD_DIMS, head_dim
  dq_sum = (jax.new_ref(jnp.zeros((batch, tp, num_heads, head_dim),
                                  jnp.float32))
            if blocks.fused_dq else None)
  dkv_extras = (tables(True), operands.alibi_slopes, *ids,
                operands.dropout_seed,
                *(pad_pairs(x, tp, kv_cols, transposed=True)
                  for x in (operands.dense_mask, operands.bias)), dq_sum)
  bq_dkv = blocks.block_q_dkv
  # Both warpgroups read K/V of the other's rows (head dims above 128, or
  # `fused_dq`'s exchange of dS): they meet at `done` before writing dK/dV
  # through K/V's shared memory.
  exchange = blocks.fused_dq and fused_dq_columns(head_dim) < head_dim
  fused_scratch = {}
  if blocks.fused_dq:
    width = fused_dq_columns(head_dim)
    fused_scratch["fused"] = dict(
        ds=plgpu.SMEM((2, COMPUTE_WGS, dkv_rows, bq_dkv), q.dtype,
                      transforms=smem_transforms(q.dtype, bq_dkv)),
        dq=plgpu.SMEM((COMPUTE_WGS, bq_dkv, width), jnp.float32,
                      transforms=smem_transforms(jnp.float32, width)),
        **({"ds_ready": plgpu.Barrier(num_arrivals=COMPUTE_WGS)}
           if exchange else {}))
  dk, dv = plgpu.kernel(
      lambda *refs, k_smem, v_smem, ready, done=None, fused=None: _dkv_kernel(
          *flat(refs, dkv_extras), k_smem, v_smem, ready, done, fused,
          **kernel_args),
      out_type=(kv_out, kv_out),
      scratch_types=dict(
          k_smem=tile_buffer((copies, dkv_rows, head_dim), k.dtype,
                             transforms, whole_atoms),
          v_smem=tile_buffer((copies, dkv_rows, head_dim), k.dtype,
                             transforms, whole_atoms),
          ready=plgpu.Barrier(num_barriers=(2, copies)),
          **(dict(done=plgpu.Barrier(num_arrivals=COMPUTE_WGS))
             if split or exchange else {}),
          **fused_scratch),
      grid=(num_kv_heads, sp // kv_rows, batch),
      grid_names=("heads", "kv_seq", "batch"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=params, kernel_name="flash_attention_dkv_mosaic",
  )(q_s, k, v, do_s, lse2, delta,
    *(x for x in dkv_extras if x is not None))
  if blocks.fused_dq:
    dq = (dq_sum[...] * scores.scale).astype(q.dtype)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
