"""The FlashAttention-1 forward (Dao et al. 2022, Algorithm 1), beside
FlashAttention-2's to compare the two: `flash_attention(..., version=1)`.

Not a backend: the dispatch plans the call as FlashAttention-2 on the
Triton kernels ("triton" on a GPU, "interpret" off one), and the attention
primitive's forward runs this kernel (`pallas_kernels.triton.flash_fwd_v1`)
in place of theirs; the backward is FlashAttention-2's, from the same
logsumexp.
"""
from __future__ import annotations

from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores

# The implementations that run it, and the one the dispatch plans for each.
IMPLEMENTATIONS = {"pallas": "triton", "triton": "triton",
                   "interpret": "interpret"}


def plan_implementation(implementation: str | None, on_gpu: bool) -> str:
  """The implementation the dispatch plans a version=1 call with;
  ValueError where it has no FlashAttention-1 forward."""
  if implementation is None and on_gpu:
    implementation = "triton"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"version=1 runs the FlashAttention-1 forward, a Triton kernel: on a "
        f"GPU (implementation None, 'pallas' or 'triton'), or "
        f"implementation='interpret' anywhere; got implementation="
        f"{implementation!r}{'' if on_gpu else ' off a GPU'}")
  return IMPLEMENTATIONS[implementation]


def unsupported(problem: Problem, scores: Scores) -> str | None:
  """Why the FlashAttention-1 forward cannot take the call, or None."""
  if scores.sinks:
    return "the FlashAttention-1 forward takes no sinks"
  if scores.fp8:
    return "the FlashAttention-1 forward takes no fp8 call"
  if problem.value_head_dim != problem.head_dim:
    return ("the FlashAttention-1 forward needs value's head dim equal to "
            "the query's")
  return None


def block_sizes(block_sizes, problem: Problem, dtype, *, is_causal: bool):
  """Its tiles: a `jax_flash.BlockSizes` (the Triton kernels'), or their
  FlashAttention-1 defaults, fitted to the lengths."""
  from pallas_kernels.triton.config import BlockSizes
  if not isinstance(block_sizes, BlockSizes):
    block_sizes = BlockSizes.get_default(problem.head_dim, dtype, is_causal,
                                         version=1)
  return block_sizes.clipped(problem.q_len, problem.kv_len)


def forward(q, k, v, operands: Operands, *, mask: Mask, scores: Scores,
            config, interpret: bool):
  """(o [B, T, N, H], lse [B, N, T] natural log), as a backend's forward."""
  from pallas_kernels.triton.flash_fwd_v1 import flash_forward_v1
  return flash_forward_v1(q, k, v, operands, scores=scores, mask=mask,
                          block_sizes=config, interpret=interpret)
