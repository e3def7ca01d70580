"""Forward, logsumexp and gradients of the kernels against the reference."""
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.testing import relative_error, tolerance
from tests.cases import CASES, V1_CASES, Case, inputs
from tests.conftest import KERNEL_IMPL


def _run(case: Case, impl: str, version: int = 2, seed: int = 0):
  """out, lse and (dq, dk, dv) for random inputs and random cotangents."""
  q, k, v, do = inputs(case, seed)
  dlse = jax.random.normal(jax.random.key(seed + 1),
                           (case.batch, case.q_len, case.num_heads))

  def f(q, k, v):
    if impl == "reference":
      up = lambda x: x.astype(jnp.float32)
      return jax_flash.reference_attention(
          up(q), up(k), up(v), is_causal=case.causal, return_residual=True)
    return jax_flash.flash_attention(
        q, k, v, is_causal=case.causal, return_residual=True,
        implementation=impl, block_sizes=case.block_sizes, version=version)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  grads = vjp((do.astype(out.dtype), dlse))
  return out, lse, grads


def _check(case: Case, impl: str, version: int = 2):
  out, lse, grads = jax.jit(lambda: _run(case, impl, version))()
  ref_out, ref_lse, ref_grads = jax.jit(lambda: _run(case, "reference"))()
  tol = tolerance(case.dtype)
  assert out.dtype == jnp.dtype(case.dtype) and out.shape == ref_out.shape
  assert lse.shape == (case.batch, case.q_len, case.num_heads)
  errors = {"out": relative_error(out, ref_out),
            "lse": relative_error(lse, ref_lse)}
  for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert g.dtype == jnp.dtype(case.dtype) and g.shape == rg.shape
    errors[name] = relative_error(g, rg)
  bounds = {"out": tol.out, "lse": tol.lse, "dq": tol.grad, "dk": tol.grad,
            "dv": tol.grad}
  bad = {n: (e, bounds[n]) for n, e in errors.items() if not e <= bounds[n]}
  assert not bad, f"{case}: (error, bound) {bad}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case):
  _check(case, KERNEL_IMPL)


@pytest.mark.parametrize("case", V1_CASES, ids=str)
def test_version1_matches_reference(case):
  _check(case, KERNEL_IMPL, version=1)


def test_xla_implementation_is_the_reference():
  case = CASES[9]
  q, k, v, _ = inputs(case)
  out = jax_flash.flash_attention(q, k, v, is_causal=True, implementation="xla")
  ref = jax_flash.reference_attention(q, k, v, is_causal=True)
  assert relative_error(out, ref) == 0.0


def test_unbatched_inputs():
  case = CASES[2]
  q, k, v, _ = inputs(case)
  out, lse = jax_flash.flash_attention(
      q[0], k[0], v[0], is_causal=True, implementation=KERNEL_IMPL,
      return_residual=True)
  ref, ref_lse = jax_flash.reference_attention(
      q, k, v, is_causal=True, return_residual=True)
  assert out.shape == q.shape[1:] and lse.shape == ref_lse.shape[1:]
  assert relative_error(out, ref[0]) <= tolerance(q.dtype).out
  assert relative_error(lse, ref_lse[0]) <= tolerance(q.dtype).lse


def test_scale_argument():
  case = CASES[0]
  q, k, v, _ = inputs(case)
  out = jax_flash.flash_attention(q, k, v, scale=0.37,
                                  implementation=KERNEL_IMPL)
  ref = jax_flash.reference_attention(q, k, v, scale=0.37)
  assert relative_error(out, ref) <= tolerance(q.dtype).out
  # And the scale matters: the default scale gives another answer.
  assert relative_error(jax_flash.reference_attention(q, k, v), ref) > 0.01


def test_matches_jax_nn_dot_product_attention():
  case = CASES[8]
  q, k, v, _ = inputs(case)
  for causal in (False, True):
    ours = jax_flash.flash_attention(q, k, v, is_causal=causal,
                                     implementation=KERNEL_IMPL)
    theirs = jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        is_causal=causal)
    assert relative_error(ours, theirs) <= tolerance(q.dtype).out
