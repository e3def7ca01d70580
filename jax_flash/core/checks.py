"""Trace-time validation of the public arguments, shared by every implementation.

Each check raises `ValueError` naming the argument and the expected shape or
dtype. What a particular backend can run (head dims, dtypes) is that
backend's business: see `jax_flash._dispatch`.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.core.problem import Problem


def _shape(x, name):
  shape = getattr(x, "shape", None)
  if shape is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(shape)


def check_qkv(query, key, value) -> Problem:
  """Checks ranks, shapes and dtypes of query [B,T,N,H]|[T,N,H], key
  [B,S,K,H]|[S,K,H] and value [B,S,K,Hv]|[S,K,Hv] (Hv may differ from H)."""
  qs, ks, vs = _shape(query, "query"), _shape(key, "key"), _shape(value, "value")
  if len(qs) not in (3, 4):
    raise ValueError(
        f"query must have shape [batch, q_len, num_heads, head_dim] or "
        f"[q_len, num_heads, head_dim], got shape {qs}")
  expected = ("[batch, kv_len, num_kv_heads, head_dim]" if len(qs) == 4 else
              "[kv_len, num_kv_heads, head_dim]")
  for name, s in (("key", ks), ("value", vs)):
    if len(s) != len(qs):
      raise ValueError(
          f"{name} must have the same rank as query ({len(qs)}): expected "
          f"{expected}, got shape {s}")
  if ks[:-1] != vs[:-1]:
    raise ValueError(f"value must have the shape of key {ks} but for its last "
                     f"dim (its own head dim), got {vs}")
  unbatched = len(qs) == 3
  if unbatched:
    qs, ks = (1,) + qs, (1,) + ks
  b, t, n, h = qs
  kb, s, k, kh = ks
  if kb != b:
    raise ValueError(f"key batch size {kb} must equal query batch size {b} "
                     f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
  if kh != h:
    raise ValueError(f"key head_dim {kh} must equal query head_dim {h} "
                     f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
  hv = vs[-1]
  if min(n, k, h, hv) < 1:
    raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} "
                     f"and value {tuple(value.shape)} must have heads and "
                     "head dims of size 1 or more")
  if n % k:
    raise ValueError(
        f"key num_kv_heads={k} must divide query num_heads={n} "
        "(MHA: equal, GQA: a divisor, MQA: 1)")
  dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
  if len(dtypes) != 1:
    raise ValueError(
        "query, key and value must share one dtype, got "
        f"query {query.dtype}, key {key.dtype}, value {value.dtype}")
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise ValueError(f"query dtype must be floating point, got {query.dtype}")
  return Problem(b, t, s, n, k, h, unbatched, hv)


def common_rank(query, key, value):
  """(query, key, value) with one rank, as jax.nn takes them: where the
  query is batched ([B, T, N, H]) and key or value is not, that one is a
  batch of 1; where the query is not, a batched key or value of batch 1
  loses its batch axis. Other shapes are returned as they are (for
  `check_qkv` to name)."""
  ranks = [getattr(x, "ndim", None) for x in (query, key, value)]
  if len(set(ranks)) == 1 or not set(ranks) <= {3, 4}:
    return query, key, value
  if ranks[0] == 4:
    for name, x in (("key", key), ("value", value)):
      if x.ndim == 3 and query.shape[0] != 1:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} is unbatched: it goes with a "
            f"query of batch 1 (as in jax.nn), got query "
            f"{tuple(query.shape)}; pass [batch, kv_len, num_kv_heads, "
            "head_dim]")
    return query, *(x[None] if x.ndim == 3 else x for x in (key, value))
  for name, x in (("key", key), ("value", value)):
    if x.ndim == 4 and x.shape[0] != 1:
      raise ValueError(
          f"{name} of shape {tuple(x.shape)} has a batch of {x.shape[0]}; "
          f"an unbatched query {tuple(query.shape)} takes key and value of "
          "batch 1 or unbatched")
  return query, *(x[0] if x.ndim == 4 else x for x in (key, value))


def fold_traced_scale(query, scale):
  """(query, scale). A traced scale (jax.nn takes one; the kernels' is a
  compile-time constant) multiplies the query instead, since
  softmax((s q) k^T) = softmax(s (q k^T)), and the static scale becomes 1;
  its gradient flows through that product. A static scale (a Python or
  numpy number) is returned as it is."""
  if scale is None or isinstance(scale, (int, float, np.number, np.ndarray)):
    return query, scale
  if jnp.ndim(scale) != 0:
    raise ValueError(f"scale must be a scalar, got shape {jnp.shape(scale)}")
  if not jnp.issubdtype(jnp.result_type(scale), jnp.floating) and (
      not jnp.issubdtype(jnp.result_type(scale), jnp.integer)):
    raise ValueError(f"scale must be a real number, got {scale!r}")
  scaled = query * jnp.asarray(scale, jnp.float32)
  return scaled.astype(query.dtype), 1.0


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  try:
    value = float(scale)
  except Exception as e:  # A tracer, an array of many elements, ...
    raise ValueError(
        f"scale must be a static Python number, got {scale!r}") from e
  if not math.isfinite(value):
    raise ValueError(f"scale must be finite, got {scale!r}")
  return value




def x64_scope(query):
  """The precision the library traces a call in. With 64-bit types on
  (`jax_enable_x64`) and a query of 32 bits or fewer, they are off inside:
  index arithmetic stays int32, as every kernel's is, whatever the user's
  setting (the results are the same dtypes either way). A float64 query
  (the blockwise path's) keeps them on."""
  wide = jnp.dtype(getattr(query, "dtype", jnp.float32)).itemsize > 4
  return contextlib.nullcontext() if wide else jax.enable_x64(False)


def in_x64_scope(fn):
  """fn(query, ...) traced in `x64_scope(query)`."""
  @functools.wraps(fn)
  def wrapped(query, *args, **kwargs):
    with x64_scope(query):
      return fn(query, *args, **kwargs)
  return wrapped


def in_int32_scope(fn):
  """fn traced with 64-bit types off: it computes only int32 indices and
  tables (a flex block mask's), whatever `jax_enable_x64` says."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.enable_x64(False):
      return fn(*args, **kwargs)
  return wrapped


def int_array(x, name, shape, expected):
  if isinstance(x, (list, tuple)):  # As jax.nn takes them.
    try:
      x = np.asarray(x)
    except ValueError as e:
      raise ValueError(f"{name} must be an integer array of shape "
                       f"{expected}, got {x!r}") from e
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an integer array of shape {expected}, "
                     f"got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {expected} = {tuple(shape)}, "
                     f"got {tuple(x.shape)}")
  return x if x.dtype == jnp.int32 else jnp.asarray(x).astype(jnp.int32)


def check_lengths(lengths, name, p: Problem):
  """Sequence lengths: [B] (or [] / [1] for unbatched inputs) -> [B] or None."""
  if lengths is None:
    return None
  if p.unbatched and getattr(lengths, "ndim", None) == 0:
    lengths = lengths.reshape(1)
  return int_array(lengths, name, (p.batch,), "[batch]")


def check_query_offset(offset, p: Problem):
  """query_offset: a static int, or an int array [] or [B] ([] or [1]
  unbatched): the position of each sequence's first query among its keys.
  -> int32 [B], or None for a static 0 (or None)."""
  if offset is None:
    return None
  if isinstance(offset, (int, np.integer)) and not isinstance(offset, bool):
    if offset == 0:
      return None
    return jnp.full((p.batch,), offset, jnp.int32)
  if isinstance(offset, (list, tuple)):
    offset = np.asarray(offset)
  if getattr(offset, "ndim", None) == 0 or getattr(offset, "shape",
                                                   None) == (1,):
    if not jnp.issubdtype(offset.dtype, jnp.integer):
      raise ValueError(f"query_offset must have an integer dtype, got "
                       f"{offset.dtype}")
    return jnp.broadcast_to(jnp.asarray(offset).astype(jnp.int32).reshape(()),
                            (p.batch,))
  return int_array(offset, "query_offset", (p.batch,), "[batch] (or an int)")


def check_segment_ids(segment_ids, p: Problem):
  """[B, T] (self-attention) or ([B, T], [B, S]) -> (q_ids, kv_ids) or None."""
  if segment_ids is None:
    return None
  lead = () if p.unbatched else (p.batch,)
  b = "" if p.unbatched else "batch, "
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be an array or a pair "
                       "(q_segment_ids, kv_segment_ids)")
    q_ids, kv_ids = segment_ids
  else:
    if p.q_len != p.kv_len:
      raise ValueError(
          f"segment_ids as one array needs q_len == kv_len, got {p.q_len} "
          f"and {p.kv_len}; pass (q_segment_ids, kv_segment_ids)")
    q_ids = kv_ids = segment_ids
  q_ids = int_array(q_ids, "q_segment_ids", lead + (p.q_len,), f"[{b}q_len]")
  kv_ids = int_array(kv_ids, "kv_segment_ids", lead + (p.kv_len,),
                      f"[{b}kv_len]")
  if p.unbatched:
    q_ids, kv_ids = q_ids[None], kv_ids[None]
  return q_ids, kv_ids


def check_window(local_window_size):
  """int w -> (w, w); (left, right) with None for unbounded; static ints >= 0."""
  if local_window_size is None:
    return None, None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
      local_window_size, bool):
    window = (local_window_size, local_window_size)
  elif (isinstance(local_window_size, (tuple, list)) and
        len(local_window_size) == 2):
    window = tuple(local_window_size)
  else:
    raise ValueError(
        "local_window_size must be an int or a pair (left, right), got "
        f"{local_window_size!r}")
  for side in window:
    if side is not None and (
        not isinstance(side, (int, np.integer)) or isinstance(side, bool) or
        side < 0):
      raise ValueError(
          "local_window_size entries must be static ints >= 0 (or None for "
          f"unbounded), got {local_window_size!r}")
  return tuple(None if w is None else int(w) for w in window)


def check_pair_array(x, name, p: Problem, *, boolean: bool):
  """bias / mask: broadcastable to [B, N, T, S] ([N, T, S] unbatched).

  Returns it as 4-D [Bm, Nm, Tm, Sm] with each dim 1 or full, or None.
  """
  if x is None:
    return None
  full = (p.batch, p.num_heads, p.q_len, p.kv_len)
  expected = ("[batch, num_heads, q_len, kv_len]" if not p.unbatched else
              "[num_heads, q_len, kv_len]")
  shape = getattr(x, "shape", None)
  if shape is None:
    raise ValueError(f"{name} must be an array broadcastable to {expected}, "
                     f"got {type(x).__name__}")
  rank = 3 if p.unbatched else 4
  if len(shape) > rank:
    raise ValueError(f"{name} must have at most {rank} dims (broadcastable to "
                     f"{expected} = {full[4 - rank:]}), got shape {tuple(shape)}")
  shape4 = (1,) * (4 - len(shape)) + tuple(shape)
  for got, want in zip(shape4, full):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {tuple(shape)} is not broadcastable "
                       f"to {expected} = {full[4 - rank:]}")
  if boolean and x.dtype != jnp.bool_:
    raise ValueError(f"{name} must be boolean (True = attend), got {x.dtype}; "
                     "pass an additive mask as bias")
  if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got {x.dtype}")
  return x.reshape(shape4)


def check_soft_cap(cap):
  if cap is None:
    return None
  try:
    value = float(cap)
  except Exception as e:
    raise ValueError(f"logits_soft_cap must be a static Python number, got "
                     f"{cap!r}") from e
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"logits_soft_cap must be a finite number > 0, got {cap!r}")
  return value


def check_dropout(rate, rng):
  """A static rate in [0, 1); a PRNG key when the rate is > 0."""
  try:
    value = float(rate)
  except Exception as e:
    raise ValueError(f"dropout_rate must be a static Python number, got "
                     f"{rate!r}") from e
  if not 0.0 <= value < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
  if value > 0.0 and rng is None:
    raise ValueError("dropout_rate > 0 needs dropout_rng (a jax.random key)")
  return value


def check_alibi_slopes(slopes, p: Problem):
  """[N] or [B, N] ([N] unbatched) -> float32 [B, N], or None."""
  if slopes is None:
    return None
  shape = tuple(getattr(slopes, "shape", ()))
  if shape not in ((p.num_heads,), (p.batch, p.num_heads)) or (
      p.unbatched and shape != (p.num_heads,)):
    want = "[num_heads]" + ("" if p.unbatched else " or [batch, num_heads]")
    raise ValueError(f"alibi_slopes must have shape {want} with "
                     f"num_heads={p.num_heads}, got {shape}")
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be floating point, got {slopes.dtype}")
  return jnp.broadcast_to(slopes.astype(jnp.float32),
                          (p.batch, p.num_heads))


def check_sinks(sinks, p: Problem):
  """Per-head sink logits [N] -> float32 [N], or None."""
  if sinks is None:
    return None
  shape = tuple(getattr(sinks, "shape", ()))
  if shape != (p.num_heads,):
    raise ValueError(f"sinks must have shape [num_heads] = ({p.num_heads},), "
                     f"got {shape}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
  return sinks.astype(jnp.float32)


def check_block_field(blocks, name: str, ok, expected: str):
  """Raises ValueError naming `block_sizes.<name>` unless that field of a
  backend's BlockSizes is an int (not a bool) for which ok(value) holds;
  `expected` says what it must be ("a multiple of 64", ...)."""
  value = getattr(blocks, name)
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise ValueError(f"block_sizes.{name}={value!r} must be an int, "
                     f"{expected}")
  if not ok(value):
    raise ValueError(f"block_sizes.{name}={value!r} must be {expected}")
