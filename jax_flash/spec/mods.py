"""User-written mask and score modifications (flex attention) in a form every
backend reads: a function applied elementwise with broadcasting, hashable by
the function itself (a jit static)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ElementwiseMod:
  """`fn` (a mask_mod(b, h, q_idx, kv_idx) or a score_mod(score, b, h, q_idx,
  kv_idx)) that closes over no array, applied elementwise: its arguments
  broadcast against each other, so a function written for scalars works on
  the index tiles of a kernel."""
  fn: Callable

  def __call__(self, *args):
    return jnp.vectorize(self.fn)(*args)
