"""Forward and forward+backward times of `jax_flash.flash_attention` (the
default dispatch, bf16, jitted calls) on the benchmark's dense grid and its
model shapes, for whichever jax_flash is first on PYTHONPATH: run it on two
trees one after the other on one GPU and compare with --compare.

    PYTHONPATH=<old tree> python scripts/side_by_side.py --out old.jsonl
    PYTHONPATH=. python scripts/side_by_side.py --out new.jsonl
    python scripts/side_by_side.py --compare old.jsonl new.jsonl

Public API only, so it runs on any commit's tree (timed by this tree's
`benchmarks/harness.py`, loaded by path, for both). Grid: 16,384 tokens a
call, 2,048 model dims (heads of 64 and 128), 1k/4k/16k tokens, causal or
not; shapes: those of `benchmarks.harness.MODELS` (written out here).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

# name: (batch, q_len, kv_len, heads, kv_heads, head_dim, value_head_dim,
# causal, soft_cap)
SHAPES = {
    "gpt2_small": (16, 1024, 1024, 12, 12, 64, 64, True, None),
    "llama3_8b": (2, 8192, 8192, 32, 8, 128, 128, True, None),
    "phi2": (4, 2048, 2048, 32, 32, 80, 80, True, None),
    "gemma2_9b": (2, 4096, 4096, 16, 8, 256, 256, True, 50.0),
    "deepseek_v2_mla": (1, 4096, 4096, 16, 16, 192, 128, True, None),
    "vit_b16": (128, 197, 197, 12, 12, 64, 64, False, None),
    "dit_xl2": (64, 256, 256, 16, 16, 72, 72, False, None),
    "sd15_unet": (8, 4096, 4096, 8, 8, 40, 40, False, None),
    "sd15_cross": (8, 4096, 77, 8, 8, 40, 40, False, None),
    "whisper_cross": (16, 448, 1500, 20, 20, 64, 64, False, None),
    "whisper_encoder": (8, 1500, 1500, 20, 20, 64, 64, False, None),
    "falcon_7b": (4, 2048, 2048, 71, 1, 64, 64, True, None),
}
for h in (64, 128):
  for t in (1024, 4096, 16384):
    for causal in (False, True):
      SHAPES[f"grid_h{h}_t{t}_{'causal' if causal else 'full'}"] = (
          16384 // t, t, t, 2048 // h, 2048 // h, h, h, causal, None)


def _harness():
  """This tree's `benchmarks/harness.py` (its timer `_time`), loaded by path:
  the tree under test may have no benchmarks package."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      os.pardir, "benchmarks", "harness.py")
  spec = importlib.util.spec_from_file_location("harness", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["harness"] = module  # Its dataclasses look themselves up.
  spec.loader.exec_module(module)
  return module


def measure(out_path: str, names) -> None:
  import jax
  import jax.numpy as jnp
  import jax_flash
  timer = _harness()._time
  with open(out_path, "a") as out:
    for name in names:
      b, t, s, n, kh, h, hv, causal, cap = SHAPES[name]
      keys = jax.random.split(jax.random.key(0), 4)
      q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
      k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
      v = jax.random.normal(keys[2], (b, s, kh, hv), jnp.bfloat16)
      do = jax.random.normal(keys[3], (b, t, n, hv), jnp.bfloat16)
      attend = lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal, logits_soft_cap=cap)
      fwd = jax.jit(attend)
      both = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
      for mode, fn, args in (("fwd", fwd, (q, k, v)),
                             ("fwd+bwd", both, (q, k, v, do))):
        try:
          row = dict(ms=timer(fn, args, calls=3, repeats=5) * 1e3)
        except Exception as e:  # Say so, go on.
          row = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        out.write(json.dumps(dict(shape=name, mode=mode, **row)) + "\n")
        out.flush()


def compare(old_path: str, new_path: str) -> None:
  def load(path):
    rows = [json.loads(line) for line in open(path)]
    return {(r["shape"], r["mode"]): r.get("ms") for r in rows}
  old, new = load(old_path), load(new_path)
  print("| shape | mode | old ms | new ms | old / new |\n|---|---|---|---|---|")
  for key in old:
    a, b = old[key], new.get(key)
    ratio = f"{a / b:.3f}" if a and b else "-"
    print(f"| {key[0]} | {key[1]} | {a and f'{a:.3f}'} | "
          f"{b and f'{b:.3f}'} | {ratio} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out")
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--compare", nargs=2)
  args = parser.parse_args()
  if args.compare:
    compare(*args.compare)
  else:
    measure(args.out, args.shapes)


if __name__ == "__main__":
  main()
