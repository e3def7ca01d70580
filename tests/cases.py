"""Shared test inputs: random (never zero) arrays and the case lists."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import BlockSizes
from jax_flash.testing import relative_error, tolerance
from tests.conftest import KERNEL_IMPL

SMALL_BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16,
                          block_k_dkv=32, block_q_dq=32, block_k_dq=16)


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
  def block_sizes(self):
    return SMALL_BLOCKS if self.small_blocks else None

  def __str__(self):
    return (f"B{self.batch}-T{self.q_len}-S{self.kv_len}-N{self.num_heads}"
            f"-K{self.num_kv_heads}-H{self.head_dim}-{self.dtype}"
            f"{'-causal' if self.causal else ''}"
            f"{'-small' if self.small_blocks else ''}")


def inputs(case: Case, seed: int = 0):
  """query, key, value and a cotangent for out, standard normal."""
  return random_inputs(case.batch, case.q_len, case.kv_len, case.num_heads,
                       case.num_kv_heads, case.head_dim, jnp.dtype(case.dtype),
                       seed)


C = Case
# Every length in (1, 17, 128, 255, 1000), every head dim class (32..256 with
# non-powers of two), GQA ratios 1, 4 and N (MQA), T != S both ways, every
# dtype, causal on and off; small blocks to get many tiles on short lengths.
CASES = [
    C(2, 128, 128, 4, 4, 64, "float32", False),
    C(2, 128, 128, 4, 4, 64, "float32", True),
    C(1, 255, 255, 2, 2, 40, "float32", True, True),
    C(1, 17, 1000, 4, 1, 80, "float32", False),
    C(1, 1000, 17, 4, 1, 80, "float32", True),
    C(1, 1, 255, 8, 2, 96, "float32", True),
    C(1, 255, 1, 2, 1, 32, "float32", False),
    C(1, 1000, 1000, 2, 2, 128, "bfloat16", True),
    C(1, 255, 128, 8, 2, 64, "bfloat16", False, True),
    C(1, 128, 255, 8, 2, 64, "bfloat16", True, True),
    C(2, 17, 17, 4, 4, 160, "bfloat16", True),
    C(1, 200, 300, 4, 1, 192, "bfloat16", False),
    C(1, 128, 128, 2, 2, 256, "bfloat16", True),
    C(1, 1, 1, 2, 1, 64, "bfloat16", True),
    C(1, 300, 200, 4, 4, 96, "float16", True, True),
    C(1, 255, 1000, 4, 2, 128, "float16", False),
    C(1, 1000, 255, 6, 2, 40, "float16", True),
    C(2, 17, 128, 3, 3, 256, "float16", False),
]

# The FlashAttention-1 forward, on a spread of the same.
V1_CASES = [CASES[i] for i in (1, 2, 4, 8, 12, 14)]


def random_inputs(b, t, s, n, k, h, dtype, seed=0):
  """query [b,t,n,h], key/value [b,s,k,h] and a cotangent, standard normal."""
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = ((b, t, n, h), (b, s, k, h), (b, s, k, h), (b, t, n, h))
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(ks, shapes))


def compare_with_reference(kwargs, dtype=jnp.float32, version=2,
                           shape=(2, 100, 90, 4, 2, 32), seed=0,
                           block_sizes=SMALL_BLOCKS,
                           implementation=KERNEL_IMPL):
  """Kernels vs reference: out, logsumexp, dq/dk/dv (and dbias if a bias).

  Random cotangents for out and logsumexp. Outputs and gradients come in the
  input dtype. Rows that see no key must give out 0 and logsumexp -inf in
  both, and nothing may be NaN. Returns the boolean [B, T, N] of such empty
  rows.
  """
  q, k, v, do = random_inputs(*shape, dtype, seed=seed)
  kwargs = dict(kwargs)
  bias = kwargs.pop("bias", None)

  def run(attention, up, **extra):
    def f(q, k, v, bias):
      return attention(up(q), up(k), up(v), bias, return_residual=True,
                       **kwargs, **extra)
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
    grads = vjp((do.astype(out.dtype), dlse))
    return out, lse, [g for g in grads if g is not None]

  out, lse, grads = jax.jit(lambda: run(
      jax_flash.flash_attention, lambda x: x, implementation=implementation,
      block_sizes=block_sizes, version=version))()
  ref_out, ref_lse, ref_grads = run(jax_flash.reference_attention,
                                    lambda x: x.astype(jnp.float32))
  tol = tolerance(dtype)
  assert out.dtype == jnp.dtype(dtype) and out.shape == ref_out.shape
  assert lse.shape == ref_lse.shape == out.shape[:3]
  for g, x in zip(grads, (q, k, v)):
    assert g.dtype == x.dtype
  for x in (out, lse, *grads):
    assert not jnp.isnan(x).any()
  empty = np.isneginf(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
  assert not np.asarray(out, np.float32)[empty].any()
  finite = lambda x: np.where(np.isfinite(x), x, 0.0)
  errors = {"out": relative_error(out, ref_out),
            "lse": relative_error(finite(lse), finite(ref_lse))}
  bounds = {"out": tol.out, "lse": tol.lse}
  for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
    assert g.shape == r.shape, name
    errors[name], bounds[name] = relative_error(g, r), tol.grad
  bad = {n: (e, bounds[n]) for n, e in errors.items() if not e <= bounds[n]}
  assert not bad, f"(error, bound): {bad}"
  return empty


def jax_nn_attention(*args, **kwargs):
  """jax.nn.dot_product_attention (XLA) with full float32 matmuls: XLA's
  default on a GPU is TF32 (about 5e-4 relative), our kernels are full
  float32."""
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)
