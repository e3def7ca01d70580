"""Block-size sweep of one (head dim, causal) shape: the data behind the
defaults in `pallas_kernels/triton/config.py`.

    PYTHONPATH=. python3 benchmarks/tune.py --head-dim 256 [--causal] [--out DIR]

bf16, 16k tokens (batch = 16384 / seq), hidden 2048. Times the forward under
each forward candidate and the backward (alone, from saved residuals) under
each backward candidate, the other half at its default; prints one JSON row per
candidate and writes tune_h{H}{_causal}.json.
"""
import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import BlockSizes
from benchmarks.harness import _measure

# (block_q, block_k, num_warps, num_stages)
FORWARD = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2),
           (128, 32, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
# (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps, num_stages)
BACKWARD = [(32, 64, 64, 32, 4, 1), (32, 64, 64, 32, 8, 1),
            (16, 32, 32, 16, 4, 1), (32, 32, 32, 32, 4, 1),
            (32, 32, 32, 32, 8, 1), (32, 32, 32, 32, 4, 2),
            (16, 64, 64, 16, 8, 1), (64, 64, 64, 64, 8, 1),
            (32, 64, 64, 32, 8, 2), (64, 32, 32, 64, 8, 1)]
# Head dims 257..512 (padded to 512): [rows, 512] tiles, one or two stages.
FORWARD_512 = [(32, 16, 8, 1), (32, 32, 8, 1), (64, 16, 8, 1), (64, 32, 8, 1),
               (64, 64, 8, 1), (32, 32, 4, 1), (64, 32, 8, 2), (128, 32, 8, 1)]
BACKWARD_512 = [(16, 16, 16, 16, 8, 1), (16, 32, 32, 16, 8, 1),
                (32, 32, 32, 32, 8, 1), (32, 16, 16, 32, 8, 1),
                (16, 32, 32, 16, 4, 1), (32, 64, 64, 32, 8, 1),
                (16, 64, 64, 16, 8, 1)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--head-dim", type=int, default=256)
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  h, t, causal = args.head_dim, args.seq_len, args.causal
  n, b = 2048 // h, max(1, 16384 // t)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16)
                 for kk in keys)
  flops = 4 * b * n * t * t * h / (2 if causal else 1)
  default = BlockSizes.get_default(h, jnp.bfloat16, causal)
  rows = []

  def run(kind, bs, mode):
    fn = lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=causal, implementation="triton", block_sizes=bs)
    row = dict(kind=kind, head_dim=h, seq_len=t, causal=causal,
               block_sizes=dataclasses.asdict(bs))
    row.update(_measure(fn, mode, q, k, v, do, flops, 10, 3))
    print(json.dumps(row), flush=True)
    rows.append(row)

  forward, backward = (FORWARD_512, BACKWARD_512) if h > 256 else (
      FORWARD, BACKWARD)
  for bq, bk, w, s in forward:
    run("fwd", dataclasses.replace(default, block_q=bq, block_k=bk,
                                   num_warps=w, num_stages=s), "fwd")
  for qd, kd, qq, kq, w, s in backward:
    run("bwd", dataclasses.replace(
        default, block_q_dkv=qd, block_k_dkv=kd, block_q_dq=qq, block_k_dq=kq,
        num_warps_bwd=w, num_stages_bwd=s), "bwd")
  os.makedirs(args.out, exist_ok=True)
  name = f"tune_h{h}{'_causal' if causal else ''}.json"
  with open(os.path.join(args.out, name), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, default=dataclasses.asdict(default),
                   rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
