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
from pallas_kernels.tiles import dot, load_tile, store_row_stat, store_tile


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2: float,
                    mask: masking.Mask, head_dim: int, block_q: int,
                    block_k: int):
  """q_ref/o_ref: [T, Hp]; k_ref/v_ref: [S, Hp]; lse_ref: [T] (one batch, head)."""
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  # Longest query tiles first: under a causal mask the last tiles do the most.
  i = pl.num_programs(0) - 1 - pl.program_id(0)
  q_start = i * block_q
  rows = q_start + jnp.arange(block_q)
  q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)

  def body(j, carry, *, masked: bool):
    acc, m, l = carry
    k_start = j * block_k
    # Interior tiles are whole: no predicate on their loads or scores.
    bound = kv_len if masked else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    s = dot(q, k, trans_b=True) * scale_log2
    if masked:
      cols = k_start + jnp.arange(block_k)
      visible = mask.visible(rows[:, None], cols[None, :], kv_len)
      s = jnp.where(visible, s, online_softmax.NEG_INF)
    m, alpha, p, l = online_softmax.update(m, l, s)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m, l

  lo, full_lo, full_hi, hi = masking.kv_block_ranges(
      mask, q_start, block_q, block_k, kv_len)
  carry = online_softmax.init(block_q, q_ref.shape[-1])
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True),
                        carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False),
                        carry)
  carry = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True),
                        carry)
  o, lse2 = online_softmax.finalize(*carry)
  store_tile(o_ref, q_start, o, row_bound=q_len, head_dim=head_dim)
  store_row_stat(lse_ref, q_start, lse2, row_bound=q_len)


def flash_forward(q, k, v, *, scale: float, mask: masking.Mask,
                  block_sizes: BlockSizes, interpret: bool = False):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N (GQA: query head n
      reads key/value head n // (N // K), nothing is repeated in memory).
  Returns:
    o: [B, T, N, H] in q.dtype; lse2: [B, N, T] float32, base-2 logsumexp of
    the scaled scores (-inf for a row that sees no key).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  bq, bk = block_sizes.block_q, block_sizes.block_k
  kernel = functools.partial(
      _forward_kernel, scale_log2=scale * math.log2(math.e), mask=mask,
      head_dim=head_dim, block_q=bq, block_k=bk)
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda i, b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda i, b, n: (b, 0, lax.div(n, group), 0))
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(q_len, bq), batch, num_heads),
      in_specs=[q_spec, kv_spec, kv_spec],
      out_specs=[q_spec,
                 pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_forward",
  )(q, k, v)
