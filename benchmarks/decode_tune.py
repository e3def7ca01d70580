"""Paged decode: the key tile's rows against the page size, on one GPU.

    PYTHONPATH=. python benchmarks/decode_tune.py --out DIR

One new token per sequence (16 query heads and 4 KV heads of 128, bf16)
against a full cache stored contiguously and as pages of 16, 32 and 64
tokens in a random order, for every key tile from one page to 128 rows
(`pallas_kernels.triton.config.decode_block_k` is replaced for each row; a
tile of one page or less is a contiguous load, more pages a gather), and
for each, the kernel's pipelining stages (`--stages`; `DECODE_STAGES` is
replaced likewise: a paged tile's loads wait on its page-table read). Prints
and writes one JSON line per row: TB/s of K+V read, and the ratio to the
contiguous cache in the same run. The defaults in `decode_block_k` come
from it.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import benchmark
from pallas_kernels.triton import config


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--shapes", nargs="+", default=["8x32768", "64x8192"],
                      help="BATCHxCACHE")
  parser.add_argument("--page-sizes", type=int, nargs="+",
                      default=[16, 32, 64])
  parser.add_argument("--stages", type=int, nargs="+", default=[2],
                      help="Triton pipelining stages to try on paged rows")
  parser.add_argument("--implementation", default="pallas",
                      help="'interpret' tries the script on a CPU")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  default, stages0 = config.decode_block_k, config.DECODE_STAGES
  dtype, heads, kv_heads, head_dim = jnp.bfloat16, 16, 4, 128
  with open(os.path.join(args.out, "decode_tune.jsonl"), "w") as log:
    for shape in args.shapes:
      batch, cache_len = map(int, shape.split("x"))
      keys = jax.random.split(jax.random.key(batch), 3)
      q, kc, vc, lengths = benchmark.decode_inputs(
          keys, batch, cache_len, heads, kv_heads, head_dim, dtype)
      nbytes = 2 * kc.size * kc.dtype.itemsize
      contiguous = benchmark._time(jax.jit(
          lambda q, k, v: jax_flash.flash_decode(
              q, k, v, kv_lengths=lengths,
              implementation=args.implementation)), (q, kc, vc), 10, 3)
      cases = [(None, default(head_dim, cache_len), stages0, contiguous)]
      for page_size in args.page_sizes:
        paged = benchmark._paged_cache(kc, vc, page_size, keys[2])
        for block_k in (16, 32, 64, 128):
          if block_k < page_size:
            continue
          for stages in args.stages:
            config.decode_block_k = lambda *a, b=block_k: b
            config.DECODE_STAGES = stages
            try:
              seconds = benchmark._time(jax.jit(benchmark._paged_decode(
                  lengths, args.implementation)), (q, *paged), 10, 3)
            finally:
              config.decode_block_k, config.DECODE_STAGES = default, stages0
            cases.append((page_size, block_k, stages, seconds))
      for page_size, block_k, stages, seconds in cases:
        row = dict(batch=batch, cache_len=cache_len, page_size=page_size,
                   block_k=block_k, num_stages=stages,
                   us=round(seconds * 1e6, 1),
                   tb_s=round(nbytes / seconds / 1e12, 3),
                   of_contiguous=round(contiguous / seconds, 3),
                   default=(block_k == default(head_dim, cache_len, page_size)
                            and stages == stages0))
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
