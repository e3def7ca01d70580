"""The Mosaic GPU backend's configuration and limits."""
from __future__ import annotations

import dataclasses
import os

from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.core.checks import check_block_field
from jax_flash.core.padding import round_up

DTYPES = ("bfloat16", "float16")
# Head dims of the FP8 forward (`fp8=True`: e4m3 wgmma), and its K/V tiles'
# rows at each, (causal, not): a multiple of 64 (V^T's rows of keys take
# the 64- or 128-byte swizzle P's e4m3 tiles need); why these:
# benchmarks/NOTES.md, "Mosaic GPU FP8".
FP8_BLOCK_KV = {64: (128, 128), 128: (128, 256), 256: (64, 64)}
# Head dims of the FP8 backward (e4m3 wgmma in both kernels), and those
# where fp8=True takes it by default (where it is faster than the bf16
# kernels on the rounded values: benchmarks/NOTES.md, "Mosaic GPU FP8").
FP8_BACKWARD_HEAD_DIMS = (64, 128, 256)
FP8_BACKWARD_DEFAULT_HEAD_DIMS = (128, 256)
# Head dims where fp8=True stores its e4m3 tiles by `stmatrix` by default
# (`BlockSizes.e4m3_stmatrix`: faster there, not at 256; benchmarks/NOTES.md,
# "Mosaic GPU FP8").
FP8_STMATRIX_DEFAULT_HEAD_DIMS = (128,)
# Head dims where fp8=True hands its e4m3 tiles to wgmma from registers by
# default: the forward's P (`BlockSizes.e4m3_registers`) and the FP8
# backward's P^T, dS^T and dS (`e4m3_registers_bwd`), where each was
# faster (benchmarks/NOTES.md, "Mosaic GPU FP8").
FP8_REGISTERS_DEFAULT_HEAD_DIMS = (256,)
FP8_REGISTERS_BWD_DEFAULT_HEAD_DIMS = (128, 256)
# Head dims a call may have (of query/key and of value): up to wgmma's
# N <= 256. The kernels run at `kernel_head_dim`: a multiple of 16 (bf16
# rows of 32 bytes, the narrowest swizzle TMA and wgmma take), at least 32.
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16
MIN_KERNEL_HEAD_DIM = 32
SMEM_BYTES = 227 * 1024  # Shared memory of one Hopper CTA.
# flash_decode: up to this many new tokens run the split-KV kernel
# (`flash_decode.py`) against a contiguous cache at SPLIT_KV_HEAD_DIMS (two
# consumer warpgroups' outputs and four K/V stages fit shared memory
# there; Triton's elsewhere); more run the forward kernel (a CTA takes 2 *
# block_q >= 128 query rows). The same name and value as Triton's.
SPLIT_KV_MAX_QUERIES = 64
SPLIT_KV_HEAD_DIMS = (64, 128)
DECODE_ROWS = 64  # wgmma's rows: the most query rows a split-KV CTA takes.
DECODE_BLOCK_K = 64  # Cache rows a split-KV K/V tile by default.
# The dK/dV kernel's CTAs `BlockSizes.dkv_head_splits=None` splits KV heads
# up to (about 8 a multiprocessor; benchmarks/NOTES.md, "Mosaic GPU
# backward").
DKV_CTAS = 1024
# The widest score tile (columns) `BlockSizes.alibi_vectors=None` adds
# ALiBi to by vectors, and the widest K/V tile of the default forward
# with ALiBi: a column vector costs a thread a register per four columns;
# at 256 the forward spilled (benchmarks/NOTES.md, "Mosaic GPU forward").
ALIBI_VECTORS_MAX_COLUMNS = 128


# `BlockSizes.fused_dq`'s head dims: 128-byte swizzled K rows, which the
# dQ matmul slices by 64 columns.
FUSED_DQ_HEAD_DIMS = (64, 128)


def kernel_head_dim(head_dim: int, value_head_dim: int) -> int:
  """The head dim the kernels run a call at: the larger of query/key's and
  value's, rounded up to a multiple of HEAD_DIM_MULTIPLE (at least
  MIN_KERNEL_HEAD_DIM). The backend pads Q, K and V with zero columns to
  it (logits and outputs unchanged) and cuts the results back."""
  return max(MIN_KERNEL_HEAD_DIM,
             round_up(max(head_dim, value_head_dim), HEAD_DIM_MULTIPLE))


def short_kv_tile(kv_len: int, head_dim: int) -> int:
  """Rows of one K/V tile that holds all kv_len keys: a multiple of 16
  (V's contracted rows, `tiles.smem_transforms`), at least 64. Where the
  forward copies a head dim's tiles untiled (head dims 32 and 64, and
  those off a multiple of 16, in column parts: `tiles.Columns`), a
  multiple of its widest part's columns, so that V's tiles keep a row's
  swizzle and any length is read in place (`tiles.one_atom_wide`): 77
  keys take 96 rows at head dim 40 (parts 32 + 16), 80 at head dim 80;
  where kv_len is off a multiple of 8 the forward reads any head dim in
  such parts (77 keys take 128 rows at head dim 80, parts 64 + 16)."""
  multiple = HEAD_DIM_MULTIPLE
  if head_dim in (32, 64) or head_dim % HEAD_DIM_MULTIPLE or kv_len % 8:
    padded = kernel_head_dim(head_dim, head_dim)
    multiple = max(w for w in (64, 32, 16) if w <= padded)
  return max(64, round_up(kv_len, multiple))


def fused_dq_columns(head_dim: int) -> int:
  """Columns of dQ each warpgroup of the dK/dV kernel forms and adds a step
  with `fused_dq`: at head dim 128 half of them, over both warpgroups' keys
  (dS exchanged through shared memory); at 64 all, over its own keys (half
  would cut a 128-byte swizzle atom of K)."""
  return head_dim // 2 if head_dim > 64 else head_dim


# Keys above which the backward pads a head dim off a multiple of 16
# (`flash_bwd.backward_columns`) instead of running it in column parts:
# there the parts' narrow matmuls cost more than the pad.
BACKWARD_PARTS_MAX_KV_LEN = 1024
# Kernel head dims up to which the forward is persistent by default
# (`BlockSizes.get_default`; two Q buffers fit beside the K/V ring).
PERSISTENT_MAX_HEAD_DIM = 128
# Keys up to which the causal forward at head dim 64 takes 128-row K/V
# tiles instead of 256 (`BlockSizes.get_default`).
SHORT_KV_LEN = 2048
# Keys above which the forward at head dim 256 takes 80-row K/V tiles
# instead of 64 (`BlockSizes.get_default`).
LONG_KV_LEN = 4096
# Where the Mosaic kernels write a per-warpgroup trace of their named
# regions (`jax.named_scope` in the kernels) when set: one Chrome-trace
# JSON a launch, summarised by benchmarks/profile_summary.py.
PROFILE_DIR_ENV = "JAX_FLASH_MOSAIC_PROFILE_DIR"
# Events a warpgroup can record in one launch: PROFILE_EVENTS, or
# $JAX_FLASH_MOSAIC_PROFILE_EVENTS (the forward records 4 a key tile).
PROFILE_EVENTS_ENV = "JAX_FLASH_MOSAIC_PROFILE_EVENTS"
PROFILE_EVENTS = 128


def compiler_params(reduction_scratch: bool = True):
  """The Mosaic kernels' compiler parameters: approximate math, and Mosaic
  GPU's profiler when $JAX_FLASH_MOSAIC_PROFILE_DIR names a directory
  (read at trace time; a warpgroup's events past the profile's space are
  dropped). `reduction_scratch=False` reserves none of the 2 KiB Mosaic
  GPU keeps for reductions across warps by default (the forward's row
  reductions stay within a warp)."""
  scratch = {} if reduction_scratch else {"reduction_scratch_bytes": 0}
  profile_dir = os.environ.get(PROFILE_DIR_ENV)
  if not profile_dir:
    return plgpu.CompilerParams(approx_math=True, **scratch)
  events = os.environ.get(PROFILE_EVENTS_ENV, str(PROFILE_EVENTS))
  if not events.isdigit() or int(events) < 1:
    raise ValueError(f"${PROFILE_EVENTS_ENV}={events!r} must be a positive "
                     f"int (events a warpgroup records)")
  return plgpu.CompilerParams(approx_math=True, profile_space=int(events),
                              profile_dir=profile_dir,
                              profile_bounds_check=True, **scratch)


def aligned(nbytes: int) -> int:
  """Mosaic GPU aligns each shared-memory allocation to 1 KiB."""
  return -(-nbytes // 1024) * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and variants of the Mosaic GPU kernels, built by keyword. Every
  head dim here is the kernels' (`kernel_head_dim`); why each default is
  what it is: benchmarks/NOTES.md, "Mosaic GPU forward" and "backward".

  Forward: each of the two consumer warpgroups owns `block_q` query rows
  (a CTA owns 2 * block_q); K/V tiles of `block_kv` rows (a multiple of
  16 from 64: tiles off a multiple of 64 take a narrower swizzle for V,
  `layout.smem_transforms`, and no reduction scratch) stream through
  `num_stages` shared-memory slots. Backward: the dK/dV kernel's
  warpgroups own `block_kv_dkv` key rows each and stream `block_q_dkv`-row
  Q/dO tiles; the dQ kernel's own `block_q_dq` query rows and stream
  `block_kv_dq`-row K/V tiles; both through `num_stages_bwd` slots.

  Variants:
    named_barriers: the forward's consumers stagger each other through
      hardware barriers (`bar.sync` / `bar.arrive`) instead of an mbarrier.
    producer_registers: registers a thread of each kernel's TMA producer
      (`setmaxnreg`); the consumers share the rest (`consumer_registers`).
    dv_before_ds: the dK/dV kernel waits for its dV matmul before forming
      dS (fewer live registers, less overlap).
    fused_dq (head dims `FUSED_DQ_HEAD_DIMS`): the dK/dV kernel also forms
      dQ (`fused_dq_columns`), added into a float32 buffer by TMA
      reduce-add: no dQ kernel, but dQ's additions come in an order that
      varies from run to run (not bitwise deterministic).
    persistent: the forward runs one CTA a multiprocessor looping over
      (batch, head, query tile) items with one K/V ring
      (`flash_fwd.cta_schedule`, `scheduling.persistent_order`) and two Q
      buffers up to head dim 128 (`q_buffers`).
    fp8_backward (fp8=True at FP8_BACKWARD_HEAD_DIMS): the backward's five
      matmuls in e4m3, where otherwise the bf16 kernels run on the
      rounded values.
    overlap (the FP8 forward only): each consumer issues a tile's QK^T
      with the previous tile's P V and runs the softmax while P V runs,
      the consumers taking turns at the tensor cores (`flash_fwd._Turns`).
    e4m3_stmatrix (the FP8 kernels): their e4m3 tiles (P, P^T, dS, dS^T)
      stored by `stmatrix`, their columns permuted and the operand each
      meets permuted alike (`tiles.E4m3Tiles`), instead of 16-bit stores.
    e4m3_registers (the FP8 forward) and e4m3_registers_bwd (the FP8
      backward): their e4m3 tiles (P; P^T, dS^T and dS) handed to wgmma
      from registers, regrouped into the 8-bit wgmma layout (the operand
      each meets permuted as for `e4m3_stmatrix`), with no store to
      shared memory, no fence and no buffer.
    dkv_head_splits (not with fp8_backward or fused_dq): the dK/dV
      kernel's CTAs a KV head, each taking a share of the group's query
      heads (shares of ceil(G / splits)) and writing its partial dK and dV,
      which XLA sums in float32 in a fixed order (still deterministic):
      more CTAs where (batch, KV heads, key tiles) underfill the GPU, as
      with multi-query attention. None: the fewest that give the kernel
      `DKV_CTAS` CTAs (or G).
    alibi_vectors: ALiBi added to a tile from a row and a column vector
      of positions scaled by the slope (`tiles.with_alibi`: on a causal
      mask slope (j - i), two additions a score; otherwise -|slope j -
      slope i|), instead of -slope |i - j| from two position tiles.
      None: on for tiles of at most `ALIBI_VECTORS_MAX_COLUMNS` columns
      (the backward's always; the forward's K/V tiles with ALiBi are
      that wide by default).
    alibi_fold: where ALiBi goes by vectors on a causal mask, its query
      term (-slope i) joins the forward's row maximum and the backward's
      logsumexp (one operation a row) instead of each score: one addition
      a score, not two (`tiles.with_alibi`, `softmax_step`'s `row`).
    fp8_ds_bound (FP8 backward): dS scaled to e4m3 by one bound a (batch,
      KV head) on |dS|, formed before the kernels (`flash_bwd.ds_bound`),
      instead of its rows' running maxima: no row maxima of |dS| and no
      rescale of the dK and dQ accumulators.
  """
  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_stages_bwd: int = 2
  named_barriers: bool = False
  producer_registers: int = 40
  dv_before_ds: bool = False
  fused_dq: bool = False
  persistent: bool = False
  fp8_backward: bool = False
  overlap: bool = False
  e4m3_stmatrix: bool = False
  e4m3_registers: bool = False
  e4m3_registers_bwd: bool = False
  dkv_head_splits: int | None = None
  alibi_vectors: bool | None = None
  alibi_fold: bool = True
  fp8_ds_bound: bool = True

  def __post_init__(self):
    for name in ("block_q", "block_q_dkv", "block_kv_dkv", "block_q_dq",
                 "block_kv_dq"):
      check_block_field(self, name, lambda x: x >= 64 and x % 64 == 0,
                        "a multiple of 64")
    check_block_field(self, "block_kv", lambda x: x >= 64 and x % 16 == 0,
                      "a multiple of 16 from 64 up")
    for name in ("num_stages", "num_stages_bwd"):
      check_block_field(self, name, lambda x: 2 <= x <= 6,
                        "an int in [2, 6]")
    if self.dkv_head_splits is not None:
      check_block_field(self, "dkv_head_splits", lambda x: x >= 1,
                        "None or an int from 1 up")
    check_block_field(self, "producer_registers",
                      lambda x: 24 <= x <= 128 and x % 8 == 0,
                      "a multiple of 8 in [24, 128]")
    for name in ("named_barriers", "dv_before_ds", "fused_dq", "persistent",
                 "fp8_backward", "overlap", "e4m3_stmatrix",
                 "e4m3_registers", "e4m3_registers_bwd", "alibi_fold",
                 "fp8_ds_bound"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"block_sizes.{name}={getattr(self, name)!r} must "
                         f"be a bool")
    if not isinstance(self.alibi_vectors, (bool, type(None))):
      raise ValueError(f"block_sizes.alibi_vectors={self.alibi_vectors!r} "
                       f"must be None or a bool")
    if self.fp8_backward and self.fused_dq:
      raise ValueError("block_sizes.fp8_backward=True needs fused_dq=False "
                       "(the FP8 backward has its own dQ kernel)")
    if self.overlap and self.named_barriers:
      raise ValueError("block_sizes.overlap=True needs named_barriers=False "
                       "(its turns are mbarriers)")
    if self.persistent and self.named_barriers:
      raise ValueError("block_sizes.persistent=True needs "
                       "named_barriers=False (the hardware barriers' "
                       "parities are fixed per item)")

  def check_overlap(self, fp8: bool) -> None:
    """Raises ValueError where `overlap` is asked of a forward not FP8."""
    if self.overlap and not fp8:
      raise ValueError("block_sizes.overlap=True is the FP8 forward's "
                       "(fp8=True or float8 inputs)")

  def q_buffers(self, head_dim: int) -> int:
    """Q (and O staging) buffers of the forward: two when persistent, up
    to head dim 128 (at 256 two do not fit beside the K/V ring)."""
    return 2 if self.persistent and head_dim <= 128 else 1

  def consumer_registers(self, num_consumers: int) -> int:
    """Registers a thread of each of `num_consumers` consumer warpgroups
    beside the producer's: the rest of 512 (a warpgroup's share of the
    SM's registers times four), at most 256, a multiple of 8 (what
    `emit_pipeline_warp_specialized` gives its compute warpgroups)."""
    return min(256, (512 - self.producer_registers) // num_consumers) // 8 * 8

  def reduction_scratch(self) -> bool:
    """Whether the forward keeps Mosaic's 2 KiB reduction scratch: only
    with K/V tiles of a multiple of 64 rows (`block_kv`; 80-row tiles fit
    head dim 256's shared memory only without it)."""
    return self.block_kv % 64 == 0

  def smem_bytes(self, head_dim: int, itemsize: int,
                 fp8: bool = False) -> int:
    """Shared memory of the forward: Q tiles, the K/V ring, the row stats,
    each allocation aligned to 1 KiB, Mosaic's 2 KiB reduction scratch
    (`reduction_scratch`) and the barriers (1 KiB); with `fp8` (e4m3 Q, K
    and V: itemsize 1) also O's bf16 staging and each consumer's e4m3 P
    (none with `e4m3_registers`).
    An upper bound: (128, 3) at head dim 128, 232568 bytes on the H200, is
    233472 here; 80-row K/V tiles at head dim 256, 230488 (lowered for
    the H200), 231424."""
    buffers = self.q_buffers(head_dim)
    q = aligned(buffers * 2 * self.block_q * head_dim * itemsize)
    kv = 2 * aligned(self.num_stages * self.block_kv * head_dim * itemsize)
    scratch = 2048 if self.reduction_scratch() else 0
    p = 0 if self.e4m3_registers else aligned(2 * self.block_q *
                                              self.block_kv)
    staging = (aligned(buffers * 2 * self.block_q * head_dim * 2) + p
               if fp8 else 0)
    return (q + kv + staging + aligned(buffers * 2 * self.block_q * 4) +
            scratch + 1024)

  def backward_smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the larger backward kernel: dK/dV (its K/V tiles, a
    ring of Q/dO tiles and their L/D rows) or dQ (Q/dO tiles, a K/V ring)."""
    # Above head dim 128 the dK/dV kernel's warpgroups share one K/V copy
    # and the dQ kernel has one warpgroup (`flash_bwd`).
    copies = 1 if head_dim > 128 else 2
    dkv = (copies * 2 * self.block_kv_dkv * head_dim * itemsize +
           self.num_stages_bwd * 2 * self.block_q_dkv * (head_dim * itemsize
                                                         + 4))
    dq = (copies * 2 * self.block_q_dq * head_dim * itemsize +
          self.num_stages_bwd * 2 * self.block_kv_dq * head_dim * itemsize)
    if self.fused_dq:  # dS twice over (2 x 2 tiles), float32 dQ columns.
      return dkv + (4 * self.block_kv_dkv * self.block_q_dkv * itemsize +
                    2 * self.block_q_dkv * fused_dq_columns(head_dim) * 4)
    return max(dkv, dq)

  @classmethod
  def get_default(cls, head_dim: int, is_causal: bool = False,
                  fused_dq: bool = False, band_only: bool = False,
                  kv_len: int | None = None) -> "BlockSizes":
    """The default tiles for a head dim (the call's, before any padding),
    causality and key length.

    Forward: 64-row consumer tiles; K/V tiles of 256 rows at head dim 64
    (128 causal up to SHORT_KV_LEN keys), 128 at 65-128, 96 at 129-192, 64
    at 193-256 (80 above LONG_KV_LEN keys), or one tile of the keys
    (`short_kv_tile`) where that is fewer rows;
    2 stages. Backward: 64-row
    tiles, dQ's K/V tiles 128 rows at head dim 64 and at 65-128 non-causal.
    `fused_dq` (head dims 64, 128): 3 backward stages at 64, 2 at 128.
    `persistent` for a call whose mask is at most causal (`band_only`) up
    to PERSISTENT_MAX_HEAD_DIM. Why: benchmarks/NOTES.md, "Mosaic GPU
    forward".
    """
    if head_dim > 192:
      long = kv_len is not None and kv_len > LONG_KV_LEN
      blocks = cls(block_q=64, block_kv=80 if long else 64)
    elif head_dim > 128:
      blocks = cls(block_q=64, block_kv=96)
    elif head_dim > 64:
      blocks = cls(block_q=64, block_kv=128,
                   block_kv_dq=64 if is_causal else 128)
    else:
      short = is_causal and kv_len is not None and kv_len <= SHORT_KV_LEN
      blocks = cls(block_q=64, block_kv=128 if short else 256,
                   block_kv_dq=128)
    if kv_len is not None and short_kv_tile(kv_len, head_dim) < blocks.block_kv:
      blocks = dataclasses.replace(blocks,
                                   block_kv=short_kv_tile(kv_len, head_dim))
    if fused_dq:
      blocks = dataclasses.replace(
          blocks, fused_dq=True, num_stages_bwd=3 if head_dim <= 64 else 2)
    if band_only and head_dim <= PERSISTENT_MAX_HEAD_DIM:
      blocks = dataclasses.replace(blocks, persistent=True)
    return blocks
