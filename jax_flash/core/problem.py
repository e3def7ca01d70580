"""What every backend reads of one call: its shapes (`Problem`) and the
whole description (`Spec`: shapes, mask, score modifications, optional
arrays), as `prepare.prepare` builds it from the public arguments."""
from __future__ import annotations

import dataclasses

from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores


@dataclasses.dataclass(frozen=True)
class Problem:
  """Shapes of one call after validation (always batched): query
  [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv], output [B, T, N, Hv]."""
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  unbatched: bool
  value_head_dim: int | None = None  # None: head_dim.

  def __post_init__(self):
    if self.value_head_dim is None:
      object.__setattr__(self, "value_head_dim", self.head_dim)


@dataclasses.dataclass(frozen=True)
class Spec:
  problem: Problem
  mask: Mask
  scores: Scores
  operands: Operands
