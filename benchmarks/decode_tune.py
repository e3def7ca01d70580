"""Paged decode: the key tile's rows against the page size, on one GPU.

    PYTHONPATH=. python benchmarks/decode_tune.py --out DIR

One new token per sequence (16 query heads and 4 KV heads of 128, bf16)
against a full cache stored contiguously and as pages of 16, 32 and 64
tokens in a random order, for every key tile from one page to 128 rows
(`--block-k`; `pallas_kernels.triton.config.decode_block_k` is replaced for
each row; a tile of one page or less is a contiguous load, more pages a
gather), and for each: the kernel's pipelining stages (`--stages`,
replacing `DECODE_STAGES`), how many tiles ahead it reads a tile's page ids
(`--prefetch`, replacing `DECODE_PREFETCH_PAGES`: a paged tile's loads wait
on its page-table read), and the programs per multiprocessor
(`--programs-per-sm`, giving `num_splits`; `config.decode_splits` gives 2).
Prints and writes one JSON line per row: TB/s of K+V read, and the ratio to
the contiguous cache in the same run. The defaults in `decode_block_k` come
from it.
"""
from __future__ import annotations

import argparse
import itertools
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
  parser.add_argument("--block-k", type=int, nargs="+",
                      default=[16, 32, 64, 128])
  parser.add_argument("--stages", type=int, nargs="+", default=[2],
                      help="Triton pipelining stages to try on paged rows")
  parser.add_argument("--prefetch", type=int, nargs="+", default=[0],
                      help="tiles ahead a paged tile's page ids are read")
  parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2])
  parser.add_argument("--calls", type=int, default=50,
                      help="back-to-back calls per timing (median of 5)")
  parser.add_argument("--implementation", default="pallas",
                      help="'interpret' tries the script on a CPU")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  default = config.decode_block_k
  stages0, prefetch0 = config.DECODE_STAGES, config.DECODE_PREFETCH_PAGES
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
              implementation=args.implementation)), (q, kc, vc),
          args.calls, 5)
      cases = [dict(page_size=None, block_k=default(head_dim, cache_len),
                    num_stages=stages0, prefetch=prefetch0,
                    programs_per_sm=2, seconds=contiguous)]
      for page_size in args.page_sizes:
        paged = benchmark._paged_cache(kc, vc, page_size, keys[2])
        for block_k, stages, prefetch, per_sm in itertools.product(
            args.block_k, args.stages, args.prefetch, args.programs_per_sm):
          if block_k < page_size:
            continue
          splits = -(-per_sm * config.NUM_SMS // (batch * kv_heads))
          config.decode_block_k = lambda *a, b=block_k: b
          config.DECODE_STAGES, config.DECODE_PREFETCH_PAGES = stages, prefetch
          try:
            seconds = benchmark._time(jax.jit(benchmark._paged_decode(
                lengths, args.implementation, num_splits=splits)),
                (q, *paged), args.calls, 5)
          finally:
            config.decode_block_k = default
            config.DECODE_STAGES, config.DECODE_PREFETCH_PAGES = (
                stages0, prefetch0)
          cases.append(dict(page_size=page_size, block_k=block_k,
                            num_stages=stages, prefetch=prefetch,
                            programs_per_sm=per_sm, seconds=seconds))
      for case in cases:
        seconds = case.pop("seconds")
        row = dict(batch=batch, cache_len=cache_len, **case,
                   us=round(seconds * 1e6, 1),
                   tb_s=round(nbytes / seconds / 1e12, 3),
                   of_contiguous=round(contiguous / seconds, 3),
                   default=(case["block_k"] == default(
                       head_dim, cache_len, case["page_size"])
                            and case["num_stages"] == stages0
                            and case["prefetch"] == prefetch0
                            and case["programs_per_sm"] == 2))
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
