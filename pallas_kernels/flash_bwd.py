"""FlashAttention-2 backward (seed 000, Algorithm 2) for the Triton lowering.

`D = rowsum(dO * O)` is one XLA reduction before the kernels. Then, with no
atomics anywhere, so gradients are bitwise deterministic:

* dK/dV: one program owns a key tile of one (batch, kv head). It loops over the
  query heads of its GQA group and over query tiles, recomputes
  P^T = 2**(S^T - L) from the forward's logsumexp (S^T = K Q^T keeps every dot's
  M dimension at the key tile), and accumulates dV += P^T dO and
  dK += dS^T Q with dS = P * (dP - D): dK/dV come out summed over the group.
* dQ: one program owns a query tile of one (batch, head), loops over key tiles
  and accumulates dQ += dS K.
* dBias (only when a bias is given; XLA drops it when its result is unused):
  the dQ program's loop again, writing dS (reduced over the dimensions the bias
  broadcasts along) instead of dQ.

All visit only the tiles `masking` says are not entirely masked, and evaluate
the mask predicate only on the tiles that cross its boundary.
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
from pallas_kernels.scores import LOG2E, Scores
from pallas_kernels.tile_context import TileContext, split_refs
from pallas_kernels.tiles import dot, load_row_stat, load_tile, store_tile

_INF = float("inf")


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                 extras: tuple[str, ...], scores: Scores, mask: masking.Mask,
                 head_dim: int, block_q: int, block_k: int):
  """One (key tile, batch, kv head).

  q_ref/do_ref: [T, G, Hp]; k/v/dk/dv_ref: [S, Hp]; lse/delta_ref: [G, T];
  then the optional operands named in `extras`, per-head ones as [G, ...].
  """
  x, (dk_ref, dv_ref) = split_refs(extras, refs)
  q_len, group = q_ref.shape[0], q_ref.shape[1]
  kv_len = k_ref.shape[0]
  ctx = TileContext(mask, scores, x, q_len, kv_len, block_q, block_k,
                    batch=pl.program_id(1), transposed=True)
  kv_tile = pl.program_id(0)
  kv_start = kv_tile * block_k
  k = load_tile(k_ref, kv_start, block_k, row_bound=kv_len, head_dim=head_dim)
  v = load_tile(v_ref, kv_start, block_k, row_bound=kv_len, head_dim=head_dim)
  kv_ids = ctx.kv_ids(kv_start) if mask.has_ids else None
  first_head = pl.program_id(2) * group  # Global index of the group's head 0.

  def body(j, carry, *, head, slope, masked: bool):
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
    s_t, tanh_t = ctx.logits2(dot(k, q, trans_b=True), q_start, kv_start,
                              head=head, slope=slope)  # [block_k, block_q]
    p_t = jnp.exp2(s_t - lse2[None, :])
    if masked:
      p_t = jnp.where(ctx.visible(q_start, kv_start, kv_ids=kv_ids,
                                  head=head), p_t, 0.0)
    query_head = first_head + head
    dv = dv + dot(ctx.dropped(p_t, q_start, kv_start, query_head)
                  .astype(do.dtype), do)
    dp_t = ctx.dropped(dot(v, do, trans_b=True), q_start, kv_start,
                       query_head)
    ds_t = scores.dqk(p_t * (dp_t - delta[None, :]), tanh_t)
    dk = dk + dot(ds_t.astype(q.dtype), q)
    return dk, dv

  lo, full_lo, full_hi, hi = ctx.q_ranges(kv_tile, kv_start)

  def head_body(head, carry):
    step = functools.partial(body, head=head, slope=ctx.slope(head))
    for start, stop, masked in ((lo, full_lo, True), (full_lo, full_hi, False),
                                (full_hi, hi, True)):
      carry = lax.fori_loop(start, stop,
                            functools.partial(step, masked=masked), carry)
    return carry

  zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
  store_tile(dk_ref, kv_start, dk * scores.scale, row_bound=kv_len,
             head_dim=head_dim)
  store_tile(dv_ref, kv_start, dv, row_bound=kv_len, head_dim=head_dim)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               extras: tuple[str, ...], scores: Scores, mask: masking.Mask,
               head_dim: int, block_q: int, block_k: int, output: str):
  """One (query tile, batch, head): dQ, or a form of dBias.

  q/do/dq_ref: [T, Hp]; k/v_ref: [S, Hp]; lse/delta_ref: [T]; then the
  optional operands named in `extras`. `output` is "dq", or for dBias
  "dbias_tiles" ([T, S]: the bias has full rows and columns), "dbias_rows"
  ([T, 1] row sums: it broadcasts over keys) or "dbias_cols"
  ([num_q_tiles, S] per-tile column sums: it broadcasts over queries).
  """
  x, (out_ref,) = split_refs(extras, refs)
  q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
  ctx = TileContext(mask, scores, x, q_len, kv_len, block_q, block_k,
                    batch=pl.program_id(1))
  i = pl.num_programs(0) - 1 - pl.program_id(0)  # Longest tiles first.
  q_start = i * block_q
  q = load_tile(q_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  do = load_tile(do_ref, q_start, block_q, row_bound=q_len, head_dim=head_dim)
  lse2 = online_softmax.backward_lse(load_row_stat(
      lse_ref, q_start, block_q, row_bound=q_len, other=_INF))
  delta = load_row_stat(delta_ref, q_start, block_q, row_bound=q_len)
  q_ids = ctx.q_ids(q_start) if mask.has_ids else None
  head = pl.program_id(2)  # Read here: the interpreter wants it outside loops.
  slope = ctx.slope(head)

  def tile_ds(j, masked):
    """dS = dL/d(logits) of key tile j, the soft-cap tanh, and K."""
    k_start = j * block_k
    bound = kv_len if masked else None
    k = load_tile(k_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    v = load_tile(v_ref, k_start, block_k, row_bound=bound, head_dim=head_dim)
    s, tanh = ctx.logits2(dot(q, k, trans_b=True), q_start, k_start,
                          slope=slope)
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      p = jnp.where(ctx.visible(q_start, k_start, q_ids=q_ids), p, 0.0)
    dp = ctx.dropped(dot(do, v, trans_b=True), q_start, k_start, head)
    return p * (dp - delta[:, None]), tanh, k

  lo, full_lo, full_hi, hi = ctx.kv_ranges(i, q_start)
  visited = ((lo, full_lo, True), (full_lo, full_hi, False),
             (full_hi, hi, True))

  if output == "dq":
    def dq_body(j, dq, *, masked):
      ds, tanh, k = tile_ds(j, masked)
      return dq + dot(scores.dqk(ds, tanh).astype(k.dtype), k)
    dq = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
    for start, stop, masked in visited:
      dq = lax.fori_loop(start, stop, functools.partial(dq_body, masked=masked),
                         dq)
    store_tile(out_ref, q_start, dq * scores.scale, row_bound=q_len,
               head_dim=head_dim)
    return

  rows = q_start + jnp.arange(block_q)
  if output == "dbias_rows":
    def rowsum_body(j, acc, *, masked):
      return acc + jnp.sum(tile_ds(j, masked)[0], axis=1)
    acc = jnp.zeros((block_q,), jnp.float32)
    for start, stop, masked in visited:
      acc = lax.fori_loop(start, stop,
                          functools.partial(rowsum_body, masked=masked), acc)
    plgpu.store(out_ref.at[pl.ds(q_start, block_q), jnp.int32(0)], acc,
                mask=rows < q_len)
    return

  def store_cols(j, value):
    cols = j * block_k + jnp.arange(block_k)
    if output == "dbias_cols":
      plgpu.store(out_ref.at[i, pl.ds(j * block_k, block_k)],
                  jnp.sum(value, axis=0), mask=cols < kv_len)
    else:
      plgpu.store(out_ref.at[pl.ds(q_start, block_q), pl.ds(j * block_k,
                                                             block_k)],
                  value, mask=(rows < q_len)[:, None] & (cols < kv_len)[None, :])

  def ds_body(j, carry, *, masked):
    store_cols(j, tile_ds(j, masked)[0])
    return carry

  def zero_body(j, carry):  # Skipped tiles have dS = 0.
    store_cols(j, jnp.zeros((block_q, block_k), jnp.float32))
    return carry

  num_kv_tiles = pl.cdiv(kv_len, block_k)
  lax.fori_loop(0, lo, zero_body, None)
  for start, stop, masked in visited:
    lax.fori_loop(start, stop, functools.partial(ds_body, masked=masked), None)
  lax.fori_loop(hi, num_kv_tiles, zero_body, None)


def flash_backward(q, k, v, extras: Extras, o, lse2, do, dlse2, *,
                   scores: Scores, mask: masking.Mask, block_sizes: BlockSizes,
                   interpret: bool = False):
  """Gradients of the forward with respect to q, k, v (and the bias).

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H]; o, do: [B, T, N, H].
    extras: the optional operands of the forward.
    lse2: [B, N, T] base-2 logsumexp saved by the forward.
    dlse2: [B, N, T] cotangent of lse2 (zeros unless the caller used it).
  Returns:
    dq [B, T, N, H] in q.dtype; dk, dv [B, S, K, H] in k.dtype, summed over
    the query heads that share each key/value head; dbias shaped like
    extras.bias (float32), or None without a bias.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  hp = padded_head_dim(head_dim)
  # dS = P * (dP - D) + dlse * dlse/dS; with lse2 = lse * log2(e) the second
  # term is P * dlse2 * log2(e), so it folds into D.
  delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32),
                     do.astype(jnp.float32)) - dlse2 * LOG2E
  static = dict(scores=scores, mask=mask, head_dim=head_dim)
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
  names, specs, operands = extras.for_key_tiles(bq, bk, group)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, extras=names, block_q=bq, block_k=bk,
                        **static),
      grid=(pl.cdiv(kv_len, bk), batch, num_kv_heads),
      in_specs=[group_spec, kv_spec, kv_spec, group_spec, group_stat_spec,
                group_stat_spec, *specs],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="flash_attention_backward_dkdv",
  )(q, k, v, do, lse2, delta, *operands)

  # dQ (and dBias): grid over (query tiles, batch, heads).
  bq, bk = block_sizes.block_q_dq, block_sizes.block_k_dq
  num_q_tiles = pl.cdiv(q_len, bq)
  q_spec = pl.BlockSpec((None, q_len, None, hp), lambda i, b, n: (b, 0, n, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, hp),
                         lambda i, b, n: (b, 0, lax.div(n, group), 0))
  stat_spec = pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))
  names, specs, operands = extras.for_query_tiles(bq, bk)

  def run(output, out_shape):
    out_spec = pl.BlockSpec((None, None) + out_shape[2:],
                            lambda i, b, n: (b, n, 0, 0))
    if output == "dq":
      out_spec = q_spec
    return pl.pallas_call(
        functools.partial(_dq_kernel, extras=names, block_q=bq, block_k=bk,
                          output=output, **static),
        grid=(num_q_tiles, batch, num_heads),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec,
                  *specs],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, q.dtype if output == "dq"
                                       else jnp.float32),
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"flash_attention_backward_{output}",
    )(q, k, v, do, lse2, delta, *operands)

  dq = run("dq", q.shape)
  dbias = None
  if extras.bias is not None:
    bm, nm, tm, sm = extras.bias.shape
    if sm == 1:
      buf = run("dbias_rows", (batch, num_heads, q_len, 1))
    elif tm == 1:
      buf = run("dbias_cols", (batch, num_heads, num_q_tiles, kv_len))
    else:
      buf = run("dbias_tiles", (batch, num_heads, q_len, kv_len))
    axes = tuple(a for a, d in enumerate((bm, nm, tm, sm)) if d == 1)
    dbias = jnp.sum(buf, axis=axes, keepdims=True)
  return dq, dk, dv, dbias
