"""User-written mask and score modifications (flex attention) in a form every
backend reads: a function applied elementwise with broadcasting, hashable by
the function itself (a jit static)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ElementwiseMod:
  """`fn` (a mask_mod(b, h, q_idx, kv_idx, *consts) or a score_mod(score, b,
  h, q_idx, kv_idx, *consts)) applied elementwise: the index arguments
  broadcast against each other, so a function written for scalars works on
  the index tiles of a kernel or a block. `consts` are the arrays the user's
  function closed over, hoisted into arguments (`flex._elementwise`; they
  travel in `Operands.mask_consts` / `score_consts`: the score_mod's
  floating ones get gradients); kernels take only functions without any."""
  fn: Callable

  def __call__(self, *args, consts=()):
    return jnp.vectorize(lambda *xs: self.fn(*xs, *consts))(*args)
