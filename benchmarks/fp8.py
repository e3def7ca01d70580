"""FP8 (`fp8=True`) against our bf16 kernels and cuDNN's bf16: speed and error.

    PYTHONPATH=. python benchmarks/fp8.py [--seq-len 8192] \
        [--head-dims 128 256] [--parts speed error]

For each head dim and causality, at `--seq-len` tokens (batch and heads
from `--tokens` and `--hidden`, as `jax_flash.benchmark`): ms and TFLOP/s of
jitted calls forward, backward and forward+backward for "bf16" (the
default dispatch on bf16 inputs), "fp8" (the same with fp8=True: on an
H100/H200 the Mosaic FP8 forward and the bf16 backward on the rounded
values) and "cudnn" (jax.nn, bf16). Then, at `--error-len` tokens, the
error (RMS over RMS) of fp8's output and gradients against float32
attention on the unquantized inputs, beside that of exact attention on
the inputs rounded to e4m3 (`jax_flash.spec.fp8.round_trip`) and of the
bf16 call. One JSON line a row.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import benchmark
from jax_flash.spec import fp8


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))


def speed(head_dim, causal, seq_len, tokens, hidden, calls, repeats):
  heads = hidden // head_dim
  batch = max(1, tokens // seq_len)
  keys = jax.random.split(jax.random.key(head_dim), 4)
  q, k, v, do = (jax.random.normal(kk, (batch, seq_len, heads, head_dim),
                                   jnp.bfloat16) for kk in keys)
  flops = 4 * batch * heads * seq_len * seq_len * head_dim / (2 if causal
                                                                else 1)
  impls = {
      "bf16": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal),
      "fp8": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal, fp8=True),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
  }
  for name, fn in impls.items():
    for mode in ("fwd", "bwd", "fwd+bwd"):
      row = dict(kind="speed", impl=name, mode=mode, head_dim=head_dim,
                 causal=causal, seq_len=seq_len, batch=batch, heads=heads)
      row.update(benchmark._measure(fn, mode, q, k, v, do, flops, calls,
                                    repeats))
      print(json.dumps(row), flush=True)


def error(head_dim, causal, seq_len, outliers):
  """Errors against float32 on the unquantized inputs; `outliers`: two
  feature columns of Q and K 20x the rest."""
  keys = jax.random.split(jax.random.key(1), 4)
  shape = (1, seq_len, 8, head_dim)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
  if outliers:
    cols = jnp.ones(head_dim).at[jnp.array([3, 17])].set(20.0)
    q, k = (q * cols).astype(jnp.bfloat16), (k * cols / 4.5).astype(
        jnp.bfloat16)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  exact = lambda q, k, v: jax_flash.reference_attention(q, k, v,
                                                        is_causal=causal)
  rounded = lambda q, k, v: exact(*(fp8.round_trip(x, 8) for x in (q, k, v)))
  calls = {"fp8": lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, fp8=True),
           "fp8_rotate": lambda q, k, v: jax_flash.flash_attention(
               q, k, v, is_causal=causal, fp8="rotate"),
           "bf16": lambda q, k, v: jax_flash.flash_attention(
               q, k, v, is_causal=causal),
           "rounding_alone": rounded}

  def grads(f, *args):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        f(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))(*args)
  want_o = jax.jit(exact)(*up)
  want_g = grads(exact, *up)
  for name, f in calls.items():
    args = up if name == "rounding_alone" else (q, k, v)
    row = dict(kind="error", impl=name, head_dim=head_dim, causal=causal,
               seq_len=seq_len, outliers=outliers,
               out=_rel(jax.jit(f)(*args), want_o))
    row.update({f"d{n}": _rel(g, w) for n, g, w in zip(
        "qkv", grads(f, *args), want_g)})
    print(json.dumps(row), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--error-len", type=int, default=2048)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--parts", nargs="+", default=["speed", "error"],
                      choices=["speed", "error"])
  args = parser.parse_args()
  for head_dim in args.head_dims if "speed" in args.parts else ():
    for causal in (True, False):
      speed(head_dim, causal, args.seq_len, args.tokens, args.hidden,
            args.calls, args.repeats)
  for head_dim in args.head_dims if "error" in args.parts else ():
    for outliers in (False, True):
      error(head_dim, True, args.error_len, outliers)


if __name__ == "__main__":
  main()
