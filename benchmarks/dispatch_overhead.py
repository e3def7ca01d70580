"""Host time a call: a jitted function against its compiled executable.

    PYTHONPATH=. python benchmarks/dispatch_overhead.py [--calls N]

`flash_attention` is a hijax primitive, and JAX 0.11's `jax.jit` dispatches
a function holding one by its Python path on every call (no C++ fast
path); `jax.jit(f).lower(*args).compile()` gives an executable called from
C++. Times back-to-back calls of both, for our forward and, on a GPU,
cuDNN's through `jax.nn`, on a small problem (1 x 16 tokens, 2 heads of
64) whose kernel time is far below either: microseconds a call, host-bound.
Prints one JSON line per implementation.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp

import jax_flash


def per_call_us(fn, args, calls):
  """Median over 5 batches of `calls` back-to-back calls, microseconds."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e6)
  return sorted(times)[2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=2000)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  q = jax.random.normal(jax.random.key(0), (1, 16, 2, 64), dtype)
  impls = {"flash_attention": lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True)}
  if on_gpu:
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")
  for name, fn in impls.items():
    jitted = jax.jit(fn)
    compiled = jax.jit(fn).lower(q, q, q).compile()
    print(json.dumps(dict(
        impl=name, backend=jax.default_backend(), jax=jax.__version__,
        jit_us=round(per_call_us(jitted, (q, q, q), args.calls), 1),
        compiled_us=round(per_call_us(compiled, (q, q, q), args.calls), 1))),
          flush=True)


if __name__ == "__main__":
  main()
