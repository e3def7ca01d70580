"""Equivalence testing of attention: the tolerances per dtype, stated once,
and `assert_attention_close`, built on chex.

Errors are relative Frobenius norms, ||x - ref|| / ||ref||, against a float32
reference (`jax_flash.reference_attention` on the inputs upcast, at HIGHEST
precision). For float32 inputs the bounds are fixed. For bfloat16 and float16
the honest bound is what plain attention reaches in that dtype: pass its
result as `baseline` (e.g. `jax.nn.dot_product_attention` on the same
low-precision inputs, or `reference.attend(..., compute_dtype=dtype)` for
features jax.nn lacks), and each leaf may be at most `baseline_ratio` times
the baseline's own error, and never needs to beat `floor`, the dtype's unit
roundoff (where the baseline is exact, e.g. dQ = 0 for a row that sees one
key, a FlashAttention backward still rounds O to the dtype in D = rowsum(dO*O)).
Without a baseline the fixed bounds apply: a few times what plain attention
reaches on random inputs.

    from jax_flash.testing import assert_attention_close
    assert_attention_close({"out": out, "dq": dq}, {"out": ref, "dq": ref_dq},
                           dtype=jnp.bfloat16, baseline={"out": ..., "dq": ...})

A leaf whose path names `lse` or `logsumexp` is held to the logsumexp bound,
one named `out` or `output` (or a tree that is a single array) to the output
bound, every other leaf (gradients, parameters) to the gradient bound.
"""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
  out: float    # Output: relative error bound without a baseline.
  lse: float    # Logsumexp (always float32; compared where finite).
  grad: float   # Gradients: relative error bound without a baseline.
  # Low precision with a baseline: bound = max(ratio * its error, floor).
  baseline_ratio: float | None = None
  floor: float = 0.0


# Measured on the CPU (interpret mode) over the test cases, 2026-11-30: plain
# attention in bfloat16 (jax.nn's XLA path, or reference.attend with bf16
# matmul operands: the same numbers) reaches 2.1e-3 to 2.4e-3 on the output
# and 2.4e-3 to 2.7e-3 on the gradients; the kernels 1.7e-3 to 2.1e-3 and
# 2.4e-3 to 3.4e-3 (at most 1.3x plain). float16: 2.6e-4 to 3.4e-4 plain,
# the kernels at most 1.3x. float32 kernels: 2e-7 to 4e-7.
TOLERANCES = {
    jnp.dtype(jnp.float32): Tolerance(out=2e-5, lse=2e-6, grad=5e-5),
    jnp.dtype(jnp.bfloat16): Tolerance(out=6e-3, lse=2e-6, grad=8e-3,
                                       baseline_ratio=2.0, floor=2.0**-8),
    jnp.dtype(jnp.float16): Tolerance(out=8e-4, lse=2e-6, grad=1e-3,
                                      baseline_ratio=2.0, floor=2.0**-11),
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


def _kind(path) -> str:
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", ""))))
           for k in path]
  if any(n in ("lse", "logsumexp") for n in names):
    return "lse"
  if not names or any(n in ("out", "output") for n in names):
    return "out"
  return "grad"


def _leaf_error(x, ref) -> float:
  """relative_error where ref is finite; inf if x and ref disagree on which
  entries are -inf (rows that see no key) or x holds NaN."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if np.isnan(x).any() or not np.array_equal(np.isneginf(x),
                                             np.isneginf(ref)):
    return float("inf")
  keep = np.isfinite(ref)
  return relative_error(np.where(keep, x, 0.0), np.where(keep, ref, 0.0))


def assert_attention_close(actual, expected, dtype=None, *, baseline=None):
  """Asserts two pytrees of attention results (outputs, logsumexps,
  gradients) agree within the tolerance of `dtype`.

  actual: the results under test; expected: the float32 reference, same tree
  structure and shapes. dtype: the inputs' dtype, which picks the tolerance
  (default: the dtype of actual's first leaf). baseline: for bfloat16/float16,
  the same results from plain attention in that dtype (see the module
  docstring); ignored for float32. Raises AssertionError naming every leaf
  out of bounds with its error and bound.
  """
  chex.assert_trees_all_equal_structs(actual, expected)
  chex.assert_trees_all_equal_shapes(actual, expected)
  if dtype is None:
    dtype = jax.tree.leaves(actual)[0].dtype
  tol = tolerance(dtype)
  use_baseline = baseline is not None and tol.baseline_ratio is not None
  if use_baseline:
    chex.assert_trees_all_equal_structs(baseline, expected)
  paths = jax.tree_util.tree_flatten_with_path(expected)[0]
  bad = []
  for i, (path, ref) in enumerate(paths):
    x = jax.tree.leaves(actual)[i]
    kind = _kind(path)
    error = _leaf_error(x, ref)
    bound = getattr(tol, kind)
    if use_baseline and kind != "lse":
      base = _leaf_error(jax.tree.leaves(baseline)[i], ref)
      bound = max(tol.baseline_ratio * base, tol.floor)
    if not error <= bound:
      name = jax.tree_util.keystr(path) or "<root>"
      bad.append(f"{name}: error {error:.3g} > bound {bound:.3g}")
  if bad:
    raise AssertionError(
        f"attention results differ beyond the {jnp.dtype(dtype).name} "
        "tolerance: " + "; ".join(bad))
