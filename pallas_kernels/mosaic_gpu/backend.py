"""`MosaicGpuBackend`: what the Mosaic GPU kernels take, their tiles, and
their launches (the kernel modules are imported by a call's first launch)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.extend.core
import jax.numpy as jnp

from jax_flash.core import device
from jax_flash.core import fp8 as fp8_lib
from jax_flash.core.backend import Copies
from jax_flash.core.mask import Mask, without_padding
from jax_flash.core.operands import Operands
from jax_flash.core.padding import pad_to
from jax_flash.core.prepare import decode_as_forward
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu import config
from pallas_kernels.mosaic_gpu.config import FP8_BACKWARD_HEAD_DIMS, BlockSizes
from pallas_kernels.mosaic_gpu.layout import Columns, backward_columns


# What a user's mask_mod or score_mod may be made of in these kernels:
# elementwise primitives the Mosaic GPU lowering takes on register arrays.
MOD_PRIMITIVES = frozenset((
    "abs", "add", "and", "broadcast_in_dim", "clamp", "convert_element_type",
    "cos", "div", "eq", "erf", "exp", "exp2", "ge", "gt", "integer_pow", "jit",
    "le", "log", "log2", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "not", "or", "rem", "round", "rsqrt", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sqrt",
    "square", "sub", "tanh", "xor"))


def _primitives(jaxpr) -> set:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def mod_primitives_missing(mask: Mask, scores: Scores) -> set:
  """Primitives of the mask_mod / score_mod outside `MOD_PRIMITIVES`, traced
  on index tiles as the kernels call them."""
  idx = jnp.zeros((8, 8), jnp.int32)
  b = jnp.int32(0)
  used = set()
  if mask.mod is not None:
    used |= _primitives(jax.make_jaxpr(mask.mod)(b, b, idx, idx).jaxpr)
  if scores.mod is not None:
    used |= _primitives(jax.make_jaxpr(scores.mod)(
        jnp.zeros((8, 8), jnp.float32), b, b, idx, idx).jaxpr)
  return used - MOD_PRIMITIVES


def split_kv_heads(q_len: int, num_heads: int, num_kv_heads: int) -> int:
  """KV heads a tile of the split-KV kernel: all of them (a tile is then a
  contiguous run of the cache) where every query row fits one CTA and K
  divides a tile's rows; otherwise one."""
  rows = num_heads * q_len
  if rows <= config.DECODE_ROWS and config.DECODE_BLOCK_K % num_kv_heads == 0:
    return num_kv_heads
  return 1


def split_kv_unsupported(problem: Problem, *, paged: bool) -> str | None:
  """Why the split-KV kernel cannot take a decode call, or None."""
  if paged:
    return "the cache is contiguous (a paged one's short chunks are Triton's)"
  if (problem.head_dim not in config.SPLIT_KV_HEAD_DIMS
      or problem.value_head_dim != problem.head_dim):
    return (f"the head dim is one of {config.SPLIT_KV_HEAD_DIMS}, value's "
            f"the same")
  heads = split_kv_heads(problem.q_len, problem.num_heads,
                         problem.num_kv_heads)
  group = problem.num_heads // problem.num_kv_heads
  if heads * group * problem.q_len > config.DECODE_ROWS:
    return (f"a KV head's query rows (new tokens x query heads a KV head) "
            f"are at most {config.DECODE_ROWS}")
  if problem.kv_len % 8:
    return "the cache's length is a multiple of 8"
  return None


def _fp8_unsupported(problem: Problem, mask: Mask, scores: Scores,
                     decode) -> str | None:
  """What the FP8 forward lacks for the call (None: it takes it)."""
  if decode:
    return "no decode"
  if (problem.head_dim not in config.FP8_BLOCK_KV
      or problem.value_head_dim != problem.head_dim):
    return (f"head dims {tuple(config.FP8_BLOCK_KV)}, value's the same, got "
            f"{problem.head_dim}/{problem.value_head_dim}")
  if mask not in (Mask(), Mask(is_causal=True)):
    return "only a causal mask or none"
  if scores != Scores(scale=scores.scale, fp8=scores.fp8) or scores.scale <= 0:
    return "no soft-cap, ALiBi, bias, sinks or dropout and a positive scale"
  return None


def _pad_heads(q, k, v, *rest):
  """q, k, v (and dO in `rest`, value's head dim) with zero columns up
  to `config.kernel_head_dim`: zeros add nothing to the logits, and V's
  give zero output columns, cut off after the kernels."""
  size = config.kernel_head_dim(q.shape[-1], v.shape[-1])
  return tuple(pad_to(x, x.ndim - 1, size) for x in (q, k, v, *rest))


def _backward_pads(problem: Problem, dtype, blocks: BlockSizes) -> bool:
  """Whether the backward pads the head dims (`_pad_heads`): a value head
  dim of its own, or one the kernels' column parts cannot read in place
  (`flash_bwd.backward_columns`)."""
  return (problem.value_head_dim != problem.head_dim
          or backward_columns(dtype, problem.head_dim, problem.q_len,
                              problem.kv_len, blocks) is None)


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend:
  """The `jax_flash.core.backend.Backend` of the Mosaic GPU kernels.
  `fp8_rounding`: () -> the `fp8.Rounding` that quantizes dO for the FP8
  backward, asked at its first launch (the dispatch's registry passes the
  one it picks for a Hopper GPU; XLA's ops by default)."""
  fp8_rounding: Callable[[], fp8_lib.Rounding] = lambda: fp8_lib.XLA
  name = "mosaic"
  needs_gpu = True
  config_type = BlockSizes
  operand_gradients = frozenset()  # A bias's comes from another backend.

  def __repr__(self) -> str:
    # The function by its name, not its address: the kernel cache's key
    # holds this repr and must read the same in every process.
    f = self.fp8_rounding
    return (f"MosaicGpuBackend(fp8_rounding="
            f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', f)})")

  def unsupported(self, problem: Problem, dtype, *, mask: Mask,
                  scores: Scores, decode: bool | str = False) -> str | None:
    """Why the Mosaic GPU kernels cannot take the call, or None. decode:
    False, or the cache's storage ("contiguous" or "paged")."""
    if not device.hopper_target():
      return "the Mosaic GPU kernels need a Hopper GPU (H100/H200)"
    if decode and problem.q_len <= config.SPLIT_KV_MAX_QUERIES:
      why = split_kv_unsupported(problem, paged=decode == "paged")
      if why:
        return (f"the Mosaic GPU kernels decode prompt chunks of more than "
                f"{config.SPLIT_KV_MAX_QUERIES} new tokens, and fewer only "
                f"where {why} (Triton's split-KV kernel takes them), got "
                f"{problem.q_len}")
    if scores.fp8:
      why = _fp8_unsupported(problem, mask, scores, decode)
      if why:
        return (f"the Mosaic GPU FP8 forward takes {why} "
                f"(implementation='xla' takes any fp8 call)")
    elif jnp.dtype(dtype).name not in config.DTYPES:
      return (f"query dtype must be bfloat16 or float16 for the Mosaic GPU "
              f"kernels, got {jnp.dtype(dtype)}")
    for name, h in (("head_dim (last axis of query, key)", problem.head_dim),
                    ("value head_dim (last axis of value)",
                     problem.value_head_dim)):
      if h > config.MAX_HEAD_DIM:
        return (f"{name} must be at most {config.MAX_HEAD_DIM} for the Mosaic "
                f"GPU kernels, got {h}")
    if mask.mod_arrays or scores.mod_arrays:
      return ("the Mosaic GPU kernels cannot read the arrays a mask_mod or "
              "score_mod closes over (the Triton kernels do)")
    missing = mod_primitives_missing(mask, scores)
    if missing:
      return (f"the Mosaic GPU kernels cannot run a mask_mod/score_mod made "
              f"of {sorted(missing)}")
    return None

  def _forward_copies(self, problem: Problem, dtype, mask: Mask) -> bool:
    """Whether XLA copies Q, K, V or O around the forward at its default
    tiles: a head dim padded (`tiles.Columns`) or a length off a multiple
    of 8 read through tiled copies."""
    blocks = self.config(None, problem, dtype, is_causal=mask.is_causal,
                         mask=mask)
    layout = (Columns.of(dtype, problem.head_dim, blocks.block_kv,
                         problem.q_len, problem.kv_len)
              if problem.value_head_dim == problem.head_dim else None)
    return layout is None or layout.copies(problem.q_len, problem.kv_len)

  def copies(self, problem: Problem, dtype, *, mask: Mask) -> Copies:
    """XLA copies arrays around the forward where `_forward_copies`, and
    pads the head dims around the backward where `_backward_pads` (at
    the default tiles)."""
    return Copies(forward=self._forward_copies(problem, dtype, mask),
                  backward=_backward_pads(problem, dtype, BlockSizes()))

  def config(self, block_sizes, problem: Problem, dtype, *, is_causal: bool,
             scores: Scores | None = None,
             mask: Mask | None = None) -> BlockSizes:
    """The call's tiles: `block_sizes`, or the defaults for its head dim,
    causality, key length, and (`persistent`) whether the call's mask is at
    most causality (the persistent schedule weighs items by the band);
    with ALiBi K/V tiles of at most `ALIBI_VECTORS_MAX_COLUMNS` rows."""
    head_dim = config.kernel_head_dim(problem.head_dim, problem.value_head_dim)
    fp8 = scores is not None and bool(scores.fp8)
    # FP8 calls arrive as rounded values (bf16 or float32): their forward
    # reads e4m3 tiles, their backward is the bf16 kernels'.
    itemsize = 2 if fp8 else jnp.dtype(dtype).itemsize
    own = isinstance(block_sizes, BlockSizes)
    blocks = (block_sizes if own else
              BlockSizes.get_default(
                  problem.head_dim if problem.value_head_dim ==
                  problem.head_dim else head_dim, is_causal,
                  band_only=mask in (Mask(), Mask(is_causal=True)),
                  kv_len=problem.kv_len))
    if (not own and scores is not None and scores.alibi
        and blocks.block_kv > config.ALIBI_VECTORS_MAX_COLUMNS):
      # ALiBi by vectors (`tiles.alibi_by_vectors`) on narrower tiles.
      blocks = dataclasses.replace(
          blocks, block_kv=config.ALIBI_VECTORS_MAX_COLUMNS)
    if fp8 and not own:  # The FP8 forward's K/V tiles, overlapped.
      blocks = dataclasses.replace(blocks, overlap=True)
      rows = config.FP8_BLOCK_KV.get(head_dim)
      if rows is not None:  # 256 rows fit beside one Q buffer, not two.
        want = rows[0 if is_causal else 1]
        tiles = [dataclasses.replace(blocks, block_kv=want),
                 dataclasses.replace(blocks, block_kv=want, persistent=False),
                 dataclasses.replace(blocks, block_kv=rows[0])]
        blocks = next((t for t in tiles if t.smem_bytes(
            head_dim, 1, fp8=True) <= config.SMEM_BYTES), tiles[-1])
      if head_dim in config.FP8_BACKWARD_DEFAULT_HEAD_DIMS:
        blocks = dataclasses.replace(blocks, fp8_backward=True)
      if head_dim in config.FP8_STMATRIX_DEFAULT_HEAD_DIMS:
        blocks = dataclasses.replace(blocks, e4m3_stmatrix=True)
      blocks = dataclasses.replace(
          blocks,
          e4m3_registers=head_dim in config.FP8_REGISTERS_DEFAULT_HEAD_DIMS,
          e4m3_registers_bwd=(head_dim in
                              config.FP8_REGISTERS_BWD_DEFAULT_HEAD_DIMS))
    blocks.check_overlap(fp8)
    if fp8 and blocks.block_kv % 64:
      raise ValueError(f"block_sizes.block_kv must be a multiple of 64 with "
                       f"fp8, got {blocks.block_kv}")
    if blocks.fused_dq and head_dim not in config.FUSED_DQ_HEAD_DIMS:
      value = ("" if problem.value_head_dim == problem.head_dim else
               f" (value's {problem.value_head_dim})")
      raise ValueError(f"block_sizes.fused_dq=True needs a head_dim in "
                       f"{config.FUSED_DQ_HEAD_DIMS}, got "
                       f"{problem.head_dim}{value}")
    smem = (blocks.smem_bytes(head_dim, 1, fp8=True) if fp8 else
            blocks.smem_bytes(head_dim, itemsize))
    if smem > config.SMEM_BYTES:
      raise ValueError(f"block_sizes {blocks} need {smem} bytes of shared "
                       f"memory at head_dim {head_dim}, more than "
                       f"the {config.SMEM_BYTES} of an H100/H200")
    smem = blocks.backward_smem_bytes(head_dim, itemsize)
    if smem > config.SMEM_BYTES:
      raise ValueError(f"block_sizes {blocks} need {smem} bytes of shared "
                       f"memory in the backward at head_dim {head_dim}, more "
                       f"than the {config.SMEM_BYTES} of an H100/H200")
    return blocks

  def forward(self, q, k, v, operands: Operands, *, mask: Mask,
              scores: Scores, config: BlockSizes):
    from pallas_kernels.mosaic_gpu import flash_fwd
    if scores.fp8:
      if operands.fp8_q is None:
        raise ValueError("the Mosaic FP8 forward reads the call's e4m3 "
                         "values (Operands.fp8_q, ...), which this part of "
                         "the call lacks")
      q8, k8, vt8, scales = flash_fwd.fp8_operands(operands)
      o, lse = flash_fwd.flash_forward(q8, k8, vt8, operands, mask=mask,
                                       scores=scores, block_sizes=config,
                                       fp8_scales=scales)
      return o.astype(q.dtype), lse
    (q,), (k, v) = without_padding(mask, operands.q_ids, operands.kv_ids,
                                   (q,), (k, v))
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1] or Columns.of(
        q.dtype, value_dim, config.block_kv, q.shape[1], k.shape[1]) is None:
      q, k, v = _pad_heads(q, k, v)
    o, lse = flash_fwd.flash_forward(q, k, v, operands, mask=mask,
                                     scores=scores, block_sizes=config)
    return o[..., :value_dim], lse

  def decode(self, q, k, v, kv_lengths, *, mask: Mask, scores: Scores,
             num_splits=None, page_table=None, sinks=None):
    """(o [B, T, N, Hv], lse [B, N, T]) of T new tokens at positions
    kv_lengths[b] - T + t: up to `config.SPLIT_KV_MAX_QUERIES` against a
    contiguous cache, the split-KV kernel (`split_kv_heads` KV heads a
    tile); more, against a contiguous or paged cache, the forward kernel
    with query offsets and key ids (`core.prepare.decode_as_forward`; pages
    gathered by XLA first, positions past a length zeroed)."""
    # The split-KV kernel balances equal runs of tiles over the
    # multiprocessors; the forward takes a CTA per 2 * block_q queries.
    del num_splits
    if q.shape[1] <= config.SPLIT_KV_MAX_QUERIES:
      from pallas_kernels.mosaic_gpu import flash_decode
      return flash_decode.flash_decode(
          q, k, v, kv_lengths, scores=scores, mask=mask,
          heads_per_cta=split_kv_heads(q.shape[1], q.shape[2], k.shape[2]),
          consumers=2, sinks=sinks)
    k, v, mask, operands, problem = decode_as_forward(
        q, k, v, kv_lengths, mask, page_table, sinks)
    return self.forward(q, k, v, operands, mask=mask, scores=scores,
                        config=self.config(None, problem, q.dtype,
                                           is_causal=True, mask=mask))

  def backward_unsupported(self, problem: Problem, dtype, *, mask: Mask,
                           scores: Scores,
                           operands: Operands) -> str | None:
    """Declines query offsets (its kernels have none), and a bias per
    (query, key) pair: the dK/dV kernel reads such tiles keys-down, so
    XLA would write a transposed copy of the bias on every backward
    (slower than the Triton backward after this forward)."""
    del problem, dtype, scores
    if mask.has_q_offsets:
      return "the Mosaic GPU backward takes no query offsets"
    bias = operands.bias
    if bias is not None and bias.shape[2] > 1 and bias.shape[3] > 1:
      return ("the Mosaic GPU backward reads a bias per (query, key) pair "
              "transposed (a copy of it every step)")
    return None

  def backward(self, q, k, v, operands: Operands, delta, lse, do, dlse, *,
               mask: Mask, scores: Scores, config: BlockSizes):
    """(dq, dk, dv, Operands()): no operand's gradient (the dispatch takes
    a bias's from a backend that gives it; no arrays a score_mod closes
    over, see `unsupported`). FP8 calls with `BlockSizes.fp8_backward` at
    head dims `config.FP8_BACKWARD_HEAD_DIMS` run every matmul in e4m3 on
    the call's e4m3 values and dO quantized as they are, by
    `fp8_rounding` (`flash_bwd`);
    other FP8 calls (values on e4m3's grid times a power-of-two scale,
    exact in bf16) the bf16 kernels on those values, P unrounded, as the
    blockwise backward takes it."""
    from pallas_kernels.mosaic_gpu.flash_bwd import flash_backward
    if (scores.fp8 and config.fp8_backward and operands.fp8_q is not None
        and q.shape[-1] in FP8_BACKWARD_HEAD_DIMS):
      dq, dk, dv = flash_backward(q, k, v, operands, delta, lse, do,
                                  mask=mask, scores=scores,
                                  block_sizes=config,
                                  fp8_rounding=self.fp8_rounding())
      return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
              Operands())
    if scores.fp8:
      dtype = q.dtype
      q, k, v, do = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
      scores = dataclasses.replace(scores, fp8=False)
      dq, dk, dv, grads = self.backward(
          q, k, v, operands, delta, lse, do, dlse, mask=mask, scores=scores,
          config=config)
      return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype), grads
    (q, do), (k, v) = without_padding(mask, operands.q_ids, operands.kv_ids,
                                      (q, do), (k, v))
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    problem = Problem(batch=q.shape[0], q_len=q.shape[1], kv_len=k.shape[1],
                      num_heads=q.shape[2], num_kv_heads=k.shape[2],
                      head_dim=head_dim, unbatched=False,
                      value_head_dim=value_dim)
    if _backward_pads(problem, q.dtype, config):
      q, k, v, do = _pad_heads(q, k, v, do)
    dq, dk, dv = flash_backward(q, k, v, operands, delta, lse, do, mask=mask,
                                scores=scores, block_sizes=config)
    return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :value_dim],
            Operands())
