"""Ours against cuDNN, from benchmark JSONs: one PNG of time ratios.

    python benchmarks/plot_ratios.py OUT.png RUN.json [RUN.json ...]

Reads `python -m benchmarks.harness` results (`benchmark.json`), pairs
each row of `--ours` (default flash_mosaic) with cuDNN's row of the same
shape and mode, and plots cuDNN's time / ours (above 1: ours faster)
against the sequence length, one panel per mode, a line per (head dim,
KV heads, causal).
"""
import argparse
import json


def ratios(paths, ours):
  rows = []
  for path in paths:
    with open(path) as f:
      rows += json.load(f)["rows"]
  key = lambda r: (r["head_dim"], r["num_kv_heads"], r["num_heads"],
                   r["causal"], r["mode"], r["seq_len"])
  cudnn = {key(r): r for r in rows if r["impl"] == "cudnn" and "ms" in r}
  return [(key(r), cudnn[key(r)]["ms"] / r["ms"]) for r in rows
          if r["impl"] == ours and "ms" in r and key(r) in cudnn]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("runs", nargs="+")
  parser.add_argument("--ours", default="flash_mosaic")
  args = parser.parse_args()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  points = ratios(args.runs, args.ours)
  modes = ["fwd", "fwd+bwd"]
  fig, axes = plt.subplots(1, len(modes), figsize=(10, 3.8), sharey=True)
  colors = plt.get_cmap("tab20").colors
  for ax, mode in zip(axes, modes):
    lines = sorted({k[:4] for k, _ in points if k[4] == mode})
    for i, (h, kv, n, causal) in enumerate(lines):
      pts = sorted((k[5], r) for k, r in points
                   if k[:4] == (h, kv, n, causal) and k[4] == mode)
      label = f"H {h}{'' if kv == n else f', {n}/{kv} heads'}" + (
          " causal" if causal else "")
      ax.plot(*zip(*pts), marker="o", linestyle="--" if causal else "-",
              color=colors[i % len(colors)],
              label=label)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{mode}: cuDNN time / ours")
    ax.set_xlabel("sequence length")
  axes[0].set_ylabel("ratio (above 1: ours faster)")
  axes[-1].legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(args.out, dpi=90)


if __name__ == "__main__":
  main()
