"""Padding a sequence axis to a tile multiple (every backend that tiles)."""
from __future__ import annotations

import jax.numpy as jnp


def round_up(n: int, multiple: int) -> int:
  """The least multiple of `multiple` >= n (static ints)."""
  return -(-n // multiple) * multiple


def pad_to(x, axis: int, size: int, value=0, *, broadcast: bool = False):
  """x padded with `value` to `size` along `axis` (None unchanged).

  broadcast: x is a mask or bias that may broadcast along `axis`: a
  dimension of 1 stays 1. Otherwise a length of 1 is padded like any other
  (a sequence of one token)."""
  if (x is None or x.shape[axis] == size
      or (broadcast and x.shape[axis] == 1)):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def pad_pairs(x, q_rows: int, kv_rows: int, *, transposed: bool = False):
  """A per-pair operand (`Operands.dense_mask`, int8, or `Operands.bias`;
  [Bm, Nm, Tm, Sm], each dim 1 or full) padded with 0 to q_rows queries
  and kv_rows keys, a dim of 1 kept (the kernels broadcast it); the last
  two dims swapped if `transposed` (keys-down tiles); None for None."""
  if x is None:
    return None
  x = pad_to(pad_to(x, 2, q_rows, broadcast=True), 3, kv_rows, broadcast=True)
  return x.swapaxes(2, 3) if transposed else x
