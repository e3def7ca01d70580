"""Batch-, head- and sequence-sharded inputs run without gathering them.

The Pallas kernels are opaque custom calls to XLA's partitioner, which would
otherwise gather sharded inputs onto every device. `custom_partitioning`
tells it that attention is independent per (batch, head): the forward and the
backward run on each device's shard of the batch and of the heads. Heads
shard only where the kv heads divide evenly, so that every device holds
whole GQA groups.

Queries and keys sharded along the sequence (the same mesh axes for both)
run all-to-all context parallelism (DeepSpeed-Ulysses): an all-to-all over
those axes trades each device's sequence chunk of every head for the whole
sequence of a few heads, attention runs on them as on one device (every
mask of the call unchanged), and an all-to-all returns the output (and the
backward's gradients) to sequence chunks. It needs the KV heads of a
device's head shard to divide by the sequence axes' size; otherwise the
sequence is gathered, as the head dims always are.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Shardy rules: b batch, t/s query/key length, n/k query/kv heads, h head
# dim of query/key, v head dim of value/output.
_FWD_RULE = "b t n h, b s k h, b s k v -> b t n v, b n t"
_BWD_RULE = ("b t n h, b s k h, b s k v, b t n v, b n t, b t n v, b n t "
             "-> b t n h, b s k h, b s k v")
_WHOLE = ("h", "v")  # Never split inside one call.


def _names(axes):
  return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _size(mesh, axes) -> int:
  size = 1
  for name in _names(axes):
    size *= mesh.shape[name]
  return size


def _spec(sharding, dim):
  spec = getattr(sharding, "spec", P())
  return spec[dim] if len(spec) > dim else None


def _plan(mesh, q_sharding, k_sharding, num_kv_heads):
  """Mesh axes for (batch, heads, sequence), kept from the query's
  sharding: heads where whole GQA groups fit a device, the sequence where
  the key's is sharded alike and the KV heads of a head shard divide by
  its size (`all_to_all`)."""
  batch, heads, seq = (_spec(q_sharding, d) for d in (0, 2, 1))
  if heads is not None and num_kv_heads % _size(mesh, heads):
    heads = None  # Whole GQA groups per device, or no head sharding.
  if seq is not None and (
      _spec(k_sharding, 1) != seq or set(_names(seq)) & set(
          _names(batch) + _names(heads))
      or (num_kv_heads // _size(mesh, heads)) % _size(mesh, seq)):
    seq = None
  return batch, heads, seq


def _shardings(mesh, shapes, batch, heads, seq):
  def one(shape):
    if len(shape.shape) == 4:
      return NamedSharding(mesh, P(batch, seq, heads, None))
    return NamedSharding(mesh, P(batch, heads, seq))
  return jax.tree.map(one, shapes)


def all_to_all(fn, seq):
  """fn(*arrays) -> arrays, each [B, L, N, H] or [B, N, L], run on the
  whole sequence of 1 / P of the heads (P: the size of mesh axes `seq`)
  when called on sequence chunks of every head inside those axes; None
  `seq`: fn itself."""
  if seq is None:
    return fn

  def swap(x, to_heads: bool):
    length, heads = (1, 2) if x.ndim == 4 else (2, 1)
    split, concat = (heads, length) if to_heads else (length, heads)
    return jax.lax.all_to_all(x, seq, split, concat, tiled=True)

  def run(*arrays):
    outs = fn(*(swap(x, True) for x in arrays))
    return jax.tree.map(lambda y: swap(y, False), outs)
  return run


def _fold_vmap(op):
  """op(*arrays, cfg) under vmap: the mapped axis joins the batch axis.

  (custom_partitioning has no batching rule of its own.)
  """
  @functools.lru_cache(maxsize=None)
  def for_cfg(cfg):
    @jax.custom_batching.custom_vmap
    def call(*arrays):
      return op(*arrays, cfg)

    @call.def_vmap
    def rule(axis_size, in_batched, *arrays):
      arrays = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
                for x, b in zip(arrays, in_batched)]
      folded = [x.reshape((-1,) + x.shape[2:]) for x in arrays]
      outs = call(*folded)
      outs = jax.tree.map(
          lambda y: y.reshape((axis_size, -1) + y.shape[1:]), outs)
      return outs, jax.tree.map(lambda _: True, outs)

    return call

  def wrapped(*args):
    *arrays, cfg = args
    return for_cfg(cfg)(*arrays)

  return wrapped


def _define(fn, rule):
  """fn(*arrays, cfg) as a custom_partitioning op split over batch, heads
  and (all-to-all) the sequence."""
  op = custom_partitioning(fn, static_argnums=(fn.__code__.co_argcount - 1,))

  def plan(mesh, arg_shapes):
    return _plan(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding,
                 arg_shapes[1].shape[2])

  def infer(cfg, mesh, arg_shapes, result_shape):
    return _shardings(mesh, result_shape, *plan(mesh, arg_shapes))

  def partition(cfg, mesh, arg_shapes, result_shape):
    batch, heads, seq = plan(mesh, arg_shapes)
    lower = all_to_all(lambda *arrays: fn(*arrays, cfg), seq)
    return (mesh, lower, _shardings(mesh, result_shape, batch, heads, seq),
            _shardings(mesh, arg_shapes, batch, heads, seq))

  factors = []  # In order of first appearance: shardy wants them sorted.
  for name in rule.replace(",", " ").replace("->", " ").split():
    if name not in factors:
      factors.append(name)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule,
                   need_replication_factors=tuple(f for f in factors
                                                  if f in _WHOLE))
  return _fold_vmap(op)


def sharded_forward(forward):
  """forward(q, k, v, cfg) -> (o, lse), split over batch and heads."""
  return _define(forward, _FWD_RULE)


def sharded_backward(backward):
  """backward(q, k, v, o, lse, do, dlse, cfg) -> (dq, dk, dv), likewise."""
  return _define(backward, _BWD_RULE)
