"""The grouped-query backward across group sizes: forward+backward of the
Mosaic GPU kernels with the dK/dV kernel's CTAs split over shares of each
KV head's query heads (`MosaicBlockSizes.dkv_head_splits`), beside cuDNN.

    PYTHONPATH=. python3 benchmarks/head_splits.py [--splits 1 2 4 8 16 71]

Shapes: 4 x 2048 tokens, causal, 64 query heads of 64 on 64 / G KV heads
for G in 1, 4, 8, 16, 32, 64, and Falcon-7B's 71 heads on 1. bf16, jitted
calls; one JSON line a measurement (splits past G are G's).
"""
import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks.harness import _measure

SHAPES = [(4, 2048, 64, 64 // g, 64) for g in (1, 4, 8, 16, 32, 64)] + [
    (4, 2048, 71, 1, 64)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--splits", type=int, nargs="+",
                      default=[1, 2, 4, 8, 16, 71])
  parser.add_argument("--causal", type=int, default=1)
  args = parser.parse_args()
  causal = bool(args.causal)
  for b, t, n, kh, h in SHAPES:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kh, h), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    flops = 4 * b * n * h * t * t / (2 if causal else 1)
    default = jax_flash.MosaicBlockSizes.get_default(h, causal, kv_len=t)
    group = n // kh
    impls = {}
    for s in sorted({min(s, group) for s in args.splits}):
      impls[f"splits={s}"] = lambda q, k, v, s=s: jax_flash.flash_attention(
          q, k, v, is_causal=causal, implementation="mosaic",
          block_sizes=dataclasses.replace(default, dkv_head_splits=s))
    impls["default"] = lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=causal)
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")
    for label, fn in impls.items():
      row = _measure(fn, "fwd+bwd", q, k, v, do, flops, 10, 5)
      print(json.dumps(dict(shape=[b, t, n, kh, h], group=group,
                            causal=causal, impl=label, mode="fwd+bwd",
                            **row)), flush=True)


if __name__ == "__main__":
  main()
