"""Flash attention forward and backward on random data, checked against the reference.

    python examples/quickstart.py            # CPU: the kernels in interpret mode
    python examples/quickstart.py --seq 4096 # on a GPU: the GPU kernels

Prints the relative error of the output and of dQ, dK, dV against
`jax_flash.reference_attention` (float32) and the steady-state time of a
jitted forward+backward (after a warm-up; the median of back-to-back calls).
"""
import argparse
import time

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.testing import relative_error, tolerance


def steady_state_seconds(fn, args, calls=5):
  """Median seconds a call of `fn(*args)`: 3 warm-up calls, then 3 batches
  of `calls` back-to-back calls."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return sorted(times)[1]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=4096 if on_gpu else 300)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--causal", action=argparse.BooleanOptionalAction,
                      default=True)
  args = parser.parse_args(argv)
  # The GPU kernels on a GPU; on a CPU the Triton kernels, interpreted.
  implementation = "pallas" if on_gpu else "interpret"
  dtype = jnp.dtype(args.dtype)

  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (args.batch, args.seq, args.heads, args.head_dim),
                        dtype)
  k = jax.random.normal(kk, (args.batch, args.seq, args.kv_heads,
                             args.head_dim), dtype)
  v = jax.random.normal(kv, k.shape, dtype)
  do = jax.random.normal(kd, q.shape, dtype)

  def forward_backward(attention, **kwargs):
    def f(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: attention(
          q, k, v, is_causal=args.causal, **kwargs), q, k, v)
      return out, vjp(do.astype(out.dtype))
    return jax.jit(f)

  flash = forward_backward(jax_flash.flash_attention,
                           implementation=implementation)
  out, (dq, dk, dv) = flash(q, k, v)
  seconds = steady_state_seconds(flash, (q, k, v))

  up = lambda x: x.astype(jnp.float32)
  ref_out, ref_grads = forward_backward(jax_flash.reference_attention)(
      up(q), up(k), up(v))
  errors = {"out": relative_error(out, ref_out)}
  errors.update({name: relative_error(g, r) for name, g, r in
                 zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads)})
  tol = tolerance(dtype)

  print(f"flash_attention ({implementation}) on {jax.devices()[0].device_kind}: "
        f"q {q.shape}, k/v {k.shape}, {dtype.name}, causal={args.causal}")
  for name, err in errors.items():
    bound = tol.out if name == "out" else tol.grad
    print(f"  {name:>3}: relative error {err:.2e} (bound {bound:.1e})")
  print(f"  forward+backward: {seconds * 1e3:.1f} ms (steady state, median "
        "of back-to-back calls)")
  ok = errors["out"] <= tol.out and all(
      errors[n] <= tol.grad for n in ("dq", "dk", "dv"))
  print("OK" if ok else "MISMATCH")
  if not ok:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
