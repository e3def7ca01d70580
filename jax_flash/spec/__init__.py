"""The backend-neutral description of an attention problem.

Imports no kernel backend: every backend (`pallas_kernels.triton`, ...), the
reference and the dispatch read it.

- `checks`: trace-time validation of the public arguments (`Problem`).
- `mask`: which pairs attend (band, ids, query offset) and which tiles to
  skip, visit whole or mask.
- `scores`: raw scores -> logits (scale, soft-cap, ALiBi, bias) and back.
- `dropout`: the counter-based keep bits.
- `softmax`: online-softmax statistics, the logsumexp convention, the merge
  of partial results.
- `operands`: `Operands`, the optional arrays.
- `problem`: `prepare`, from the public arguments to a `Spec`.
"""
from jax_flash.spec.checks import Problem
from jax_flash.spec.mask import Mask
from jax_flash.spec.operands import Operands
from jax_flash.spec.problem import Spec, prepare
from jax_flash.spec.scores import Scores

__all__ = ["Mask", "Operands", "Problem", "Scores", "Spec", "prepare"]
