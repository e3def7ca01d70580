"""`flash_decode`: a few new queries against a long (optionally paged) KV cache."""
from __future__ import annotations

import jax
import numpy as np

from jax_flash import _dispatch
from jax_flash.core import checks, device
from jax_flash.core.mask import Mask
from jax_flash.core.scores import Scores


@checks.in_x64_scope
def flash_decode(query, key_cache=None, value_cache=None, *, kv_lengths,
                 scale=None, logits_soft_cap=None, local_window_size=None,
                 num_splits=None, implementation=None, key_pages=None,
                 value_pages=None, page_table=None, sinks=None,
                 return_residual=False):
  """Attention of the newest T tokens of each sequence against its KV cache.

  Args:
    query: [B, T, N, H]: the last T positions of each sequence, any T (one
      new token, or a prompt chunk). Query t of sequence b sees cache
      positions < kv_lengths[b] - T + t + 1 (so T = 1 sees the whole cache).
      Short chunks run a split-KV kernel (on an H100/H200 with a
      contiguous cache at head dims 64/128, the Mosaic GPU one), long ones
      the training kernel.
    key_cache, value_cache: [B, S_max, K, H] and [B, S_max, K, Hv] (value's
      head dim may differ), K dividing N (GQA: the group's query heads share
      one read of K/V). None when paged.
    kv_lengths: int [B], the cache length of each sequence, new tokens
      included. Tiles past a length are never read; positions past it may
      hold anything, NaN included.
    scale, logits_soft_cap: as in `flash_attention`.
    local_window_size: int w or (left, right): query at position p sees
      p - left ... p (nothing lies to its right in a cache).
    num_splits: chunks each sequence's cache is split into by the Triton
      split-KV kernel (one program each, merged by logsumexp); default
      fills the GPU. An int >= 1; the Mosaic kernels (their split-KV kernel
      gives each multiprocessor an equal run of the cache's tiles) and the
      "xla" implementation ignore it.
    key_pages, value_pages, page_table: a paged cache instead: pages
      [num_pages, page_size, K, H] and int32 page_table [B, pages_per_seq];
      page j of sequence b holds its positions j*page_size ... (j+1)*page_size-1.
      page_size is a power of two >= 16.
    sinks: float [N] per-head sink logits, as in `flash_attention`.
    implementation: as in `flash_attention`.
  Returns:
    out [B, T, N, Hv] in query.dtype, or (out, logsumexp [B, T, N]).
  Inference only: no gradient.

  It is the same mask description as `flash_attention`'s (`jax_flash.core`),
  causal with a left window, the queries offset to kv_lengths[b] - T.
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
  query, scale = checks.fold_traced_scale(query, scale)
  batch, q_len, _, head_dim = query.shape
  if paged:
    page_table = checks.int_array(
        page_table, "page_table", (batch, page_table.shape[-1]),
        "[batch, pages_per_seq]")
    page_size = k.shape[1]
    if page_size < 16 or page_size & (page_size - 1):
      raise ValueError(f"key_pages page_size={page_size} must be a power of "
                       "two >= 16")
    if k.shape[:-1] != v.shape[:-1]:
      raise ValueError(f"value_pages must have the shape of key_pages "
                       f"{k.shape} but for its last dim, got {v.shape}")
    # Validate shapes like a contiguous cache of the same length.
    kv_len = page_table.shape[1] * page_size
    p = checks.check_qkv(query, *(jax.ShapeDtypeStruct(
        (batch, kv_len) + x.shape[2:], x.dtype) for x in (k, v)))
  else:
    p = checks.check_qkv(query, k, v)
  kv_lengths = checks.int_array(kv_lengths, "kv_lengths", (batch,), "[batch]")
  if num_splits is not None and (
      not isinstance(num_splits, (int, np.integer)) or num_splits < 1):
    raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
  left, _ = checks.check_window(local_window_size)
  mask = Mask(is_causal=True, window_left=left)
  sinks = checks.check_sinks(sinks, p)
  scores = Scores(scale=checks.check_scale(scale, head_dim),
                  soft_cap=checks.check_soft_cap(logits_soft_cap),
                  sinks=sinks is not None)
  backend = _dispatch.select(implementation, query, p, query.dtype, mask=mask,
                             scores=scores,
                             decode="paged" if paged else "contiguous").forward
  out, lse = device.on_auto_axes(
      lambda query, k, v, kv_lengths, page_table, sinks: backend.decode(
          query, k, v, kv_lengths, mask=mask, scores=scores,
          num_splits=num_splits, page_table=page_table, sinks=sinks),
      query, k, v, kv_lengths, page_table if paged else None, sinks)
  return (out, lse.transpose(0, 2, 1)) if return_residual else out
