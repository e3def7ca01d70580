"""Batch-, head- and sequence-sharded inputs run without gathering them.

The Pallas kernels are opaque custom calls to XLA's partitioner, which would
otherwise gather sharded inputs onto every device. `custom_partitioning`
tells it that attention is independent per (batch, head): the forward and the
backward run on each device's shard of the batch and of the heads. Heads
shard only where the kv heads divide evenly, so that every device holds
whole GQA groups.

Queries sharded along the sequence (keys sharded over the same mesh axes,
or not sharded along it) run context parallelism, one of three strategies
(`STRATEGIES`; `context_parallel` picks, "auto" by the bytes each device
moves, `_Split.cost`):

* all_to_all (DeepSpeed-Ulysses): an all-to-all over the sequence axes
  trades each device's sequence chunk of every head for the whole sequence
  of a few heads, attention runs on them as on one device (every mask of
  the call unchanged), and an all-to-all returns the output (and the
  backward's gradients) to sequence chunks. It needs keys sharded like the
  queries and the KV heads of a device's head shard to divide by the
  sequence axes' size.
* all_gather: each device gathers the whole of K and V and runs its own
  queries against them at their positions in the sequence (query offsets);
  the backward's dK and dV partials are reduce-scattered back. Causal
  calls balance the work: the halves of the chunks are exchanged so that
  device d holds chunks d and 2P-1-d of 2P (`_to_zigzag`), and the results
  go back. Queries are never gathered.
* ring (named only: it moves as much as all_gather, and spares memory):
  self-attention with causal or full masks or causal sliding windows
  (segment ids and sinks too); K/V chunks travel around the
  devices while each runs its pairs (`jax_flash.ring`, the code of
  `ring_attention`), causal calls in the balanced layout, windowed ones
  in order, stopping after the chunks the window reaches.

A call with optional operands (`Operands`: ids, a dense mask, a bias,
ALiBi slopes, sinks, query offsets, tile kinds, dropout's seed) splits
over batch and heads too, each operand along its own batch and head dims
(`operand_factors`; a dim of 1 that broadcasts stays whole, and a gradient
summed over a split it broadcasts along is summed over those devices); its
sequence splits by the strategies its arrays allow (`_STRATEGY_OPERANDS`),
else is gathered. Dropout's seed is shifted to each device's place in the
batch and the heads, and all_gather's chunks draw the bits of their
queries' positions, so its keep bits are the whole call's. A mask_mod or
score_mod that reads its batch or head index and a mod's arrays keep the
call whole (`splittable`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash.core import dropout, mods
from jax_flash.core.backend import differentiable_leaves
from jax_flash.core.mask import Mask, dense_tile_kinds
from jax_flash.core.operands import Operands
from jax_flash.core.options import STRATEGIES
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores

# Shardy rules: b batch, t/s query/key length, n/k query/kv heads, h head
# dim of query/key, v head dim of value/output.
_FWD_RULE = "b t n h, b s k h, b s k v -> b t n v, b n t"
# The backward reads D = rowsum(dO * O) - dlse ([B, N, T]) in O's place.
_BWD_RULE = ("b t n h, b s k h, b s k v, b n t, b n t, b t n v, b n t "
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


@dataclasses.dataclass(frozen=True)
class _Split:
  """How one call is split: mesh axes of the batch, the heads and the
  sequence (None: not split), whether the keys are split along the
  sequence too, the strategy of a split sequence, and whether its queries
  are exchanged into balanced halves (all_gather, causal)."""
  batch: object = None
  heads: object = None
  seq: object = None
  kv_seq: bool = False
  strategy: str | None = None
  balanced: bool = False

  def specs(self, shapes, kv_positions):
    """The sharding spec of each of `shapes` ([B, L, N, H] or [B, N, L]);
    those at `kv_positions` are keys, values or their gradients."""
    def one(i, shape):
      seq = self.seq if i not in kv_positions or self.kv_seq else None
      if len(shape.shape) == 4:
        return P(self.batch, seq, self.heads, None)
      return P(self.batch, self.heads, seq)
    return [one(i, s) for i, s in enumerate(shapes)]


def cost(strategy: str, *, p: int, q_rows: int, kv_rows: int, heads: int,
         kv_heads: int, head_dims: int, kv_seq: bool, balanced: bool,
         inner: int = 1) -> int:
  """Elements a device sends in a forward (its backward moves about twice
  as many, in the same proportion), P devices along the sequence, each
  holding `q_rows` queries of `heads` heads and `kv_rows` keys of
  `kv_heads` heads (`head_dims`: query + value head dims). all_to_all:
  (P-1)/P of its queries, keys, values and outputs; all_gather: its keys
  and values to the P-1 others (none when the keys are not split), and
  with balanced halves its queries and outputs (each half to a device);
  ring: as all_gather, its keys and values also exchanged into the
  balanced halves. (ring never sends fewer than all_gather: what it
  spares is memory, one chunk of keys a device instead of all.)
  ring_all_to_all: all_to_all over the last sequence axis (`inner`
  devices), then a ring of blocks as large as a chunk over the P / inner
  others."""
  q, kv = q_rows * heads * head_dims, kv_rows * kv_heads * head_dims
  if strategy == "all_to_all":
    return (q + kv) * (p - 1) // p
  if strategy == "ring_all_to_all":
    return ((q + kv) * (inner - 1) // inner + kv * (p // inner - 1)
            + (q + kv if balanced else 0))
  if strategy == "ring":  # As all_gather, and keys into the zigzag too.
    return kv * (p - 1) + (q + kv if balanced else 0)
  return (kv * (p - 1) if kv_seq else 0) + (q if balanced else 0)


def _plan(mesh, arg_shapes, cfg, refit_why, refused=None) -> _Split:
  """The split of a call whose first three arguments are q, k, v: batch
  and heads as the query is sharded (heads where whole GQA groups fit a
  device), the sequence where the keys are sharded alike or not at all,
  by the strategy `cfg.context_parallel` names (or the cheaper one);
  `refused`: {strategy: why it cannot run} known beforehand."""
  q, k, v = arg_shapes[:3]
  batch, heads, seq = (_spec(q.sharding, d) for d in (0, 2, 1))
  num_kv_heads = k.shape[2]
  if heads is not None and num_kv_heads % _size(mesh, heads):
    heads = None  # Whole GQA groups per device, or no head sharding.
  k_seq = _spec(k.sharding, 1)
  p = _size(mesh, seq)
  if (seq is None or p == 1 or k_seq not in (None, seq)
      or _spec(v.sharding, 1) != k_seq
      or set(_names(seq)) & set(_names(batch) + _names(heads))):
    return _Split(batch, heads)
  kv_seq = k_seq is not None
  hs = _size(mesh, heads)
  local = dict(p=p, q_rows=q.shape[1] // p,
               kv_rows=k.shape[1] // p if kv_seq else k.shape[1],
               heads=q.shape[2] // hs, kv_heads=num_kv_heads // hs,
               head_dims=q.shape[3] + v.shape[3], kv_seq=kv_seq)
  left, right = cfg.mask.band()
  windowed = left is not None and right == 0  # Causal sliding windows.
  balanced = cfg.mask.is_causal and local["q_rows"] % 2 == 0
  why = dict(refused or {})
  if not kv_seq:
    why["all_to_all"] = "the keys are not sharded like the queries"
  elif local["kv_heads"] % p:
    why["all_to_all"] = (f"the {local['kv_heads']} KV heads a device holds "
                         f"do not divide by the {p} devices of the sequence")
  chunk = Problem(batch=q.shape[0] // _size(mesh, batch),
                  q_len=local["q_rows"] // (2 if balanced else 1),
                  kv_len=k.shape[1], num_heads=local["heads"],
                  num_kv_heads=local["kv_heads"], head_dim=q.shape[3],
                  unbatched=False, value_head_dim=v.shape[3])
  offsets_why = "all_gather" not in why and refit_why(cfg, chunk, q.dtype,
                                                     True)
  if offsets_why:
    why["all_gather"] = offsets_why
  causal = cfg.mask.is_causal or windowed
  ring_masks = (Mask(is_causal=causal),
                Mask(is_causal=causal, has_ids=True, segments_only=True))
  ring_mask = dataclasses.replace(cfg.mask, is_causal=causal,
                                  window_left=None, window_right=None)

  def ring_why(r: int, a: int):
    """Why a ring over r devices cannot run, its blocks a chunks of the
    sequence and 1 / a of the heads (or None)."""
    if not kv_seq or q.shape[1] != k.shape[1]:
      return "ring runs self-attention with keys sharded as queries"
    if ring_mask not in ring_masks or (
        (cfg.mask.window_left, cfg.mask.window_right) != (None, None)
        and not windowed):
      return ("ring runs causal or full masks and causal sliding windows, "
              "alone or with segment ids (no lengths)")
    if cfg.mask.is_causal and not balanced and not windowed:
      return "a causal ring needs chunks of an even length"
    rows = q.shape[1] // r // (2 if balanced and not windowed else 1)
    pair = dataclasses.replace(chunk, q_len=rows, kv_len=rows,
                               num_heads=local["heads"] // a,
                               num_kv_heads=local["kv_heads"] // a)
    return (refit_why(cfg, pair, q.dtype, False)
            or (windowed and refit_why(cfg, pair, q.dtype, True)) or None)

  axes = _names(seq)
  local["inner"] = mesh.shape[axes[-1]] if len(axes) > 1 else 1
  if "ring" not in why and (reason := ring_why(p, 1)):
    why["ring"] = reason
  if "ring_all_to_all" in why:  # Refused beforehand.
    pass
  elif len(axes) < 2:
    why["ring_all_to_all"] = (
        "ring_all_to_all needs the sequence sharded over several mesh "
        "axes: a ring over the first, all_to_all over the last")
  elif local["kv_heads"] % local["inner"]:
    why["ring_all_to_all"] = (
        f"the {local['kv_heads']} KV heads a device holds do not divide by "
        f"the {local['inner']} devices of {axes[-1]!r}")
  elif reason := ring_why(p // local["inner"], local["inner"]):
    why["ring_all_to_all"] = reason
  costs = {s: cost(s, balanced=balanced, **local) for s in STRATEGIES[1:]
           if s not in why}
  want = cfg.context_parallel
  if want == "auto":
    if not costs:  # Nothing fits: XLA gathers the sequence.
      return _Split(batch, heads)
    want = min(costs, key=costs.get)
  elif want in why:
    raise ValueError(f"context_parallel={want!r} cannot run this call: "
                     f"{why[want]}")
  return _Split(batch, heads, seq, kv_seq, want,
                balanced and want != "all_to_all"
                and not (windowed and want.startswith("ring")))


def moved(collective, x, *args, **kwargs):
  """collective(x, *args, **kwargs) for a collective that only moves data
  (all_to_all, all_gather, ppermute), 16-bit floats sent as 16-bit
  integers: XLA's CPU backend runs collectives of bf16 and f16 in float32
  (a converted copy at twice the size on each side), while NCCL moves
  16-bit integers as they are. Bitwise the same result."""
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return collective(x, *args, **kwargs)
  bits = collective(lax.bitcast_convert_type(x, jnp.uint16), *args, **kwargs)
  return lax.bitcast_convert_type(bits, x.dtype)


def exchange(x, seq, split: int, concat: int):
  """lax.all_to_all(x, seq, split, concat, tiled=True), its pieces moved
  along a leading axis of their own (each piece one contiguous block, the
  received blocks laid out where the concatenated axis wants them)."""
  p = lax.axis_size(seq)
  shape = x.shape
  y = x.reshape(shape[:split] + (p, shape[split] // p) + shape[split + 1:])
  y = moved(lax.all_to_all, jnp.moveaxis(y, split, 0), seq, 0, 0,
            tiled=True)
  y = jnp.moveaxis(y, 0, concat)  # Block j, from device j, before j + 1.
  return y.reshape(y.shape[:concat] + (p * y.shape[concat + 1],)
                   + y.shape[concat + 2:])


def in_turn(move, arrays):
  """[move(x) for x in arrays], one after another: each move waits for the
  one before's result through an optimization barrier. XLA would otherwise
  run every collective first and hold all their received pieces at once."""
  done = []
  for x in arrays:
    if done:
      x, _ = lax.optimization_barrier((x, done[-1]))
    done.append(move(x))
  return done


def after_all(fn):
  """fn run once all of its arrays exist (an optimization barrier on
  them). A backward's moves of Q, K and V need no result of its forward:
  XLA would otherwise run them ahead of the forward and hold what they
  received through it."""
  def run(*arrays):
    return fn(*lax.optimization_barrier(arrays))
  return run


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
    return exchange(x, seq, split, concat)

  def run(*arrays):
    outs = fn(*in_turn(lambda x: swap(x, True), arrays))
    leaves, tree = jax.tree.flatten(outs)
    return jax.tree.unflatten(tree, in_turn(lambda y: swap(y, False),
                                            leaves))
  return run


def _zigzag_perms(p):
  """ppermute pairs sending half 0 and half 1 of each device's chunk
  (chunks 2e, 2e + 1 of 2P) to the device that holds it in the balanced
  layout: chunk c on device c, or 2P-1-c from P on."""
  owner = lambda c: c if c < p else 2 * p - 1 - c
  return ([(e, owner(2 * e)) for e in range(p)],
          [(e, owner(2 * e + 1)) for e in range(p)])


def _to_zigzag(x, axis, seq, p):
  """(chunk d, chunk 2P-1-d) on device d, from the contiguous chunk each
  device holds along `axis`. (Chunk d is even, arriving through the first
  permutation, exactly when d is.)"""
  first, second = _zigzag_perms(p)
  h0, h1 = jnp.split(x, 2, axis)
  a = moved(lax.ppermute, h0, seq, first)
  b = moved(lax.ppermute, h1, seq, second)
  even = lax.rem(lax.axis_index(seq), 2) == 0
  return jnp.where(even, a, b), jnp.where(even, b, a)


def _from_zigzag(low, high, axis, seq, p):
  """The inverse of `_to_zigzag`: each device's contiguous chunk again."""
  first, second = _zigzag_perms(p)
  even = lax.rem(lax.axis_index(seq), 2) == 0
  a, b = jnp.where(even, low, high), jnp.where(even, high, low)
  back = lambda perm: [(j, i) for i, j in perm]
  return jnp.concatenate([moved(lax.ppermute, a, seq, back(first)),
                          moved(lax.ppermute, b, seq, back(second))], axis)


def _query_parts(split: _Split, p, rows, arrays, axes):
  """[(offset, arrays' parts)]: this device's queries (and the per-query
  arrays, each with its sequence axis in `axes`) with the position of
  their first row, as one chunk or as its balanced halves."""
  seq = split.seq
  d = lax.axis_index(seq)
  if not split.balanced:
    return [(d * rows, tuple(arrays))]
  half = rows // 2
  parts = [_to_zigzag(x, axis, seq, p) for x, axis in zip(arrays, axes)]
  return [(d * half, tuple(x[0] for x in parts)),
          ((2 * p - 1 - d) * half, tuple(x[1] for x in parts))]


def _join_queries(split: _Split, p, parts, axes):
  """The inverse of `_query_parts` for outputs per query: [(arrays)]."""
  if not split.balanced:
    return parts[0]
  return tuple(_from_zigzag(lo, hi, axis, split.seq, p)
               for lo, hi, axis in zip(*parts, axes))


def _offsets(q, offset):
  return jnp.full((q.shape[0],), offset, jnp.int32)


def _axis(factors: str, name: str):
  names = factors.split()
  return names.index(name) if name in names else None


def _gather_lowering(chunk, in_factors, out_factors):
  """all_gather's per-device function, (cfg, split, p) -> run(*arrays):
  chunk(*arrays, q_offsets, cfg) on this device's queries (the arrays
  with a "t" factor; as balanced halves when causal) against the whole
  of the arrays with an "s" factor (K, V, key ids: gathered). Results per
  query are joined back; the others (dK, dV, the sinks' gradient) are
  partials over this device's queries, summed in float32 across the
  devices: reduce-scattered back to key chunks where they have an "s"
  factor and the keys are split, else summed whole."""
  queries = [i for i, f in enumerate(in_factors) if "t" in f.split()]
  joined = [j for j, f in enumerate(out_factors) if "t" in f.split()]

  def lowering(cfg, split: _Split, p):
    def run(*arrays):
      arrays = list(arrays)
      if split.kv_seq:  # Per-pair arrays arrive with every key.
        for i, f in enumerate(in_factors):
          if _axis(f, "s") is not None and _axis(f, "t") is None:
            arrays[i] = moved(lax.all_gather, arrays[i], split.seq,
                              axis=_axis(f, "s"), tiled=True)
      results = []
      for offset, part in _query_parts(
          split, p, arrays[0].shape[1], [arrays[i] for i in queries],
          [_axis(in_factors[i], "t") for i in queries]):
        local = list(arrays)
        for i, x in zip(queries, part):
          local[i] = x
        results.append(chunk(*local, _offsets(arrays[0], offset), cfg))
      outs = dict(zip(joined, _join_queries(
          split, p, [tuple(r[j] for j in joined) for r in results],
          [_axis(out_factors[j], "t") for j in joined])))
      for j, f in enumerate(out_factors):
        if j in outs:
          continue
        total = sum(r[j].astype(jnp.float32) for r in results)
        if split.kv_seq and _axis(f, "s") is not None:
          total = lax.psum_scatter(total, split.seq,
                                   scatter_dimension=_axis(f, "s"),
                                   tiled=True)
        else:
          total = lax.psum(total, split.seq)
        outs[j] = total.astype(results[0][j].dtype)
      return tuple(outs[j] for j in range(len(out_factors)))
    return run
  return lowering


def _zigzag_whole(x, axis, seq, p):
  """This device's chunk of `x` in the balanced layout: (chunk d, chunk
  2P-1-d) joined along `axis`."""
  return jnp.concatenate(_to_zigzag(x, axis, seq, p), axis)


def _unzigzag_whole(x, axis, seq, p):
  return _from_zigzag(*jnp.split(x, 2, axis), axis, seq, p)


def _ring_lowering(ring_fn, in_factors, out_factors):
  """ring's per-device function, (cfg, split, p) -> run(*arrays): the
  arrays along the sequence (a "t" or "s" factor) moved into the balanced
  layout when causal, ring_fn(*arrays, seq, p, cfg) run, its results moved
  back; a result with neither factor (the sinks' gradient, a partial over
  this device's queries) summed across the devices."""
  def lowering(cfg, split: _Split, p):
    seq = split.seq

    def axis(factors):
      t = _axis(factors, "t")
      return t if t is not None else _axis(factors, "s")

    def run(*arrays):
      if split.balanced:
        arrays = [x if axis(f) is None else
                  _zigzag_whole(x, axis(f), seq, p)
                  for x, f in zip(arrays, in_factors)]
      outs = ring_fn(*arrays, seq, p, cfg)
      return tuple(
          lax.psum(y, seq) if axis(f) is None else
          _unzigzag_whole(y, axis(f), seq, p) if split.balanced else y
          for y, f in zip(outs, out_factors))
    return run
  return lowering


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


def _custom_partitioning(fn, num_args: int):
  """custom_partitioning of fn(*arrays, cfg) (`num_args` in all, cfg
  static), traced through a `jax.jit`: custom_partitioning takes no
  function whose trace has constants (a kernel's static tables made in
  numpy), and a jit keeps them inside its own program."""
  static = num_args - 1
  return custom_partitioning(jax.jit(fn, static_argnums=static),
                             static_argnums=(static,))


def _define(fn, rule, lowerings, refit_why, kv_results):
  """fn(*arrays, cfg) as a custom_partitioning op split over batch, heads
  and the sequence; `lowerings`: strategy name -> (cfg, split, p) -> the
  per-device function (all_to_all's is fn's own); `kv_results`: the
  positions of key-like results."""
  op = _custom_partitioning(fn, fn.__code__.co_argcount)

  def shardings(mesh, split, shapes, kv_positions):
    specs = split.specs(shapes, kv_positions)
    if isinstance(shapes, (list, tuple)):
      return type(shapes)(NamedSharding(mesh, s) for s in specs)
    return NamedSharding(mesh, specs[0])

  def infer(cfg, mesh, arg_shapes, result_shape):
    split = _plan(mesh, arg_shapes, cfg, refit_why)
    return shardings(mesh, split, result_shape, kv_results)

  def partition(cfg, mesh, arg_shapes, result_shape):
    split = _plan(mesh, arg_shapes, cfg, refit_why)
    p = _size(mesh, split.seq)
    if split.strategy == "ring_all_to_all":  # A ring of each block's heads.
      *outer, inner = _names(split.seq)
      outer = outer[0] if len(outer) == 1 else tuple(outer)
      lower = all_to_all(lowerings["ring"](
          cfg, dataclasses.replace(split, seq=outer), _size(mesh, outer)),
                         inner)
    elif split.strategy in lowerings:
      lower = lowerings[split.strategy](cfg, split, p)
    else:
      lower = all_to_all(lambda *arrays: fn(*arrays, cfg), split.seq)
    return (mesh, after_all(lower),
            shardings(mesh, split, result_shape, kv_results),
            shardings(mesh, split, arg_shapes, (1, 2)))

  factors = []  # In order of first appearance: shardy wants them sorted.
  for name in rule.replace(",", " ").replace("->", " ").split():
    if name not in factors:
      factors.append(name)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule,
                   need_replication_factors=tuple(f for f in factors
                                                  if f in _WHOLE))
  return _fold_vmap(op)


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


def localize(x, factors: str, seq, p: int, to_heads: bool):
  """One array of an all_to_all call with operands, on a device, moved
  between its sequence chunk of every head (`to_heads` False) and the
  whole sequence of its 1 / P of the heads: per (token, head) arrays by
  an all-to-all, per-token ones (ids, a bias shared by the heads)
  gathered whole (back, a gradient's partials over the heads summed and
  cut to the chunk), per-head ones (ALiBi slopes, sinks) cut to its heads
  (and, back, gathered); others unchanged."""
  names = factors.split()
  length = next((i for i, f in enumerate(names) if f in "ts"), None)
  heads = next((i for i, f in enumerate(names) if f in "nk"), None)
  if length is not None and heads is not None:
    split, concat = (heads, length) if to_heads else (length, heads)
    return exchange(x, seq, split, concat)
  if length is not None:  # Back: a gradient's partial over these heads.
    if to_heads:
      return moved(lax.all_gather, x, seq, axis=length, tiled=True)
    return lax.psum_scatter(x, seq, scatter_dimension=length, tiled=True)
  if heads is not None:
    if not to_heads:
      return moved(lax.all_gather, x, seq, axis=heads, tiled=True)
    size = x.shape[heads] // p
    return lax.dynamic_slice_in_dim(x, lax.axis_index(seq) * size, size,
                                    heads)
  return x


def _split_with_operands(fn, in_factors, out_factors, refused, refit_why,
                         lowerings, seed_index=None):
  """fn(*arrays, cfg) as a custom_partitioning op split over batch and
  heads as the query is (`_plan`), and over the sequence by all_to_all
  or the other strategies (`lowerings`: name -> (cfg, split, p) -> the
  per-device function) unless `refused` (strategy -> why) says otherwise:
  each array and
  result along its factors (a string each: "b t n h"; `localize`), its
  other dims whole. A result without the batch factor (or without the
  heads') is summed over the devices of the batch (heads) split: the
  gradient of an operand that broadcasts along it. The array at
  `seed_index` (dropout's seed words) is shifted to each device's place
  in the batch and the heads (`dropout.shifted`), so its keep bits are
  the whole call's."""
  op = _custom_partitioning(fn, len(in_factors) + 1)

  def spec(split, factors):
    kv = split.seq if split.kv_seq else None
    if "t" in factors.split():  # Per pair (a bias): keys whole.
      kv = None
    axis = dict(b=split.batch, n=split.heads, k=split.heads, t=split.seq,
                s=kv)
    return P(*(axis.get(f) for f in factors.split()))

  def shardings(mesh, split, factors, like):
    out = [NamedSharding(mesh, spec(split, f)) for f in factors]
    return type(like)(out) if isinstance(like, (list, tuple)) else out[0]

  def plan(mesh, arg_shapes, cfg):
    return _plan(mesh, arg_shapes, cfg, refit_why, refused)

  def infer(cfg, mesh, arg_shapes, result_shape):
    return shardings(mesh, plan(mesh, arg_shapes, cfg), out_factors,
                     result_shape)

  def partition(cfg, mesh, arg_shapes, result_shape):
    split = plan(mesh, arg_shapes, cfg)
    p = _size(mesh, split.seq)

    def summed(y, factors):
      names = factors.split()
      axes = (_names(split.batch) if "b" not in names else ()) + (
          _names(split.heads) if not {"n", "k"} & set(names) else ())
      return lax.psum(y, axes) if axes else y

    def place(axes, size):
      return lax.axis_index(axes) * size if axes is not None else 0

    local_fn = (lowerings[split.strategy](cfg, split, p)
                if split.strategy in lowerings else None)

    def lower(*arrays):
      if seed_index is not None and not cfg.scores.dropout_broadcast:
        local = arrays[0].shape  # [B, T, N, H] of this device.
        heads = place(split.heads, local[2])
        if split.seq is not None and local_fn is None:  # all_to_all's.
          heads = heads + place(split.seq, local[2] // p)
        arrays = list(arrays)
        arrays[seed_index] = dropout.shifted(
            arrays[seed_index], place(split.batch, local[0]), heads)
      if local_fn is not None:
        return tuple(summed(y, f)
                     for y, f in zip(local_fn(*arrays), out_factors))
      if split.seq is not None:
        arrays = [localize(x, f, split.seq, p, True)
                  for x, f in zip(arrays, in_factors)]
      outs = fn(*arrays, cfg)
      if split.seq is not None:
        outs = [localize(y, f, split.seq, p, False)
                for y, f in zip(outs, out_factors)]
      return tuple(summed(y, f) for y, f in zip(outs, out_factors))
    return (mesh, after_all(lower),
            shardings(mesh, split, out_factors, result_shape),
            shardings(mesh, split, in_factors, arg_shapes))

  rule = ", ".join(in_factors) + " -> " + ", ".join(out_factors)
  factors = []
  for name in rule.replace(",", " ").replace("->", " ").split():
    if name not in factors:
      factors.append(name)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule,
                   need_replication_factors=tuple(
                       f for f in factors if f not in _SPLIT))
  return op


# The optional arrays each strategy splits the sequence with; with others a
# call's sequence stays whole. all_to_all: ids gathered whole, per-head
# arrays cut to a device's heads, a bias (its gradient back to chunks) and
# a dense mask (sharded along its queries,
# every key's column on each device) moved to a device's heads with the
# queries (gathered whole where it broadcasts over heads); its tile kinds
# cover the whole sequence each device then holds. all_gather: key ids
# gathered with the keys, query ids and a bias's rows cut with the queries
# (its key dim whole on every device), per-head arrays whole, dropout's
# bits at the queries' positions, a dense mask's rows cut with the queries
# and its tile kinds taken again from a chunk's rows (`_at_offsets`; a
# flex block mask's kinds, which cover the whole call's grid, are refused:
# `_refused`). ring: key ids travel with the keys, sinks join the merge,
# dropout draws each pair's bits at its place (`ring._pair_seed`). FP8's
# e4m3 arrays and scales (`_FP8`) move as q, k, v and the per-head arrays
# do in all_to_all and all_gather; a ring's pairs would not get them.
_FP8 = ("fp8_q", "fp8_k", "fp8_v", "fp8_scales")
_STRATEGY_OPERANDS = {
    "all_to_all": frozenset(("q_ids", "kv_ids", "alibi_slopes", "sinks",
                             "bias", "dense_mask", "tile_kinds",
                             "dropout_seed", "q_offsets") + _FP8),
    "all_gather": frozenset(("q_ids", "kv_ids", "alibi_slopes", "sinks",
                             "bias", "dense_mask", "tile_kinds",
                             "dropout_seed", "q_offsets") + _FP8),
    "ring": frozenset(("q_ids", "kv_ids", "sinks", "dropout_seed")),
    "ring_all_to_all": frozenset(),
}


def _refused(operands: Operands) -> dict:
  """{strategy: why it cannot run a call with `operands`}."""
  present = {f.name for f in dataclasses.fields(Operands)
             if getattr(operands, f.name) is not None}
  refused = {name: f"{name} runs no {sorted(present - allowed)}"
             for name, allowed in _STRATEGY_OPERANDS.items()
             if not present <= allowed}
  if "tile_kinds" in present and "dense_mask" not in present:
    refused.setdefault("all_gather", "all_gather runs no flex block mask "
                       "(its tile kinds cover the whole call's grid)")
  return refused


def _at_offsets(operands: Operands, offsets, q, k) -> Operands:
  """`operands` of a query chunk at `offsets` (all_gather's; added to the
  call's own query offsets): with a dense mask (its rows the chunk's), the
  tile kinds of those rows."""
  if operands.q_offsets is not None:
    offsets = offsets + operands.q_offsets
  operands = dataclasses.replace(operands, q_offsets=offsets)
  if operands.dense_mask is None:
    return operands
  return dataclasses.replace(operands, tile_kinds=dense_tile_kinds(
      operands.dense_mask, q.shape[1], k.shape[1]))


def _seed_index(tree):
  """The position among a call's arrays (q, k, v, then the operands'
  leaves) of dropout's seed words, or None."""
  numbered = jax.tree.unflatten(tree, range(tree.num_leaves))
  return None if numbered.dropout_seed is None else 3 + numbered.dropout_seed


_QKV = ("b t n h", "b s k h", "b s k v")
_FWD_OUT = ("b t n v", "b n t")
_BWD_IN = ("b n t", "b n t", "b t n v", "b n t")  # delta, lse, do, dlse


def _on_axis(lowerings, cfg, arrays, refit_why, refused):
  """Inside a shard_map whose axis `cfg.sequence_axis` holds the sequence
  in contiguous chunks (`arrays`: q, k, v chunks, then the rest as the
  per-device functions take them): `cfg.context_parallel`'s per-device
  function (ring or all_gather, `lowerings`), planned as `_plan` plans a
  call sharded along that axis."""
  axis = cfg.sequence_axis
  mesh = jax.sharding.get_abstract_mesh()
  p = lax.axis_size(axis)

  def whole(x):  # The call's array, sharded along the sequence.
    return jax.ShapeDtypeStruct(
        (x.shape[0], x.shape[1] * p, *x.shape[2:]), x.dtype,
        sharding=NamedSharding(mesh, P(None, axis, None, None)))
  split = _plan(mesh, [whole(x) for x in arrays[:3]], cfg, refit_why,
                refused)
  return lowerings[split.strategy](cfg, split, p)(*arrays)


def sharded_forward(forward, chunk_forward, ring_forward, refit_why):
  """forward(q, k, v, operands, cfg) -> (o, lse), split over batch, heads
  and the sequence. chunk_forward(q, k, v, operands, cfg): the same for
  queries at per-sequence offsets (`operands.q_offsets`); ring_forward(q,
  k, v, operands, seq, p, cfg): the ring over mesh axes `seq` of size p;
  refit_why(cfg, problem, dtype, offsets): why a part of the call (a
  chunk at offsets, a ring's pair) cannot run, or None."""
  def plain_chunk(q, k, v, offsets, cfg):
    return chunk_forward(q, k, v, Operands(q_offsets=offsets), cfg)

  def plain_ring(q, k, v, seq, p, cfg):
    return ring_forward(q, k, v, Operands(), seq, p, cfg)
  plain_lowerings = {
      "all_gather": _gather_lowering(plain_chunk, _QKV, _FWD_OUT),
      "ring": _ring_lowering(plain_ring, _QKV, _FWD_OUT)}
  plain = _define(
      lambda q, k, v, cfg: forward(q, k, v, Operands(), cfg), _FWD_RULE,
      plain_lowerings, refit_why, ())

  @functools.cache
  def operand_lowerings(tree, factors):
    def chunk(*args):
      q, k, v, *leaves, offsets, cfg = args
      operands = _at_offsets(jax.tree.unflatten(tree, leaves), offsets, q, k)
      return chunk_forward(q, k, v, operands, cfg)

    def ring(*args):
      q, k, v, *leaves, seq, p, cfg = args
      return ring_forward(q, k, v, jax.tree.unflatten(tree, leaves), seq, p,
                          cfg)
    in_factors = _QKV + factors
    return in_factors, {
        "all_gather": _gather_lowering(chunk, in_factors, _FWD_OUT),
        "ring": _ring_lowering(ring, in_factors, _FWD_OUT)}

  @functools.cache
  def with_operands(tree, factors, refused):
    def fn(*args):
      q, k, v, *leaves, cfg = args
      return forward(q, k, v, jax.tree.unflatten(tree, leaves), cfg)
    in_factors, lowerings = operand_lowerings(tree, factors)
    return _split_with_operands(
        fn, in_factors, _FWD_OUT, dict(refused), refit_why, lowerings,
        _seed_index(tree))

  def call(q, k, v, operands: Operands, cfg):
    if operands.empty:
      return plain(q, k, v, cfg)
    leaves, tree = jax.tree.flatten(operands)
    op = with_operands(tree, operand_factors(operands, q, k),
                       tuple(_refused(operands).items()))
    return op(q, k, v, *leaves, cfg)

  def on_axis(q, k, v, operands: Operands, cfg):
    """The same on sequence chunks inside a shard_map (`_on_axis`)."""
    if operands.empty:
      return _on_axis(plain_lowerings, cfg, (q, k, v), refit_why, {})
    leaves, tree = jax.tree.flatten(operands)
    _, lowerings = operand_lowerings(tree, operand_factors(operands, q, k))
    return _on_axis(lowerings, cfg, (q, k, v, *leaves), refit_why,
                    _refused(operands))
  call.on_axis = on_axis
  return call


def sharded_backward(backward, chunk_backward, ring_backward, refit_why):
  """backward(q, k, v, operands, delta, lse, do, dlse, cfg) -> (dq, dk, dv,
  the operands' gradients), likewise (delta: D = rowsum(dO * O) - dlse,
  [B, N, T]); chunk_backward(q, k, v, operands, delta, lse, do, dlse, cfg)
  the same at `operands.q_offsets`; ring_backward(q, k, v, operands,
  delta, lse, do, dlse, seq, p, cfg) the ring's."""
  def without_operands(q, k, v, delta, lse, do, dlse, cfg):
    return backward(q, k, v, Operands(), delta, lse, do, dlse, cfg)[:3]

  def plain_chunk(q, k, v, delta, lse, do, dlse, offsets, cfg):
    return chunk_backward(q, k, v, Operands(q_offsets=offsets), delta, lse, do,
                          dlse, cfg)[:3]

  def plain_ring(q, k, v, delta, lse, do, dlse, seq, p, cfg):
    return ring_backward(q, k, v, Operands(), delta, lse, do, dlse, seq, p,
                         cfg)[:3]
  plain_lowerings = {
      "all_gather": _gather_lowering(plain_chunk, _QKV + _BWD_IN, _QKV),
      "ring": _ring_lowering(plain_ring, _QKV + _BWD_IN, _QKV)}
  plain = _define(without_operands, _BWD_RULE, plain_lowerings, refit_why,
                  (1, 2))

  def chosen(grads, diff):
    flat = jax.tree.leaves(dataclasses.replace(grads, q_offsets=None))
    return tuple(flat[i] for i in diff)

  @functools.cache
  def operand_lowerings(tree, factors, diff):
    def chunk(*args):
      q, k, v, *leaves, delta, lse, do, dlse, offsets, cfg = args
      operands = _at_offsets(jax.tree.unflatten(tree, leaves), offsets, q, k)
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
        "all_gather": _gather_lowering(chunk, in_factors, out_factors),
        "ring": _ring_lowering(ring, in_factors, out_factors)}

  @functools.cache
  def with_operands(tree, factors, diff, refused):
    def fn(*args):
      q, k, v, *leaves, delta, lse, do, dlse, cfg = args
      dq, dk, dv, grads = backward(q, k, v, jax.tree.unflatten(tree, leaves),
                                   delta, lse, do, dlse, cfg)
      return (dq, dk, dv) + chosen(grads, diff)
    in_factors, out_factors, lowerings = operand_lowerings(tree, factors,
                                                           diff)
    return _split_with_operands(
        fn, in_factors, out_factors, dict(refused), refit_why, lowerings,
        _seed_index(tree))

  def with_grads(leaves, tree, diff, diff_grads):
    grads = [jnp.zeros_like(x) for x in leaves]
    for i, g in zip(diff, diff_grads):
      grads[i] = g
    return jax.tree.unflatten(tree, grads)

  def call(q, k, v, operands: Operands, delta, lse, do, dlse, cfg):
    if operands.empty:
      return (*plain(q, k, v, delta, lse, do, dlse, cfg), operands)
    leaves, tree = jax.tree.flatten(operands)
    diff = differentiable_leaves(tree)
    op = with_operands(tree, operand_factors(operands, q, k), diff,
                       tuple(_refused(operands).items()))
    dq, dk, dv, *diff_grads = op(q, k, v, *leaves, delta, lse, do, dlse, cfg)
    return dq, dk, dv, with_grads(leaves, tree, diff, diff_grads)

  def on_axis(q, k, v, operands: Operands, delta, lse, do, dlse, cfg):
    """The same on sequence chunks inside a shard_map (`_on_axis`)."""
    if operands.empty:
      return (*_on_axis(plain_lowerings, cfg, (q, k, v, delta, lse, do, dlse),
                        refit_why, {}), operands)
    leaves, tree = jax.tree.flatten(operands)
    diff = differentiable_leaves(tree)
    _, _, lowerings = operand_lowerings(
        tree, operand_factors(operands, q, k), diff)
    dq, dk, dv, *diff_grads = _on_axis(
        lowerings, cfg, (q, k, v, *leaves, delta, lse, do, dlse), refit_why,
        _refused(operands))
    return dq, dk, dv, with_grads(leaves, tree, diff, diff_grads)
  call.on_axis = on_axis
  return call
