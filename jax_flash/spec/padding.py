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
