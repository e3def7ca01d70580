"""`flash_attention(..., sequence_axis=name)` inside `jax.shard_map`: each
device holds a contiguous chunk of the sequences; the call is the whole
sequence's attention. By default by all_to_all (DeepSpeed-Ulysses): Q, K
and V exchange their sequence chunks for the whole sequence of 1 / P of
the heads, each device attends on those heads (the attention primitive,
per device whole), and the output goes back to sequence chunks. Every step
is a JAX collective or array op, so gradients, vmap and shard_map's checks
of varying values follow from JAX's own rules. With context_parallel
"ring" or "all_gather" the primitive itself runs that strategy's
per-device function on the chunks, the code a sequence-sharded call under
jit runs (`partition`), its collectives over the axis inside the
primitive's lowering."""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from jax_flash.context_parallel.collectives import localize
from jax_flash.core.options import Options


def _axis_size(axis) -> int:
  """P: the size of mesh axis (or axes) `axis` of the enclosing shard_map."""
  try:
    return lax.axis_size(axis)
  except NameError as e:
    raise ValueError(
        f"sequence_axis={axis!r} names no axis of an enclosing shard_map "
        f"(flash_attention with sequence_axis runs inside jax.shard_map "
        f"over that mesh axis): {e}") from None


def _pairs(x, name: str, num_heads: int, q_chunk: int, kv_chunk: int,
           kv_len: int, p: int):
  """(a bias or mask as 4-D, its `localize` factors): x
  broadcastable to [B, N, T / P, S] (its query rows a chunk, its keys
  whole), its dims of 1 factors of their own."""
  x = jnp.asarray(x)
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if x.shape[3] not in (1, kv_len):
    raise ValueError(
        f"{name} with sequence_axis: its key dim must be whole, {kv_len} "
        f"(P={p} chunks of {kv_chunk}) or 1, got shape {x.shape}")
  if x.shape[2] not in (1, q_chunk):
    raise ValueError(
        f"{name} with sequence_axis: its query dim must be this device's "
        f"chunk, {q_chunk}, or 1, got shape {x.shape}")
  heads = "n" if x.shape[1] == num_heads and num_heads > 1 else "u"
  return x, f"u {heads} {'t' if x.shape[2] > 1 else 'u'} u"


def attend(attention, query, key, value, options: Options):
  """attention(q, k, v, options, head_offset=...) on the whole sequence of
  this device's heads, from and to sequence chunks over
  `options.sequence_axis`."""
  axis, context_parallel = options.sequence_axis, options.context_parallel
  p = _axis_size(axis)
  if context_parallel in ("ring", "all_gather"):
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
      if getattr(options, name) is not None:
        raise ValueError(
            f"{name} with sequence_axis and context_parallel="
            f"{context_parallel!r}: lengths would count this chunk's "
            f"positions; pass segment ids, or context_parallel="
            f"'all_to_all'")
    for name in ("bias", "mask"):
      if getattr(options, name) is not None:
        raise ValueError(
            f"{name} with sequence_axis and context_parallel="
            f"{context_parallel!r}: not taken there; context_parallel="
            f"'all_to_all' takes it")
    return attention(query, key, value, options)
  if context_parallel not in ("auto", "all_to_all"):
    raise ValueError(
        f"context_parallel={context_parallel!r} with sequence_axis: inside "
        f"shard_map the sequence runs 'all_to_all' ('auto'), 'ring' or "
        f"'all_gather'")
  if query.ndim not in (3, 4) or key.ndim != query.ndim:
    raise ValueError(
        f"sequence_axis: query [B, T, N, H] or [T, N, H] and key of the same "
        f"rank, got {query.shape} and {key.shape}")
  seq, heads = query.ndim - 3, query.ndim - 2
  num_heads, kv_heads = query.shape[heads], key.shape[heads]
  if num_heads % p:
    raise ValueError(
        f"sequence_axis={axis!r}: all_to_all splits the query heads over "
        f"the axis's {p} devices, so N={num_heads} must be a multiple of "
        f"{p}")
  descale = options.descale
  if descale is not None and any(jnp.ndim(d) for d in descale):
    raise ValueError("sequence_axis with float8 inputs takes scalar "
                     "descales only")
  if kv_heads and num_heads % kv_heads == 0 and kv_heads % p:
    # Each device needs whole KV heads: repeat them up to lcm(K, P), which
    # divides N; query head n still attends with KV head n // (N // K).
    repeats = math.lcm(kv_heads, p) // kv_heads
    key, value = (jnp.repeat(x, repeats, axis=heads) for x in (key, value))
  kv_len = key.shape[seq] * p
  q_chunk = query.shape[seq]
  batch = "b " * (query.ndim - 3)
  to_heads = functools.partial(localize, seq=axis, p=p, to_heads=True)
  pairs = {}
  for name in ("bias", "mask"):
    x = getattr(options, name)
    if x is not None:
      x = to_heads(*_pairs(x, name, num_heads, q_chunk, key.shape[seq],
                           kv_len, p))
    pairs[name] = x
  segment_ids = options.segment_ids
  if segment_ids is not None:
    pair = isinstance(segment_ids, (tuple, list))
    ids = tuple(to_heads(jnp.asarray(x), "u " * (jnp.ndim(x) - 1) + "t")
                for x in (segment_ids if pair else (segment_ids,)))
    segment_ids = ids if pair else ids[0]
  per_head = {name: None if x is None or jnp.ndim(x) == 0 else
              to_heads(x, "u " * (jnp.ndim(x) - 1) + "n")
              for name, x in (("alibi_slopes", options.alibi_slopes),
                              ("sinks", options.sinks))}
  q, k, v = (to_heads(x, batch + "t n h") for x in (query, key, value))
  offset = lax.axis_index(axis) * (num_heads // p)
  out = attention(q, k, v, options.replace(
      **pairs, **per_head, segment_ids=segment_ids, context_parallel="auto",
      sequence_axis=None), head_offset=offset)
  to_chunks = lambda y, factors: localize(y, batch + factors, axis, p,
                                           to_heads=False)
  if options.return_residual:
    out, lse = out
    return to_chunks(out, "t n h"), to_chunks(lse, "t n")
  return to_chunks(out, "t n h")
