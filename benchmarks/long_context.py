"""One long causal sequence on one GPU: time and memory, ours vs cuDNN.

    PYTHONPATH=. python3 benchmarks/long_context.py [--seq-len 131072] [--out DIR]

Batch 1, hidden 2048 (16 heads of 128), bfloat16, causal; forward and
forward+backward timed as in `benchmarks.harness`, and each compiled
function's memory from XLA's memory_analysis (arguments + outputs + temporaries).
Writes long_context.json under --out.
"""
import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks.harness import _jitted, _measure, compiled_gib


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-len", type=int, default=131072)
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  t, n, h = args.seq_len, 16, 128
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (1, t, n, h), jnp.bfloat16)
                 for kk in keys)
  fwd_flops = 4 * t * t * n * h / 2
  impls = {
      "flash_v2": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=True, implementation="pallas"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"),
  }
  rows = []
  for name, fn in impls.items():
    for mode in ("fwd", "fwd+bwd"):
      row = dict(impl=name, mode=mode, seq_len=t, num_heads=n, head_dim=h)
      row.update(_measure(fn, mode, q, k, v, do, fwd_flops, 3, 3))
      try:
        f, f_args = _jitted(fn, mode, q, k, v, do)
        row["gib"] = compiled_gib(f, *f_args)
      except Exception as e:  # Say so and go on.
        row["memory_error"] = str(e).splitlines()[0][:200]
      print(json.dumps(row), flush=True)
      rows.append(row)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "long_context.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
