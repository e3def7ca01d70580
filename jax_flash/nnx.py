"""Flash attention for `flax.nnx`: a drop-in `attention_fn` and module.

    layer = nnx.MultiHeadAttention(..., attention_fn=jax_flash.nnx.dot_product_attention)
    layer = jax_flash.nnx.FlashAttention(...)   # same arguments, same parameters

Both keep the model's parameters (names, shapes) and checkpoints: only the
attention between the projections changes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_flash import _dispatch, attention
from jax_flash.core.options import Options
from jax_flash.decode import flash_decode


def attend(query, key, value, options: Options):
  """flax's attention_fn contract on top of `flash_attention`: query
  [batch..., T, N, H], key/value [batch..., S, K, H], `options.bias` and
  `options.mask` broadcastable to [batch..., N, T, S]. Any number of batch
  dims (flattened into one for the kernels)."""
  batch_dims = query.shape[:-3]
  bias, mask = options.bias, options.mask
  if len(batch_dims) != 1:
    flat = math.prod(batch_dims)

    def flatten(x, rank):
      if x is None:
        return None
      x = x.reshape((1,) * (len(batch_dims) + rank - x.ndim) + x.shape)
      lead = x.shape[:len(batch_dims)]
      if all(d == 1 for d in lead):
        return x.reshape((1,) + x.shape[len(batch_dims):])
      x = jnp.broadcast_to(x, batch_dims + x.shape[len(batch_dims):])
      return x.reshape((flat,) + x.shape[len(batch_dims):])

    query, key, value = (x.reshape((flat,) + x.shape[-3:])
                         for x in (query, key, value))
    bias, mask = flatten(bias, 3), flatten(mask, 3)
  if mask is not None:
    mask = mask.astype(jnp.bool_)
  out = attention.attend(query, key, value,
                         options.replace(bias=bias, mask=mask))
  return out.reshape(batch_dims + out.shape[-3:])


def module_options(**options) -> Options:
  """A module's options (`implementation`, `block_sizes`, `fp8`,
  `context_parallel`, ...), checked when it is built (not at its first
  call)."""
  options = Options(**options)
  _dispatch.check_block_sizes(options.block_sizes)
  return options


def check_sow_weights(module, sinks):
  """sow_weights=True (a `module` to sow into) runs flax's own attention,
  which has no sinks: refuse the pair."""
  if module is not None and sinks is not None:
    raise ValueError("sow_weights=True runs flax's own attention, which has "
                     "no sinks")


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None,
                          promote_dtype=dtypes.promote_dtype,
                          is_causal: bool = False, *, implementation=None,
                          block_sizes=None, sinks=None, fp8=False,
                          context_parallel="auto", sequence_axis=None):
  """Drop-in for `flax.nnx.dot_product_attention`, computed by flash attention.

  Takes every argument nnx passes. `is_causal` skips the masked tiles instead
  of building a T x S mask; dense masks (`nnx.make_causal_mask`, padding
  masks) and biases are read tile by tile; dropout (with `broadcast_dropout`
  sharing one keep mask across batch and heads) happens inside the kernel, with
  its own keep bits (a different random stream from flax's). `precision` is
  not used: the kernels accumulate in float32 (float32 inputs get full float32
  dots). With `module` set (nnx's `sow_weights=True`, which needs the T x S
  attention weights), it falls back to flax's own implementation.

  `implementation`, `block_sizes`, `sinks`, `fp8`, `context_parallel` and
  `sequence_axis` are passed to `flash_attention`.
  """
  check_sow_weights(module, sinks)
  if module is not None:
    return nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng,
        dropout_rate, deterministic, dtype, precision, module, promote_dtype,
        is_causal)
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  use_dropout = dropout_rate > 0.0 and not deterministic
  if use_dropout and dropout_rng is None:
    raise ValueError("dropout_rate > 0 with deterministic=False needs "
                     "dropout_rng")
  return attend(query, key, value, Options(
      bias=bias, mask=mask, is_causal=is_causal,
      dropout_rate=dropout_rate if use_dropout else 0.0,
      dropout_rng=dropout_rng if use_dropout else None,
      dropout_broadcast=broadcast_dropout, sinks=sinks,
      implementation=implementation, block_sizes=block_sizes, fp8=fp8,
      context_parallel=context_parallel, sequence_axis=sequence_axis))


class FlashAttention(nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` with flash attention inside.

  Same constructor (GQA via `num_kv_heads`, dropout, `decode` with a KV cache
  through `init_cache`), same parameters, so a model swaps it in and keeps its
  checkpoint. Extra keyword arguments: `implementation`, `block_sizes`,
  `fp8` (FP8 attention: `flash_attention`'s; decoding runs unquantized) and
  `context_parallel` (inputs sharded along the sequence) and
  `sequence_axis` (called inside shard_map on sequence chunks), for
  `flash_attention`, and `sinks=True`, which adds a parameter `sinks`
  [num_heads] (zeros at first): learned attention sinks (see
  `flash_attention`). Calls take `is_causal=True` without building a mask.
  In decode mode (self-attention, one batch dimension, no extra mask, no
  active dropout) the new tokens attend to the cache through `flash_decode`,
  reading only the filled part of the cache, and several tokens may be fed at
  once; other decode calls take flax's path.
  """

  def __init__(self, *args, implementation=None, block_sizes=None,
               sinks: bool = False, fp8=False, context_parallel="auto",
               sequence_axis=None, attention_fn=None, **kwargs):
    module_options(implementation=implementation, block_sizes=block_sizes,
                   fp8=fp8, context_parallel=context_parallel)
    if attention_fn is None:
      attention_fn = functools.partial(
          dot_product_attention, implementation=implementation,
          block_sizes=block_sizes, fp8=fp8,
          context_parallel=context_parallel, sequence_axis=sequence_axis)
    self.implementation = implementation
    super().__init__(*args, attention_fn=attention_fn, **kwargs)
    self.sinks = (nnx.Param(jnp.zeros((self.num_heads,), jnp.float32))
                  if sinks else None)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic=None, decode=None, **kwargs):
    decode = self.decode if decode is None else decode
    dropout = self.dropout_rate > 0.0 and not (
        deterministic if deterministic is not None else self.deterministic)
    if (not decode or inputs_k is not None or inputs_v is not None or
        mask is not None or dropout or inputs_q.ndim != 3 or kwargs.get(
            "sow_weights") or self.cached_key is None):
      return self._with_sinks(super().__call__, inputs_q, inputs_k, inputs_v,
                              mask=mask, deterministic=deterministic,
                              decode=decode, **kwargs)
    # Projections and the cache update as nnx.MultiHeadAttention does them,
    # then flash_decode over the filled part of the cache.
    sharding = kwargs.get("qkv_sharding")
    query = self.query(inputs_q, out_sharding=sharding)
    key = self.key(inputs_q, out_sharding=sharding)
    value = self.value(inputs_q, out_sharding=sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    index = self.cache_index[...]
    zero = jnp.zeros((), index.dtype)
    at = (zero, index, zero, zero)
    self.cached_key[...] = jax.lax.dynamic_update_slice(
        self.cached_key[...], key.astype(self.cached_key.dtype), at)
    self.cached_value[...] = jax.lax.dynamic_update_slice(
        self.cached_value[...], value.astype(self.cached_value.dtype), at)
    self.cache_index[...] = index + inputs_q.shape[1]
    lengths = jnp.full((inputs_q.shape[0],), index + inputs_q.shape[1],
                       jnp.int32)
    cached_key = self.cached_key[...].astype(query.dtype)
    cached_value = self.cached_value[...].astype(query.dtype)
    x = flash_decode(query, cached_key, cached_value, kv_lengths=lengths,
                     implementation=self.implementation,
                     sinks=None if self.sinks is None else self.sinks[...])
    return self.out(x, out_sharding=kwargs.get("out_sharding"))

  def _with_sinks(self, call, *args, **kwargs):
    """call(*args, **kwargs) with the sinks' current value bound into the
    attention function (flax calls it with a fixed set of arguments)."""
    if self.sinks is None:
      return call(*args, **kwargs)
    fn = self.attention_fn
    object.__setattr__(self, "attention_fn",
                       functools.partial(fn, sinks=self.sinks[...]))
    try:
      return call(*args, **kwargs)
    finally:
      object.__setattr__(self, "attention_fn", fn)
