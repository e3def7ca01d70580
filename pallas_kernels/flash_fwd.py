"""FlashAttention-2 forward (seed 000, Algorithm 1) for the Triton lowering.

One program owns one query tile of one (batch, head): it keeps Q in registers,
streams K/V tiles, maintains the online-softmax statistics and normalizes the
output once at the end (delayed normalization). It writes O and the base-2
logsumexp `lse2 = m + log2(l)`, the only residual the backward needs.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masking, online_softmax
from pallas_kernels.config import BlockSizes, padded_head_dim
from pallas_kernels.tiles import (dot, load_ids, load_table_row, load_tile,
                                  store_row_stat, store_tile)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale_log2: float,
                    mask: masking.Mask, head_dim: int, block_q: int,
                    block_k: int):
  """One (query tile, batch, head).

  q_ref/o_ref: [T, Hp]; k_ref/v_ref: [S, Hp]; lse_ref: [T]. With ids, refs
  starts with q_ids_ref [T], kv_ids_ref [S] and table_ref [num_q_tiles, 4].
  """
  if mask.has_ids:
    q_ids_ref, kv_ids_ref, table_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  # Longest query tiles first: under a causal mask the last tiles do the most.
  i = pl.num_programs(0) - 1 - pl.program_id(0)
  q_start = i * block_q
  rows = q_start + jnp.arange(block_q)
  q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  ranges = masking.kv_block_ranges(mask, q_start, block_q, block_k, kv_len)
  q_ids = None
  if mask.has_ids:
    q_ids = load_ids(q_ids_ref, q_start, block_q, bound=q_len,
                     pad_id=masking.Q_PAD_ID)[:, None]
    ranges = masking.intersect_ranges(ranges, load_table_row(table_ref, i))

  def body(j, carry, *, masked: bool):
    acc, m, l = carry
    k_start = j * block_k
    # Interior tiles are whole: no predicate on their loads or scores.
    bound = kv_len if masked else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    s = dot(q, k, trans_b=True) * scale_log2
    if masked:
      cols = (k_start + jnp.arange(block_k))[None, :]
      kv_ids = None
      if mask.has_ids:
        kv_ids = load_ids(kv_ids_ref, k_start, block_k, bound=kv_len,
                          pad_id=masking.KV_PAD_ID)[None, :]
      visible = mask.visible(rows[:, None], cols, kv_len, q_ids, kv_ids)
      s = jnp.where(visible, s, online_softmax.NEG_INF)
    m, alpha, p, l = online_softmax.update(m, l, s)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m, l

  lo, full_lo, full_hi, hi = ranges
  carry = online_softmax.init(block_q, q_ref.shape[-1])
  for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                              (full_hi, hi, True)):
    carry = lax.fori_loop(start, stop, functools.partial(body, masked=masked),
                          carry)
  o, lse2 = online_softmax.finalize(*carry)
  store_tile(o_ref, q_start, o, row_bound=q_len, head_dim=head_dim)
  store_row_stat(lse_ref, q_start, lse2, row_bound=q_len)


def flash_forward(q, k, v, *, scale: float, mask: masking.Mask,
                  block_sizes: BlockSizes, q_ids=None, kv_ids=None,
                  interpret: bool = False):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N (GQA: query head n
      reads key/value head n // (N // K), nothing is repeated in memory).
    q_ids, kv_ids: int32 [B, T], [B, S] when `mask.has_ids` (see `masking`).
  Returns:
    o: [B, T, N, H] in q.dtype; lse2: [B, N, T] float32, base-2 logsumexp of
    the scaled scores (-inf for a row that sees no key; its o is 0).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  bq, bk = block_sizes.block_q, block_sizes.block_k
  num_q_tiles = pl.cdiv(q_len, bq)
  kernel = functools.partial(
      _forward_kernel, scale_log2=scale * math.log2(math.e), mask=mask,
      head_dim=head_dim, block_q=bq, block_k=bk)
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda i, b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda i, b, n: (b, 0, lax.div(n, group), 0))
  in_specs, operands = [q_spec, kv_spec, kv_spec], [q, k, v]
  if mask.has_ids:
    in_specs += [pl.BlockSpec((None, q_len), lambda i, b, n: (b, 0)),
                 pl.BlockSpec((None, kv_len), lambda i, b, n: (b, 0)),
                 pl.BlockSpec((None, num_q_tiles, 4), lambda i, b, n: (b, 0, 0))]
    operands += [q_ids, kv_ids,
                 masking.id_block_table(q_ids, kv_ids, bq, bk)]
  return pl.pallas_call(
      kernel,
      grid=(num_q_tiles, batch, num_heads),
      in_specs=in_specs,
      out_specs=[q_spec,
                 pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_forward",
  )(*operands)
