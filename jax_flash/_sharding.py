"""Batch- and head-sharded inputs run each shard locally (no all-gather).

The Pallas kernels are opaque custom calls to XLA's partitioner, which would
otherwise gather sharded inputs onto every device. `custom_partitioning`
tells it that attention is independent per (batch, head): the forward and the
backward run on each device's shard of the batch and of the heads. The
sequence and head-dim axes must be whole on each device (they are gathered if
sharded). Heads shard only where the kv heads divide evenly, so that every
device holds whole GQA groups.
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
_WHOLE = ("t", "s", "h", "v")  # Never split inside one call.


def _plan(mesh, q_sharding, num_kv_heads):
  """Mesh axes for (batch, heads), kept from the query's sharding."""
  spec = getattr(q_sharding, "spec", P())
  batch = spec[0] if len(spec) > 0 else None
  heads = spec[2] if len(spec) > 2 else None
  if heads is not None:
    names = heads if isinstance(heads, tuple) else (heads,)
    size = 1
    for name in names:
      size *= mesh.shape[name]
    if num_kv_heads % size:
      heads = None  # Whole GQA groups per device, or no head sharding.
  return batch, heads


def _shardings(mesh, shapes, batch, heads):
  def one(shape):
    if len(shape.shape) == 4:
      return NamedSharding(mesh, P(batch, None, heads, None))
    return NamedSharding(mesh, P(batch, heads, None))
  return jax.tree.map(one, shapes)


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
  """fn(*arrays, cfg) as a custom_partitioning op split over batch and heads."""
  op = custom_partitioning(fn, static_argnums=(fn.__code__.co_argcount - 1,))

  def infer(cfg, mesh, arg_shapes, result_shape):
    batch, heads = _plan(mesh, arg_shapes[0].sharding, arg_shapes[1].shape[2])
    return _shardings(mesh, result_shape, batch, heads)

  def partition(cfg, mesh, arg_shapes, result_shape):
    batch, heads = _plan(mesh, arg_shapes[0].sharding, arg_shapes[1].shape[2])
    lower = lambda *arrays: fn(*arrays, cfg)
    return (mesh, lower, _shardings(mesh, result_shape, batch, heads),
            _shardings(mesh, arg_shapes, batch, heads))

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
