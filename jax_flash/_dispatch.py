"""One dispatch: which backend runs a call, for every entry point.

`flash_attention`, `flash_decode` and `ring_attention` describe their call
(the `Problem`, dtype, `Mask`, `Scores`) and ask `select` for a backend. A
backend is an object with:

    name, needs_gpu, config_type
    unsupported(problem, dtype, *, mask, scores, version, decode)
        -> str | None (why it cannot take the call; decode: False, or a
        `flash_decode` call's cache, "contiguous" or "paged")
    config(block_sizes, problem, dtype, *, is_causal, version, scores)
        -> config (scores: optional, `Scores`, for tiles that depend on them)
    forward(q, k, v, operands, *, mask, scores, config, version)
        -> (o [B, T, N, H], lse [B, N, T])
    backward(q, k, v, operands, o, lse, do, dlse, *, mask, scores, config)
        -> (dq, dk, dv, Operands of the differentiable operands' gradients:
            bias, score_consts; None where not computed)
    decode(q, k, v, kv_lengths, *, mask, scores, num_splits, page_table,
           sinks) -> (o [B, T, N, H], lse [B, N, T])
    backward_by(operands) -> str | None (optional: the backend whose
        backward runs after this one's forward, from the same logsumexp,
        when it is the better one; None: its own)

with lse the natural-log logsumexp, float32, everywhere. Backends:
"mosaic" (Pallas Mosaic GPU kernels, forward and backward; Hopper GPUs),
"triton" (Pallas kernels lowered through Triton; any CUDA GPU), "interpret"
(the Triton kernels run by the Pallas interpreter; any machine) and "xla"
(`blockwise`: FlashAttention in plain jnp; any device, any input). "pallas" names the best Pallas backend
for the device that takes the call (`PALLAS`, best first).
`implementation=None` picks "pallas" when the query lives on a GPU and a
Pallas backend takes the call, else "xla".
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from jax_flash import blockwise
from jax_flash.spec.checks import Problem
from jax_flash.spec.mask import Mask
from jax_flash.spec.problem import decode_as_forward
from jax_flash.spec.scores import Scores

IMPLEMENTATIONS = ("pallas", "mosaic", "triton", "interpret", "xla")
VERSIONS = (1, 2)


@dataclasses.dataclass(frozen=True)
class XlaBackend:
  """Blockwise FlashAttention in plain jnp (`blockwise`): any device, any
  input, memory linear in the sequence length (decoding too: queries offset
  to the end of each cache)."""
  name = "xla"
  needs_gpu = False
  config_type = blockwise.BlockSizes

  def unsupported(self, problem, dtype, *, mask, scores, version=2,
                  decode=False):
    return None

  def config(self, block_sizes, problem, dtype, *, is_causal, version=2,
             scores=None, mask=None):
    if isinstance(block_sizes, blockwise.BlockSizes):
      return block_sizes
    return blockwise.BlockSizes()

  def forward(self, q, k, v, operands, *, mask, scores, config, version=2):
    return blockwise.forward(q, k, v, operands, mask=mask, scores=scores,
                             config=config)

  def backward(self, q, k, v, operands, o, lse, do, dlse, *, mask, scores,
               config):
    return blockwise.backward(q, k, v, operands, o, lse, do, dlse, mask=mask,
                              scores=scores, config=config)

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
def backends() -> dict:
  """The backends by implementation name. (Imported on first use: the
  kernel packages import `jax_flash.spec`, so importing one of them first
  must not need this module.)"""
  from pallas_kernels import mosaic_gpu, triton
  return {"mosaic": mosaic_gpu.MosaicGpuBackend(),
          "triton": triton.TRITON, "interpret": triton.INTERPRET, "xla": XLA}


def _triton_backward(q, k, v, operands, o, lse, do, dlse, *, mask: Mask,
                     scores: Scores):
  """The Triton backend's backward at its default tiles."""
  triton = backends()["triton"]
  blocks = triton.config_type.get_default(
      q.shape[-1], q.dtype, mask.is_causal).clipped(q.shape[1], k.shape[1])
  return triton.backward(q, k, v, operands, o, lse, do, dlse, mask=mask,
                         scores=scores, config=blocks)


def backward(backend, q, k, v, operands, o, lse, do, dlse, *, mask: Mask,
             scores: Scores, config):
  """(dq, dk, dv, operands' gradients) of a call that `backend` ran
  forward: its own backward, or the one its `backward_by` names (only
  "triton" so far), at that backend's default tiles."""
  by = getattr(backend, "backward_by", lambda operands: None)(operands)
  if by == "triton":
    return _triton_backward(q, k, v, operands, o, lse, do, dlse, mask=mask,
                            scores=scores)
  if by is not None:
    raise NotImplementedError(f"a backward by {by!r} after {backend.name!r}")
  return backend.backward(q, k, v, operands, o, lse, do, dlse, mask=mask,
                          scores=scores, config=config)


def missing_gradients(q, k, v, operands, o, lse, do, dlse, grads, *,
                      mask: Mask, scores: Scores):
  """`grads` (a backend's operand gradients, `Operands`) with those it
  leaves out (None) computed by a backend that gives them: a bias's by the
  Triton backend's dbias kernel (the Mosaic kernels read a bias but give no
  gradient), a score_mod's arrays' by the blockwise loops (the kernels read
  them element by element). Same inputs and residuals; XLA drops the rest
  of that backward (unused), and all of it when nothing uses the gradient."""
  changes = {}
  if operands.bias is not None and grads.bias is None:
    changes["bias"] = _triton_backward(q, k, v, operands, o, lse, do, dlse,
                                       mask=mask, scores=scores)[3].bias
  if operands.score_consts and grads.score_consts is None:
    changes["score_consts"] = XLA.backward(
        q, k, v, operands, o, lse, do, dlse, mask=mask, scores=scores,
        config=blockwise.BlockSizes())[3].score_consts
  return dataclasses.replace(grads, **changes)


# The Pallas backends for a GPU, best first: on an H100/H200 the Mosaic GPU
# forward measured 1.15-1.52x the Triton one at 8k (every head dim, causal
# and not; benchmarks/results/2026-11-30-h200-session3/mosaic_8k.md), its
# backward 1.2-2.6x (results/2026-11-30-h200-session4/).
PALLAS = ("mosaic", "triton")
# Backends that need a Hopper (sm90) GPU.
HOPPER_ONLY = ("mosaic",)


def on_gpu(x) -> bool:
  """Whether `x` lives on a GPU (a tracer: where the computation runs)."""
  try:
    return any(d.platform == "gpu" for d in x.devices())
  except Exception:
    return gpu_target()


def gpu_target() -> bool:
  """A GPU to run on, or one to compile for (an abstract mesh's device)."""
  if jax.default_backend() == "gpu":
    return True
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform == "gpu"


def hopper_target() -> bool:
  """An sm90 GPU (H100/H200) to run on, or one to compile for."""
  if jax.default_backend() == "gpu":
    return all(getattr(d, "compute_capability", "") == "9.0"
               for d in jax.local_devices())
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform == "gpu" and any(
      name in device.device_kind for name in ("H100", "H200", "H800"))


def check_options(block_sizes, version) -> None:
  """`block_sizes` and `version`, checked for every implementation."""
  types = tuple({b.config_type for b in backends().values()} - {type(None)})
  if block_sizes is not None and not isinstance(block_sizes, types):
    raise ValueError(
        f"block_sizes must be a jax_flash.BlockSizes, "
        f"jax_flash.MosaicBlockSizes, jax_flash.XlaBlockSizes or None, got "
        f"{type(block_sizes).__name__}")
  if version not in VERSIONS:
    raise ValueError(f"version must be 1 or 2, got {version!r}")


def select(implementation, query, problem: Problem, dtype, *, mask: Mask,
           scores: Scores, version: int = 2, decode: bool = False):
  """The backend that runs this call; ValueError if the one named cannot."""
  def reason(name):
    """Why backend `name` cannot take the call (None if it can)."""
    if name in HOPPER_ONLY and not hopper_target():
      return f"implementation {name!r} needs a Hopper GPU (H100/H200)"
    backend = backends()[name]
    return backend.unsupported(problem, dtype, mask=mask, scores=scores,
                               version=version, decode=decode)

  if implementation is None:
    if on_gpu(query):
      for name in PALLAS:
        if reason(name) is None:
          return backends()[name]
    return XLA
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                     f"None, got {implementation!r}")
  names = PALLAS if implementation == "pallas" else (implementation,)
  if backends()[names[-1]].needs_gpu and not gpu_target():
    raise ValueError(
        f"implementation={implementation!r} runs the GPU kernels and needs a "
        "GPU; on this machine use implementation='interpret' (the same "
        "kernels, interpreted) or 'xla'")
  reasons = []
  for name in names:
    why = reason(name)
    if why is None:
      return backends()[name]
    reasons.append(why)
  raise ValueError("; ".join(reasons) + "; implementation='xla' takes any "
                   "input")
