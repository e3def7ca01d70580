"""The plain-`jnp` statement of the math: the one reference implementation.

Used by the tests, by users' own equivalence tests, and as the
`implementation="xla"` path. Scores and softmax are float32 (float64 inputs
stay float64), matmuls at HIGHEST precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _checks
from pallas_kernels import masking


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None,
                        return_residual=False, implementation=None,
                        block_sizes=None, version=2):
  """softmax(scale * Q K^T, masked) V, with the signature of `flash_attention`.

  `implementation`, `block_sizes` and `version` are accepted and ignored, so a
  call can switch between the two functions unchanged.

  Returns `out` [B, T, N, H] in query.dtype, or `(out, logsumexp)` with
  logsumexp [B, T, N] (natural log) when `return_residual`.
  """
  del implementation, block_sizes, version
  _checks.check_not_yet(bias=bias, mask=mask,
                        query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths,
                        local_window_size=local_window_size)
  p = _checks.check_qkv(query, key, value)
  scale = _checks.check_scale(scale, p.head_dim)
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  group = p.num_heads // p.num_kv_heads
  q = query.astype(acc).reshape(p.batch, p.q_len, p.num_kv_heads, group,
                                p.head_dim)
  s = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(acc),
                 precision=lax.Precision.HIGHEST) * scale
  visible = masking.dense_mask(masking.Mask(is_causal=is_causal), p.q_len,
                               p.kv_len)
  s = jnp.where(visible, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, T]; -inf for empty rows
  probs = jnp.exp(s - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value.astype(acc),
                   precision=lax.Precision.HIGHEST)
  out = out.reshape(p.batch, p.q_len, p.num_heads, p.head_dim)
  out = out.astype(query.dtype)
  lse = lse.reshape(p.batch, p.num_heads, p.q_len).transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
