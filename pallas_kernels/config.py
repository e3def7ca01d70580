"""Static kernel configuration: tile sizes and launch knobs, in one frozen dataclass.

Every block size and launch knob the kernels use lives here, with the defaults
chosen per head dim, dtype and causality in `BlockSizes.get_default`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def padded_head_dim(head_dim: int) -> int:
  """Triton tiles need power-of-two shapes: head dims are padded (and masked)."""
  return max(16, 1 << (int(head_dim) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the forward and backward kernels.

  Forward (and the dQ kernel of the backward) tile the queries by `block_q`
  rows and the keys by `block_k` rows. The dK/dV kernel owns `block_k_dkv`
  keys per program and walks the queries `block_q_dkv` rows at a time; the dQ
  kernel owns `block_q_dq` queries and walks the keys `block_k_dq` at a time.
  All block sizes are powers of two >= 16 (a Triton dot needs every dimension
  >= 16 and every tile power-of-two shaped).
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv",
                 "block_q_dq", "block_k_dq"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"block_sizes.{name}={value!r} must be an int")
      if value < 16 or not _is_pow2(value):
        raise ValueError(
            f"block_sizes.{name}={value} must be a power of two >= 16")
    for name in ("num_warps", "num_warps_bwd"):
      value = getattr(self, name)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"block_sizes.{name}={value!r} must be one of 1, 2, 4, 8, 16")
    for name in ("num_stages", "num_stages_bwd"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or not 1 <= value <= 8:
        raise ValueError(
            f"block_sizes.{name}={value!r} must be an int in [1, 8]")

  @classmethod
  def get_default(cls, head_dim: int, dtype, is_causal: bool,
                  version: int = 2) -> "BlockSizes":
    """Defaults for an H100/H200-class GPU.

    Forward: 128-row query tiles with 4 warps and 2 stages is the best measured
    point for causal head dim 128 in ../shared/PALLAS_TRITON_NOTES.md and within
    a few percent of the best elsewhere; 128x128 with 8 warps and 3 stages for
    non-causal head dim 128. Larger head dims and float32 shrink the tiles so
    the pipelined K/V stages fit in the 227 KB of shared memory.
    Backward: 64x64 tiles with 4 warps up to head dim 128 (the notes measured
    8 warps 2-3x slower at that tile size there); at head dim 256, 8 warps
    measured 1.6x faster (below).
    """
    hp = padded_head_dim(head_dim)
    itemsize = np.dtype(dtype).itemsize
    if itemsize >= 4:
      # float32 runs IEEE dots on CUDA cores: small tiles, modest smem.
      if hp <= 64:
        return cls(64, 64, 4, 2, 32, 64, 64, 32, 4, 2)
      if hp <= 128:
        return cls(64, 32, 4, 2, 32, 32, 32, 32, 4, 2)
      return cls(32, 32, 4, 1, 16, 32, 32, 16, 4, 1)
    if hp <= 64:
      return cls(128, 64, 4, 3, 64, 64, 64, 64, 4, 2)
    if hp <= 128:
      if is_causal:
        return cls(128, 64, 4, 2, 64, 64, 64, 64, 4, 2)
      return cls(128, 128, 8, 3, 64, 64, 64, 64, 4, 2)
    # Head dims 160..256 (padded to 256), measured on the H200 at 8k
    # non-causal by benchmarks/tune.py (benchmarks/results/2026-11-30-h200-session2/
    # tune_h256.json): forward 128x64 tiles with 8 warps and 2 stages, 436
    # TFLOP/s against 316 for 64x64/4 warps (3 stages of 128-row tiles
    # overflow shared memory); backward 64x64 tiles everywhere with 8 warps
    # and 1 stage, 160 TFLOP/s against 100 for the 32/64 tiles with 4 warps.
    # The FlashAttention-1 forward keeps more tiles in shared memory: its
    # 128x64 tiles overflow it at this head dim (327680 of 232448 bytes on
    # the H200), so it keeps the 64x64/4-warp tiles it passed its tests with.
    if version == 1:
      return cls(64, 64, 4, 2, 64, 64, 64, 64, 8, 1)
    return cls(128, 64, 8, 2, 64, 64, 64, 64, 8, 1)

  def clipped(self, q_len: int, kv_len: int) -> "BlockSizes":
    """Shrinks tiles for short sequences (never below 16), keeping the rest."""
    def clip(b, n):
      return max(16, min(b, 1 << max(0, (int(n) - 1).bit_length())))
    return dataclasses.replace(
        self,
        block_q=clip(self.block_q, q_len), block_k=clip(self.block_k, kv_len),
        block_q_dkv=clip(self.block_q_dkv, q_len),
        block_k_dkv=clip(self.block_k_dkv, kv_len),
        block_q_dq=clip(self.block_q_dq, q_len),
        block_k_dq=clip(self.block_k_dq, kv_len))
