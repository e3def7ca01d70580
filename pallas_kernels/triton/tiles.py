"""Tile primitives for the Triton lowering: masked loads and stores, and dots.

Sequence lengths need not be multiples of the block size and head dims need
not be powers of two: every tile is power-of-two shaped and its rows past the
sequence and columns past the head dim are masked (read as `other`, never
written). Refs are [rows, head_dim_padded] or [rows, heads, head_dim_padded];
`head` picks one head of the latter.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _mask(ref, start, size, row_bound, head_dim):
  mask = None
  if row_bound is not None:
    mask = ((start + jnp.arange(size)) < row_bound)[:, None]
  if head_dim is not None and head_dim < ref.shape[-1]:
    cols = (jnp.arange(ref.shape[-1]) < head_dim)[None, :]
    mask = cols if mask is None else jnp.logical_and(mask, cols)
  return mask


def _rows(start, size):
  # A traced start: a static one past the end fails validation even when the
  # rows past the end are masked.
  return pl.ds(jnp.asarray(start, jnp.int32), size)


def _index(ref, start, size, head):
  rows = _rows(start, size)
  if head is None:
    return ref.at[rows, :]
  return ref.at[rows, head, :]


def load_tile(ref, start, size, *, row_bound=None, head_dim=None, head=None):
  """ref[start:start+size, (head,) :], zero where masked.

  `row_bound=None` promises every row is in bounds (interior tiles).
  """
  mask = _mask(ref, start, size, row_bound, head_dim)
  view = _index(ref, start, size, head)
  if mask is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=mask, other=0.0)


def page_rows(table_ref, start, size, page_size: int, num_pages: int):
  """Where cache positions [start, start + size) of one sequence lie in a
  paged cache with page table row table_ref [pages_per_seq]: position p is
  row p % page_size of page table_ref[p // page_size]. Read once per tile
  for K and V alike. A tile within one page (size <= page_size; tiles start
  at multiples of size): (start, page id, first row in the page), one
  contiguous load. A tile over several pages: (positions, page ids, rows in
  the page) per row, one gather load. Slots past the table and page ids
  past the cache (num_pages) are clamped: a garbage entry is never read out
  of bounds (its positions are past the sequence's length, and `load_pages`
  zeroes them)."""
  if size <= page_size:
    slot = jnp.minimum(lax.div(start, page_size), table_ref.shape[0] - 1)
    page = jnp.clip(table_ref[slot], 0, num_pages - 1)
    return start, page, lax.rem(start, page_size)
  positions = start + jnp.arange(size)
  slots = jnp.minimum(positions // page_size, table_ref.shape[0] - 1)
  pages = jnp.clip(table_ref[slots], 0, num_pages - 1)
  return positions, pages, positions % page_size


def tile_pages(table_ref, start, size, page_size: int, num_pages: int):
  """The pages of cache positions [start, start + size) (size a multiple
  of page_size, start of size): a tuple of (first position, page id, 0),
  one a page, each what `page_rows` gives a tile within one page."""
  return tuple(page_rows(table_ref, start + i * page_size, page_size,
                         page_size, num_pages)
               for i in range(size // page_size))


def load_pages(ref, rows, size, *, row_bound, head_dim):
  """The tile of `size` rows at `rows` (from `page_rows`) of a paged cache
  ref [pages, page_size, Hp]; zero at positions >= row_bound (they may hold
  anything: never read, or read and replaced by zeros) and columns >=
  head_dim."""
  if size <= ref.shape[1]:  # Within one page: a masked contiguous load.
    start, page, offset = rows
    mask = _mask(ref, start, size, row_bound, head_dim)
    return plgpu.load(ref.at[page, _rows(offset, size), :], mask=mask,
                      other=0.0)
  positions, pages, in_page = rows
  cols = jnp.arange(ref.shape[2])
  tile = ref[pages[:, None], in_page[:, None], cols[None, :]]
  keep = (positions < row_bound)[:, None] & (cols < head_dim)[None, :]
  return jnp.where(keep, tile, jnp.zeros_like(tile))


def store_tile(ref, start, value, *, row_bound, head_dim, head=None):
  mask = _mask(ref, start, value.shape[0], row_bound, head_dim)
  plgpu.store(_index(ref, start, value.shape[0], head),
              value.astype(ref.dtype), mask=mask)


def load_row_stat(ref, start, size, *, row_bound, head=None, other=0.0):
  """A [size] slice of a per-row statistic ([T] or [heads, T] ref)."""
  rows = _rows(start, size)
  view = ref.at[rows] if head is None else ref.at[head, rows]
  mask = (start + jnp.arange(size)) < row_bound
  return plgpu.load(view, mask=mask, other=other)


def store_row_stat(ref, start, value, *, row_bound, head=None):
  rows = _rows(start, value.shape[0])
  view = ref.at[rows] if head is None else ref.at[head, rows]
  mask = (start + jnp.arange(value.shape[0])) < row_bound
  plgpu.store(view, value.astype(ref.dtype), mask=mask)


def dot(a, b, *, trans_b: bool = False):
  """a @ b (a @ b.T with trans_b), accumulated in float32.

  float32 operands get full-precision products: the Triton default for them
  is TF32 (about 3e-4 relative error), which float32 callers do not expect.
  """
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def load_ids(ref, start, size, *, bound, pad_id):
  """A [size] slice of per-row or per-column ids ([L] ref), `pad_id` past `bound`."""
  return load_row_stat(ref, start, size, row_bound=bound, other=pad_id)


def load_table_row(table_ref, i):
  """The 4 tile-range scalars (lo, full_lo, full_hi, hi) of row tile i."""
  return tuple(table_ref[i, c] for c in range(4))
