"""Where a jitted attention call's GPU time goes: the attention kernels
against everything else XLA runs around them (padding copies, slices,
the backward's D = rowsum(dO * O), layout changes), per model shape and
implementation.

    PYTHONPATH=. python benchmarks/call_profile.py [--shapes dit_xl2 ...] \
        [--impls flash mosaic triton cudnn] [--lengths 256 257] [--out DIR]

For each (shape, implementation, forward or forward+backward): the call's
time as `benchmarks.harness` measures it (back-to-back jitted calls), then
`--calls` calls under `jax.profiler`: GPU ms a call in the attention
kernels (`ATTENTION`: ours and cuDNN's) and in the rest, and the costliest
kernels. Shapes: `benchmarks.harness.MODELS` and the held-out ones
(`HELD_OUT` there). One JSON line a row to stdout and DIR/call_profile.jsonl,
then a table to DIR/call_profile.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import harness as benchmark

# GPU kernels that compute attention (ours, cuDNN's); the rest is overhead.
ATTENTION = re.compile(r"flash_attention|sdpa|fmha|cudnn", re.IGNORECASE)
SHAPES = {m.name: m for m in benchmark.MODELS + benchmark.HELD_OUT}


def impls(m):
  def ours(implementation):
    return lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=m.causal, logits_soft_cap=m.soft_cap,
        implementation=implementation)

  def jax_nn(implementation):
    def f(q, k, v):
      hv = v.shape[-1]
      if hv != q.shape[-1]:  # jax.nn has no value head dim of its own.
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, q.shape[-1] - hv),))
      return jax.nn.dot_product_attention(
          q, k, v, is_causal=m.causal, implementation=implementation)[..., :hv]
    return f
  fp8 = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=m.causal, logits_soft_cap=m.soft_cap, fp8=True)
  return {"flash": ours(None), "fp8": fp8, "mosaic": ours("mosaic"),
          "triton": ours("triton"), "cudnn": jax_nn("cudnn"),
          "xla": jax_nn("xla")}


def profile_row(m, name, fn, mode, calls):
  hv = m.value_head_dim or m.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (m.batch, m.q_len, m.heads, m.head_dim),
                        jnp.bfloat16)
  k = jax.random.normal(keys[1], (m.batch, m.kv_len, m.kv_heads, m.head_dim),
                        jnp.bfloat16)
  v = jax.random.normal(keys[2], (m.batch, m.kv_len, m.kv_heads, hv),
                        jnp.bfloat16)
  do = jax.random.normal(keys[3], q.shape[:-1] + (hv,), jnp.bfloat16)
  row = dict(model=m.name, impl=name, mode=mode)
  try:
    f, args = benchmark._jitted(fn, mode, q, k, v, do)
    row["ms"] = benchmark._time(f, args, 30, 5) * 1e3
    with tempfile.TemporaryDirectory() as folder:
      with jax.profiler.trace(folder):
        out = None
        for _ in range(calls):
          out = f(*args)
        jax.block_until_ready(out)
      times = benchmark.gpu_times(folder, calls)
  except Exception as e:  # A refused call: say so, go on.
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row
  kernels = times["kernels"]
  row["gpu_ms"] = sum(kernels.values())
  row["attention_ms"] = sum(t for n, t in kernels.items() if ATTENTION.search(n))
  row["other_ms"] = row["gpu_ms"] - row["attention_ms"]
  row["launches"] = times["launches"]
  row["kernels"] = [(n[:80], round(t, 4)) for n, t in kernels.most_common(8)]
  return row


def markdown(rows) -> str:
  lines = ["| model | impl | mode | call ms | GPU ms | attention kernels | "
           "other | costliest other |", "|" + "---|" * 8]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['impl']} | {r['mode']} | "
                   f"{r['error'][:60]} | | | | |")
      continue
    other = [f"{n[:40]} {t:.3f}" for n, t in r["kernels"]
             if not ATTENTION.search(n)][:2]
    lines.append(
        f"| {r['model']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | "
        f"{r['gpu_ms']:.3f} | {r['attention_ms']:.3f} | {r['other_ms']:.3f} "
        f"| {'; '.join(other)} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                      choices=list(SHAPES))
  parser.add_argument("--impls", nargs="+",
                      default=["flash", "mosaic", "triton", "cudnn"],
                      choices=["flash", "fp8", "mosaic", "triton", "cudnn",
                               "xla"])
  parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"],
                      choices=["fwd", "bwd", "fwd+bwd"])
  parser.add_argument("--lengths", nargs="+", type=int, default=None,
                      help="run each shape with queries and keys of each "
                      "of these lengths instead of its own")
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--out", default="call_profile_out")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows = []
  shapes = [SHAPES[name] for name in args.shapes]
  if args.lengths:
    shapes = [dataclasses.replace(m, name=f"{m.name}@{n}", q_len=n, kv_len=n)
              for m in shapes for n in args.lengths]
  for m in shapes:
    fns = impls(m)
    for name in args.impls:
      for mode in args.modes:
        row = profile_row(m, name, fns[name], mode, args.calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "call_profile.jsonl"), "a") as f:
          f.write(json.dumps(row) + "\n")
  with open(os.path.join(args.out, "call_profile.md"), "w") as f:
    f.write(markdown(rows))
  print(markdown(rows))


if __name__ == "__main__":
  main()
