"""`Options`: every argument of one `flash_attention` call but the query,
key and value, built once where the call is made and validated there,
then passed whole: to `prepare` (which reads its arrays against the
call's shapes), the dispatch, the reference, the Flax modules and the
context-parallel rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jax_flash.core import checks
from jax_flash.core import fp8 as fp8_lib

# `implementation`: see `flash_attention`.
IMPLEMENTATIONS = ("pallas", "mosaic", "triton", "interpret", "xla")
VERSIONS = (1, 2)
# `context_parallel`: how a sequence-sharded call splits its work.
STRATEGIES = ("auto", "all_to_all", "all_gather", "ring", "ring_all_to_all")


@dataclasses.dataclass(frozen=True)
class Options:
  """The arguments of `flash_attention` after query, key and value, with
  its meanings and defaults. The arrays (bias ... descale) are checked
  against the call's shapes by `prepare`; everything else is checked
  here, each error a ValueError naming the argument."""
  bias: Any = None
  mask: Any = None
  scale: Any = None  # A number, or a traced scalar (`checks.fold_traced_scale`).
  is_causal: bool = False
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  local_window_size: Any = None
  segment_ids: Any = None
  logits_soft_cap: Any = None
  alibi_slopes: Any = None
  dropout_rate: Any = 0.0
  dropout_rng: Any = None
  dropout_broadcast: bool = False
  sinks: Any = None
  query_offset: Any = None
  return_residual: bool = False
  implementation: str | None = None
  block_sizes: Any = None
  version: int = 2
  fp8: bool | str = False
  descale: Any = None
  out_dtype: Any = None
  context_parallel: str = "auto"
  sequence_axis: Any = None

  def __post_init__(self):
    if self.implementation is not None and (
        self.implementation not in IMPLEMENTATIONS):
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                       f"None, got {self.implementation!r}")
    if self.version not in VERSIONS:
      raise ValueError(f"version must be 1 or 2, got {self.version!r}")
    if self.context_parallel not in STRATEGIES:
      raise ValueError(f"context_parallel must be one of {STRATEGIES}, got "
                       f"{self.context_parallel!r}")
    fp8_lib.check_fp8(self.fp8)
    checks.check_window(self.local_window_size)
    checks.check_soft_cap(self.logits_soft_cap)
    checks.check_dropout(self.dropout_rate, self.dropout_rng)
    if self.query_offset is not None and self.sequence_axis is not None:
      raise ValueError("query_offset does not go with sequence_axis (each "
                       "device's chunk has an offset of its own there)")

  @property
  def fp8_kind(self):
    """What `Scores.fp8` records: "descale" (float8 inputs with their
    scales), "amax" (inputs rounded by `fp8`) or False."""
    if self.descale is not None:
      return "descale"
    return "amax" if self.fp8 is not False else False

  def replace(self, **changes) -> Options:
    return dataclasses.replace(self, **changes)
