"""Shared test inputs: random (never zero) arrays, the named cases, and the
comparison of an implementation with the reference."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import BlockSizes
from jax_flash.reference import attend
from jax_flash.core import prepare
from jax_flash.testing import assert_attention_close
from tests.conftest import KERNEL_IMPL

SMALL_BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16,
                          block_k_dkv=32, block_q_dq=32, block_k_dq=16)
XLA_SMALL_BLOCKS = jax_flash.XlaBlockSizes(block_q=32, block_k=16)


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  causal: bool
  small_blocks: bool = False

  @property
  def shape(self):
    return (self.batch, self.q_len, self.kv_len, self.num_heads,
            self.num_kv_heads, self.head_dim)

  @property
  def block_sizes(self):
    return SMALL_BLOCKS if self.small_blocks else None

  def __str__(self):
    return (f"B{self.batch}-T{self.q_len}-S{self.kv_len}-N{self.num_heads}"
            f"-K{self.num_kv_heads}-H{self.head_dim}-{self.dtype}"
            f"{'-causal' if self.causal else ''}"
            f"{'-small' if self.small_blocks else ''}")


def inputs(case: Case, seed: int = 0):
  """query, key, value and a cotangent for out, standard normal."""
  return random_inputs(*case.shape, jnp.dtype(case.dtype), seed)


C = Case
# Every length in (1, 17, 128, 255, 1000), every head dim class (32..256 with
# non-powers of two), GQA ratios 1, 4 and N (MQA), T != S both ways, every
# dtype, causal on and off; small blocks to get many tiles on short lengths.
CASES = {
    "f32_mha": C(2, 128, 128, 4, 4, 64, "float32", False),
    "f32_mha_causal": C(2, 128, 128, 4, 4, 64, "float32", True),
    "f32_odd_small_tiles": C(1, 255, 255, 2, 2, 40, "float32", True, True),
    "f32_mqa_short_queries": C(1, 17, 1000, 4, 1, 80, "float32", False),
    "f32_mqa_short_keys": C(1, 1000, 17, 4, 1, 80, "float32", True),
    "f32_one_query": C(1, 1, 255, 8, 2, 96, "float32", True),
    "f32_one_key": C(1, 255, 1, 2, 1, 32, "float32", False),
    "bf16_h128_causal": C(1, 1000, 1000, 2, 2, 128, "bfloat16", True),
    "bf16_gqa_small_tiles": C(1, 255, 128, 8, 2, 64, "bfloat16", False, True),
    "bf16_gqa_causal_small_tiles": C(1, 128, 255, 8, 2, 64, "bfloat16", True,
                                     True),
    "bf16_h160": C(2, 17, 17, 4, 4, 160, "bfloat16", True),
    "bf16_h192_mqa": C(1, 200, 300, 4, 1, 192, "bfloat16", False),
    "bf16_h256_causal": C(1, 128, 128, 2, 2, 256, "bfloat16", True),
    "bf16_single_pair": C(1, 1, 1, 2, 1, 64, "bfloat16", True),
    "f16_h96_causal_small_tiles": C(1, 300, 200, 4, 4, 96, "float16", True,
                                    True),
    "f16_h128_gqa": C(1, 255, 1000, 4, 2, 128, "float16", False),
    "f16_gqa3_causal": C(1, 1000, 255, 6, 2, 40, "float16", True),
    "f16_h256": C(2, 17, 128, 3, 3, 256, "float16", False),
}

# The FlashAttention-1 forward, on a spread of the same.
V1_CASES = ["f32_mha_causal", "f32_odd_small_tiles", "f32_mqa_short_keys",
            "bf16_gqa_small_tiles", "bf16_h256_causal",
            "f16_h96_causal_small_tiles"]


def random_inputs(b, t, s, n, k, h, dtype, seed=0, value_head_dim=None):
  """query [b,t,n,h], key [b,s,k,h], value [b,s,k,hv] and a cotangent
  [b,t,n,hv] (hv = value_head_dim or h), standard normal."""
  hv = value_head_dim or h
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = ((b, t, n, h), (b, s, k, h), (b, s, k, hv), (b, t, n, hv))
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(ks, shapes))


def plain_attention(compute_dtype):
  """Plain attention with its two matmuls in `compute_dtype` (the signature
  of `reference_attention`): the low-precision baseline of the tolerances.
  On the test inputs it gives the errors of jax.nn's XLA path."""
  def attention(q, k, v, bias=None, *, return_residual=False, **kwargs):
    spec = prepare(q, k, v, bias=bias, **kwargs)
    out, lse = attend(q, k, v, spec.operands, mask=spec.mask,
                      scores=spec.scores, compute_dtype=compute_dtype)
    lse = lse.transpose(0, 2, 1)
    return (out, lse) if return_residual else out
  return attention


def compare_with_reference(kwargs, dtype=jnp.float32, version=2,
                           shape=(2, 100, 90, 4, 2, 32), seed=0,
                           block_sizes="small",
                           implementation=KERNEL_IMPL, garbage=False,
                           value_head_dim=None):
  """An implementation vs the reference: out, logsumexp, dq/dk/dv (and dbias
  if a bias), with `assert_attention_close` (low precision: against plain
  attention's own error in that dtype).

  value_head_dim: value's own head dim (default: the query's).
  garbage: queries and keys/values at or past `query_seq_lengths` /
  `key_value_seq_lengths` hold NaN for the implementation (zeros for the
  reference, which computes 0 * NaN): none may reach a result.

  Random cotangents for out and logsumexp. Outputs and gradients come in the
  input dtype. Rows that see no key must give out 0 and logsumexp -inf, and
  nothing may be NaN. Returns the boolean [B, T, N] of such empty rows.
  block_sizes "small": small tiles of the implementation (many per case).
  """
  if isinstance(block_sizes, str):
    block_sizes = XLA_SMALL_BLOCKS if implementation == "xla" else SMALL_BLOCKS
  q, k, v, do = random_inputs(*shape, dtype, seed=seed,
                              value_head_dim=value_head_dim)
  kwargs = dict(kwargs)
  bias = kwargs.pop("bias", None)
  names = ("out", "lse", "dq", "dk", "dv", "dbias")

  def padded(lengths, size):  # [B, size, 1, 1]: positions past a length.
    if lengths is None:
      return jnp.zeros((1, size, 1, 1), bool)
    return (jnp.arange(size)[None] >= lengths[:, None])[:, :, None, None]

  q_pad = padded(kwargs.get("query_seq_lengths"), q.shape[1])
  kv_pad = padded(kwargs.get("key_value_seq_lengths"), k.shape[1])

  def fill(value):
    return (jnp.where(q_pad, value, q).astype(q.dtype),
            jnp.where(kv_pad, value, k).astype(k.dtype),
            jnp.where(kv_pad, value, v).astype(v.dtype))

  clean = fill(0.0)
  poisoned = fill(jnp.nan) if garbage else clean

  def run(attention, up, inputs=clean, **extra):
    """The results of `attention`, jitted with the arrays as arguments:
    closed over, jit would embed them in the program as constants and XLA
    would fold the whole computation while compiling (over a minute for
    the reference at the GPU tests' sizes)."""
    def results(q, k, v, bias, do):
      def f(q, k, v, bias):
        return attention(up(q), up(k), up(v), bias, return_residual=True,
                         **kwargs, **extra)
      (out, lse), vjp = jax.vjp(f, q, k, v, bias)
      dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(
          lse.shape)
      grads = vjp((do.astype(out.dtype), dlse))
      return {n: x for n, x in zip(names, (out, lse) + grads)
              if x is not None}
    return jax.jit(results)(*inputs, bias, do)

  got = run(jax_flash.flash_attention, lambda x: x, poisoned,
            implementation=implementation, block_sizes=block_sizes,
            version=version)
  ref = run(jax_flash.reference_attention, lambda x: x.astype(jnp.float32))
  baseline = None
  if jnp.dtype(dtype) != jnp.float32:
    baseline = run(plain_attention(dtype), lambda x: x)
  assert got["out"].dtype == jnp.dtype(dtype)
  for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
    assert got[name].dtype == x.dtype, name
  empty = np.isneginf(np.asarray(ref["lse"]))
  assert not np.asarray(got["out"], np.float32)[empty].any()
  assert_attention_close(got, ref, dtype, baseline=baseline)
  return empty


def jax_nn_attention(*args, **kwargs):
  """jax.nn.dot_product_attention (XLA) with full float32 matmuls: XLA's
  default on a GPU is TF32 (about 5e-4 relative), our kernels are full
  float32."""
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)
