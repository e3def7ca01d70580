"""`flash_decode`: a few new queries against a long (optionally paged) KV cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _checks
from jax_flash.attention import _resolve_implementation
from jax_flash.reference import decode_mask, reference_attention
from pallas_kernels.config import padded_head_dim
from pallas_kernels.flash_decode import flash_decode as _decode_kernel
from pallas_kernels.scores import Scores

MAX_DECODE_QUERIES = 64
_SMS = 132  # H100/H200 multiprocessors: fill them with (split, batch, head).


def _default_splits(batch, num_kv_heads, num_tiles):
  return int(max(1, min(num_tiles, -(-2 * _SMS // (batch * num_kv_heads)))))


def flash_decode(query, key_cache=None, value_cache=None, *, kv_lengths,
                 scale=None, logits_soft_cap=None, local_window_size=None,
                 num_splits=None, implementation=None, key_pages=None,
                 value_pages=None, page_table=None, return_residual=False):
  """Attention of the newest T tokens of each sequence against its KV cache.

  Args:
    query: [B, T, N, H], T small (1 to 64): the last T positions of each
      sequence. Query t of sequence b sees cache positions
      < kv_lengths[b] - T + t + 1 (so T = 1 sees the whole cache).
    key_cache, value_cache: [B, S_max, K, H], K dividing N (GQA: the group's
      query heads share one read of K/V). None when paged.
    kv_lengths: int [B], the cache length of each sequence, new tokens
      included. Tiles past a length are never read.
    scale, logits_soft_cap: as in `flash_attention`.
    local_window_size: int w or (left, right): query at position p sees
      p - left ... p (nothing lies to its right in a cache).
    num_splits: chunks each sequence's cache is split into (one program
      each, merged by logsumexp); default fills the GPU.
    key_pages, value_pages, page_table: a paged cache instead: pages
      [num_pages, page_size, K, H] and int32 page_table [B, pages_per_seq];
      page j of sequence b holds its positions j*page_size ... (j+1)*page_size-1.
      page_size is a power of two >= 16.
    implementation: as in `flash_attention`.
  Returns:
    out [B, T, N, H] in query.dtype, or (out, logsumexp [B, T, N]).
  Inference only: no gradient.
  """
  paged = page_table is not None
  if paged:
    if key_cache is not None or value_cache is not None:
      raise ValueError("pass either key_cache/value_cache or "
                       "key_pages/value_pages/page_table, not both")
    if key_pages is None or value_pages is None:
      raise ValueError("a paged cache needs key_pages, value_pages and "
                       "page_table")
    k, v = key_pages, value_pages
  else:
    if key_cache is None or value_cache is None:
      raise ValueError("flash_decode needs key_cache and value_cache (or "
                       "key_pages, value_pages and page_table)")
    k, v = key_cache, value_cache
  if getattr(query, "ndim", None) != 4:
    raise ValueError(f"query must have shape [batch, q_len, num_heads, "
                     f"head_dim], got {getattr(query, 'shape', None)}")
  batch, q_len, num_heads, head_dim = query.shape
  if q_len > MAX_DECODE_QUERIES:
    raise ValueError(f"query q_len={q_len} is more than flash_decode's "
                     f"{MAX_DECODE_QUERIES}; use flash_attention")
  if paged:
    page_table = _checks._int_array(
        page_table, "page_table", (batch, page_table.shape[-1]),
        "[batch, pages_per_seq]")
    page_size = k.shape[1]
    if page_size < 16 or page_size & (page_size - 1):
      raise ValueError(f"key_pages page_size={page_size} must be a power of "
                       "two >= 16")
    kv_len = page_table.shape[1] * page_size
    # Validate shapes like a contiguous cache of the same length.
    p = _checks.check_qkv(query, jax.ShapeDtypeStruct(
        (batch, kv_len) + k.shape[2:], k.dtype), jax.ShapeDtypeStruct(
            (batch, kv_len) + v.shape[2:], v.dtype))
    if k.shape != v.shape:
      raise ValueError(f"value_pages must have the shape of key_pages "
                       f"{k.shape}, got {v.shape}")
  else:
    p = _checks.check_qkv(query, k, v)
    kv_len = p.kv_len
  kv_lengths = _checks._int_array(kv_lengths, "kv_lengths", (batch,),
                                  "[batch]")
  scale = _checks.check_scale(scale, head_dim)
  cap = _checks.check_soft_cap(logits_soft_cap)
  left, _ = _checks.check_window(local_window_size)
  implementation = _resolve_implementation(implementation, query)
  if implementation == "xla":
    if paged:  # Gather the pages into a contiguous cache.
      k, v = (x[page_table].reshape((batch, kv_len) + x.shape[2:])
              for x in (k, v))
    # Positions past a length may hold anything (NaN too): 0 * NaN is NaN.
    live = (jnp.arange(kv_len)[None] < kv_lengths[:, None])[:, :, None, None]
    k, v = (jnp.where(live, x, 0) for x in (k, v))
    out, lse = reference_attention(
        query, k, v, mask=decode_mask(kv_lengths, q_len, kv_len, left),
        scale=scale, logits_soft_cap=cap, return_residual=True)
  else:
    _checks.check_kernel_support(p, query.dtype)
    block_k = page_size if paged else min(
        128 if padded_head_dim(head_dim) <= 128 else 64,
        max(16, 1 << (kv_len - 1).bit_length()))
    num_tiles = -(-kv_len // block_k)
    if num_splits is None:
      num_splits = _default_splits(batch, p.num_kv_heads, num_tiles)
    if not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
      raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    out, lse = _decode_kernel(
        query, k, v, kv_lengths, scores=Scores(scale=scale, soft_cap=cap),
        window_left=left, num_splits=int(min(num_splits, num_tiles)),
        block_k=block_k, page_table=page_table if paged else None,
        interpret=implementation == "interpret")
  return (out, lse) if return_residual else out
