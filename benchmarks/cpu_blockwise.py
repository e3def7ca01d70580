"""The "xla" backend (blockwise FlashAttention in plain JAX) against
`jax.nn.dot_product_attention(implementation="xla")` on this machine's CPU.

    PYTHONPATH=. python3 benchmarks/cpu_blockwise.py [--seq-lens 1024 8192]
        [--block-sizes 256 512 1024] [--out DIR]

Causal, GQA (8 query heads, 2 kv heads of 64), batch 1, jitted forward+
backward (a random cotangent), float32 and bfloat16: the median of
`--repeats` back-to-back batches of `--calls` calls after a warm-up, and
XLA's compiled memory (arguments + outputs + temporaries) of the step.
Prints one JSON row per measurement; writes blockwise.json and blockwise.md.
"""
import argparse
import datetime
import json
import os
import platform

import jax

import jax_flash
from jax_flash import blockwise
from benchmarks.harness import _time, compiled_gib


def _step(attention):
  def step(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v), q, k, v)
    return vjp(do)
  return jax.jit(step)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192],
                      help="sequence lengths (query = key)")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--block-sizes", type=int, nargs="+", default=[128],
                      help="blockwise block_q = block_k values to time")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  rows = []
  for dtype in args.dtypes:
    for seq in args.seq_lens:
      keys = jax.random.split(jax.random.key(seq), 4)
      q = jax.random.normal(keys[0], (1, seq, args.heads, args.head_dim),
                            dtype)
      k, v = (jax.random.normal(x, (1, seq, args.kv_heads, args.head_dim),
                                dtype) for x in keys[1:3])
      do = jax.random.normal(keys[3], q.shape, dtype)
      impls = {"jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="xla")}
      for block in args.block_sizes:
        config = blockwise.BlockSizes(block_q=block, block_k=block)
        impls[f"blockwise {block}"] = (
            lambda q, k, v, config=config: jax_flash.flash_attention(
                q, k, v, is_causal=True, implementation="xla",
                block_sizes=config))
      for name, fn in impls.items():
        step = _step(fn)
        row = dict(impl=name, dtype=dtype, seq_len=seq, heads=args.heads,
                   kv_heads=args.kv_heads, head_dim=args.head_dim)
        try:
          row["compiled_gib"] = compiled_gib(step, q, k, v, do)
          row["ms"] = _time(step, (q, k, v, do), args.calls,
                            args.repeats) * 1e3
        except Exception as e:  # Out of memory: say so, go on.
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
  os.makedirs(args.out, exist_ok=True)
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
              machine=f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", jax=jax.__version__)
  with open(os.path.join(args.out, "blockwise.json"), "w") as f:
    json.dump(dict(meta=meta, args=vars(args), rows=rows), f, indent=1)
  lines = ["| dtype | T | impl | fwd+bwd ms | / jax.nn | compiled GiB |",
           "|---|---|---|---|---|---|"]
  base = {(r["dtype"], r["seq_len"]): r.get("ms") for r in rows
          if r["impl"] == "jax.nn xla"}
  for r in rows:
    ref = base.get((r["dtype"], r["seq_len"]))
    ratio = f"{r['ms'] / ref:.2f}" if "ms" in r and ref else "-"
    ms = f"{r['ms']:.1f}" if "ms" in r else "fails"
    gib = f"{r['compiled_gib']:.3f}" if "compiled_gib" in r else "-"
    lines.append(f"| {r['dtype']} | {r['seq_len']} | {r['impl']} | {ms} | "
                 f"{ratio} | {gib} |")
  table = "\n".join(lines)
  with open(os.path.join(args.out, "blockwise.md"), "w") as f:
    f.write(f"# Blockwise XLA vs jax.nn, {meta['date'][:10]}, {meta['machine']}"
            f", jax {meta['jax']}\n\n`python3 benchmarks/cpu_blockwise.py "
            f"{_flags(args)}`\n\n"
            "Causal, GQA, batch 1, jitted forward+backward; median of "
            "back-to-back batches after a warm-up.\n\n" + table + "\n")
  print(table)


def _flags(args) -> str:
  """The command-line flags of `args` (lists as space-separated values)."""
  def value(v):
    return " ".join(map(str, v)) if isinstance(v, list) else str(v)
  return " ".join(f"--{k.replace('_', '-')} {value(v)}"
                  for k, v in vars(args).items() if k != "out")


if __name__ == "__main__":
  main()
