"""`flash_attention`: the public entry point and its custom_vjp wiring."""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jax_flash import _checks, _sharding
from jax_flash._spec import prepare
from jax_flash.reference import reference_attention
from pallas_kernels import masking
from pallas_kernels.config import BlockSizes
from pallas_kernels.extras import Extras
from pallas_kernels.scores import Scores
from pallas_kernels.flash_bwd import flash_backward
from pallas_kernels.flash_fwd import flash_forward
from pallas_kernels.flash_fwd_v1 import flash_forward_v1


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static about one call: the custom_vjp's one nondiff argument."""
  scores: Scores
  mask: masking.Mask
  block_sizes: BlockSizes
  version: int
  interpret: bool


def _plain_forward(q, k, v, cfg: _Config):
  forward = flash_forward if cfg.version == 2 else flash_forward_v1
  return forward(q, k, v, Extras(), scores=cfg.scores, mask=cfg.mask,
                 block_sizes=cfg.block_sizes, interpret=cfg.interpret)


def _plain_backward(q, k, v, o, lse2, do, dlse2, cfg: _Config):
  dq, dk, dv, _ = flash_backward(
      q, k, v, Extras(), o, lse2, do, dlse2, scores=cfg.scores, mask=cfg.mask,
      block_sizes=cfg.block_sizes, interpret=cfg.interpret)
  return dq, dk, dv


# Without optional operands (static masks and score modifications only),
# batch- and head-sharded inputs run shard by shard: see `_sharding`.
_sharded_forward = _sharding.sharded_forward(_plain_forward)
_sharded_backward = _sharding.sharded_backward(_plain_backward)


def _partitioned(extras) -> bool:
  """Use the batch/head-partitioned op: several devices, no optional operands.

  (On one device there is nothing to partition, and the plain call also
  lowers ahead of time for a GPU that is not present.)
  """
  return jax.device_count() > 1 and all(x is None for x in jax.tree.leaves(
      extras, is_leaf=lambda x: x is None))


def _forward(q, k, v, extras, cfg: _Config):
  if _partitioned(extras):
    return _sharded_forward(q, k, v, cfg)
  forward = flash_forward if cfg.version == 2 else flash_forward_v1
  return forward(q, k, v, extras, scores=cfg.scores, mask=cfg.mask,
                 block_sizes=cfg.block_sizes, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, extras: Extras, cfg: _Config):
  """(o [B,T,N,H], lse2 [B,N,T] base-2 logsumexp) with the kernels' backward."""
  return _forward(q, k, v, extras, cfg)


def _flash_fwd(q, k, v, extras, cfg: _Config):
  o, lse2 = _forward(q, k, v, extras, cfg)
  return (o, lse2), (q, k, v, extras, o, lse2)


def _flash_bwd(cfg: _Config, residuals, cotangents):
  q, k, v, extras, o, lse2 = residuals
  do, dlse2 = cotangents
  if _partitioned(extras):
    dq, dk, dv = _sharded_backward(q, k, v, o, lse2, do.astype(q.dtype),
                                   dlse2, cfg)
    return dq, dk, dv, extras
  dq, dk, dv, dbias = flash_backward(
      q, k, v, extras, o, lse2, do.astype(q.dtype), dlse2, scores=cfg.scores,
      mask=cfg.mask, block_sizes=cfg.block_sizes, interpret=cfg.interpret)
  # Ids, the dense mask, the ALiBi slopes and the seed get no gradient.
  d_extras = jax.tree.map(jnp.zeros_like, extras)
  if dbias is not None:
    d_extras = dataclasses.replace(d_extras,
                                   bias=dbias.astype(extras.bias.dtype))
  return dq, dk, dv, d_extras


_flash.defvjp(_flash_fwd, _flash_bwd)


def _on_gpu(x) -> bool:
  try:
    return any(d.platform == "gpu" for d in x.devices())
  except Exception:  # A tracer: it lives where the computation runs.
    return jax.default_backend() == "gpu"


def _gpu_target() -> bool:
  """A GPU to run on, or one to compile for (an abstract mesh's device)."""
  if jax.default_backend() == "gpu":
    return True
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform == "gpu"


def _resolve_implementation(implementation, query) -> str:
  if implementation is None:
    return "pallas" if _on_gpu(query) else "xla"
  if implementation not in _checks.IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {_checks.IMPLEMENTATIONS} or None, "
        f"got {implementation!r}")
  if implementation == "pallas" and not _gpu_target():
    raise ValueError(
        "implementation='pallas' runs the Triton kernels and needs a GPU; on "
        "this machine use implementation='interpret' (same kernels, "
        "interpreted) or 'xla'")
  return implementation


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None,
                    is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None,
                    alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                    dropout_broadcast=False, return_residual=False,
                    implementation=None, block_sizes=None, version=2):
  """Exact attention, softmax(scale * Q K^T) V, without the T x S matrix in memory.

  A superset of `jax.nn.dot_product_attention`: same arguments, shapes and
  results, so either can replace the other.

  Letters: B batch, T query length, S key/value length, N query heads,
  K key/value heads (K divides N: MHA K = N, GQA, MQA K = 1), H head dim.

  Args:
    query: [B, T, N, H] or [T, N, H].
    key: [B, S, K, H] or [S, K, H]. Query head n attends with key/value head
      n // (N // K); keys are never repeated in memory.
    value: same shape as key.
    bias: float, broadcastable to [B, N, T, S] (dims of 1 broadcast), added
      to the logits; read tile by tile. Its gradient has the bias's shape.
    mask: bool, broadcastable to [B, N, T, S]; True = attend. Read tile by
      tile (never expanded in memory).
    scale: multiplies the scores; default 1 / sqrt(H). A static number.
    is_causal: query i attends to keys j <= i, aligned top-left when T != S
      (as jax.nn does). For T=3, S=5 the visible pairs are::

          1 0 0 0 0
          1 1 0 0 0
          1 1 1 0 0

      Key tiles entirely above the diagonal are never loaded.
    query_seq_lengths, key_value_seq_lengths: int [B]; positions at and past
      a length are padding (queries there output 0, keys there are unseen).
      Key tiles past a length are skipped.
    local_window_size: int w or (left, right), static; query i sees keys
      i - left <= j <= i + right (None: unbounded on that side), as in jax.nn.
      Key tiles outside the band are skipped: cost grows with T x window.
    segment_ids: int [B, T] for self-attention, or a pair (q_segment_ids
      [B, T], kv_segment_ids [B, S]): a query sees only keys with the same id
      (packed documents). Pairs of tiles whose id ranges do not overlap are
      skipped. Ids must be > -2**31 + 1 (the two lowest are padding).
    logits_soft_cap: float c > 0; logits become c * tanh(logits / c) (before
      ALiBi, bias and masking), forward and backward.
    alibi_slopes: float [N] or [B, N]; adds -slope * |i - j| to the logits,
      computed in the kernel. Treated as constants (no gradient).
    dropout_rate, dropout_rng: dropout on the attention probabilities with a
      static rate in [0, 1) and a jax.random key. The keep bits come from a
      counter-based hash of (rng, batch, head, row, column), regenerated in
      the backward, never stored; the same rng gives the same result, and the
      output is unbiased (kept probabilities are scaled by 1 / (1 - rate)).
      `jax_flash.dropout_keep_mask` returns the same bits, densely.
    dropout_broadcast: one keep mask shared by every batch element and head
      (flax's `broadcast_dropout`); the bits of batch 0, head 0.
    return_residual: also return the logsumexp of the scaled scores,
      [B, T, N] (or [T, N]), natural log.
    implementation: None picks "pallas" when query lives on a GPU and "xla"
      otherwise. "pallas": the Triton-lowered kernels (GPU only).
      "interpret": the same kernels run by the Pallas interpreter (any
      backend, slow; for tests). "xla": `reference_attention`, plain jnp.
    block_sizes: a `jax_flash.BlockSizes` for the kernels; default
      `BlockSizes.get_default(H, dtype, is_causal, version)`.
    version: 2 runs the FlashAttention-2 forward; 1 the FlashAttention-1
      forward (for comparison). Both share the FlashAttention-2 backward.

  Returns:
    out: like query, in query.dtype; or `(out, logsumexp)`.

  A query row that sees no key at all (all masked) outputs 0, with
  logsumexp -inf and zero gradients, never NaN. (jax.nn returns the mean of V
  there.)

  The kernels take float32, bfloat16 and float16 with float32 accumulation
  (float32 inputs use full-precision float32 dots), head dims 16 to 256 (any,
  padded internally to a power of two) and any T and S. Gradients with respect
  to query, key and value are deterministic (no atomics). Errors in the
  arguments are raised at trace time as ValueError.
  """
  args = dict(bias=bias, mask=mask, scale=scale, is_causal=is_causal,
              query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths,
              local_window_size=local_window_size, segment_ids=segment_ids,
              logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
              dropout_rate=dropout_rate, dropout_rng=dropout_rng,
              dropout_broadcast=dropout_broadcast)
  spec = prepare(query, key, value, **args)
  p = spec.problem
  _checks.check_options(block_sizes, version)
  implementation = _resolve_implementation(implementation, query)
  if implementation == "xla":
    return reference_attention(query, key, value, return_residual=return_residual,
                               **args)
  _checks.check_kernel_support(p, query.dtype)
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(p.head_dim, query.dtype, is_causal,
                                         version)
  cfg = _Config(scores=spec.scores, mask=spec.mask,
                block_sizes=block_sizes.clipped(p.q_len, p.kv_len),
                version=version, interpret=implementation == "interpret")
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  with jax.named_scope("jax_flash_attention"):
    out, lse2 = _flash(query, key, value, spec.extras, cfg)
  lse = (lse2 * math.log(2.0)).transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
