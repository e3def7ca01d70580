"""BlockSpecs of the optional operands for each grid layout of the Triton kernels.

Three layouts: (query tile, batch, head) for the forward, dQ and dBias
kernels; (key tile, batch, kv head) for dK/dV, whose programs see a whole GQA
group of query heads, so per-query-head operands come as [G, ...] blocks;
and (batch, head) for the FlashAttention-1 forward. Every array is passed
whole per (batch, head): kernels load their tiles from it.

Alongside the operands goes the tile-range table when the mask has one
(`mask.id_block_table` of the ids, `mask.kinds_block_table` of tile kinds,
both intersected): for each row tile, the column tiles to visit.
"""
from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from jax_flash.core import mask as mask_lib
from jax_flash.core.operands import Operands


@dataclasses.dataclass(frozen=True)
class KernelOperands:
  """What a launcher passes after Q, K, V: the operands, their BlockSpecs,
  and the id-range table with its BlockSpec (None without ids)."""
  operands: Operands
  specs: Operands
  id_table: object = None
  id_table_spec: object = None

  def args(self):
    return (self.operands, self.id_table)

  def in_specs(self):
    return [self.specs, self.id_table_spec]


def _build(operands: Operands, batch_head, group: int | None, table):
  """BlockSpecs for a grid whose program indices map to (batch, head) by
  `batch_head`; `group` set: the head is a kv head owning `group` query
  heads."""
  def ids(x):
    return pl.BlockSpec((None, x.shape[1]),
                        lambda *g: (batch_head(*g)[0], 0))

  def pair(x):
    bm, nm, tm, sm = x.shape

    def index(*g):
      b, n = batch_head(*g)
      return (b if bm > 1 else 0, n if nm > 1 else 0, 0, 0)
    heads = group if group is not None and nm > 1 else None
    return pl.BlockSpec((None, heads, tm, sm), index)

  def slopes(x):
    if group is not None:
      return pl.BlockSpec((None, group), lambda *g: batch_head(*g))
    return pl.BlockSpec((None, x.shape[1]), lambda *g: (batch_head(*g)[0], 0))

  def whole(x):  # The seed, the sinks, the offsets, a mod's arrays.
    return pl.BlockSpec(x.shape, lambda *g: (0,) * x.ndim)

  def wholes(xs):
    return tuple(whole(x) for x in xs)

  make = dict(q_ids=ids, kv_ids=ids, dense_mask=pair, bias=pair,
              alibi_slopes=slopes, dropout_seed=whole, sinks=whole,
              q_offsets=whole, mask_consts=wholes, score_consts=wholes)
  specs = Operands(**{
      f.name: None if getattr(operands, f.name) is None else
      make[f.name](getattr(operands, f.name))
      for f in dataclasses.fields(Operands)})
  table_spec = None
  if table is not None:
    per_batch = table.shape[0] > 1  # A mask_mod's table may broadcast.
    table_spec = pl.BlockSpec(
        (None,) + table.shape[1:],
        lambda *g: (batch_head(*g)[0] if per_batch else 0, 0, 0))
  return KernelOperands(operands, specs, table, table_spec)


def _table(operands: Operands, mask: mask_lib.Mask, block_q: int,
           block_k: int, q_len: int, kv_len: int, *, by_keys: bool):
  """(the operands the kernels read, the tile-range table or None): rows of
  the table are query tiles, or key tiles with by_keys."""
  blocks = (block_k, block_q) if by_keys else (block_q, block_k)
  tables = []
  if operands.q_ids is not None:
    rows, cols = ((operands.kv_ids, operands.q_ids) if by_keys else
                  (operands.q_ids, operands.kv_ids))
    tables.append(mask_lib.id_block_table(rows, cols, *blocks))
  if operands.tile_kinds is not None:
    tables.append(mask_lib.kinds_block_table(
        operands.tile_kinds, mask, *blocks, q_len, kv_len,
        transposed=by_keys))
  return (dataclasses.replace(operands, tile_kinds=None),
          mask_lib.intersect_tables(tables))


def for_query_tiles(operands: Operands, mask: mask_lib.Mask, block_q: int,
                    block_k: int, q_len: int, kv_len: int) -> KernelOperands:
  """Grid (query tile, batch, head); the table lists key tiles per query tile."""
  operands, table = _table(operands, mask, block_q, block_k, q_len, kv_len,
                           by_keys=False)
  return _build(operands, lambda i, b, n: (b, n), None, table)


def for_key_tiles(operands: Operands, mask: mask_lib.Mask, block_q: int,
                  block_k: int, q_len: int, kv_len: int,
                  group: int) -> KernelOperands:
  """Grid (key tile, batch, kv head); per-query-head operands as the group's
  [G, ...] heads; the table lists query tiles per key tile."""
  operands, table = _table(operands, mask, block_q, block_k, q_len, kv_len,
                           by_keys=True)
  return _build(operands, lambda j, b, h: (b, h), group, table)


def for_heads(operands: Operands, mask: mask_lib.Mask, block_q: int,
              block_k: int, q_len: int, kv_len: int) -> KernelOperands:
  """Grid (batch, head), key tiles in the outer loop (FlashAttention-1)."""
  operands, table = _table(operands, mask, block_q, block_k, q_len, kv_len,
                           by_keys=True)
  return _build(operands, lambda b, n: (b, n), None, table)
