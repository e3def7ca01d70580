"""`Operands`: the optional arrays of one attention problem."""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Operands:
  """The arrays the mask and the score modifications need (None: absent).

  A pytree: backends pass it to their kernels whole (a Pallas kernel gets an
  `Operands` of refs, built from an `Operands` of BlockSpecs).

  q_ids, kv_ids: int32 [B, T], [B, S]: segment ids and lengths as ids
    (`mask.make_ids`).
  dense_mask: int8 [Bm, Nm, Tm, Sm], each dim 1 (broadcast) or full; != 0
    means attend.
  bias: float [Bm, Nm, Tm, Sm], added to the logits; differentiable.
  alibi_slopes: float32 [B, N].
  dropout_seed: int32 [4], the dropout hash's seed (`dropout.seed_words`:
    two words, then offsets added to rows and columns).
  sinks: float32 [N], a sink logit per query head; differentiable.
  q_offsets: int32 [B], the position of each sequence's first query
    (`Mask.has_q_offsets`; decode and chunked prefill).
  tile_kinds: int8 [Bm, R, C], the kinds (empty, partial, full) of (query
    block, key block) pairs of `Mask.mod_tiles`, combined over heads: a
    mask_mod's (`Mask.mod`; flex attention) or a dense mask's
    (`mask.dense_tile_kinds`). Kernels get the tile ranges made of it.
  fp8_q, fp8_k, fp8_v, fp8_scales: an FP8 call's e4m3 values of query,
    key and value ([B, T, N, H], [B, S, K, H], [B, S, K, Hv]) and their
    float32 scales [B, K, 3] (x = x8 * scale, per batch and KV head; the
    library's, `jax_flash.core.fp8`, or the caller's descales), made once
    for kernels that read e4m3; q, k and v carry the same values in a
    float dtype for the others and the backward.
  mask_consts, score_consts: tuples of the arrays a mask_mod / score_mod
    closes over (`mods.ElementwiseMod`); the score_mod's are
    differentiable. The Triton kernels read a mask_mod's element by
    element (`mods.evaluate`); only the blockwise backend takes a
    score_mod's.
  """
  q_ids: jax.Array | None = None
  kv_ids: jax.Array | None = None
  dense_mask: jax.Array | None = None
  bias: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  dropout_seed: jax.Array | None = None
  sinks: jax.Array | None = None
  q_offsets: jax.Array | None = None
  tile_kinds: jax.Array | None = None
  fp8_q: jax.Array | None = None
  fp8_k: jax.Array | None = None
  fp8_v: jax.Array | None = None
  fp8_scales: jax.Array | None = None
  mask_consts: tuple | None = None
  score_consts: tuple | None = None

  @property
  def empty(self) -> bool:
    return not jax.tree.leaves(self)
