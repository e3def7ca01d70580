"""Where a first call's time goes: tracing, lowering, XLA's compile, the first run.

    PYTHONPATH=. python benchmarks/compile_time.py [--impls ours cudnn] \
        [--shapes 4x8192x32x8x128 ...] [--modes fwd fwd+bwd] [--cache] \
        [--warm 2x1024x16x4x128] [--rounds 3]

Each measurement runs in a fresh process (nothing cached in memory, and a
kernel cache folder of its own, empty), on bf16 inputs of shape batch x
seq x heads x kv_heads x head_dim, causal; with `--warm SHAPE`, a process
that has already run SHAPE's forward+backward (a new shape's first call in
a process whose kernels of another shape are compiled):

* `first_call_s`: the wall time of `jax.jit(f)(*args)` to its result, what
  a user's first call costs;
* the same first call in stages, in another fresh process: `trace_s`
  (`jax.jit(f).trace`: Python, our checks, the kernels' Pallas tracing of
  a forward or backward, which run at trace time), `lower_s` (`.lower()`:
  MLIR, Mosaic GPU and Triton lowering of the kernels), `compile_s`
  (`.compile()`: XLA, and the kernels' own compilation where it happens
  there) and `first_run_s` (the first execution: kernels compiled at
  their first launch);
* with `--cache`: the library's kernel cache alone (its default; JAX's
  persistent compilation cache off) in a fresh folder, one process filling
  it and a second one measured (`kernel_cached_first_call_s`); then JAX's
  persistent compilation cache as well (`cached_first_call_s`;
  `cached_matches`: both processes' results have the same checksum).

f is the forward (`fwd`) or `jax.vjp` of it applied to a cotangent
(`fwd+bwd`). Prints one JSON line a measurement; ratios to cuDNN are the
reader's (same process kinds, same shapes).
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time


def _attention(impl):
  import jax

  import jax_flash
  if impl == "ours":
    return lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True)
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl)


def _inputs(shape, dtype):
  """Random q, k, v and a cotangent of `shape` (b x t x n x kv x h)."""
  import jax
  batch, seq, heads, kv_heads, head_dim = shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], k.shape, dtype)
  do = jax.random.normal(keys[3], q.shape, dtype)
  return jax.block_until_ready((q, k, v, do))


def _warm_up(attn, shape, dtype):
  """Runs `attn`'s forward+backward at `shape` to its result."""
  import jax
  q, k, v, do = _inputs(shape, dtype)
  jax.block_until_ready(jax.jit(
      lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))(q, k, v, do))


def _child(impl, shape, mode, staged, warm=None):
  import jax
  import jax.numpy as jnp

  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  q, k, v, do = _inputs(shape, dtype)
  attn = _attention(impl)
  if warm:
    _warm_up(attn, warm, dtype)
  if mode == "fwd":
    f, args = attn, (q, k, v)
  else:
    f, args = (lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do)), (q, k, v,
                                                                    do)
  row = {}
  start = time.perf_counter()
  if not staged:
    out = jax.block_until_ready(jax.jit(f)(*args))
    row["first_call_s"] = time.perf_counter() - start
    row["checksum"] = float(sum(jnp.sum(jnp.abs(x.astype(jnp.float32)))
                                for x in jax.tree.leaves(out)))
    return row
  traced = jax.jit(f).trace(*args)
  row["trace_s"] = time.perf_counter() - start
  start = time.perf_counter()
  lowered = traced.lower()
  row["lower_s"] = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  row["compile_s"] = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  row["first_run_s"] = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  row["second_run_s"] = time.perf_counter() - start
  return row


def _spawn(impl, shape, mode, staged, env=None, warm=None):
  """One measurement in a fresh process; without `env`, with an empty
  kernel cache folder of its own (a new shape's first call)."""
  command = [sys.executable, __file__, "--child", impl, mode,
             "x".join(map(str, shape)), "staged" if staged else "plain",
             "x".join(map(str, warm)) if warm else "-"]
  if env is None:
    with tempfile.TemporaryDirectory() as folder:
      return _spawn(impl, shape, mode, staged,
                    dict(os.environ, JAX_FLASH_CACHE_DIR=folder), warm)
  result = subprocess.run(command, capture_output=True, text=True,
                          env=env, timeout=900)
  if result.returncode:
    return {"error": result.stderr.strip().splitlines()[-1][:300]}
  return json.loads(result.stdout.strip().splitlines()[-1])


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    impl, mode, shape, staged, warm = sys.argv[2:7]
    shape = tuple(int(x) for x in shape.split("x"))
    warm = None if warm == "-" else tuple(int(x) for x in warm.split("x"))
    print(json.dumps(_child(impl, shape, mode, staged == "staged", warm)))
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["ours", "cudnn"],
                      help="ours (flash_attention), or a jax.nn "
                      "implementation (cudnn, xla)")
  parser.add_argument("--shapes", nargs="+",
                      default=["4x8192x32x8x128", "2x8192x32x32x64"],
                      help="batch x seq x heads x kv_heads x head_dim")
  parser.add_argument("--modes", nargs="+", default=["fwd+bwd"],
                      choices=["fwd", "fwd+bwd"])
  parser.add_argument("--warm", default=None,
                      help="a shape whose forward+backward each process "
                      "runs first (its kernels compiled) before the one "
                      "measured")
  parser.add_argument("--rounds", type=int, default=1,
                      help="measure each row this many times (fresh "
                      "processes; a row a round, `round` in it)")
  parser.add_argument("--cache", action="store_true",
                      help="also measure a second process's first call "
                      "with the persistent compilation cache")
  args = parser.parse_args()
  warm = tuple(int(x) for x in args.warm.split("x")) if args.warm else None
  for shape_text, rnd in itertools.product(args.shapes, range(args.rounds)):
    shape = tuple(int(x) for x in shape_text.split("x"))
    for mode in args.modes:
      for impl in args.impls:
        row = dict(impl=impl, mode=mode, shape=shape_text, warm=args.warm,
                   round=rnd)
        row.update(_spawn(impl, shape, mode, staged=False, warm=warm))
        row.update(_spawn(impl, shape, mode, staged=True, warm=warm))
        if args.cache:
          with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, JAX_FLASH_CACHE_DIR=folder)
            _spawn(impl, shape, mode, staged=False, env=env)
            cached = _spawn(impl, shape, mode, staged=False, env=env)
            row["kernel_cached_first_call_s"] = cached.get(
                "first_call_s", cached.get("error"))
          with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=folder,
                       JAX_FLASH_CACHE_DIR=os.path.join(folder, "kernels"),
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            filled = _spawn(impl, shape, mode, staged=False, env=env)
            cached = _spawn(impl, shape, mode, staged=False, env=env)
            row["filling_first_call_s"] = filled.get("first_call_s")
            row["cached_first_call_s"] = cached.get("first_call_s",
                                                    cached.get("error"))
            row["cache_files"] = len(os.listdir(folder))
            row["cached_matches"] = (filled.get("checksum") ==
                                     cached.get("checksum"))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)


if __name__ == "__main__":
  main()
