"""The model shapes against cuDNN (or XLA where cuDNN refuses): one PNG.

    python benchmarks/plot_models.py OUT.png models.json

Reads `python -m benchmarks.harness --scenario models` results and plots,
for each model, the best other implementation's time over ours (above 1:
ours faster), forward and forward+backward, as bars.
"""
import argparse
import json


def ratios(path):
  """[(model, mode, ratio, against)]: the fastest of cuDNN and XLA over
  ours, and which it was."""
  with open(path) as f:
    rows = json.load(f)["rows"]
  ms = {(r["model"], r["impl"], r["mode"]): r["ms"] for r in rows
        if "ms" in r}
  out = []
  for model in dict.fromkeys(r["model"] for r in rows):
    for mode in ("fwd", "fwd+bwd"):
      others = {i: ms[(model, i, mode)] for i in ("cudnn", "xla")
                if (model, i, mode) in ms}
      if (model, "flash", mode) in ms and others:
        best = min(others, key=others.get)
        out.append((model, mode, others[best] / ms[(model, "flash", mode)],
                    best))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("run")
  args = parser.parse_args()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  points = ratios(args.run)
  models = list(dict.fromkeys(p[0] for p in points))
  fig, ax = plt.subplots(figsize=(8, 4.2))
  for j, mode in enumerate(("fwd", "fwd+bwd")):
    for i, model in enumerate(models):
      for m, md, ratio, against in points:
        if (m, md) == (model, mode):
          bar = ax.barh(i + 0.4 * j - 0.2, ratio, height=0.4,
                        color=("tab:blue", "tab:orange")[j],
                        label=mode if i == 0 else None)
          if against == "xla":
            ax.bar_label(bar, labels=["vs XLA"], fontsize=6, padding=2)
  ax.axvline(1.0, color="gray", linewidth=0.8)
  ax.set_yticks(range(len(models)), models, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("cuDNN's time / ours (XLA's where cuDNN refuses; above 1: "
                "ours faster)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out, dpi=90)


if __name__ == "__main__":
  main()
