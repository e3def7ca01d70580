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

Backends: the GPU kernels (and the Pallas interpreter) take every
mask_mod and score_mod whose arrays they can read; the functions' jaxprs
are evaluated in the kernels, the tile kinds become their tile ranges. The
arrays a mod closes over (document ids, per-head windows, a relative-bias
table) are read element by element there (`a[i]`, `a[b, i]`,
`jnp.take(a, i)`; `core.mods.evaluate`): the Triton kernels take them, the
Mosaic GPU kernels (Hopper) take mods that close over no array. The
gradient of a score_mod's floating arrays comes from the blockwise loops'
backward (`_dispatch.backward` takes it from the plan; XLA drops it
when nothing uses it), the
rest of the gradient from the kernels. A mod that uses a whole array at
once (`a.max()`) runs on the blockwise plain-JAX FlashAttention loops
(`blockwise`, the "xla" implementation), on any device, its arrays passed
as operands (`Operands.mask_consts` / `score_consts`); so does every call
off the GPU with implementation=None. Either way the call goes through
`flash_attention`'s primitive (`_primitive.flash_p`) with the same
`Mask.mod` / `Scores.mod`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _dispatch, attention
from jax_flash.core import checks, device, mods
from jax_flash.core.mask import EMPTY, FULL, PARTIAL, Mask
from jax_flash.core.mods import ElementwiseMod
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores


def _examples(num_args: int, float_first: bool):
  return ((jnp.float32(0),) if float_first else ()) + (
      jnp.int32(0),) * (num_args - (1 if float_first else 0))


def _elementwise(fn: Callable, num_args: int, float_first: bool):
  """(fn as an `ElementwiseMod` of its jaxpr, the arrays it closes over).
  Every array is hoisted into an argument, integer ones too
  (`jax.closure_convert` keeps those closed over): traced under jit, they
  must travel as operands, since the attention primitive's rules run after
  the trace that made them; a kernel reads them through its refs
  (`mods.evaluate`)."""
  closed = jax.make_jaxpr(fn)(*_examples(num_args, float_first))

  def converted(*args):
    return mods.evaluate(closed.jaxpr, args[num_args:], *args[:num_args])[0]
  return ElementwiseMod(converted), tuple(closed.consts)


@jax.tree_util.register_pytree_node_class
class BlockMask:
  """A mask_mod and, per (batch, head, query tile, key tile), whether the
  tile is empty, partial or full. Built by `create_block_mask`; reusable
  across layers and calls (a pytree: it goes through jit).

  kinds: int8 [Bm, Nm, num_q_tiles, num_k_tiles] (Bm, Nm: 1 or B, N).
  """

  def __init__(self, kinds, consts, mask_fn, q_len, kv_len, block_q,
               block_k):
    self.kinds, self.consts, self.mask_fn = kinds, tuple(consts), mask_fn
    self.q_len, self.kv_len = q_len, kv_len
    self.block_q, self.block_k = block_q, block_k

  def tree_flatten(self):
    return (self.kinds, self.consts), (self.mask_fn, self.q_len, self.kv_len,
                                       self.block_q, self.block_k)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], children[1], *aux)

  def __repr__(self):
    return (f"BlockMask(q_len={self.q_len}, kv_len={self.kv_len}, "
            f"block=({self.block_q}, {self.block_k}), "
            f"kinds={tuple(self.kinds.shape)})")


@checks.in_int32_scope
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
    vis = mask_fn(b, h, rows, cols, consts=consts) & (cols < S) & (rows < T)
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
  return BlockMask(kinds.transpose(1, 2, 0, 3), consts, mask_fn, T, S, bq, bk)


def and_masks(*mask_mods: Callable) -> Callable:
  """The mask_mod that is True where every one of mask_mods is."""
  return lambda b, h, q, k: functools.reduce(
      jnp.logical_and, [m(b, h, q, k) for m in mask_mods])


def or_masks(*mask_mods: Callable) -> Callable:
  """The mask_mod that is True where any of mask_mods is."""
  return lambda b, h, q, k: functools.reduce(
      jnp.logical_or, [m(b, h, q, k) for m in mask_mods])


@checks.in_x64_scope
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
    implementation: None: the GPU kernels where they take the call (see
      the module doc: the Mosaic kernels on an H100/H200, else Triton),
      else "xla" (the blockwise plain-JAX loops; any device). "pallas",
      "mosaic", "triton": the GPU kernels; "interpret": the same kernels
      interpreted (any machine, slow); a named implementation that cannot
      take the call raises ValueError saying why.
  Returns:
    out [B, T, N, H] in query.dtype, or (out, logsumexp).
  """
  query, scale = checks.fold_traced_scale(query, scale)
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
  plan, mask, scores, operands = _problem(query, p, block_mask, score_mod,
                                          scale, implementation)
  cfg = attention.config(plan, None, p, query.dtype, mask, scores)
  out, lse = attention.flash_call(query, key, value, operands, cfg)
  lse = lse.transpose(0, 2, 1)
  return (out, lse) if return_residual else out


def _problem(query, p, block_mask: BlockMask, score_mod, scale: float,
             implementation):
  """(plan, Mask, Scores, Operands) of a flex call: the kernels when one
  takes it (a score_mod closes over no array; a mask_mod's arrays are read
  element by element, `mods.unsupported_reads`), else the blockwise loops;
  either way the functions' jaxprs with their arrays as operands.
  ValueError if a named kernel backend cannot take it."""
  pow2 = lambda x: x > 0 and x & (x - 1) == 0
  score_fn, score_consts = None, ()
  if score_mod is not None:
    score_fn, score_consts = _elementwise(score_mod, 5, float_first=True)
  why = None
  for name, fn, consts, num_args in (
      ("score_mod", score_fn, score_consts, 5),
      ("mask_mod", block_mask.mask_fn, block_mask.consts, 4)):
    bad = consts and mods.unsupported_reads(fn, consts, num_args)
    if bad and why is None:
      why = (f"the kernels read a {name}'s arrays one element at a time "
             f"(a[i], a[b, i]); this one uses {bad}: implementation=None "
             "or 'xla' runs it")
  if why is None and not (pow2(block_mask.block_q) and
                          pow2(block_mask.block_k)):
    why = ("the kernels need a block_mask of power-of-two block sizes from "
           "create_block_mask")
  tiles = (block_mask.block_q, block_mask.block_k)
  # A tile is visited if any head needs it, spared the mask_mod only if full
  # for every head (tile ranges are per batch element).
  kinds = block_mask.kinds
  tile_kinds = jnp.where(jnp.all(kinds == FULL, axis=1), FULL, jnp.where(
      jnp.all(kinds == EMPTY, axis=1), EMPTY, PARTIAL)).astype(jnp.int8)
  mask = Mask(mod=block_mask.mask_fn, mod_tiles=tiles,
              mod_arrays=len(block_mask.consts))
  scores = Scores(scale=scale, mod=score_fn, mod_arrays=len(score_consts))
  operands = Operands(tile_kinds=tile_kinds,
                      mask_consts=block_mask.consts or None,
                      score_consts=score_consts or None)
  plan = _dispatch.select("xla", query, p, query.dtype, mask=mask,
                          scores=scores, operands=operands)
  if implementation != "xla" and why is None and (
      implementation is not None or device.on_gpu(query)):
    plan = _dispatch.select(implementation, query, p, query.dtype,
                            mask=mask, scores=scores, operands=operands)
  elif implementation not in (None, "xla"):
    raise ValueError(f"implementation={implementation!r}: {why}")
  return plan, mask, scores, operands
