"""`TritonBackend`: what the Triton kernels take, their tiles, and their
launches (the kernel modules are imported by a call's first launch)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_flash.core.backend import Copies
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.prepare import decode_as_forward
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores
from pallas_kernels.triton import config
from pallas_kernels.triton.config import BlockSizes


@dataclasses.dataclass(frozen=True)
class TritonBackend:
  """The `jax_flash.core.backend.Backend` of the Triton kernels."""
  interpret: bool = False
  config_type = BlockSizes
  operand_gradients = frozenset({"bias"})  # The dbias kernel.

  @property
  def name(self) -> str:
    return "interpret" if self.interpret else "triton"

  @property
  def needs_gpu(self) -> bool:
    return not self.interpret

  def unsupported(self, problem: Problem, dtype, *, mask: Mask,
                  scores: Scores, decode: bool = False) -> str | None:
    """Why this backend cannot take the call, or None."""
    del mask, decode  # It takes every one.
    if scores.fp8:
      return "the Triton kernels take no fp8 call (implementation='xla' does)"
    if jnp.dtype(dtype).name not in config.DTYPES:
      return (f"query dtype must be one of {', '.join(config.DTYPES)} for the "
              f"Triton kernels, got {jnp.dtype(dtype)}")
    for name, h in (("head_dim (last axis of query, key)", problem.head_dim),
                    ("value head_dim (last axis of value)",
                     problem.value_head_dim)):
      if not config.MIN_HEAD_DIM <= h <= config.MAX_HEAD_DIM:
        return (f"{name} must be in [{config.MIN_HEAD_DIM}, "
                f"{config.MAX_HEAD_DIM}] for the Triton kernels, got {h}")
    return None

  def copies(self, problem: Problem, dtype, *, mask: Mask) -> Copies:
    return Copies()  # Its kernels read every array where it lies.

  def backward_unsupported(self, problem: Problem, dtype, *, mask: Mask,
                           scores: Scores,
                           operands: Operands) -> str | None:
    return None  # Its backward follows any forward it could have run.

  def config(self, block_sizes: BlockSizes | None, problem: Problem, dtype,
             *, is_causal: bool, scores: Scores | None = None,
             mask: Mask | None = None) -> BlockSizes:
    del mask  # The tiles do not depend on it.
    if block_sizes is None:
      block_sizes = BlockSizes.get_default(problem.head_dim, dtype, is_causal)
      if scores is not None and scores.mod_arrays:
        block_sizes = block_sizes.for_array_reads()
    return block_sizes.clipped(problem.q_len, problem.kv_len)

  def forward(self, q, k, v, operands: Operands, *, mask: Mask,
              scores: Scores, config: BlockSizes):
    """(o [B, T, N, H], lse [B, N, T] natural log)."""
    from pallas_kernels.triton import flash_fwd
    return flash_fwd.flash_forward(q, k, v, operands, scores=scores,
                                   mask=mask, block_sizes=config,
                                   interpret=self.interpret)

  def backward(self, q, k, v, operands: Operands, delta, lse, do, dlse, *,
               mask: Mask, scores: Scores, config: BlockSizes):
    """(dq, dk, dv, Operands(bias=dbias or None))."""
    from pallas_kernels.triton.flash_bwd import flash_backward
    dq, dk, dv, dbias = flash_backward(
        q, k, v, operands, delta, lse, do, dlse, scores=scores, mask=mask,
        block_sizes=config, interpret=self.interpret)
    if dbias is not None:
      dbias = dbias.astype(operands.bias.dtype)
    return dq, dk, dv, Operands(bias=dbias)

  def decode(self, q, k, v, kv_lengths, *, mask: Mask, scores: Scores,
             num_splits: int | None, page_table=None, sinks=None):
    """(o [B, T, N, Hv], lse [B, N, T]) of queries at positions
    kv_lengths[b] - T + t against a contiguous or paged cache.

    Up to `config.SPLIT_KV_MAX_QUERIES` new tokens: the split-KV kernel
    (parallel over chunks of the cache). More (a prompt chunk): the training
    forward kernel on the same mask with per-sequence query offsets; a paged
    cache is first gathered into a contiguous one by XLA (a copy of the
    cache, linear in its length), faster than reading the pages through the
    table inside the kernel (benchmarks/NOTES.md, "Triton kernels").
    """
    from pallas_kernels.triton import flash_decode, flash_fwd
    if q.shape[1] > config.SPLIT_KV_MAX_QUERIES:
      k, v, mask, operands, problem = decode_as_forward(
          q, k, v, kv_lengths, mask, page_table, sinks)
      return flash_fwd.flash_forward(
          q, k, v, operands, mask=mask, scores=scores,
          block_sizes=self.config(None, problem, q.dtype, is_causal=True),
          interpret=self.interpret)
    head_dim = q.shape[-1]
    page_size = None if page_table is None else k.shape[1]
    kv_len = k.shape[1] if page_table is None else (
        page_table.shape[1] * page_size)
    blocks = config.decode_blocks(head_dim, kv_len, page_size)
    num_tiles = -(-kv_len // blocks.block_k)
    if num_splits is None:
      num_splits = config.decode_splits(q.shape[0], k.shape[2], num_tiles,
                                        blocks.programs_per_sm)
    return flash_decode.flash_decode(
        q, k, v, kv_lengths, scores=scores, mask=mask,
        num_splits=int(min(num_splits, num_tiles)), blocks=blocks,
        page_table=page_table, sinks=sinks, interpret=self.interpret)


TRITON = TritonBackend()
INTERPRET = TritonBackend(interpret=True)
