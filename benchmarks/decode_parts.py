"""Where contiguous decode's time goes, against cuDNN's, one GPU.

    PYTHONPATH=. python benchmarks/decode_parts.py --out DIR

One new token per sequence (16 query heads and 4 KV heads of 128, bf16)
against a full contiguous cache, for each BATCHxCACHE shape: cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`), `flash_decode`
by default (the Mosaic split-KV kernel on an H100/H200), the Triton
split-KV kernel with its default split count and with each `--splits`,
"kernel_only": the default with the merge of the parts' partial outputs
replaced by taking the first part's (a wrong answer, timed to see what
the kernel costs without the merge; `softmax.merge` patched for that row
only), and the Mosaic kernel's `--mosaic` variants. Each row: microseconds a call, TB/s of K+V read, the ratio to cuDNN
in the same run, and the kernels in the compiled program's entry
computation (fusions and custom calls). One JSON line a row, printed and
written to DIR/decode_parts.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import functools
import re

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import harness as benchmark
from jax_flash.core import softmax
from jax_flash.core.mask import Mask
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu import flash_decode as mosaic_decode


def kernels(compiled) -> int:
  """Fusions and custom calls in a compiled program's entry computation."""
  entry = compiled.as_text().split("ENTRY", 1)[1]
  return len(re.findall(r"= \S+ (?:fusion|custom-call)\(", entry))


def _first_part(o, lse, axis):
  return (jnp.take(o, 0, axis=axis).astype(jnp.float32),
          jnp.take(lse, 0, axis=axis))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--shapes", nargs="+",
                      default=["64x32768", "64x131072", "8x32768"],
                      help="BATCHxCACHE")
  parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--mosaic", nargs="*", default=["4:0:1:2", "4:0:4:2"],
                      help="STAGES:CTAS[:HEADS[:CONSUMERS[:ROWS]]] of the "
                      "Mosaic split-KV kernel: CTAS 0 for one a "
                      "multiprocessor, HEADS the KV heads a tile (1 or 4), "
                      "CONSUMERS its consumer warpgroups (1 or 2), ROWS a "
                      "tile's rows (64; GPU only)")
  parser.add_argument("--hlo", action="store_true",
                      help="also write each row's compiled program to "
                      "DIR/hlo/<batch>x<cache>_<row>.txt")
  parser.add_argument("--repeat", type=int, default=1,
                      help="time every row this many times, in turn (the "
                      "spread between a row's times is the run's noise)")
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--implementation", default="pallas",
                      help="'interpret' tries the script on a CPU")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  heads, kv_heads, head_dim = 16, 4, 128
  on_gpu = jax.devices()[0].platform == "gpu"
  with open(os.path.join(args.out, "decode_parts.jsonl"), "w") as log:
    for shape in args.shapes:
      batch, cache_len = map(int, shape.split("x"))
      keys = jax.random.split(jax.random.key(batch), 3)
      q, kc, vc, lengths = benchmark.decode_inputs(
          keys, batch, cache_len, heads, kv_heads, head_dim, jnp.bfloat16)
      nbytes = 2 * kc.size * kc.dtype.itemsize

      def ours(splits, implementation=args.implementation):
        return lambda q, k, v: jax_flash.flash_decode(
            q, k, v, kv_lengths=lengths, num_splits=splits,
            implementation=implementation)

      # Triton's split-KV kernel by name on a GPU (on an H100/H200 the
      # default is the Mosaic one); --splits are its split counts.
      triton = "triton" if on_gpu else args.implementation
      cases = [("default", ours(None))]
      if on_gpu:
        cases.append(("triton", ours(None, triton)))
      cases += [(f"splits_{n}", ours(n, triton)) for n in args.splits]
      cases.append(("kernel_only", ours(None)))
      for config_text in args.mosaic if on_gpu else ():
        # (Not `heads`: that is the query heads of every shape.)
        given = list(map(int, config_text.split(":")))
        stages, n, tile_heads, consumers, rows = (
            given + [1, 1, 64][len(given) - 2:])
        cases.append((
            f"mosaic_s{stages}_ctas{n}_heads{tile_heads}_wg{consumers}"
            + (f"_rows{rows}" if rows != 64 else ""),
            functools.partial(
                lambda q, k, v, **kw: mosaic_decode.flash_decode(
                    q, k, v, lengths, scores=Scores(scale=head_dim ** -0.5),
                    mask=Mask(is_causal=True), **kw)[0], num_ctas=n or None,
                num_stages=stages, heads_per_cta=tile_heads,
                consumers=consumers, block_k=rows)))
      if on_gpu:
        cases.insert(0, ("cudnn", lambda q, k, v: (
            jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=lengths,
                implementation="cudnn"))))
      base = None
      for name, fn in cases * args.repeat:
        merge = softmax.merge
        if name == "kernel_only":
          softmax.merge = _first_part
        try:
          compiled = jax.jit(fn).lower(q, kc, vc).compile()
          seconds = benchmark._time(compiled, (q, kc, vc), args.calls, 5)
        finally:
          softmax.merge = merge
        if base is None or name == cases[0][0]:
          base = seconds  # The round's first row (cuDNN on a GPU).
        row = dict(batch=batch, cache_len=cache_len, q_heads=q.shape[2],
                   impl=name,
                   us=round(seconds * 1e6, 1),
                   tb_s=round(nbytes / seconds / 1e12, 3),
                   of_first=round(base / seconds, 3),
                   kernels=kernels(compiled))
        if args.hlo:
          os.makedirs(os.path.join(args.out, "hlo"), exist_ok=True)
          with open(os.path.join(args.out, "hlo", f"{shape}_{name}.txt"),
                    "w") as f:
            f.write(compiled.as_text())
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
