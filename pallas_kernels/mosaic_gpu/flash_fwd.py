"""FlashAttention-2 forward (Dao 2023, Algorithm 1) for Hopper, in Pallas Mosaic GPU.

One CTA owns 2 * block_q query rows of one (batch, head), or with
`BlockSizes.persistent` one CTA a multiprocessor runs such items in turn
(`cta_schedule`), and runs three warpgroups (warp specialization):

* warpgroup 2, the producer, streams K/V tiles with TMA into a ring of
  `num_stages` shared-memory slots. A slot is refilled once both consumers
  have released it (a "free" barrier with two arrivals).
* warpgroups 0 and 1, the consumers, each own block_q rows: S = Q K^T by
  wgmma into registers, the online-softmax update (base 2, delayed
  normalization), then O += P V by wgmma with P from registers. A two-arrival
  "schedule" barrier staggers them (ping-pong), so one warpgroup's softmax
  overlaps the other's matmuls (`_Schedule`; or two hardware barriers with
  `BlockSizes.named_barriers`).

Tiles come from the shared mask description (`mask.kv_block_ranges`, and the
range table of a mask_mod or of ids, `table_ranges`; ids are compared on
boundary tiles, read from global memory): the producer loads the key tiles
either consumer needs, interior tiles skip the predicate, boundary tiles
evaluate it; a consumer whose rows need fewer tiles only waits and releases
the rest (every barrier completion is awaited). Scores go through the shared
`Scores.factored_logits2` (soft-cap, ALiBi, a score_mod; plain scores keep
their scale for the exponential's FMA, after the row max). The logsumexp is stored in
natural log, [B, N, T].
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core import fp8 as fp8_lib
from jax_flash.core import softmax
from jax_flash.core.device import num_multiprocessors
from jax_flash.core.mask import Mask, cdiv, kv_block_ranges, kv_partial_ends
from jax_flash.core.operands import Operands
from jax_flash.core.padding import pad_pairs, pad_to, round_up
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu.config import BlockSizes, compiler_params
from pallas_kernels.mosaic_gpu.layout import (COMPUTE_WGS, Columns,
                                              smem_transforms, tail_rows,
                                              tma_rows)
from pallas_kernels.mosaic_gpu.scheduling import persistent_order
from pallas_kernels.mosaic_gpu.tiles import (COL, ROW, E4m3Tiles,
                                             alibi_by_vectors,
                                             alibi_folded, alibi_row,
                                             await_last_releases,
                                             columns, cta_row_tile, dropped,
                                             load_ids, logits2,
                                             needs_positions, online_softmax,
                                             pad_ids, present, range_table,
                                             rescaled,
                                             softmax_step, split_refs,
                                             table_ranges, tile_buffer,
                                             tile_views, vector_iota,
                                             visible, with_alibi)

# Hardware barrier ids of the consumers' schedule with `named_barriers`,
# [warpgroup waiting][parity of its wait]: Mosaic GPU itself uses 0 (the
# CTA) and 1 to 3 (one per warpgroup).
SCHEDULE_BARRIER_IDS = ((4, 5), (6, 7))


def _hardware_barrier(op: str, barrier_id: int):
  """PTX `bar.<op>` ("sync": arrive and wait, "arrive": arrive only) on
  hardware barrier `barrier_id` for the two consumer warpgroups' threads."""
  @plgpu.inline_mgpu()
  def emit(_):
    mgpu_utils.inline_ptx(
        f"bar.{op} {barrier_id}, {COMPUTE_WGS * 128};", has_side_effects=True)
  emit()


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """The consumers' ping-pong, seen from warpgroup `wg`: `arrive` tells the
  other warpgroup this one has passed a point, `wait` waits for the other's
  arrival matching this warpgroup's (each warpgroup alternates arrive and
  wait; its k-th wait matches the other's k-th arrival).

  Either one mbarrier of two arrivals both use (`barrier`), or, with
  `barrier` None, hardware barriers: warpgroup w's k-th wait is a `bar.sync`
  on SCHEDULE_BARRIER_IDS[w][k % 2], where the other arrives (`bar.arrive`)
  for its k-th time. Two ids a warpgroup, alternating, because a hardware
  barrier counts arrivals, not arrivers: a warpgroup that arrives twice
  before the other waits once (it runs ahead through tiles it only
  releases) would complete one barrier alone; its (k+2)-th arrival comes
  after the other's (k+1)-th, so after the other's k-th wait. `turn` (0 or
  1) places a call in a loop step, whose two arrivals and two waits are a
  warpgroup's k = 2 * step + turn + wg."""
  barrier: object
  wg: jax.Array

  def _each(self, op: str, turn: int, own: bool):
    for w in range(COMPUTE_WGS):
      waiter = w if own else 1 - w
      k_parity = (turn + w) % 2
      pl.when(self.wg == w)(functools.partial(
          _hardware_barrier, op, SCHEDULE_BARRIER_IDS[waiter][k_parity]))

  def arrive(self, turn: int):
    if self.barrier is None:
      self._each("arrive", turn, own=False)
    else:
      plgpu.barrier_arrive(self.barrier)

  def wait(self, turn: int):
    if self.barrier is None:
      self._each("sync", turn, own=True)
    else:
      plgpu.barrier_wait(self.barrier)

  def both(self, turn: int):
    self.arrive(turn)
    self.wait(turn)


@dataclasses.dataclass(frozen=True)
class _Turns:
  """The consumers' turns at the tensor cores with `BlockSizes.overlap`,
  seen from warpgroup `wg`: `wait` before issuing a tile's matmuls waits
  for the other warpgroup to have issued its previous ones, `arrive` after
  issuing tells it so (FlashAttention-3's warp scheduler barriers: the
  matmuls alternate, the softmaxes do not wait for each other). One
  mbarrier of one arrival a warpgroup (`barriers.at[w]`, arrived at by the
  other); warpgroup 1 arrives once before its first tile, warpgroup 0 waits
  once after its last."""
  barriers: object
  wg: jax.Array

  def wait(self):
    plgpu.barrier_wait(self.barriers.at[self.wg])

  def arrive(self):
    plgpu.barrier_arrive(self.barriers.at[1 - self.wg])


def cta_schedule(mask: Mask, programs: int | None, batch: int, heads: int,
                 num_tiles: int, order_ref=None):
  """(count, item_id, coords) of this CTA's forward items (batch, head,
  query tile of 2 * block_q rows): how many it runs, item_id(i) -> the id
  of its i-th (for i < count) and coords(id) -> (batch, head, tile).

  programs None: one item a CTA, from its grid indices ("batch", "heads",
  `cta_row_tile` of "q_seq"). Otherwise the grid is `programs` CTAs
  ("program", persistent: one a multiprocessor) taking the items in rounds
  of `programs` (`persistent_order`): in round k CTA p takes item
  order_ref[k, p] (read from global memory: the kernel reads ids two
  items ahead), or without a table item k * programs + p, item ids
  counting query tiles fastest."""
  if programs is None:
    tile = cta_row_tile(mask, "q_seq", num_tiles)
    index = (lax.axis_index("batch"), lax.axis_index("heads"), tile)
    return 1, lambda i: jnp.int32(0), lambda item: index
  pid = lax.axis_index("program")

  def item_id(i):
    return i * programs + pid if order_ref is None else order_ref[i, pid]

  def coords(item):
    rest = lax.div(item, num_tiles)
    return lax.div(rest, heads), lax.rem(rest, heads), lax.rem(item, num_tiles)
  if order_ref is None:
    total = batch * heads * num_tiles
    count = total // programs + (pid < total % programs).astype(jnp.int32)
  else:  # Only the last round has empty entries.
    rounds = order_ref.shape[0]
    count = rounds - 1 + (order_ref[rounds - 1, pid] >= 0).astype(jnp.int32)
  return count, item_id, coords


def _union(a, b):
  """(first, stop): the tiles of two ranges; an empty range adds none."""
  empty_a, empty_b = a[0] >= a[3], b[0] >= b[3]
  first = jnp.where(empty_a, b[0], jnp.where(empty_b, a[0],
                                              jnp.minimum(a[0], b[0])))
  stop = jnp.where(empty_a, b[3], jnp.where(empty_b, a[3],
                                             jnp.maximum(a[3], b[3])))
  return first, jnp.maximum(stop, first)


@dataclasses.dataclass(frozen=True)
class Extras:
  """The forward's optional inputs, each None when the call has none (in
  the launcher arrays, in the kernel their refs): the range table of
  block_q-row query tiles (`range_table`), ALiBi slopes [B, N], query and
  key ids [B, T], [B, S] (padded past the kernel's tiles), sink logits
  [N], the dropout seed [4], query offsets [B] (row i of sequence b sits
  at position i + q_offsets[b]; `mask.has_q_offsets`), a dense mask and a
  bias (`pad_pairs`; `mask.has_dense`, `scores.bias`), the persistent
  CTAs' items [rounds, programs] (`persistent_order`), and with FP8 the
  scales [B, K, 2] float32 (`fp8_operands`)."""
  table: object = None
  slopes: object = None
  q_ids: object = None
  kv_ids: object = None
  sinks: object = None
  seed: object = None
  q_offsets: object = None
  dense: object = None
  bias: object = None
  order: object = None
  scales: object = None


@dataclasses.dataclass(frozen=True)
class _Cta:
  """What every part of one CTA's kernel reads: refs, shared memory, the
  call's statics and the warpgroup's own values (`_cta`)."""
  q_ref: object
  k_ref: object
  v_ref: object
  o_ref: object
  lse_ref: object
  extras: Extras
  mask: Mask
  scores: Scores
  blocks: BlockSizes
  group: int
  q_len: int
  kv_len: int
  num_tiles: int
  programs: int | None
  layout: Columns
  fp8: bool
  q_views: list
  k_views: list
  v_views: list
  lse_smem3: object
  fp8_buffers: object
  part_columns: list
  ready: tuple  # (K's, V's, Q's) barriers.
  free: tuple  # (K's, V's).
  tail: int  # Rows of the last key tile a consumer runs on.
  last_kv_tile: int
  q_buffers: int
  wg: object  # This warpgroup's index.
  schedule: object  # `_Turns` with `overlap`, else `_Schedule`.
  e4m3: E4m3Tiles
  count: object  # `cta_schedule`'s: items, ids and coordinates.
  item_id: object
  item_coords: object

  @property
  def rows(self) -> int:
    return COMPUTE_WGS * self.blocks.block_q

  @property
  def log2_scale(self) -> float:
    """With FP8, P * 448 (l sums it too, until the epilogue)."""
    return fp8_lib.LOG2_E4M3_MAX if self.fp8 else 0.0


def _cta(refs, scratch, **statics) -> _Cta:
  """The `_Cta` of a kernel's refs ((q, k, v, o, lse), `Extras` of refs)
  and scratch ((buffers, ready, free, schedule barrier))."""
  (q_ref, k_ref, v_ref, o_ref, lse_ref), extras = refs
  ((q_buffers, k_buffers, v_buffers, lse_smem3, fp8_buffers), ready, free,
   schedule_barrier) = scratch
  layout, blocks, fp8 = statics["layout"], statics["blocks"], statics["fp8"]
  qk_untiled, v_untiled = layout.untiled
  # Per column part: (the view TMA copies through, the view wgmma reads).
  q_views = [tile_views(x, qk_untiled) for x in q_buffers]
  k_views = [tile_views(x, qk_untiled) for x in k_buffers]
  v_views = [tile_views(x, v_untiled) for x in v_buffers]
  part_columns = [columns(start, width, q_ref.shape[-1])
                  for start, width in layout.parts]
  kv_len, block_kv = statics["kv_len"], blocks.block_kv
  last_kv_tile = cdiv(kv_len, block_kv) - 1
  # The rows of the last key tile run (`tail_rows`; FP8's V^T tiles whole).
  tail = block_kv if fp8 else tail_rows(
      kv_len, block_kv, layout.contraction_rows(q_ref.dtype, block_kv))
  wg = lax.axis_index("wg")
  schedule = (_Turns(schedule_barrier, wg) if blocks.overlap else
              _Schedule(schedule_barrier, wg))
  count, item_id, item_coords = cta_schedule(
      statics["mask"], statics["programs"], q_ref.shape[0], q_ref.shape[2],
      statics["num_tiles"], extras.order)
  return _Cta(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, o_ref=o_ref,
              lse_ref=lse_ref, extras=extras, q_views=q_views,
              k_views=k_views, v_views=v_views, lse_smem3=lse_smem3,
              fp8_buffers=fp8_buffers, part_columns=part_columns,
              ready=ready, free=free, tail=tail, last_kv_tile=last_kv_tile,
              q_buffers=blocks.q_buffers(layout.width), wg=wg,
              schedule=schedule,
              e4m3=E4m3Tiles(blocks.e4m3_stmatrix, blocks.e4m3_registers),
              count=count, item_id=item_id, item_coords=item_coords,
              **statics)


def _item_ranges(cta: _Cta, batch, tile_start, q_offset):
  """(first, steps, consumer_ranges) of one item: the key tiles [first,
  steps) the producer loads (what either consumer needs) and, per
  consumer warpgroup w, the ranges of its rows (the band's and the
  table's)."""
  mask, block_q, block_kv = cta.mask, cta.blocks.block_q, cta.blocks.block_kv

  def consumer_ranges(w):
    start = tile_start + w * block_q
    ranges = table_ranges(
        mask, kv_block_ranges(mask, start, block_q, block_kv, cta.kv_len,
                              q_offset),
        cta.extras.table, batch, lax.div(tile_start, block_q) + w)
    if cta.num_tiles * COMPUTE_WGS * block_q - cta.q_len < block_q:
      return ranges  # No warpgroup's rows lie past the queries.
    return tuple(jnp.where(start >= cta.q_len, ranges[0], x) for x in ranges)
  if cta.extras.table is None:  # The band of the CTA's rows.
    first, _, _, steps = kv_block_ranges(mask, tile_start, cta.rows,
                                         block_kv, cta.kv_len, q_offset)
  else:
    first, steps = _union(consumer_ranges(0), consumer_ranges(1))
  return first, jnp.maximum(steps, first), consumer_ranges


def _for_each_item(cta: _Cta, body):
  """Runs body(i, item, next_item, base) -> base over the CTA's items i
  (their ids, and the next one's: item_id(i + 1) for i + 1 < count), from
  base 0; returns the last base. Ids are read two items ahead, so a
  table's global-memory read has an item to arrive."""
  def ahead(i):
    return cta.item_id(jnp.minimum(i, cta.count - 1))

  def run(i, carry):
    base, item, next_item = carry
    later = ahead(i + 2)
    return body(i, item, next_item, base), next_item, later
  if cta.programs is None:
    return body(0, cta.item_id(0), cta.item_id(0), jnp.int32(0))
  return lax.fori_loop(0, cta.count, run,
                       (jnp.int32(0), ahead(0), ahead(1)))[0]


def _load_q(cta: _Cta, item, buffer):
  """This warpgroup's rows of item `item`'s Q into Q buffer `buffer`."""
  b, h, tile = cta.item_coords(item)
  block_q, wg = cta.blocks.block_q, cta.wg
  q_rows = pl.ds(tile * cta.rows + wg * block_q, block_q)
  for (copy, _), cols in zip(cta.q_views, cta.part_columns):
    plgpu.copy_gmem_to_smem(cta.q_ref.at[b, q_rows, h, cols],
                            copy.at[buffer, wg],
                            cta.ready[2].at[buffer * COMPUTE_WGS + wg])


@dataclasses.dataclass(frozen=True)
class _Item:
  """One consumer warpgroup's view of one item: its coordinates and
  rows, its key tiles (the producer's [first, steps) and its own
  [lo, full_lo, full_hi, hi): `_item_ranges`), the ring's count of
  tiles loaded before it (`base`), its Q buffer, and its per-item
  operands."""
  batch: object
  head: object
  q_start: object
  buffer: object
  q_offset: object
  first: object
  steps: object
  ranges: tuple
  base: object
  slope: object
  qk_scale: object
  pv_scale: object
  q_ids: object
  q_smems: list
  lse_smem: object
  p_smem: object  # With FP8: its e4m3 P (None: P stays in registers).

  def slot(self, cta: _Cta, j):
    """The ring slot of key tile j."""
    return lax.rem(self.base + j - self.first, cta.blocks.num_stages)


def _logits(cta: _Cta, it: _Item, j, s, *, masked: bool, width: int):
  """(t, c, positions, cols, row) of key tile j's raw scores s: base-2
  logits t * c + row (c > 0; `factored_logits2`; row: ALiBi's query term
  where `alibi_folded`, else None), hidden pairs -inf where `masked`; the
  positions and columns a score_mod, ALiBi or dropout see (None where
  unneeded)."""
  mask, block_q, block_kv = cta.mask, cta.blocks.block_q, cta.blocks.block_kv
  extras = cta.extras
  no_alibi = alibi_by_vectors(mask, cta.scores, cta.blocks, block_kv)
  scores = no_alibi or cta.scores
  rows = cols = None
  shape = (block_q, width)
  if masked or needs_positions(mask, scores):
    rows = it.q_start + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                               layout=plgpu.Layout.WGMMA)
    cols = j * block_kv + plgpu.broadcasted_iota(
        jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  tile = (pl.ds(it.q_start, block_q), pl.ds(j * block_kv, width))
  positions = (rows if rows is None or extras.q_offsets is None else
               rows + it.q_offset)  # What ALiBi and a score_mod see.
  s, c, _ = logits2(scores, s, positions, cols, slope=it.slope,
                    bias_ref=extras.bias, pair=tile, batch=it.batch,
                    head=it.head)
  if cta.fp8:
    c = c * it.qk_scale
  row = None
  if no_alibi is not None:  # Query positions less the key tile's first.
    q_rel = it.q_start - j * block_kv + vector_iota(block_q, ROW)
    if extras.q_offsets is not None:
      q_rel = q_rel + it.q_offset
    fold = alibi_folded(mask, cta.blocks)
    s = with_alibi(s, c, it.slope, q_rel, vector_iota(width, COL), 0, mask,
                   fold=fold)
    row = alibi_row(it.slope, q_rel) if fold else None
  if masked:
    ids = {}
    if mask.has_ids:
      kv_ids = load_ids(extras.kv_ids, it.batch, j * block_kv, width, COL)
      ids = dict(q_ids=lax.broadcast_in_dim(it.q_ids, shape, [0]),
                 kv_ids=lax.broadcast_in_dim(kv_ids, shape, [1]))
    ok = visible(mask, rows, cols, cta.kv_len, dense_ref=extras.dense,
                 pair=tile, batch=it.batch, head=it.head,
                 q_offset=it.q_offset, **ids)
    s = jnp.where(ok, s, -jnp.inf)
  return s, c, positions, cols, row


def _step(cta: _Cta, it: _Item, j, carry, *, masked: bool, width: int):
  """Key tile j on its first `width` rows (`tail_rows`): S = Q K^T, the
  online-softmax step, then O += P V, the consumers staggered."""
  acc, m, l = carry
  (k_ready, v_ready, _), (k_free, v_free) = cta.ready, cta.free
  schedule, fp8 = cta.schedule, cta.fp8
  slot = it.slot(cta, j)
  with jax.named_scope("k_wait"):
    plgpu.barrier_wait(k_ready.at[slot])

  def qk(acc_ref):
    for q_smem, (_, k_smem) in zip(it.q_smems, cta.k_views):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot, pl.ds(0, width)].T)
    schedule.both(0)
    return acc_ref[...]
  s = pl.run_scoped(qk, plgpu.ACC((cta.blocks.block_q, width), jnp.float32))
  plgpu.barrier_arrive(k_free.at[slot])
  s, c, positions, cols, row = _logits(cta, it, j, s, masked=masked,
                                      width=width)
  p, m_new, l, acc = online_softmax(s, c, m, l, acc,
                                    log2_scale=cta.log2_scale, row=row)
  # l sums the undropped p; only P V sees the dropout.
  if fp8:  # As e4m3: the left operand from shared memory or registers.
    p16 = cta.e4m3.operand(p.astype(fp8_lib.E4M3), it.p_smem)
  else:
    p16 = dropped(p, cta.scores, cta.extras.seed, it.batch, it.head,
                  positions, cols).astype(cta.o_ref.dtype)
  schedule.arrive(1)  # Softmax done: the other may compute.
  with jax.named_scope("v_wait"):
    plgpu.barrier_wait(v_ready.at[slot])
  schedule.wait(1)  # The tensor cores are ours again.

  def pv(acc_refs):
    for acc_ref, (_, v_smem) in zip(acc_refs, cta.v_views):
      plgpu.wgmma(acc_ref, p16, v_smem.at[slot].T if fp8 else
                  v_smem.at[slot, pl.ds(0, width)])
  acc = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in acc))
  plgpu.barrier_arrive(v_free.at[slot])
  return acc, m_new, l


def _overlapped_step(cta: _Cta, it: _Item, j, carry, *, masked: bool,
                     first_tile: bool = False):
  """Key tile j with `overlap` (FP8, whole tiles): its QK^T issued with
  tile j - 1's P V (none for the first tile), its softmax while P V runs,
  then the accumulator (P V's result) rescaled and tile j's P stored
  where P V read tile j - 1's (or, `E4m3Tiles.registers`, carried as
  the next step's left operand: `pending`)."""
  acc, m, l, pending = carry
  p_prev = it.p_smem if pending is None else pending
  (k_ready, v_ready, _), (k_free, v_free) = cta.ready, cta.free
  block_q, block_kv = cta.blocks.block_q, cta.blocks.block_kv
  slot, prev = it.slot(cta, j), it.slot(cta, j - 1)
  with jax.named_scope("k_wait"):
    plgpu.barrier_wait(k_ready.at[slot])
  if not first_tile:
    with jax.named_scope("v_wait"):
      plgpu.barrier_wait(v_ready.at[prev])
  cta.schedule.wait()

  def matmuls(s_ref, acc_refs):
    for q_smem, (_, k_smem) in zip(it.q_smems, cta.k_views):
      plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
    if not first_tile:
      for acc_ref, a, (_, v_smem) in zip(acc_refs, acc, cta.v_views):
        acc_ref[...] = a
        plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev].T)
    cta.schedule.arrive()
    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if first_tile else 1)
    plgpu.barrier_arrive(k_free.at[slot])
    s, c, _, _, row = _logits(cta, it, j, s, masked=masked, width=block_kv)
    p, m_new, l_new, alpha = softmax_step(s, c, m, l,
                                          log2_scale=cta.log2_scale, row=row)
    p8 = p.astype(fp8_lib.E4M3)
    if first_tile:
      return acc, m_new, l_new, p8
    new = tuple(acc_ref[...] for acc_ref in acc_refs)  # P V done.
    plgpu.barrier_arrive(v_free.at[prev])
    return rescaled(new, alpha), m_new, l_new, p8
  acc, m, l, p8 = pl.run_scoped(
      matmuls, plgpu.ACC((block_q, block_kv), jnp.float32),
      tuple(plgpu.ACC((block_q, w), jnp.float32)
            for _, w in cta.layout.parts))
  p8 = cta.e4m3.operand(p8, it.p_smem)
  return acc, m, l, (p8 if cta.e4m3.registers else None)


def _finish(cta: _Cta, it: _Item, j, carry):
  """The last tile's (j - 1's) P V, with `overlap`."""
  acc, m, l, pending = carry
  p_prev = it.p_smem if pending is None else pending
  prev = it.slot(cta, j - 1)
  with jax.named_scope("v_wait"):
    plgpu.barrier_wait(cta.ready[1].at[prev])

  def pv(acc_refs):
    for acc_ref, (_, v_smem) in zip(acc_refs, cta.v_views):
      plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev].T)
  acc = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in acc))
  plgpu.barrier_arrive(cta.free[1].at[prev])
  return acc, m, l, pending


def _release(cta: _Cta, it: _Item, j, carry):
  """A tile the producer loaded for the other warpgroup's rows: awaited,
  released, and the consumers' stagger kept."""
  (k_ready, v_ready, _), (k_free, v_free) = cta.ready, cta.free
  slot = it.slot(cta, j)
  plgpu.barrier_wait(k_ready.at[slot])
  plgpu.barrier_arrive(k_free.at[slot])
  if cta.blocks.overlap:
    cta.schedule.wait()
    cta.schedule.arrive()
  else:
    cta.schedule.both(0)
  plgpu.barrier_wait(v_ready.at[slot])
  plgpu.barrier_arrive(v_free.at[slot])
  if not cta.blocks.overlap:
    cta.schedule.both(1)
  return carry


def _stepped_tiles(cta: _Cta, it: _Item, carry):
  """Tiles [lo, hi), each by `_step`: masked, unmasked, masked (a masked
  range the mask leaves empty on every call not emitted)."""
  lo, full_lo, full_hi, hi = it.ranges
  block_kv, tail = cta.blocks.block_kv, cta.tail
  leading, trailing = kv_partial_ends(cta.mask, block_kv, cta.kv_len)
  for start, stop, masked, emitted in ((lo, full_lo, True, leading),
                                       (full_lo, full_hi, False, True),
                                       (full_hi, hi, True, trailing)):
    if not emitted:
      continue
    # The last key tile (always masked where keys end inside it) on its
    # first `tail` rows: a loop of none or one step after the rest.
    end = (stop if not masked or tail == block_kv else
           jnp.minimum(jnp.maximum(start, cta.last_kv_tile), stop))
    carry = lax.fori_loop(start, end, functools.partial(
        _step, cta, it, masked=masked, width=block_kv), carry)
    if end is not stop:
      carry = lax.fori_loop(end, stop, functools.partial(
          _step, cta, it, masked=True, width=tail), carry)
  return carry


def _overlapped_tiles(cta: _Cta, it: _Item, carry):
  """Tiles [lo, hi) by `_overlapped_step`: the first (taken as masked),
  the rest, then the last one's P V (a masked range the mask leaves empty
  on every call not emitted)."""
  lo, full_lo, full_hi, hi = it.ranges
  leading, trailing = kv_partial_ends(cta.mask, cta.blocks.block_kv,
                                      cta.kv_len)
  pending = cta.e4m3.no_operand((cta.blocks.block_q, cta.blocks.block_kv))
  carry = lax.fori_loop(lo, jnp.minimum(lo + 1, hi), functools.partial(
      _overlapped_step, cta, it, masked=True, first_tile=True),
      (*carry, pending))
  for start, stop, masked, emitted in (
      (lo + 1, full_lo, True, leading),
      (jnp.maximum(full_lo, lo + 1), full_hi, False, True),
      (jnp.maximum(full_hi, lo + 1), hi, True, trailing)):
    if not emitted:
      continue
    carry = lax.fori_loop(start, stop, functools.partial(
        _overlapped_step, cta, it, masked=masked), carry)
  return lax.fori_loop(hi, jnp.where(lo < hi, hi + 1, hi),
                       functools.partial(_finish, cta, it), carry)[:3]


def _epilogue(cta: _Cta, it: _Item, acc, m, l):
  """O and the logsumexp of the item's rows, normalized once, through
  shared memory to global memory."""
  extras, fp8 = cta.extras, cta.fp8
  sink2 = (None if extras.sinks is None else
           extras.sinks[it.head].astype(jnp.float32) * softmax.LOG2E)
  if fp8:
    acc = tuple(a * (it.pv_scale / fp8_lib.E4M3_MAX) for a in acc)
    l = l * (1 / fp8_lib.E4M3_MAX)
  o, lse = softmax.finalize(acc, m, l, sink2=sink2)
  o_views = ([(cta.fp8_buffers[0],) * 2] if fp8 else cta.q_views)
  for (copy, mma), part in zip(o_views, o):
    mma.at[it.buffer, cta.wg][...] = part.astype(cta.o_ref.dtype)
  it.lse_smem[...] = lse
  plgpu.commit_smem()
  block_q = cta.blocks.block_q
  for (copy, _), cols in zip(o_views, cta.part_columns):
    plgpu.copy_smem_to_gmem(
        copy.at[it.buffer, cta.wg],
        cta.o_ref.at[it.batch, pl.ds(it.q_start, block_q), it.head, cols])
  plgpu.copy_smem_to_gmem(
      it.lse_smem, cta.lse_ref.at[it.batch, it.head,
                                  pl.ds(it.q_start, block_q)])
  if cta.q_buffers == 1:
    plgpu.wait_smem_to_gmem(0)


def _consumer_item(cta: _Cta, i, item, next_item, base):
  """A consumer warpgroup's part of item `item` (the CTA's i-th): its Q,
  the key tiles its rows need (the rest only released), the epilogue.
  With two Q buffers (persistent) item i uses buffer i % 2, and the next
  item's Q loads into the other while this one's tiles run. Returns the
  ring's count after the item."""
  extras, block_q, wg = cta.extras, cta.blocks.block_q, cta.wg
  batch, head, tile = cta.item_coords(item)
  tile_start = tile * cta.rows
  buffer = lax.rem(i, cta.q_buffers) if cta.q_buffers > 1 else 0
  q_smems = [mma.at[buffer, wg] for _, mma in cta.q_views]
  lse_smem = cta.lse_smem3.at[buffer, wg]
  q_offset = 0 if extras.q_offsets is None else extras.q_offsets[batch]
  first, steps, consumer_ranges = _item_ranges(cta, batch, tile_start,
                                               q_offset)
  q_start = tile_start + wg * block_q
  lo, full_lo, full_hi, hi = consumer_ranges(wg)
  empty = lo >= hi  # An empty range sits at the producer's first.
  ranges = tuple(jnp.where(empty, first, x) for x in (lo, full_lo, full_hi,
                                                        hi))
  slope = None if extras.slopes is None else extras.slopes[batch, head]
  qk_scale = pv_scale = None
  if cta.fp8:  # Q's and K's scales in the logits, V's (over 448) in O.
    kv_head = lax.div(head, jnp.int32(cta.group))
    qk_scale = extras.scales[batch, kv_head, 0]
    pv_scale = extras.scales[batch, kv_head, 1]
  p_smem = (cta.fp8_buffers[1].at[wg] if cta.fp8 and not
            cta.e4m3.registers else None)
  with jax.named_scope("q_load"):  # Profiler regions (`compiler_params`).
    if cta.q_buffers == 1:
      _load_q(cta, item, 0)
    else:
      pl.when(i == 0)(lambda: _load_q(cta, item, 0))
    plgpu.barrier_wait(cta.ready[2].at[buffer * COMPUTE_WGS + wg])
  if cta.q_buffers == 2:  # The other buffer's O and L stores have read it.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    pl.when(i + 1 < cta.count)(lambda: _load_q(cta, next_item, 1 - buffer))
  it = _Item(batch=batch, head=head, q_start=q_start, buffer=buffer,
             q_offset=q_offset, first=first, steps=steps, ranges=ranges,
             base=base, slope=slope, qk_scale=qk_scale, pv_scale=pv_scale,
             q_ids=load_ids(extras.q_ids, batch, q_start, block_q, ROW),
             q_smems=q_smems, lse_smem=lse_smem, p_smem=p_smem)
  m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), ROW)
  l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), ROW)
  acc = tuple(plgpu.layout_cast(jnp.zeros((block_q, width), jnp.float32),
                                plgpu.Layout.WGMMA)
              for _, width in cta.layout.parts)
  overlap, schedule = cta.blocks.overlap, cta.schedule
  # Warpgroup 1 runs half a step behind (as if the second of a step -1).
  pl.when(wg == 1)(schedule.arrive if overlap else
                   functools.partial(schedule.both, 1))
  release = functools.partial(_release, cta, it)
  with jax.named_scope("tiles"):
    carry = lax.fori_loop(first, ranges[0], release, (acc, m, l))
    carry = (_overlapped_tiles if overlap else _stepped_tiles)(cta, it,
                                                               carry)
    acc, m, l = lax.fori_loop(ranges[3], steps, release, carry)
    pl.when(wg == 0)(schedule.wait if overlap else
                     functools.partial(schedule.both, 0))
  with jax.named_scope("epilogue"):
    _epilogue(cta, it, acc, m, l)
  return base + steps - first


def _producer_item(cta: _Cta, i, item, next_item, base):
  """The producer's part of item `item`: the K/V tiles either consumer
  needs, into the ring, each slot refilled once both released it.
  Returns the ring's count after the item."""
  del i, next_item
  extras, blocks, stages = cta.extras, cta.blocks, cta.blocks.num_stages
  (k_ready, v_ready, _), (k_free, v_free) = cta.ready, cta.free
  batch, head, tile = cta.item_coords(item)
  tile_start = tile * cta.rows
  q_offset = 0 if extras.q_offsets is None else extras.q_offsets[batch]
  first, steps, _ = _item_ranges(cta, batch, tile_start, q_offset)
  kv_head = lax.div(head, jnp.int32(cta.group))

  @pl.loop(first, steps)
  def _(j):
    count = base + j - first  # The CTA's tile number.
    slot = lax.rem(count, stages)

    def await_release(free):  # The slot's previous tile's.
      pl.when(count >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
    keys = pl.ds(j * blocks.block_kv, blocks.block_kv)
    tile = (batch, keys, kv_head)
    # With `overlap` a consumer releases V a step after K, so K's copy
    # waits for K's release alone.
    await_release(k_free)
    if not blocks.overlap:
      await_release(v_free)
    for (k_copy, _), cols in zip(cta.k_views, cta.part_columns):
      plgpu.copy_gmem_to_smem(cta.k_ref.at[(*tile, cols)], k_copy.at[slot],
                              k_ready.at[slot])
    if blocks.overlap:
      await_release(v_free)
    for (v_copy, _), cols in zip(cta.v_views, cta.part_columns):
      v_tile = (cta.v_ref.at[batch, kv_head, cols, keys] if cta.fp8 else
                cta.v_ref.at[(*tile, cols)])
      plgpu.copy_gmem_to_smem(v_tile, v_copy.at[slot], v_ready.at[slot])
  return base + steps - first


def _forward_kernel(refs, scratch, **statics):
  """The forward's kernel: refs ((q, k, v, o, lse), `Extras` of refs);
  q_ref/o_ref [B, T, N, H], k_ref/v_ref [B, S, K, H], lse_ref [B, N,
  num_tiles * 2 * block_q]; keys at or past kv_len (<= S: XLA's padding)
  are masked. The last of num_tiles query tiles may reach past T (and the
  last key tile past S): TMA reads zeros there and drops the stores of O's
  rows past T (`tma_rows`); a consumer whose rows all lie at or past q_len
  (the call's T) only releases its tiles, so the other one's 64 rows run
  alone (257 tokens: the last query tile's second warpgroup), and the
  last key tile runs on the rows up to kv_len in V's groups of rows
  (`tail_rows`: 257 keys in 256-row tiles take 256 + 64). `layout`: the
  head dim's column parts, each with tiles of its own, and whether they
  are copied untiled (`layout.Columns`); the last part may reach past H.

  With `fp8`, Q and K are e4m3 and v_ref holds V transposed, [B, K, H,
  S'] (FP8 wgmma takes only K-major operands): the logits' factor c takes
  Q's and K's scales, P enters P V as e4m3 values of P * 448 (log2(448)
  added to the exponential's argument) through shared memory (jax
  0.11.2's wgmma takes an 8-bit left operand from registers only in a
  layout the accumulator's cannot be converted to), and the epilogue
  multiplies by V's scale / 448 and l by 1 / 448; O is staged in a bf16
  buffer of its own. With `BlockSizes.overlap` (FP8 only) each consumer
  runs `_overlapped_step` (a tile's softmax while the previous P V runs,
  the consumers taking turns at the tensor cores: `_Turns`), else
  `_step` (`_Schedule`'s ping-pong).

  A CTA runs the items (batch, head, 2 * block_q query rows)
  `cta_schedule` gives it (`programs`: None, one; else the persistent
  grid's size), in order; every warpgroup counts the K/V tiles loaded so
  far (`base`), and tile number base + i of the CTA sits in ring slot
  (base + i) % num_stages, so the ring carries over from one item to the
  next."""
  cta = _cta(refs, scratch, **statics)
  blocks = cta.blocks

  @pl.when(cta.wg < COMPUTE_WGS)
  def _consumer():
    plgpu.set_max_registers(blocks.consumer_registers(COMPUTE_WGS),
                            action="increase")
    _for_each_item(cta, functools.partial(_consumer_item, cta))
    if cta.q_buffers == 2:
      plgpu.wait_smem_to_gmem(0)

  @pl.when(cta.wg == COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(blocks.producer_registers, action="decrease")
    await_last_releases(
        _for_each_item(cta, functools.partial(_producer_item, cta)),
        blocks.num_stages, *cta.free)


def fp8_operands(operands: Operands):
  """(q8, k8, vt8, scales) for the FP8 forward: the call's e4m3 values
  (`Operands.fp8_q`, ...: the caller's, or those fp8=True rounded the
  inputs to, `jax_flash.core.fp8`), V transposed to [B, K, H, S], and
  scales [B, K, 2] float32 (Q's times K's, and V's)."""
  sq, sk, sv = (operands.fp8_scales[..., i] for i in range(3))
  return (operands.fp8_q, operands.fp8_k,
          operands.fp8_v.transpose(0, 2, 3, 1),
          jnp.stack([sq * sk, sv], axis=-1))


def _scratch(blocks: BlockSizes, layout: Columns, dtype, out_dtype,
             fp8: bool) -> dict:
  """The forward's shared memory and barriers: per column part Q's tiles
  (a buffer a warpgroup, two when persistent), the K/V ring (V^T's tiles
  with FP8), the logsumexp's rows, with FP8 O's bf16 staging and each
  consumer's e4m3 P (unless it stays in registers); ready barriers (one
  arrival a column part's copy) for K, V and Q, free barriers for K and V
  (one arrival a consumer), and the consumers' schedule barrier
  (`_Schedule`, `_Turns`; none with named barriers)."""
  widths = [w for _, w in layout.parts]
  stages, q_buffers = blocks.num_stages, blocks.q_buffers(layout.width)
  untiled = layout.untiled
  scratch = dict(
      buffers=(
          tuple(tile_buffer((q_buffers, COMPUTE_WGS, blocks.block_q, w),
                            dtype, smem_transforms(dtype, w), untiled[0])
                for w in widths),
          tuple(tile_buffer((stages, blocks.block_kv, w), dtype,
                            smem_transforms(dtype, w), untiled[0])
                for w in widths),
          tuple((plgpu.SMEM((stages, w, blocks.block_kv), dtype,
                            transforms=smem_transforms(dtype,
                                                       blocks.block_kv))
                 if fp8 else
                 tile_buffer((stages, blocks.block_kv, w), dtype,
                             smem_transforms(dtype, w, blocks.block_kv),
                             untiled[1]))
                for w in widths),
          plgpu.SMEM((q_buffers, COMPUTE_WGS, blocks.block_q), jnp.float32),
          (plgpu.SMEM((q_buffers, COMPUTE_WGS, blocks.block_q, widths[0]),
                      out_dtype, transforms=smem_transforms(out_dtype,
                                                            widths[0])),
           None if blocks.e4m3_registers else
           plgpu.SMEM((COMPUTE_WGS, blocks.block_q, blocks.block_kv),
                      dtype, transforms=smem_transforms(
                          dtype, blocks.block_kv))) if fp8 else None,
      ),
      ready=(plgpu.Barrier(num_arrivals=len(widths), num_barriers=stages),
             plgpu.Barrier(num_arrivals=len(widths), num_barriers=stages),
             plgpu.Barrier(num_arrivals=len(widths),
                           num_barriers=q_buffers * COMPUTE_WGS)),
      free=(plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
  )
  if blocks.overlap:  # One barrier a consumer, the other arrives (`_Turns`).
    scratch["schedule"] = plgpu.Barrier(num_arrivals=1,
                                        num_barriers=COMPUTE_WGS)
  elif not blocks.named_barriers:
    scratch["schedule"] = plgpu.Barrier(num_arrivals=COMPUTE_WGS)
  return scratch


def flash_forward(q, k, v, operands: Operands, *, mask: Mask, scores: Scores,
                  block_sizes: BlockSizes, fp8_scales=None):
  """Runs the forward kernel.

  q [B, T, N, H], k/v [B, S, K, H] (K divides N), bf16 or fp16, H up to
  256: a multiple of 16 from 32 in one part, any other in parts one
  swizzle atom wide (`tiles.Columns`; the backend pads the head dim to a
  multiple of 16 where V's tiles cannot take them). `operands`
  (`jax_flash.core.operands`): those the call has, each read as its
  docstring says; here the tile kinds
  become tile ranges, the ids are padded past the tiles, a dense mask and
  a bias (each dim 1 or full) are read tile by tile (no tile skipped for
  a dense mask), sinks enter each row's denominator (their gradient comes
  from the logsumexp, in `jax_flash.attention`), and query offsets (a
  prompt chunk against a cache) are forward only. Any T and S: Q, K and V
  are read where they lie, in tiles that may reach past the last row
  (`tiles.tma_rows`: no copy of tiles one swizzle atom wide, elsewhere one
  only where a length is not a multiple of 8), and the kernel masks keys
  past S.
  With `fp8_scales` ([B, K, 2], `fp8_operands`), q and k are e4m3, v is
  V transposed as e4m3 [B, K, H, S], H is 64, 128 or 256 and the output
  bfloat16 (`_forward_kernel`).
  GPU only: the Pallas interpreter cannot run a wgmma whose left operand is
  in registers (P here); tests lower it for CUDA on the CPU instead.
  Returns (o [B, T, N, H], lse [B, N, T] float32, natural log).
  """
  fp8 = fp8_scales is not None
  q_len, kv_len = q.shape[1], k.shape[1]
  blocks = block_sizes
  blocks.check_overlap(fp8)
  layout = (Columns(((0, q.shape[3]),), (False, False)) if fp8 else
            Columns.of(q.dtype, q.shape[3], blocks.block_kv, q_len, kv_len))
  q, k = (pad_to(x, 1, tma_rows(n, layout.untiled[0]))
          for x, n in ((q, q_len), (k, kv_len)))
  if fp8:  # The tiled copies of V^T's [H, block_kv] tiles: whole tiles,
    # their keys permuted as P's columns are stored (`tiles.E4m3Tiles`).
    v = E4m3Tiles(blocks.e4m3_stmatrix, blocks.e4m3_registers).permute(
        pad_to(v, 3, round_up(kv_len, blocks.block_kv)))
  else:
    v = pad_to(v, 1, tma_rows(kv_len, layout.untiled[1]))
  batch, _, num_heads, _ = q.shape
  group = num_heads // k.shape[2]
  rows = COMPUTE_WGS * blocks.block_q
  num_tiles = -(-q_len // rows)
  padded_len = num_tiles * rows  # The logsumexp's rows, ids' and pairs'.
  table = range_table(  # One row per consumer's query tile.
      mask, operands.tile_kinds, operands.q_ids, operands.kv_ids,
      blocks.block_q, blocks.block_kv, q_len, kv_len,
      padded_len // blocks.block_q)
  kv_rows = round_up(kv_len, blocks.block_kv)
  order = None
  if blocks.persistent:
    programs = min(batch * num_heads * num_tiles, num_multiprocessors())
    order = persistent_order(mask, programs, batch, num_heads, num_tiles,
                             rows, blocks.block_kv, kv_len)
    grid, grid_names = (programs,), ("program",)
  else:
    programs = None
    grid = (num_heads, num_tiles, batch)
    grid_names = ("heads", "q_seq", "batch")
  q_ids, kv_ids = pad_ids(operands.q_ids, operands.kv_ids, padded_len,
                          kv_rows)
  dense, bias = (pad_pairs(x, padded_len, kv_rows)
                 for x in (operands.dense_mask, operands.bias))
  extras = Extras(table=table, slopes=operands.alibi_slopes, q_ids=q_ids,
                  kv_ids=kv_ids, sinks=operands.sinks,
                  seed=operands.dropout_seed, q_offsets=operands.q_offsets,
                  dense=dense, bias=bias,
                  order=None if order is None else jnp.asarray(order),
                  scales=fp8_scales)
  out_dtype = jnp.dtype(jnp.bfloat16) if fp8 else q.dtype
  scratch = _scratch(blocks, layout, q.dtype, out_dtype, fp8)

  def body(*refs, buffers, ready, free, schedule=None):
    (q_ref, k_ref, v_ref), extra_refs, (o_ref, lse_ref) = split_refs(
        refs, 3, extras)
    _forward_kernel(((q_ref, k_ref, v_ref, o_ref, lse_ref), extra_refs),
                    (buffers, ready, free, schedule), mask=mask,
                    scores=scores, blocks=blocks, group=group, q_len=q_len,
                    kv_len=kv_len, num_tiles=num_tiles, programs=programs,
                    layout=layout, fp8=fp8)

  o, lse = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct(q.shape, out_dtype),
                jax.ShapeDtypeStruct((batch, num_heads, padded_len),
                                     jnp.float32)),
      scratch_types=scratch,
      grid=grid,
      grid_names=grid_names,
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=compiler_params(blocks.reduction_scratch()),
      kernel_name="flash_attention_forward_mosaic",
  )(q, k, v, *present(extras))
  return o[:, :q_len], lse[:, :, :q_len]


