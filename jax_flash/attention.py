"""`flash_attention`: the public entry point and its autodiff wiring (one
hijax primitive with reverse-mode, forward-mode and batching rules)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import hijax

from jax_flash import _dispatch, _sharding, blockwise
from jax_flash.spec import softmax
from jax_flash.spec.mask import Mask
from jax_flash.spec.operands import Operands
from jax_flash.spec.problem import masks_as_ids, prepare, with_dense_kinds
from jax_flash.spec.scores import Scores


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static about one call: the primitive's one parameter."""
  backend: object  # A backend of `_dispatch` (hashable).
  mask: Mask
  scores: Scores
  block_sizes: object  # The backend's config.
  version: int


def _plain_forward(q, k, v, cfg: _Config):
  return cfg.backend.forward(q, k, v, Operands(), mask=cfg.mask,
                             scores=cfg.scores, config=cfg.block_sizes,
                             version=cfg.version)


def _plain_backward(q, k, v, o, lse, do, dlse, cfg: _Config):
  dq, dk, dv, _ = cfg.backend.backward(
      q, k, v, Operands(), o, lse, do, dlse, mask=cfg.mask, scores=cfg.scores,
      config=cfg.block_sizes)
  return dq, dk, dv


# Without optional operands (static masks and score modifications only),
# batch- and head-sharded inputs run shard by shard: see `_sharding`.
_sharded_forward = _sharding.sharded_forward(_plain_forward)
_sharded_backward = _sharding.sharded_backward(_plain_backward)


def _partitioned(operands: Operands) -> bool:
  """Use the batch/head-partitioned op: several devices, no optional operands.

  (On one device there is nothing to partition, and the plain call also
  lowers ahead of time for a GPU that is not present.)
  """
  return jax.device_count() > 1 and operands.empty


def _forward(q, k, v, operands: Operands, cfg: _Config):
  if _partitioned(operands):
    return _sharded_forward(q, k, v, cfg)
  return cfg.backend.forward(q, k, v, operands, mask=cfg.mask,
                             scores=cfg.scores, config=cfg.block_sizes,
                             version=cfg.version)


SECOND_ORDER = (
    "flash_attention's derivatives cannot themselves be differentiated "
    "(grad of grad, jvp of grad, grad of jvp): its kernels and blockwise "
    "loops have no derivative of their own. For second-order derivatives "
    "use jax_flash.reference_attention (the same arguments; dense, T x S "
    "memory)")


@jax.custom_jvp
def _first_order_only(x):
  """The identity, whose derivative is a clear error: what flows through it
  (the backward's inputs) may not be differentiated again."""
  return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
  raise NotImplementedError(SECOND_ORDER)


class _FlashPrim(hijax.HiPrim):
  """(o [B, T, N, Hv], lse [B, N, T] natural log) of one call, as one JAX
  primitive (`jax.experimental.hijax`) with a rule per transformation:

  * evaluation and lowering: the backend's forward (`_forward`);
  * reverse mode (grad, vjp): the backend's backward (the kernels);
  * forward mode (jvp, linearize, and reverse mode under jax.checkpoint,
    which JAX derives from it): the primal from the backend and the tangent
    from `_FlashTangent`, linear in the input tangents, whose transpose is
    the backend's backward again;
  * vmap: a mapped axis folds into the batch axis (the same primitive on a
    larger batch) or, where an operand cannot fold (dropout, whose bits
    depend on the batch index; sinks or a score_mod's arrays that differ
    along the axis), the primitive runs once per slice (`lax.map`).
  """

  def __init__(self, q, k, v, operands: Operands, cfg: _Config):
    self.in_avals = jax.tree.map(jax.typeof, (q, k, v, operands))
    self.out_aval = _out_avals(q, v)
    self.params = dict(cfg=cfg)
    super().__init__()

  def expand(self, q, k, v, operands):
    return _forward(q, k, v, operands, self.cfg)

  def vjp_fwd(self, nzs_in, q, k, v, operands):
    del nzs_in
    o, lse = self(q, k, v, operands)
    return (o, lse), (q, k, v, operands, o, lse)

  def vjp_bwd_retval(self, residuals, cotangents):
    return _backward(self.cfg, residuals, _instantiate(cotangents))

  def jvp(self, primals, tangents):
    out = self(*primals)
    residuals, tangents = tuple(primals) + tuple(out), _instantiate(tangents)
    return out, _FlashTangent(residuals, tangents, self.cfg)(residuals,
                                                            tangents)

  lin, linearized = hijax.linearize_from_jvp

  def batch(self, axis_data, args, dims):
    size = axis_data.size
    q, k, v, operands = args
    # (Unmapped leaves have dim None, which jax.tree.leaves drops.)
    if self.cfg.scores.dropout or any(
        jax.tree.leaves(getattr(dims[3], name)) for name in _UNFOLDABLE):
      return _map_slices(
          lambda q, k, v, operands: _FlashPrim(q, k, v, operands, self.cfg)(
              q, k, v, operands), args, dims, size), (0, 0)
    (q, k, v), batch = _fold((q, k, v), dims[:3], size)
    operands = _fold_operands(operands, dims[3], size, batch)
    o, lse = _FlashPrim(q, k, v, operands, self.cfg)(q, k, v, operands)
    return ((o.reshape((size, batch) + o.shape[1:]),
             lse.reshape((size, batch) + lse.shape[1:])), (0, 0))


class _FlashTangent(hijax.HiPrim):
  """The tangents of (o, lse) at residuals (q, k, v, operands, o, lse) for
  input tangents (of q, k, v, operands): linear in the latter.

  Its value is `jax.jvp` of the blockwise forward (FlashAttention's loop
  carried with its tangents: one pass over the key tiles with the same
  online statistics, memory linear in the length); its transpose is the
  backend's backward (the kernels), which is how reverse mode reaches them
  when JAX derives it from forward mode. Its own derivatives are second
  order: a clear error."""

  def __init__(self, residuals, tangents, cfg: _Config):
    self.in_avals = jax.tree.map(jax.typeof, (residuals, tangents))
    self.out_aval = _out_avals(residuals[0], residuals[2])
    self.params = dict(cfg=cfg)
    super().__init__()

  def expand(self, residuals, tangents):
    config = (self.cfg.block_sizes
              if isinstance(self.cfg.block_sizes, blockwise.BlockSizes)
              else blockwise.BlockSizes())
    forward = functools.partial(blockwise.forward, mask=self.cfg.mask,
                                scores=self.cfg.scores, config=config)
    return jax.jvp(forward, residuals[:4], tangents)[1]

  def transpose(self, cotangents, residuals, tangent_accums):
    grads = _backward(self.cfg, residuals, _instantiate(cotangents))
    jax.tree.map(lambda acc, g: isinstance(acc, hijax.GradAccum) and
                 acc.accum(g), tangent_accums, grads,
                 is_leaf=lambda x: isinstance(x, hijax.GradAccum))

  def jvp(self, primals, tangents):
    raise NotImplementedError(SECOND_ORDER)

  def vjp_fwd(self, nzs_in, *args):
    raise NotImplementedError(SECOND_ORDER)

  def batch(self, axis_data, args, dims):
    return _map_slices(
        lambda residuals, tangents: _FlashTangent(
            residuals, tangents, self.cfg)(residuals, tangents),
        args, dims, axis_data.size), (0, 0)


def _out_avals(q, v):
  """Avals of (o [B, T, N, Hv], lse [B, N, T] float32)."""
  batch, q_len, num_heads, _ = q.shape
  return (hijax.ShapedArray((batch, q_len, num_heads, v.shape[-1]), q.dtype),
          hijax.ShapedArray((batch, num_heads, q_len), jnp.float32))


def _instantiate(tangents):
  """Symbolic zero tangents or cotangents as arrays."""
  return jax.tree.map(hijax.instantiate_zeros, tangents,
                      is_leaf=lambda t: isinstance(t, hijax.Zero))


# Operands without a batch axis: a vmapped one cannot fold into the batch.
_UNFOLDABLE = ("dropout_seed", "sinks", "mask_consts", "score_consts")
# Operands whose axis 0 is the batch (B), or broadcasts over it (1 or B).
_BATCH_AXIS = ("q_ids", "kv_ids", "alibi_slopes", "q_offsets")
_BROADCAST_BATCH_AXIS = ("bias", "dense_mask", "tile_kinds")


def _front(x, dim, size: int):
  """x with its mapped axis first (broadcast to `size` if unmapped)."""
  if dim is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, dim, 0)


def _fold(xs, dims, size: int):
  """[V, B, ...] -> [V * B, ...] for each x (V the mapped axis); (xs, B)."""
  fronts = [_front(x, d, size) for x, d in zip(xs, dims)]
  batch = fronts[0].shape[1]
  return [x.reshape((size * batch,) + x.shape[2:]) for x in fronts], batch


def _fold_operands(operands: Operands, dims: Operands, size: int, batch: int):
  """The operands with a mapped axis folded into (or tiled over) the batch
  axis; those that broadcast over the batch (axis 0 of size 1) and are not
  mapped stay as they are."""
  changes = {}
  for name in _BATCH_AXIS + _BROADCAST_BATCH_AXIS:
    x, d = getattr(operands, name), getattr(dims, name)
    if x is None or (d is None and name in _BROADCAST_BATCH_AXIS and
                     x.shape[0] == 1):
      continue
    x = _front(x, d, size)
    x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
    changes[name] = x.reshape((size * batch,) + x.shape[2:])
  return dataclasses.replace(operands, **changes)


def _map_slices(prim_call, args, dims, size: int):
  """prim_call(*args) on each slice along the mapped axes (`dims`), the
  outputs stacked along axis 0."""
  flat, tree = jax.tree.flatten(args)
  flat_dims = tree.flatten_up_to(dims)
  mapped = [i for i, d in enumerate(flat_dims) if d is not None]

  def one(slices):
    leaves = list(flat)
    for i, x in zip(mapped, slices):
      leaves[i] = x
    return prim_call(*jax.tree.unflatten(tree, leaves))

  return jax.lax.map(one, [jnp.moveaxis(flat[i], flat_dims[i], 0)
                           for i in mapped])


def _flash(q, k, v, operands: Operands, cfg: _Config):
  """(o [B,T,N,H], lse [B,N,T] natural-log logsumexp) with the kernels'
  backward and a forward-mode rule (`_FlashPrim`)."""
  return _FlashPrim(q, k, v, operands, cfg)(q, k, v, operands)


def _backward(cfg: _Config, residuals, cotangents):
  """(dq, dk, dv, operands' cotangents) from the backend's backward."""
  q, k, v, operands, o, lse = _first_order_only(residuals)
  do, dlse = _first_order_only(cotangents)
  do = do.astype(q.dtype)
  if _partitioned(operands):
    dq, dk, dv = _sharded_backward(q, k, v, o, lse, do, dlse, cfg)
    return dq, dk, dv, jax.tree.map(jnp.zeros_like, operands)
  dq, dk, dv, grads = _dispatch.backward(
      cfg.backend, q, k, v, operands, o, lse, do, dlse, mask=cfg.mask,
      scores=cfg.scores, config=cfg.block_sizes)
  grads = _dispatch.missing_gradients(q, k, v, operands, o, lse, do, dlse,
                                      grads, mask=cfg.mask, scores=cfg.scores)
  # Ids, the dense mask, the ALiBi slopes, the seed, the tile kinds and the
  # mask_mod's arrays get no gradient; the backend (or missing_gradients)
  # gives the bias's and the score_mod's arrays'.
  d_operands = jax.tree.map(jnp.zeros_like, operands)
  for name in ("bias", "score_consts"):
    if getattr(grads, name) is not None:
      d_operands = dataclasses.replace(d_operands,
                                       **{name: getattr(grads, name)})
  if operands.sinks is not None:
    d_operands = dataclasses.replace(
        d_operands, sinks=_sink_gradient(operands.sinks, o, lse, do, dlse))
  return dq, dk, dv, d_operands


def _sink_gradient(sinks, o, lse, do, dlse):
  """dL/dsinks [N]. The sink's probability in row i is p_i = exp(sink - L_i),
  and dL/dsink = -sum_i p_i (rowsum(dO_i * O_i) - dlse_i): the same D as the
  backward's dS = P (dP - D), since dL/dL_i enters through it."""
  delta = softmax.backward_delta(o, do, dlse)
  p_sink = jnp.exp(sinks[None, :, None] - lse)
  return -jnp.sum(p_sink * delta, axis=(0, 2))


def config(backend, block_sizes, problem, dtype, mask: Mask, scores: Scores,
           *, is_causal: bool = False, version: int = 2) -> _Config:
  """The static part of one call: its backend, mask, scores and tiles."""
  return _Config(backend=backend, mask=mask, scores=scores,
                 block_sizes=backend.config(block_sizes, problem, dtype,
                                            is_causal=is_causal,
                                            version=version, scores=scores,
                                            mask=mask),
                 version=version)


def flash_call(query, key, value, operands: Operands, cfg: _Config):
  """(out [B, T, N, Hv], lse [B, N, T]) through `_FlashPrim`: what
  `flash_attention` and the kernel path of `flex_attention` run."""
  with jax.named_scope("jax_flash_attention"):
    return _flash(query, key, value, operands, cfg)


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None,
                    is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None,
                    alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                    dropout_broadcast=False, sinks=None, return_residual=False,
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
      tile (never expanded in memory). A padding mask, varying along one
      sequence axis only ([B, 1, 1, S] or [B, 1, T, 1]), becomes ids as
      lengths do: its masked tiles are skipped, and masked keys or queries
      may hold NaN.
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
    sinks: float [N], a learned sink logit per query head (as in gpt-oss):
      one more term exp(sinks[n]) in the softmax's denominator, of a key
      whose value is 0; it gets a gradient. A row that sees no key then has
      logsumexp sinks[n] (and output 0).
    return_residual: also return the logsumexp of the scaled scores,
      [B, T, N] (or [T, N]), natural log.
    implementation: None picks "pallas" when query lives on a GPU and a
      Pallas backend takes the call, "xla" otherwise. "pallas": the best
      Pallas backend for the device and call (GPU only): the Mosaic GPU
      kernels on an H100/H200 where they take the call, else the Triton
      kernels. "mosaic": the Mosaic GPU kernels, forward and backward
      (Hopper only; bf16/fp16, head dims 64/96/128/192/256, causal,
      sliding windows, lengths, segment ids, dense masks, bias, soft-cap,
      ALiBi, sinks, dropout, flex mods that close over no array; with a
      bias per (query, key) pair the backward runs on the Triton kernels).
      "triton": the Triton-lowered kernels (GPU only). "interpret": the same
      kernels run by the Pallas interpreter (any machine, slow; for tests).
      "xla": FlashAttention in plain jnp (`jax_flash.blockwise`: loops
      over blocks, memory linear in the sequence length; any device, any
      head dim and floating dtype). A named implementation that cannot take
      the call raises ValueError saying why.
    block_sizes: a `jax_flash.BlockSizes` for the Triton kernels (default
      `BlockSizes.get_default(H, dtype, is_causal, version)`), a
      `jax_flash.MosaicBlockSizes` for the Mosaic GPU forward, or a
      `jax_flash.XlaBlockSizes` for "xla"; a backend ignores the others'.
    version: 2 runs the FlashAttention-2 forward; 1 the FlashAttention-1
      forward (for comparison). Both share the FlashAttention-2 backward.

  Returns:
    out: like query, in query.dtype; or `(out, logsumexp)`.

  A query row that sees no key at all (all masked) outputs 0, with
  logsumexp -inf and zero gradients, never NaN. (jax.nn returns the mean of V
  there.)

  The Triton kernels take float32, bfloat16 and float16 with float32
  accumulation (float32 inputs use full-precision float32 dots), head dims 16
  to 256 (any, padded internally to a power of two; up to 512 when named
  "triton", not yet compiled for a GPU) and any T and S.
  Gradients with respect to query, key and value are deterministic (no
  atomics). Errors in the arguments are raised at trace time as ValueError.
  """
  args = dict(bias=bias, mask=mask, scale=scale, is_causal=is_causal,
              query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths,
              local_window_size=local_window_size, segment_ids=segment_ids,
              logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
              dropout_rate=dropout_rate, dropout_rng=dropout_rng,
              dropout_broadcast=dropout_broadcast, sinks=sinks)
  spec = with_dense_kinds(masks_as_ids(prepare(query, key, value, **args)))
  p = spec.problem
  _dispatch.check_options(block_sizes, version)
  backend = _dispatch.select(implementation, query, p, query.dtype,
                             mask=spec.mask, scores=spec.scores,
                             version=version)
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  cfg = config(backend, block_sizes, p, query.dtype, spec.mask, spec.scores,
               is_causal=is_causal, version=version)
  out, lse = flash_call(query, key, value, spec.operands, cfg)
  lse = lse.transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
