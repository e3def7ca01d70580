"""The backend-neutral description of an attention problem: the bottom
layer, which every backend (`pallas_kernels.triton`, ...), the reference,
the dispatch and the API read. It imports nothing of theirs.

- `problem`: `Problem` (a call's shapes) and `Spec` (the whole description).
- `checks`: trace-time validation of the public arguments.
- `prepare`: from the public arguments to a `Spec`.
- `mask`: which pairs attend (band, ids, query offset) and which tiles to
  skip, visit whole or mask.
- `scores`: raw scores -> logits (scale, soft-cap, ALiBi, bias) and back.
- `dropout`: the counter-based keep bits.
- `softmax`: online-softmax statistics, the logsumexp convention, the merge
  of partial results.
- `operands`: `Operands`, the optional arrays.
- `fp8`, `mods`, `padding`, `device`, `backend`: FP8 quantization, a user's
  mask_mod/score_mod, padding to tiles, the GPU a call targets, and the
  interface every backend implements.
"""
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.prepare import prepare
from jax_flash.core.problem import Problem, Spec
from jax_flash.core.scores import Scores

__all__ = ["Mask", "Operands", "Problem", "Scores", "Spec", "prepare"]
