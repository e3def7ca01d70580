"""The per-device functions of the strategies, each built as
`lowering(cfg, split, p) -> run(*arrays)` from the function it runs on a
device's part of the call and the Shardy factors of its arrays and results
("b t n h": `partition`): `heads` (all_to_all), `gather` (all_gather) and
`ring`."""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jax_flash.context_parallel.collectives import (
    from_zigzag, in_turn, localize, moved, to_zigzag, unzigzag_whole,
    zigzag_whole)
from jax_flash.context_parallel.plan import Split
from jax_flash.core.mask import dense_tile_kinds
from jax_flash.core.operands import Operands


def heads(fn, in_factors, out_factors, seq, p: int, kv_repeats: int = 1):
  """all_to_all's per-device function over mesh axes `seq` (P = `p`
  devices): fn(*arrays) on the whole sequence of 1 / P of the heads, each
  array moved there from this device's sequence chunk of every head and
  each result back (`localize`), one after another (`in_turn`). Arrays
  with a KV-head factor ("k") are sent as `kv_repeats` copies of each head
  (`plan.kv_repeats`), and results with one summed over the copies."""
  def to_heads(x, factors):
    axis = _axis(factors, "k")
    if kv_repeats > 1 and axis is not None:
      x = jnp.repeat(x, kv_repeats, axis=axis)
    return localize(x, factors, seq, p, True)

  def from_heads(y, factors):
    y = localize(y, factors, seq, p, False)
    axis = _axis(factors, "k")
    if kv_repeats > 1 and axis is not None:
      copies = y.reshape(y.shape[:axis] + (-1, kv_repeats)
                         + y.shape[axis + 1:])
      y = copies.astype(jnp.float32).sum(axis + 1).astype(y.dtype)
    return y

  def moves(move, factors):
    return [functools.partial(move, factors=f) for f in factors]

  def run(*arrays):
    outs = fn(*in_turn(moves(to_heads, in_factors), arrays))
    return tuple(in_turn(moves(from_heads, out_factors), outs))
  return run


def _query_parts(split: Split, p, rows, arrays, axes):
  """[(offset, arrays' parts)]: this device's queries (and the per-query
  arrays, each with its sequence axis in `axes`) with the position of
  their first row, as one chunk or as its balanced halves."""
  seq = split.seq
  d = lax.axis_index(seq)
  if not split.balanced:
    return [(d * rows, tuple(arrays))]
  half = rows // 2
  parts = [to_zigzag(x, axis, seq, p) for x, axis in zip(arrays, axes)]
  return [(d * half, tuple(x[0] for x in parts)),
          ((2 * p - 1 - d) * half, tuple(x[1] for x in parts))]


def _join_queries(split: Split, p, parts, axes):
  """The inverse of `_query_parts` for outputs per query: [(arrays)]."""
  if not split.balanced:
    return parts[0]
  return tuple(from_zigzag(lo, hi, axis, split.seq, p)
               for lo, hi, axis in zip(*parts, axes))


def _offsets(q, offset):
  return jnp.full((q.shape[0],), offset, jnp.int32)


def _axis(factors: str, name: str):
  names = factors.split()
  return names.index(name) if name in names else None


def gather(chunk, in_factors, out_factors):
  """all_gather's per-device function, (cfg, split, p) -> run(*arrays):
  chunk(*arrays, q_offsets, cfg) on this device's queries (the arrays
  with a "t" factor; as balanced halves when causal) against the whole
  of the arrays with an "s" factor (K, V, key ids: gathered). Results per
  query are joined back; the others (dK, dV, the sinks' gradient) are
  partials over this device's queries, summed in float32 across the
  devices: reduce-scattered back to key chunks where they have an "s"
  factor and the keys are split, else summed whole."""
  queries = [i for i, f in enumerate(in_factors) if "t" in f.split()]
  joined = [j for j, f in enumerate(out_factors) if "t" in f.split()]

  def lowering(cfg, split: Split, p):
    def run(*arrays):
      arrays = list(arrays)
      if split.kv_seq:  # Per-pair arrays arrive with every key.
        for i, f in enumerate(in_factors):
          if _axis(f, "s") is not None and _axis(f, "t") is None:
            arrays[i] = moved(lax.all_gather, arrays[i], split.seq,
                              axis=_axis(f, "s"), tiled=True)
      results = []
      for offset, part in _query_parts(
          split, p, arrays[0].shape[1], [arrays[i] for i in queries],
          [_axis(in_factors[i], "t") for i in queries]):
        local = list(arrays)
        for i, x in zip(queries, part):
          local[i] = x
        results.append(chunk(*local, _offsets(arrays[0], offset), cfg))
      outs = dict(zip(joined, _join_queries(
          split, p, [tuple(r[j] for j in joined) for r in results],
          [_axis(out_factors[j], "t") for j in joined])))
      for j, f in enumerate(out_factors):
        if j in outs:
          continue
        total = sum(r[j].astype(jnp.float32) for r in results)
        if split.kv_seq and _axis(f, "s") is not None:
          total = lax.psum_scatter(total, split.seq,
                                   scatter_dimension=_axis(f, "s"),
                                   tiled=True)
        else:
          total = lax.psum(total, split.seq)
        outs[j] = total.astype(results[0][j].dtype)
      return tuple(outs[j] for j in range(len(out_factors)))
    return run
  return lowering


def ring(ring_fn, in_factors, out_factors):
  """ring's per-device function, (cfg, split, p) -> run(*arrays): the
  arrays along the sequence (a "t" or "s" factor) moved into the balanced
  layout when causal, ring_fn(*arrays, seq, p, cfg) run, its results moved
  back; a result with neither factor (the sinks' gradient, a partial over
  this device's queries) summed across the devices."""
  def lowering(cfg, split: Split, p):
    seq = split.seq

    def axis(factors):
      t = _axis(factors, "t")
      return t if t is not None else _axis(factors, "s")

    def run(*arrays):
      if split.balanced:
        arrays = [x if axis(f) is None else
                  zigzag_whole(x, axis(f), seq, p)
                  for x, f in zip(arrays, in_factors)]
      outs = ring_fn(*arrays, seq, p, cfg)
      return tuple(
          lax.psum(y, seq) if axis(f) is None else
          unzigzag_whole(y, axis(f), seq, p) if split.balanced else y
          for y, f in zip(outs, out_factors))
    return run
  return lowering


def at_offsets(operands: Operands, offsets, q, k) -> Operands:
  """`operands` of a query chunk at `offsets` (all_gather's; added to the
  call's own query offsets): with a dense mask (its rows the chunk's), the
  tile kinds of those rows."""
  if operands.q_offsets is not None:
    offsets = offsets + operands.q_offsets
  operands = dataclasses.replace(operands, q_offsets=offsets)
  if operands.dense_mask is None:
    return operands
  return dataclasses.replace(operands, tile_kinds=dense_tile_kinds(
      operands.dense_mask, q.shape[1], k.shape[1]))
