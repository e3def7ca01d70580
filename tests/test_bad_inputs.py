"""Bad arguments fail at trace time with a ValueError naming the argument: one
table for every entry point (flash_attention, flash_decode, BlockSizes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import BlockSizes
from jax_flash.testing import assert_attention_close
from tests.cases import jax_nn_attention
from tests.conftest import KERNEL_IMPL, ON_GPU

B, T, S, N, K, H = 2, 64, 32, 4, 2, 64
RNG = jax.random.key(7)


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = _sds((B, T, N, H)), _sds((B, S, K, H))
I32 = jnp.int32


def _attention(q=Q, k=KV, v=KV, **kwargs):
  """Traces flash_attention without running it: errors come from tracing."""
  kwargs.setdefault("implementation", KERNEL_IMPL)
  return lambda: jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, **kwargs)).trace(q, k, v)


def _decode(q=_sds((B, 1, N, 32)), **kwargs):
  cache = _sds((B, S, K, 32))
  kwargs.setdefault("implementation", KERNEL_IMPL)
  kwargs.setdefault("key_cache", cache)
  kwargs.setdefault("value_cache", cache)
  return lambda: jax.jit(lambda q: jax_flash.flash_decode(q, **kwargs)).trace(
      q)


BAD = {
    # query, key, value.
    "query_rank_2": (_attention(q=_sds((64, 64))),
                     r"query must have shape \[batch, q_len"),
    "query_rank_5": (_attention(q=_sds((1, 2, 64, 4, 64))),
                     "query must have shape"),
    "key_rank": (_attention(k=_sds((S, K, H))),
                 r"key of shape \(32, 2, 64\) is unbatched: it goes with a "
                 "query of batch 1"),
    "batched_key_for_unbatched_query": (
        _attention(q=_sds((T, N, H)), k=_sds((B, S, K, H)),
                   v=_sds((B, S, K, H))),
        "an unbatched query .* takes key and value of batch 1"),
    "value_shape": (_attention(v=_sds((B, 48, K, H))),
                    "value must have the shape of key"),
    "key_batch": (_attention(k=_sds((3, S, K, H)), v=_sds((3, S, K, H))),
                  "key batch size 3"),
    "key_head_dim": (_attention(k=_sds((B, S, K, 32)), v=_sds((B, S, K, 32))),
                     "key head_dim 32"),
    "kv_heads_divide": (_attention(k=_sds((B, S, 3, H)), v=_sds((B, S, 3, H))),
                        "num_kv_heads=3 must divide query num_heads=4"),
    "mixed_dtypes": (_attention(k=_sds((B, S, K, H), jnp.bfloat16)),
                     "must share one dtype"),
    "integer_dtype": (_attention(q=_sds((B, T, N, H), I32),
                                 k=_sds((B, S, K, H), I32),
                                 v=_sds((B, S, K, H), I32)),
                      "query dtype must be floating"),
    "zero_heads": (_attention(k=_sds((B, S, 0, H)), v=_sds((B, S, 0, H))),
                   "must have heads and head dims of size 1 or more"),
    # What the kernels take, when they are named.
    "kernel_head_dim_8": (_attention(q=_sds((B, T, N, 8)), k=_sds((B, S, K, 8)),
                                     v=_sds((B, S, K, 8))),
                          r"head_dim .* must be in \[16, 512\].* got 8"),
    "kernel_head_dim_640": (_attention(q=_sds((B, T, N, 640)),
                                       k=_sds((B, S, K, 640)),
                                       v=_sds((B, S, K, 640))),
                            r"head_dim .* got 640; implementation='xla'"),
    "kernel_float8": (_attention(q=_sds((B, T, N, H), jnp.float8_e4m3fn),
                                 k=_sds((B, S, K, H), jnp.float8_e4m3fn),
                                 v=_sds((B, S, K, H), jnp.float8_e4m3fn)),
                       "float8_e4m3fn query, key and value need descale"),
    "kernel_float8_descale": (
        _attention(q=_sds((B, T, N, H), jnp.float8_e4m3fn),
                   k=_sds((B, S, K, H), jnp.float8_e4m3fn),
                   v=_sds((B, S, K, H), jnp.float8_e4m3fn),
                   descale=(1.0, 1.0, 1.0),
                   implementation="triton" if ON_GPU else "interpret"),
        "take no fp8 call"),
    # Options.
    "block_sizes_type": (_attention(block_sizes=(128, 64)),
                         "block_sizes must be a"),
    "block_sizes_type_xla": (_attention(block_sizes=64, implementation="xla"),
                             "block_sizes must be a"),
    "version": (_attention(version=3), "version must be 1 or 2"),
    "version_xla": (_attention(version=3, implementation="xla"),
                    "version must be 1 or 2"),
    "context_parallel": (_attention(context_parallel="ulysses"),
                         "context_parallel must be one of"),
    "sequence_axis_outside_shard_map": (
        _attention(sequence_axis="sp"),
        "sequence_axis='sp' names no axis of an enclosing shard_map"),
    "implementation": (_attention(implementation="cuda"),
                       "implementation must be one of"),
    "scale_nan": (_attention(scale=float("nan")), "scale must be finite"),
    # Masks.
    "q_lengths_shape": (_attention(query_seq_lengths=jnp.array([1, 2, 3])),
                        r"query_seq_lengths must have shape \[batch\]"),
    "kv_lengths_dtype": (_attention(
        key_value_seq_lengths=jnp.array([1.0, 2.0])),
        "key_value_seq_lengths must have an integer dtype"),
    "segments_one_array_cross": (_attention(
        segment_ids=jnp.zeros((B, T), I32)), "needs q_len == kv_len"),
    "kv_segments_shape": (_attention(
        segment_ids=(jnp.zeros((B, T), I32), jnp.zeros((B, T), I32))),
        r"kv_segment_ids must have shape \[batch, kv_len\]"),
    "segments_dtype": (_attention(
        segment_ids=(jnp.zeros((B, T)), jnp.zeros((B, S)))),
        "q_segment_ids must have an integer dtype"),
    "segments_triple": (_attention(segment_ids=(jnp.zeros((B, T), I32),) * 3),
                        "segment_ids must be an array or a pair"),
    "window_negative": (_attention(local_window_size=-1),
                        "entries must be static ints >= 0"),
    "window_pair_negative": (_attention(local_window_size=(3, -2)),
                             "entries must be static ints >= 0"),
    "window_triple": (_attention(local_window_size=(1, 2, 3)),
                      "local_window_size must be an int or a pair"),
    # Score modifications.
    "bias_shape": (_attention(bias=jnp.zeros((B, N, T, 7))),
                   r"bias of shape \(2, 4, 64, 7\) is not broadcastable"),
    "bias_rank": (_attention(bias=jnp.zeros((1, B, N, T, S))),
                  "bias must have at most 4 dims"),
    "bias_dtype": (_attention(bias=jnp.zeros((B, N, T, S), I32)),
                   "bias must be floating point"),
    "mask_dtype": (_attention(mask=jnp.zeros((B, N, T, S))),
                   "mask must be boolean"),
    "mask_shape": (_attention(mask=jnp.zeros((3, 1, T, S), bool)),
                   "mask of shape .* is not broadcastable"),
    "soft_cap_zero": (_attention(logits_soft_cap=0.0),
                      "logits_soft_cap must be a finite number > 0"),
    "soft_cap_inf": (_attention(logits_soft_cap=float("inf")),
                     "logits_soft_cap must be a finite"),
    "alibi_shape": (_attention(alibi_slopes=jnp.zeros((N + 1,))),
                    r"alibi_slopes must have shape \[num_heads\]"),
    "alibi_dtype": (_attention(alibi_slopes=jnp.zeros((N,), I32)),
                    "alibi_slopes must be floating"),
    # Dropout.
    "dropout_without_rng": (_attention(dropout_rate=0.5),
                            "dropout_rate > 0 needs dropout_rng"),
    "dropout_rate_one": (_attention(dropout_rate=1.0, dropout_rng=RNG),
                         r"dropout_rate must be in \[0, 1\)"),
    "dropout_rate_negative": (_attention(dropout_rate=-0.1, dropout_rng=RNG),
                              r"dropout_rate must be in \[0, 1\)"),
    # flash_decode.
    "decode_lengths_dtype": (_decode(kv_lengths=jnp.array([1.0, 2.0])),
                             "kv_lengths must have an integer"),
    "decode_lengths_shape": (_decode(kv_lengths=jnp.array([1, 2, 3])),
                             r"kv_lengths must have shape \[batch\]"),
    "decode_num_splits": (_decode(kv_lengths=jnp.array([1, 2]), num_splits=0),
                          "num_splits must be an int >= 1"),
    "decode_num_splits_xla": (_decode(kv_lengths=jnp.array([1, 2]),
                                      num_splits=0, implementation="xla"),
                              "num_splits must be an int >= 1"),
    "decode_cache_and_pages": (_decode(
        kv_lengths=jnp.array([1, 2]), key_pages=jnp.zeros((4, 16, K, 32)),
        value_pages=jnp.zeros((4, 16, K, 32)),
        page_table=jnp.zeros((B, 2), I32)), "not both"),
    "decode_page_size": (_decode(
        kv_lengths=jnp.array([5, 5]), key_cache=None, value_cache=None,
        key_pages=jnp.zeros((4, 24, K, 32)),
        value_pages=jnp.zeros((4, 24, K, 32)),
        page_table=jnp.zeros((B, 2), I32)),
        "page_size=24 must be a power of two"),
    "version_1_on_xla": (_attention(version=1, implementation="xla"),
                         "version=1 runs the FlashAttention-1 forward, a "
                         "Triton kernel"),
    "query_offset_shape": (_attention(is_causal=True,
                                      query_offset=jnp.array([1, 2, 3])),
                           r"query_offset must have shape \[batch\]"),
    "query_offset_dtype": (_attention(is_causal=True, query_offset=2.5),
                           "query_offset must be an integer array"),
    "query_offset_with_sequence_axis": (
        _attention(query_offset=3, sequence_axis="sp"),
        "query_offset does not go with sequence_axis"),
    # BlockSizes.
    "block_q_48": (lambda: BlockSizes(block_q=48),
                   r"block_sizes.block_q=48 must be a power of two >= 16"),
    "block_k_8": (lambda: BlockSizes(block_k=8),
                  r"block_sizes.block_k=8 must be a power of two >= 16"),
    "block_k_dq_100": (lambda: BlockSizes(block_k_dq=100),
                       r"block_sizes.block_k_dq=100"),
    "num_warps_3": (lambda: BlockSizes(num_warps=3),
                    r"block_sizes.num_warps=3 must be one of"),
    "num_stages_0": (lambda: BlockSizes(num_stages=0),
                     r"block_sizes.num_stages=0 must be an int in"),
    "block_q_float": (lambda: BlockSizes(block_q=64.0),
                      r"block_sizes.block_q=64.0 must be an int"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_argument_raises_value_error(name):
  call, match = BAD[name]
  with pytest.raises(ValueError, match=match):
    call()


def test_a_traced_scale_is_the_static_one():
  """jax.nn takes a traced scale; so do we (it multiplies the query), with
  its gradient; a scale of many elements is a clear error."""
  q = jax.random.normal(jax.random.key(0), Q.shape)
  kv = jax.random.normal(jax.random.key(1), KV.shape)

  def both(scale):
    return jax_flash.flash_attention(q, kv, kv, scale=scale,
                                     implementation=KERNEL_IMPL)
  assert_attention_close(jax.jit(both)(0.3), both(0.3))
  grad = jax.grad(lambda s: jnp.sum(both(s) ** 2))(0.3)
  ref = jax.grad(lambda s: jnp.sum(jax_flash.reference_attention(
      q, kv, kv, scale=s) ** 2))(0.3)
  assert_attention_close(grad, ref)
  with pytest.raises(ValueError, match="scale must be a scalar"):
    jax_flash.flash_attention(q, kv, kv, scale=jnp.ones(2))


@pytest.mark.parametrize("empty", ["queries", "keys", "batch"])
def test_empty_sequences_as_jax_nn(empty):
  """No query, no key or no batch: jax.nn's result (zeros; a row that sees
  no key outputs 0), logsumexp -inf, zero gradients."""
  shapes = {"queries": ((2, 0, 4, 32), (2, 9, 2, 32)),
            "keys": ((2, 9, 4, 32), (2, 0, 2, 32)),
            "batch": ((0, 9, 4, 32), (0, 9, 2, 32))}[empty]
  q, kv = (jnp.ones(s) for s in shapes)
  out, lse = jax_flash.flash_attention(q, kv, kv, return_residual=True,
                                       implementation=KERNEL_IMPL)
  want = jax.nn.dot_product_attention(q, kv, kv)
  assert out.shape == want.shape and not out.any()
  np.testing.assert_array_equal(want, out)
  assert lse.shape == q.shape[:3] and bool(jnp.all(lse == -jnp.inf))
  grad = jax.grad(lambda q: jnp.sum(jax_flash.flash_attention(q, kv, kv)))(q)
  assert grad.shape == q.shape and not grad.any()


def test_gpu_kernels_without_gpu_are_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  for name in ("pallas", "triton"):
    with pytest.raises(ValueError, match=f"implementation='{name}' .* needs "
                       "a GPU"):
      _attention(implementation=name)()


def test_default_implementation_on_cpu_is_xla():
  """Random inputs, where the interpreted kernels and the "xla" backend
  differ in the last bits: the default must give xla's bits exactly."""
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, 40, 2, 16))
  k, v = (jax.random.normal(x, (1, 40, 1, 16)) for x in ks[1:])
  run = lambda **kw: np.asarray(jax_flash.flash_attention(
      q, k, v, is_causal=True, **kw))
  kernels, xla = run(implementation="interpret"), run(implementation="xla")
  assert not np.array_equal(kernels, xla)  # The inputs tell them apart ...
  np.testing.assert_array_equal(run(), xla)  # ... and the default is xla.


@pytest.mark.parametrize("head_dim", [8, 320])
def test_xla_implementation_takes_any_head_dim(head_dim):
  q = jax.random.normal(jax.random.key(1), (1, 8, 2, head_dim))
  out = jax_flash.flash_attention(q, q, q, implementation="xla")
  assert_attention_close(out, jax_flash.reference_attention(q, q, q))


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_what_jax_nn_takes_we_take(implementation):
  """Lengths as Python lists; a [S, K, H] key and value with a query of
  batch 1, and a [1, S, K, H] one with an unbatched query (jax.nn gives
  each a batch of 1; the output has the query's rank)."""
  q = jax.random.normal(jax.random.key(0), (1, 24, 4, 16))
  k, v = (jax.random.normal(jax.random.key(i), (1, 40, 2, 16))
          for i in (1, 2))
  cases = {
      "lengths_list": ((q, k, v), dict(key_value_seq_lengths=[33],
                                       query_seq_lengths=(20,))),
      "unbatched_kv": ((q, k[0], v[0]), {}),
      "unbatched_query": ((q[0], k, v), {}),
  }
  for name, (args, kwargs) in cases.items():
    got = jax_flash.flash_attention(*args, is_causal=True,
                                    implementation=implementation, **kwargs)
    want = jax_nn_attention(*args, is_causal=True, **{
        key: jnp.asarray(x, jnp.int32) for key, x in kwargs.items()})
    assert got.shape == want.shape == args[0].shape, name
    if not kwargs:  # With lengths, padded rows differ on purpose (0 here).
      assert_attention_close(got, want)
    else:
      assert_attention_close(got[:, :20], want[:, :20])


def test_logsumexp_is_float32_for_every_dtype():
  """return_residual's logsumexp is float32 whatever the inputs' dtype
  (jax.nn's is theirs): docs/differences.md says why."""
  q = jax.random.normal(jax.random.key(0), (1, 24, 4, 16), jnp.bfloat16)
  _, lse = jax_flash.flash_attention(q, q, q, return_residual=True)
  assert lse.dtype == jnp.float32
  _, ref = jax_flash.reference_attention(q, q, q, return_residual=True)
  assert ref.dtype == jnp.float32
