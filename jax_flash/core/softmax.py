"""Online-softmax statistics and the logsumexp merge: backend-neutral.

FlashAttention-2 (Dao 2023, Algorithm 1) keeps, per query row, the running
max `m` and the running sum `l` of exponentials, rescales its unnormalized
output when the max grows, and normalizes once at the end (delayed
normalization). FlashAttention-1 (Dao et al. 2022, Algorithm 1) merges the
statistics of each block into normalized ones instead (`update_v1`).

Inside a kernel the scores arrive multiplied by `scale * log2(e)`, so every
exponential is an `exp2` (one `ex2.approx` on NVIDIA GPUs) and `m`, `l` are in
base 2. Between modules the logsumexp is always the natural-log one, float32
[B, N, T]: kernels convert when they store it (`finalize`, `logsumexp`) and
when they read it back (`backward_lse2`).

A row that has seen no visible key keeps `m = -inf`, `l = 0`; the helpers never
form `-inf - -inf`, so such rows give an output of 0 and `lse = -inf`, not NaN.
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def init(block_q: int, head_dim: int):
  """(acc, m, l) before the first key block."""
  acc = jnp.zeros((block_q, head_dim), jnp.float32)
  m = jnp.full((block_q,), NEG_INF, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  return acc, m, l


def _safe(m):
  # A row whose max is still -inf has only masked scores: shift by 0 instead.
  return jnp.where(m == NEG_INF, 0.0, m)


def update(m_prev, l_prev, s, *, autodiff: bool = False):
  """One FlashAttention-2 step on a [block_q, block_k] tile of base-2 scores.

  Returns `(m_new, alpha, p, l_new)`: the caller rescales its unnormalized
  accumulator by `alpha` and adds `p @ V` (delayed normalization).

  autodiff: the caller is differentiated (the blockwise forward under
  `jax.jvp`). The running max is a shift the results do not depend on, so
  it is then a constant to AD (`lax.stop_gradient`, as in
  `jax.nn.softmax`). Its own derivative, JAX's reduce_max JVP, divides by
  how many entries equal the max: 0/0 where a compiler computes the entries
  twice with different rounding (XLA's CPU backend at optimization level 0
  fuses the logits into the max and into the comparison apart). Kernels
  leave it off: Mosaic GPU has no lowering for stop_gradient.
  """
  m_new, alpha, (p,), l_new = update_parts(m_prev, l_prev, (s,),
                                           autodiff=autodiff)
  return m_new, alpha, p, l_new


def update_parts(m_prev, l_prev, parts, *, autodiff: bool = False):
  """`update` over one tile given as column blocks `parts` (a tuple of
  [block_q, n_i] base-2 score tiles, together the tile's columns): the same
  statistics, and a p for each part."""
  m_new = functools.reduce(jnp.maximum, (jnp.max(s, axis=1) for s in parts),
                           m_prev)
  if autodiff:
    m_new = jax.lax.stop_gradient(m_new)
  m_safe = _safe(m_new)
  alpha = jnp.exp2(m_prev - m_safe)
  ps = tuple(jnp.exp2(s - m_safe[:, None]) for s in parts)
  l_new = l_prev * alpha + functools.reduce(
      operator.add, (jnp.sum(p, axis=1) for p in ps))
  return m_new, alpha, ps, l_new


def safe_divisor(l):
  """l, with the 0 of rows that saw no key replaced by 1 (their output is 0)."""
  return jnp.where(l == 0.0, 1.0, l)


def logsumexp(m, l):
  """The natural-log logsumexp of base-2 statistics: (m + log2 l) ln 2; -inf
  for rows that saw no key."""
  return jnp.where(l == 0.0, NEG_INF, (m + jnp.log2(safe_divisor(l))) * LN2)


def finalize(acc, m, l, sink2=None):
  """Normalizes once at the end: returns (o, lse), lse in natural log; acc
  [rows, Hv] or a tuple of such column parts (o likewise).

  sink2: the rows' base-2 sink logits (broadcasting against m: a scalar or
  [rows]), which join the denominator as one more key of value 0.
  """
  if sink2 is not None:
    m_new = jnp.maximum(m, sink2)
    alpha = jnp.exp2(m - m_new)  # 0 for rows that saw no key (m = -inf).
    acc = jax.tree.map(lambda a: a * alpha[:, None], acc)
    l = l * alpha + jnp.exp2(sink2 - m_new)
    m = m_new
  divisor = safe_divisor(l)[:, None]
  return jax.tree.map(lambda a: a / divisor, acc), logsumexp(m, l)


def with_sink(o, lse, sink):
  """Merged partial results (natural log) with a sink logit joining the
  denominator: o [..., H] scaled by exp(lse - lse_new), lse_new =
  logaddexp(lse, sink); sink broadcasts against lse."""
  lse_new = jnp.logaddexp(lse, sink)
  return o * jnp.exp(lse - lse_new)[..., None], lse_new


def sink_gradient(sinks, delta, lse):
  """dL/dsinks [N] from lse [B, N, T] and D = rowsum(dO * O) - dlse
  (`backward_delta`). The sink's probability in row i is p_i = exp(sink -
  L_i), and dL/dsink = -sum_i p_i D_i: the backward's D, since dL/dL_i
  enters through it."""
  return -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))


def update_v1(m_prev, l_prev, s):
  """FlashAttention-1 step: block statistics, then the merge.

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


def backward_lse2(lse):
  """The base-2 logsumexp the backward's P = 2**(s2 - lse2) needs, from the
  natural-log one; +inf for rows that saw no key (lse = -inf), so every P of
  such a row is 0."""
  return jnp.where(lse == NEG_INF, float("inf"), lse * LOG2E)


def backward_delta(o, do, dlse=None):
  """D = rowsum(dO * O) - dlse, float32 [B, N, T] from o, do [B, T, N, H]:
  the backward's dS = P (dP - D); the logsumexp's cotangent folds into D
  because dL/dS gets dlse * P from it."""
  delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32),
                     do.astype(jnp.float32))
  return delta if dlse is None else delta - dlse


def lse_cotangent(dlse, like):
  """The logsumexp's cotangent as float32 (zeros shaped like `like`, the
  backward's D, when there is none): what `key_sum_of_ds` reads."""
  return jnp.zeros_like(like) if dlse is None else dlse.astype(jnp.float32)


def key_sum_of_ds(p_dp, p_sum, dlse):
  """sum over keys of dS = P (dP - D), for a bias that broadcasts over keys,
  from p_dp = sum P * dP and p_sum = sum P (float32, accumulated from the
  tiles) and dlse, the logsumexp's cotangent (0 where unused).

  The exact D is sum P * dP itself (= rowsum(dO * O) before O is rounded),
  so the sum is p_dp * (1 - p_sum) + dlse * p_sum: 0 plus the logsumexp's
  part when the keys take all the probability (p_sum = 1 without sinks), as
  a shift of a whole row must give. Summing P (dP - D) with the D of
  `backward_delta` instead cancels only to the precision of O's dtype
  (relative error 7e-3 at head dim 256 in bfloat16, against 5e-7 for plain
  attention's own gradient)."""
  return p_dp * (1.0 - p_sum) + dlse * p_sum


def merge(o, lse, axis: int):
  """Combines partial results of disjoint key sets exactly, by their logsumexp.

  o: partial outputs, each normalized over its own keys, with the parts along
  `axis` (>= 0) and the head dim last; lse: their natural-log logsumexps, shaped
  like o without its last dim. Returns (o, lse) with `axis` reduced. Parts
  that saw no key (lse = -inf) weigh 0; if no part saw a key, o is 0 and lse
  -inf.
  """
  total = jax.nn.logsumexp(lse, axis=axis, keepdims=True)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  weight = jnp.exp(lse - safe)  # 0 for empty parts.
  out = jnp.sum(weight[..., None] * o.astype(jnp.float32), axis=axis)
  return out, jnp.squeeze(total, axis)


def merge_two(o, lse, part_o, part_lse):
  """`merge` of two parts without stacking them: the running float32 o
  [..., H] and lse [...] with a part's (any float dtype), for loops that
  merge one part a step (a ring's pairs)."""
  total = jnp.logaddexp(lse, part_lse)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  return (o * jnp.exp(lse - safe)[..., None]
          + part_o.astype(jnp.float32) * jnp.exp(part_lse - safe)[..., None],
          total)


def merge_split_kv(o, lse, *, q_len: int, group: int, dtype, sinks=None):
  """A split-KV decode kernel's partials to `flash_decode`'s results.

  o [B, K, splits, R, Hv] (each split's normalized output) and lse [B, K,
  splits, R] (natural log, -inf for a split that saw no key), row r = g *
  T + t holding query t of the group's head g (rows past G * T: padding);
  sinks: float32 [N] or None, joining each head's denominator. Returns
  (out [B, T, N, Hv] in dtype, lse [B, N, T]).
  """
  batch, num_kv_heads, _, rows, value_head_dim = o.shape
  out, lse = merge(o, lse, axis=2)  # [B, K, R, Hv], [B, K, R]
  if sinks is not None:  # Row g * T + t is query head k * G + g.
    per_row = jnp.repeat(sinks.reshape(num_kv_heads, group), q_len, axis=1)
    per_row = jnp.pad(per_row, ((0, 0), (0, rows - group * q_len)))
    out, lse = with_sink(out, lse, per_row[None])
  out = out[:, :, :group * q_len].reshape(batch, num_kv_heads, group, q_len,
                                          value_head_dim)
  # Heads n = kv_head * G + g: [B, K, G, T] is [B, N, T].
  lse = lse[:, :, :group * q_len].reshape(batch, num_kv_heads * group, q_len)
  out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len,
                                             num_kv_heads * group,
                                             value_head_dim)
  return out.astype(dtype), lse
