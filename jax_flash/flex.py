"""Flex attention: user-written mask and score modifications, block-sparse.

    def causal(b, h, q_idx, kv_idx):
      return q_idx >= kv_idx

    block_mask = jax_flash.create_block_mask(causal, None, None, T, S)
    out = jax_flash.flex_attention(q, k, v, block_mask=block_mask)

`mask_mod(b, h, q_idx, kv_idx) -> bool` and `score_mod(score, b, h, q_idx,
kv_idx) -> score` take int32 index arrays that broadcast against each other
(a function written for scalars works elementwise) and may close over arrays
(document ids, per-head tensors, a learned bias table): gradients flow to
query, key, value and to every floating array a score_mod closes over.

`create_block_mask` classifies each (query tile, key tile) pair as empty,
partial or full by evaluating mask_mod one query tile at a time (memory
linear in the lengths); attention never visits an empty tile and evaluates
mask_mod only on partial ones. A query row that sees no key outputs 0 with
zero gradients, as in `flash_attention`.

Backends: the Triton kernels (and the Pallas interpreter) take mask_mods and
score_mods that close over no array (only Python numbers: causal, prefix-LM,
windows and slopes written as formulas of the indices, soft-caps): the
functions are traced into the kernels, the tile kinds become their tile
ranges. Functions that close over arrays (document ids, per-head tensors, a
learned bias table) run on the blockwise plain-JAX FlashAttention loops
(`blockwise`, the "xla" implementation), on any device; so does every call
off the GPU with implementation=None.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flash import _dispatch, attention, blockwise
from jax_flash.spec import checks, softmax
from jax_flash.spec.mask import EMPTY, FULL, PARTIAL, Mask
from jax_flash.spec.mods import ElementwiseMod
from jax_flash.spec.operands import Operands
from jax_flash.spec.padding import pad_to
from jax_flash.spec.scores import Scores


def _examples(num_args: int, float_first: bool):
  return ((jnp.float32(0),) if float_first else ()) + (
      jnp.int32(0),) * (num_args - (1 if float_first else 0))


def _elementwise(fn: Callable, num_args: int, float_first: bool):
  """(pure function applied elementwise with broadcasting, its constants)."""
  converted, consts = jax.closure_convert(fn, *_examples(num_args,
                                                         float_first))

  def apply(consts, *args):
    return jnp.vectorize(lambda *xs: converted(*xs, *consts))(*args)
  return apply, tuple(consts)


@jax.tree_util.register_pytree_node_class
class BlockMask:
  """A mask_mod and, per (batch, head, query tile, key tile), whether the
  tile is empty, partial or full. Built by `create_block_mask`; reusable
  across layers and calls (a pytree: it goes through jit).

  kinds: int8 [Bm, Nm, num_q_tiles, num_k_tiles] (Bm, Nm: 1 or B, N).
  """

  def __init__(self, kinds, consts, mask_fn, q_len, kv_len, block_q,
               block_k, mask_mod=None):
    self.kinds, self.consts, self.mask_fn = kinds, tuple(consts), mask_fn
    self.q_len, self.kv_len = q_len, kv_len
    self.block_q, self.block_k = block_q, block_k
    self.mask_mod = mask_mod  # The user's function (the kernels trace it).

  def tree_flatten(self):
    return (self.kinds, self.consts), (self.mask_fn, self.q_len, self.kv_len,
                                       self.block_q, self.block_k,
                                       self.mask_mod)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], children[1], *aux)

  def visible(self, b, h, q_idx, kv_idx):
    """The mask_mod (and key positions < kv_len), broadcasting."""
    return self.mask_fn(self.consts, b, h, q_idx, kv_idx) & (
        kv_idx < self.kv_len)

  def __repr__(self):
    return (f"BlockMask(q_len={self.q_len}, kv_len={self.kv_len}, "
            f"block=({self.block_q}, {self.block_k}), "
            f"kinds={tuple(self.kinds.shape)})")


def create_block_mask(mask_mod: Callable, B: int | None, N: int | None,
                      T: int, S: int, *, block_size=None) -> BlockMask:
  """Evaluates `mask_mod(b, h, q_idx, kv_idx)` tile by tile.

  B, N: batch and heads the mask varies over, or None where it does not
  (one entry broadcast over them; mask_mod then sees index 0). T, S: query
  and key lengths. block_size: an int or (block_q, block_k); default 128.
  Runs under jit; memory is [B, N, block_q, S] at a time.
  """
  bq, bk = ((block_size, block_size) if isinstance(block_size, int) else
            block_size or (128, 128))
  for name, value in (("B", B), ("N", N)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"create_block_mask: {name} must be None or an int "
                       f">= 1, got {value!r}")
  for name, value in (("T", T), ("S", S), ("block_q", bq), ("block_k", bk)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"create_block_mask: {name} must be an int >= 1, got "
                       f"{value!r}")
  bm, nm = B or 1, N or 1
  mask_fn, consts = _elementwise(mask_mod, 4, float_first=False)
  num_q, num_k = -(-T // bq), -(-S // bk)
  b = jnp.arange(bm, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(nm, dtype=jnp.int32)[None, :, None, None]
  cols = jnp.arange(num_k * bk, dtype=jnp.int32)[None, None, None, :]

  def tile_kinds(i):
    rows = (i * bq + jnp.arange(bq, dtype=jnp.int32))[None, None, :, None]
    vis = mask_fn(consts, b, h, rows, cols) & (cols < S) & (rows < T)
    vis = jnp.broadcast_to(vis, (bm, nm, bq, num_k * bk)).reshape(
        bm, nm, bq, num_k, bk)
    # Rows and columns past the lengths are padding: they neither make a
    # tile partial nor keep it from being full.
    real = jnp.broadcast_to((rows < T) & (cols < S), vis.shape[:3] + (
        num_k * bk,)).reshape(vis.shape)
    any_ = jnp.any(vis, axis=(2, 4))
    all_ = jnp.all(vis | ~real, axis=(2, 4))
    return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(
        jnp.int8)

  kinds = lax.map(tile_kinds, jnp.arange(num_q))  # [nq, Bm, Nm, nk]
  return BlockMask(kinds.transpose(1, 2, 0, 3), consts, mask_fn, T, S, bq, bk,
                   mask_mod)


def and_masks(*mask_mods: Callable) -> Callable:
  """The mask_mod that is True where every one of mask_mods is."""
  return lambda b, h, q, k: functools.reduce(
      jnp.logical_and, [m(b, h, q, k) for m in mask_mods])


def or_masks(*mask_mods: Callable) -> Callable:
  """The mask_mod that is True where any of mask_mods is."""
  return lambda b, h, q, k: functools.reduce(
      jnp.logical_or, [m(b, h, q, k) for m in mask_mods])


@dataclasses.dataclass(frozen=True)
class _Static:
  """The custom_vjp's static argument."""
  mask_fn: Callable | None
  score_fn: Callable | None
  scale: float
  q_len: int
  kv_len: int
  block_q: int
  block_k: int


def flex_attention(query, key, value, score_mod: Callable | None = None,
                   block_mask: BlockMask | None = None, *, scale=None,
                   return_residual: bool = False, implementation=None):
  """softmax(score_mod(scale * Q K^T), masked by block_mask) V.

  Args:
    query: [B, T, N, H]; key, value: [B, S, K, H], K dividing N (GQA: query
      head n uses key/value head n // (N // K)).
    score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score` on the
      scaled scores (float32), h the query head; None: the identity.
    block_mask: from `create_block_mask(mask_mod, B|None, N|None, T, S)`;
      None: every key visible.
    scale: default 1 / sqrt(H).
    return_residual: also return the natural-log logsumexp [B, T, N].
    implementation: None: the Triton kernels on a GPU where they take the
      call (mask_mod and score_mod close over no array), else "xla" (the
      blockwise plain-JAX loops; any device). "pallas"/"triton": the GPU
      kernels; "interpret": the same kernels interpreted (any machine,
      slow); a named implementation that cannot take the call raises
      ValueError saying why.
  Returns:
    out [B, T, N, H] in query.dtype, or (out, logsumexp).
  """
  p = checks.check_qkv(query, key, value)
  if p.unbatched:
    raise ValueError("flex_attention takes batched inputs: query "
                     "[B, T, N, H], key/value [B, S, K, H]")
  scale = checks.check_scale(scale, p.head_dim)
  if block_mask is None:
    block_mask = create_block_mask(lambda b, h, q, k: q >= 0, None, None,
                                   p.q_len, p.kv_len)
  if not isinstance(block_mask, BlockMask):
    raise ValueError(f"block_mask must come from jax_flash.create_block_mask, "
                     f"got {type(block_mask).__name__}")
  if (block_mask.q_len, block_mask.kv_len) != (p.q_len, p.kv_len):
    raise ValueError(
        f"block_mask was made for (T, S) = ({block_mask.q_len}, "
        f"{block_mask.kv_len}); query and key give ({p.q_len}, {p.kv_len})")
  bm, nm = block_mask.kinds.shape[:2]
  if bm not in (1, p.batch) or nm not in (1, p.num_heads):
    raise ValueError(
        f"block_mask was made for B={bm}, N={nm}; query has B={p.batch}, "
        f"N={p.num_heads} (create it with those, or None to broadcast)")
  score_fn, score_consts = None, ()
  if score_mod is not None:
    score_fn, score_consts = _elementwise(score_mod, 5, float_first=True)
  kernel = _kernel_call(query, p, block_mask, score_mod, score_consts, scale,
                        implementation)
  if kernel is not None:
    backend, mask, scores, operands = kernel
    cfg = attention.config(backend, None, p, query.dtype, mask, scores)
    out, lse = attention.flash_call(query, key, value, operands, cfg)
    lse = lse.transpose(0, 2, 1)
    return (out, lse) if return_residual else out
  static = _Static(block_mask.mask_fn, score_fn, scale, p.q_len, p.kv_len,
                   block_mask.block_q, block_mask.block_k)
  out, lse = _flex(query, key, value, block_mask.kinds, block_mask.consts,
                   score_consts, static)
  lse = lse.transpose(0, 2, 1)
  return (out, lse) if return_residual else out


def _kernel_call(query, p, block_mask: BlockMask, score_mod, score_consts,
                 scale: float, implementation):
  """(backend, Mask, Scores, Operands) when a kernel backend runs this call,
  None for the blockwise loops; ValueError if a named backend cannot."""
  pow2 = lambda x: x > 0 and x & (x - 1) == 0
  why = None
  if _closes_over_arrays(block_mask.mask_mod, 4, False) or (
      score_mod is not None and _closes_over_arrays(score_mod, 5, True)):
    why = ("mask_mod and score_mod must close over no array for the "
           "kernels (this one does: implementation=None or 'xla' runs it)")
  elif block_mask.mask_mod is None or not (
      pow2(block_mask.block_q) and pow2(block_mask.block_k)):
    why = ("the kernels need a block_mask of power-of-two block sizes from "
           "create_block_mask")
  mask = Mask(mod=ElementwiseMod(block_mask.mask_mod) if why is None else None,
              mod_tiles=(block_mask.block_q, block_mask.block_k))
  scores = Scores(scale=scale, mod=None if score_mod is None else
                  ElementwiseMod(score_mod))
  if implementation == "xla":
    return None
  if implementation is None and (why or not _dispatch.on_gpu(query)):
    return None
  if why is not None:
    raise ValueError(f"implementation={implementation!r}: {why}")
  backend = _dispatch.select(implementation, query, p, query.dtype, mask=mask,
                             scores=scores)
  if backend is _dispatch.XLA:
    return None
  # A tile is visited if any head needs it, skips the predicate only if
  # full for every head (the kernels' ranges are per batch element).
  kinds = block_mask.kinds
  tile_kinds = jnp.where(jnp.all(kinds == FULL, axis=1), FULL, jnp.where(
      jnp.all(kinds == EMPTY, axis=1), EMPTY, PARTIAL)).astype(jnp.int8)
  return backend, mask, scores, Operands(tile_kinds=tile_kinds)


def _closes_over_arrays(fn, num_args: int, float_first: bool) -> bool:
  """Whether fn's trace holds any array (or traced) constant: a kernel
  cannot capture one (Python numbers become literals and are fine)."""
  if fn is None:
    return False
  closed = jax.make_jaxpr(fn)(*_examples(num_args, float_first))
  return bool(closed.consts)


class _Tiles:
  """One call's tile geometry and the logits of a tile."""

  def __init__(self, q, k, kinds, mask_consts, score_consts, st: _Static):
    self.b, self.t, self.n, self.h = q.shape
    self.kh = k.shape[2]
    self.g = self.n // self.kh
    self.st, self.kinds = st, kinds
    self.mask_consts, self.score_consts = mask_consts, score_consts
    self.num_q = -(-st.q_len // st.block_q)
    self.num_k = -(-st.kv_len // st.block_k)
    self.batch = jnp.arange(self.b, dtype=jnp.int32)[:, None, None, None,
                                                     None]
    self.head = (jnp.arange(self.kh, dtype=jnp.int32)[:, None] * self.g +
                 jnp.arange(self.g, dtype=jnp.int32)[None, :])[
                     None, :, :, None, None]
    self.dtype = jnp.dtype(q.dtype)
    # Key tiles each query tile visits: those not empty for every (b, h).
    nonempty = jnp.any(kinds != EMPTY, axis=(0, 1))  # [nq, nk]
    idx = jnp.arange(self.num_k, dtype=jnp.int32)
    self.lo = jnp.min(jnp.where(nonempty, idx, self.num_k), axis=1)
    self.hi = jnp.maximum(jnp.max(jnp.where(nonempty, idx + 1, 0), axis=1),
                          self.lo)
    self.all_full = jnp.all(kinds == FULL, axis=(0, 1))  # [nq, nk]

  def dot(self, spec, a, b):
    return blockwise.block_dot(spec, a, b, self.dtype)

  def coords(self, i, j):
    rows = i * self.st.block_q + jnp.arange(self.st.block_q,
                                            dtype=jnp.int32)[:, None]
    cols = j * self.st.block_k + jnp.arange(self.st.block_k,
                                            dtype=jnp.int32)[None, :]
    return rows, cols

  def scores(self, raw, i, j, score_consts):
    """score_mod(scale * raw) of tile (i, j): float32 [B, K, G, bq, bk]."""
    s = raw * self.st.scale
    if self.st.score_fn is None:
      return s
    rows, cols = self.coords(i, j)
    return self.st.score_fn(score_consts, s, self.batch, self.head, rows,
                            cols).astype(jnp.float32)

  def masked(self, s, i, j):
    """s with -inf where the mask hides a pair; mask_mod evaluated only if
    the tile is not full for every (batch, head)."""
    rows, cols = self.coords(i, j)

    def apply(s):
      visible = self.st.mask_fn(self.mask_consts, self.batch, self.head,
                                rows, cols) & (cols < self.st.kv_len)
      return jnp.where(visible, s, -jnp.inf)

    def bound_only(s):  # Full tiles: only positions past the keys.
      return jnp.where(cols < self.st.kv_len, s, -jnp.inf)
    return lax.cond(self.all_full[i, j], bound_only, apply, s)


def _forward(q, k, v, kinds, mask_consts, score_consts, st: _Static):
  tiles = _Tiles(q, k, kinds, mask_consts, score_consts, st)
  b, n, h, kh, g = tiles.b, tiles.n, tiles.h, tiles.kh, tiles.g
  bq, bk = st.block_q, st.block_k
  tp, sp = tiles.num_q * bq, tiles.num_k * bk
  k, v = pad_to(k, 1, sp), pad_to(v, 1, sp)
  rows = b * kh * g * bq

  def q_tile(args):
    i, qb = args

    def body(j, carry):
      acc, m, l = carry
      kb = lax.dynamic_slice_in_dim(k, j * bk, bk, 1)
      vb = lax.dynamic_slice_in_dim(v, j * bk, bk, 1)
      s = tiles.masked(tiles.scores(tiles.dot("bqkgh,bskh->bkgqs", qb, kb),
                                    i, j, score_consts), i, j)
      m, alpha, prob, l = softmax.update(m, l, (s * softmax.LOG2E).reshape(
          rows, bk))
      pv = tiles.dot("bkgqs,bskh->bkgqh",
                     prob.reshape(s.shape).astype(v.dtype), vb)
      return acc * alpha[:, None] + pv.reshape(rows, h), m, l

    carry = lax.fori_loop(tiles.lo[i], tiles.hi[i], body,
                          softmax.init(rows, h))
    o, lse = softmax.finalize(*carry)
    return (o.reshape(b, kh, g, bq, h).astype(q.dtype),
            lse.reshape(b, kh, g, bq))

  qs = blockwise.blocks(pad_to(q, 1, tp), tiles.num_q, bq, kh)
  o, lse = lax.map(q_tile, (jnp.arange(tiles.num_q), qs))
  o = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, n, h)[:, :st.q_len]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, n, tp)[..., :st.q_len]
  return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flex(q, k, v, kinds, mask_consts, score_consts, st: _Static):
  return _forward(q, k, v, kinds, mask_consts, score_consts, st)


def _flex_fwd(q, k, v, kinds, mask_consts, score_consts, st):
  o, lse = _forward(q, k, v, kinds, mask_consts, score_consts, st)
  return (o, lse), (q, k, v, kinds, mask_consts, score_consts, o, lse)


def _flex_bwd(st: _Static, residuals, cotangents):
  q, k, v, kinds, mask_consts, score_consts, o, lse = residuals
  do, dlse = cotangents
  do = do.astype(q.dtype)
  tiles = _Tiles(q, k, kinds, mask_consts, score_consts, st)
  b, n, h, kh, g = tiles.b, tiles.n, tiles.h, tiles.kh, tiles.g
  bq, bk = st.block_q, st.block_k
  tp, sp = tiles.num_q * bq, tiles.num_k * bk
  k, v = pad_to(k, 1, sp), pad_to(v, 1, sp)
  delta = softmax.backward_delta(o, do, dlse)
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # Empty rows: P = 0.

  def stats(x):  # [B, N, T] -> [nq, B, K, G, bq]
    x = pad_to(x, 2, tp)
    return x.reshape(b, kh, g, tiles.num_q, bq).transpose(3, 0, 1, 2, 4)

  def q_tile(carry, args):
    i, qb, dob, lse_b, delta_b = args

    def body(j, inner):
      dq, dk, dv, dconsts = inner
      k0 = j * bk
      kb = lax.dynamic_slice_in_dim(k, k0, bk, 1)
      vb = lax.dynamic_slice_in_dim(v, k0, bk, 1)
      raw = tiles.dot("bqkgh,bskh->bkgqs", qb, kb)
      s, score_vjp = jax.vjp(lambda raw, c: tiles.scores(raw, i, j, c), raw,
                             score_consts)
      prob = jnp.exp(tiles.masked(s, i, j) - lse_b[..., None])
      dp = tiles.dot("bqkgh,bskh->bkgqs", dob, vb)
      dv_b = tiles.dot("bkgqs,bqkgh->bskh", prob.astype(do.dtype), dob)
      draw, dc = score_vjp(prob * (dp - delta_b[..., None]))
      draw = draw.astype(q.dtype)
      dq = dq + tiles.dot("bkgqs,bskh->bqkgh", draw, kb)
      dk_b = tiles.dot("bkgqs,bqkgh->bskh", draw, qb)
      dk = lax.dynamic_update_slice_in_dim(
          dk, lax.dynamic_slice_in_dim(dk, k0, bk, 1) + dk_b, k0, 1)
      dv = lax.dynamic_update_slice_in_dim(
          dv, lax.dynamic_slice_in_dim(dv, k0, bk, 1) + dv_b, k0, 1)
      dconsts = jax.tree.map(jnp.add, dconsts, dc)
      return dq, dk, dv, dconsts

    dk, dv, dconsts = carry
    dq = jnp.zeros(qb.shape, jnp.float32)
    dq, dk, dv, dconsts = lax.fori_loop(tiles.lo[i], tiles.hi[i], body,
                                        (dq, dk, dv, dconsts))
    return (dk, dv, dconsts), dq.astype(q.dtype)

  blocks = lambda x: blockwise.blocks(pad_to(x, 1, tp),
                                      tiles.num_q, bq, kh)
  zeros = jnp.zeros((b, sp, kh, h), jnp.float32)
  dconsts0 = jax.tree.map(jnp.zeros_like, score_consts)
  (dk, dv, dconsts), dq = lax.scan(
      q_tile, (zeros, zeros, dconsts0),
      (jnp.arange(tiles.num_q), blocks(q), blocks(do), stats(lse),
       stats(delta)))
  dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(b, tp, n, h)[:, :st.q_len]
  # (draw, the gradient of the raw q.k, carries the scale already.)
  dk = dk[:, :st.kv_len].astype(k.dtype)
  dv = dv[:, :st.kv_len].astype(v.dtype)
  d_mask_consts = jax.tree.map(_zero_cotangent, mask_consts)
  return (dq, dk, dv, _zero_cotangent(kinds), d_mask_consts, dconsts)


def _zero_cotangent(x):
  """A zero cotangent for x (float0 for integer and boolean arrays)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


_flex.defvjp(_flex_fwd, _flex_bwd)
