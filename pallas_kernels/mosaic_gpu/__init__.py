"""The Mosaic GPU backend: Pallas kernels for Hopper (sm90a) with TMA, wgmma
and warp specialization.

A forward kernel (`flash_fwd`) and a backward of two kernels (`flash_bwd`:
dK/dV and dQ). What it takes is narrower than the Triton backend
(`unsupported` says what, and the dispatch then runs Triton): bf16/fp16,
head dims 64/128/256, any lengths (XLA pads them to the tiles; the kernels
mask keys past the length), causal masks and sliding windows (the band of
the shared mask description) but no lengths, segments or dense masks, no
score modification, no dropout.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_flash.spec.checks import Problem
from jax_flash.spec.mask import Mask
from jax_flash.spec.operands import Operands
from jax_flash.spec.scores import Scores
from pallas_kernels.mosaic_gpu import config
from pallas_kernels.mosaic_gpu.config import BlockSizes
from pallas_kernels.mosaic_gpu.flash_bwd import flash_backward
from pallas_kernels.mosaic_gpu.flash_fwd import flash_forward


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend:
  """The backend interface of `jax_flash._dispatch`."""
  name = "mosaic"
  needs_gpu = True
  config_type = BlockSizes

  def unsupported(self, problem: Problem, dtype, *, mask: Mask,
                  scores: Scores, version: int = 2,
                  decode: bool = False) -> str | None:
    """Why the Mosaic GPU kernels cannot take the call, or None."""
    if decode:
      return "the Mosaic GPU backend has no decode kernel yet"
    if version != 2:
      return "the Mosaic GPU backend runs only the FlashAttention-2 forward"
    if jnp.dtype(dtype).name not in config.DTYPES:
      return (f"query dtype must be bfloat16 or float16 for the Mosaic GPU "
              f"kernels, got {jnp.dtype(dtype)}")
    if problem.value_head_dim != problem.head_dim:
      return "the Mosaic GPU kernels need value's head dim equal to the query's"
    if problem.head_dim not in config.HEAD_DIMS:
      return (f"head_dim must be one of {config.HEAD_DIMS} for the Mosaic GPU "
              f"kernels, got {problem.head_dim}")
    if (mask.has_ids or mask.has_dense or mask.has_q_offsets or
        mask.mod is not None):
      return ("the Mosaic GPU kernels take causal masks and windows only "
              "(no lengths, segments, dense masks or mask_mods yet)")
    if not scores.plain or scores.dropout or scores.sinks:
      return ("the Mosaic GPU kernels take no bias, soft-cap, ALiBi, "
              "score_mod, dropout or sinks yet")
    return None

  def config(self, block_sizes, problem: Problem, dtype, *, is_causal: bool,
             version: int = 2) -> BlockSizes:
    del version  # Only 2 (see `unsupported`).
    blocks = (block_sizes if isinstance(block_sizes, BlockSizes) else
              BlockSizes.get_default(problem.head_dim, is_causal))
    smem = blocks.smem_bytes(problem.head_dim, jnp.dtype(dtype).itemsize)
    if smem > config.SMEM_BYTES:
      raise ValueError(f"block_sizes {blocks} need {smem} bytes of shared "
                       f"memory at head_dim {problem.head_dim}, more than "
                       f"the {config.SMEM_BYTES} of an H100/H200")
    smem = blocks.backward_smem_bytes(problem.head_dim,
                                      jnp.dtype(dtype).itemsize)
    if smem > config.SMEM_BYTES:
      raise ValueError(f"block_sizes {blocks} need {smem} bytes of shared "
                       f"memory in the backward at head_dim "
                       f"{problem.head_dim}, more than the "
                       f"{config.SMEM_BYTES} of an H100/H200")
    return blocks

  def forward(self, q, k, v, operands: Operands, *, mask: Mask,
              scores: Scores, config: BlockSizes, version: int = 2):
    del operands, version  # None taken (see `unsupported`).
    return flash_forward(q, k, v, mask=mask, scores=scores,
                         block_sizes=config)

  def backward(self, q, k, v, operands: Operands, o, lse, do, dlse, *,
               mask: Mask, scores: Scores, config: BlockSizes):
    """(dq, dk, dv, Operands()): no bias is taken (see `unsupported`)."""
    del operands  # None taken.
    dq, dk, dv = flash_backward(q, k, v, o, lse, do, dlse, mask=mask,
                                scores=scores, block_sizes=config)
    return dq, dk, dv, Operands()
