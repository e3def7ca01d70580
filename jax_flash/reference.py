"""The plain-`jnp` statement of the math: the one reference implementation.

Used by the tests, by users' own equivalence tests, and as the "xla"
implementation. Scores and softmax are float32 (float64 inputs stay
float64), matmuls at HIGHEST precision. The mask, score modifications and
dropout bits come from `jax_flash.core`, the description every kernel reads.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_flash.core import checks, dropout
from jax_flash.core import mask as mask_lib
from jax_flash.core.operands import Operands
from jax_flash.core.options import Options
from jax_flash.core.prepare import prepare
from jax_flash.core.scores import Scores


def _per_head(a, num_kv_heads: int, group: int = None):
  """[B|1, N|1, ...] -> [B|1, K|1, G|1, ...]: heads n = k * G + g."""
  many = a.shape[1] > 1
  group = a.shape[1] // num_kv_heads if group is None else group
  return a.reshape(a.shape[0], num_kv_heads if many else 1,
                   group if many else 1, *a.shape[2:])


def logits(q, k, operands: Operands, *, mask: mask_lib.Mask, scores: Scores,
           compute_dtype=None):
  """The masked logits, float32 [B, K, G, T, S] (-inf where masked): query
  head n = k * G + g of q [B, T, N, H] against key head k of k [B, S, K, H].
  Arguments as `attend`."""
  acc = jnp.promote_types(q.dtype, jnp.float32)
  b, t, n, h = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  g = n // kh
  s = _matmul("btkgh,bskh->bkgts", q.reshape(b, t, kh, g, h), k, acc,
              compute_dtype) * scores.scale
  if scores.soft_cap is not None:
    s = scores.soft_cap * jnp.tanh(s / scores.soft_cap)
  offsets = operands.q_offsets if mask.has_q_offsets else None
  if scores.alibi:  # Query i sits at position i + its sequence's offset.
    rows = _positions(t, offsets)[:, None, None, :, None]
    distance = jnp.abs(rows - jnp.arange(s_len))
    s = s - _per_head(operands.alibi_slopes[:, :, None, None], kh,
                      g) * distance
  if scores.bias:
    s = s + _per_head(operands.bias.astype(acc), kh, g)
  visible = mask_lib.dense_mask(mask, t, s_len, operands.q_ids,
                                operands.kv_ids, offsets)[:, None, None]
  if mask.has_dense:
    visible = visible & _per_head(operands.dense_mask != 0, kh, g)
  return jnp.where(visible, s, -jnp.inf)


def _positions(q_len: int, offsets):
  """int32 [B|1, T]: the queries' positions (offsets int [B] or None)."""
  rows = jnp.arange(q_len, dtype=jnp.int32)[None]
  return rows if offsets is None else rows + offsets.astype(jnp.int32)[:,
                                                                       None]


def dropped(probs, operands: Operands, scores: Scores, mask: mask_lib.Mask):
  """probs [B, K, G, T, S] with dropout applied: kept entries scaled by
  1 / (1 - rate), the keep bits of `jax_flash.dropout_keep_mask` (at the
  queries' positions, with query offsets)."""
  if not scores.dropout:
    return probs
  b, kh, g, t, s_len = probs.shape
  shared = scores.dropout_broadcast  # One mask: batch 0, head 0.
  offsets = operands.q_offsets if mask.has_q_offsets else None
  keep = dropout.keep(
      operands.dropout_seed, scores.dropout_rate,
      0 if shared else jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
      0 if shared else jnp.arange(kh * g, dtype=jnp.int32)[:, None, None],
      _positions(t, offsets)[:, None, :, None],
      jnp.arange(s_len, dtype=jnp.int32))
  return jnp.where(_per_head(keep, kh, g),
                   probs / (1.0 - scores.dropout_rate), 0.0)


def _matmul(spec, x, y, acc, compute_dtype):
  dtype = acc if compute_dtype is None else jnp.dtype(compute_dtype)
  return jnp.einsum(spec, x.astype(dtype), y.astype(dtype),
                    precision=lax.Precision.HIGHEST,
                    preferred_element_type=acc)


def attend(q, k, v, operands: Operands, *, mask: mask_lib.Mask,
           scores: Scores, compute_dtype=None):
  """The math on batched inputs and a problem description.

  q [B, T, N, H]; k [B, S, K, H]; v [B, S, K, Hv]; operands, mask, scores
  as built by `jax_flash.core.prepare` (with `mask.has_q_offsets`, each
  sequence's queries start at position `operands.q_offsets[b]`). Returns
  (out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32, natural log; -inf
  for rows that see no key).

  `compute_dtype` (tests only): the dtype of the two matmuls' operands, as a
  plain low-precision implementation would run them (scores, softmax and
  accumulation stay float32). None: float32 at HIGHEST precision.
  """
  acc = jnp.promote_types(q.dtype, jnp.float32)
  b, t, n, h = q.shape
  s = logits(q, k, operands, mask=mask, scores=scores,
             compute_dtype=compute_dtype)
  # Softmax that gives 0 (and zero gradients, no NaN) for rows with no key.
  m = jnp.max(s, axis=-1, keepdims=True)
  if scores.sinks:  # One more logit per head, of a key whose value is 0.
    sink = _per_head(operands.sinks[None, :, None, None], k.shape[2])
    m = jnp.maximum(m, sink)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(s - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  if scores.sinks:
    l = l + jnp.exp(sink - m)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  probs = dropped(e / l_safe, operands, scores, mask)
  lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))[..., 0]
  out = _matmul("bkgts,bskh->btkgh", probs, v, acc, compute_dtype)
  return (out.reshape(b, t, n, v.shape[-1]).astype(q.dtype),
          lse.reshape(b, n, t).astype(jnp.float32))


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None,
                        segment_ids=None, logits_soft_cap=None,
                        alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                        dropout_broadcast=False, sinks=None,
                        query_offset=None, return_residual=False,
                        implementation=None, block_sizes=None, version=2):
  """softmax(logits, masked) V, with the signature of `flash_attention`::

      logits = scale * Q K^T
      logits = cap * tanh(logits / cap)           (logits_soft_cap)
      logits = logits - slope[b, n] * abs(i + o[b] - j)  (alibi_slopes;
                                                   o: query_offset)
      logits = logits + bias                      (bias)
      P      = exp(logits) / (sum_j exp(logits_j) + exp(sinks[n]))
      P      = P * keep / (1 - dropout_rate)      (dropout: the keep bits of
                                                   `jax_flash.dropout_keep_mask`)

  `implementation`, `block_sizes` and `version` are accepted and ignored, so a
  call can switch between the two functions unchanged. A query row that sees
  no key gets output 0, logsumexp -inf and zero gradients.

  Returns `out` [B, T, N, H] in query.dtype, or `(out, logsumexp)` with
  logsumexp [B, T, N] (natural log) when `return_residual`.
  """
  del implementation, block_sizes, version
  query, key, value = checks.common_rank(query, key, value)
  query, scale = checks.fold_traced_scale(query, scale)
  spec = prepare(query, key, value, Options(
      bias=bias, mask=mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      dropout_broadcast=dropout_broadcast, sinks=sinks,
      query_offset=query_offset))
  unbatched = spec.problem.unbatched
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  out, lse = attend(query, key, value, spec.operands, mask=spec.mask,
                    scores=spec.scores)
  lse = lse.transpose(0, 2, 1)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
