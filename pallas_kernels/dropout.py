"""Dropout keep bits from a counter-based hash: backend-agnostic.

The keep decision for (batch b, query head n, row i, column j) is a pure
function of the seed and those four counters, so the forward and backward
kernels regenerate the same bits tile by tile and nothing is stored. The hash
is the MurmurHash3 32-bit finalizer applied in a chain; the top 24 bits are
compared with the rate (so rates are quantized to 2**-24).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_M1 = np.uint32(0x85EBCA6B)
_M2 = np.uint32(0xC2B2AE35)
_GOLDEN = np.uint32(0x9E3779B9)
_HEAD = np.uint32(0x7F4A7C15)


def _fmix(x):
  x = x ^ (x >> 16)
  x = x * _M1
  x = x ^ (x >> 13)
  x = x * _M2
  return x ^ (x >> 16)


def seed_words(rng) -> jax.Array:
  """Two uint32 words from a JAX PRNG key (typed or raw)."""
  return jax.random.bits(rng, (2,), jnp.uint32)


def threshold(rate: float) -> int:
  """Keep iff the 24-bit hash >= this."""
  return int(min(round(rate * 2**24), 2**24))


def keep(seed, rate: float, batch, head, rows, cols):
  """Boolean keep mask; rows and cols broadcast (int32), seed uint32 [2]."""
  base = _fmix(seed[0] ^ _fmix(
      seed[1] + batch.astype(jnp.uint32) * _GOLDEN +
      head.astype(jnp.uint32) * _HEAD))
  bits = _fmix(_fmix(base ^ rows.astype(jnp.uint32)) +
               cols.astype(jnp.uint32) * _GOLDEN)
  return (bits >> 8).astype(jnp.int32) >= threshold(rate)


def keep_mask(rng, rate: float, batch: int, num_heads: int, q_len: int,
              kv_len: int) -> jax.Array:
  """The dense [B, N, T, S] keep mask the kernels use for `dropout_rng`."""
  seed = seed_words(rng)
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  n = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
  i = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep(seed, rate, b, n, i, j)
