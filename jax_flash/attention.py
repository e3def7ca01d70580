"""`flash_attention`: the public entry point (checks, dispatch, the call of
the attention primitive, `_primitive`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash import _dispatch, _primitive, fa1
from jax_flash.context_parallel.sequence_axis import attend as attend_on_axis
from jax_flash.core import checks, device, dropout
from jax_flash.core import fp8 as fp8_lib
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.options import Options
from jax_flash.core.prepare import masks_as_ids, prepare, with_dense_kinds
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores


def config(plan: _dispatch.Plan, block_sizes, problem: Problem, dtype,
           mask: Mask, scores: Scores, *, is_causal: bool = False,
           version: int = 2, context_parallel: str = "auto",
           sequence_axis=None) -> _primitive.Config:
  """The static part of one call: its plan, mask, scores and tiles (with
  `version` 1, the forward's those of the FlashAttention-1 forward)."""
  configs = _dispatch.configure(plan, block_sizes, problem, dtype,
                                is_causal=is_causal, scores=scores, mask=mask)
  if version == 1:
    configs = dataclasses.replace(configs, forward=fa1.block_sizes(
        block_sizes, problem, dtype, is_causal=is_causal))
  return _primitive.Config(
      plan=plan, mask=mask, scores=scores, version=version,
      context_parallel=context_parallel, sequence_axis=sequence_axis,
      configs=configs)


def flash_call(query, key, value, operands: Operands, cfg: _primitive.Config):
  """(out [B, T, N, Hv], lse [B, N, T]) through the attention primitive:
  what `flash_attention` and the kernel path of `flex_attention` run (on a
  mesh with Explicit axes, with them as Auto ones: `device.on_auto_axes`)."""
  def bind(query, key, value, operands):
    with jax.named_scope("jax_flash_attention"):
      return _primitive.bind(query, key, value, operands, cfg)
  if cfg.sequence_axis is not None:  # Inside a shard_map: manual axes.
    return bind(query, key, value, operands)
  return device.on_auto_axes(bind, query, key, value, operands)


def _empty(query, p: Problem, return_residual: bool):
  """The result of a call with no query or no key (jax.nn's): out zeros
  [B, T, N, Hv] (a row that sees no key outputs 0), logsumexp -inf."""
  out = jnp.zeros((p.batch, p.q_len, p.num_heads, p.value_head_dim),
                  query.dtype)
  lse = jnp.full((p.batch, p.q_len, p.num_heads), -jnp.inf, jnp.float32)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _as(result, out_dtype):
  """`result` (out, or (out, lse)) with out in out_dtype (None: as is)."""
  if out_dtype is None:
    return result
  if isinstance(result, tuple):
    return result[0].astype(out_dtype), result[1]
  return result.astype(out_dtype)


def _fp8_inputs(query, key, value, fp8, descale, out_dtype, implementation):
  """(query, key, value, out_dtype, fp8 operands) for an FP8 call:
  float8_e4m3fn inputs dequantized with `descale` as float32, or (`fp8`)
  inputs rounded to e4m3 with per-(batch, KV head) scales,
  straight-through, in `fp8.rounded_dtype` (`jax_flash.core.fp8`; by
  the kernels or ops `_dispatch.fp8_rounding` picks);
  out_dtype the result's (None for a call without FP8); the operands the
  e4m3 values and their scales (`Operands.fp8_q`, ...: batched), made
  once for the kernels that read them."""
  fp8_lib.check_fp8(fp8)
  e4m3 = {jnp.dtype(x.dtype) == fp8_lib.E4M3 for x in (query, key, value)}
  if e4m3 == {False}:
    if descale is not None or out_dtype is not None:
      raise ValueError("descale and out_dtype are for float8_e4m3fn query, "
                       "key and value; with other inputs use fp8=True")
    if fp8 is False:
      return query, key, value, None, {}
    checks.check_qkv(query, key, value)
    if jnp.dtype(query.dtype).itemsize > 4:
      raise ValueError(f"fp8 takes float32, bfloat16 or float16 inputs, got "
                       f"{query.dtype}")
    dtype, num_kv_heads = query.dtype, key.shape[-2]
    if fp8 == "rotate":
      r = fp8_lib.rotation(query.shape[-1])
      query, key = (x.astype(jnp.float32) @ r for x in (query, key))
    rounding = _dispatch.fp8_rounding(implementation, query)
    parts = [fp8_lib.rounded(_batch(x), num_kv_heads, rounding)
             for x in (query, key, value)]
    values = [_unbatch(v.astype(fp8_lib.rounded_dtype(dtype)), query.ndim)
              for v, _, _ in parts]
    e4m3_values = [x8 for _, x8, _ in parts]
    scales = [s for _, _, s in parts]
    return (*values, dtype, fp8_lib.as_operands(*e4m3_values, scales))
  if e4m3 != {True}:
    raise ValueError(f"query, key and value must all be float8_e4m3fn or "
                     f"none of them, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}")
  if descale is None:
    raise ValueError("float8_e4m3fn query, key and value need descale=("
                     "q_descale, k_descale, v_descale)")
  if fp8 == "rotate":
    raise ValueError("fp8='rotate' rotates inputs before they are quantized; "
                     "float8_e4m3fn inputs are quantized already")
  p = checks.check_qkv(query, key, value)
  scales = fp8_lib.check_descale(descale, p.batch, p.num_kv_heads)
  e4m3_values = [_batch(fp8_lib.no_gradient(x)) for x in (query, key, value)]
  values = [_unbatch(fp8_lib.dequantize(x8, scale, p.num_kv_heads),
                     query.ndim) for x8, scale in zip(e4m3_values, scales)]
  return (*values, jnp.dtype(out_dtype or jnp.bfloat16),
          fp8_lib.as_operands(*e4m3_values, scales))


def _fold_scale(query, scale, descale):
  """(query, scale, descale) with a traced scale folded in
  (`checks.fold_traced_scale`) before any FP8 rounding, so that the e4m3
  values a kernel reads are those of the scaled query: float8 inputs take
  it into the query's descale instead."""
  if (descale is not None and isinstance(descale, (tuple, list))
      and len(descale) == 3 and jnp.dtype(query.dtype) == fp8_lib.E4M3):
    factor, folded = checks.fold_traced_scale(jnp.ones((), jnp.float32),
                                              scale)
    if folded is scale:  # Static (or None): nothing to fold.
      return query, scale, descale
    return query, folded, (descale[0] * factor, *descale[1:])
  query, scale = checks.fold_traced_scale(query, scale)
  return query, scale, descale


def _batch(x):
  """x [B, L, N, H], or [L, N, H] as [1, L, N, H]."""
  return x[None] if x.ndim == 3 else x


def _unbatch(x, ndim: int):
  """The inverse of `_batch` for inputs of `ndim` dims."""
  return x[0] if ndim == 3 else x


@checks.in_x64_scope
def flash_attention(query, key, value, bias=None, mask=None, *, scale=None,
                    is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None,
                    alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                    dropout_broadcast=False, sinks=None, query_offset=None,
                    return_residual=False, implementation=None,
                    block_sizes=None, version=2, fp8=False, descale=None,
                    out_dtype=None, context_parallel="auto",
                    sequence_axis=None):
  """Exact attention, softmax(scale * Q K^T) V, without the T x S matrix in memory.

  A superset of `jax.nn.dot_product_attention`: same arguments, shapes and
  results, so either can replace the other.

  Letters: B batch, T query length, S key/value length, N query heads,
  K key/value heads (K divides N: MHA K = N, GQA, MQA K = 1), H head dim.

  Args:
    query: [B, T, N, H] or [T, N, H].
    key: [B, S, K, H] or [S, K, H]. Query head n attends with key/value head
      n // (N // K); keys are never repeated in memory.
    value: same shape as key. As in jax.nn, a [S, K, H] key or value goes
      with a query of batch 1 ([1, T, N, H]), and a [1, S, K, H] one with
      an unbatched query; the output has the query's rank.
    bias: float, broadcastable to [B, N, T, S] (dims of 1 broadcast), added
      to the logits; read tile by tile. Its gradient has the bias's shape.
    mask: bool, broadcastable to [B, N, T, S]; True = attend. Read tile by
      tile (never expanded in memory). A padding mask, varying along one
      sequence axis only ([B, 1, 1, S] or [B, 1, T, 1]), becomes ids as
      lengths do: its masked tiles are skipped, and masked keys or queries
      may hold NaN.
    scale: multiplies the scores; default 1 / sqrt(H). A Python number is
      a constant of the kernels; a traced scalar multiplies the query
      instead (the same softmax; it gets a gradient).
    is_causal: query i attends to keys j <= i, aligned top-left when T != S
      (as jax.nn does; `query_offset` moves the queries). For T=3, S=5 the
      visible pairs are::

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
    alibi_slopes: float [N] or [B, N]; adds -slope * abs(i - j) to the logits,
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
    query_offset: an int, or int [B]: the position of each sequence's
      first query among the keys (default 0). Query i sits at position
      i + query_offset[b] for the causal mask, windows, ALiBi and dropout's
      bits; S - T aligns a causal mask bottom-right, as FlashAttention-2
      does, for a chunk of new queries against a cache that holds the
      chunk's keys last (chunked prefill). Any int32; a query that sees no
      key outputs 0. Not with `sequence_axis`.
    return_residual: also return the logsumexp of the scaled scores,
      [B, T, N] (or [T, N]), natural log, float32 whatever the inputs'
      dtype (jax.nn gives the inputs' dtype; a bfloat16 logsumexp is off
      by up to 2**-8 of its value, 0.06 at 16, enough to skew the
      merge of partial results it exists for).
    implementation: None picks "pallas" when query lives on a GPU and a
      Pallas backend takes the call, "xla" otherwise. "pallas": the best
      Pallas backend for the device and call (GPU only): the Mosaic GPU
      kernels on an H100/H200 where they take the call, else the Triton
      kernels (up to 320 keys also for a forward or backward around
      which XLA would copy arrays for the Mosaic kernels). "mosaic": the Mosaic GPU kernels, forward and backward
      (Hopper only; bf16/fp16, head dims up to 256, causal,
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
      forward (for comparison: a Triton kernel, so on a GPU or with
      implementation="interpret"; no sinks, fp8 or value head dim of its
      own). Both share the FlashAttention-2 backward.
    fp8: True quantizes query, key and value to float8_e4m3fn with a scale
      per (batch, KV head), and the probabilities before P V, as
      `jax_flash.core.fp8` describes; "rotate" first multiplies query and
      key by one orthogonal matrix along the head dim (incoherent
      processing: less error with outlier features). Output and gradients
      (straight-through) in the inputs' dtype. On an H100/H200 the Mosaic
      GPU FP8 kernels run it (causal or no mask, head dims 64, 128 and
      256; docs/fp8.md), elsewhere the blockwise path ("xla").
    descale: for float8_e4m3fn query, key and value: (q_descale,
      k_descale, v_descale), float32 scalars or arrays broadcastable to
      [B, K]; the inputs' values are x * descale. Forward only.
    out_dtype: the output's dtype for float8 inputs (default bfloat16).
    context_parallel: for query (and key) sharded along the sequence under
      jit: "all_to_all" (heads exchanged for the sequence), "all_gather"
      (keys and values gathered, queries kept), "ring" (key/value chunks
      passed around; causal or full masks or causal windows, T = S),
      "ring_all_to_all" (the sequence over several mesh axes: all_to_all
      over the last, a ring over the others) or "auto" (whichever of the
      others moves the fewest bytes among those that hold at most twice
      the least memory: docs/devices.md). A strategy
      named that cannot run the call's arguments (ring with a mask or a
      bias, ...) is a ValueError at trace time on several
      devices; one that cannot run the inputs' sharding warns as the
      call compiles and the cheapest that can runs it.
    sequence_axis: inside `jax.shard_map`, the name of the mesh axis (or a
      tuple of names) the sequences are split over, in contiguous chunks:
      query [B, T / P, N, H], key and value [B, S / P, K, H] on each of the
      axis's P devices; the call is then the whole sequence's attention
      (context parallelism: all_to_all, heads exchanged for the sequence;
      N divisible by P, key/value heads repeated up to a multiple of P
      where K is not; or with context_parallel "ring" or "all_gather"
      that strategy, without a bias, a mask, lengths or jvp). Segment ids
      and a bias's or mask's query rows are chunks as the query is (their
      keys whole); per-head arrays, lengths and dropout are the whole
      call's. Output (and logsumexp) chunks like the query's.

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
  return attend(query, key, value, Options(
      bias=bias, mask=mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      dropout_broadcast=dropout_broadcast, sinks=sinks,
      query_offset=query_offset, return_residual=return_residual,
      implementation=implementation, block_sizes=block_sizes,
      version=version, fp8=fp8, descale=descale, out_dtype=out_dtype,
      context_parallel=context_parallel, sequence_axis=sequence_axis))


@checks.in_x64_scope
def attend(query, key, value, options: Options):
  """`flash_attention(query, key, value, **options)`, its arguments
  already `Options` (the Flax modules build theirs once)."""
  query, key, value = checks.common_rank(query, key, value)
  if options.sequence_axis is not None:
    return attend_on_axis(_attention, query, key, value, options)
  return _attention(query, key, value, options)


def _attention(query, key, value, options: Options, head_offset=None):
  """`flash_attention` on one device's arrays; `head_offset` (traced int or
  None): the place of its first query head among the whole call's, where
  dropout's keep bits are drawn (`context_parallel.sequence_axis`); with
  `options.sequence_axis`, the arrays are chunks of the sequence over that
  shard_map axis, run by the ring or all_gather `options.context_parallel`
  names (`context_parallel.sequence_axis`)."""
  o = options
  query, scale, descale = _fold_scale(query, o.scale, o.descale)
  query, key, value, out_dtype, fp8_operands = _fp8_inputs(
      query, key, value, o.fp8, descale, o.out_dtype, o.implementation)
  spec = prepare(query, key, value, o.replace(scale=scale, descale=descale))
  spec = dataclasses.replace(spec, operands=dataclasses.replace(
      spec.operands, **fp8_operands))
  seed = spec.operands.dropout_seed
  if head_offset is not None and seed is not None and not o.dropout_broadcast:
    spec = dataclasses.replace(spec, operands=dataclasses.replace(
        spec.operands, dropout_seed=dropout.shifted(seed, 0, head_offset)))
  p = spec.problem
  _dispatch.check_block_sizes(o.block_sizes)
  if p.batch * p.q_len * p.kv_len == 0:
    return _as(_empty(query, p, o.return_residual), out_dtype)
  spec = with_dense_kinds(masks_as_ids(spec))
  implementation = o.implementation
  if o.version == 1:  # Planned as FlashAttention-2 on the Triton kernels.
    implementation = fa1.plan_implementation(implementation,
                                             device.on_gpu(query))
    why = fa1.unsupported(p, spec.scores)
    if why:
      raise ValueError(why)
  plan = _dispatch.select(implementation, query, p, query.dtype,
                          mask=spec.mask, scores=spec.scores,
                          operands=spec.operands)
  if p.unbatched:
    query, key, value = query[None], key[None], value[None]
  cfg = config(plan, o.block_sizes, p, query.dtype, spec.mask, spec.scores,
               is_causal=o.is_causal, version=o.version,
               context_parallel=o.context_parallel,
               sequence_axis=o.sequence_axis)
  out, lse = flash_call(query, key, value, spec.operands, cfg)
  lse = lse.transpose(0, 2, 1)
  if p.unbatched:
    out, lse = out[0], lse[0]
  return _as((out, lse) if o.return_residual else out, out_dtype)
