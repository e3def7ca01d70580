"""One `custom_partitioning` op per call signature (`split_op`), and the
forward and backward split with it (`sharded_forward`, `sharded_backward`,
and their `on_axis` inside a shard_map). A call's arrays are q, k, v, the
leaves of its optional operands (none: the empty case), and for the
backward the residuals and cotangents; each is described by its Shardy
factors, one name a dim ("b t n h"), which say how it splits."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash.context_parallel import lowerings
from jax_flash.context_parallel.collectives import after_all
from jax_flash.context_parallel.plan import (Split, axes_size, axis_names,
                                             check_named, plan, refused_by)
from jax_flash.core import dropout, mods
from jax_flash.core.backend import differentiable_leaves
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores

_QKV = ("b t n h", "b s k h", "b s k v")
_FWD_OUT = ("b t n v", "b n t")
# The backward reads D = rowsum(dO * O) - dlse ([B, N, T]) in O's place.
_BWD_IN = ("b n t", "b n t", "b t n v", "b n t")  # delta, lse, do, dlse


# The dims of each optional operand (`Operands`' fields) as Shardy factors:
# b batch, n query heads, t/s queries/keys; None: a dim no split follows
# (a tile-kinds table's block counts).
_OPERAND_DIMS = {
    "q_ids": ("b", "t"), "kv_ids": ("b", "s"),
    "dense_mask": ("b", "n", "t", "s"), "bias": ("b", "n", "t", "s"),
    "alibi_slopes": ("b", "n"), "sinks": ("n",), "q_offsets": ("b",),
    "tile_kinds": ("b", None, None), "dropout_seed": (None,),
    "fp8_q": ("b", "t", "n", None), "fp8_k": ("b", "s", "k", None),
    "fp8_v": ("b", "s", "k", None), "fp8_scales": ("b", "k", None)}
_SPLIT = ("b", "n", "k", "t", "s")  # The factors a call with operands splits.


def splittable(operands: Operands, mask: Mask, scores: Scores) -> bool:
  """Whether a call splits over devices: not with a mask_mod or score_mod
  that reads its batch or head index (`mods.reads_batch_or_head`: a
  device would count them from its shard's first), nor with a mod's
  arrays (of any shape). (Dropout's seed is shifted to each device's
  place instead: `dropout.shifted`.)"""
  if operands.mask_consts or operands.score_consts:
    return False
  return not ((mask.mod is not None and mods.reads_batch_or_head(mask.mod, 4))
              or (scores.mod is not None
                  and mods.reads_batch_or_head(scores.mod, 5)))


def operand_factors(operands: Operands, q, k) -> tuple[str, ...]:
  """The Shardy factors of each of `operands`' leaves (in
  `jax.tree.leaves` order), one name a dim: its factor where the dim is as
  long as q's or k's (b, n, t, s), else (a dim of 1 that broadcasts, a
  table's block count) a factor of its own, "u<leaf>_<dim>", never
  split."""
  sizes = dict(b=q.shape[0], t=q.shape[1], n=q.shape[2], s=k.shape[1],
               k=k.shape[2])
  factors = []
  for field in dataclasses.fields(Operands):
    x = getattr(operands, field.name)
    if x is None:
      continue
    names = []
    for dim, factor in zip(x.shape, _OPERAND_DIMS[field.name]):
      if factor is None or dim != sizes[factor]:
        factor = f"u{len(factors)}_{len(names)}"
      names.append(factor)
    factors.append(" ".join(names))
  return tuple(factors)


def _seed_index(tree):
  """The position among a call's arrays (q, k, v, then the operands'
  leaves) of dropout's seed words, or None."""
  numbered = jax.tree.unflatten(tree, range(tree.num_leaves))
  return None if numbered.dropout_seed is None else 3 + numbered.dropout_seed


def _custom_partitioning(fn, num_args: int):
  """custom_partitioning of fn(*arrays, cfg) (`num_args` in all, cfg
  static), traced through a `jax.jit`: custom_partitioning takes no
  function whose trace has constants (a kernel's static tables made in
  numpy), and a jit keeps them inside its own program."""
  static = num_args - 1
  return custom_partitioning(jax.jit(fn, static_argnums=static),
                             static_argnums=(static,))


def _spec(split: Split, factors: str):
  """The PartitionSpec of an array with `factors` under `split` (an array
  per (query, key) pair, a bias, keeps its keys whole)."""
  kv = split.seq if split.kv_seq and "t" not in factors.split() else None
  axis = dict(b=split.batch, n=split.heads, k=split.heads, t=split.seq,
              s=kv)
  return P(*(axis.get(f) for f in factors.split()))


def _per_device(fn, strategies, in_factors, out_factors, cfg, mesh,
                split: Split):
  """What a device runs under `split`: fn(*arrays, cfg) on its batch and
  heads, the sequence whole or split by `split.strategy` (`strategies`:
  name -> (cfg, split, p) -> run; all_to_all runs fn on
  `lowerings.heads`; ring_all_to_all, all_to_all over the last sequence
  axis around a ring over the others)."""
  whole = lambda *arrays: fn(*arrays, cfg)
  p = axes_size(mesh, split.seq)
  if split.seq is None:
    return whole
  if split.strategy == "ring_all_to_all":
    *outer, inner = axis_names(split.seq)
    outer = outer[0] if len(outer) == 1 else tuple(outer)
    ring = strategies["ring"](cfg, dataclasses.replace(split, seq=outer),
                              axes_size(mesh, outer))
    return lowerings.heads(ring, in_factors, out_factors, inner,
                           mesh.shape[inner], split.kv_repeats)
  if split.strategy in strategies:
    return strategies[split.strategy](cfg, split, p)
  return lowerings.heads(whole, in_factors, out_factors, split.seq, p,
                         split.kv_repeats)


def _placed(run, mesh, split: Split, out_factors, seed_index, cfg):
  """run(*arrays) with dropout's seed words (at `seed_index`) shifted to
  this device's place in the batch and the heads (`dropout.shifted`, so
  its keep bits are the whole call's), and each result without the batch
  factor (or the heads') summed over the devices of that split: the
  gradient of an operand that broadcasts along it."""
  def place(axes, size):
    return lax.axis_index(axes) * size if axes is not None else 0

  def summed(y, factors):
    names = factors.split()
    axes = (axis_names(split.batch) if "b" not in names else ()) + (
        axis_names(split.heads) if not {"n", "k"} & set(names) else ())
    return lax.psum(y, axes) if axes else y

  def lower(*arrays):
    if seed_index is not None and not cfg.scores.dropout_broadcast:
      local = arrays[0].shape  # [B, T, N, H] of this device.
      heads = place(split.heads, local[2])
      if split.strategy == "all_to_all":  # A device's heads of its heads.
        heads = heads + place(split.seq,
                              local[2] // axes_size(mesh, split.seq))
      elif split.strategy == "ring_all_to_all":  # Of the inner axis's.
        inner = axis_names(split.seq)[-1]
        heads = heads + place(inner, local[2] // mesh.shape[inner])
      arrays = list(arrays)
      arrays[seed_index] = dropout.shifted(
          arrays[seed_index], place(split.batch, local[0]), heads)
    return tuple(summed(y, f)
                 for y, f in zip(run(*arrays), out_factors))
  return lower


def split_op(fn, in_factors, out_factors, strategies, refit_why,
             refused=(), seed_index=None):
  """fn(*arrays, cfg) as a custom_partitioning op: split over batch and
  heads as the query is, and over the sequence by the strategy `plan`
  picks (`strategies`: name -> (cfg, split, p) -> the per-device function
  of all_gather and ring; `refused`: (strategy, why it cannot run) pairs
  known from the call's arrays). Each array and result splits along its
  factors (a string each: "b t n h"), its other dims whole; `seed_index`:
  the position of dropout's seed words among the arrays."""
  op = _custom_partitioning(fn, len(in_factors) + 1)
  refused = dict(refused)

  def shardings(mesh, split, factors, like):
    out = [NamedSharding(mesh, _spec(split, f)) for f in factors]
    return type(like)(out) if isinstance(like, (list, tuple)) else out[0]

  def infer(cfg, mesh, arg_shapes, result_shape):
    split = plan(mesh, arg_shapes, cfg, refit_why, refused, fallback=True)
    return shardings(mesh, split, out_factors, result_shape)

  def partition(cfg, mesh, arg_shapes, result_shape):
    split = plan(mesh, arg_shapes, cfg, refit_why, refused, fallback=True)
    run = _per_device(fn, strategies, in_factors, out_factors, cfg, mesh,
                      split)
    return (mesh, after_all(_placed(run, mesh, split, out_factors,
                                    seed_index, cfg)),
            shardings(mesh, split, out_factors, result_shape),
            shardings(mesh, split, in_factors, arg_shapes))

  rule = ", ".join(in_factors) + " -> " + ", ".join(out_factors)
  factors = dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule,
                   need_replication_factors=tuple(
                       f for f in factors if f not in _SPLIT))
  return op


def _on_axis(strategies, cfg, arrays, refit_why, refused):
  """Inside a shard_map whose axis `cfg.sequence_axis` holds the sequence
  in contiguous chunks (`arrays`: q, k, v chunks, then the rest as the
  per-device functions take them): `cfg.context_parallel`'s per-device
  function (ring or all_gather, `strategies`), planned as `plan` plans a
  call sharded along that axis."""
  axis = cfg.sequence_axis
  mesh = jax.sharding.get_abstract_mesh()
  p = lax.axis_size(axis)

  def whole(x):  # The call's array, sharded along the sequence.
    return jax.ShapeDtypeStruct(
        (x.shape[0], x.shape[1] * p, *x.shape[2:]), x.dtype,
        sharding=NamedSharding(mesh, P(None, axis, None, None)))
  split = plan(mesh, [whole(x) for x in arrays[:3]], cfg, refit_why,
               refused)
  if split.strategy is None:  # One device: its chunk is the sequence.
    split = Split(seq=axis, kv_seq=True, strategy=cfg.context_parallel)
  return strategies[split.strategy](cfg, split, p)(*arrays)


def _leaves(operands: Operands, q, k, cfg):
  """(operands' leaves, their tree, their factors, (strategy, why refused)
  pairs): what keys a call's op. A strategy named that cannot run the
  call whatever its sharding is a ValueError here, as the call traces."""
  leaves, tree = jax.tree.flatten(operands)
  refused = refused_by(operands, cfg.mask, q.shape[1], k.shape[1])
  check_named(cfg.context_parallel, refused)
  return (leaves, tree, operand_factors(operands, q, k),
          tuple(refused.items()))


def sharded_forward(forward, chunk_forward, ring_forward, refit_why):
  """forward(q, k, v, operands, cfg) -> (o, lse), split over batch, heads
  and the sequence. chunk_forward(q, k, v, operands, cfg): the same for
  queries at per-sequence offsets (`operands.q_offsets`); ring_forward(q,
  k, v, operands, seq, p, cfg): the ring over mesh axes `seq` of size p;
  refit_why(cfg, problem, dtype, offsets): why a part of the call (a
  chunk at offsets, a ring's pair) cannot run, or None."""
  @functools.cache
  def strategies(tree, factors):
    def chunk(*args):
      q, k, v, *leaves, offsets, cfg = args
      operands = lowerings.at_offsets(jax.tree.unflatten(tree, leaves),
                                      offsets, q, k)
      return chunk_forward(q, k, v, operands, cfg)

    def ring(*args):
      q, k, v, *leaves, seq, p, cfg = args
      return ring_forward(q, k, v, jax.tree.unflatten(tree, leaves), seq, p,
                          cfg)
    in_factors = _QKV + factors
    return in_factors, {
        "all_gather": lowerings.gather(chunk, in_factors, _FWD_OUT),
        "ring": lowerings.ring(ring, in_factors, _FWD_OUT)}

  @functools.cache
  def op(tree, factors, refused):
    def fn(*args):
      q, k, v, *leaves, cfg = args
      return forward(q, k, v, jax.tree.unflatten(tree, leaves), cfg)
    in_factors, lowered = strategies(tree, factors)
    return split_op(fn, in_factors, _FWD_OUT, lowered, refit_why, refused,
                    _seed_index(tree))

  def call(q, k, v, operands: Operands, cfg):
    leaves, tree, factors, refused = _leaves(operands, q, k, cfg)
    return op(tree, factors, refused)(q, k, v, *leaves, cfg)

  def on_axis(q, k, v, operands: Operands, cfg):
    """The same on sequence chunks inside a shard_map (`_on_axis`)."""
    leaves, tree, factors, refused = _leaves(operands, q, k, cfg)
    return _on_axis(strategies(tree, factors)[1], cfg, (q, k, v, *leaves),
                    refit_why, dict(refused))
  call.on_axis = on_axis
  return call


def sharded_backward(backward, chunk_backward, ring_backward, refit_why):
  """backward(q, k, v, operands, delta, lse, do, dlse, cfg) -> (dq, dk, dv,
  the operands' gradients), likewise (delta: D = rowsum(dO * O) - dlse,
  [B, N, T]); chunk_backward(q, k, v, operands, delta, lse, do, dlse, cfg)
  the same at `operands.q_offsets`; ring_backward(q, k, v, operands,
  delta, lse, do, dlse, seq, p, cfg) the ring's. The op's results are dq,
  dk, dv and the gradients of the differentiable operands."""
  def chosen(grads, diff):
    flat = jax.tree.leaves(dataclasses.replace(grads, q_offsets=None))
    return tuple(flat[i] for i in diff)

  @functools.cache
  def strategies(tree, factors):
    diff = differentiable_leaves(tree)

    def chunk(*args):
      q, k, v, *leaves, delta, lse, do, dlse, offsets, cfg = args
      operands = lowerings.at_offsets(jax.tree.unflatten(tree, leaves),
                                      offsets, q, k)
      dq, dk, dv, grads = chunk_backward(q, k, v, operands, delta, lse, do,
                                         dlse, cfg)
      return (dq, dk, dv) + chosen(grads, diff)

    def ring(*args):
      q, k, v, *leaves, delta, lse, do, dlse, seq, p, cfg = args
      dq, dk, dv, grads = ring_backward(q, k, v,
                                        jax.tree.unflatten(tree, leaves),
                                        delta, lse, do, dlse, seq, p, cfg)
      return (dq, dk, dv) + chosen(grads, diff)
    in_factors = _QKV + factors + _BWD_IN
    out_factors = _QKV + tuple(factors[i] for i in diff)
    return in_factors, out_factors, {
        "all_gather": lowerings.gather(chunk, in_factors, out_factors),
        "ring": lowerings.ring(ring, in_factors, out_factors)}

  @functools.cache
  def op(tree, factors, refused):
    diff = differentiable_leaves(tree)

    def fn(*args):
      q, k, v, *leaves, delta, lse, do, dlse, cfg = args
      dq, dk, dv, grads = backward(q, k, v, jax.tree.unflatten(tree, leaves),
                                   delta, lse, do, dlse, cfg)
      return (dq, dk, dv) + chosen(grads, diff)
    in_factors, out_factors, lowered = strategies(tree, factors)
    return split_op(fn, in_factors, out_factors, lowered, refit_why,
                    refused, _seed_index(tree))

  def with_grads(leaves, tree, diff_grads):
    grads = [jnp.zeros_like(x) for x in leaves]
    for i, g in zip(differentiable_leaves(tree), diff_grads):
      grads[i] = g
    return jax.tree.unflatten(tree, grads)

  def call(q, k, v, operands: Operands, delta, lse, do, dlse, cfg):
    leaves, tree, factors, refused = _leaves(operands, q, k, cfg)
    dq, dk, dv, *diff_grads = op(tree, factors, refused)(
        q, k, v, *leaves, delta, lse, do, dlse, cfg)
    return dq, dk, dv, with_grads(leaves, tree, diff_grads)

  def on_axis(q, k, v, operands: Operands, delta, lse, do, dlse, cfg):
    """The same on sequence chunks inside a shard_map (`_on_axis`)."""
    leaves, tree, factors, refused = _leaves(operands, q, k, cfg)
    dq, dk, dv, *diff_grads = _on_axis(
        strategies(tree, factors)[2], cfg,
        (q, k, v, *leaves, delta, lse, do, dlse), refit_why, dict(refused))
    return dq, dk, dv, with_grads(leaves, tree, diff_grads)
  call.on_axis = on_axis
  return call
