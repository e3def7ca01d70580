"""The plain-`jnp` statement of the math: the one reference implementation.

Used by the tests, by users' own equivalence tests, and as the
`implementation="xla"` path. Scores and softmax are float32 (float64 inputs
stay float64), matmuls at HIGHEST precision. The mask comes from
`pallas_kernels.masking`, the same description the kernels use.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_flash._spec import prepare
from pallas_kernels import dropout, masking


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None,
                        segment_ids=None, logits_soft_cap=None,
                        alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                        dropout_broadcast=False, return_residual=False,
                        implementation=None, block_sizes=None, version=2):
  """softmax(logits, masked) V, with the signature of `flash_attention`.

      logits = scale * Q K^T
      logits = cap * tanh(logits / cap)           (logits_soft_cap)
      logits = logits - slope[b, n] * |i - j|     (alibi_slopes)
      logits = logits + bias                      (bias)
      P      = P * keep / (1 - dropout_rate)      (dropout: the keep bits of
                                                   `jax_flash.dropout_keep_mask`)

  `implementation`, `block_sizes` and `version` are accepted and ignored, so a
  call can switch between the two functions unchanged. A query row that sees
  no key gets output 0, logsumexp -inf and zero gradients.

  Returns `out` [B, T, N, H] in query.dtype, or `(out, logsumexp)` with
  logsumexp [B, T, N] (natural log) when `return_residual`.
  """
  del implementation, block_sizes, version
  spec = prepare(query, key, value, bias=bias, mask=mask, scale=scale,
                 is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size, segment_ids=segment_ids,
                 logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                 dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                 dropout_broadcast=dropout_broadcast)
  p, x, scores = spec.problem, spec.extras, spec.scores
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  b, t, s_len, kh = p.batch, p.q_len, p.kv_len, p.num_kv_heads
  g = p.num_heads // kh

  def per_head(a):  # [B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, T|1, S|1]
    return a.reshape(a.shape[0], kh if a.shape[1] > 1 else 1,
                     g if a.shape[1] > 1 else 1, *a.shape[2:])

  q = query.astype(acc).reshape(b, t, kh, g, p.head_dim)
  s = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(acc),
                 precision=lax.Precision.HIGHEST) * scores.scale
  if scores.soft_cap is not None:
    s = scores.soft_cap * jnp.tanh(s / scores.soft_cap)
  if scores.alibi:
    distance = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(s_len)[None, :])
    s = s - per_head(x.slopes[:, :, None, None]) * distance
  if scores.bias:
    s = s + per_head(x.bias.astype(acc))
  visible = masking.dense_mask(spec.mask, t, s_len, x.q_ids, x.kv_ids)
  if spec.mask.has_ids:  # [B, T, S] -> [B, 1, 1, T, S]
    visible = visible[:, None, None]
  if spec.mask.has_dense:
    visible = visible & per_head(x.dense_mask != 0)
  s = jnp.where(visible, s, -jnp.inf)
  # Softmax that gives 0 (and zero gradients, no NaN) for rows with no key.
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  probs = e / l_safe
  if scores.dropout:
    shared = scores.dropout_broadcast  # One mask: batch 0, head 0.
    keep = dropout.keep_mask(dropout_rng, scores.dropout_rate,
                             1 if shared else b, 1 if shared else p.num_heads,
                             t, s_len)
    probs = jnp.where(per_head(keep), probs / (1.0 - scores.dropout_rate), 0.0)
  lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))[..., 0]
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value.astype(acc),
                   precision=lax.Precision.HIGHEST)
  out = out.reshape(b, t, p.num_heads, p.head_dim).astype(query.dtype)
  lse = lse.reshape(b, p.num_heads, t).transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def decode_mask(kv_lengths, q_len: int, kv_len: int, window_left=None):
  """[B, 1, T, S] mask of decoding: query t of sequence b sits at position
  kv_lengths[b] - T + t and sees the cache positions up to it (and, with a
  window, back to it - window_left)."""
  position = (kv_lengths[:, None] - q_len + jnp.arange(q_len)[None])[:, :, None]
  cols = jnp.arange(kv_len)[None, None, :]
  visible = (cols <= position) & (cols < kv_lengths[:, None, None])
  if window_left is not None:
    visible = visible & (cols >= position - window_left)
  return visible[:, None]
