"""FlashAttention-2 forward (Dao 2023, Algorithm 1) for the Triton lowering.

One program owns one query tile of one (batch, head): it keeps Q in registers,
streams K/V tiles, maintains the online-softmax statistics and normalizes the
output once at the end (delayed normalization). It writes O and the logsumexp
`L = m + log(l)`, the only residual the backward needs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.core import softmax
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores
from pallas_kernels.triton import operand_specs
from pallas_kernels.triton.config import BlockSizes, padded_head_dim
from pallas_kernels.triton.tile_context import TileContext
from pallas_kernels.triton.tiles import (dot, load_tile, store_row_stat,
                                         store_tile)


def _forward_kernel(q_ref, k_ref, v_ref, operand_refs: Operands, id_table_ref,
                    o_ref, lse_ref, *, scores: Scores, mask: Mask,
                    head_dim: int, value_head_dim: int, block_q: int,
                    block_k: int):
  """One (query tile, batch, head).

  q_ref: [T, Hp]; k_ref: [S, Hp]; v_ref: [S, Hvp]; o_ref: [T, Hvp]; lse_ref:
  [T]; operand_refs: the optional operands' refs
  (`operand_specs.for_query_tiles`).
  """
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  ctx = TileContext(mask, scores, operand_refs, id_table_ref, q_len, kv_len,
                    block_q, block_k, batch=pl.program_id(1),
                    query_head=pl.program_id(2))
  # Longest query tiles first: under a causal mask the last tiles do the most.
  i = pl.num_programs(0) - 1 - pl.program_id(0)
  q_start = i * block_q
  q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  q_ids = ctx.q_ids(q_start) if mask.has_ids else None
  head = pl.program_id(2)  # Read here: the interpreter wants it outside loops.
  slope = ctx.slope(head)

  def body(j, carry, *, masked: bool):
    acc, m, l = carry
    k_start = j * block_k
    # Interior tiles are whole: no predicate on their loads or scores.
    bound = kv_len if masked else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    s, _ = ctx.logits2(dot(q, k, trans_b=True), q_start, k_start, slope=slope)
    if masked:
      s = jnp.where(ctx.visible(q_start, k_start, q_ids=q_ids), s,
                    softmax.NEG_INF)
    m, alpha, p, l = softmax.update(m, l, s)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound,
                  head_dim=value_head_dim)
    if masked:  # Only boundary tiles can hold keys past a length.
      v = ctx.without_padding(v, k_start, keys=True)
    # l sums the undropped p; only P V sees the dropout.
    p = ctx.dropped(p, q_start, k_start, head)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m, l

  carry = ctx.visit(ctx.kv_ranges(i, q_start), body,
                    softmax.init(block_q, v_ref.shape[-1]))
  sink2 = None
  if scores.sinks:  # The head's sink logit joins the denominator.
    sink2 = operand_refs.sinks[head] * softmax.LOG2E
  o, lse = softmax.finalize(*carry, sink2=sink2)
  store_tile(o_ref, q_start, o, row_bound=q_len, head_dim=value_head_dim)
  store_row_stat(lse_ref, q_start, lse, row_bound=q_len)


def flash_forward(q, k, v, operands: Operands, *, scores: Scores, mask: Mask,
                  block_sizes: BlockSizes, interpret: bool = False):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv], K dividing N (GQA:
      query head n reads key/value head n // (N // K), nothing is repeated
      in memory).
    operands: the optional arrays (ids, dense mask, bias, ALiBi slopes, seed).
  Returns:
    o: [B, T, N, Hv] in q.dtype; lse: [B, N, T] float32, the natural-log
    logsumexp of the logits (-inf for a row that sees no key; its o is 0).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  value_head_dim = v.shape[-1]
  bq, bk = block_sizes.block_q, block_sizes.block_k
  num_q_tiles = pl.cdiv(q_len, bq)

  def q_spec(h):
    return pl.BlockSpec((None, q_len, None, padded_head_dim(h)),
                        lambda i, b, n: (b, 0, n, 0))

  def kv_spec(h):
    return pl.BlockSpec((None, kv_len, None, padded_head_dim(h)),
                        lambda i, b, n: (b, 0, lax.div(n, group), 0))
  extra = operand_specs.for_query_tiles(operands, mask, bq, bk, q_len,
                                        kv_len)
  kernel = functools.partial(
      _forward_kernel, scores=scores, mask=mask, head_dim=head_dim,
      value_head_dim=value_head_dim, block_q=bq, block_k=bk)
  return pl.pallas_call(
      kernel,
      grid=(num_q_tiles, batch, num_heads),
      in_specs=[q_spec(head_dim), kv_spec(head_dim), kv_spec(value_head_dim),
                *extra.in_specs()],
      out_specs=[q_spec(value_head_dim),
                 pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape[:3] + (value_head_dim,),
                                      q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_forward",
  )(q, k, v, *extra.args())
