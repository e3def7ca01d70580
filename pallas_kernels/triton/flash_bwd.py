"""FlashAttention-2 backward (Dao 2023, Algorithm 2) for the Triton lowering.

`D = rowsum(dO * O)` is one XLA reduction before the kernels. Then, with no
atomics anywhere, so gradients are bitwise deterministic:

* dK/dV: one program owns a key tile of one (batch, kv head). It loops over the
  query heads of its GQA group and over query tiles, recomputes
  P^T = exp(S^T - L) from the forward's logsumexp (S^T = K Q^T keeps every
  dot's M dimension at the key tile), and accumulates dV += P^T dO and
  dK += dS^T Q with dS = P * (dP - D): dK/dV come out summed over the group.
  Where those programs are too few to fill the GPU (a few keys against many
  queries), each key tile's query tiles are split into runs of one program
  each, whose float32 shares XLA sums in a fixed order (`dkdv_splits`).
* dQ: one program owns a query tile of one (batch, head), loops over key tiles
  and accumulates dQ += dS K.
* dBias (only when a bias is given; XLA drops it when its result is unused):
  the same loop as dQ, writing dS itself, summed over the dimensions the bias
  broadcasts along.

All visit only the tiles the mask does not hide entirely, and evaluate the
mask predicate only on the tiles that cross its boundary.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_flash.core import device, softmax
from jax_flash.core import mask as mask_lib
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores
from pallas_kernels.triton import operand_specs
from pallas_kernels.triton.config import BlockSizes, padded_head_dim
from pallas_kernels.triton.tile_context import TileContext
from pallas_kernels.triton.tiles import dot, load_row_stat, load_tile, store_tile

_INF = float("inf")


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 operand_refs: Operands, id_table_ref, dk_ref, dv_ref, *,
                 scores: Scores, mask: Mask, head_dim: int,
                 value_head_dim: int, block_q: int, block_k: int,
                 splits: int):
  """One (key tile, batch, kv head), or with `splits` > 1 one of that many
  equal runs of its query tiles (`dkdv_splits`).

  q_ref: [T, G, Hp]; do_ref: [T, G, Hvp]; k/dk_ref: [S, Hp]; v/dv_ref:
  [S, Hvp] (with splits, dk/dv_ref float32: this run's share);
  lse/delta_ref: [G, T];
  operand_refs: the optional operands' refs, per-head ones as [G, ...]
  (`operand_specs.for_key_tiles`).
  """
  q_len, group = q_ref.shape[0], q_ref.shape[1]
  kv_len = k_ref.shape[0]
  ctx = TileContext(mask, scores, operand_refs, id_table_ref, q_len, kv_len,
                    block_q, block_k, batch=pl.program_id(1),
                    query_head=pl.program_id(2) * group, transposed=True)
  kv_tile = lax.div(pl.program_id(0), splits)
  kv_start = kv_tile * block_k
  # Keys past a length may hold garbage: zeroed (dK/dV there come out 0).
  k = ctx.without_padding(load_tile(k_ref, kv_start, block_k, row_bound=kv_len,
                                    head_dim=head_dim), kv_start, keys=True)
  v = ctx.without_padding(load_tile(v_ref, kv_start, block_k, row_bound=kv_len,
                                    head_dim=value_head_dim), kv_start,
                          keys=True)
  kv_ids = ctx.kv_ids(kv_start) if mask.has_ids else None

  def body(j, carry, *, head, slope, masked: bool):
    dk, dv = carry
    q_start = j * block_q
    # Rows past q_len load Q = dO = 0 and L = +inf (P = 0): they add nothing.
    q = load_tile(q_ref, q_start, block_q, row_bound=q_len,
                  head_dim=head_dim, head=head)
    do = load_tile(do_ref, q_start, block_q, row_bound=q_len,
                   head_dim=value_head_dim, head=head)
    if masked:  # Queries past a length may hold garbage.
      q = ctx.without_padding(q, q_start, keys=False)
      do = ctx.without_padding(do, q_start, keys=False)
    lse2 = softmax.backward_lse2(load_row_stat(
        lse_ref, q_start, block_q, row_bound=q_len, head=head, other=_INF))
    delta = load_row_stat(delta_ref, q_start, block_q, row_bound=q_len,
                          head=head)
    s_t, tanh_t = ctx.logits2(dot(k, q, trans_b=True), q_start, kv_start,
                              head=head, slope=slope)  # [block_k, block_q]
    p_t = jnp.exp2(s_t - lse2[None, :])
    if masked:
      p_t = jnp.where(ctx.visible(q_start, kv_start, kv_ids=kv_ids,
                                  head=head), p_t, 0.0)
    query_head = ctx.query_head + head
    dv = dv + dot(ctx.dropped(p_t, q_start, kv_start, query_head)
                  .astype(do.dtype), do)
    dp_t = ctx.dropped(dot(v, do, trans_b=True), q_start, kv_start,
                       query_head)
    ds_t = scores.dqk(p_t * (dp_t - delta[None, :]), tanh_t)
    dk = dk + dot(ds_t.astype(q.dtype), q)
    return dk, dv

  ranges = ctx.q_ranges(kv_tile, kv_start)
  if splits > 1:  # This run's query tiles, all of them fully in it.
    per = pl.cdiv(pl.cdiv(q_len, block_q), splits)
    first = lax.rem(pl.program_id(0), splits) * per
    ranges = mask_lib.intersect_ranges(ranges, (first, first, first + per,
                                                first + per))

  def head_body(head, carry):
    step = functools.partial(body, head=head, slope=ctx.slope(head))
    return ctx.visit(ranges, step, carry)

  dk, dv = lax.fori_loop(0, group, head_body, (
      jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32),
      jnp.zeros((block_k, v_ref.shape[-1]), jnp.float32)))
  store_tile(dk_ref, kv_start, dk * scores.scale, row_bound=kv_len,
             head_dim=head_dim)
  store_tile(dv_ref, kv_start, dv, row_bound=kv_len, head_dim=value_head_dim)


class _QueryTile:
  """What the dQ and dBias kernels share: one (query tile, batch, head)
  program's Q, dO, L and D, and dS = dL/d(logits) of any of its key tiles.

  q_ref: [T, Hp]; do_ref: [T, Hvp]; k_ref: [S, Hp]; v_ref: [S, Hvp];
  lse/delta_ref: [T].
  """

  def __init__(self, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               operand_refs, id_table_ref, *, scores, mask, head_dim,
               value_head_dim, block_q, block_k):
    q_len, kv_len = q_ref.shape[0], k_ref.shape[0]
    self.ctx = TileContext(mask, scores, operand_refs, id_table_ref, q_len,
                           kv_len, block_q, block_k, batch=pl.program_id(1),
                           query_head=pl.program_id(2))
    self.k_ref, self.v_ref = k_ref, v_ref
    self.head_dim, self.block_k = head_dim, block_k
    self.value_head_dim = value_head_dim
    self.tile = pl.num_programs(0) - 1 - pl.program_id(0)  # Longest first.
    self.q_start = self.tile * block_q
    bound = dict(row_bound=q_len, head_dim=head_dim)
    # Queries past a length may hold garbage: zeroed.
    self.q = self.ctx.without_padding(
        load_tile(q_ref, self.q_start, block_q, **bound), self.q_start,
        keys=False)
    self.do = self.ctx.without_padding(
        load_tile(do_ref, self.q_start, block_q, row_bound=q_len,
                  head_dim=value_head_dim), self.q_start, keys=False)
    self.lse2 = softmax.backward_lse2(load_row_stat(
        lse_ref, self.q_start, block_q, row_bound=q_len, other=_INF))
    self.delta = load_row_stat(delta_ref, self.q_start, block_q,
                               row_bound=q_len)
    self.q_ids = self.ctx.q_ids(self.q_start) if mask.has_ids else None
    # Read here: the interpreter wants program ids outside loops.
    self.head = pl.program_id(2)
    self.slope = self.ctx.slope(self.head)
    self.ranges = self.ctx.kv_ranges(self.tile, self.q_start)

  def ds(self, j, masked: bool):
    """(dS, the soft-cap tanh or None, K) of key tile j."""
    p, dp, tanh, k = self.probs(j, masked)
    return p * (dp - self.delta[:, None]), tanh, k

  def probs(self, j, masked: bool):
    """(P, dP, the soft-cap tanh or None, K) of key tile j."""
    ctx, k_start = self.ctx, j * self.block_k
    bound = ctx.kv_len if masked else None
    k = load_tile(self.k_ref, k_start, self.block_k, row_bound=bound,
                  head_dim=self.head_dim)
    v = load_tile(self.v_ref, k_start, self.block_k, row_bound=bound,
                  head_dim=self.value_head_dim)
    if masked:  # Only boundary tiles can hold keys past a length.
      k = ctx.without_padding(k, k_start, keys=True)
      v = ctx.without_padding(v, k_start, keys=True)
    s, tanh = ctx.logits2(dot(self.q, k, trans_b=True), self.q_start, k_start,
                          slope=self.slope)
    p = jnp.exp2(s - self.lse2[:, None])
    if masked:
      p = jnp.where(ctx.visible(self.q_start, k_start, q_ids=self.q_ids), p,
                    0.0)
    dp = ctx.dropped(dot(self.do, v, trans_b=True), self.q_start, k_start,
                     self.head)
    return p, dp, tanh, k


def _dq_kernel(*refs, scores: Scores, mask: Mask, head_dim: int,
               value_head_dim: int, block_q: int, block_k: int):
  """One (query tile, batch, head): dQ = scale * sum_j dS_j K_j.

  refs: as `_QueryTile`, then dq_ref [T, Hp].
  """
  *inputs, dq_ref = refs
  prog = _QueryTile(*inputs, scores=scores, mask=mask, head_dim=head_dim,
                    value_head_dim=value_head_dim, block_q=block_q,
                    block_k=block_k)

  def body(j, dq, *, masked):
    ds, tanh, k = prog.ds(j, masked)
    return dq + dot(scores.dqk(ds, tanh).astype(k.dtype), k)

  dq = prog.ctx.visit(prog.ranges, body,
                      jnp.zeros((block_q, dq_ref.shape[-1]), jnp.float32))
  store_tile(dq_ref, prog.q_start, dq * scores.scale,
             row_bound=prog.ctx.q_len, head_dim=head_dim)


def _dbias_kernel(*refs, scores: Scores, mask: Mask, head_dim: int,
                  value_head_dim: int, block_q: int, block_k: int,
                  sum_keys: bool, sum_queries: bool):
  """One (query tile, batch, head): dBias = dS, summed as the bias broadcasts.

  refs: as `_QueryTile` (but delta_ref holds the logsumexp's cotangent when
  `sum_keys`), then dbias_ref: [T, 1] row sums when the bias broadcasts over
  keys (`sum_keys`: `softmax.key_sum_of_ds`); [num_q_tiles, S] this tile's column sums
  when it broadcasts over queries only (`sum_queries`; XLA sums the tiles);
  else [T, S], dS itself. Tiles the mask hides have dS = 0.
  """
  *inputs, dbias_ref = refs
  prog = _QueryTile(*inputs, scores=scores, mask=mask, head_dim=head_dim,
                    value_head_dim=value_head_dim, block_q=block_q,
                    block_k=block_k)
  ctx, q_start = prog.ctx, prog.q_start
  rows = q_start + jnp.arange(block_q)

  if sum_keys:
    def rowsum_body(j, acc, *, masked):
      p, dp, _, _ = prog.probs(j, masked)
      return acc[0] + jnp.sum(p * dp, axis=1), acc[1] + jnp.sum(p, axis=1)
    zeros = jnp.zeros((block_q,), jnp.float32)
    p_dp, p_sum = ctx.visit(prog.ranges, rowsum_body, (zeros, zeros))
    plgpu.store(dbias_ref.at[pl.ds(q_start, block_q), jnp.int32(0)],
                softmax.key_sum_of_ds(p_dp, p_sum, prog.delta),
                mask=rows < ctx.q_len)
    return

  def store(j, ds):
    cols = j * block_k + jnp.arange(block_k)
    if sum_queries:
      plgpu.store(dbias_ref.at[prog.tile, pl.ds(j * block_k, block_k)],
                  jnp.sum(ds, axis=0), mask=cols < ctx.kv_len)
    else:
      plgpu.store(dbias_ref.at[pl.ds(q_start, block_q),
                               pl.ds(j * block_k, block_k)], ds,
                  mask=(rows < ctx.q_len)[:, None] & (cols < ctx.kv_len)[None])

  def ds_body(j, carry, *, masked):
    store(j, prog.ds(j, masked)[0])
    return carry

  def zero_body(j, carry):
    store(j, jnp.zeros((block_q, block_k), jnp.float32))
    return carry

  lo, _, _, hi = prog.ranges
  lax.fori_loop(0, lo, zero_body, None)
  ctx.visit(prog.ranges, ds_body, None)
  lax.fori_loop(hi, pl.cdiv(ctx.kv_len, block_k), zero_body, None)


# Programs a multiprocessor the dK/dV kernel should have at least, and
# query tiles a run of its at least (`dkdv_splits`).
DKDV_PROGRAMS_PER_SM = 2
DKDV_MIN_RUN = 8


def dkdv_splits(programs: int, q_tiles: int, multiprocessors: int) -> int:
  """Runs the dK/dV kernel splits each key tile's query tiles into: one
  where its `programs` (key tiles x batch x KV heads) fill the GPU, else
  enough for DKDV_PROGRAMS_PER_SM a multiprocessor, each run at least
  DKDV_MIN_RUN tiles (few keys against many queries: cross-attention on
  77 text tokens has 64 programs for 132 multiprocessors)."""
  wanted = pl.cdiv(DKDV_PROGRAMS_PER_SM * multiprocessors, programs)
  return max(1, min(wanted, q_tiles // DKDV_MIN_RUN))


@dataclasses.dataclass(frozen=True)
class _Launch:
  """What the backward's kernel launches share (`flash_backward`)."""
  scores: Scores
  mask: Mask
  blocks: BlockSizes
  interpret: bool
  head_dim: int
  value_head_dim: int
  group: int

  @property
  def static(self) -> dict:
    return dict(scores=self.scores, mask=self.mask, head_dim=self.head_dim,
                value_head_dim=self.value_head_dim)

  @property
  def widths(self):  # Q/K's and V's head dims, padded.
    return padded_head_dim(self.head_dim), padded_head_dim(
        self.value_head_dim)

  @property
  def compiler_params(self):
    return plgpu.CompilerParams(num_warps=self.blocks.num_warps_bwd,
                                num_stages=self.blocks.num_stages_bwd)


def _dkdv_call(launch: _Launch, q, k, v, operands: Operands, delta, lse, do):
  """dK, dV: grid over (key tiles x splits, batch, kv heads); the group's
  query heads are one block of `group` consecutive heads; with several
  splits of the query tiles, their float32 shares summed in a fixed
  order."""
  batch, q_len, _, _ = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group, (hp, hvp) = launch.group, launch.widths
  bq, bk = launch.blocks.block_q_dkv, launch.blocks.block_k_dkv
  def group_spec(width):
    return pl.BlockSpec((None, q_len, group, width),
                        lambda j, b, h: (b, 0, h, 0))

  def kv_spec(width):
    return pl.BlockSpec((None, kv_len, None, width),
                        lambda j, b, h: (b, 0, h, 0))
  group_stat_spec = pl.BlockSpec((None, group, q_len), lambda j, b, h: (b, h, 0))
  extra = operand_specs.for_key_tiles(operands, launch.mask, bq, bk, q_len,
                                      kv_len, group)
  splits = dkdv_splits(pl.cdiv(kv_len, bk) * batch * num_kv_heads,
                       pl.cdiv(q_len, bq), device.num_multiprocessors())

  def out_spec(width):
    if splits == 1:
      return kv_spec(width)
    return pl.BlockSpec((None, None, kv_len, None, width),
                        lambda j, b, h: (lax.rem(j, splits), b, 0, h, 0))

  def out_shape(x):
    if splits == 1:
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct((splits, *x.shape), jnp.float32)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=bq, block_k=bk, splits=splits,
                        **launch.static),
      grid=(pl.cdiv(kv_len, bk) * splits, batch, num_kv_heads),
      in_specs=[group_spec(hp), kv_spec(hp), kv_spec(hvp), group_spec(hvp),
                group_stat_spec, group_stat_spec, *extra.in_specs()],
      out_specs=[out_spec(hp), out_spec(hvp)],
      out_shape=[out_shape(k), out_shape(v)],
      compiler_params=launch.compiler_params,
      interpret=launch.interpret,
      name="flash_attention_backward_dkdv",
  )(q, k, v, do, lse, delta, *extra.args())
  if splits > 1:  # The runs' shares summed in a fixed order.
    dk, dv = (x.sum(axis=0).astype(y.dtype) for x, y in ((dk, k), (dv, v)))
  return dk, dv


def _query_tile_calls(launch: _Launch, q, k, v, operands: Operands, delta,
                      lse, do, dlse):
  """dQ and dBias (None without a bias): grid over (query tiles, batch,
  heads)."""
  batch, q_len, num_heads, _ = q.shape
  kv_len = k.shape[1]
  group, (hp, hvp) = launch.group, launch.widths
  bq, bk = launch.blocks.block_q_dq, launch.blocks.block_k_dq
  num_q_tiles = pl.cdiv(q_len, bq)
  def q_spec(width):
    return pl.BlockSpec((None, q_len, None, width),
                        lambda i, b, n: (b, 0, n, 0))

  def kv_spec(width):
    return pl.BlockSpec((None, kv_len, None, width),
                        lambda i, b, n: (b, 0, lax.div(n, group), 0))
  stat_spec = pl.BlockSpec((None, None, q_len), lambda i, b, n: (b, n, 0))
  extra = operand_specs.for_query_tiles(operands, launch.mask, bq, bk, q_len,
                                        kv_len)

  def query_tile_call(kernel, name, out_spec, out_shape, row_stat=delta):
    return pl.pallas_call(
        functools.partial(kernel, block_q=bq, block_k=bk, **launch.static),
        grid=(num_q_tiles, batch, num_heads),
        in_specs=[q_spec(hp), kv_spec(hp), kv_spec(hvp), q_spec(hvp),
                  stat_spec, stat_spec, *extra.in_specs()],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=launch.compiler_params,
        interpret=launch.interpret,
        name=name,
    )(q, k, v, do, lse, row_stat, *extra.args())

  dq = query_tile_call(_dq_kernel, "flash_attention_backward_dq", q_spec(hp),
                       jax.ShapeDtypeStruct(q.shape, q.dtype))
  if operands.bias is None:
    return dq, None
  bm, nm, tm, sm = operands.bias.shape
  sum_keys, sum_queries = sm == 1, tm == 1 and sm > 1
  shape = (batch, num_heads, num_q_tiles if sum_queries else q_len,
           1 if sum_keys else kv_len)
  buf = query_tile_call(
      functools.partial(_dbias_kernel, sum_keys=sum_keys,
                        sum_queries=sum_queries),
      "flash_attention_backward_dbias",
      pl.BlockSpec((None, None) + shape[2:], lambda i, b, n: (b, n, 0, 0)),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      row_stat=softmax.lse_cotangent(dlse, delta) if sum_keys else delta)
  axes = tuple(a for a, d in enumerate((bm, nm, tm, sm)) if d == 1)
  return dq, jnp.sum(buf, axis=axes, keepdims=True)


def flash_backward(q, k, v, operands: Operands, delta, lse, do, dlse, *,
                   scores: Scores, mask: Mask, block_sizes: BlockSizes,
                   interpret: bool = False):
  """Gradients of the forward with respect to q, k, v (and the bias).

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv]; do: [B, T, N, Hv].
    operands: the optional arrays of the forward.
    delta: D = rowsum(dO * O) - dlse, float32 [B, N, T]
      (`softmax.backward_delta`).
    lse: [B, N, T] the forward's natural-log logsumexp; dlse: its cotangent
      (zeros unless the caller used the logsumexp).
  Returns:
    dq [B, T, N, H] in q.dtype; dk, dv shaped and typed like k, v, summed over
    the query heads that share each key/value head; dbias shaped like
    operands.bias (float32), or None without a bias.
  """
  launch = _Launch(scores=scores, mask=mask, blocks=block_sizes,
                   interpret=interpret, head_dim=q.shape[-1],
                   value_head_dim=v.shape[-1],
                   group=q.shape[2] // k.shape[2])
  dk, dv = _dkdv_call(launch, q, k, v, operands, delta, lse, do)
  dq, dbias = _query_tile_calls(launch, q, k, v, operands, delta, lse, do,
                                dlse)
  return dq, dk, dv, dbias
