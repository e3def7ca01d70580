"""How a sharded call splits: its batch and heads as the query is sharded,
its sequence by one of the strategies (`STRATEGIES`), chosen by the bytes
a device sends (`cost`) among those that can run the call and hold no
more than `MEMORY_SLACK` times the least a device holds (`held`; `plan`;
the optional arrays each strategy takes: `STRATEGY_OPERANDS`)."""
from __future__ import annotations

import dataclasses
import math
import warnings

from jax.sharding import PartitionSpec as P

from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.options import STRATEGIES
from jax_flash.core.problem import Problem


def axis_names(axes):
  return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def axes_size(mesh, axes) -> int:
  size = 1
  for name in axis_names(axes):
    size *= mesh.shape[name]
  return size


def _spec(sharding, dim):
  spec = getattr(sharding, "spec", P())
  return spec[dim] if len(spec) > dim else None


@dataclasses.dataclass(frozen=True)
class Split:
  """How one call is split: mesh axes of the batch, the heads and the
  sequence (None: not split), whether the keys are split along the
  sequence too, the strategy of a split sequence, and whether its queries
  are exchanged into balanced halves (all_gather, causal), and the copies
  of each KV head an all-to-all sends (`kv_repeats`)."""
  batch: object = None
  heads: object = None
  seq: object = None
  kv_seq: bool = False
  strategy: str | None = None
  balanced: bool = False
  kv_repeats: int = 1


def kv_repeats(heads: int, kv_heads: int, p: int) -> int | None:
  """The copies of each of `kv_heads` KV heads an all-to-all over p devices
  sends so that every device gets whole groups of the `heads` query heads
  (lcm(K, P) / K: the copies of a KV head go to the devices of its query
  heads), or None where the query heads do not split so."""
  repeats = math.lcm(kv_heads, p) // kv_heads
  return repeats if heads % (kv_heads * repeats) == 0 else None


def cost(strategy: str, *, p: int, q_rows: int, kv_rows: int, heads: int,
         kv_heads: int, head_dims: int, kv_seq: bool, balanced: bool,
         inner: int = 1, repeats: int = 1) -> int:
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
  others. `repeats`: the copies of each KV head an all-to-all sends
  (`kv_repeats`)."""
  q, kv = q_rows * heads * head_dims, kv_rows * kv_heads * head_dims
  if strategy in ("all_to_all", "ring_all_to_all"):
    kv *= repeats
  if strategy == "all_to_all":
    return (q + kv) * (p - 1) // p
  if strategy == "ring_all_to_all":
    return ((q + kv) * (inner - 1) // inner + kv * (p // inner - 1)
            + (q + kv if balanced else 0))
  if strategy == "ring":  # As all_gather, and keys into the zigzag too.
    return kv * (p - 1) + (q + kv if balanced else 0)
  return (kv * (p - 1) if kv_seq else 0) + (q if balanced else 0)


# "auto" picks the strategy that sends the least among those whose arrays a
# device holds (`held`) are within this factor of the least any holds.
MEMORY_SLACK = 2


def held(strategy: str, *, p: int, q_rows: int, kv_rows: int, heads: int,
         kv_heads: int, head_dims: int, kv_seq: bool, inner: int = 1,
         repeats: int = 1, **_) -> int:
  """Elements of Q, K, V and O a device holds at once as a strategy runs
  (`cost`'s arguments): all_to_all its chunk's worth, each KV head as
  `repeats` copies; all_gather the whole K and V; ring its queries and
  two chunks of keys (the next arriving); ring_all_to_all as ring, its
  blocks each KV head's copies."""
  q, kv = q_rows * heads * head_dims, kv_rows * kv_heads * head_dims
  if strategy == "all_to_all":
    return q + kv * repeats
  if strategy == "all_gather":
    return q + kv * (p if kv_seq else 1)
  return q + 2 * kv * (repeats if strategy == "ring_all_to_all" else 1)


def plan(mesh, arg_shapes, cfg, refit_why, refused,
         fallback=False) -> Split:
  """The split of a call whose first three arguments are q, k, v: batch
  and heads as the query is sharded (heads where whole GQA groups fit a
  device), the sequence where the keys are sharded alike or not at all,
  by the strategy `cfg.context_parallel` names (or the cheapest);
  `refused`: {strategy: why it cannot run} whatever the sharding
  (`refused_by`). A named
  strategy that cannot run the sharding is a ValueError, or with
  `fallback` (in XLA's partitioner, where an error reaches the user as
  INTERNAL) a warning and the cheapest that can."""
  q, k, v = arg_shapes[:3]
  batch, heads, seq = (_spec(q.sharding, d) for d in (0, 2, 1))
  num_kv_heads = k.shape[2]
  if heads is not None and num_kv_heads % axes_size(mesh, heads):
    heads = None  # Whole GQA groups per device, or no head sharding.
  k_seq = _spec(k.sharding, 1)
  p = axes_size(mesh, seq)
  if (seq is None or p == 1 or k_seq not in (None, seq)
      or _spec(v.sharding, 1) != k_seq
      or set(axis_names(seq)) & set(axis_names(batch) + axis_names(heads))):
    return Split(batch, heads)
  kv_seq = k_seq is not None
  hs = axes_size(mesh, heads)
  local = dict(p=p, q_rows=q.shape[1] // p,
               kv_rows=k.shape[1] // p if kv_seq else k.shape[1],
               heads=q.shape[2] // hs, kv_heads=num_kv_heads // hs,
               head_dims=q.shape[3] + v.shape[3], kv_seq=kv_seq)
  left, right = cfg.mask.band()
  windowed = left is not None and right == 0  # Causal sliding windows.
  balanced = cfg.mask.is_causal and local["q_rows"] % 2 == 0
  why = dict(refused)
  repeats = {"all_to_all": kv_repeats(local["heads"], local["kv_heads"], p)}
  if not kv_seq:
    why["all_to_all"] = "the keys are not sharded like the queries"
  elif repeats["all_to_all"] is None:
    why["all_to_all"] = (
        f"the {local['heads']} query heads a device holds do not split into "
        f"whole groups of its {local['kv_heads']} KV heads over the {p} "
        f"devices of the sequence")
  chunk = Problem(batch=q.shape[0] // axes_size(mesh, batch),
                  q_len=local["q_rows"] // (2 if balanced else 1),
                  kv_len=k.shape[1], num_heads=local["heads"],
                  num_kv_heads=local["kv_heads"], head_dim=q.shape[3],
                  unbatched=False, value_head_dim=v.shape[3])
  offsets_why = "all_gather" not in why and refit_why(cfg, chunk, q.dtype,
                                                     True)
  if offsets_why:
    why["all_gather"] = offsets_why

  def ring_why(r: int, a: int, copies: int = 1):
    """Why a ring over r devices cannot run, its blocks a chunks of the
    sequence and 1 / a of the heads (`copies` of each KV head), or None."""
    if not kv_seq:  # (Its masks and lengths: `refused_by`.)
      return "ring runs self-attention with keys sharded as queries"
    if cfg.mask.is_causal and not balanced and not windowed:
      return "a causal ring needs chunks of an even length"
    rows = q.shape[1] // r // (2 if balanced and not windowed else 1)
    pair = dataclasses.replace(chunk, q_len=rows, kv_len=rows,
                               num_heads=local["heads"] // a,
                               num_kv_heads=local["kv_heads"] * copies // a)
    return (refit_why(cfg, pair, q.dtype, False)
            or ((windowed or cfg.scores.alibi)
                and refit_why(cfg, pair, q.dtype, True)) or None)

  axes = axis_names(seq)
  local["inner"] = mesh.shape[axes[-1]] if len(axes) > 1 else 1
  if "ring" not in why and (reason := ring_why(p, 1)):
    why["ring"] = reason
  if "ring_all_to_all" in why:  # Refused beforehand.
    pass
  elif len(axes) < 2:
    why["ring_all_to_all"] = (
        "ring_all_to_all needs the sequence sharded over several mesh "
        "axes: a ring over the first, all_to_all over the last")
  elif (inner := kv_repeats(local["heads"], local["kv_heads"],
                            local["inner"])) is None:
    why["ring_all_to_all"] = (
        f"the {local['heads']} query heads a device holds do not split into "
        f"whole groups of its {local['kv_heads']} KV heads over the "
        f"{local['inner']} devices of {axes[-1]!r}")
  elif reason := ring_why(p // local["inner"], local["inner"], inner):
    why["ring_all_to_all"] = reason
  else:
    repeats["ring_all_to_all"] = inner
  can = {s: dict(local, repeats=repeats.get(s) or 1)
         for s in STRATEGIES[1:] if s not in why}
  memory = {s: held(s, **shape) for s, shape in can.items()}
  costs = {s: cost(s, balanced=balanced, **shape)
           for s, shape in can.items()
           if memory[s] <= MEMORY_SLACK * min(memory.values())}
  want = cfg.context_parallel
  cheapest = min(costs, key=costs.get) if costs else None
  if want in why:
    if not fallback:
      raise ValueError(f"context_parallel={want!r} cannot run this call: "
                       f"{why[want]}")
    warnings.warn(
        f"context_parallel={want!r} cannot run this call as it is sharded: "
        f"{why[want]}; running "
        f"{repr(cheapest) if cheapest else 'it unsplit'} instead",
        stacklevel=2)
  if want == "auto" or want in why:
    if cheapest is None:  # Nothing fits: XLA gathers the sequence.
      return Split(batch, heads)
    want = cheapest
  return Split(batch, heads, seq, kv_seq, want,
               balanced and want != "all_to_all"
               and not (windowed and want.startswith("ring")),
               repeats.get(want) or 1)


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
# `refused_by`). ring: key ids travel with the keys, sinks join the merge,
# dropout draws each pair's bits at its place, ALiBi runs each pair at its
# queries' offset from its keys (`ring._pair_extras`). ring_all_to_all:
# the ring's, moved as all_to_all moves them over its inner axis (dropout's
# seed shifted to the device's heads there: `partition._placed`). FP8's
# e4m3 arrays and scales (`_FP8`) move as q, k, v and the per-head arrays
# do in all_to_all and all_gather; a ring's pairs would not get them.
_FP8 = ("fp8_q", "fp8_k", "fp8_v", "fp8_scales")


STRATEGY_OPERANDS = {
    "all_to_all": frozenset(("q_ids", "kv_ids", "alibi_slopes", "sinks",
                             "bias", "dense_mask", "tile_kinds",
                             "dropout_seed", "q_offsets") + _FP8),
    "all_gather": frozenset(("q_ids", "kv_ids", "alibi_slopes", "sinks",
                             "bias", "dense_mask", "tile_kinds",
                             "dropout_seed", "q_offsets") + _FP8),
    "ring": frozenset(("q_ids", "kv_ids", "sinks", "dropout_seed",
                       "alibi_slopes")),
    "ring_all_to_all": frozenset(("q_ids", "kv_ids", "sinks", "dropout_seed",
                                  "alibi_slopes")),
}


# The argument of `flash_attention` (or `flex_attention`) each operand
# comes from, as a refusal names it.
_ARGUMENT = dict(q_ids="segment_ids or lengths",
                 kv_ids="segment_ids or lengths", dense_mask="mask",
                 bias="bias", alibi_slopes="alibi_slopes",
                 dropout_seed="dropout_rate", sinks="sinks",
                 q_offsets="query offsets", tile_kinds="block_mask",
                 **dict.fromkeys(_FP8, "fp8"))


def _arguments(operands) -> str:
  """The arguments `operands` (names of `Operands` fields) come from (a
  dense mask's tile kinds are its own)."""
  if "dense_mask" in operands:
    operands = set(operands) - {"tile_kinds"}
  return ", ".join(sorted({_ARGUMENT[name] for name in operands}))


def ring_mask_why(mask: Mask, q_len: int, kv_len: int) -> str | None:
  """Why no ring (nor ring_all_to_all) can run a call with `mask` and
  these lengths, whatever its sharding, or None."""
  if q_len != kv_len:
    return "ring runs self-attention (T = S) with keys sharded as queries"
  left, right = mask.band()
  windowed = left is not None and right == 0
  causal = mask.is_causal or windowed
  bare = dataclasses.replace(mask, is_causal=causal, window_left=None,
                             window_right=None)
  if bare not in (Mask(is_causal=causal),
                  Mask(is_causal=causal, has_ids=True, segments_only=True),
                  Mask(is_causal=causal, has_ids=True)) or (
                      (mask.window_left, mask.window_right) != (None, None)
                      and not windowed):  # (has_ids: lengths too.)
    return ("ring runs causal or full masks and causal sliding windows, "
            "alone or with segment ids and lengths")
  return None


def refused_by(operands: Operands, mask: Mask, q_len: int,
               kv_len: int) -> dict:
  """{strategy: why it cannot run a call with `operands`, `mask` and these
  query and key lengths}, whatever the call's sharding."""
  present = {f.name for f in dataclasses.fields(Operands)
             if getattr(operands, f.name) is not None}
  refused = {name: f"{name} runs no {_arguments(present - allowed)}"
             for name, allowed in STRATEGY_OPERANDS.items()
             if not present <= allowed}
  if "tile_kinds" in present and "dense_mask" not in present:
    refused.setdefault("all_gather", "all_gather runs no flex block_mask "
                       "(its tile kinds cover the whole call's grid)")
  if reason := ring_mask_why(mask, q_len, kv_len):
    for name in ("ring", "ring_all_to_all"):
      refused.setdefault(name, reason)
  return refused


def check_named(want: str, refused: dict) -> None:
  """A ValueError where the strategy named, `want`, is in `refused`
  (`refused_by`), saying which strategies could run the call."""
  if want in refused:
    others = [repr(s) for s in STRATEGIES[1:] if s not in refused]
    raise ValueError(
        f"context_parallel={want!r} cannot run this call: {refused[want]}. "
        f"Strategies that can: {', '.join(others)} ('auto' picks the "
        f"cheapest of them)")
