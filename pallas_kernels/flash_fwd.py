"""FlashAttention-2 forward (seed 000, Algorithm 1) for the Triton lowering.

One program owns one query tile of one (batch, head): it keeps Q in registers,
streams K/V tiles, maintains the online-softmax statistics and normalizes the
output once at the end (delayed normalization). It writes O and the base-2
logsumexp `lse2 = m + log2(l)`, the only residual the backward needs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masking, online_softmax
from pallas_kernels.config import BlockSizes, padded_head_dim
from pallas_kernels.extras import Extras
from pallas_kernels.scores import Scores
from pallas_kernels.tile_context import TileContext, split_refs
from pallas_kernels.tiles import dot, load_tile, store_row_stat, store_tile


def _forward_kernel(q_ref, k_ref, v_ref, *refs, extras: tuple[str, ...],
                    scores: Scores, mask: masking.Mask, head_dim: int,
                    block_q: int, block_k: int):
  """One (query tile, batch, head).

  q_ref/o_ref: [T, Hp]; k_ref/v_ref: [S, Hp]; lse_ref: [T]; then the optional
  operands named in `extras` (see `tile_context`).
  """
  x, (o_ref, lse_ref) = split_refs(extras, refs)
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  ctx = TileContext(mask, scores, x, q_len, kv_len, block_q, block_k,
                    batch=pl.program_id(1))
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
                    online_softmax.NEG_INF)
    m, alpha, p, l = online_softmax.update(m, l, s)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    # l sums the undropped p; only P V sees the dropout.
    p = ctx.dropped(p, q_start, k_start, head)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m, l

  lo, full_lo, full_hi, hi = ctx.kv_ranges(i, q_start)
  carry = online_softmax.init(block_q, q_ref.shape[-1])
  for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                              (full_hi, hi, True)):
    carry = lax.fori_loop(start, stop, functools.partial(body, masked=masked),
                          carry)
  o, lse2 = online_softmax.finalize(*carry)
  store_tile(o_ref, q_start, o, row_bound=q_len, head_dim=head_dim)
  store_row_stat(lse_ref, q_start, lse2, row_bound=q_len)


def flash_forward(q, k, v, extras: Extras, *, scores: Scores,
                  mask: masking.Mask, block_sizes: BlockSizes,
                  interpret: bool = False):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N (GQA: query head n
      reads key/value head n // (N // K), nothing is repeated in memory).
    extras: the optional operands (ids, dense mask, bias, ALiBi slopes).
  Returns:
    o: [B, T, N, H] in q.dtype; lse2: [B, N, T] float32, base-2 logsumexp of
    the logits (-inf for a row that sees no key; its o is 0).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  bq, bk = block_sizes.block_q, block_sizes.block_k
  num_q_tiles = pl.cdiv(q_len, bq)
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda i, b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda i, b, n: (b, 0, lax.div(n, group), 0))
  names, specs, operands = extras.for_query_tiles(bq, bk)
  kernel = functools.partial(
      _forward_kernel, extras=names, scores=scores, mask=mask,
      head_dim=head_dim, block_q=bq, block_k=bk)
  return pl.pallas_call(
      kernel,
      grid=(num_q_tiles, batch, num_heads),
      in_specs=[q_spec, kv_spec, kv_spec, *specs],
      out_specs=[q_spec,
                 pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_forward",
  )(q, k, v, *operands)
