"""Per-program view of the mask and score modifications, for the Triton kernels.

Every kernel (forward v2 and v1, dK/dV, dQ, dBias) sees one (query tile, key
tile) pair at a time. `TileContext` holds the refs of the optional operands
(an `Operands` of refs, and the id-range table) and answers the questions each
kernel asks: which key (or query) tiles to visit, what the logits of a tile
are, which of its entries are visible, which survive dropout. The math is in
the backend-neutral `jax_flash.core`; this module only loads tiles.

Tiles are [queries, keys] in the forward and dQ kernels and [keys, queries]
(`transposed=True`) in the dK/dV kernel.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.core import dropout
from jax_flash.core import mask as mask_lib
from jax_flash.core.mods import ArrayReader
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores
from pallas_kernels.triton.tiles import load_ids, load_table_row


def _transpose(x):
  if x.ndim < 2:
    return x
  if x.shape[0] == 1 or x.shape[1] == 1:
    return x.reshape(x.shape[::-1])
  return x.T


def _load_pair_tile(ref, head, q_start, block_q, k_start, block_k, q_len,
                    kv_len, other):
  """A [block_q, block_k]-broadcastable tile of a [(G,) Tm, Sm] ref.

  Tm is 1 (broadcast over queries) or q_len; Sm is 1 or kv_len.
  """
  lead = (head,) if ref.ndim == 3 else ()  # [G, Tm, Sm]: one head of a group.
  tm, sm = ref.shape[-2:]
  zero = jnp.int32(0)  # A traced index: the interpreter rejects a Python int.
  row_idx = pl.ds(zero + q_start, block_q) if tm > 1 else zero
  col_idx = pl.ds(zero + k_start, block_k) if sm > 1 else zero
  mask = None
  if tm > 1:
    mask = (q_start + jnp.arange(block_q) < q_len)
  if sm > 1:
    cols_ok = k_start + jnp.arange(block_k) < kv_len
    mask = cols_ok if mask is None else (mask[:, None] & cols_ok[None, :])
  view = ref.at[lead + (row_idx, col_idx)]
  if mask is None:
    return plgpu.load(view).reshape(1, 1)
  tile = plgpu.load(view, mask=mask, other=other)
  if tm > 1 and sm > 1:
    return tile
  return tile[:, None] if tm > 1 else tile[None, :]


@dataclasses.dataclass
class TileContext:
  """What one program knows about the mask and the scores (see module doc)."""
  mask: mask_lib.Mask
  scores: Scores
  refs: Operands  # Of refs (None where absent).
  id_table: Any  # Ref of the id-range table, or None.
  q_len: int
  kv_len: int
  block_q: int
  block_k: int
  batch: Any = None  # This program's batch index (dropout, offsets).
  # This program's query head; with a GQA group per program (dK/dV), its
  # first head, and methods take `head` within the group (a mask_mod's h).
  query_head: Any = None
  transposed: bool = False

  def __post_init__(self):
    # The position of this sequence's first query (read once, outside the
    # loops, as the interpreter wants).
    self.q_offset = 0
    if self.mask.has_q_offsets:
      self.q_offset = self.refs.q_offsets[self.batch]

  def kv_ranges(self, q_tile, q_start):
    """Key tiles of query tile `q_tile`: (lo, full_lo, full_hi, hi)."""
    ranges = mask_lib.kv_block_ranges(self.mask, q_start, self.block_q,
                                      self.block_k, self.kv_len, self.q_offset)
    return self._refine(ranges, q_tile)

  def q_ranges(self, kv_tile, kv_start):
    """Query tiles of key tile `kv_tile` (dK/dV, FlashAttention-1)."""
    ranges = mask_lib.q_block_ranges(self.mask, kv_start, self.block_k,
                                     self.block_q, self.q_len, self.q_offset)
    return self._refine(ranges, kv_tile)

  def _refine(self, ranges, tile):
    if self.mask.has_table:
      ranges = mask_lib.intersect_ranges(
          ranges, load_table_row(self.id_table, tile))
    return mask_lib.without_full_tiles(self.mask, ranges)

  @staticmethod
  def visit(ranges, body, carry):
    """Runs `body(j, carry, masked=...)` over the tiles j of `ranges` (lo,
    full_lo, full_hi, hi): masked=True on the boundary tiles, which evaluate
    the mask predicate, False on the interior ones, which skip it."""
    lo, full_lo, full_hi, hi = ranges
    for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                                (full_hi, hi, True)):
      carry = lax.fori_loop(start, stop,
                            functools.partial(body, masked=masked), carry)
    return carry

  def slope(self, head):
    """ALiBi slope of query head `head` (index into this program's slopes)."""
    return self.refs.alibi_slopes[head] if self.scores.alibi else None

  def _coords(self, q_start, k_start):
    rows = q_start + jnp.arange(self.block_q)
    cols = k_start + jnp.arange(self.block_k)
    if self.transposed:
      return rows[None, :], cols[:, None]
    return rows[:, None], cols[None, :]

  def _positions(self, q_start, k_start):
    """`_coords` with the rows at their queries' positions (the offset
    added): what ALiBi, the mods and dropout's bits see."""
    rows, cols = self._coords(q_start, k_start)
    if self.mask.has_q_offsets:
      rows = rows + self.q_offset
    return rows, cols

  def _pair_tile(self, ref, head, q_start, k_start, other):
    tile = _load_pair_tile(ref, head, q_start, self.block_q,
                           k_start, self.block_k, self.q_len, self.kv_len,
                           other)
    return _transpose(tile) if self.transposed else tile

  def logits2(self, qk, q_start, k_start, *, head=None, slope=None):
    """Base-2 logits of a tile of raw scores, and the soft-cap tanh (or None).

    `head` picks the query head in refs holding a whole GQA group (dK/dV).
    """
    if self.scores.plain:
      return self.scores.logits2(qk)
    rows, cols = self._positions(q_start, k_start)
    bias = None
    if self.scores.bias:
      bias = self._pair_tile(self.refs.bias, head, q_start, k_start, 0.0)
      bias = bias.astype(jnp.float32)
    return self.scores.logits2(
        qk, rows, cols, slope, bias, self.batch, self._query_head(head),
        mod_consts=tuple(map(ArrayReader.of_ref,
                             self.refs.score_consts or ())))

  def _query_head(self, head):
    """The global query head of `head` (within this program's group)."""
    return self.query_head if head is None else self.query_head + head

  def visible(self, q_start, k_start, *, q_ids=None, kv_ids=None, head=None):
    """Boolean tile: which (query, key) pairs attend."""
    rows, cols = self._coords(q_start, k_start)
    if self.mask.has_ids:
      if q_ids is None:
        q_ids = self.q_ids(q_start)
      if kv_ids is None:
        kv_ids = self.kv_ids(k_start)
    ok = self.mask.visible(rows, cols, self.kv_len, q_ids, kv_ids,
                           self.q_offset, self.batch, self._query_head(head),
                           mod_consts=tuple(map(ArrayReader.of_ref,
                                                self.refs.mask_consts or ())))
    if self.mask.has_dense:
      ok = jnp.logical_and(
          ok, self._pair_tile(self.refs.dense_mask, head, q_start, k_start,
                              0) != 0)
    return ok

  def dropped(self, x, q_start, k_start, head):
    """x * keep / (1 - rate): dropout applied to a tile of P or dP, for
    query head `head` (a global head index)."""
    if not self.scores.dropout:
      return x
    seed = self.refs.dropout_seed
    rows, cols = self._positions(q_start, k_start)
    batch = self.batch
    if self.scores.dropout_broadcast:
      batch = head = 0
    return dropout.dropped(x, seed, self.scores.dropout_rate,
                           jnp.asarray(batch, jnp.int32),
                           jnp.asarray(head, jnp.int32),
                           rows.astype(jnp.int32), cols.astype(jnp.int32))

  def q_ids(self, q_start):
    ids = load_ids(self.refs.q_ids, q_start, self.block_q,
                   bound=self.q_len, pad_id=mask_lib.Q_PAD_ID)
    return ids[None, :] if self.transposed else ids[:, None]

  def kv_ids(self, k_start):
    ids = load_ids(self.refs.kv_ids, k_start, self.block_k,
                   bound=self.kv_len, pad_id=mask_lib.KV_PAD_ID)
    return ids[:, None] if self.transposed else ids[None, :]

  def without_padding(self, tile, start, *, keys: bool):
    """tile ([rows, Hp], rows from `start`) with the rows at or past their
    sequence's length zeroed: padding may hold anything (NaN, inf), and
    0 * NaN would reach a result. Without lengths (no ids) nothing runs."""
    if not self.mask.has_ids:
      return tile
    if keys:
      ref, size, bound, pad = (self.refs.kv_ids, self.block_k, self.kv_len,
                               mask_lib.KV_PAD_ID)
    else:
      ref, size, bound, pad = (self.refs.q_ids, self.block_q, self.q_len,
                               mask_lib.Q_PAD_ID)
    ids = load_ids(ref, start, size, bound=bound, pad_id=pad)
    return jnp.where((ids != pad)[:, None], tile, jnp.zeros_like(tile))
