"""From the public arguments to the static specs and the operand arrays.

Shared by `flash_attention` and `reference_attention`, so both validate alike
and read one description of the mask and scores.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash import _checks
from pallas_kernels import dropout, masking
from pallas_kernels.extras import Extras
from pallas_kernels.scores import Scores


@dataclasses.dataclass(frozen=True)
class Spec:
  problem: _checks.Problem
  mask: masking.Mask
  scores: Scores
  extras: Extras


def prepare(query, key, value, *, bias, mask, scale, is_causal,
            query_seq_lengths, key_value_seq_lengths, local_window_size,
            segment_ids, logits_soft_cap, alibi_slopes, dropout_rate=0.0,
            dropout_rng=None, dropout_broadcast=False) -> Spec:
  """Validates every argument (trace time) and builds the Spec (batched)."""
  p = _checks.check_qkv(query, key, value)
  scale = _checks.check_scale(scale, p.head_dim)
  q_lengths = _checks.check_lengths(query_seq_lengths, "query_seq_lengths", p)
  kv_lengths = _checks.check_lengths(key_value_seq_lengths,
                                     "key_value_seq_lengths", p)
  segments = _checks.check_segment_ids(segment_ids, p)
  left, right = _checks.check_window(local_window_size)
  bias = _checks.check_pair_array(bias, "bias", p, boolean=False)
  dense = _checks.check_pair_array(mask, "mask", p, boolean=True)
  cap = _checks.check_soft_cap(logits_soft_cap)
  slopes = _checks.check_alibi_slopes(alibi_slopes, p)
  rate = _checks.check_dropout(dropout_rate, dropout_rng)
  q_ids, kv_ids = masking.make_ids(
      p.batch, p.q_len, p.kv_len,
      q_segment_ids=None if segments is None else segments[0],
      kv_segment_ids=None if segments is None else segments[1],
      q_lengths=q_lengths, kv_lengths=kv_lengths)
  mask_spec = masking.Mask(is_causal=bool(is_causal), window_left=left,
                           window_right=right, has_ids=q_ids is not None,
                           has_dense=dense is not None)
  scores = Scores(scale=scale, soft_cap=cap, alibi=slopes is not None,
                  bias=bias is not None, dropout_rate=rate,
                  dropout_broadcast=bool(dropout_broadcast) and rate > 0)
  extras = Extras(
      q_ids=q_ids, kv_ids=kv_ids,
      dense_mask=None if dense is None else dense.astype(jnp.int8),
      bias=bias,
      # ALiBi slopes are constants here: no gradient flows to them.
      slopes=None if slopes is None else jax.lax.stop_gradient(slopes),
      seed=dropout.seed_words(dropout_rng) if rate > 0 else None)
  return Spec(p, mask_spec, scores, extras)
