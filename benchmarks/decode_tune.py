"""Paged decode: the decode kernel's tiling against the page size, one GPU.

    PYTHONPATH=. python benchmarks/decode_tune.py --out DIR

One new token per sequence (16 query heads and 4 KV heads of 128, bf16)
against a full cache stored contiguously and as pages of 16, 32 and 64
tokens in a random order. For each page size (0: the contiguous cache
itself), every `config.DecodeBlocks`
of the product of: key tile rows (`--block-k`, from one page up: a tile of
one page or less is a contiguous load, more pages a gather), pipelining
stages (`--stages`), tiles ahead that a tile's page ids are read
(`--prefetch`) and programs per multiprocessor (`--programs-per-sm`), or
instead of the programs, the number of chunks each sequence's cache is
split into (`--splits`, flash_decode's `num_splits`), warps a program
(`--num-warps`), and for tiles of
several pages a gathered load or a load and a dot a page
(`--page-dots 0 1`);
`config.decode_blocks` is replaced for each row. Prints and writes one JSON
line per row: TB/s of K+V read, the ratio to the contiguous cache (its
default tiling) in the same run, and whether the row is the default.
`config.decode_blocks` comes from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import harness as benchmark
from pallas_kernels.triton import config


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--shapes", nargs="+", default=["8x32768", "64x8192"],
                      help="BATCHxCACHE")
  parser.add_argument("--page-sizes", type=int, nargs="+",
                      default=[16, 32, 64],
                      help="tokens a page; 0 sweeps the contiguous cache")
  parser.add_argument("--block-k", type=int, nargs="+",
                      default=[16, 32, 64, 128])
  parser.add_argument("--stages", type=int, nargs="+", default=[2],
                      help="Triton pipelining stages to try on paged rows")
  parser.add_argument("--prefetch", type=int, nargs="+", default=[0],
                      help="tiles ahead a paged tile's page ids are read")
  parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[4])
  parser.add_argument("--splits", type=int, nargs="+", default=[0],
                      help="num_splits to pass (0: from programs per SM)")
  parser.add_argument("--num-warps", type=int, nargs="+", default=[4])
  parser.add_argument("--page-dots", type=int, nargs="+", default=[0],
                      help="1: a tile's pages loaded and multiplied one at "
                           "a time (`DecodeBlocks.page_dots`)")
  parser.add_argument("--calls", type=int, default=50,
                      help="back-to-back calls per timing (median of 5)")
  parser.add_argument("--implementation", default="pallas",
                      help="'interpret' tries the script on a CPU")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  default = config.decode_blocks
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
      cases = [(None, default(head_dim, cache_len), contiguous, None)]
      for page_size in args.page_sizes:  # 0: the contiguous cache.
        cache = (benchmark._paged_cache(kc, vc, page_size, keys[2])
                 if page_size else (kc, vc))
        for block_k, stages, prefetch, per_sm, splits, page_dots, warps in (
            itertools.product(args.block_k, args.stages, args.prefetch,
                              args.programs_per_sm, args.splits,
                              args.page_dots, args.num_warps)):
          if block_k < page_size or (prefetch and not page_size) or (
              page_dots and block_k <= page_size):
            continue
          splits = splits or None
          blocks = config.DecodeBlocks(
              block_k=block_k, num_stages=stages, prefetch_pages=prefetch,
              programs_per_sm=per_sm, page_dots=bool(page_dots),
              num_warps=warps)
          config.decode_blocks = lambda *a, b=blocks: b
          # A new function for each tiling: jax.jit would reuse the trace
          # (and the tiling) of the same function object.
          fn = (benchmark._paged_decode(lengths, args.implementation, splits)
                if page_size else lambda q, k, v, n=splits: (
                    jax_flash.flash_decode(
                        q, k, v, kv_lengths=lengths, num_splits=n,
                        implementation=args.implementation)))
          try:
            seconds = benchmark._time(jax.jit(fn), (q, *cache), args.calls, 5)
          finally:
            config.decode_blocks = default
          cases.append((page_size or None, blocks, seconds, splits))
      for page_size, blocks, seconds, splits in cases:
        row = dict(batch=batch, cache_len=cache_len, page_size=page_size,
                   **dataclasses.asdict(blocks), num_splits=splits,
                   us=round(seconds * 1e6, 1),
                   tb_s=round(nbytes / seconds / 1e12, 3),
                   of_contiguous=round(contiguous / seconds, 3),
                   default=(splits is None and
                            blocks == default(head_dim, cache_len, page_size)))
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
