"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1), kept to show what v2 changed.

One program per (batch, head), as in the original: key/value tiles in the
outer loop, query tiles in the inner loop. For every (query tile, key tile)
pair the program reads O_i, l_i and m_i back from HBM, merges the tile's own
statistics (m~, l~, P~ = exp(S - m~)) into them, rescales the already
normalized O_i and writes all three back:

    O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j)

Compared with FlashAttention-2 (`flash_fwd.py`) this re-reads and re-writes O,
normalizes at every step, stores m and l separately and parallelizes only over
batch and heads. The backward is shared: L = m + log l.
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
from pallas_kernels.triton.tiles import (dot, load_row_stat, load_tile,
                                         store_row_stat, store_tile)


def _forward_v1_kernel(q_ref, k_ref, v_ref, operand_refs: Operands,
                       id_table_ref, o_ref, m_ref, l_ref, *, scores: Scores,
                       mask: Mask, head_dim: int, block_q: int, block_k: int,
                       interpret: bool):
  """One (batch, head).

  q_ref/o_ref: [T, Hp]; k_ref/v_ref: [S, Hp]; m_ref/l_ref: [T]; operand_refs:
  the optional operands' refs (`operand_specs.for_heads`).
  """
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  head = pl.program_id(1)  # Read here: the interpreter wants it outside loops.
  ctx = TileContext(mask, scores, operand_refs, id_table_ref, q_len, kv_len,
                    block_q, block_k, batch=pl.program_id(0), query_head=head)
  slope = ctx.slope(head)
  hp = q_ref.shape[-1]

  def sync():
    # The next step reads what other threads of this program wrote.
    if not interpret:
      plgpu.debug_barrier()

  def init(i, carry):
    q_start = i * block_q
    acc, m, l = softmax.init(block_q, hp)
    store_tile(o_ref, q_start, acc, row_bound=q_len, head_dim=head_dim)
    store_row_stat(m_ref, q_start, m, row_bound=q_len)
    store_row_stat(l_ref, q_start, l, row_bound=q_len)
    return carry

  def q_step(i, carry, *, k, v, k_start, kv_ids, masked: bool):
    q_start = i * block_q
    q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
    o = load_tile(o_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
    m = load_row_stat(m_ref, q_start, block_q, row_bound=q_len)
    l = load_row_stat(l_ref, q_start, block_q, row_bound=q_len)
    s, _ = ctx.logits2(dot(q, k, trans_b=True), q_start, k_start, slope=slope)
    if masked:
      s = jnp.where(ctx.visible(q_start, k_start, kv_ids=kv_ids), s,
                    softmax.NEG_INF)
    m_new, l_new, a, b, p = softmax.update_v1(m, l, s)
    p = ctx.dropped(p, q_start, k_start, head)
    pv = dot(p.astype(v.dtype), v)
    o = ((a * l)[:, None] * o + b[:, None] * pv) / (
        softmax.safe_divisor(l_new)[:, None])
    store_tile(o_ref, q_start, o, row_bound=q_len, head_dim=head_dim)
    store_row_stat(m_ref, q_start, m_new, row_bound=q_len)
    store_row_stat(l_ref, q_start, l_new, row_bound=q_len)
    return carry

  def kv_step(j, carry, *, tail: bool):
    k_start = j * block_k
    bound = kv_len if tail else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    v = ctx.without_padding(v, k_start, keys=True)
    lo, full_lo, full_hi, hi = ctx.q_ranges(j, k_start)
    kv_ids = ctx.kv_ids(k_start) if mask.has_ids else None
    step = functools.partial(q_step, k=k, v=v, k_start=k_start, kv_ids=kv_ids)
    if tail:  # The last, partial key tile: every query tile takes the mask.
      lax.fori_loop(lo, hi, functools.partial(step, masked=True), None)
    else:
      for start, stop, masked in ((lo, full_lo, True),
                                  (full_lo, full_hi, False),
                                  (full_hi, hi, True)):
        lax.fori_loop(start, stop, functools.partial(step, masked=masked), None)
    sync()
    return carry

  lax.fori_loop(0, pl.cdiv(q_len, block_q), init, None)
  sync()
  lax.fori_loop(0, kv_len // block_k, functools.partial(kv_step, tail=False),
                None)
  if kv_len % block_k:
    kv_step(kv_len // block_k, None, tail=True)


def flash_forward_v1(q, k, v, operands: Operands, *, scores: Scores,
                     mask: Mask, block_sizes: BlockSizes,
                     interpret: bool = False):
  """FlashAttention-1 forward. Shapes and returns as `flash_forward`."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  bq, bk = block_sizes.block_q, block_sizes.block_k
  extra = operand_specs.for_heads(operands, mask, bq, bk, q_len, kv_len)
  kernel = functools.partial(
      _forward_v1_kernel, scores=scores, mask=mask,
      head_dim=head_dim, block_q=bq, block_k=bk, interpret=interpret)
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda b, n: (b, 0, lax.div(n, group), 0))
  stat_spec = pl.BlockSpec((None, None, q_len), lambda b, n: (b, n, 0))
  stat_shape = jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(batch, num_heads),
      in_specs=[q_spec, kv_spec, kv_spec, *extra.in_specs()],
      out_specs=[q_spec, stat_spec, stat_spec],
      # O is kept in float32 in HBM: it is re-read and rescaled every step.
      out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), stat_shape,
                 stat_shape],
      compiler_params=plgpu.CompilerParams(
          num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_forward_v1",
  )(q, k, v, *extra.args())
  return o.astype(q.dtype), softmax.logsumexp(m, l)
