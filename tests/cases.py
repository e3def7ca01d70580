"""Shared test inputs: random (never zero) arrays and the case lists."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash import BlockSizes

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
  dtype = jnp.dtype(case.dtype)
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (case.batch, case.q_len, case.num_heads,
                             case.head_dim), jnp.float32)
  k = jax.random.normal(kk, (case.batch, case.kv_len, case.num_kv_heads,
                             case.head_dim), jnp.float32)
  v = jax.random.normal(kv, k.shape, jnp.float32)
  do = jax.random.normal(kd, q.shape, jnp.float32)
  return tuple(x.astype(dtype) for x in (q, k, v, do))


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
