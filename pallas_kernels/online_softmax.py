"""Online-softmax statistics (FlashAttention-2, seed 000 section 2), backend-agnostic.

Scores arrive already multiplied by `scale * log2(e)`, so every exponential is
an `exp2` (one `ex2.approx` on NVIDIA GPUs) and the running statistics are in
base 2: `m` is the running row max, `l` the running sum of `2**(s - m)`. A row
that has seen no visible key keeps `m = -inf`, `l = 0`; the helpers never form
`-inf - -inf`, so such rows give an output of 0 and `lse = -inf`, not NaN.
"""
from __future__ import annotations

import jax.numpy as jnp

NEG_INF = float("-inf")


def init(block_q: int, head_dim: int):
  """(acc, m, l) before the first key block."""
  acc = jnp.zeros((block_q, head_dim), jnp.float32)
  m = jnp.full((block_q,), NEG_INF, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  return acc, m, l


def _safe(m):
  # A row whose max is still -inf has only masked scores: shift by 0 instead.
  return jnp.where(m == NEG_INF, 0.0, m)


def update(m_prev, l_prev, s):
  """One FlashAttention-2 step on a [block_q, block_k] tile of base-2 scores.

  Returns `(m_new, alpha, p, l_new)`: the caller rescales its unnormalized
  accumulator by `alpha` and adds `p @ V` (delayed normalization).
  """
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  m_safe = _safe(m_new)
  alpha = jnp.exp2(m_prev - m_safe)
  p = jnp.exp2(s - m_safe[:, None])
  l_new = l_prev * alpha + jnp.sum(p, axis=1)
  return m_new, alpha, p, l_new


def safe_divisor(l):
  """l, with the 0 of rows that saw no key replaced by 1 (their output is 0)."""
  return jnp.where(l == 0.0, 1.0, l)


def logsumexp2(m, l):
  """lse2 = m + log2(l); -inf for rows that saw no key."""
  return jnp.where(l == 0.0, NEG_INF, m + jnp.log2(safe_divisor(l)))


def finalize(acc, m, l):
  """Normalizes once at the end: returns (o, lse2)."""
  return acc / safe_divisor(l)[:, None], logsumexp2(m, l)


def update_v1(m_prev, l_prev, s):
  """FlashAttention-1 step (seed 001): block statistics, then the merge.

  Returns `(m_new, l_new, a, b, p)` with `p = 2**(s - m_tilde)` for the block's
  own max `m_tilde`; the caller forms the normalized output
  `O_new = (a * l_prev * O_prev + b * p @ V) / l_new`.
  """
  m_tilde = jnp.max(s, axis=1)
  p = jnp.exp2(s - _safe(m_tilde)[:, None])
  l_tilde = jnp.sum(p, axis=1)
  m_new = jnp.maximum(m_prev, m_tilde)
  m_safe = _safe(m_new)
  a = jnp.exp2(m_prev - m_safe)
  b = jnp.exp2(m_tilde - m_safe)
  l_new = a * l_prev + b * l_tilde
  return m_new, l_new, a, b, p


def backward_lse(lse2):
  """The backward's P = 2**(s - lse2) must be 0 for rows that saw no key.

  Those rows have lse2 = -inf; mapping it to +inf makes every P of the row 0.
  """
  return jnp.where(lse2 == NEG_INF, float("inf"), lse2)
