"""FlashAttention's point: compiled memory grows linearly in sequence length."""
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from tests.conftest import KERNEL_IMPL


def _grad_temp_bytes(attention, seq_len, **kwargs):
  x = jax.ShapeDtypeStruct((1, seq_len, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = attention(q, k, v, is_causal=True, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla", None])
def test_flash_memory_grows_linearly(implementation):
  small = _grad_temp_bytes(jax_flash.flash_attention, 1024,
                           implementation=implementation)
  large = _grad_temp_bytes(jax_flash.flash_attention, 4096,
                           implementation=implementation)
  assert large / small < 5, (small, large)


def test_reference_memory_grows_quadratically():
  # The contrast that makes the test above mean something.
  small = _grad_temp_bytes(jax_flash.reference_attention, 1024)
  large = _grad_temp_bytes(jax_flash.reference_attention, 4096)
  assert large / small > 12, (small, large)
