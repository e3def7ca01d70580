"""Forward, logsumexp and gradients of the kernels against the reference."""
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.testing import relative_error, tolerance
from tests.cases import (CASES, V1_CASES, Case, compare_with_reference, inputs,
                         jax_nn_attention)
from tests.conftest import KERNEL_IMPL


def _check(case: Case, impl: str, version: int = 2):
  compare_with_reference(
      dict(is_causal=case.causal), case.dtype, version,
      shape=(case.batch, case.q_len, case.kv_len, case.num_heads,
             case.num_kv_heads, case.head_dim),
      block_sizes=case.block_sizes, implementation=impl)


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
    theirs = jax_nn_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        is_causal=causal)
    assert relative_error(ours, theirs) <= tolerance(q.dtype).out
