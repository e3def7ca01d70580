"""With `jax_enable_x64` on (as jax's own tests run), every entry point
gives what it gives with it off: the library's index arithmetic is int32
either way; float64 inputs run the blockwise path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_flash
import jax_flash.linen
import jax_flash.nnx
from jax_flash.testing import assert_attention_close
from tests.conftest import KERNEL_IMPL

KEYS = jax.random.split(jax.random.key(0), 5)
Q = jax.random.normal(KEYS[0], (2, 40, 4, 16))
K = jax.random.normal(KEYS[1], (2, 30, 2, 16))
V = jax.random.normal(KEYS[2], (2, 30, 2, 16))
BIAS = jax.random.normal(KEYS[3], (1, 4, 40, 30))
LENGTHS = np.array([30, 7])  # numpy: int64 under x64, int32 without.


def _attention(impl, **kwargs):
  def f(q, k, v, bias):
    return jax_flash.flash_attention(q, k, v, bias, implementation=impl,
                                     **kwargs)
  return f


CALLS = {
    "causal": dict(is_causal=True),
    "window_lengths": dict(local_window_size=(5, 3),
                           key_value_seq_lengths=LENGTHS),
    "segments": dict(segment_ids=(np.zeros((2, 40), np.int64),
                                  np.zeros((2, 30), np.int64))),
    "dropout_alibi": dict(dropout_rate=0.2, dropout_rng=jax.random.key(3),
                          alibi_slopes=jnp.linspace(0.1, 0.4, 4)),
}


def _value_and_grads(fn):
  loss = lambda q, k, v, b: jnp.sum(fn(q, k, v, b) ** 2)
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
      Q, K, V, BIAS)
  return {"out": fn(Q, K, V, BIAS), "loss": value, "grads": grads}


@pytest.mark.parametrize("impl, name", [("xla", n) for n in CALLS] + [
    (KERNEL_IMPL, "causal"), (KERNEL_IMPL, "window_lengths")])
def test_flash_attention_and_gradients(impl, name):
  fn = _attention(impl, **CALLS[name])
  want = _value_and_grads(fn)
  with jax.enable_x64(True):
    got = _value_and_grads(fn)
  assert got["out"].dtype == jnp.float32
  assert_attention_close(got, want)


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "xla"])
def test_decode_and_flex(impl):
  def run():
    decode = jax_flash.flash_decode(Q[:, :3], K, V, kv_lengths=LENGTHS,
                                    implementation=impl)
    mask = jax_flash.create_block_mask(lambda b, h, i, j: i >= j, None, None,
                                       40, 30, block_size=16)
    flex = jax_flash.flex_attention(Q, K, V, block_mask=mask,
                                    implementation=impl)
    return {"decode": decode, "flex": flex}
  want = run()
  with jax.enable_x64(True):
    got = run()
  assert_attention_close(got, want)


def test_float64_inputs_give_float64_accumulated_in_float32():
  """The blockwise path takes float64 and returns float64; it accumulates
  in float32, as every backend does (float32's accuracy)."""
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in (Q, K, V))
    out = jax_flash.flash_attention(q, k, v, is_causal=True,
                                    key_value_seq_lengths=LENGTHS)
    ref = jax_flash.reference_attention(q, k, v, is_causal=True,
                                        key_value_seq_lengths=LENGTHS)
    assert out.dtype == jnp.float64
    assert_attention_close(out.astype(jnp.float32), ref.astype(jnp.float32))


def test_modules():
  x = jax.random.normal(KEYS[4], (2, 12, 32))

  def run():
    layer = jax_flash.nnx.FlashAttention(num_heads=2, in_features=32,
                                         decode=False,
                                         implementation=KERNEL_IMPL,
                                         rngs=nnx.Rngs(0))
    module = jax_flash.linen.FlashAttention(num_heads=2,
                                            implementation=KERNEL_IMPL)
    params = module.init(jax.random.key(1), x)
    linen_out = module.apply(params, x)
    cached = jax_flash.nnx.FlashAttention(num_heads=2, in_features=32,
                                          decode=True,
                                          implementation=KERNEL_IMPL,
                                          rngs=nnx.Rngs(0))
    cached.init_cache((2, 12, 32))
    steps = [cached(x[:, i:i + 1]) for i in range(3)]
    return {"nnx": layer(x, is_causal=True), "linen": linen_out,
            "decode": jnp.concatenate(steps, axis=1)}
  want = run()
  with jax.enable_x64(True):
    got = run()
  assert_attention_close(got, want)
