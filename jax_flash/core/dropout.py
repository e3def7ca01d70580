"""Dropout keep bits from a counter-based hash: backend-neutral.

The keep decision for (batch b, query head n, row i, column j) is a pure
function of the seed and those four counters, so the forward and backward
kernels regenerate the same bits tile by tile and nothing is stored. The
seed is four int32 words: two of the hash and two position offsets added
to i and j (zero but where a kernel runs a block of a longer sequence
whose rows or columns it counts from the block's first: a ring's pairs of
chunks, `at_positions`). The hash
is the MurmurHash3 32-bit finalizer applied in a chain, computed in int32
(wrapping multiplies, logical shifts: the same bits as uint32, and no
unsigned constants for a backend to trip on); the top 24 bits are compared
with the rate, so rates are quantized to 2**-24.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _i32(x: int) -> int:
  """A uint32 constant as the int32 with the same bits."""
  return x - (1 << 32) if x >= (1 << 31) else x


_M1 = _i32(0x85EBCA6B)
_M2 = _i32(0xC2B2AE35)
_GOLDEN = _i32(0x9E3779B9)
_HEAD = _i32(0x7F4A7C15)


def _shr(x, n: int):
  return lax.shift_right_logical(x, jnp.int32(n))


def _fmix(x):
  x = x ^ _shr(x, 16)
  x = x * _M1
  x = x ^ _shr(x, 13)
  x = x * _M2
  return x ^ _shr(x, 16)


def seed_words(rng) -> jax.Array:
  """The seed, int32 [4], of a JAX PRNG key (typed or raw): two words of
  its bits, offsets 0."""
  words = lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32),
                                   jnp.int32)
  return jnp.concatenate([words, jnp.zeros((2,), jnp.int32)])


def threshold(rate: float) -> int:
  """Keep iff the 24-bit hash >= this."""
  return int(min(round(rate * 2**24), 2**24))


def keep(seed, rate: float, batch, head, rows, cols):
  """Boolean keep mask; `seed` int32 [4] (an array or a kernel's ref),
  int32 scalars and index arrays (rows, cols broadcast), which the seed's
  offsets shift."""
  rows, cols = rows + seed[2], cols + seed[3]
  base = _fmix(seed[0] ^ _fmix(seed[1] + batch * _GOLDEN + head * _HEAD))
  bits = _fmix(_fmix(base ^ rows) + cols * _GOLDEN)
  return _shr(bits, 8) >= threshold(rate)


def shifted(seed, batch_offset, head_offset):
  """The seed (int32 [4]) whose keep bits at (b, n, i, j) are `seed`'s at
  (b + batch_offset, n + head_offset, i, j): a device holding a shard of
  the batch and the heads draws the bits of its place in the whole (the
  hash takes batch and head through one wrapping sum with seed1)."""
  return seed.at[1].add(jnp.int32(batch_offset) * _GOLDEN
                        + jnp.int32(head_offset) * _HEAD)


def at_positions(seed, row_offset, col_offset):
  """The seed whose bits at (b, n, i, j) are `seed`'s at (b, n, i +
  row_offset, j + col_offset): a block of rows and columns that starts at
  those positions of the whole."""
  return seed.at[2].add(row_offset).at[3].add(col_offset)


def dropped(x, seed, rate: float, batch, head, rows, cols):
  """x * keep / (1 - rate): dropout applied to a tile of P or dP, `keep`'s
  bits for (batch, head, rows, cols)."""
  return jnp.where(keep(seed, rate, batch, head, rows, cols),
                   x * (1.0 / (1.0 - rate)), 0.0)


def keep_mask(seed, rate: float, batch: int, num_heads: int, q_len: int,
              kv_len: int) -> jax.Array:
  """The dense [B, N, T, S] keep mask of the seed `seed` (int32 [4])."""
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  n = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
  i = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep(seed, rate, b, n, i, j)


def dropout_keep_mask(rng, rate: float, batch: int, num_heads: int,
                      q_len: int, kv_len: int) -> jax.Array:
  """The dense [B, N, T, S] keep mask every implementation uses for
  `dropout_rng=rng` (True = kept)."""
  return keep_mask(seed_words(rng), rate, batch, num_heads, q_len, kv_len)
