"""Dropout: exact match with a reference that uses the same keep bits, the keep
rate, determinism per rng, unbiasedness."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.core import dropout
from jax_flash.testing import relative_error
from tests.cases import compare_with_reference, random_inputs
from tests.conftest import KERNEL_IMPL

RNG = jax.random.key(7)


@pytest.mark.parametrize("kwargs", [
    dict(dropout_rate=0.3),
    dict(dropout_rate=0.5, is_causal=True, bias=jnp.full((1, 4, 100, 90), 0.3),
         logits_soft_cap=3.0),
    dict(dropout_rate=0.1, local_window_size=(16, 16),
         key_value_seq_lengths=jnp.array([90, 0])),
], ids=["plain", "causal_bias_cap", "window_lengths"])
@pytest.mark.parametrize("version, implementation",
                         [(2, KERNEL_IMPL), (1, KERNEL_IMPL), (2, "xla")])
def test_dropout_matches_reference_with_same_bits(kwargs, version,
                                                  implementation):
  compare_with_reference(dict(kwargs, dropout_rng=RNG), version=version,
                         implementation=implementation)


def test_dropout_bfloat16_gqa():
  compare_with_reference(dict(dropout_rate=0.2, dropout_rng=RNG, is_causal=True),
                         jnp.bfloat16, shape=(1, 255, 200, 8, 2, 64))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_kernel_keep_bits_are_the_documented_ones(rate):
  """With V = identity, out[i] is row i of the dropped P: its zeros are the
  dropped entries."""
  t = s = h = 64
  q = jax.random.normal(jax.random.key(1), (2, t, 3, h))
  k = jax.random.normal(jax.random.key(2), (2, s, 3, h)) * 0.1
  v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (2, s, 3, h))
  out = jax_flash.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=RNG,
                                  implementation=KERNEL_IMPL)
  kept = np.asarray(out != 0).transpose(0, 2, 1, 3)  # [B, N, T, S]
  expected = np.asarray(jax_flash.dropout_keep_mask(RNG, rate, 2, 3, t, s))
  np.testing.assert_array_equal(kept, expected)
  # Binomial: 24576 draws, the keep rate within 4 standard deviations.
  std = np.sqrt(rate * (1 - rate) / kept.size)
  assert abs(kept.mean() - (1 - rate)) < 4 * std


def test_same_rng_same_result_other_rng_other_result():
  q, k, v, _ = random_inputs(1, 64, 64, 2, 2, 32, jnp.float32)
  f = lambda rng: jax_flash.flash_attention(
      q, k, v, dropout_rate=0.4, dropout_rng=rng, implementation=KERNEL_IMPL)
  np.testing.assert_array_equal(f(RNG), f(RNG))
  assert (f(RNG) != f(jax.random.key(8))).any()


def test_dropout_is_unbiased():
  q, k, v, _ = random_inputs(1, 64, 64, 2, 2, 32, jnp.float32)
  f = jax.jit(jax.vmap(lambda rng: jax_flash.flash_attention(
      q, k, v, dropout_rate=0.4, dropout_rng=rng, implementation=KERNEL_IMPL)))
  samples = f(jax.random.split(jax.random.key(0), 64))
  exact = jax_flash.reference_attention(q, k, v)
  one = relative_error(samples[0], exact)
  mean = relative_error(samples.mean(0), exact)
  # Independent samples: the error of the mean shrinks like 1/sqrt(64) = 1/8.
  assert mean < one / 4, (mean, one)


def test_broadcast_dropout_shares_one_mask():
  compare_with_reference(dict(dropout_rate=0.3, dropout_rng=RNG,
                              dropout_broadcast=True))
  t = s = h = 32
  q = jax.random.normal(jax.random.key(1), (2, t, 3, h))
  v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (2, s, 3, h))
  out = jax_flash.flash_attention(q, q * 0.1, v, dropout_rate=0.5,
                                  dropout_rng=RNG, dropout_broadcast=True,
                                  implementation=KERNEL_IMPL)
  kept = np.asarray(out != 0).transpose(0, 2, 1, 3)  # [B, N, T, S]
  expected = np.asarray(jax_flash.dropout_keep_mask(RNG, 0.5, 1, 1, t, s))
  np.testing.assert_array_equal(kept, np.broadcast_to(expected, kept.shape))


def test_a_shifted_seed_draws_a_shards_bits():
  """dropout.shifted: the keep bits of a shard of the batch and the heads
  (what a device draws under sharding) are the whole call's there."""
  seed = dropout.seed_words(jax.random.key(3))
  whole = dropout.keep_mask(seed, 0.3, 4, 8, 16, 16)
  part = dropout.keep_mask(dropout.shifted(seed, 2, 4), 0.3, 2, 4, 16, 16)
  np.testing.assert_array_equal(part, whole[2:, 4:])
  assert not np.array_equal(whole[:2, :4], whole[2:, 4:])
