"""Split-KV decoding for Hopper in Pallas Mosaic GPU: a balanced TMA stream.

The cache is cut into tiles of `block_k` rows: block_k / heads positions of
a group of `heads` KV heads (one head, or all of them: a run of the cache
that is contiguous in memory). The (sequence, head group, tile) space,
flattened, is cut into one equal run a CTA, one CTA a multiprocessor
(stream-K), so every multiprocessor streams the same number of tiles of a
full cache; a run crosses from one head group's tiles into the next in at
most a few segments. A CTA runs three warpgroups (two with one consumer):

* the producer loads each segment's query rows (the head group's G * T
  rows a head, padded to 8; two buffers, so the next segment's load while
  this one streams) and streams the run's K/V tiles with TMA into a ring
  of `num_stages` shared-memory slots (tiles past a sequence's length are
  never loaded);
* each of `consumers` consumer warpgroups takes every consumers-th tile
  (always the same slots) and for each forms S = Q K^T by wgmma (64 rows),
  the masked online-softmax update (base 2) and O += P V by wgmma with P
  from registers, and at a segment's end writes its normalized partial
  output and logsumexp into the head group's next slot.

`softmax.merge_split_kv` merges a head group's parts in XLA (which slots
are written is static: the schedule depends on shapes only). Query t of
sequence b (of T) sits at position kv_len[b] - T + t (the shared `Mask`'s
query offset); row r of a CTA is query t = r % T of the group's head r //
T. Its speed against cuDNN's: benchmarks/NOTES.md, "Mosaic GPU split-KV
decode".
"""
from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core import softmax
from jax_flash.core.device import num_multiprocessors
from jax_flash.core.mask import Mask, cdiv
from jax_flash.core.padding import pad_to
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu import config
from pallas_kernels.mosaic_gpu.config import (DECODE_BLOCK_K, DECODE_ROWS,
                                              compiler_params)
from pallas_kernels.mosaic_gpu.layout import smem_transforms
from pallas_kernels.mosaic_gpu.scheduling import stream_k
from pallas_kernels.mosaic_gpu.tiles import (ROW, await_last_releases,
                                             online_softmax)


def _segment(bounds_ref, lengths_ref, s: int, *, groups: int,
             head_groups: int, tiles: int, positions: int):
  """Segment s of this CTA's run: (group, batch, head group, whether the
  run crosses the group, its first tile, tiles to stream: those of the run
  within the sequence's length)."""
  cta = lax.axis_index("cta")
  start, end = bounds_ref[cta], bounds_ref[cta + 1]
  group = lax.div(start, tiles) + s
  clamped = jnp.minimum(group, groups - 1)
  batch = lax.div(clamped, head_groups)
  lo = jnp.maximum(start - group * tiles, 0)
  hi = jnp.minimum(end - group * tiles, tiles)
  in_run = jnp.logical_and(group < groups, hi > lo)
  hi = jnp.minimum(hi, cdiv(lengths_ref[batch], positions))
  count = jnp.where(in_run, jnp.maximum(hi - lo, 0), 0)
  return (clamped, batch, lax.rem(clamped, head_groups), in_run, lo,
          count)


@dataclasses.dataclass(frozen=True)
class _Cta:
  """What every part of a decode CTA reads: refs, shared memory, barriers,
  statics, and this CTA and warpgroup (`_decode_kernel`)."""
  refs: tuple  # (q, k, v, lengths, bounds, owners, o, lse)
  buffers: tuple  # (Q, K, V, O, lse) in shared memory.
  ready: tuple  # (K, V, Q) barriers,
  free: tuple  # and their releases.
  scores: Scores
  mask: Mask
  q_len: int
  heads: int
  group: int
  block_k: int
  stages: int
  consumers: int
  segments: int
  segment: object  # `_segment` with the schedule's statics.
  wg: object
  cta: object

  @property
  def positions(self) -> int:
    return self.block_k // self.heads  # Cache positions a tile.

  @property
  def q_buffers(self) -> int:
    return self.buffers[0].shape[0]

  def q_buffer(self, seg: int):
    """Segment seg's Q buffer (the rows the kernel's Q has)."""
    q = self.buffers[0].at[seg % self.q_buffers]
    q_rows = self.refs[0].shape[-2]
    return q if q_rows == DECODE_ROWS else q.at[pl.ds(0, q_rows)]


class _Lanes(typing.NamedTuple):
  """A consumer's per-element values of an S tile: each row's query, its
  match of a column's KV head (heads > 1, else None), each column's
  position in the tile."""
  query: object
  same_head: object
  tile_positions: object


class _Run(typing.NamedTuple):
  """A consumer's segment: its Q, the sequence's length, the segment's
  first tile, the run's tiles before it, the consumer's first place."""
  q: object
  kv_len: object
  lo: object
  base: object
  first: object


def _lanes(cta: _Cta) -> _Lanes:
  shape = (DECODE_ROWS, cta.block_k)
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                layout=plgpu.Layout.WGMMA)
  query = lax.rem(rows, cta.q_len)
  tile_cols = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                     layout=plgpu.Layout.WGMMA)
  # A row's KV head against a column's (heads > 1: rows of padding match
  # none).
  heads = cta.heads
  same_head = (lax.div(rows, cta.group * cta.q_len) == lax.rem(tile_cols,
                                                                heads)
               if heads > 1 else None)
  tile_positions = lax.div(tile_cols, heads) if heads > 1 else tile_cols
  return _Lanes(query, same_head, tile_positions)


def _decode_step(cta: _Cta, lanes: _Lanes, run: _Run, i, carry):
  """One tile of a consumer: S = Q K^T, the masked online-softmax update,
  O += P V (V's rows past the length zeroed first)."""
  _, k_smem, v_smem, _, _ = cta.buffers
  k_ready, v_ready, _ = cta.ready
  k_free, v_free, _ = cta.free
  acc, m, l = carry
  n = run.first + cta.consumers * i  # The tile's place in the run.
  j = run.lo + n - run.base
  slot = lax.rem(n, cta.stages)
  plgpu.barrier_wait(k_ready.at[slot])

  def qk(acc_ref):
    plgpu.wgmma(acc_ref, run.q, k_smem.at[slot].T)
    return acc_ref[...]
  s = pl.run_scoped(qk, plgpu.ACC((DECODE_ROWS, cta.block_k), jnp.float32))
  plgpu.barrier_arrive(k_free.at[slot])
  cols = j * cta.positions + lanes.tile_positions
  s, c, _ = cta.scores.factored_logits2(s, lanes.query, cols)
  ok = cta.mask.visible(lanes.query, cols, run.kv_len,
                        q_offset=run.kv_len - cta.q_len)
  if lanes.same_head is not None:
    ok = jnp.logical_and(ok, lanes.same_head)
  s = jnp.where(ok, s, -jnp.inf)
  p, m_new, l, acc = online_softmax(s, c, m, l, acc)
  plgpu.barrier_wait(v_ready.at[slot])
  valid = (run.kv_len - j * cta.positions) * cta.heads  # V rows past it: NaN?

  @pl.when(valid < cta.block_k)
  def _():  # Zeroed, or 0 * NaN would reach P V.
    v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
    v_rows = plgpu.broadcasted_iota(jnp.int32, v.shape, 0,
                                    layout=plgpu.Layout.WGMMA)
    v_smem.at[slot][...] = jnp.where(v_rows < valid, v, jnp.zeros_like(v))
    plgpu.commit_smem()
  acc = pl.run_state(lambda acc_ref: plgpu.wgmma(
      acc_ref, p.astype(cta.refs[0].dtype), v_smem.at[slot]))(
          plgpu.ACC.init(acc))
  plgpu.barrier_arrive(v_free.at[slot])
  return acc, m_new, l


def _consumer_segment(cta: _Cta, lanes: _Lanes, seg: int, base):
  """A consumer's tiles of segment seg (run places base + t, t < count,
  that are wg modulo `consumers`: the slots it always takes), then its
  normalized part stored in the group's slot. Returns the next base."""
  q_ref, _, _, lengths_ref, bounds_ref, owners_ref, o_ref, lse_ref = cta.refs
  q_smem, _, v_smem, o_smem, lse_smem = cta.buffers
  q_ready, q_free, wg = cta.ready[2], cta.free[2], cta.wg
  group_index, batch, _, in_run, lo, count = cta.segment(
      bounds_ref, lengths_ref, seg)
  kv_len = lengths_ref[batch]
  q_seg = q_smem.at[seg % cta.q_buffers]  # The producer's load of it.
  plgpu.barrier_wait(q_ready.at[seg % cta.q_buffers])
  consumers = cta.consumers
  first = base + lax.rem(wg - lax.rem(base, consumers) + consumers,
                         consumers)
  mine = cdiv(jnp.maximum(base + count - first, 0), consumers)
  m = plgpu.layout_cast(jnp.full((DECODE_ROWS,), -jnp.inf, jnp.float32), ROW)
  l = plgpu.layout_cast(jnp.zeros((DECODE_ROWS,), jnp.float32), ROW)
  acc = plgpu.layout_cast(
      jnp.zeros((DECODE_ROWS, v_smem.shape[-1]), jnp.float32),
      plgpu.Layout.WGMMA)
  run = _Run(q_seg, kv_len, lo, base, first)
  acc, m, l = lax.fori_loop(0, mine, functools.partial(
      _decode_step, cta, lanes, run), (acc, m, l))
  plgpu.barrier_arrive(q_free.at[seg % cta.q_buffers])
  o, lse = softmax.finalize(acc, m, l)
  # The last segment's store has read the buffer (it ran meanwhile).
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  o_smem.at[wg][...] = o
  lse_smem.at[wg][...] = lse
  plgpu.commit_smem()
  out_rows = pl.ds(0, o_ref.shape[-2])
  part = cta.cta - owners_ref[group_index]

  @pl.when(in_run)
  def _():
    plgpu.copy_smem_to_gmem(o_smem.at[wg, out_rows],
                            o_ref.at[group_index, part, wg])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg, out_rows],
                            lse_ref.at[group_index, part, wg])
  return base + count


def _decode_consumer(cta: _Cta):
  plgpu.set_max_registers(232, action="increase")
  lanes = _lanes(cta)
  base = jnp.int32(0)  # Tiles of the run before the segment.
  for seg in range(cta.segments):
    base = _consumer_segment(cta, lanes, seg, base)
  plgpu.wait_smem_to_gmem(0)


def _decode_producer(cta: _Cta):
  """Each segment's Q (into a buffer both consumers have released: the next
  segment's Q loads while they stream this one's tiles), then its K/V
  tiles through the ring of `stages` slots."""
  q_ref, k_ref, v_ref, lengths_ref, bounds_ref = cta.refs[:5]
  _, k_smem, v_smem, _, _ = cta.buffers
  k_ready, v_ready, q_ready = cta.ready
  k_free, v_free, q_free = cta.free
  stages, block_k, q_buffers = cta.stages, cta.block_k, cta.q_buffers
  plgpu.set_max_registers(40, action="decrease")
  base = jnp.int32(0)
  for seg in range(cta.segments):
    _, batch, head, _, lo, count = cta.segment(bounds_ref, lengths_ref, seg)
    if seg >= q_buffers:
      plgpu.barrier_wait(q_free.at[seg % q_buffers])
    plgpu.copy_gmem_to_smem(q_ref.at[batch, head], cta.q_buffer(seg),
                            q_ready.at[seg % q_buffers])

    @pl.loop(0, count)
    def _(t, base=base, batch=batch, head=head, lo=lo):
      n = base + t
      slot = lax.rem(n, stages)

      @pl.when(n >= stages)  # The slot's previous tile released.
      def _():
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
      rows = pl.ds((lo + t) * block_k, block_k)
      # heads > 1: every KV head of block_k / K positions, contiguous.
      tile = (batch, rows, head) if cta.heads == 1 else (batch, rows)
      plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot],
                              k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot],
                              v_ready.at[slot])
    base = base + count
  # Await the last releases too: every completion of a barrier is waited.
  for seg in range(max(cta.segments - q_buffers, 0), cta.segments):
    plgpu.barrier_wait(q_free.at[seg % q_buffers])
  await_last_releases(base, stages, k_free, v_free)


def _decode_kernel(*refs, **statics):
  """refs (q, k, v, lengths, bounds, owners, o, lse): q [B, K / heads, Rq,
  H] (rows (h * G + g) * T + t for the group's KV head h < heads, zero
  past heads * G * T; Rq <= DECODE_ROWS, a multiple of 8 or DECODE_ROWS:
  the buffer's rows past Rq are never written, and only rows that are
  dropped or masked read them); k/v [B, S, K, H] when heads == 1, else
  [B, S * K, H] (row p * K + h: position p, KV head h); lengths int32 [B];
  bounds int32 [CTAs + 1] (CTA c streams flattened tiles bounds[c] to
  bounds[c + 1]); owners int32 [groups] (the first CTA whose run crosses
  each head group); o [groups, M, consumers, R, H] and lse [groups, M,
  consumers, R] float32: part (m, w) of a group from the group's m-th
  CTA's consumer w (the first R of the DECODE_ROWS rows; natural log, -inf
  for a part that saw no key; parts past a group's CTAs are not written).
  `statics`: `_Cta`'s fields from buffers to segment."""
  cta = _Cta(refs=refs, wg=lax.axis_index("wg"), cta=lax.axis_index("cta"),
             **statics)
  pl.when(cta.wg < cta.consumers)(lambda: _decode_consumer(cta))
  pl.when(cta.wg == cta.consumers)(lambda: _decode_producer(cta))


def max_stages(head_dim: int, block_k: int, itemsize: int,
               consumers: int = 1, q_buffers: int = 2) -> int:
  """K/V tiles in flight that fit one CTA's shared memory beside the Q
  buffers, each consumer's f32 output tile and logsumexp and the barriers,
  rounded down to a multiple of `consumers` (each takes every
  consumers-th slot)."""
  fixed = (config.aligned(q_buffers * DECODE_ROWS * head_dim * itemsize)
           + config.aligned(consumers * DECODE_ROWS * head_dim * 4)
           + config.aligned(consumers * DECODE_ROWS * 4)
           + 1024)  # The barriers' allocation.
  per_stage = 2 * config.aligned(block_k * head_dim * itemsize)
  stages = (config.SMEM_BYTES - fixed) // per_stage
  return stages - stages % consumers


def _scratch(dtype, k_dtype, v_dtype, head_dim: int, block_k: int,
             stages: int, q_buffers: int, consumers: int) -> dict:
  """The decode kernel's shared memory (Q buffers, the K/V ring, each
  consumer's output and logsumexp) and barriers."""
  transforms = smem_transforms(dtype, head_dim)
  return dict(
      buffers=(
          plgpu.SMEM((q_buffers, DECODE_ROWS, head_dim), dtype,
                     transforms=transforms),
          plgpu.SMEM((stages, block_k, head_dim), k_dtype,
                     transforms=transforms),
          plgpu.SMEM((stages, block_k, head_dim), v_dtype,
                     transforms=smem_transforms(v_dtype, head_dim,
                                                block_k)),
          plgpu.SMEM((consumers, DECODE_ROWS, head_dim), jnp.float32,
                     transforms=smem_transforms(jnp.float32, head_dim)),
          plgpu.SMEM((consumers, DECODE_ROWS), jnp.float32),
      ),
      ready=(plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=q_buffers)),
      free=(plgpu.Barrier(num_barriers=stages),) * 2 + (
          plgpu.Barrier(num_arrivals=consumers, num_barriers=q_buffers),),
  )


def flash_decode(q, k_cache, v_cache, kv_lengths, *, scores: Scores,
                 mask: Mask, block_k: int = DECODE_BLOCK_K, num_stages: int = 4,
                 heads_per_cta: int = 1, consumers: int = 1,
                 num_ctas: int | None = None, sinks=None):
  """Decode attention of q [B, T, N, H] against a contiguous cache k_cache,
  v_cache [B, S, K, H] (bf16/fp16, S a multiple of 8, H one of the Mosaic
  kernels' head dims), each sequence's first kv_lengths[b] positions;
  `mask` the band (causal, a left window) of queries at positions
  kv_lengths[b] - T + t; sinks float32 [N] or None; num_stages K/V tiles
  in flight, at most as many as fit shared memory. heads_per_cta: 1 (a
  tile one KV head's; G * T <= 64 for G = N / K) or K (a tile every KV
  head's block_k / K positions, contiguous in the cache; N * T <= 64 and K
  dividing block_k). consumers: 1 or 2 consumer warpgroups a CTA, taking
  alternate tiles (each its own partial output). num_ctas: the CTAs
  (default: the GPU's multiprocessors).
  Returns (out [B, T, N, H] in q.dtype, lse [B, N, T] natural log)."""
  batch, q_len, num_heads, head_dim = q.shape
  cache_len, num_kv_heads = k_cache.shape[1:3]
  group = num_heads // num_kv_heads
  heads = heads_per_cta
  rows = heads * group * q_len
  if heads not in (1, num_kv_heads) or block_k % heads:
    raise ValueError(f"heads_per_cta must be 1 or the KV heads ("
                     f"{num_kv_heads}) dividing block_k ({block_k}), got "
                     f"{heads}")
  if consumers not in (1, 2):
    raise ValueError(f"consumers must be 1 or 2, got {consumers}")
  if cache_len % 8:
    raise ValueError(f"the Mosaic decode kernel needs the cache's length a "
                     f"multiple of 8 (TMA's row tiles), got {cache_len}")
  if rows > DECODE_ROWS:
    raise ValueError(f"the Mosaic decode kernel takes at most {DECODE_ROWS} query "
                     f"rows a CTA (heads_per_cta * G * T), got {rows}")
  # Rows of Q read and of each part written: a multiple of TMA's 8-row
  # tiles (at most DECODE_ROWS).
  out_rows = -(-rows // 8) * 8
  # [B, T, N, H] -> [B, N, T, H] -> [B, K / heads, heads * G * T, H]: row
  # (h * G + g) * T + t (free at T = 1), padded to out_rows (a copy only if
  # the rows are not a multiple of 8).
  head_groups = num_kv_heads // heads
  qr = q.transpose(0, 2, 1, 3).reshape(batch, head_groups, rows, head_dim)
  qr = pad_to(qr, 2, out_rows)
  if heads > 1:  # [B, S * K, H]: row p * K + h (free: the cache's order).
    k_cache = k_cache.reshape(batch, cache_len * heads, head_dim)
    v_cache = v_cache.reshape(batch, cache_len * heads, head_dim)
  positions = block_k // heads
  tiles = pl.cdiv(cache_len, positions)
  groups = batch * head_groups
  bounds, segments, owners, crossed = stream_k(
      groups, tiles, num_ctas or num_multiprocessors())
  ctas, width = len(bounds) - 1, crossed.shape[1]
  # Two Q buffers (the next segment's Q loads early) where a run crosses
  # groups and the second costs no stage asked for (it does at head dim
  # 256).
  fits = max_stages(head_dim, block_k, q.dtype.itemsize, consumers, 1)
  fits_two = max_stages(head_dim, block_k, q.dtype.itemsize, consumers, 2)
  q_buffers = 2 if segments > 1 and fits_two >= min(num_stages, fits) else 1
  fits = fits_two if q_buffers == 2 else fits
  if fits < consumers:
    raise ValueError(f"{consumers} consumers' outputs, Q and {consumers} K/V "
                     f"tiles of {block_k} rows at head dim {head_dim} exceed "
                     f"shared memory ({config.SMEM_BYTES} bytes)")
  num_stages = max(consumers, min(num_stages, fits))
  num_stages -= num_stages % consumers
  scratch = _scratch(q.dtype, k_cache.dtype, v_cache.dtype, head_dim,
                     block_k, num_stages, q_buffers, consumers)
  kernel = functools.partial(
      _decode_kernel, scores=scores, mask=mask, q_len=q_len, heads=heads,
      group=group, block_k=block_k, stages=num_stages, consumers=consumers,
      segments=segments, segment=functools.partial(
          _segment, groups=groups, head_groups=head_groups, tiles=tiles,
          positions=positions))
  o, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(
          (groups, width, consumers, out_rows, head_dim), jnp.float32),
                jax.ShapeDtypeStruct(
                    (groups, width, consumers, out_rows), jnp.float32)),
      scratch_types=scratch,
      grid=(ctas,),
      grid_names=("cta",),
      num_threads=consumers + 1,
      thread_name="wg",
      # The row reductions stay within a warp, as the forward's.
      compiler_params=compiler_params(reduction_scratch=False),
      kernel_name="flash_attention_decode_mosaic",
  )(qr, k_cache, v_cache, kv_lengths.astype(jnp.int32), jnp.asarray(bounds),
    jnp.asarray(owners))
  # A group's parts [B, K / heads, M * consumers, R(, H)], the unwritten
  # ones emptied (o 0, lse -inf); its rows are its heads' in order, so the
  # merge takes them as one group of heads * G heads.
  parts = width * consumers
  written = np.repeat(crossed, consumers, axis=1).reshape(
      batch, head_groups, parts, 1)
  o = jnp.where(written[..., None], o.reshape(
      batch, head_groups, parts, out_rows, head_dim), 0.0)
  lse = jnp.where(written, lse.reshape(batch, head_groups, parts, out_rows),
                  -jnp.inf)
  return softmax.merge_split_kv(o, lse, q_len=q_len, group=heads * group,
                                dtype=q.dtype, sinks=sinks)
