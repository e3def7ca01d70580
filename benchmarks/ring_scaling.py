"""Context parallelism on the GPUs of one host: ring_attention vs one GPU.

    PYTHONPATH=. python3 benchmarks/ring_scaling.py --out DIR

1. Equality: ring_attention over all local GPUs against flash_attention on one
   GPU (and both against the float32 reference), out and gradients, bf16,
   causal and not, MHA and GQA.
2. Scaling: forward+backward time of ring_attention on P GPUs at P*L tokens
   against flash_attention on one GPU at L tokens (the same per-device
   length). Causal work grows as the square of the length, so P GPUs at P*L
   do P times the per-device work of one GPU at L: ideal time ratio = P.
3. Length: the longest sequence run (one timed step), and XLA's compiled
   per-device memory at longer ones (compiled, not run).
Hidden 2048 (16 heads of 128), batch 1. Writes ring_scaling.json.
"""
import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from benchmarks.harness import _measure, compiled_gib
from jax_flash.testing import relative_error


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--check-len", type=int, default=8192)
  parser.add_argument("--per-device", type=int, nargs="+",
                      default=[16384, 65536])
  parser.add_argument("--longest", type=int, default=524288)
  parser.add_argument("--compile-only", type=int, nargs="+",
                      default=[1 << 20, 1 << 21, 1 << 22])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--implementation", default="pallas")
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  n, h, impl = args.heads, args.head_dim, args.implementation
  devices = jax.devices()
  size = len(devices)
  mesh = jax.make_mesh((size,), ("seq",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  sharded = NamedSharding(mesh, P(None, "seq"))
  rows = []

  def record(row):
    print(json.dumps(row), flush=True)
    rows.append(row)

  def inputs(t, kv_heads, place):
    keys = jax.random.split(jax.random.key(t + kv_heads), 4)
    shapes = [(1, t, n, h), (1, t, kv_heads, h), (1, t, kv_heads, h),
              (1, t, n, h)]
    return [jax.device_put(jax.random.normal(kk, s, jnp.bfloat16), place)
            for kk, s in zip(keys, shapes)]

  def ring(causal):
    return lambda q, k, v: jax_flash.ring_attention(
        q, k, v, mesh=mesh, axis_name="seq", is_causal=causal,
        implementation=impl)

  def single(causal):
    return lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=causal, implementation=impl)

  def out_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(do.astype(out.dtype))

  # 1. Equality.
  for causal, kv_heads in ((False, n), (True, n), (True, n // 4)):
    q, k, v, do = inputs(args.check_len, kv_heads, devices[0])
    ref = jax.jit(lambda *a, c=causal: out_and_grads(
        lambda q, k, v: jax_flash.reference_attention(q, k, v, is_causal=c),
        *(x.astype(jnp.float32) for x in a)))(q, k, v, do)
    one = jax.jit(lambda *a, c=causal: out_and_grads(single(c), *a))(
        q, k, v, do)
    many = jax.jit(lambda *a, c=causal: out_and_grads(ring(c), *a))(
        *(jax.device_put(x, sharded) for x in (q, k, v, do)))
    names = ("out", "dq", "dk", "dv")
    record(dict(
        check="equality", causal=causal, seq_len=args.check_len,
        num_heads=n, num_kv_heads=kv_heads, devices=size,
        ring_vs_one_gpu={nm: float(relative_error(a, b))
                         for nm, a, b in zip(names, many, one)},
        ring_vs_reference={nm: float(relative_error(a, b))
                           for nm, a, b in zip(names, many, ref)},
        one_gpu_vs_reference={nm: float(relative_error(a, b))
                              for nm, a, b in zip(names, one, ref)}))

  # 2. Scaling at the same per-device length.
  for causal in (True, False):
    for per_device in args.per_device:
      for name, t, place, fn in (
          ("one_gpu", per_device, devices[0], single(causal)),
          (f"ring_{size}_gpus", per_device * size, sharded, ring(causal))):
        q, k, v, do = inputs(t, n, place)
        flops = 4 * t * t * n * h / (2 if causal else 1)
        row = dict(check="scaling", impl=name, causal=causal, seq_len=t,
                   per_device=per_device, devices=size if "ring" in name else 1)
        row.update(_measure(fn, "fwd+bwd", q, k, v, do, flops, 3, 3))
        record(row)

  # 3. Length.
  t = args.longest
  q, k, v, do = inputs(t, n, sharded)
  row = dict(check="longest_run", impl=f"ring_{size}_gpus", causal=True,
             seq_len=t, devices=size)
  row.update(_measure(ring(True), "fwd+bwd", q, k, v, do,
                      4 * t * t * n * h / 2, 1, 1))
  record(row)
  step = lambda q, k, v, do: jax.vjp(ring(True), q, k, v)[1](do)
  for t in args.compile_only:
    spec = jax.ShapeDtypeStruct((1, t, n, h), jnp.bfloat16, sharding=sharded)
    row = dict(check="compiled_memory", impl=f"ring_{size}_gpus", causal=True,
               seq_len=t, devices=size)
    try:
      row["gib_per_device"] = compiled_gib(jax.jit(step), spec, spec, spec,
                                           spec)
    except Exception as e:  # Say so and go on.
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    record(row)

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "ring_scaling.json"), "w") as f:
    json.dump(dict(device=devices[0].device_kind, devices=size, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()
