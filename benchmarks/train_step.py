"""A language model's training step, ours against cuDNN's attention: tokens/s and where the time goes.

    PYTHONPATH=. python benchmarks/train_step.py [--configs llama_4k ...] \
        [--impls pallas cudnn] [--steps 20] [--rounds 3] [--profile DIR] \
        [--hlo DIR]

The model is `examples/train_lm.py`'s (pre-LayerNorm blocks, GQA
attention through `jax_flash.nnx.FlashAttention`, or the same
`nnx.MultiHeadAttention` with jax.nn's cuDNN attention for "cudnn"), bf16
compute, AdamW, on random tokens; each configuration is named after the
model family its shape follows (`CONFIGS`). For each (config, driver, impl):
the first step's time (compilation included), the steady-state step time
and tokens/s (`--rounds` rounds of `--steps` steps after two warm-up
steps, the impls in turn, one sync a round, the median round reported;
`host_ms`: the host's time to dispatch a step, before that sync), the
ratio to the first impl's; with `--profile`, three steps under
`jax.profiler`, the GPU's kernel time and launches per step and its 12
costliest XLA ops and kernels; with `--hlo`, the optimized HLO of the step
written to DIR. Drivers: "jit" (the step as one `jax.jit` of the model's
state, as the example's loop runs it) and "nnx_jit" (`train_lm.train_step`,
`nnx.jit`, which walks the module graph on every call). One
JSON line a row.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_lm  # noqa: E402

from benchmarks import harness as benchmark  # noqa: E402

# name -> (layers, d_model, heads, kv_heads, seq_len, batch)
CONFIGS = {
    # Llama-like: 16 query heads of 64 on 4 KV heads.
    "llama_4k": (8, 1024, 16, 4, 4096, 4),
    "llama_2k_h128": (8, 2048, 16, 8, 2048, 8),
    "llama_8k_h128": (4, 2048, 16, 8, 8192, 2),
    # MHA at 4k: 16 heads of 128, as many KV heads.
    "mha_4k_h128": (6, 2048, 16, 16, 4096, 4),
    # GPT-2 small: 12 heads of 64, MHA.
    "gpt2_1k": (12, 768, 12, 12, 1024, 16),
    # A CPU-sized check of the script itself.
    "tiny": (2, 128, 4, 2, 128, 2),
}
VOCAB = 128


def _model(config, impl):
  layers, d_model, heads, kv_heads, seq_len, _ = CONFIGS[config]
  model = train_lm.LanguageModel(VOCAB, seq_len, d_model, layers, heads,
                                 kv_heads, 0.0, impl, jnp.bfloat16,
                                 rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  return model, optimizer


def prepare(config, impl, driver="jit"):
  """(row, run, lowered): the configuration's row so far, a function that
  runs one step and returns its loss, and one that lowers the step.
  `driver` "nnx_jit" runs train_lm's `nnx.jit` step, "jit" the same step
  as one `jax.jit` of the state (`train_lm.jitted_train_step`, what the
  example's loop runs). The first step (compilation included) and two
  more have run."""
  layers, d_model, heads, kv_heads, seq_len, batch = CONFIGS[config]
  model, optimizer = _model(config, impl)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (batch, seq_len + 1)),
                       jnp.int32)
  row = dict(config=config, impl=impl, driver=driver, layers=layers,
             d_model=d_model, heads=heads, kv_heads=kv_heads,
             seq_len=seq_len, batch=batch)
  if driver == "jit":
    step, state = train_lm.jitted_train_step(model, optimizer)

    def run():
      nonlocal state
      loss, state = step(state, tokens)
      return loss
    lowered = lambda: step.lower(state, tokens)
  else:
    run = lambda: train_lm.train_step(model, optimizer, tokens)
    lowered = lambda: train_lm.train_step.lower(model, optimizer, tokens)
  start = time.perf_counter()
  float(run())
  row["first_step_s"] = time.perf_counter() - start
  for _ in range(2):
    float(run())
  return row, run, lowered


def time_steps(run, steps):
  """(host ms, ms) a step over `steps` back-to-back steps, one sync at the
  end, and the last loss."""
  start = time.perf_counter()
  for _ in range(steps):
    loss = run()
  host = (time.perf_counter() - start) / steps
  loss = float(loss)
  return host * 1e3, (time.perf_counter() - start) / steps * 1e3, loss


def inspect(row, run, lowered, profile=None, hlo=None):
  """Adds the optimized HLO's counts (`hlo`: its folder) and the GPU's time
  per op and kernel (`profile`: three steps under jax.profiler) to `row`."""
  name = f"{row['config']}_{row['impl']}_{row['driver']}"
  if hlo:
    os.makedirs(hlo, exist_ok=True)
    text = lowered().compile().as_text()
    with open(os.path.join(hlo, f"{name}.hlo.txt"), "w") as f:
      f.write(text)
    row["hlo_copies"] = text.count(" copy(") + text.count(" copy.")
    row["hlo_transposes"] = text.count(" transpose(")
    row["hlo_custom_calls"] = text.count("custom-call(")
  if profile:
    os.makedirs(profile, exist_ok=True)
    folder = tempfile.mkdtemp(dir=profile)
    with jax.profiler.trace(folder):
      for _ in range(3):
        loss = run()
      float(loss)
    times = benchmark.gpu_times(folder, 3)
    row["gpu_ms"] = sum(times["kernels"].values())
    row["gpu_kernels_a_step"] = times["launches"]
    for kind in ("ops", "kernels"):
      row[f"top_{kind}"] = [(name, round(ms, 3)) for name, ms in
                            times[kind].most_common(12)]


def measure(config, impls, steps, rounds=1, profile=None, hlo=None,
            driver="jit"):
  """One row an impl: each impl's step compiled, then `rounds` rounds that
  time `steps` steps of each impl in turn (so drift over the run falls on
  all alike); step_ms is the median round's, `rounds_ms` all of them."""
  prepared, rows = [], []
  for impl in impls:
    try:
      prepared.append(prepare(config, impl, driver))
    except Exception as e:  # A refused configuration: say so, go on.
      rows.append(dict(config=config, impl=impl, driver=driver,
                       error=f"{type(e).__name__}: "
                       f"{str(e).splitlines()[0][:300]}"))
  for _ in range(rounds):
    for row, run, _ in prepared:
      host_ms, ms, loss = time_steps(run, steps)
      row.setdefault("rounds_ms", []).append(round(ms, 3))
      row.update(host_ms=host_ms, loss=loss)
  for row, run, lowered in prepared:
    _, _, _, _, seq_len, batch = CONFIGS[config]
    row["step_ms"] = float(np.median(row["rounds_ms"]))
    row["tokens_per_s"] = batch * seq_len / row["step_ms"] * 1e3
    inspect(row, run, lowered, profile, hlo)
    rows.append(row)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+",
                      default=[c for c in CONFIGS if c != "tiny"],
                      choices=list(CONFIGS))
  parser.add_argument("--impls", nargs="+", default=["pallas", "cudnn"],
                      help="the model's --implementation (examples/"
                      "train_lm.py): pallas, mosaic, triton, cudnn, flax")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=1,
                      help="rounds of --steps steps, each impl in turn")
  parser.add_argument("--drivers", nargs="+", default=["jit", "nnx_jit"],
                      choices=["jit", "nnx_jit"],
                      help="jit: the step as one jax.jit of the model's "
                      "state; nnx_jit: train_lm's nnx.jit step")
  parser.add_argument("--profile", default=None,
                      help="a folder for profiles: report GPU time per op")
  parser.add_argument("--hlo", default=None,
                      help="a folder for each step's optimized HLO")
  args = parser.parse_args()
  for config, driver in itertools.product(args.configs, args.drivers):
    rows = measure(config, args.impls, args.steps, args.rounds,
                   args.profile, args.hlo, driver)
    first = next((r["tokens_per_s"] for r in rows if r["impl"] ==
                  args.impls[0] and "tokens_per_s" in r), None)
    for row in rows:
      if first and "tokens_per_s" in row:
        row["tokens_per_s_over_first"] = row["tokens_per_s"] / first
      print(json.dumps(row), flush=True)

if __name__ == "__main__":
  main()
