"""FlashAttention-2 backward (seed 000, Algorithm 2) for the Triton lowering.

`D = rowsum(dO * O)` is one XLA reduction before the kernels. Then two kernels,
neither with atomics, so gradients are bitwise deterministic:

* dK/dV: one program owns a key tile of one (batch, kv head). It loops over the
  query heads of its GQA group and over query tiles, recomputes
  P^T = 2**(S^T - L) from the forward's logsumexp (S^T = K Q^T keeps every dot's
  M dimension at the key tile), and accumulates dV += P^T dO and
  dK += dS^T Q with dS = P * (dP - D): dK/dV come out already summed over
  the head group.
* dQ: one program owns a query tile of one (batch, head), loops over key tiles
  and accumulates dQ += dS K.

Both visit only the tiles `masking` says are not entirely masked, and evaluate
the mask predicate only on the tiles that cross its boundary.
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
from pallas_kernels.tiles import (dot, load_ids, load_row_stat, load_table_row,
                                  load_tile, store_tile)

_INF = float("inf")


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                 scale: float, scale_log2: float, mask: masking.Mask,
                 head_dim: int, block_q: int, block_k: int):
  """One (key tile, batch, kv head).

  q_ref/do_ref: [T, G, Hp]; k/v/dk/dv_ref: [S, Hp]; lse/delta_ref: [G, T].
  With ids, refs starts with q_ids_ref [T], kv_ids_ref [S] and table_ref
  [num_kv_tiles, 4] (query-tile ranges per key tile).
  """
  if mask.has_ids:
    q_ids_ref, kv_ids_ref, table_ref, dk_ref, dv_ref = refs
  else:
    dk_ref, dv_ref = refs
  q_len, group = q_ref.shape[0], q_ref.shape[1]
  kv_len = k_ref.shape[0]
  kv_start = pl.program_id(0) * block_k
  cols = (kv_start + jnp.arange(block_k))[:, None]
  k = load_tile(k_ref, kv_start, block_k, row_bound=kv_len, head_dim=head_dim)
  v = load_tile(v_ref, kv_start, block_k, row_bound=kv_len, head_dim=head_dim)
  ranges = masking.q_block_ranges(mask, kv_start, block_k, block_q, q_len)
  kv_ids = None
  if mask.has_ids:
    kv_ids = load_ids(kv_ids_ref, kv_start, block_k, bound=kv_len,
                      pad_id=masking.KV_PAD_ID)[:, None]
    ranges = masking.intersect_ranges(
        ranges, load_table_row(table_ref, pl.program_id(0)))

  def body(j, carry, *, head, masked: bool):
    dk, dv = carry
    q_start = j * block_q
    # Rows past q_len load Q = dO = 0 and L = +inf (P = 0): they add nothing.
    q = load_tile(q_ref, q_start, block_q, row_bound=q_len,
                  head_dim=head_dim, head=head)
    do = load_tile(do_ref, q_start, block_q, row_bound=q_len,
                   head_dim=head_dim, head=head)
    lse2 = online_softmax.backward_lse(load_row_stat(
        lse_ref, q_start, block_q, row_bound=q_len, head=head, other=_INF))
    delta = load_row_stat(delta_ref, q_start, block_q, row_bound=q_len,
                          head=head)
    s_t = dot(k, q, trans_b=True) * scale_log2  # [block_k, block_q]
    p_t = jnp.exp2(s_t - lse2[None, :])
    if masked:
      rows = (q_start + jnp.arange(block_q))[None, :]
      q_ids = None
      if mask.has_ids:
        q_ids = load_ids(q_ids_ref, q_start, block_q, bound=q_len,
                         pad_id=masking.Q_PAD_ID)[None, :]
      p_t = jnp.where(mask.visible(rows, cols, kv_len, q_ids, kv_ids), p_t,
                      0.0)
    dv = dv + dot(p_t.astype(do.dtype), do)
    dp_t = dot(v, do, trans_b=True)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + dot(ds_t.astype(q.dtype), q)
    return dk, dv

  lo, full_lo, full_hi, hi = ranges

  def head_body(head, carry):
    for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                                (full_hi, hi, True)):
      carry = lax.fori_loop(
          start, stop,
          functools.partial(body, head=head, masked=masked), carry)
    return carry

  zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
  store_tile(dk_ref, kv_start, dk * scale, row_bound=kv_len, head_dim=head_dim)
  store_tile(dv_ref, kv_start, dv, row_bound=kv_len, head_dim=head_dim)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               scale: float, scale_log2: float, mask: masking.Mask,
               head_dim: int, block_q: int, block_k: int):
  """One (query tile, batch, head).

  q/do/dq_ref: [T, Hp]; k/v_ref: [S, Hp]; lse/delta_ref: [T]. With ids, refs
  starts with q_ids_ref [T], kv_ids_ref [S] and table_ref [num_q_tiles, 4].
  """
  if mask.has_ids:
    q_ids_ref, kv_ids_ref, table_ref, dq_ref = refs
  else:
    (dq_ref,) = refs
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  i = pl.num_programs(0) - 1 - pl.program_id(0)  # Longest tiles first.
  q_start = i * block_q
  rows = q_start + jnp.arange(block_q)
  q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  do = load_tile(do_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  lse2 = online_softmax.backward_lse(load_row_stat(
      lse_ref, q_start, block_q, row_bound=q_len, other=_INF))
  delta = load_row_stat(delta_ref, q_start, block_q, row_bound=q_len)
  ranges = masking.kv_block_ranges(mask, q_start, block_q, block_k, kv_len)
  q_ids = None
  if mask.has_ids:
    q_ids = load_ids(q_ids_ref, q_start, block_q, bound=q_len,
                     pad_id=masking.Q_PAD_ID)[:, None]
    ranges = masking.intersect_ranges(ranges, load_table_row(table_ref, i))

  def body(j, dq, *, masked: bool):
    k_start = j * block_k
    bound = kv_len if masked else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    s = dot(q, k, trans_b=True) * scale_log2
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      cols = (k_start + jnp.arange(block_k))[None, :]
      kv_ids = None
      if mask.has_ids:
        kv_ids = load_ids(kv_ids_ref, k_start, block_k, bound=kv_len,
                          pad_id=masking.KV_PAD_ID)[None, :]
      p = jnp.where(mask.visible(rows[:, None], cols, kv_len, q_ids, kv_ids),
                    p, 0.0)
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.astype(k.dtype), k)

  lo, full_lo, full_hi, hi = ranges
  dq = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
  for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                              (full_hi, hi, True)):
    dq = lax.fori_loop(start, stop, functools.partial(body, masked=masked), dq)
  store_tile(dq_ref, q_start, dq * scale, row_bound=q_len, head_dim=head_dim)


def flash_backward(q, k, v, o, lse2, do, dlse2, *, scale: float,
                   mask: masking.Mask, block_sizes: BlockSizes, q_ids=None,
                   kv_ids=None, interpret: bool = False):
  """Gradients of the forward with respect to q, k, v.

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H]; o, do: [B, T, N, H].
    lse2: [B, N, T] base-2 logsumexp saved by the forward.
    dlse2: [B, N, T] cotangent of lse2 (zeros unless the caller used it).
    q_ids, kv_ids: int32 [B, T], [B, S] when `mask.has_ids`.
  Returns:
    dq [B, T, N, H] in q.dtype; dk, dv [B, S, K, H] in k.dtype, summed over
    the query heads that share each key/value head.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  log2e = math.log2(math.e)
  # dS = P * (dP - D) + dlse * dlse/dS; with lse2 = lse * log2(e) the second
  # term is P * dlse2 * log2(e), so it folds into D.
  delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32),
                     do.astype(jnp.float32)) - dlse2 * log2e
  params = dict(scale=scale, scale_log2=scale * log2e, mask=mask,
                head_dim=head_dim)
  compiler_params = plgpu.CompilerParams(
      num_warps=block_sizes.num_warps_bwd,
      num_stages=block_sizes.num_stages_bwd)

  # dK/dV: grid over (key tiles, batch, kv heads); the group's query heads
  # are one block of `group` consecutive heads.
  bq, bk = block_sizes.block_q_dkv, block_sizes.block_k_dkv
  group_spec = pl.BlockSpec((None, q_len, group, hp),
                            lambda j, b, h: (b, 0, h, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp), lambda j, b, h: (b, 0, h, 0))
  group_stat_spec = pl.BlockSpec((None, group, q_len), lambda j, b, h: (b, h, 0))
  num_kv_tiles = pl.cdiv(kv_len, bk)
  in_specs = [group_spec, kv_spec, kv_spec, group_spec, group_stat_spec,
              group_stat_spec]
  operands = [q, k, v, do, lse2, delta]
  if mask.has_ids:
    in_specs += [pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, kv_len), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, num_kv_tiles, 4),
                              lambda j, b, h: (b, 0, 0))]
    operands += [q_ids, kv_ids, masking.id_block_table(kv_ids, q_ids, bk, bq)]
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=bq, block_k=bk, **params),
      grid=(num_kv_tiles, batch, num_kv_heads),
      in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="flash_attention_backward_dkdv",
  )(*operands)

  # dQ: grid over (query tiles, batch, heads).
  bq, bk = block_sizes.block_q_dq, block_sizes.block_k_dq
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda i, b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda i, b, n: (b, 0, lax.div(n, group), 0))
  stat_spec = pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))
  num_q_tiles = pl.cdiv(q_len, bq)
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec]
  operands = [q, k, v, do, lse2, delta]
  if mask.has_ids:
    in_specs += [pl.BlockSpec((None, q_len), lambda i, b, n: (b, 0)),
                 pl.BlockSpec((None, kv_len), lambda i, b, n: (b, 0)),
                 pl.BlockSpec((None, num_q_tiles, 4),
                              lambda i, b, n: (b, 0, 0))]
    operands += [q_ids, kv_ids, masking.id_block_table(q_ids, kv_ids, bq, bk)]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq, block_k=bk, **params),
      grid=(num_q_tiles, batch, num_heads),
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params,
      interpret=interpret,
      name="flash_attention_backward_dq",
  )(*operands)
  return dq, dk, dv
