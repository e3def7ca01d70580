"""The optional operands of the kernels, and their BlockSpecs per grid layout.

Three grid layouts use them: (query tile, batch, head) for the forward and dQ
kernels, (key tile, batch, kv head) for dK/dV, whose refs hold a whole GQA
group of query heads, and (batch, head) for the FlashAttention-1 forward.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl

from pallas_kernels import masking
from pallas_kernels.tile_context import EXTRA_ORDER


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Extras:
  """Arrays the mask and score modifications need (None: absent).

  q_ids, kv_ids: int32 [B, T], [B, S] (see `masking.make_ids`).
  dense_mask: int8 [Bm, Nm, Tm, Sm], each dim 1 (broadcast) or full; != 0
    means attend.
  bias: float [Bm, Nm, Tm, Sm], added to the logits.
  slopes: float32 [B, N], ALiBi slopes.
  seed: int32 [2], the dropout hash's seed.
  """
  q_ids: jax.Array | None = None
  kv_ids: jax.Array | None = None
  dense_mask: jax.Array | None = None
  bias: jax.Array | None = None
  slopes: jax.Array | None = None
  seed: jax.Array | None = None

  def _build(self, table, ids_spec, pair_spec, slopes_spec):
    seed_spec = pl.BlockSpec((2,), lambda *_: (0,))
    names, specs, operands = [], [], []
    for name in EXTRA_ORDER:
      if name == "table":
        if table is None:
          continue
        value, spec = table
      else:
        value = getattr(self, name)
        if value is None:
          continue
        if name in ("q_ids", "kv_ids"):
          spec = ids_spec(value)
        elif name == "slopes":
          spec = slopes_spec
        elif name == "seed":
          spec = seed_spec
        else:
          spec = pair_spec(value)
      names.append(name)
      specs.append(spec)
      operands.append(value)
    return tuple(names), specs, operands

  def for_query_tiles(self, block_q: int, block_k: int):
    """(names, specs, operands) for a grid (query tile, batch, head)."""
    table = None
    if self.q_ids is not None:
      t = masking.id_block_table(self.q_ids, self.kv_ids, block_q, block_k)
      table = (t, pl.BlockSpec((None,) + t.shape[1:],
                               lambda i, b, n: (b, 0, 0)))

    def ids_spec(ids):
      return pl.BlockSpec((None, ids.shape[1]), lambda i, b, n: (b, 0))

    def pair_spec(x):
      bm, nm, tm, sm = x.shape
      return pl.BlockSpec((None, None, tm, sm), lambda i, b, n: (
          b if bm > 1 else 0, n if nm > 1 else 0, 0, 0))

    slopes_spec = None
    if self.slopes is not None:
      slopes_spec = pl.BlockSpec((None, self.slopes.shape[1]),
                                 lambda i, b, n: (b, 0))
    return self._build(table, ids_spec, pair_spec, slopes_spec)

  def for_key_tiles(self, block_q: int, block_k: int, group: int):
    """(names, specs, operands) for a grid (key tile, batch, kv head).

    Per-query-head operands come as the group's `group` heads: [G, ...].
    """
    table = None
    if self.q_ids is not None:
      t = masking.id_block_table(self.kv_ids, self.q_ids, block_k, block_q)
      table = (t, pl.BlockSpec((None,) + t.shape[1:],
                               lambda j, b, h: (b, 0, 0)))

    def ids_spec(ids):
      return pl.BlockSpec((None, ids.shape[1]), lambda j, b, h: (b, 0))

    def pair_spec(x):
      bm, nm, tm, sm = x.shape
      if nm > 1:
        return pl.BlockSpec((None, group, tm, sm), lambda j, b, h: (
            b if bm > 1 else 0, h, 0, 0))
      return pl.BlockSpec((None, None, tm, sm), lambda j, b, h: (
          b if bm > 1 else 0, 0, 0, 0))

    slopes_spec = None
    if self.slopes is not None:
      slopes_spec = pl.BlockSpec((None, group), lambda j, b, h: (b, h))
    return self._build(table, ids_spec, pair_spec, slopes_spec)

  def for_heads(self, block_q: int, block_k: int):
    """(names, specs, operands) for a grid (batch, head), key tiles outer."""
    table = None
    if self.q_ids is not None:
      t = masking.id_block_table(self.kv_ids, self.q_ids, block_k, block_q)
      table = (t, pl.BlockSpec((None,) + t.shape[1:], lambda b, n: (b, 0, 0)))

    def ids_spec(ids):
      return pl.BlockSpec((None, ids.shape[1]), lambda b, n: (b, 0))

    def pair_spec(x):
      bm, nm, tm, sm = x.shape
      return pl.BlockSpec((None, None, tm, sm), lambda b, n: (
          b if bm > 1 else 0, n if nm > 1 else 0, 0, 0))

    slopes_spec = None
    if self.slopes is not None:
      slopes_spec = pl.BlockSpec((None, self.slopes.shape[1]),
                                 lambda b, n: (b, 0))
    return self._build(table, ids_spec, pair_spec, slopes_spec)
