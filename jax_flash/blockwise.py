"""FlashAttention in plain JAX: the "xla" backend, for any device.

FlashAttention-2 (Dao 2023, Algorithms 1 and 2) written with XLA loops
instead of a kernel. The forward maps over query blocks; each walks the key
blocks that `mask.kv_block_ranges` (and, with ids, `mask.id_block_table`)
says are not entirely masked, keeping the online-softmax statistics of
`core.softmax`, and stores O and the logsumexp. The backward recomputes
P = exp(S - L) block by block: dQ per query block, dK, dV (and dBias)
accumulated across them. Nothing of size T x S is ever held (except a bias
gradient for a full T x S bias), so memory grows linearly in the sequence
length; causal and windowed masks skip their hidden blocks.

The logits, masks and dropout bits are those of the kernels: `core.scores`,
`core.mask`, `core.dropout`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash.core import dropout, fp8, softmax
from jax_flash.core import mask as mask_lib
from jax_flash.core.checks import check_block_field
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.padding import pad_pairs, pad_to
from jax_flash.core.scores import Scores


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key block lengths of the blockwise loops (clipped to the
  sequence lengths), built by keyword.

  Default 128 x 128, the fastest of 64-512 on a 2-core CPU at 1k and 8k
  tokens (benchmarks/NOTES.md, "The blockwise path").
  """
  block_q: int = 128
  block_k: int = 128

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      check_block_field(self, name, lambda x: x >= 1, ">= 1")


def _per_head(x, num_kv_heads: int):
  """[B|1, N|1, ...] -> [B|1, K|1, G|1, ...] (heads n = k * G + g)."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape((x.shape[0], num_kv_heads, -1) + x.shape[2:])


def _slice(x, axis: int, start, size: int):
  """x[start:start+size] along `axis`, or x itself where it broadcasts."""
  if x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, start, size, axis)


@dataclasses.dataclass(frozen=True)
class _Problem:
  """One call's static layout: padded lengths, blocks, and the description."""
  mask: Mask
  scores: Scores
  q_len: int
  kv_len: int
  block_q: int
  block_k: int
  num_kv_heads: int
  dtype: jnp.dtype

  @property
  def num_q_blocks(self):
    return -(-self.q_len // self.block_q)

  @property
  def num_k_blocks(self):
    return -(-self.kv_len // self.block_k)

  def dot(self, spec, a, b):
    """A block matmul accumulated in float32 (full float32 for float32;
    float64 operands rounded to float32 first: a GPU's BLAS has no f64 x
    f64 -> f32 matmul)."""
    precision = (lax.Precision.HIGHEST if jnp.dtype(self.dtype).itemsize >= 4
                 else None)
    if a.dtype.itemsize > 4 or b.dtype.itemsize > 4:
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, precision=precision,
                      preferred_element_type=jnp.float32)


def _setup(q, k, operands: Operands, mask: Mask, scores: Scores,
           config: BlockSizes):
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  bq, bk = min(config.block_q, t), min(config.block_k, s)
  if mask.mod is not None:  # The blocks of the mask_mod's tile kinds.
    bq, bk = mask.mod_tiles
  p = _Problem(mask, scores, t, s, bq, bk, kh, jnp.dtype(q.dtype))
  tp, sp = p.num_q_blocks * bq, p.num_k_blocks * bk
  ops = dataclasses.replace(
      operands,
      q_ids=pad_to(operands.q_ids, 1, tp, mask_lib.Q_PAD_ID),
      kv_ids=pad_to(operands.kv_ids, 1, sp, mask_lib.KV_PAD_ID),
      dense_mask=pad_pairs(operands.dense_mask, tp, sp),
      bias=pad_pairs(operands.bias, tp, sp))
  return p, tp, sp, ops


def _kv_ranges(p: _Problem, ops: Operands):
  """(lo, hi) [num_q_blocks] int32: the key blocks each query block visits,
  by the band and by the tile tables (ids, tile kinds) of any
  batch element."""
  starts = jnp.arange(p.num_q_blocks, dtype=jnp.int32) * p.block_q
  if p.mask.has_q_offsets:  # The union over the sequences' offsets.
    lo, _, _, hi = jax.vmap(jax.vmap(
        lambda s, o: mask_lib.kv_block_ranges(p.mask, s, p.block_q, p.block_k,
                                              p.kv_len, o),
        in_axes=(None, 0)), in_axes=(0, None))(starts, ops.q_offsets)
    lo, hi = jnp.min(lo, axis=1), jnp.max(hi, axis=1)
  else:
    lo, _, _, hi = jax.vmap(lambda s: mask_lib.kv_block_ranges(
        p.mask, s, p.block_q, p.block_k, p.kv_len))(starts)
  tables = []  # [B, nq, 4] each: by the ids, by the tile kinds.
  if p.mask.has_ids:
    tables.append(mask_lib.id_block_table(ops.q_ids, ops.kv_ids, p.block_q,
                                          p.block_k))
  if ops.tile_kinds is not None:
    tables.append(mask_lib.kinds_block_table(
        ops.tile_kinds, p.mask, p.block_q, p.block_k, p.q_len, p.kv_len))
  for table in tables:
    lo = jnp.maximum(lo, jnp.min(table[..., 0], axis=0))
    hi = jnp.minimum(hi, jnp.max(table[..., 3], axis=0))
  return lo, jnp.maximum(hi, lo)


def _batch_head(x):
  """Batch and query-head indices broadcasting against a [B, K, G, ...]
  block (head n = k * G + g): a mask_mod's and score_mod's b and h."""
  b, kh, g = x.shape[:3]
  batch = jnp.arange(b, dtype=jnp.int32)[:, None, None, None, None]
  head = (jnp.arange(kh, dtype=jnp.int32)[:, None] * g +
          jnp.arange(g, dtype=jnp.int32)[None, :])[None, :, :, None, None]
  return batch, head


def _coords(p: _Problem, ops: Operands, q0, k0):
  """(rows [bq, 1], cols [1, bk], the queries' offset: 0, or [B, 1, 1, 1, 1]
  with `Mask.has_q_offsets`) of the block at q0, k0."""
  rows = q0 + jnp.arange(p.block_q, dtype=jnp.int32)[:, None]
  cols = k0 + jnp.arange(p.block_k, dtype=jnp.int32)[None, :]
  offset = 0
  if p.mask.has_q_offsets:
    offset = ops.q_offsets[:, None, None, None, None]
  return rows, cols, offset


def _logits2(p: _Problem, ops: Operands, qk, q0, k0):
  """Base-2 logits of a block, -inf where masked, and the soft-cap tanh.

  qk: float32 [B, K, G, bq, bk] raw scores of rows q0.. and columns k0..
  """
  rows, cols, offset = _coords(p, ops, q0, k0)
  positions = rows + offset  # What ALiBi and the mods see of a query.
  slope = bias = None
  if p.scores.alibi:
    slope = _per_head(ops.alibi_slopes, p.num_kv_heads)[..., None, None]
  if p.scores.bias:
    tile = _slice(_slice(ops.bias, 2, q0, p.block_q), 3, k0, p.block_k)
    bias = _per_head(tile.astype(jnp.float32), p.num_kv_heads)
  batch = head = None
  if p.mask.mod is not None or p.scores.mod is not None:
    batch, head = _batch_head(qk)
  s2, tanh = p.scores.logits2(qk, positions, cols, slope, bias, batch, head,
                              ops.score_consts or ())
  q_ids = kv_ids = None
  if p.mask.has_ids:
    q_ids = lax.dynamic_slice_in_dim(ops.q_ids, q0, p.block_q, 1)
    kv_ids = lax.dynamic_slice_in_dim(ops.kv_ids, k0, p.block_k, 1)
    q_ids, kv_ids = q_ids[:, None, None, :, None], kv_ids[:, None, None, None]
  band = dataclasses.replace(p.mask, mod=None)
  visible = band.visible(rows, cols, p.kv_len, q_ids, kv_ids, offset)
  if p.mask.mod is not None:  # Evaluated only where a tile is not full.
    full = jnp.all(ops.tile_kinds[:, q0 // p.block_q, k0 // p.block_k] ==
                   mask_lib.FULL)
    visible = visible & lax.cond(
        full, lambda: jnp.ones(qk.shape, bool),
        lambda: jnp.broadcast_to(p.mask.mod(
            batch, head, positions, cols, consts=ops.mask_consts or ()),
            qk.shape))
  if p.mask.has_dense:
    tile = _slice(_slice(ops.dense_mask, 2, q0, p.block_q), 3, k0, p.block_k)
    visible = visible & (_per_head(tile, p.num_kv_heads) != 0)
  return jnp.where(visible, s2, -jnp.inf), tanh


def _dropped(p: _Problem, ops: Operands, x, q0, k0):
  """x * keep / (1 - rate) for a [B, K, G, bq, bk] block: the kernels' bits."""
  if not p.scores.dropout:
    return x
  if p.scores.dropout_broadcast:
    batch, head = jnp.int32(0), jnp.int32(0)
  else:
    batch, head = _batch_head(x)
  rows, cols, offset = _coords(p, ops, q0, k0)
  seed = ops.dropout_seed  # The bits of the queries' positions.
  return dropout.dropped(x, seed, p.scores.dropout_rate, batch, head,
                         rows + offset, cols)


def _blocks(x, num: int, size: int, kh: int):
  """[B, L, N, H] -> [num, B, size, K, G, H] (L = num * size)."""
  b, _, n, h = x.shape
  return x.reshape(b, num, size, kh, n // kh, h).transpose(1, 0, 2, 3, 4, 5)


def _scan(f, init, xs):
  """lax.scan(f, init, xs), or f called once on a single block: XLA's CPU
  compiler (jax 0.11.2) can hang inlining a loop of one trip in a
  program that custom_partitioning assembled (an all_to_all call's
  forward at 128 tokens or fewer)."""
  if jax.tree.leaves(xs)[0].shape[0] != 1:
    return lax.scan(f, init, xs)
  carry, ys = f(init, jax.tree.map(lambda x: x[0], xs))
  return carry, jax.tree.map(lambda y: y[None], ys)


def forward(q, k, v, operands: Operands, *, mask: Mask, scores: Scores,
            config: BlockSizes):
  """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> (o [B, T, N, Hv] in
  q.dtype, lse [B, N, T] float32, natural log)."""
  p, tp, sp, ops = _setup(q, k, operands, mask, scores, config)
  b, t, n, h = q.shape
  hv = v.shape[-1]
  kh, g = p.num_kv_heads, n // p.num_kv_heads
  (q,), (k, v) = mask_lib.without_padding(mask, operands.q_ids,
                                          operands.kv_ids, (q,), (k, v))
  k, v = pad_to(k, 1, sp), pad_to(v, 1, sp)
  lo, hi = _kv_ranges(p, ops)
  rows = b * kh * g * p.block_q
  sink2 = None
  if scores.sinks:  # Each row's head's sink, base 2.
    sink2 = jnp.broadcast_to(
        (operands.sinks * softmax.LOG2E).reshape(1, kh, g, 1),
        (b, kh, g, p.block_q)).reshape(rows)

  def q_block(args):
    i, qb = args  # qb [B, bq, K, G, H]
    q0 = i * p.block_q

    def body(j, carry):
      acc, m, l = carry
      k0 = j * p.block_k
      kb = lax.dynamic_slice_in_dim(k, k0, p.block_k, 1)
      vb = lax.dynamic_slice_in_dim(v, k0, p.block_k, 1)
      s2, _ = _logits2(p, ops, p.dot("bqkgh,bskh->bkgqs", qb, kb), q0, k0)
      m, alpha, prob, l = softmax.update(m, l, s2.reshape(rows, p.block_k),
                                         autodiff=True)
      prob = _dropped(p, ops, prob.reshape(s2.shape), q0, k0)
      if scores.fp8:  # e4m3 values of P * 448: exact in V's dtype.
        pv = p.dot("bkgqs,bskh->bkgqh", fp8.quantize_p(prob).astype(v.dtype),
                   vb) / fp8.E4M3_MAX
      else:
        pv = p.dot("bkgqs,bskh->bkgqh", prob.astype(v.dtype), vb)
      return acc * alpha[:, None] + pv.reshape(rows, hv), m, l

    carry = lax.fori_loop(lo[i], hi[i], body, softmax.init(rows, hv))
    o, lse = softmax.finalize(*carry, sink2=sink2)
    return (o.reshape(b, kh, g, p.block_q, hv).astype(q.dtype),
            lse.reshape(b, kh, g, p.block_q))

  qs = _blocks(pad_to(q, 1, tp), p.num_q_blocks, p.block_q, kh)
  _, (o, lse) = _scan(lambda _, x: (None, q_block(x)), None,
                      (jnp.arange(p.num_q_blocks), qs))
  # [nq, B, K, G, bq, (H)] -> [B, T, N, H] and [B, N, T].
  o = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, n, hv)[:, :t]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, n, tp)[..., :t]
  return o, lse


def backward(q, k, v, operands: Operands, delta, lse, do, dlse, *,
             mask: Mask, scores: Scores, config: BlockSizes):
  """(dq, dk, dv, Operands of the operands' gradients: bias, and the arrays
  a score_mod closes over; None where none) from the forward's logsumexp
  and D = rowsum(dO * O) - dlse (`delta`)."""
  p, tp, sp, ops = _setup(q, k, operands, mask, scores, config)
  b, t, n, h = q.shape
  kh, g = p.num_kv_heads, n // p.num_kv_heads
  (q, do), (k, v) = mask_lib.without_padding(
      mask, operands.q_ids, operands.kv_ids, (q, do), (k, v))
  k, v = pad_to(k, 1, sp), pad_to(v, 1, sp)
  lo, hi = _kv_ranges(p, ops)
  lse2 = softmax.backward_lse2(pad_to(lse, 2, tp, -jnp.inf))

  def stats(x):  # [B, N, Tp] -> [nq, B, K, G, bq]
    return x.reshape(b, kh, g, p.num_q_blocks, p.block_q).transpose(
        3, 0, 1, 2, 4)

  bias_shape = None if ops.bias is None else ops.bias.shape
  # A bias over queries only: its gradient from sums over each row's keys
  # (`softmax.key_sum_of_ds`), which read the logsumexp's cotangent.
  key_sum = bias_shape is not None and bias_shape[3] == 1
  dlse = softmax.lse_cotangent(dlse, delta) if key_sum else None
  # The score_mod's floating arrays get gradients (dL/dS through its vjp).
  consts = ops.score_consts or ()
  trained = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]

  def const_grads(qk, q0, k0, ds):
    def logits(floats):
      it = iter(floats)
      c = tuple(next(it) if t else x for x, t in zip(consts, trained))
      return _logits2(p, dataclasses.replace(ops, score_consts=c), qk, q0,
                      k0)[0]
    floats = [c for c, t in zip(consts, trained) if t]
    _, vjp = jax.vjp(logits, floats)
    return vjp(ds / softmax.LOG2E)[0]  # s2 is s * log2(e).

  def q_block(carry, args):
    i, qb, dob, lse2_b, delta_b, dlse_b = args
    q0 = i * p.block_q

    def body(j, inner):
      dq, dk, dv, dbias, dconsts, sums = inner
      k0 = j * p.block_k
      kb = lax.dynamic_slice_in_dim(k, k0, p.block_k, 1)
      vb = lax.dynamic_slice_in_dim(v, k0, p.block_k, 1)
      qk = p.dot("bqkgh,bskh->bkgqs", qb, kb)
      s2, tanh = _logits2(p, ops, qk, q0, k0)
      prob = jnp.exp2(s2 - lse2_b[..., None])
      dp = _dropped(p, ops, p.dot("bqkgh,bskh->bkgqs", dob, vb), q0, k0)
      dv_b = p.dot("bkgqs,bqkgh->bskh",
                   _dropped(p, ops, prob, q0, k0).astype(do.dtype), dob)
      ds = prob * (dp - delta_b[..., None])
      if key_sum:  # sum P * dP and sum P (softmax.key_sum_of_ds).
        sums = (sums[0] + jnp.sum(prob * dp, axis=-1),
                sums[1] + jnp.sum(prob, axis=-1))
      elif dbias is not None:
        dbias = _add_dbias(dbias, ds, q0, k0, p)
      if dconsts:
        dconsts = jax.tree.map(jnp.add, dconsts,
                               const_grads(qk, q0, k0, ds))
      dqk = p.scores.dqk(ds, tanh).astype(q.dtype)
      dq = dq + p.dot("bkgqs,bskh->bqkgh", dqk, kb)
      dk_b = p.dot("bkgqs,bqkgh->bskh", dqk, qb)
      dk = lax.dynamic_update_slice_in_dim(
          dk, lax.dynamic_slice_in_dim(dk, k0, p.block_k, 1) + dk_b, k0, 1)
      dv = lax.dynamic_update_slice_in_dim(
          dv, lax.dynamic_slice_in_dim(dv, k0, p.block_k, 1) + dv_b, k0, 1)
      return dq, dk, dv, dbias, dconsts, sums

    dq = jnp.zeros(qb.shape, jnp.float32)
    sums = None
    if key_sum:
      sums = (jnp.zeros(lse2_b.shape, jnp.float32),) * 2
    dq, dk, dv, dbias, dconsts, sums = lax.fori_loop(
        lo[i], hi[i], body, (dq, *carry, sums))
    if key_sum:
      rows = softmax.key_sum_of_ds(*sums, dlse_b)
      dbias = _add_dbias(dbias, rows[..., None], q0, 0, p)
    return (dk, dv, dbias, dconsts), (dq * p.scores.scale).astype(q.dtype)

  split = lambda x: _blocks(pad_to(x, 1, tp), p.num_q_blocks, p.block_q, kh)
  dk0 = jnp.zeros((b, sp, kh, h), jnp.float32)
  dv0 = jnp.zeros((b, sp, kh, v.shape[-1]), jnp.float32)
  dbias0 = None if bias_shape is None else jnp.zeros(bias_shape, jnp.float32)
  dconsts0 = [jnp.zeros(c.shape, jnp.float32)
              for c, t in zip(consts, trained) if t]
  (dk, dv, dbias, dconsts), dq = _scan(
      q_block, (dk0, dv0, dbias0, dconsts0),
      (jnp.arange(p.num_q_blocks), split(q), split(do), stats(lse2),
       stats(pad_to(delta, 2, tp)),
       None if dlse is None else stats(pad_to(dlse, 2, tp))))
  dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(b, tp, n, h)[:, :t]
  dk = (dk[:, :p.kv_len] * p.scores.scale).astype(k.dtype)
  dv = dv[:, :p.kv_len].astype(v.dtype)
  if dbias is not None:
    dbias = dbias[:, :, :operands.bias.shape[2], :operands.bias.shape[3]]
    dbias = dbias.astype(operands.bias.dtype)
  d_consts = None
  if consts:
    it = iter(dconsts)
    d_consts = tuple(next(it).astype(c.dtype) if t else jnp.zeros_like(c)
                     for c, t in zip(consts, trained))
  return dq, dk, dv, Operands(bias=dbias, score_consts=d_consts)


def _add_dbias(dbias, ds, q0, k0, p: _Problem):
  """Adds a block's dS [B, K, G, bq, bk], summed over the dimensions the bias
  broadcasts along, into dbias [Bm, Nm, Tpm, Spm]."""
  b, kh, g, bq, bk = ds.shape
  ds = ds.reshape(b, kh * g, bq, bk)
  bm, nm, tm, sm = dbias.shape
  axes = tuple(a for a, d in enumerate((bm, nm, tm, sm)) if d == 1)
  ds = jnp.sum(ds, axis=axes, keepdims=True)
  start = (0, 0, q0 if tm > 1 else 0, k0 if sm > 1 else 0)
  old = lax.dynamic_slice(dbias, start, ds.shape)
  return lax.dynamic_update_slice(dbias, old + ds, start)
