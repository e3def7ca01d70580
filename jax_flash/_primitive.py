"""The attention primitives: one call's kernels as standard JAX primitives.

* `flash_p` (q, k, v, *operands) -> (o [B, T, N, Hv], lse [B, N, T]
  float32 natural log): lowered to the plan's forward (`_forward`); under
  vmap a mapped axis folds into the batch axis (or the call runs once per
  slice where an operand cannot fold); its JVP is itself for the primal and
  `flash_tangent_p` for the tangent.
* `flash_tangent_p` (q, k, v, *operands, o, lse, tq, tk, tv,
  *operand tangents) -> (to, tlse): linear in the tangents. Its value is
  `jax.jvp` of the blockwise forward (FlashAttention's loop carried with its
  tangents: memory linear in the length); its transpose is the plan's
  backward (the kernels), which is how grad, vjp and checkpoint reach them.

Standard primitives (not `jax.experimental.hijax` ones), so a jitted
function holding one is dispatched by jit's C++ path. `operands` travel
flat, with their treedef as a parameter; of them only the bias, the sinks
and a score_mod's arrays are differentiable (the rest are constants, in
forward mode too). Each distinct forward and backward is traced once per
process and lowered once per program, however many layers call it (cached
`jax.jit`s), and, with JAX's persistent compilation cache on, kept as
exported programs for later processes (`_kernel_cache`). Derivatives of the
rules are second order: a clear error (the tangent's and the backward's JVP
rules raise it).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # shard_map's vma checks.
from jax._src import core as jax_core
from jax._src import dispatch  # The registry of device-bound lowerings.
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_flash import _dispatch, _kernel_cache, blockwise, fa1
from jax_flash import context_parallel
from jax_flash.context_parallel import ring
from jax_flash.core import softmax
from jax_flash.core.backend import differentiable_leaves
from jax_flash.core.checks import check_qkv, x64_scope
from jax_flash.core.mask import Mask, without_padding
from jax_flash.core.operands import Operands
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything static about one call: the primitives' parameter."""
  plan: _dispatch.Plan
  configs: _dispatch.Configs
  mask: Mask
  scores: Scores
  version: int
  # Sequence-sharded inputs: `core.options.STRATEGIES`.
  context_parallel: str = "auto"
  # Inside a shard_map, the mesh axis (or axes) whose devices hold the
  # sequence in chunks, run by `context_parallel`'s ring or all_gather
  # (`context_parallel`'s `on_axis`); None: the arrays are the call's.
  sequence_axis: object = None


SECOND_ORDER = (
    "flash_attention's derivatives cannot themselves be differentiated "
    "(grad of grad, jvp of grad, grad of jvp): its kernels and blockwise "
    "loops have no derivative of their own. For second-order derivatives "
    "use jax_flash.reference_attention (the same arguments; dense, T x S "
    "memory)")


# --- The forward and the backward of a plan. ---

def _backend_forward(q, k, v, operands: Operands, cfg: Config):
  """The plan's forward, or with `cfg.version` 1 the FlashAttention-1
  forward (`fa1`) in its place."""
  if cfg.version == 1:
    return fa1.forward(q, k, v, operands, mask=cfg.mask, scores=cfg.scores,
                       config=cfg.configs.forward,
                       interpret=cfg.plan.forward.name == "interpret")
  return cfg.plan.forward.forward(q, k, v, operands, mask=cfg.mask,
                                  scores=cfg.scores,
                                  config=cfg.configs.forward)


def _local_backward(q, k, v, operands: Operands, delta, lse, do, dlse,
                    cfg: Config):
  """(dq, dk, dv, the operands' gradients) of one device's call: the
  plan's backward; of the operands only the bias, the sinks and a
  score_mod's arrays get a gradient (the rest zeros)."""
  dq, dk, dv, grads = _dispatch.backward(
      cfg.plan, cfg.configs, q, k, v, operands, delta, lse, do, dlse,
      mask=cfg.mask, scores=cfg.scores)
  # Ids, the dense mask, the ALiBi slopes, the seed, the tile kinds and the
  # mask_mod's arrays get no gradient; the plan's backends give the bias's
  # and the score_mod's arrays'.
  d_operands = jax.tree.map(jnp.zeros_like, operands)
  for name in _dispatch.GRADIENT_OPERANDS:
    if getattr(grads, name) is not None:
      d_operands = dataclasses.replace(d_operands,
                                       **{name: getattr(grads, name)})
  if operands.sinks is not None:
    d_operands = dataclasses.replace(
        d_operands, sinks=softmax.sink_gradient(operands.sinks, delta, lse))
  return dq, dk, dv, d_operands


@functools.lru_cache(maxsize=None)
def _refit(cfg: Config, problem: Problem, dtype, offsets: bool) -> Config | str:
  """cfg for a part of the call, `problem` its shapes: a chunk of the
  queries at per-sequence offsets against all keys (`offsets`), or a ring's
  pair of chunks. Its plan chosen again for that mask, from the backend
  cfg's forward names (the backward may change where its own declines),
  its block sizes fitted to the part. A string: why no backend can."""
  mask = dataclasses.replace(cfg.mask, has_q_offsets=offsets)
  try:
    plan = _dispatch.select(cfg.plan.forward.name, None, problem, dtype,
                            mask=mask, scores=cfg.scores)
  except ValueError as e:
    return str(e)

  def fitted(backend, was, config):
    return backend.config(config if backend == was else None, problem,
                          dtype, is_causal=mask.is_causal, scores=cfg.scores,
                          mask=mask)
  forward = (fa1.block_sizes(cfg.configs.forward, problem, dtype,
                             is_causal=mask.is_causal) if cfg.version == 1
             else fitted(plan.forward, cfg.plan.forward, cfg.configs.forward))
  configs = _dispatch.Configs(
      forward=forward,
      backward=fitted(plan.backward, cfg.plan.backward,
                      cfg.configs.backward))
  return dataclasses.replace(cfg, plan=plan, configs=configs, mask=mask)


def _refit_why(cfg: Config, problem: Problem, dtype,
               offsets: bool) -> str | None:
  why = _refit(cfg, problem, jnp.dtype(dtype), offsets)
  return why if isinstance(why, str) else None


def _chunk_config(cfg: Config, q, k, v) -> Config:
  return _refit(cfg, check_qkv(q, k, v), q.dtype, True)


def _chunk_forward(q, k, v, operands: Operands, cfg: Config):
  return _backend_forward(q, k, v, operands, _chunk_config(cfg, q, k, v))


def _chunk_backward(q, k, v, operands: Operands, delta, lse, do, dlse,
                    cfg: Config):
  return _local_backward(q, k, v, operands, delta, lse, do, dlse,
                         _chunk_config(cfg, q, k, v))


def _ring_of(cfg: Config, q, k, v, seq, size: int) -> ring.Ring:
  """The ring over mesh axes `seq` for this device's chunks (in the zigzag
  layout when causal: its two halves are the pairs' chunks). Sinks join
  the merge of the pairs' partials, not a pair's kernel."""
  p = check_qkv(q, k, v)
  window, right = cfg.mask.band()  # A causal window (`context_parallel.plan`).
  half = 2 if cfg.mask.is_causal and window is None else 1
  pair = dataclasses.replace(p, q_len=p.q_len // half,
                             kv_len=p.kv_len // half)
  cfg = dataclasses.replace(
      cfg, scores=dataclasses.replace(cfg.scores, sinks=False))
  part = _refit(cfg, pair, q.dtype, False)
  alibi = cfg.scores.alibi  # FULL pairs at offsets (`ring.Ring.alibi`).
  band = (None if window is None and not alibi else
          _refit(cfg, pair, q.dtype, True))
  return ring.Ring(axis=seq, size=size, causal=right == 0,
                    scores=cfg.scores, plan=part.plan, configs=part.configs,
                    window=window, band_plan=band and band.plan,
                    band_configs=band and band.configs, alibi=alibi,
                    head_groups=ring.head_groups(k.shape[2]))


def _ring_forward(q, k, v, operands: Operands, seq, size, cfg: Config):
  """The ring's (o, lse). Rows past a length are zeroed first (padding may
  hold anything; the pairs read the ids as segments, and a length's pad
  ids match no other)."""
  (q,), (k, v) = without_padding(cfg.mask, operands.q_ids, operands.kv_ids,
                                 (q,), (k, v))
  return ring.forward(q, k, v, operands.q_ids, operands.kv_ids,
                      operands.sinks, _ring_of(cfg, q, k, v, seq, size),
                      operands.dropout_seed, operands.alibi_slopes)


def _ring_backward(q, k, v, operands: Operands, delta, lse, do, dlse, seq,
                   size, cfg: Config):
  """(dq, dk, dv, the operands' gradients: the sinks' over this device's
  queries, zeros for the ids)."""
  del dlse  # In delta; the ring's pairs take no bias that would read it.
  (q, do), (k, v) = without_padding(cfg.mask, operands.q_ids,
                                    operands.kv_ids, (q, do), (k, v))
  dq, dk, dv = ring.backward(q, k, v, operands.q_ids, operands.kv_ids,
                             delta, lse, do,
                             _ring_of(cfg, q, k, v, seq, size),
                             operands.dropout_seed, operands.alibi_slopes)
  d_operands = jax.tree.map(jnp.zeros_like, operands)
  if operands.sinks is not None:
    d_operands = dataclasses.replace(
        d_operands, sinks=softmax.sink_gradient(operands.sinks, delta, lse))
  return dq, dk, dv, d_operands


# Batch-, head- and (without optional operands) sequence-sharded inputs
# run shard by shard: see `context_parallel`.
_sharded_forward = context_parallel.sharded_forward(
    _backend_forward, _chunk_forward, _ring_forward, _refit_why)
_sharded_backward = context_parallel.sharded_backward(
    _local_backward, _chunk_backward, _ring_backward, _refit_why)


def _partitioned(operands: Operands, cfg: Config) -> bool:
  """Use the partitioned op: several devices, and a call a device's shard
  can take (`context_parallel.splittable`: no dropout, no mod's arrays or mod
  reading the batch or head index).

  (On one device there is nothing to partition, and the plain call also
  lowers ahead of time for a GPU that is not present.) An FP8 call's
  shards carry their e4m3 values (`Operands.fp8_q`, ...).
  """
  return (jax.device_count() > 1 and cfg.sequence_axis is None
          and context_parallel.splittable(operands, cfg.mask, cfg.scores))


def _forward(q, k, v, operands: Operands, cfg: Config):
  if cfg.sequence_axis is not None:
    return _sharded_forward.on_axis(q, k, v, operands, cfg)
  if _partitioned(operands, cfg):
    return _sharded_forward(q, k, v, operands, cfg)
  return _backend_forward(q, k, v, operands, cfg)


def _backward(cfg: Config, residuals, cotangents):
  """(dq, dk, dv, operands' cotangents) from the plan's backward. D =
  rowsum(dO * O) - dlse is formed here, once, where O lies (a query row's
  own: no communication when the sequence is split), and the backward
  reads D in O's place: a sequence-sharded backward moves D, not O. Rows
  past a length give D from zeroed O and dO (padding may hold anything)."""
  q, k, v, operands, o, lse = residuals
  do, dlse = cotangents
  do = do.astype(q.dtype)
  (o_rows, do_rows), _ = without_padding(cfg.mask, operands.q_ids,
                                         operands.kv_ids, (o, do))
  delta = softmax.backward_delta(o_rows, do_rows, dlse)
  if cfg.sequence_axis is not None:
    return _sharded_backward.on_axis(q, k, v, operands, delta, lse, do,
                                     dlse, cfg)
  if _partitioned(operands, cfg):
    return _sharded_backward(q, k, v, operands, delta, lse, do, dlse, cfg)
  return _local_backward(q, k, v, operands, delta, lse, do, dlse, cfg)


# One `jax.jit` per distinct call: JAX traces each once per process (its
# cache is by function and input types) and lowers each once per program.

@functools.cache
def _forward_jit(cfg: Config, tree):
  def forward(q, k, v, *leaves):
    return list(_forward(q, k, v, jax.tree.unflatten(tree, leaves), cfg))
  return jax.jit(forward)


@functools.cache
def _backward_jit(cfg: Config, tree):
  def backward(q, k, v, leaves, o, lse, do, dlse):
    operands = jax.tree.unflatten(tree, leaves)
    dq, dk, dv, d_operands = _backward(cfg, (q, k, v, operands, o, lse),
                                       (do, dlse))
    d_leaves = jax.tree.leaves(d_operands)
    primals = [q, k, v] + [leaves[i] for i in differentiable_leaves(tree)]
    grads = [dq, dk, dv] + [d_leaves[i] for i in differentiable_leaves(tree)]
    return [g.astype(x.dtype) for g, x in zip(grads, primals)]
  return jax.jit(backward)


@functools.cache
def _tangent_jit(cfg: Config, tree):
  config = cfg.configs.forward
  if not isinstance(config, blockwise.BlockSizes):
    config = blockwise.BlockSizes()
  positions = differentiable_leaves(tree)

  def tangent(q, k, v, leaves, tangents):
    def forward(q, k, v, *diff):
      flat = list(leaves)
      for i, x in zip(positions, diff):
        flat[i] = x
      return blockwise.forward(q, k, v, jax.tree.unflatten(tree, flat),
                               mask=cfg.mask, scores=cfg.scores,
                               config=config)
    primals = (q, k, v) + tuple(leaves[i] for i in positions)
    return list(jax.jvp(forward, primals, tuple(tangents))[1])
  return jax.jit(tangent)


# --- flash_p ---


def _twins(name):
  """(primitive, its twin for a call whose lowering splits it over devices:
  `context_parallel`'s custom_partitioning, which needs the program's devices as
  it lowers)."""
  prims = (Primitive(name), Primitive(name + "_partitioned"))
  for prim in prims:
    prim.multiple_results = True
  dispatch.prim_requires_devices_during_lowering.add(prims[1])
  return prims


flash_p, flash_partitioned_p = _twins("jax_flash_attention")
flash_tangent_p = Primitive("jax_flash_attention_tangent")
flash_tangent_p.multiple_results = True
flash_backward_p, flash_backward_partitioned_p = _twins(
    "jax_flash_attention_backward")


def _scoped(rule):
  """A lowering rule run in the call's `x64_scope` (the kernels' lowering,
  the Pallas interpreter's, Triton's and Mosaic GPU's, makes index
  constants of Python ints) and without shard_map's checks of how values
  vary over manual axes (the call is per device whole: its loops start
  from constants, as Pallas kernels' do, which it checks without either)."""
  def lowering(ctx, *args, **params):
    avals = [a.update(manual_axis_type=jax_core.empty_mat)
             if isinstance(a, jax_core.ShapedArray) else a
             for a in ctx.avals_in]
    with x64_scope(ctx.avals_in[0]), jax_config._check_vma(False):
      return rule(ctx.replace(avals_in=avals), *args, **params)
  return lowering


def bind(q, k, v, operands: Operands, cfg: Config):
  """(o [B, T, N, Hv], lse [B, N, T]) of one call through `flash_p` (or
  `flash_partitioned_p`)."""
  leaves, tree = jax.tree.flatten(operands)
  prim = flash_partitioned_p if _partitioned(operands, cfg) else flash_p
  o, lse = prim.bind(q, k, v, *leaves, cfg=cfg, tree=tree)
  return o, lse


def _out_avals(q, v):
  """Avals of (o [B, T, N, Hv] like q, lse [B, N, T] float32), sharded as
  q is along batch, queries and heads (and varying where q varies)."""
  batch, q_len, num_heads, _ = q.shape
  spec = tuple(q.sharding.spec) + (None,) * (4 - len(q.sharding.spec))
  o = q.update(shape=(batch, q_len, num_heads, v.shape[-1]), weak_type=False,
               sharding=q.sharding.update(spec=jax.P(*spec[:3], None)))
  lse = q.update(shape=(batch, num_heads, q_len), dtype=jnp.float32,
                 weak_type=False,
                 sharding=q.sharding.update(
                     spec=jax.P(spec[0], spec[2], spec[1])))
  return [o, lse]


def _flash_jvp(prim, primals, tangents, *, cfg, tree):
  out = prim.bind(*primals, cfg=cfg, tree=tree)
  positions = (0, 1, 2) + tuple(3 + i for i in differentiable_leaves(tree))
  tangents = [tangents[i] for i in positions]
  if all(type(t) is ad.Zero for t in tangents):
    return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return out, flash_tangent_p.bind(*primals, *out, *tangents, cfg=cfg,
                                   tree=tree)


# Operands without a batch axis: a vmapped one cannot fold into the batch.
_UNFOLDABLE = ("dropout_seed", "sinks", "mask_consts", "score_consts")
# Operands whose axis 0 is the batch (B), or broadcasts over it (1 or B).
_BATCH_AXIS = ("q_ids", "kv_ids", "alibi_slopes", "q_offsets", "fp8_q",
               "fp8_k", "fp8_v", "fp8_scales")
_BROADCAST_BATCH_AXIS = ("bias", "dense_mask", "tile_kinds")


def _front(x, dim, size: int):
  """x with its mapped axis first (broadcast to `size` if unmapped)."""
  if dim is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, dim, 0)


def _fold(xs, dims, size: int):
  """[V, B, ...] -> [V * B, ...] for each x (V the mapped axis); (xs, B)."""
  fronts = [_front(x, d, size) for x, d in zip(xs, dims)]
  batch = fronts[0].shape[1]
  return [x.reshape((size * batch,) + x.shape[2:]) for x in fronts], batch


def _fold_operands(operands: Operands, dims: Operands, size: int, batch: int):
  """The operands with a mapped axis folded into (or tiled over) the batch
  axis; those that broadcast over the batch (axis 0 of size 1) and are not
  mapped stay as they are."""
  changes = {}
  for name in _BATCH_AXIS + _BROADCAST_BATCH_AXIS:
    x, d = getattr(operands, name), getattr(dims, name)
    if x is None or (d is None and name in _BROADCAST_BATCH_AXIS and
                     x.shape[0] == 1):
      continue
    x = _front(x, d, size)
    x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
    changes[name] = x.reshape((size * batch,) + x.shape[2:])
  return dataclasses.replace(operands, **changes)


def _map_slices(prim_call, args, dims):
  """prim_call(*args) on each slice along the mapped axes (`dims`), the
  outputs stacked along axis 0."""
  mapped = [i for i, d in enumerate(dims) if d is not None]

  def one(slices):
    flat = list(args)
    for i, x in zip(mapped, slices):
      flat[i] = x
    return prim_call(*flat)

  return jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])


def _axis_size(args, dims) -> int:
  return next(x.shape[d] for x, d in zip(args, dims)
              if d is not None)


def _batched(prim, args, dims, *, cfg, tree, per_slice: bool = False):
  """`prim`'s outputs under vmap, each with the mapped axis first: args are
  (q, k, v, *operand leaves, then any more batch-major arrays). The mapped
  axis folds into the batch axis (the same call on a larger batch), or the
  call runs once per slice (`lax.map`) with `per_slice` or where an operand
  cannot fold (dropout, whose bits depend on the batch index; sinks or a
  mod's arrays that differ along the axis)."""
  size = _axis_size(args, dims)
  n = tree.num_leaves
  operand_dims = jax.tree.unflatten(tree, dims[3:3 + n])
  if per_slice or cfg.scores.dropout or any(
      jax.tree.leaves(getattr(operand_dims, name)) for name in _UNFOLDABLE):
    return _map_slices(lambda *a: prim.bind(*a, cfg=cfg, tree=tree), args,
                       dims)
  (q, k, v), batch = _fold(args[:3], dims[:3], size)
  tail = _fold(args[3 + n:], dims[3 + n:], size)[0] if args[3 + n:] else []
  operands = _fold_operands(jax.tree.unflatten(tree, args[3:3 + n]),
                            operand_dims, size, batch)
  outs = prim.bind(q, k, v, *jax.tree.leaves(operands), *tail, cfg=cfg,
                   tree=tree)
  return [x.reshape((size, batch) + x.shape[1:]) for x in outs]


def _flash_batch(prim, args, dims, *, cfg, tree):
  return _batched(prim, args, dims, cfg=cfg, tree=tree), (0, 0)


def _forward_value(*args, cfg, tree):
  if _kernel_cache.keepable(cfg):
    return _kernel_cache.call(_forward_jit(cfg, tree), ("forward", cfg, tree),
                              *args)
  return _forward_jit(cfg, tree)(*args)


for _prim in (flash_p, flash_partitioned_p):
  _prim.def_impl(functools.partial(dispatch.apply_primitive, _prim))
  _prim.def_abstract_eval(
      lambda q, k, v, *leaves, cfg, tree: _out_avals(q, v))
  mlir.register_lowering(_prim, _scoped(mlir.lower_fun(
      _forward_value, multiple_results=True)))
  ad.primitive_jvps[_prim] = functools.partial(_flash_jvp, _prim)
  batching.primitive_batchers[_prim] = functools.partial(_flash_batch, _prim)

# --- flash_tangent_p ---


def _split(args, tree):
  """(q, k, v, leaves, o, lse), tangents of a `flash_tangent_p` call."""
  n = tree.num_leaves
  q, k, v = args[:3]
  leaves, (o, lse) = list(args[3:3 + n]), args[3 + n:5 + n]
  return (q, k, v, leaves, o, lse), list(args[5 + n:])


def _tangent_value(*args, cfg, tree):
  if cfg.sequence_axis is not None:
    raise NotImplementedError(
        f"forward-mode derivatives (jvp) of flash_attention with "
        f"sequence_axis and context_parallel={cfg.context_parallel!r}: its "
        f"tangent is per device; reverse mode (grad, vjp) runs, and "
        f"context_parallel='all_to_all' takes jvp too")
  (q, k, v, leaves, _, _), tangents = _split(args, tree)
  return _tangent_jit(cfg, tree)(q, k, v, leaves, tangents)


def _tangent_transpose(cotangents, *args, cfg, tree):
  (q, k, v, leaves, o, lse), tangents = _split(args, tree)
  if any(ad.is_undefined_primal(x) for x in (q, k, v, o, lse, *leaves)):
    raise NotImplementedError(SECOND_ORDER)
  do, dlse = (ad.instantiate_zeros(ct) for ct in cotangents)
  prim = (flash_backward_partitioned_p
          if _partitioned(jax.tree.unflatten(tree, leaves), cfg)
          else flash_backward_p)
  grads = prim.bind(q, k, v, *leaves, o, lse, do, dlse, cfg=cfg, tree=tree)
  return [None] * (5 + len(leaves)) + [
      g if ad.is_undefined_primal(t) else None
      for g, t in zip(grads, tangents)]


def _second_order(*args, **params):
  raise NotImplementedError(SECOND_ORDER)


def _tangent_batch(args, dims, *, cfg, tree):
  return _map_slices(
      lambda *a: flash_tangent_p.bind(*a, cfg=cfg, tree=tree), args,
      dims), (0, 0)


flash_tangent_p.def_impl(
    functools.partial(dispatch.apply_primitive, flash_tangent_p))
flash_tangent_p.def_abstract_eval(
    lambda *args, cfg, tree: _out_avals(args[0], args[2]))
mlir.register_lowering(flash_tangent_p, _scoped(mlir.lower_fun(
    _tangent_value, multiple_results=True)))
ad.primitive_jvps[flash_tangent_p] = _second_order
ad.primitive_transposes[flash_tangent_p] = _tangent_transpose
batching.primitive_batchers[flash_tangent_p] = _tangent_batch

# --- flash_backward_p ---
# (q, k, v, *operands, o, lse, do, dlse) -> (dq, dk, dv, *gradients of the
# differentiable operands): the plan's backward, what `flash_tangent_p`'s
# transpose binds.


def _backward_value(*args, cfg, tree):
  (q, k, v, leaves, o, lse), (do, dlse) = _split(args, tree)
  args = (q, k, v, leaves, o, lse, do, dlse)
  if _kernel_cache.keepable(cfg):
    return _kernel_cache.call(_backward_jit(cfg, tree),
                              ("backward", cfg, tree), *args)
  return _backward_jit(cfg, tree)(*args)


def _backward_avals(*args, cfg, tree):
  (q, k, v, leaves, _, _), _ = _split(args, tree)
  return [x.update(weak_type=False) for x in
          [q, k, v] + [leaves[i] for i in differentiable_leaves(tree)]]


def _backward_batch(prim, args, dims, *, cfg, tree):
  """As the forward's; once per slice where an operand has a gradient
  (whose slices the folded batch would sum)."""
  outs = _batched(prim, args, dims, cfg=cfg, tree=tree,
                  per_slice=bool(differentiable_leaves(tree)))
  return outs, (0,) * len(outs)


for _prim in (flash_backward_p, flash_backward_partitioned_p):
  _prim.def_impl(functools.partial(dispatch.apply_primitive, _prim))
  _prim.def_abstract_eval(_backward_avals)
  mlir.register_lowering(_prim, _scoped(mlir.lower_fun(
      _backward_value, multiple_results=True)))
  ad.primitive_jvps[_prim] = _second_order
  batching.primitive_batchers[_prim] = functools.partial(_backward_batch,
                                                         _prim)
