"""The size of each Mosaic GPU module a call lowers: operations by kind.

A kernel's compile (Mosaic GPU's passes, LLVM, ptxas) grows with its
module; this counts the operations of each one a forward+backward lowers,
for an H200, on any machine (the module as Mosaic GPU has it before its
serialization):

    python scripts/module_ops.py [--shape 4x8192x32x8x128] [--causal]
        [--fwd-only]

Prints one line a kernel, in lowering order: all operations, loops
(`scf.for`), then the most frequent kinds.
"""
import argparse
import collections

import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import core

import jax_flash

H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                               platform="gpu")


def count_modules(fn, args) -> list[collections.Counter]:
  """Operation counts of each Mosaic GPU module lowering fn(*args) makes."""
  counts, serde = [], core._run_serde_pass

  def counting(module, *, serialize, ir_version):
    if serialize:
      ops = collections.Counter()

      def visit(op):
        ops[op.name] += 1
        return ir.WalkResult.ADVANCE
      module.operation.walk(visit)
      counts.append(ops)
    return serde(module, serialize=serialize, ir_version=ir_version)
  core._run_serde_pass = counting
  try:
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh(
        (1,), ("x",), abstract_device=H200)):
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    core._run_serde_pass = serde
  return counts


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="4x8192x32x8x128",
                      help="batch x seq x heads x kv_heads x head_dim")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--fwd-only", action="store_true")
  args = parser.parse_args()
  b, t, n, k, h = (int(x) for x in args.shape.split("x"))
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, k, h), jnp.bfloat16)

  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=args.causal,
                                     implementation="mosaic")

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v).astype(jnp.float32))
  fn = attention if args.fwd_only else jax.grad(loss, argnums=(0, 1, 2))
  for ops in count_modules(fn, (q, kv, kv)):
    common = ", ".join(f"{name} {n}" for name, n in ops.most_common(5))
    print(f"{sum(ops.values())} operations, {ops['scf.for']} loops; "
          f"{common}")


if __name__ == "__main__":
  main()
