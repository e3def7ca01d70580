"""The plain-`jnp` statement of the math: the one reference implementation.

Used by the tests, by users' own equivalence tests, and as the
`implementation="xla"` path. Scores and softmax are float32 (float64 inputs
stay float64), matmuls at HIGHEST precision. The mask comes from
`pallas_kernels.masking`, the same description the kernels use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _checks
from pallas_kernels import masking


def prepare_mask(p: _checks.Problem, *, is_causal, query_seq_lengths,
                 key_value_seq_lengths, local_window_size, segment_ids):
  """Validates the mask arguments: (masking.Mask, q_ids [B,T] | None, kv_ids)."""
  q_lengths = _checks.check_lengths(query_seq_lengths, "query_seq_lengths", p)
  kv_lengths = _checks.check_lengths(key_value_seq_lengths,
                                     "key_value_seq_lengths", p)
  segments = _checks.check_segment_ids(segment_ids, p)
  left, right = _checks.check_window(local_window_size)
  q_ids, kv_ids = masking.make_ids(
      p.batch, p.q_len, p.kv_len,
      q_segment_ids=None if segments is None else segments[0],
      kv_segment_ids=None if segments is None else segments[1],
      q_lengths=q_lengths, kv_lengths=kv_lengths)
  mask = masking.Mask(is_causal=bool(is_causal), window_left=left,
                      window_right=right, has_ids=q_ids is not None)
  return mask, q_ids, kv_ids


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None,
                        segment_ids=None, return_residual=False,
                        implementation=None, block_sizes=None, version=2):
  """softmax(scale * Q K^T, masked) V, with the signature of `flash_attention`.

  `implementation`, `block_sizes` and `version` are accepted and ignored, so a
  call can switch between the two functions unchanged. A query row that sees
  no key gets output 0, logsumexp -inf and zero gradients.

  Returns `out` [B, T, N, H] in query.dtype, or `(out, logsumexp)` with
  logsumexp [B, T, N] (natural log) when `return_residual`.
  """
  del implementation, block_sizes, version
  _checks.check_not_yet(bias=bias, mask=mask)
  p = _checks.check_qkv(query, key, value)
  scale = _checks.check_scale(scale, p.head_dim)
  spec, q_ids, kv_ids = prepare_mask(
      p, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids)
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  group = p.num_heads // p.num_kv_heads
  q = query.astype(acc).reshape(p.batch, p.q_len, p.num_kv_heads, group,
                                p.head_dim)
  s = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(acc),
                 precision=lax.Precision.HIGHEST) * scale
  visible = masking.dense_mask(spec, p.q_len, p.kv_len, q_ids, kv_ids)
  if spec.has_ids:  # [B, T, S] -> [B, 1, 1, T, S]
    visible = visible[:, None, None]
  s = jnp.where(visible, s, -jnp.inf)
  # Softmax that gives 0 (and zero gradients, no NaN) for rows with no key.
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  probs = e / l_safe
  lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))[..., 0]
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value.astype(acc),
                   precision=lax.Precision.HIGHEST)
  out = out.reshape(p.batch, p.q_len, p.num_heads, p.head_dim)
  out = out.astype(query.dtype)
  lse = lse.reshape(p.batch, p.num_heads, p.q_len).transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
