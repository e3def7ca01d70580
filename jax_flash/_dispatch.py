"""One dispatch: which backends run a call, for every entry point.

`flash_attention`, `flex_attention`, `flash_decode` and `ring_attention`
describe their call (the `Problem`, dtype, `Mask`, `Scores`, `Operands`) and
ask `select` for a `Plan`: the backend of the forward (or of the decode),
the backend of the backward, and, for a differentiable operand whose
gradient that backward leaves out, a backend that gives it. Backends
implement `jax_flash.core.backend.Backend`; `backends()` is the registry by
implementation name, `PALLAS` the Pallas backends for a GPU, best first,
and `NEXT_IS_FASTER` the one table of where a later one is measured
faster. Each backend says why it refuses a call, and the next is asked.

`implementation=None` picks "pallas" when the query lives on a GPU and a
Pallas backend takes the call, else "xla"; "pallas" is the first of
`PALLAS` that takes it, passing over one whose forward `NEXT_IS_FASTER`
passes over for a later one that takes it too; any other name is that
backend alone, and a `ValueError` says why when it cannot. The backward's
backend is the forward's unless it declines (`backward_unsupported`) or,
for None and "pallas", `NEXT_IS_FASTER` prefers the next Pallas
backend's.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from jax_flash import blockwise
from jax_flash.core import device
from jax_flash.core import fp8 as fp8_lib
from jax_flash.core.backend import Backend, Copies, Decode
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.options import IMPLEMENTATIONS
from jax_flash.core.prepare import decode_as_forward
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores

# The Pallas backends for a GPU, best first (the Mosaic GPU kernels only
# take calls on Hopper).
PALLAS = ("mosaic", "triton")
# Operands a backward may differentiate (a sink's gradient comes from the
# logsumexp, whatever the backend: `_primitive`).
GRADIENT_OPERANDS = ("bias", "score_consts")


@dataclasses.dataclass(frozen=True)
class XlaBackend:
  """Blockwise FlashAttention in plain jnp (`blockwise`): any device, any
  input, memory linear in the sequence length (decoding too: queries offset
  to the end of each cache)."""
  name = "xla"
  needs_gpu = False
  config_type = blockwise.BlockSizes
  operand_gradients = frozenset(GRADIENT_OPERANDS)

  def unsupported(self, problem, dtype, *, mask, scores, decode=False):
    return None

  def copies(self, problem, dtype, *, mask):
    return Copies()

  def backward_unsupported(self, problem, dtype, *, mask, scores, operands):
    return None

  def config(self, block_sizes, problem, dtype, *, is_causal, scores=None,
             mask=None):
    if isinstance(block_sizes, blockwise.BlockSizes):
      return block_sizes
    return blockwise.BlockSizes()

  def forward(self, q, k, v, operands, *, mask, scores, config):
    return blockwise.forward(q, k, v, operands, mask=mask, scores=scores,
                             config=config)

  def backward(self, q, k, v, operands, delta, lse, do, dlse, *, mask,
               scores, config):
    return blockwise.backward(q, k, v, operands, delta, lse, do, dlse,
                              mask=mask, scores=scores, config=config)

  def decode(self, q, k, v, kv_lengths, *, mask, scores, num_splits=None,
             page_table=None, sinks=None):
    del num_splits  # A kernel's launch choice.
    # Keys past a length may hold anything: blockwise zeroes them.
    k, v, mask, operands, _ = decode_as_forward(q, k, v, kv_lengths, mask,
                                                page_table, sinks)
    return blockwise.forward(q, k, v, operands, mask=mask, scores=scores,
                             config=blockwise.BlockSizes())


XLA = XlaBackend()


@functools.cache
def backends() -> dict[str, Backend]:
  """The backends by implementation name: their `backend` modules, which
  import no kernel (a backend imports its kernels at its first launch)."""
  from pallas_kernels.mosaic_gpu.backend import MosaicGpuBackend
  from pallas_kernels.triton.backend import INTERPRET, TRITON
  return {"mosaic": MosaicGpuBackend(fp8_rounding=_rounding_kernels),
          "triton": TRITON, "interpret": INTERPRET, "xla": XLA}


def _rounding_kernels() -> fp8_lib.Rounding:
  """The e4m3 rounding kernels (`pallas_kernels.triton.fp8_round`:
  Triton-lowered, for any Hopper call)."""
  from pallas_kernels.triton import fp8_round
  return fp8_round.ROUNDING


# Where the next Pallas backend runs a part of a call measured faster
# than `backend`, which takes it (on an H200, the defaults' tiles): rows
# of (backend, "forward" or "backward", the most keys, only where XLA
# copies arrays around `backend`'s kernels: `Backend.copies`). Mosaic's
# forward and backward at 77-320 keys where XLA copies or pads arrays
# around them (CLIP, text cross-attention, ViT, DiT: the copies cost as
# much as the kernels), and its backward up to 128 keys anyway (a dK/dV
# CTA's 128 key rows would hold them all; Triton's smaller tiles waste
# fewer): docs/performance.md, "Where a call's time goes".
NEXT_IS_FASTER = (
    ("mosaic", "forward", 320, True),
    ("mosaic", "backward", 320, True),
    ("mosaic", "backward", 128, False),
)


def _next_is_faster(backend: Backend, direction: str, problem: Problem,
                    dtype, mask: Mask) -> bool:
  """Whether `NEXT_IS_FASTER` prefers the next Pallas backend to `backend`
  for `direction` of this call."""
  rules = [r for r in NEXT_IS_FASTER if r[:2] == (backend.name, direction)
           and problem.kv_len <= r[2]]
  if not rules:
    return False
  copies = backend.copies(problem, dtype, mask=mask)
  return any(not needs_copies or getattr(copies, direction)
             for _, _, _, needs_copies in rules)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The backends of one call (hashable: part of the primitive's
  parameters). `gradients`: (operand field, backend) for each
  differentiable operand present whose gradient `backward` leaves out."""
  forward: Backend
  backward: Backend
  gradients: tuple[tuple[str, Backend], ...] = ()


@dataclasses.dataclass(frozen=True)
class Configs:
  """The block sizes of a `Plan`'s backends, in its order."""
  forward: object
  backward: object
  gradients: tuple = ()


def configure(plan: Plan, block_sizes, problem: Problem, dtype, *,
              is_causal: bool, scores: Scores, mask: Mask) -> Configs:
  """Each backend's block sizes: `block_sizes` for the backend whose type it
  is, the defaults for the others."""
  def one(backend):
    own = block_sizes if isinstance(block_sizes, backend.config_type) else None
    return backend.config(own, problem, dtype, is_causal=is_causal,
                          scores=scores, mask=mask)
  return Configs(forward=one(plan.forward), backward=one(plan.backward),
                 gradients=tuple(one(b) for _, b in plan.gradients))


def backward(plan: Plan, configs: Configs, q, k, v, operands: Operands,
             delta, lse, do, dlse, *, mask: Mask, scores: Scores):
  """(dq, dk, dv, operand gradients) of a call `plan` ran forward: the
  backward backend's, with each gradient it leaves out from the backend
  `plan.gradients` names (the same inputs and residuals; XLA drops the
  rest of that backward, unused)."""
  dq, dk, dv, grads = plan.backward.backward(
      q, k, v, operands, delta, lse, do, dlse, mask=mask, scores=scores,
      config=configs.backward)
  changes = {}
  for (name, backend), config in zip(plan.gradients, configs.gradients):
    changes[name] = getattr(backend.backward(
        q, k, v, operands, delta, lse, do, dlse, mask=mask, scores=scores,
        config=config)[3], name)
  return dq, dk, dv, dataclasses.replace(grads, **changes)


def check_block_sizes(block_sizes) -> None:
  """`block_sizes`: one backend's type, or None."""
  types = tuple({b.config_type for b in backends().values()})
  if block_sizes is not None and not isinstance(block_sizes, types):
    raise ValueError(
        f"block_sizes must be a jax_flash.BlockSizes, "
        f"jax_flash.MosaicBlockSizes, jax_flash.XlaBlockSizes or None, got "
        f"{type(block_sizes).__name__}")


def select(implementation, query, problem: Problem, dtype, *, mask: Mask,
           scores: Scores, operands: Operands | None = None,
           decode: Decode = False) -> Plan:
  """The backends of this call; ValueError if the one named cannot take it.

  The forward's backend as the module docstring says; the backward's is the
  forward's own unless it declines (`backward_unsupported`) or, for None
  and "pallas", `NEXT_IS_FASTER` prefers the next Pallas backend that
  takes the call (after a Pallas forward), then "xla".
  """
  operands = Operands() if operands is None else operands

  def reason(backend):
    return backend.unsupported(problem, dtype, mask=mask, scores=scores,
                               decode=decode)

  def best(candidates, reasons):
    """The first of `candidates` that takes the call (its `reasons` entry
    None) and not passed over for a later one (`NEXT_IS_FASTER`), else the
    first that takes it, else None."""
    takes = [b for b, why in zip(candidates, reasons) if why is None]
    fast = [b for b in takes if decode or b == takes[-1] or
            not _next_is_faster(b, "forward", problem, dtype, mask)]
    return (fast or takes or [None])[0]

  if implementation is None:
    candidates = [backends()[n] for n in PALLAS] if device.on_gpu(query) else []
    forward = best(candidates, [reason(b) for b in candidates]) or XLA
  else:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                       f"None, got {implementation!r}")
    names = PALLAS if implementation == "pallas" else (implementation,)
    if backends()[names[-1]].needs_gpu and not device.gpu_target():
      raise ValueError(
          f"implementation={implementation!r} runs the GPU kernels and needs "
          "a GPU; on this machine use implementation='interpret' (the same "
          "kernels, interpreted) or 'xla'")
    reasons = {n: reason(backends()[n]) for n in names}
    forward = best([backends()[n] for n in names], list(reasons.values()))
    if forward is None:
      raise ValueError("; ".join(reasons.values()) + "; implementation='xla' "
                       "takes any input")
  if decode:
    return Plan(forward=forward, backward=forward)
  # Backwards to ask, best first: the forward's own, the Pallas backends
  # after a Pallas forward, then the blockwise one (which takes anything).
  fallbacks = [backends()[n] for n in PALLAS] if forward.name in PALLAS else []
  candidates = [forward] + [b for b in fallbacks + [XLA] if b != forward]
  takes = [b for b in candidates if b == forward or reason(b) is None]
  backwards = [b for b in takes if b == XLA or b.backward_unsupported(
      problem, dtype, mask=mask, scores=scores, operands=operands) is None]
  backward = backwards[0]
  faster = next((b for b in backwards[1:] if b != XLA), None)
  if implementation in (None, "pallas") and faster and _next_is_faster(
      backward, "backward", problem, dtype, mask):
    backward = faster  # Measured faster; a named backend runs anyway.
  gradients = []
  for name in GRADIENT_OPERANDS:
    if jax.tree.leaves(getattr(operands, name)) and (
        name not in backward.operand_gradients):
      gradients.append((name, next(b for b in takes[takes.index(backward):]
                                   if name in b.operand_gradients)))
  return Plan(forward=forward, backward=backward, gradients=tuple(gradients))


def fp8_rounding(implementation, query):
  """Who rounds an fp8=True call's inputs to e4m3 (`fp8.Rounding`, the
  same values either way): the Triton kernels
  (`pallas_kernels.triton.fp8_round`) where the call may run Pallas
  kernels on a Hopper GPU (implementation other than "xla"), else XLA's
  ops; XLA's too where the call's arrays may be split over several
  devices outside `shard_map` (XLA partitions its own ops, not a
  kernel)."""
  mesh = jax.sharding.get_abstract_mesh()
  local = jax.device_count() == 1 or (not mesh.empty
                                      and mesh.are_all_axes_manual)
  if (implementation != "xla" and local and device.on_gpu(query)
      and device.hopper_target()):
    return _rounding_kernels()
  return fp8_lib.XLA
