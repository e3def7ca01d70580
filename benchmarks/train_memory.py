"""Compiled memory of one jitted training step of the example language model.

    PYTHONPATH=. python benchmarks/train_memory.py --seq-lens 8192 32768 \\
        --impls pallas cudnn flax

Builds `examples/train_lm.py`'s model (GPT-2-small by default: 12 layers,
d_model 768, 12 heads, bfloat16 compute), compiles its AdamW training step on
one sequence of each length for each attention implementation, and prints
one JSON line per (implementation, length) with XLA's memory analysis:
temporaries, arguments and outputs, in bytes. Nothing runs: compile only.
FlashAttention's claim is that the temporaries grow linearly in the length;
flax's own attention (the T x T weights) grows quadratically.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.train_lm import LanguageModel, loss_fn


def step_memory(implementation, seq_len, *, layers, d_model, heads, kv_heads,
                dtype, batch=1, vocab=80):
  """XLA's memory analysis of the compiled training step, as a dict."""
  model = LanguageModel(vocab, seq_len, d_model, layers, heads, kv_heads,
                        0.0, implementation, dtype, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, tokens))(model)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))

  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  mem = jax.jit(train_step).lower(state, tokens).compile().memory_analysis()
  return dict(temp_bytes=mem.temp_size_in_bytes,
              argument_bytes=mem.argument_size_in_bytes,
              output_bytes=mem.output_size_in_bytes)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
  parser.add_argument("--impls", nargs="+", default=["pallas", "cudnn", "flax"],
                      help="train_lm's --implementation values")
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--d-model", type=int, default=768)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--kv-heads", type=int, default=12)
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args(argv)
  for impl in args.impls:
    for seq_len in args.seq_lens:
      row = dict(impl=impl, seq_len=seq_len, layers=args.layers,
                 d_model=args.d_model, heads=args.heads,
                 device=jax.devices()[0].device_kind)
      try:
        row.update(step_memory(impl, seq_len, layers=args.layers,
                               d_model=args.d_model, heads=args.heads,
                               kv_heads=args.kv_heads,
                               dtype=jnp.dtype(args.dtype)))
        row["temp_gib"] = round(row["temp_bytes"] / 2**30, 3)
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
