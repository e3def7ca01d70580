"""Which (query, key) pairs attend, and which tiles must evaluate that predicate.

Backend-agnostic: plain `jnp`/`lax` on integer scalars and index vectors, so the
Triton kernels, a future Mosaic GPU kernel and the reference all read the same
description. Positions are absolute indices: query row `i` in [0, q_len), key
column `j` in [0, kv_len). Causal masks are aligned top-left, as in
`jax.nn.dot_product_attention`: row `i` sees columns `j <= i`, e.g. for
q_len=3, kv_len=5::

    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Mask:
  """Static description of the attention mask (hashable, a jit static)."""
  is_causal: bool = False

  def visible(self, rows, cols, kv_len: int):
    """Boolean predicate, broadcasting `rows` [.., 1] against `cols` [1, ..]."""
    ok = cols < kv_len
    if self.is_causal:
      ok = jnp.logical_and(ok, cols <= rows)
    return ok


def cdiv(a, b):
  """Ceiling division that lowers on every backend (operands are >= 0)."""
  return lax.div(a + (b - 1), b)


def kv_block_ranges(mask: Mask, q_start, block_q: int, block_k: int,
                    kv_len: int):
  """Key blocks a query tile [q_start, q_start + block_q) must visit.

  Returns `(lo, full_lo, full_hi, hi)`: blocks in [lo, hi) are visited; those in
  [full_lo, full_hi) are entirely visible (no predicate); those in
  [lo, full_lo) and [full_hi, hi) evaluate `mask.visible`. Blocks outside
  [lo, hi) are entirely masked: never loaded, never computed.
  """
  num_kv_blocks = cdiv(kv_len, block_k)
  num_whole_blocks = kv_len // block_k  # Blocks with no column past kv_len.
  lo = jnp.int32(0)
  if mask.is_causal:
    # The last row of the tile sees columns <= q_start + block_q - 1; the
    # first row sees columns <= q_start.
    hi = jnp.minimum(cdiv(q_start + block_q, block_k), num_kv_blocks)
    full_hi = jnp.minimum(lax.div(q_start + 1, block_k), num_whole_blocks)
  else:
    hi = jnp.int32(num_kv_blocks)
    full_hi = jnp.int32(num_whole_blocks)
  return lo, lo, full_hi, hi


def q_block_ranges(mask: Mask, kv_start, block_k: int, block_q: int,
                   q_len: int):
  """Query blocks a key tile [kv_start, kv_start + block_k) must visit.

  Same contract as `kv_block_ranges`, seen from the key side (dK/dV kernel).
  Columns past kv_len only produce rows of dK/dV that are never stored, so the
  key bound needs no predicate here.
  """
  num_q_blocks = cdiv(q_len, block_q)
  hi = jnp.int32(num_q_blocks)
  if mask.is_causal:
    # Row i sees column kv_start only if i >= kv_start; it sees the whole key
    # tile if i >= kv_start + block_k - 1.
    lo = jnp.minimum(lax.div(kv_start, block_q), hi)
    full_lo = jnp.minimum(cdiv(kv_start + block_k - 1, block_q), hi)
  else:
    lo = full_lo = jnp.int32(0)
  return lo, full_lo, hi, hi


def dense_mask(mask: Mask, q_len: int, kv_len: int):
  """The full [q_len, kv_len] boolean mask (for the reference only)."""
  rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
  cols = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  return mask.visible(rows, cols, kv_len)
