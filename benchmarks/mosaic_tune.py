"""Tile sweep of the Mosaic GPU kernels, cuDNN timed alongside each shape.

    PYTHONPATH=. python3 benchmarks/mosaic_tune.py [--head-dims 64 128]
        [--seq-len 8192] [--modes fwd bwd] [--candidates JSON] [--out DIR]
        [--runs 10] [--repeats 3]

bf16, 16k tokens (batch = 16384 / seq), hidden 2048, causal and not. For each
(head dim, causal, mode): cuDNN, then the Mosaic kernels under every
candidate `MosaicBlockSizes` of that mode (forward tiles for "fwd", backward
tiles for "bwd", the rest at their defaults; or `--candidates`) that fits
shared memory; prints
one JSON row per measurement (TFLOP/s and the ratio to cuDNN in the same run)
and writes mosaic_tune.json. The data behind
`pallas_kernels/mosaic_gpu/config.py`. With MOSAIC_GPU_DUMP_PTXAS=1 each
Mosaic row also gets "ptxas": the spill bytes (stores) of each kernel
ptxas compiled while that row was measured (a kernel compiled before, with
the same code, is not compiled again and not listed). Each row times
--repeats batches of --calls back-to-back calls or more (the median
batch; `benchmarks.harness._time` makes a batch last 20 ms or more and
warms up for 0.2 s first).
"""
import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks.harness import _measure
from pallas_kernels.mosaic_gpu import config

CANDIDATES = {
    "fwd": [dict(block_q=64, block_kv=kv, num_stages=stages)
            for kv, stages in ((128, 2), (128, 3), (64, 2), (64, 3), (64, 4),
                               (256, 2))],
    "bwd": [dict(block_q_dkv=q_dkv, block_kv_dq=kv_dq, num_stages_bwd=stages)
            for q_dkv, kv_dq, stages in ((64, 64, 2), (64, 64, 3),
                                         (64, 128, 2), (64, 128, 3),
                                         (128, 64, 2))],
}


@contextlib.contextmanager
def captured_output(lines: list):
  """Appends to `lines` what the process writes to its stdout and stderr
  file descriptors inside the block (ptxas's report comes from C++)."""
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  saved = [os.dup(fd) for fd in (1, 2)]
  with tempfile.TemporaryFile(mode="w+") as sink:
    try:
      for fd in (1, 2):
        os.dup2(sink.fileno(), fd)
      yield
    finally:
      for stream in (sys.stdout, sys.stderr):
        stream.flush()
      for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)
      sink.seek(0)
      lines.extend(sink.read().splitlines())


def spills(lines) -> dict:
  """{kernel: spill store bytes} from ptxas's verbose report: the bytes
  of the "spill stores" line that follows each "Compiling entry function"
  line."""
  out, function = {}, None
  for line in lines:
    entry = re.search(r"Compiling entry function '(\w+)'", line)
    if entry:
      function = entry.group(1)
    stores = re.search(r"(\d+) bytes spill stores", line)
    if stores and function is not None and function not in out:
      out[function] = int(stores.group(1))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--modes", nargs="+", default=["fwd"])
  parser.add_argument("--candidates", type=json.loads,
                      help="a JSON list of MosaicBlockSizes fields to try "
                           "instead of the mode's (`{}`: the defaults), e.g. "
                           "'[{}, {\"named_barriers\": true}]'")
  parser.add_argument("--out", default=".")
  parser.add_argument("--calls", type=int, default=10,
                      help="back-to-back calls per timed batch")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed batches; the median is reported")
  args = parser.parse_args()
  t, rows = args.seq_len, []
  for h in args.head_dims:
    n, b = 2048 // h, max(1, 16384 // t)
    keys = jax.random.split(jax.random.key(h), 4)
    q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16)
                   for kk in keys)
    for causal in (False, True):
      flops = 4 * b * n * t * t * h / (2 if causal else 1)
      for mode in args.modes:
        cudnn = _measure(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), mode,
                         q, k, v, do, flops, args.calls, args.repeats)
        row = dict(impl="cudnn", head_dim=h, causal=causal, mode=mode, **cudnn)
        print(json.dumps(row), flush=True)
        rows.append(row)
        for candidate in args.candidates or CANDIDATES[mode]:
          bs = dataclasses.replace(
              jax_flash.MosaicBlockSizes.get_default(
                  h, causal, kv_len=args.seq_len), **candidate)
          if max(bs.smem_bytes(h, 2),
                 bs.backward_smem_bytes(h, 2)) > config.SMEM_BYTES:
            continue
          fn = lambda q, k, v, bs=bs: jax_flash.flash_attention(
              q, k, v, is_causal=causal, implementation="mosaic",
              block_sizes=bs)
          lines = []
          with (captured_output(lines) if os.environ.get(
              "MOSAIC_GPU_DUMP_PTXAS") else contextlib.nullcontext()):
            measured = _measure(fn, mode, q, k, v, do, flops, args.calls,
                                args.repeats)
          row = dict(impl="mosaic", head_dim=h, causal=causal, mode=mode,
                     block_sizes=dataclasses.asdict(bs), **measured)
          if lines:
            row["ptxas"] = spills(lines)
          if "tflops" in row and "tflops" in cudnn:
            row["vs_cudnn"] = round(row["tflops"] / cudnn["tflops"], 3)
          print(json.dumps(row), flush=True)
          rows.append(row)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "mosaic_tune.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, seq_len=t, rows=rows),
              f, indent=1)


if __name__ == "__main__":
  main()
