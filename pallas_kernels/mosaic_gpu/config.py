"""The Mosaic GPU backend's configuration and limits."""
from __future__ import annotations

import dataclasses

import numpy as np

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)  # Multiples of 64 within wgmma's N <= 256.
# The dK/dV kernel keeps dK and dV in registers: two [block_kv_dkv, H] float32
# accumulators, H registers a thread at 64 rows, past the 232 a consumer gets
# at H = 256 (that head dim runs Triton's backward).
BACKWARD_HEAD_DIMS = (64, 128)
SMEM_BYTES = 227 * 1024  # Shared memory of one Hopper CTA.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the Mosaic GPU kernels, built by keyword.

  Forward: each of the two consumer warpgroups owns `block_q` query rows (a
  CTA owns 2 * block_q); K/V tiles of `block_kv` rows stream through
  `num_stages` shared-memory slots. Backward: the dK/dV kernel's warpgroups
  own `block_kv_dkv` key rows each and stream `block_q_dkv`-row Q/dO tiles;
  the dQ kernel's own `block_q_dq` query rows and stream `block_kv_dq`-row
  K/V tiles; both through `num_stages_bwd` slots.
  """
  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_stages_bwd: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv",
                 "block_q_dq", "block_kv_dq"):
      value = getattr(self, name)
      if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
          or value < 64 or value % 64):
        raise ValueError(
            f"block_sizes.{name}={value!r} must be a multiple of 64")
    for name in ("num_stages", "num_stages_bwd"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or not 2 <= value <= 6:
        raise ValueError(f"block_sizes.{name}={value!r} must be an int in "
                         "[2, 6]")

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the forward: Q tiles, the K/V ring, the row stats."""
    q = 2 * self.block_q * head_dim * itemsize
    kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
    return q + kv + 2 * self.block_q * 4

  def backward_smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the larger backward kernel: dK/dV (its K/V tiles, a
    ring of Q/dO tiles and their L/D rows) or dQ (Q/dO tiles, a K/V ring)."""
    dkv = (2 * 2 * self.block_kv_dkv * head_dim * itemsize +
           self.num_stages_bwd * 2 * self.block_q_dkv * (head_dim * itemsize
                                                         + 4))
    dq = (2 * 2 * self.block_q_dq * head_dim * itemsize +
          self.num_stages_bwd * 2 * self.block_kv_dq * head_dim * itemsize)
    return max(dkv, dq)

  @classmethod
  def get_default(cls, head_dim: int) -> "BlockSizes":
    """Forward: 64-row consumer tiles, 128-row K/V tiles in 2 stages;
    64-row K/V tiles at head dim 256, to fit shared memory. Backward: 64-row
    tiles everywhere (a [64, 64] score tile leaves registers for dK and dV).
    Not tuned yet."""
    if head_dim > 128:
      return cls(block_q=64, block_kv=64, num_stages=2)
    return cls(block_q=64, block_kv=128, num_stages=2)
