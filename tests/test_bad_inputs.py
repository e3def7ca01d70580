"""Bad arguments fail at trace time with a ValueError naming the argument."""
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import BlockSizes
from tests.conftest import KERNEL_IMPL


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


Q = _sds((2, 64, 4, 64))
KV = _sds((2, 32, 2, 64))


def _trace(q, k, v, **kwargs):
  """Traces without running: errors must come from tracing alone."""
  kwargs.setdefault("implementation", KERNEL_IMPL)
  jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, **kwargs)).trace(
      q, k, v)


@pytest.mark.parametrize("q, k, v, kwargs, match", [
    (_sds((64, 64)), KV, KV, {}, r"query must have shape \[batch, q_len"),
    (_sds((1, 2, 64, 4, 64)), KV, KV, {}, "query must have shape"),
    (Q, _sds((32, 2, 64)), KV, {}, r"key must have the same rank as query"),
    (Q, KV, _sds((2, 32, 2, 32)), {}, "value must have the same shape as key"),
    (Q, _sds((3, 32, 2, 64)), _sds((3, 32, 2, 64)), {}, "key batch size 3"),
    (Q, _sds((2, 32, 2, 32)), _sds((2, 32, 2, 32)), {}, "key head_dim 32"),
    (Q, _sds((2, 32, 3, 64)), _sds((2, 32, 3, 64)), {},
     "num_kv_heads=3 must divide query num_heads=4"),
    (Q, _sds((2, 32, 2, 64), jnp.bfloat16), KV, {}, "must share one dtype"),
    (_sds((2, 64, 4, 64), jnp.int32), _sds((2, 32, 2, 64), jnp.int32),
     _sds((2, 32, 2, 64), jnp.int32), {}, "query dtype must be floating"),
    (_sds((2, 64, 4, 8)), _sds((2, 32, 2, 8)), _sds((2, 32, 2, 8)), {},
     r"head_dim .* must be in \[16, 256\].* got 8"),
    (_sds((2, 64, 4, 320)), _sds((2, 32, 2, 320)), _sds((2, 32, 2, 320)), {},
     r"head_dim .* got 320"),
    (Q, KV, KV, {"block_sizes": (128, 64)}, "block_sizes must be a"),
    (Q, KV, KV, {"version": 3}, "version must be 1 or 2"),
    (Q, KV, KV, {"implementation": "triton"}, "implementation must be one of"),
    (Q, KV, KV, {"scale": float("nan")}, "scale must be finite"),
])
def test_bad_arguments_raise_value_error(q, k, v, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _trace(q, k, v, **kwargs)


def test_traced_scale_is_rejected():
  with pytest.raises(ValueError, match="scale must be a static Python number"):
    jax.jit(lambda q, k, v, s: jax_flash.flash_attention(
        q, k, v, scale=s, implementation=KERNEL_IMPL)).trace(Q, KV, KV, 0.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_q": 48}, r"block_sizes.block_q=48 must be a power of two >= 16"),
    ({"block_k": 8}, r"block_sizes.block_k=8 must be a power of two >= 16"),
    ({"block_k_dq": 100}, r"block_sizes.block_k_dq=100"),
    ({"num_warps": 3}, r"block_sizes.num_warps=3 must be one of"),
    ({"num_stages": 0}, r"block_sizes.num_stages=0 must be an int in"),
    ({"block_q": 64.0}, r"block_sizes.block_q=64.0 must be an int"),
])
def test_bad_block_sizes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**kwargs)


def test_pallas_without_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  with pytest.raises(ValueError, match="implementation='pallas' .* needs a GPU"):
    _trace(Q, KV, KV, implementation="pallas")


def test_default_implementation_on_cpu_is_xla():
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  q = jnp.ones((1, 8, 2, 16)) * jnp.arange(16) / 16
  out = jax_flash.flash_attention(q, q, q)
  assert jnp.allclose(out, jax_flash.reference_attention(q, q, q))


def test_xla_implementation_checks_options_but_takes_any_head_dim():
  q = jnp.ones((1, 8, 2, 320)) * jnp.linspace(-1, 1, 320)
  out = jax_flash.flash_attention(q, q, q, implementation="xla")
  assert out.shape == q.shape
  with pytest.raises(ValueError, match="version must be 1 or 2"):
    jax_flash.flash_attention(q, q, q, implementation="xla", version=3)
  with pytest.raises(ValueError, match="block_sizes must be a"):
    jax_flash.flash_attention(q, q, q, implementation="xla", block_sizes=64)
