"""The Triton backend's configuration and limits: tile sizes and launch knobs.

Every block size and launch knob of the Triton kernels lives here, with the
defaults per head dim, dtype and causality in `BlockSizes.get_default`, each
next to the measurement it comes from (files under `benchmarks/results/`),
and the split-KV policy of the decode kernel.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_flash.core.checks import check_block_field
from jax_flash.core.device import num_multiprocessors

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 512
DTYPES = ("float32", "bfloat16", "float16")
# New tokens per sequence up to which decode runs the split-KV kernel (one
# tile of G*T rows); more run the training forward kernel.
SPLIT_KV_MAX_QUERIES = 64


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def padded_head_dim(head_dim: int) -> int:
  """Triton tiles need power-of-two shapes: head dims are padded (and masked)."""
  return max(16, 1 << (int(head_dim) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the Triton forward and backward kernels.

  Forward (and the dQ/dBias kernels of the backward) tile the queries by
  `block_q` rows and the keys by `block_k` rows. The dK/dV kernel owns
  `block_k_dkv` keys per program and walks the queries `block_q_dkv` rows at a
  time; the dQ kernel owns `block_q_dq` queries and walks the keys
  `block_k_dq` at a time. All block sizes are powers of two >= 16 (a Triton
  dot needs every dimension >= 16 and every tile power-of-two shaped).
  Build it by keyword: `BlockSizes(block_q=128, block_k=64, num_warps=8)`.
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
      check_block_field(self, name, lambda x: x >= 16 and _is_pow2(x),
                        "a power of two >= 16")
    for name in ("num_warps", "num_warps_bwd"):
      check_block_field(self, name, lambda x: x in (1, 2, 4, 8, 16),
                        "one of 1, 2, 4, 8, 16")
    for name in ("num_stages", "num_stages_bwd"):
      check_block_field(self, name, lambda x: 1 <= x <= 8,
                        "an int in [1, 8]")

  @classmethod
  def get_default(cls, head_dim: int, dtype, is_causal: bool,
                  version: int = 2) -> "BlockSizes":
    """Defaults for an H100/H200-class GPU (why each: benchmarks/NOTES.md,
    "Triton kernels")."""
    hp = padded_head_dim(head_dim)
    if hp > 256:
      # Head dims 257..512 (padded to 512): forward 64x32 tiles, 8 warps, 2
      # stages; backward 32x32 with 8 warps. float32 and the
      # FlashAttention-1 forward (more tiles in shared memory) keep the
      # smallest tiles in one stage.
      if np.dtype(dtype).itemsize >= 4 or version == 1:
        return cls(block_q=32 if np.dtype(dtype).itemsize < 4 else 16,
                   block_k=16, num_warps=8, num_stages=1, block_q_dkv=16,
                   block_k_dkv=16, block_q_dq=16, block_k_dq=16,
                   num_warps_bwd=8, num_stages_bwd=1)
      return cls(block_q=64, block_k=32, num_warps=8, num_stages=2,
                 block_q_dkv=32, block_k_dkv=32, block_q_dq=32,
                 block_k_dq=32, num_warps_bwd=8, num_stages_bwd=1)
    if np.dtype(dtype).itemsize >= 4:
      # float32 runs full-precision dots on CUDA cores: small tiles that fit
      # shared memory (not tuned).
      if hp <= 64:
        return cls(block_q=64, block_k=64, block_q_dkv=32, block_k_dq=32)
      if hp <= 128:
        return cls(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=32,
                   block_q_dq=32, block_k_dq=32)
      return cls(block_q=32, block_k=32, num_stages=1, block_q_dkv=16,
                 block_k_dkv=32, block_q_dq=32, block_k_dq=16,
                 num_stages_bwd=1)
    # Head dims up to 128: 128-row query tiles, the backward's 64x64 tiles
    # with 4 warps and 2 stages (the class defaults).
    if hp <= 64:
      return cls(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if hp <= 128:
      if is_causal:
        return cls(block_q=128, block_k=64, num_warps=4, num_stages=2)
      return cls(block_q=128, block_k=128, num_warps=8, num_stages=3)
    # Head dims 160..256 (padded to 256): forward 128x64 tiles with 8 warps
    # and 2 stages (3 stages of 128-row tiles overflow shared memory);
    # backward 64x64 tiles with 8 warps and 1 stage.
    backward = dict(num_warps_bwd=8, num_stages_bwd=1)
    if version == 1:
      # The FlashAttention-1 forward keeps more tiles in shared memory: 128x64
      # overflows it at this head dim (327680 of 232448 bytes).
      return cls(block_q=64, block_k=64, num_warps=4, num_stages=2,
                 **backward)
    return cls(block_q=128, block_k=64, num_warps=8, num_stages=2, **backward)

  def for_array_reads(self) -> "BlockSizes":
    """These tiles for a score_mod that reads arrays (a float32 tile gathered
    per key tile, converted through shared memory): key tiles of at most 64
    in at most 2 stages. Head dim 128's non-causal default (128 x 128, 3
    stages) asks for 360448 bytes of shared memory with a relative-bias
    table, against an H100/H200's 232448; 128 x 64 in 2 stages, the
    causal default, fits."""
    return dataclasses.replace(self, block_k=min(self.block_k, 64),
                               num_stages=min(self.num_stages, 2))

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBlocks:
  """Tiling of the split-KV decode kernel.

  block_k: key rows a tile (within one page, or the pages of one gather).
  num_stages: Triton's software-pipelining stages of the key-tile loop.
  prefetch_pages: with a page table, how many tiles ahead of its use a
    tile's page ids are read (0: in its own iteration, where its loads wait
    on the read).
  programs_per_sm: (split, batch, kv head) programs per multiprocessor the
    cache is split into (`decode_splits`).
  page_dots: a tile of several pages is read a page at a time (one
    contiguous load each) and multiplied a page at a time, instead of one
    gathered load (`decode_blocks`: the default for 16-token pages).
  num_warps: warps a program.
  """
  block_k: int
  num_stages: int = 2
  prefetch_pages: int = 0
  programs_per_sm: int = 4
  page_dots: bool = False
  num_warps: int = 4


def decode_blocks(head_dim: int, kv_len: int, page_size: int | None = None
                  ) -> DecodeBlocks:
  """The decode kernel's tiling for a cache of kv_len positions: key tiles
  of 64 rows (32 above head dim 256, never more than the cache), 2 stages,
  4 programs a multiprocessor; pages of 64 tokens or more as contiguous;
  32-token pages a 32-row tile in 3 stages, ids read a tile ahead;
  16-token pages four a 64-row tile, each its own load and matmul
  (`page_dots`), 2 programs a multiprocessor (the H200 sweeps behind
  them: the lab log of December 2026, "paged decode").
  """
  hp = padded_head_dim(head_dim)
  tile = min(64 if hp <= 256 else 32,
             max(16, 1 << (kv_len - 1).bit_length()))
  if page_size is None or page_size >= 64:
    return DecodeBlocks(block_k=min(tile, page_size or tile))
  if page_size < 32:
    return DecodeBlocks(block_k=min(tile, 64), num_stages=3,
                        prefetch_pages=1, programs_per_sm=2, page_dots=True)
  return DecodeBlocks(block_k=min(tile, page_size), num_stages=3,
                      prefetch_pages=1)


def decode_splits(batch: int, num_kv_heads: int, num_tiles: int,
                  programs_per_sm: int) -> int:
  """Chunks each sequence's cache is split into: as many as keep the
  (split, batch, kv head) programs within `programs_per_sm` per
  multiprocessor (rounded down: a few programs past whole waves of the
  resident ones run as a tail while the memory system idles; 544 programs
  of 16-token pages where 264 are resident took 1.21x the time of 512 on the
  H200), at least one, at most one per key tile."""
  per_split = batch * num_kv_heads
  programs = programs_per_sm * num_multiprocessors()
  return int(max(1, min(num_tiles, programs // per_split)))
