"""Split-KV decoding (a few queries against a long KV cache) for the Triton lowering.

Decoding is memory-bound: the cache must be read once, fast. The training
kernel parallelizes over query tiles, which leaves the GPU idle when T is 1, so
here one program owns a contiguous chunk of one sequence's cache for one kv
head ("split-KV"): it reads that chunk once for all the query rows of the GQA
group (G heads x T positions, one [rows, H] tile), and writes a partial output
and its base-2 logsumexp. `merge_partials` then combines the chunks exactly by
their logsumexp. Tiles past a sequence's length are never loaded.

Query t of sequence b (of T) sits at position kv_len[b] - T + t and sees cache
positions up to it (and, with a window, back to it - left).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.core import softmax
from jax_flash.core.mask import Mask, cdiv
from jax_flash.core.scores import Scores
from pallas_kernels.triton.config import DecodeBlocks, padded_head_dim
from pallas_kernels.triton.tiles import (dot, load_pages, load_tile,
                                         page_rows, store_row_stat,
                                         store_tile, tile_pages)


def _decode_kernel(q_ref, k_ref, v_ref, lengths_ref, *refs, scores: Scores,
                   mask: Mask, q_len: int, group: int, head_dim: int,
                   value_head_dim: int, block_k: int, tiles_per_split: int,
                   paged: bool, prefetch: int, page_dots: bool):
  """One (split, batch, kv head).

  q_ref: [R, Hp], rows r = g * T + t (masked past G*T); k_ref: [S_max, Hp]
  and v_ref [S_max, Hvp], or with `paged` [num_pages, page_size, Hp|Hvp] and
  then refs starts with the page table row [pages_per_seq]: a key tile of
  block_k rows lies in one page or gathers several (`tiles.page_rows`;
  with `page_dots` its pages are loaded and multiplied one at a time,
  `tiles.tile_pages`), its page rows read `prefetch` tiles ahead (0: in
  the tile's iteration).
  Outputs:
  o_ref [R, Hvp] (normalized partial output) and lse_ref [R] (-inf if
  empty).
  """
  if paged:
    table_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  kv_len = lengths_ref[pl.program_id(1)]
  num_rows = q_ref.shape[0]
  rows = jnp.arange(num_rows)
  query = lax.rem(rows, q_len)[:, None]  # Row r is query t = r % T.
  valid_row = (rows < group * q_len)[:, None]
  q = load_tile(q_ref, 0, num_rows, row_bound=group * q_len,
                head_dim=head_dim)
  first = pl.program_id(0) * tiles_per_split
  last = jnp.minimum(first + tiles_per_split, cdiv(kv_len, block_k))

  if paged:
    where = tile_pages if page_dots else page_rows

    def tile_rows(j):
      return where(table_ref, j * block_k, block_k, k_ref.shape[1],
                   k_ref.shape[0])

  def visible_logits(k, cols):
    """Base-2 logits of q against key rows k at positions cols, -inf
    where the mask hides them."""
    s, _ = scores.logits2(dot(q, k, trans_b=True))
    visible = valid_row & mask.visible(query, cols[None, :], kv_len,
                                       q_offset=kv_len - q_len)
    return jnp.where(visible, s, softmax.NEG_INF)

  def body(j, carry):
    (acc, m, l), ahead = carry
    k_start = j * block_k
    if paged:  # Rows of the pages past kv_len may hold anything: zeroed.
      # Tile j's page rows were read `prefetch` iterations ago (or now).
      rows, ahead = (ahead[0], ahead[1:] + (tile_rows(j + prefetch),)
                     ) if prefetch else (tile_rows(j), ())
      if page_dots:  # A page at a time: contiguous loads, a dot each.
        page_size = k_ref.shape[1]
        ks = [load_pages(k_ref, page, page_size, row_bound=kv_len,
                         head_dim=head_dim) for page in rows]
        vs = [load_pages(v_ref, page, page_size, row_bound=kv_len,
                         head_dim=value_head_dim) for page in rows]
        parts = tuple(visible_logits(k, page[0] + jnp.arange(page_size))
                      for k, page in zip(ks, rows))
        m, alpha, ps, l = softmax.update_parts(m, l, parts)
        acc = acc * alpha[:, None]
        for p, v in zip(ps, vs):
          acc = acc + dot(p.astype(v.dtype), v)
        return (acc, m, l), ahead
      k = load_pages(k_ref, rows, block_k, row_bound=kv_len,
                     head_dim=head_dim)
      v = load_pages(v_ref, rows, block_k, row_bound=kv_len,
                     head_dim=value_head_dim)
    else:
      k = load_tile(k_ref, k_start, block_k, row_bound=kv_len,
                    head_dim=head_dim)
      v = load_tile(v_ref, k_start, block_k, row_bound=kv_len,
                    head_dim=value_head_dim)
    s = visible_logits(k, k_start + jnp.arange(block_k))
    m, alpha, p, l = softmax.update(m, l, s)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return (acc, m, l), ahead

  # Page rows of the next `prefetch` tiles, read ahead of their use (a slot
  # past the table is clamped by `page_rows` and never used).
  ahead = tuple(tile_rows(first + i) for i in range(prefetch)) if paged else ()
  carry, _ = lax.fori_loop(first, jnp.maximum(last, first), body,
                           (softmax.init(num_rows, v_ref.shape[-1]), ahead))
  o, lse = softmax.finalize(*carry)
  store_tile(o_ref, 0, o, row_bound=num_rows, head_dim=value_head_dim)
  store_row_stat(lse_ref, 0, lse, row_bound=num_rows)


def flash_decode(q, k_cache, v_cache, kv_lengths, *, scores: Scores,
                 mask: Mask, num_splits: int, blocks: DecodeBlocks,
                 page_table=None, sinks=None, interpret: bool = False):
  """Decode attention of q [B, T, N, H] against a cache.

  Contiguous cache: k_cache, v_cache [B, S_max, K, H]. Paged (page_table
  [B, pages_per_seq] int32 given): k_cache, v_cache are pages
  [num_pages, page_size, K, H]; blocks.block_k divides page_size (tiles
  within a page) or is a multiple of it (the pages of one key tile).
  blocks: the tiling (`config.DecodeBlocks`). `mask`: the band (causal, a
  left window) of queries at positions kv_lengths[b] - T + t.
  sinks: float32 [N] sink logits joining each head's denominator, or None.
  Value may have a head dim Hv of its own. Returns (out [B, T, N, Hv] in
  q.dtype, lse [B, N, T] natural log).
  """
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  group = num_heads // num_kv_heads
  value_head_dim = v_cache.shape[-1]
  hp, hvp = padded_head_dim(head_dim), padded_head_dim(value_head_dim)
  rows = max(16, pl.next_power_of_2(group * q_len))
  # [B, T, K, G, H] -> [B, K, G*T, H] (rows g*T + t; for T = 1 a view, no
  # copy). The kernel's [rows, Hp] block reads past both ends masked: no
  # padded copy of q (a kernel launch of its own before this one).
  qr = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  qr = qr.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * q_len,
                                            head_dim)
  paged = page_table is not None
  block_k = blocks.block_k
  if paged:
    max_tiles = pl.cdiv(page_table.shape[1] * k_cache.shape[1], block_k)
  else:
    max_tiles = pl.cdiv(k_cache.shape[1], block_k)
  tiles_per_split = pl.cdiv(max_tiles, num_splits)
  kernel = functools.partial(
      _decode_kernel, scores=scores, mask=mask, q_len=q_len,
      group=group, head_dim=head_dim, value_head_dim=value_head_dim,
      block_k=block_k,
      tiles_per_split=tiles_per_split, paged=paged,
      prefetch=blocks.prefetch_pages if paged else 0,
      page_dots=(paged and blocks.page_dots and
                 block_k > k_cache.shape[1]))
  q_spec = pl.BlockSpec((None, None, rows, hp), lambda s, b, h: (b, h, 0, 0))
  def kv_spec(width):
    if paged:
      return pl.BlockSpec((k_cache.shape[0], k_cache.shape[1], None, width),
                          lambda s, b, h: (0, 0, h, 0))
    return pl.BlockSpec((None, k_cache.shape[1], None, width),
                        lambda s, b, h: (b, 0, h, 0))
  in_specs = [q_spec, kv_spec(hp), kv_spec(hvp),
              pl.BlockSpec((batch,), lambda s, b, h: (0,))]
  operands = [qr, k_cache, v_cache, kv_lengths.astype(jnp.int32)]
  if paged:
    in_specs.append(pl.BlockSpec((None, page_table.shape[1]),
                                 lambda s, b, h: (b, 0)))
    operands.append(page_table.astype(jnp.int32))
  o, lse = pl.pallas_call(
      kernel,
      grid=(num_splits, batch, num_kv_heads),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, hvp),
                       lambda s, b, h: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda s, b, h: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows,
                                value_head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows),
                               jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages),
      interpret=interpret,
      name="flash_attention_decode",
  )(*operands)
  return softmax.merge_split_kv(o, lse, q_len=q_len, group=group,
                                dtype=q.dtype, sinks=sinks)
