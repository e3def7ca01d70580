"""JAX's debugging modes with every public entry point (flash_attention,
flex_attention, flash_decode, ring_attention, the Flax modules): under
`jax.disable_jit()` a call gives the jitted call's values (forward and
gradients), and under `jax.debug_nans` a NaN input raises JAX's
FloatingPointError while finite inputs (masked rows included) raise
nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_flash
from jax_flash.testing import assert_attention_close
from tests.cases import random_inputs
from tests.conftest import KERNEL_IMPL

IMPLS = [KERNEL_IMPL, "xla"]


def _qkv(t=24, s=40):
  q, k, v, _ = random_inputs(2, t, s, 4, 2, 16, jnp.float32)
  return q, k, v


def _calls(impl):
  """name -> f(q, k, v): each public entry point, forward and a gradient."""
  lengths = jnp.array([40, 17])  # Rows of batch 1 past 17 keys: masked.

  def flash(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=True,
                                     key_value_seq_lengths=lengths,
                                     implementation=impl)

  block_mask = jax_flash.create_block_mask(
      lambda b, h, i, j: i + 16 >= j, None, None, 24, 40)

  def flex(q, k, v):
    return jax_flash.flex_attention(
        q, k, v, lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j),
        block_mask=block_mask, implementation=impl)

  def grad_of(f):
    return lambda q, k, v: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))),
                                    argnums=(0, 1, 2))(q, k, v)

  def decode(q, k, v):
    return jax_flash.flash_decode(q[:, :2], k, v, kv_lengths=lengths,
                                  implementation=impl)

  return {"flash_attention": flash, "flash_attention_grad": grad_of(flash),
          "flex_attention": flex, "flex_attention_grad": grad_of(flex),
          "flash_decode": decode}


def _modules(impl):
  """name -> (f(x), x): the Flax modules with their parameters."""
  x = jax.random.normal(jax.random.key(5), (2, 24, 64))
  layer = jax_flash.nnx.FlashAttention(
      num_heads=4, in_features=64, num_kv_heads=2, decode=False,
      implementation=impl, rngs=nnx.Rngs(0))
  module = jax_flash.linen.FlashAttention(num_heads=4, is_causal=True,
                                          implementation=impl)
  params = module.init(jax.random.key(2), x)
  swapped = nnx.MultiHeadAttention(
      num_heads=4, in_features=64, decode=False, rngs=nnx.Rngs(1),
      attention_fn=jax_flash.nnx.dot_product_attention)
  return {"nnx.FlashAttention": (lambda x: layer(x, is_causal=True), x),
          "linen.FlashAttention": (lambda x: module.apply(params, x), x),
          "nnx.dot_product_attention": (swapped, x)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(_calls("xla")))
def test_disable_jit_gives_the_jitted_values(impl, name):
  f = _calls(impl)[name]
  q, k, v = _qkv()
  with jax.disable_jit():
    eager = f(q, k, v)
  assert_attention_close(eager, jax.jit(f)(q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(_modules("xla")))
def test_disable_jit_runs_the_modules(impl, name):
  f, x = _modules(impl)[name]
  with jax.disable_jit():
    eager = f(x)
  assert_attention_close(eager, f(x))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(_calls("xla")))
def test_debug_nans_raises_on_a_nan_input_only(impl, name):
  f = _calls(impl)[name]
  q, k, v = _qkv()
  with jax.debug_nans(True):
    out = jax.jit(f)(q, k, v)  # Finite inputs, masked rows: no error.
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(out))
    with pytest.raises(FloatingPointError, match="nan"):
      jax.jit(f)(q.at[0, 1, 0, 3].set(jnp.nan), k, v)


@pytest.mark.parametrize("name", list(_modules("xla")))
def test_debug_nans_with_the_modules(name):
  f, x = _modules("xla")[name]
  with jax.debug_nans(True):
    f(x)
    with pytest.raises(FloatingPointError, match="nan"):
      f(x.at[0, 3, 1].set(jnp.nan))


def test_ring_attention_in_both_modes():
  mesh = jax.make_mesh((1,), ("sp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = _qkv(32, 32)
  f = lambda q, k, v: jax_flash.ring_attention(q, k, v, mesh=mesh,
                                               axis_name="sp", is_causal=True)
  with jax.disable_jit():
    eager = f(q, k, v)
  assert_attention_close(eager, jax.jit(f)(q, k, v))
  with jax.debug_nans(True), pytest.raises(FloatingPointError, match="nan"):
    jax.jit(f)(q.at[0, 1, 0, 3].set(jnp.nan), k, v)
