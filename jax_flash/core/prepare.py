"""From the public arguments to one description of the attention problem.

`prepare` checks a call's `Options` against its shapes at trace time and
returns a `Spec`: the shapes (`Problem`), the static mask (`Mask`) and
score modifications (`Scores`), and the optional arrays (`Operands`).
`flash_attention`, `reference_attention`, `ring_attention` and every
backend read this one description.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash.core import checks, dropout
from jax_flash.core.mask import (DENSE_KINDS_TILE, KV_PAD_ID, Q_PAD_ID, Mask,
                                 dense_tile_kinds, make_ids)
from jax_flash.core.operands import Operands
from jax_flash.core.options import Options
from jax_flash.core.problem import Problem, Spec
from jax_flash.core.scores import Scores


def prepare(query, key, value, options: Options | None = None,
            **arguments) -> Spec:
  """The Spec of a call (operands batched: [B, ...] even for unbatched
  inputs): its `Options`, or those `Options(**arguments)` builds, with
  every array checked against the call's shapes."""
  o = Options(**arguments) if options is None else options
  p = checks.check_qkv(query, key, value)
  scale = checks.check_scale(o.scale, p.head_dim)
  q_lengths = checks.check_lengths(o.query_seq_lengths, "query_seq_lengths",
                                   p)
  kv_lengths = checks.check_lengths(o.key_value_seq_lengths,
                                    "key_value_seq_lengths", p)
  segments = checks.check_segment_ids(o.segment_ids, p)
  left, right = checks.check_window(o.local_window_size)
  bias = checks.check_pair_array(o.bias, "bias", p, boolean=False)
  dense = checks.check_pair_array(o.mask, "mask", p, boolean=True)
  cap = checks.check_soft_cap(o.logits_soft_cap)
  slopes = checks.check_alibi_slopes(o.alibi_slopes, p)
  rate = checks.check_dropout(o.dropout_rate, o.dropout_rng)
  sinks = checks.check_sinks(o.sinks, p)
  offsets = checks.check_query_offset(o.query_offset, p)
  q_ids, kv_ids = make_ids(
      p.batch, p.q_len, p.kv_len,
      q_segment_ids=None if segments is None else segments[0],
      kv_segment_ids=None if segments is None else segments[1],
      q_lengths=q_lengths, kv_lengths=kv_lengths)
  mask_spec = Mask(is_causal=bool(o.is_causal), window_left=left,
                   window_right=right, has_ids=q_ids is not None,
                   segments_only=(segments is not None and q_lengths is None
                                  and kv_lengths is None),
                   has_dense=dense is not None,
                   has_q_offsets=offsets is not None)
  scores = Scores(scale=scale, soft_cap=cap, alibi=slopes is not None,
                  bias=bias is not None, dropout_rate=rate,
                  dropout_broadcast=bool(o.dropout_broadcast) and rate > 0,
                  sinks=sinks is not None, fp8=o.fp8_kind)
  operands = Operands(
      q_ids=q_ids, kv_ids=kv_ids,
      dense_mask=None if dense is None else dense.astype(jnp.int8),
      bias=bias,
      # ALiBi slopes are constants here: no gradient flows to them.
      alibi_slopes=None if slopes is None else jax.lax.stop_gradient(slopes),
      dropout_seed=dropout.seed_words(o.dropout_rng) if rate > 0 else None,
      sinks=sinks, q_offsets=offsets)
  return Spec(p, mask_spec, scores, operands)


def masks_as_ids(spec: Spec) -> Spec:
  """`spec` with a dense mask that varies along one sequence axis only
  (shape [Bm, 1, T, 1] or [Bm, 1, 1, S]: padding masks) folded into the
  query or key ids: a masked row or column gets the id that matches nothing
  (`mask.Q_PAD_ID` / `KV_PAD_ID`). Same attention: a query sees a key iff
  both the ids and the mask allow it. What the kernels gain: tile ranges
  from the id table (tiles of masked keys skipped, the rest spared the
  predicate) instead of a mask tile read for every tile, and masked
  positions zeroed (NaN there reaches nothing). Other masks unchanged."""
  dense = spec.operands.dense_mask
  if dense is None or dense.shape[1] != 1 or (dense.shape[2] > 1 and
                                              dense.shape[3] > 1):
    return spec
  p = spec.problem
  ops = spec.operands
  q_ids, kv_ids = ops.q_ids, ops.kv_ids
  if q_ids is None:  # One segment: the mask alone hides rows or columns.
    q_ids = jnp.zeros((p.batch, p.q_len), jnp.int32)
    kv_ids = jnp.zeros((p.batch, p.kv_len), jnp.int32)
  visible = dense != 0
  if dense.shape[3] == 1:  # Per query (or one value): the rows.
    rows = jnp.broadcast_to(visible[:, 0, :, 0], (p.batch, p.q_len))
    q_ids = jnp.where(rows, q_ids, Q_PAD_ID)
  else:  # Per key: the columns.
    cols = jnp.broadcast_to(visible[:, 0, 0, :], (p.batch, p.kv_len))
    kv_ids = jnp.where(cols, kv_ids, KV_PAD_ID)
  return Spec(p, dataclasses.replace(spec.mask, has_ids=True,
                                     segments_only=False, has_dense=False),
              spec.scores, dataclasses.replace(ops, q_ids=q_ids,
                                               kv_ids=kv_ids,
                                               dense_mask=None))


def with_dense_kinds(spec: Spec) -> Spec:
  """`spec` with its dense mask's tile kinds (`mask.dense_tile_kinds`, read
  from the mask: one pass over it) as the kinds table of the call, so the
  kernels skip the mask's empty tiles and spare its full ones the mask
  tile's load. Without a dense mask, or with another kinds table, `spec`."""
  dense = spec.operands.dense_mask
  if dense is None or spec.mask.has_kinds:
    return spec
  p = spec.problem
  kinds = dense_tile_kinds(dense, p.q_len, p.kv_len)
  tiles = (DENSE_KINDS_TILE, DENSE_KINDS_TILE)
  return Spec(p, dataclasses.replace(spec.mask, mod_tiles=tiles), spec.scores,
              dataclasses.replace(spec.operands, tile_kinds=kinds))


def prepare_decode(mask: Mask, q_len: int, kv_len: int, kv_lengths,
                   sinks=None) -> tuple[Mask, Operands]:
  """The decode problem as the training one: queries at positions
  kv_lengths[b] - T + t (query offsets), keys past kv_lengths[b] hidden (key
  ids). Returns the mask with ids and offsets, and its operands."""
  batch = kv_lengths.shape[0]
  q_ids, kv_ids = make_ids(batch, q_len, kv_len, kv_lengths=kv_lengths)
  mask = dataclasses.replace(mask, has_ids=True, has_q_offsets=True)
  offsets = (kv_lengths - q_len).astype(jnp.int32)
  return mask, Operands(q_ids=q_ids, kv_ids=kv_ids, q_offsets=offsets,
                        sinks=sinks)


def decode_as_forward(q, k, v, kv_lengths, mask: Mask, page_table=None,
                      sinks=None):
  """A decode call as a training forward problem (what a backend's `decode`
  runs for a prompt chunk): (k, v, mask, operands, problem), a paged cache
  first gathered into a contiguous one by XLA (a copy, linear in its
  length), the mask and operands of `prepare_decode`."""
  if page_table is not None:
    k, v = gather_pages(k, page_table), gather_pages(v, page_table)
  mask, operands = prepare_decode(mask, q.shape[1], k.shape[1], kv_lengths,
                                  sinks)
  problem = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                           k.shape[2], q.shape[3], False, v.shape[3])
  return k, v, mask, operands, problem


def gather_pages(pages, page_table):
  """A paged cache [num_pages, page_size, K, H] and its page table
  [B, pages_per_seq] as a contiguous cache [B, pages_per_seq * page_size,
  K, H] (one gather: a copy of the cache)."""
  batch = page_table.shape[0]
  return pages[page_table].reshape((batch, -1) + pages.shape[2:])
