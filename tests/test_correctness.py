"""Forward, logsumexp and gradients of the kernels against the reference."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close, relative_error
from tests.cases import (CASES, SMALL_BLOCKS, V1_CASES, XLA_SMALL_BLOCKS, Case,
                         compare_with_reference, inputs, jax_nn_attention)
from tests.conftest import KERNEL_IMPL


def _check(case: Case, impl: str, version: int = 2):
  compare_with_reference(
      dict(is_causal=case.causal), case.dtype, version, shape=case.shape,
      block_sizes=case.block_sizes, implementation=impl)


@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name):
  _check(CASES[name], KERNEL_IMPL)


# Head dims above 256 (Gemma-style global layers: 512; 320 is padded to
# it), with their default tiles.
@pytest.mark.parametrize("case", [
    Case(1, 100, 130, 4, 2, 512, "bfloat16", True),
    Case(1, 40, 37, 2, 1, 320, "float32", False)], ids=str)
def test_head_dims_above_256(case):
  compare_with_reference(
      dict(is_causal=case.causal), case.dtype, shape=case.shape,
      block_sizes=None, implementation=KERNEL_IMPL)


@pytest.mark.parametrize("name", V1_CASES)
def test_version1_matches_reference(name):
  _check(CASES[name], KERNEL_IMPL, version=1)


@pytest.mark.parametrize("name", CASES)
def test_xla_matches_reference(name):
  """The "xla" backend (blockwise, plain jnp) on the same cases, with small
  blocks so every case has several."""
  case = CASES[name]
  compare_with_reference(dict(is_causal=case.causal), case.dtype,
                         shape=case.shape, block_sizes=XLA_SMALL_BLOCKS,
                         implementation="xla")


def test_unbatched_inputs():
  q, k, v, _ = inputs(CASES["f32_odd_small_tiles"])
  out, lse = jax_flash.flash_attention(
      q[0], k[0], v[0], is_causal=True, implementation=KERNEL_IMPL,
      return_residual=True)
  ref, ref_lse = jax_flash.reference_attention(
      q, k, v, is_causal=True, return_residual=True)
  chex.assert_shape(out, q.shape[1:])
  assert_attention_close({"out": out, "lse": lse},
                         {"out": ref[0], "lse": ref_lse[0]})


def test_scale_argument():
  q, k, v, _ = inputs(CASES["f32_mha"])
  out = jax_flash.flash_attention(q, k, v, scale=0.37,
                                  implementation=KERNEL_IMPL)
  ref = jax_flash.reference_attention(q, k, v, scale=0.37)
  assert_attention_close(out, ref)
  # And the scale matters: the default scale gives another answer.
  assert relative_error(jax_flash.reference_attention(q, k, v), ref) > 0.01


def test_matches_jax_nn_dot_product_attention():
  q, k, v, _ = inputs(CASES["bf16_gqa_small_tiles"])
  for causal in (False, True):
    ours = jax_flash.flash_attention(q, k, v, is_causal=causal,
                                     implementation=KERNEL_IMPL)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    theirs = jax_nn_attention(*up, is_causal=causal)
    # jax.nn itself in bfloat16 is the baseline of the bfloat16 bound.
    plain = jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation="xla")
    assert_attention_close(ours, theirs, q.dtype, baseline=plain)


class WithAndWithoutJit(chex.TestCase):
  """The kernels under jit and without, one forward and backward (chex
  variants): the same results either way."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_and_gradients(self):
    case = CASES["f32_odd_small_tiles"]
    q, k, v, do = inputs(case)

    def grads(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=True, implementation=KERNEL_IMPL,
          block_sizes=SMALL_BLOCKS), q, k, v)
      return (out,) + vjp(do)

    got = self.variant(grads)(q, k, v)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, (q, q, k, v))
    ref_out, vjp = jax.vjp(lambda q, k, v: jax_flash.reference_attention(
        q, k, v, is_causal=True), q, k, v)
    assert_attention_close(
        dict(zip(("out", "dq", "dk", "dv"), got)),
        dict(zip(("out", "dq", "dk", "dv"), (ref_out,) + vjp(do))))


def test_xla_backend_backward_is_flash_attention_2s():
  """The "xla" backend's backward recomputes P from the logsumexp it is
  given (in ring_attention, that of more keys than the pair's): from the
  reference's forward it must give autodiff's gradients, bias included."""
  from jax_flash import _dispatch
  from jax_flash.core import prepare, softmax
  q, k, v, do = inputs(CASES["f32_mha_causal"])
  bias = jax.random.normal(jax.random.key(5), (1, 4, 128, 128))
  spec = prepare(q, k, v, bias=bias, is_causal=True, dropout_rate=0.2,
                 dropout_rng=jax.random.key(6), alibi_slopes=jnp.ones(4))
  dlse = jax.random.normal(jax.random.key(7), (2, 4, 128))

  def forward(q, k, v, bias):
    return jax_flash.reference.attend(
        q, k, v, dataclasses.replace(spec.operands, bias=bias),
        mask=spec.mask, scores=spec.scores)

  (o, lse), vjp = jax.vjp(forward, q, k, v, bias)
  expected = vjp((do, dlse))
  delta = softmax.backward_delta(o, do, dlse)
  dq, dk, dv, grads = _dispatch.XLA.backward(
      q, k, v, spec.operands, delta, lse, do, dlse, mask=spec.mask,
      scores=spec.scores, config=XLA_SMALL_BLOCKS)
  got = (dq, dk, dv, grads.bias)
  names = ("dq", "dk", "dv", "dbias")
  assert_attention_close(dict(zip(names, got)), dict(zip(names, expected)))
