"""Dropout keep bits from a counter-based hash: backend-neutral.

The keep decision for (batch b, query head n, row i, column j) is a pure
function of the seed and those four counters, so the forward and backward
kernels regenerate the same bits tile by tile and nothing is stored. The hash
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
  """Two int32 words from a JAX PRNG key (typed or raw)."""
  return lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32),
                                  jnp.int32)


def threshold(rate: float) -> int:
  """Keep iff the 24-bit hash >= this."""
  return int(min(round(rate * 2**24), 2**24))


def keep(seed0, seed1, rate: float, batch, head, rows, cols):
  """Boolean keep mask; int32 scalars and index arrays (rows, cols broadcast)."""
  base = _fmix(seed0 ^ _fmix(seed1 + batch * _GOLDEN + head * _HEAD))
  bits = _fmix(_fmix(base ^ rows) + cols * _GOLDEN)
  return _shr(bits, 8) >= threshold(rate)


def shifted(seed, batch_offset, head_offset):
  """Seed words (int32 [2]) whose keep bits at (b, n, i, j) are `seed`'s at
  (b + batch_offset, n + head_offset, i, j): a device holding a shard of
  the batch and the heads draws the bits of its place in the whole (the
  hash takes batch and head through one wrapping sum with seed1)."""
  return seed.at[1].add(jnp.int32(batch_offset) * _GOLDEN
                        + jnp.int32(head_offset) * _HEAD)


def dropped(x, seed0, seed1, rate: float, batch, head, rows, cols):
  """x * keep / (1 - rate): dropout applied to a tile of P or dP, `keep`'s
  bits for (batch, head, rows, cols)."""
  return jnp.where(keep(seed0, seed1, rate, batch, head, rows, cols),
                   x * (1.0 / (1.0 - rate)), 0.0)


def keep_mask(seed, rate: float, batch: int, num_heads: int, q_len: int,
              kv_len: int) -> jax.Array:
  """The dense [B, N, T, S] keep mask of the seed words `seed` (int32 [2])."""
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  n = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
  i = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep(seed[0], seed[1], rate, b, n, i, j)


def dropout_keep_mask(rng, rate: float, batch: int, num_heads: int,
                      q_len: int, kv_len: int) -> jax.Array:
  """The dense [B, N, T, S] keep mask every implementation uses for
  `dropout_rng=rng` (True = kept)."""
  return keep_mask(seed_words(rng), rate, batch, num_heads, q_len, kv_len)
