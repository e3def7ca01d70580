"""Which (query, key) pairs attend, and which tiles must evaluate that predicate.

Backend-neutral: plain `jnp`/`lax`, so every kernel backend and the reference
read this one description. Key column `j` is in [0, kv_len); query row `i`
sits at position `i + q_offset`: 0 in training, and in decoding or a chunked
prefill the number of cached positions before the new queries (a dynamic
value, one per sequence, e.g. `kv_lengths[b] - q_len`). Every function that
takes rows takes that offset.

A mask has a static part, a band of columns around each position p = i + q_offset,

    row i sees columns j with  p - left <= j <= p + right

(`is_causal` sets right = 0, aligned top-left as in jax.nn when the offset is
0; a local window sets left and right; None means unbounded), and an optional
dynamic part, per-row and per-column integer ids: row i sees column j only if
`q_ids[i] == kv_ids[j]`. Ids carry packed-segment ids and sequence lengths
(rows past a query length and columns past a key length get sentinel ids that
match nothing). For q_len=3, kv_len=5, causal, offset 0 (and offset 2, the
last three positions of a 5-token cache)::

    1 0 0 0 0          1 1 1 0 0
    1 1 0 0 0          1 1 1 1 0
    1 1 1 0 0          1 1 1 1 1

A user's mask_mod (flex attention, `mod`: `mod(b, h, q_idx, kv_idx)`, h the
query head) joins the predicate; its tiles' kinds (empty, partial, full, from
`create_block_mask`) come as a table (`Operands.tile_kinds`, of `mod_tiles`
tiles). A dense mask's kinds come the same way (`dense_tile_kinds`, read
from the mask on every call): its empty tiles are skipped and its full
ones spared the mask tile's load.

Tiles are classified into skipped (never loaded), fully visible (no predicate)
and partial (predicate evaluated), from the band statically and from per-block
id ranges or tile kinds dynamically.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

# Ids of rows past a query length / columns past a key length: they match
# nothing, not even each other. User ids must be larger.
Q_PAD_ID = int(np.iinfo(np.int32).min)
KV_PAD_ID = Q_PAD_ID + 1


@dataclasses.dataclass(frozen=True)
class Mask:
  """Static description of the attention mask (hashable: a jit static)."""
  is_causal: bool = False
  window_left: int | None = None
  window_right: int | None = None
  has_ids: bool = False  # Per-row / per-column ids (segments, lengths).
  # The ids are segment ids alone (no lengths, no padding mask): no position
  # is padding, so none needs zeroing (`without_padding`).
  segments_only: bool = False
  # Per-sequence query offsets (`Operands.q_offsets`): decode, chunked
  # prefill. Without them every offset is 0.
  has_q_offsets: bool = False
  # A dense boolean mask read tile by tile (its predicate is the caller's:
  # `visible` covers the band and the ids).
  has_dense: bool = False
  # A user's mask_mod (`mods.ElementwiseMod`), and the (rows, columns) of the
  # tiles a kinds table (`Operands.tile_kinds`: the mask_mod's, or the
  # dense mask's) classifies.
  mod: Callable | None = None
  mod_tiles: tuple[int, int] | None = None
  # How many arrays the mask_mod reads (`Operands.mask_consts`).
  mod_arrays: int = 0

  @property
  def has_kinds(self) -> bool:
    """Whether a table of tile kinds comes with the call (`mod_tiles`)."""
    return self.mod_tiles is not None

  @property
  def has_table(self) -> bool:
    """Whether tile ranges come from a table (ids or tile kinds)."""
    return self.has_ids or self.has_kinds

  def band(self) -> tuple[int | None, int | None]:
    """(left, right): position p sees columns [p - left, p + right]."""
    right = self.window_right
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return self.window_left, right

  def visible(self, rows, cols, kv_len, q_ids=None, kv_ids=None,
              q_offset=0, batch=None, head=None, mod_consts=()):
    """Boolean predicate; rows/q_ids broadcast against cols/kv_ids; `batch`
    and `head` (the query head) are the mask_mod's b and h, `mod_consts`
    the arrays it closes over."""
    ok = cols < kv_len
    left, right = self.band()
    positions = rows + q_offset
    if right is not None:
      ok = jnp.logical_and(ok, cols <= positions + right)
    if left is not None:
      ok = jnp.logical_and(ok, cols >= positions - left)
    if self.has_ids:
      ok = jnp.logical_and(ok, q_ids == kv_ids)
    if self.mod is not None:
      ok = jnp.logical_and(ok, self.mod(batch, head, positions, cols,
                                        consts=mod_consts))
    return ok


def cdiv(a, b):
  """Ceiling division that lowers on every backend (operands are >= 0)."""
  return div(a + (b - 1), b)


def div(a, b):
  """a / b rounded toward zero (`lax.div`), b (an int or an array) taken in
  a's integer dtype: with 64-bit types on, a Python int alone is int64."""
  a = jnp.asarray(a)
  return lax.div(a, jnp.asarray(b, a.dtype))


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def clamp_ranges(lo, full_lo, full_hi, hi):
  """Makes lo <= full_lo <= full_hi <= hi, shrinking the full range."""
  full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
  full_hi = jnp.minimum(jnp.maximum(full_hi, full_lo), hi)
  return lo, full_lo, full_hi, hi


def without_padding(mask: Mask, q_ids, kv_ids, q_rows=(), kv_rows=()):
  """(q_rows, kv_rows): arrays [B, T, heads, H] of query rows (q, dO) and
  [B, S, heads, H] of key rows (k, v), zeroed at positions at or past a
  length (ids Q_PAD_ID / KV_PAD_ID). Padding may hold anything (NaN, inf),
  and a hidden score's zero probability times NaN would still reach a
  result. Unchanged without ids or with segment ids alone
  (`mask.segments_only`)."""
  if q_ids is None or mask.segments_only:
    return tuple(q_rows), tuple(kv_rows)

  def zero(x, pad):
    return jnp.where(pad[:, :, None, None], jnp.zeros((), x.dtype), x)
  return (tuple(zero(x, q_ids == Q_PAD_ID) for x in q_rows),
          tuple(zero(x, kv_ids == KV_PAD_ID) for x in kv_rows))


def without_full_tiles(mask: Mask, ranges):
  """`ranges` (lo, full_lo, full_hi, hi) with no full tile when a dense mask
  is read tile by tile without its tile kinds (no tile is known wholly
  visible)."""
  if not mask.has_dense or mask.has_kinds:
    return ranges
  lo, _, _, hi = ranges
  return lo, hi, hi, hi


def intersect_ranges(a, b):
  """Tiles visited by both, fully visible under both."""
  lo, full_lo = jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])
  full_hi, hi = jnp.minimum(a[2], b[2]), jnp.minimum(a[3], b[3])
  return clamp_ranges(lo, full_lo, full_hi, jnp.maximum(hi, lo))


def kv_block_ranges(mask: Mask, q_start, block_q: int, block_k: int,
                    kv_len: int, q_offset=0):
  """Key tiles a query tile [q_start, q_start + block_q) must visit, by the band.

  Returns `(lo, full_lo, full_hi, hi)`: tiles in [lo, hi) are visited; those in
  [full_lo, full_hi) are entirely visible (no predicate); those in
  [lo, full_lo) and [full_hi, hi) evaluate `mask.visible`. Tiles outside
  [lo, hi) are entirely masked: never loaded, never computed. The last tile,
  if it reaches past kv_len, is never in the full range.
  """
  num_tiles = cdiv(kv_len, block_k)
  num_whole = kv_len // block_k
  left, right = mask.band()
  r0 = _i32(q_start) + q_offset  # Positions of the tile's first and last rows.
  r1 = r0 + (block_q - 1)
  lo = _i32(0)
  full_lo = _i32(0)
  hi = _i32(num_tiles)
  full_hi = _i32(num_whole)
  if left is not None:
    # Column c0 of tile j is visible from row r1 iff c0 >= r1 - left, ...
    lo = div(jnp.maximum(r0 - left, 0), block_k)
    # Every visible column is past kv_len: nothing to visit.
    lo = jnp.where(r0 - left >= kv_len, num_tiles, lo)
    full_lo = cdiv(jnp.maximum(r1 - left, 0), block_k)
  if right is not None:
    hi = jnp.minimum(div(r1 + right, block_k) + 1, num_tiles)
    full_hi = jnp.minimum(div(r0 + right + 1, block_k), num_whole)
  return clamp_ranges(jnp.minimum(lo, hi), full_lo, full_hi, hi)


def kv_partial_ends(mask: Mask, block_k: int, kv_len: int) -> tuple[bool, bool]:
  """Whether `kv_block_ranges`' partial ranges [lo, full_lo) and [full_hi, hi)
  can hold a tile, by the static mask alone. One that cannot is empty on
  every call (no left bound: full_lo = lo; no right bound and whole tiles:
  full_hi = hi), so a kernel need not emit its loop. Ids, tile kinds, a
  dense mask or a mask_mod may make any tile partial."""
  if mask.has_table or mask.has_dense or mask.mod is not None:
    return True, True
  left, right = mask.band()
  return left is not None, right is not None or kv_len % block_k != 0


def q_block_ranges(mask: Mask, kv_start, block_k: int, block_q: int,
                   q_len: int, q_offset=0):
  """Query tiles a key tile [kv_start, kv_start + block_k) must visit, by the band.

  Same contract as `kv_block_ranges`, seen from the key side (dK/dV kernel).
  Columns past kv_len only produce rows of dK/dV that are never stored, and
  rows past q_len load zeros that add nothing, so neither bound needs the
  predicate here.
  """
  num_tiles = cdiv(q_len, block_q)
  left, right = mask.band()
  c0 = _i32(kv_start) - q_offset  # Row r sits at position r + q_offset.
  c1 = c0 + (block_k - 1)
  lo = _i32(0)
  full_lo = _i32(0)
  hi = _i32(num_tiles)
  full_hi = _i32(num_tiles)
  if right is not None:  # Row r sees column c iff c - right <= r <= c + left.
    lo = div(jnp.maximum(c0 - right, 0), block_q)
    full_lo = cdiv(jnp.maximum(c1 - right, 0), block_q)
  if left is not None:
    hi = jnp.minimum(div(c1 + left, block_q) + 1, num_tiles)
    full_hi = jnp.minimum(div(c0 + left + 1, block_q), num_tiles)
  return clamp_ranges(jnp.minimum(lo, hi), full_lo, full_hi, hi)


def _block_min_max(ids, block: int):
  """Per-block min and max of [B, L] ids; the last block is padded by its edge."""
  b, n = ids.shape
  num = -(-n // block)
  padded = jnp.pad(ids, ((0, 0), (0, num * block - n)), mode="edge")
  padded = padded.reshape(b, num, block)
  return padded.min(axis=-1), padded.max(axis=-1)


def _first_last(flags):
  """[.., n] booleans -> (index of first True, index of last True + 1); (0, 0) if none."""
  n = flags.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  first = jnp.min(jnp.where(flags, idx, n), axis=-1)
  last = jnp.max(jnp.where(flags, idx + 1, 0), axis=-1)
  none = last == 0
  return jnp.where(none, 0, first), last


def id_block_table(row_ids, col_ids, block_rows: int, block_cols: int):
  """Per-(batch, row tile) ranges of column tiles, by the ids alone.

  row_ids: [B, R]; col_ids: [B, C] (for the dK/dV kernel, rows are keys).
  Returns int32 [B, num_row_tiles, 4]: (lo, full_lo, full_hi, hi) as in
  `kv_block_ranges`. A pair of tiles is visited if their id ranges
  [min, max] overlap (no shared id otherwise); it is fully visible if both
  hold a single, equal id. The visited range spans every overlapping tile;
  the full range is kept only where the fully visible tiles are contiguous.
  """
  r_min, r_max = _block_min_max(row_ids, block_rows)
  c_min, c_max = _block_min_max(col_ids, block_cols)
  r_min, r_max = r_min[:, :, None], r_max[:, :, None]
  c_min, c_max = c_min[:, None, :], c_max[:, None, :]
  overlap = (r_max >= c_min) & (r_min <= c_max)
  full = (r_min == r_max) & (c_min == c_max) & (r_min == c_min)
  return _range_table(overlap, full)


def _range_table(visit, full):
  """[B, R, C] booleans (tiles to visit, tiles wholly visible) -> int32
  [B, R, 4] (lo, full_lo, full_hi, hi): the visited range spans every tile
  to visit; the full range is kept only where the full tiles are contiguous."""
  lo, hi = _first_last(visit)
  full_lo, full_hi = _first_last(full)
  contiguous = jnp.sum(full, axis=-1) == full_hi - full_lo
  full_hi = jnp.where(contiguous, full_hi, full_lo)
  lo, full_lo, full_hi, hi = clamp_ranges(lo, full_lo, full_hi, hi)
  return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def intersect_tables(tables):
  """Range tables (int32 [Bm, R, 4] each, Bm 1 or B) intersected: the tiles
  every table visits, full where every table has them full; None for
  none."""
  if not tables:
    return None
  table = tables[0]
  for other in tables[1:]:
    table, other = jnp.broadcast_arrays(table, other)
    table = jnp.stack(intersect_ranges(
        tuple(table[..., c] for c in range(4)),
        tuple(other[..., c] for c in range(4))), axis=-1)
  return table


EMPTY, PARTIAL, FULL = 0, 1, 2  # Tile kinds (`create_block_mask`, dense masks).

# The tiles of a dense mask's kinds table: rows and columns (kernels regrid
# it to their own tiles, `kinds_block_table`).
DENSE_KINDS_TILE = 64


def dense_tile_kinds(dense, q_len: int, kv_len: int,
                     tile: int = DENSE_KINDS_TILE):
  """int8 [Bm, R, C] kinds of a dense mask's (tile x tile) tiles: EMPTY if
  no head sees a pair of it, FULL if every head sees every pair, else
  PARTIAL. dense: [Bm, Nm, Tm, Sm] (Tm, Sm: q_len / kv_len or 1, broadcast).
  Tiles past the end count their missing pairs as hidden (partial)."""
  visible = dense != 0
  bm, nm, tm, sm = visible.shape
  num_rows, num_cols = -(-q_len // tile), -(-kv_len // tile)
  rows, row_tile = (1, 1) if tm == 1 else (num_rows, tile)
  cols, col_tile = (1, 1) if sm == 1 else (num_cols, tile)
  visible = jnp.pad(visible, ((0, 0), (0, 0), (0, rows * row_tile - tm),
                              (0, cols * col_tile - sm)))
  visible = visible.reshape(bm, nm, rows, row_tile, cols, col_tile)
  any_ = jnp.any(visible, axis=(1, 3, 5))  # Over heads and within tiles.
  all_ = jnp.all(visible, axis=(1, 3, 5))
  kinds = jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY))
  kinds = jnp.broadcast_to(kinds, (bm, num_rows, num_cols)).astype(jnp.int8)
  # A broadcast axis's last tile, when it runs past the end, as padded ones.
  partial = lambda x: jnp.where(x == FULL, jnp.int8(PARTIAL), x)
  if tm == 1 and q_len % tile:
    kinds = kinds.at[:, -1, :].set(partial(kinds[:, -1, :]))
  if sm == 1 and kv_len % tile:
    kinds = kinds.at[:, :, -1].set(partial(kinds[:, :, -1]))
  return kinds


def _regrid(kinds, axis: int, block: int, tile: int, length: int):
  """Tile kinds along `axis` from blocks of `block` positions to tiles of
  `tile` (any sizes) over `length` positions: a tile is full if every block
  it overlaps is, empty if every one is, else partial."""
  num = -(-length // tile)
  starts = np.arange(num) * tile
  first = starts // block  # The first and last block each tile overlaps.
  last = np.minimum(np.minimum(starts + tile, length) - 1,
                    kinds.shape[axis] * block - 1) // block
  per = int((last - first).max()) + 1
  idx = np.minimum(first[:, None] + np.arange(per), last[:, None])
  grouped = jnp.take(kinds, idx.reshape(-1), axis=axis)
  if per == 1:
    return grouped
  shape = grouped.shape[:axis] + (num, per) + grouped.shape[axis + 1:]
  grouped = grouped.reshape(shape)
  empty = jnp.all(grouped == EMPTY, axis=axis + 1)
  full = jnp.all(grouped == FULL, axis=axis + 1)
  return jnp.where(full, FULL, jnp.where(empty, EMPTY, PARTIAL)).astype(
      kinds.dtype)


def kinds_block_table(kinds, mask: Mask, block_rows: int, block_cols: int,
                      q_len: int, kv_len: int, *, transposed: bool = False):
  """The tile-range table of a mask_mod's kinds, for a kernel's tiles.

  kinds: int8 [Bm, R, C] kinds of (query block, key block) pairs of
  `mask.mod_tiles` (already combined over heads: a pair is visited if any
  head needs it, full only if full for every head). Returns int32
  [Bm, num_row_tiles, 4] like `id_block_table`, rows being query tiles of
  `block_rows` (keys, with transposed=True, for the dK/dV kernel).
  """
  bq, bk = mask.mod_tiles
  if transposed:
    kinds = jnp.swapaxes(kinds, 1, 2)
    (bq, q_len), (bk, kv_len) = (bk, kv_len), (bq, q_len)
  kinds = _regrid(_regrid(kinds, 1, bq, block_rows, q_len), 2, bk,
                  block_cols, kv_len)
  return _range_table(kinds != EMPTY, kinds == FULL)


def make_ids(batch: int, q_len: int, kv_len: int, *, q_segment_ids=None,
             kv_segment_ids=None, q_lengths=None, kv_lengths=None):
  """Row and column ids [B, T], [B, S] for segments and lengths (None if neither)."""
  if (q_segment_ids is None and q_lengths is None and kv_lengths is None):
    return None, None
  q_ids = (jnp.zeros((batch, q_len), jnp.int32) if q_segment_ids is None else
           jnp.broadcast_to(q_segment_ids.astype(jnp.int32), (batch, q_len)))
  kv_ids = (jnp.zeros((batch, kv_len), jnp.int32) if kv_segment_ids is None
            else jnp.broadcast_to(kv_segment_ids.astype(jnp.int32),
                                  (batch, kv_len)))
  if q_lengths is not None:
    rows = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    q_ids = jnp.where(rows < q_lengths.astype(jnp.int32)[:, None], q_ids,
                      Q_PAD_ID)
  if kv_lengths is not None:
    cols = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    kv_ids = jnp.where(cols < kv_lengths.astype(jnp.int32)[:, None], kv_ids,
                       KV_PAD_ID)
  return q_ids, kv_ids


def dense_mask(mask: Mask, q_len: int, kv_len: int, q_ids=None, kv_ids=None,
               q_offsets=None):
  """The full boolean mask [B or 1, q_len, kv_len] (B with ids or offsets).

  q_ids [B, T], kv_ids [B, S] when `mask.has_ids`; q_offsets int [B], the
  position of each sequence's first query (None: 0).
  """
  rows = jnp.arange(q_len, dtype=jnp.int32)[None, :, None]
  cols = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
  offset = 0 if q_offsets is None else q_offsets.astype(jnp.int32)[:, None,
                                                                   None]
  if mask.has_ids:
    q_ids, kv_ids = q_ids[:, :, None], kv_ids[:, None, :]
  return mask.visible(rows, cols, kv_len, q_ids, kv_ids, q_offset=offset)
