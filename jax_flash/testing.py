"""Tolerances and error measures for equivalence tests, stated once.

Errors are relative Frobenius norms, ||x - ref|| / ||ref||, against
`reference_attention` run in float32 at HIGHEST precision on the same
(upcast) inputs. The low-precision bounds sit a few times above the error of
rounding P (and the output) to the input dtype, which is what a correct
kernel can reach; float32 inputs use full float32 dots.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
  out: float    # output, relative Frobenius error
  lse: float    # logsumexp (always computed in float32)
  grad: float   # dq, dk, dv


TOLERANCES = {
    jnp.dtype(jnp.float32): Tolerance(out=2e-5, lse=2e-6, grad=5e-5),
    jnp.dtype(jnp.bfloat16): Tolerance(out=1.2e-2, lse=2e-6, grad=2.5e-2),
    jnp.dtype(jnp.float16): Tolerance(out=2e-3, lse=2e-6, grad=4e-3),
}


def tolerance(dtype) -> Tolerance:
  return TOLERANCES[jnp.dtype(dtype)]


# Below this root-mean-square the reference counts as zero, and the error is
# measured against this floor instead (e.g. dQ, dK of a row with a single
# visible key: exactly 0 in exact arithmetic, rounding noise in any other).
RMS_FLOOR = 1e-3


def relative_error(x, ref) -> float:
  """||x - ref|| / max(||ref||, RMS_FLOOR * sqrt(size)), in float64.

  NaN or inf anywhere in x gives inf.
  """
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if x.shape != ref.shape:
    raise ValueError(f"shape {x.shape} != reference shape {ref.shape}")
  if not np.all(np.isfinite(x)):
    return float("inf")
  denom = max(np.linalg.norm(ref), RMS_FLOOR * np.sqrt(max(ref.size, 1)))
  return float(np.linalg.norm(x - ref) / denom)
