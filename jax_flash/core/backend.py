"""`Backend`: what a kernel backend implements, and what the dispatch asks of it.

A backend is a hashable object (a frozen dataclass: it sits in a jit static)
with a name, what it needs, why it refuses a call, its block sizes, and the
forward, backward and decode of one problem. Backends read the problem as
`jax_flash.core` describes it (`Problem`, `Mask`, `Scores`, `Operands`) and
meet only through the logsumexp: natural log, float32 [B, N, T], so any
backend's backward may follow any backend's forward. `jax_flash._dispatch`
chooses the pair for each call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Protocol, runtime_checkable

import jax

from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores

# What a `flash_decode` call asks of a backend: nothing (a training call), or
# decoding against a contiguous or a paged cache.
Decode = Literal[False, "contiguous", "paged"]
# The operands whose gradients a backward may give (`Operands` fields).
DIFFERENTIABLE_OPERANDS = ("bias", "sinks", "score_consts")


@dataclasses.dataclass(frozen=True)
class Copies:
  """Whether XLA copies or pads arrays around a backend's forward and
  backward kernels for a call (a head dim padded, a length read through
  copies), which costs as much as short calls' kernels."""
  forward: bool = False
  backward: bool = False


@functools.cache
def differentiable_leaves(tree) -> tuple[int, ...]:
  """Positions, among the flat leaves of an `Operands` treedef `tree`, of
  the differentiable ones (`DIFFERENTIABLE_OPERANDS`)."""
  numbered = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
  return tuple(sorted(i for name in DIFFERENTIABLE_OPERANDS
                      for i in jax.tree.leaves(getattr(numbered, name))))


@runtime_checkable
class Backend(Protocol):
  """One kernel backend: the interface `jax_flash._dispatch` calls.

  `unsupported` and `backward_unsupported` return why the backend cannot
  (or should not) take a call, as a sentence the user may read, or None;
  the dispatch then asks the next backend. Gradients of the differentiable
  operands a backward leaves out (None in the `Operands` it returns, or a
  name missing from `operand_gradients`) come from a backend that gives
  them, from the same logsumexp.
  """

  name: str  # The `implementation` that names it.
  needs_gpu: bool  # Runs only where a GPU runs (or is compiled for).
  config_type: type  # Its block sizes: a frozen dataclass.
  # The `Operands` fields whose gradients its backward returns.
  operand_gradients: frozenset[str]

  def unsupported(self, problem: Problem, dtype, *, mask: Mask,
                  scores: Scores, decode: Decode = False) -> str | None:
    """Why its forward (or, with `decode`, its decode) cannot take the
    call; None if it can."""

  def copies(self, problem: Problem, dtype, *, mask: Mask) -> Copies:
    """What XLA copies around its kernels for this call, which it takes:
    facts the dispatch's table of measured preferences reads
    (`jax_flash._dispatch.NEXT_IS_FASTER`)."""

  def backward_unsupported(self, problem: Problem, dtype, *, mask: Mask,
                           scores: Scores,
                           operands: Operands) -> str | None:
    """Why its backward should not follow a forward of this call (any
    backend's); None if it takes it. Asked only of a backend whose
    `unsupported` is None."""

  def config(self, block_sizes: Any | None, problem: Problem, dtype, *,
             is_causal: bool, scores: Scores | None = None,
             mask: Mask | None = None) -> Any:
    """Its block sizes for the call: `block_sizes` (of `config_type`) or
    its defaults, fitted to the lengths."""

  def forward(self, q: jax.Array, k: jax.Array, v: jax.Array,
              operands: Operands, *, mask: Mask, scores: Scores,
              config: Any) -> tuple[jax.Array, jax.Array]:
    """(o [B, T, N, Hv] in q.dtype, lse [B, N, T] float32 natural log) of
    q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]."""

  def backward(self, q: jax.Array, k: jax.Array, v: jax.Array,
               operands: Operands, delta: jax.Array, lse: jax.Array,
               do: jax.Array, dlse: jax.Array, *, mask: Mask, scores: Scores,
               config: Any) -> tuple[jax.Array, jax.Array, jax.Array,
                                     Operands]:
    """(dq, dk, dv, Operands of the operand gradients it gives, None for
    the rest) from the forward's lse, the cotangents do (of o) and dlse,
    and delta = rowsum(do * o) - dlse, float32 [B, N, T]
    (`softmax.backward_delta`, computed once by the caller: the forward's
    o itself is not needed)."""

  def decode(self, q: jax.Array, k: jax.Array, v: jax.Array,
             kv_lengths: jax.Array, *, mask: Mask, scores: Scores,
             num_splits: int | None = None, page_table: jax.Array | None = None,
             sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(o [B, T, N, Hv], lse [B, N, T]) of T new queries at positions
    kv_lengths[b] - T + t against a contiguous cache k, v [B, S, K, H] or,
    with `page_table` [B, pages], pages k, v [P, page_size, K, H]."""
