"""Short sequences and cross-attention: the Mosaic GPU kernels (persistent
and one CTA an item) against the Triton kernels and cuDNN, jitted calls.

    PYTHONPATH=. python benchmarks/short_sequences.py [--out DIR]

The short shapes of `benchmarks.harness.MODELS` and held-out ones like
them (`HELD_OUT` there), forward and forward+backward, bf16; one JSON line a
measurement, then a table of ms (and each against cuDNN's where it takes
the call) to DIR/short_sequences.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import jax.numpy as jnp

import jax_flash
from benchmarks import harness as benchmark
from pallas_kernels.mosaic_gpu import config

SHORT = ("vit_b16", "dit_xl2", "sd15_cross", "whisper_cross",
         "whisper_encoder", "gpt2_small")


def mosaic_impls(m: benchmark.ModelShape):
  """The Mosaic kernels with their default tiles, persistent and not."""
  def mosaic(persistent):
    dim = config.kernel_head_dim(m.head_dim, m.value_head_dim or m.head_dim)
    blocks = dataclasses.replace(jax_flash.MosaicBlockSizes.get_default(
        dim, m.causal, band_only=True, kv_len=m.kv_len), persistent=persistent)
    return lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=m.causal, implementation="mosaic",
        block_sizes=blocks)
  return {"mosaic_persistent": mosaic(True), "mosaic_per_item": mosaic(False)}


NAMES = ("mosaic_persistent", "mosaic_per_item", "flash_triton", "cudnn")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="short_out")
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  shapes = [m for m in benchmark.MODELS if m.name in SHORT] + list(benchmark.HELD_OUT)
  rows = benchmark.model_rows(shapes, NAMES, jnp.bfloat16, args.calls,
                              args.repeats, extra_impls=mosaic_impls)
  lines = ["| model | mode | " + " | ".join(NAMES) + " | best mosaic / "
           "cuDNN | flash_triton / cuDNN |",
           "|" + "---|" * (len(NAMES) + 4)]
  for m in shapes:
    for mode in ("fwd", "fwd+bwd"):
      ms = {r["impl"]: r.get("ms") for r in rows
            if r["model"] == m.name and r["mode"] == mode}
      base = ms.get("cudnn")
      best = min(x for x in (ms["mosaic_persistent"], ms["mosaic_per_item"],
                             float("inf")) if x)
      cells = [f"{ms[n]:.3f}" if ms.get(n) else "refused" for n in NAMES]
      ratio = (lambda x: f"{base / x:.2f}" if base and x and x < 1e9 else "-")
      lines.append(f"| {m.name} | {mode} | " + " | ".join(cells)
                   + f" | {ratio(best)} | {ratio(ms.get('flash_triton'))} |")
  with open(os.path.join(args.out, "short_sequences.md"), "w") as f:
    f.write("`python benchmarks/short_sequences.py`\n\n" + "\n".join(lines)
            + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
