"""A score modification's cost against the Mosaic kernels' tiles: the
forward and forward+backward of plain Mosaic and Mosaic with ALiBi (or a
soft-cap) under several `MosaicBlockSizes`, beside cuDNN. ALiBi: the
defaults; `alibi_vectors` False and True; the dQ kernel's K/V tiles at 64
rows; the forward's K/V tiles at 128 rows; on causal masks `alibi_fold`. Soft-cap (`--modification
soft_cap`, a cap of 30): the defaults; the forward's K/V tiles at 128
rows; the dQ kernel's at 64.

    PYTHONPATH=. python3 benchmarks/alibi_tiles.py [--seq-len 8192]
        [--head-dims 128 64] [--modes fwd fwd+bwd]
        [--modification alibi|soft_cap] [--masks causal none]
        [--labels plain,alibi,alibi_fold,cudnn]

bf16, 16k tokens (batch = 16384 / seq), hidden 2048, causal and not, the
paper's geometric slopes; jitted calls, one JSON line a measurement. With
MOSAIC_GPU_DUMP_PTXAS=1 ptxas's report of each kernel follows the line
`== LABEL` on stderr.
"""
import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks.harness import _measure


def variants(head_dim: int, causal: bool, kv_len: int,
             modification: str = "alibi") -> dict:
  """{label: block sizes}: None is the call's defaults ("plain": no
  modification)."""
  default = jax_flash.MosaicBlockSizes.get_default(
      head_dim, causal, band_only=True, kv_len=kv_len)
  if modification == "soft_cap":
    out = {"plain": None, "soft_cap": None}
    if default.block_kv > 128:
      out["soft_cap kv=128"] = dataclasses.replace(default, block_kv=128)
    if default.block_kv_dq != 64:
      out["soft_cap kv_dq=64"] = dataclasses.replace(default, block_kv_dq=64)
    return out
  out = {"plain": None, "alibi": None,
         "alibi positions": dataclasses.replace(default, alibi_vectors=False),
         "alibi vectors": dataclasses.replace(default, alibi_vectors=True)}
  if default.block_kv_dq != 64:
    out["alibi positions kv_dq=64"] = dataclasses.replace(
        default, alibi_vectors=False, block_kv_dq=64)
  if default.block_kv > 128:
    out["alibi vectors kv=128"] = dataclasses.replace(
        default, alibi_vectors=True, block_kv=128)
  if causal:  # The query term in the row max and the logsumexp.
    out["alibi fold"] = dataclasses.replace(
        default, alibi_vectors=True, alibi_fold=True,
        block_kv=min(default.block_kv, 128))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
  parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
  parser.add_argument("--modification", default="alibi",
                      choices=["alibi", "soft_cap"])
  parser.add_argument("--masks", nargs="+", default=["causal", "none"],
                      choices=["causal", "none"])
  parser.add_argument("--labels", default=None,
                      help="comma-separated rows to run, spaces as "
                      "underscores (default: all)")
  args = parser.parse_args()
  wanted = (None if args.labels is None else
            {x.replace("_", " ") for x in args.labels.split(",")})
  t = args.seq_len
  for h in args.head_dims:
    b, n = 16384 // t, 2048 // h
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, t, n, h), jnp.bfloat16)
                   for x in keys)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, n + 1, dtype=jnp.float32) / n)
    for causal in (mask == "causal" for mask in args.masks):
      flops = 4 * b * n * h * t * t / (2 if causal else 1)
      modified = ({"logits_soft_cap": 30.0}
                  if args.modification == "soft_cap" else
                  {"alibi_slopes": slopes})
      impls = {label: lambda q, k, v, blocks=blocks, label=label:
               jax_flash.flash_attention(
                   q, k, v, is_causal=causal, implementation="mosaic",
                   block_sizes=blocks,
                   **({} if label == "plain" else modified))
               for label, blocks in variants(
                   h, causal, t, args.modification).items()}
      impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      for label, fn in impls.items():
        if wanted is not None and label.replace("_", " ") not in wanted:
          continue
        print(f"== {label} h={h} causal={causal}", file=sys.stderr,
              flush=True)
        for mode in args.modes:
          row = _measure(fn, mode, q, k, v, do, flops, calls=10, repeats=3)
          print(json.dumps(dict(label=label, head_dim=h, seq_len=t,
                                causal=causal, mode=mode, **row)),
                flush=True)


if __name__ == "__main__":
  main()
