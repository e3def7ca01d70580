"""Context parallelism's per-device work on one GPU (communication left
out): what the cost model weighs, measured.

    PYTHONPATH=. python3 benchmarks/context_parallel_work.py [--devices 8]

For a causal sequence of `total` tokens over P devices (chunk L = total/P,
batch 1, bf16, N query heads of H on K KV heads), forward+backward:

* chunk: one device's chunk alone, causal L x L (the ideal a ring step
  reaches: the same FLOPs).
* ring_step: a zigzag ring step off the diagonal, two full (L/2 x L/2)
  pairs (the diagonal step, two causal and one full, does the same work).
* all_gather: the balanced halves of a chunk (rows at offsets dL/2 and
  (2P-1-d)L/2, here d = 0) against all `total` keys, forward and backward
  of each half timed apart (the per-device functions of `context_parallel.lowerings`).
* all_to_all: the whole sequence of N/P heads on K/P KV heads (K >= P).

Each row: ms, TFLOP/s (causal FLOPs as the benchmark counts them), and the
ratio of its time to the chunk's time scaled by its FLOPs (1.0: as fast
as the chunk alone). One JSON row a case on stdout.
"""
import argparse
import json

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import _dispatch, _primitive, attention
from benchmarks.harness import _measure, _time
from jax_flash.core import checks, softmax
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--totals", type=int, nargs="+",
                      default=[131072, 262144, 524288, 1048576])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--all-to-all-max", type=int, default=262144)
  parser.add_argument("--calls", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  p, n, kh, h = args.devices, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.bfloat16

  def arrays(t, s, heads, kv_heads, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (1, t, heads, h), dtype),
            jax.random.normal(keys[1], (1, s, kv_heads, h), dtype),
            jax.random.normal(keys[2], (1, s, kv_heads, h), dtype),
            jax.random.normal(keys[3], (1, t, heads, h), dtype))

  def flops(pairs, heads):  # Forward FLOPs of `pairs` visible (q, k) pairs.
    return 4 * heads * h * pairs

  for total in args.totals:
    chunk = total // p
    q, k, v, do = arrays(chunk, chunk, n, kh)
    causal = lambda q, k, v: jax_flash.flash_attention(q, k, v,
                                                       is_causal=True)
    base = _measure(causal, "fwd+bwd", q, k, v, do,
                    flops(chunk * chunk / 2, n), args.calls, args.repeats)
    rows = {"chunk": base}
    half = chunk // 2

    def step(q, k, v):  # Query halves 0 and 1 against key half 0, full.
      kh0, vh0 = k[:, :half], v[:, :half]
      return jnp.concatenate([jax_flash.flash_attention(q[:, :half], kh0, vh0),
                              jax_flash.flash_attention(q[:, half:], kh0, vh0)],
                             axis=1)
    rows["ring_step"] = _measure(step, "fwd+bwd", q, k, v, do,
                                 flops(2 * half * half, n), args.calls,
                                 args.repeats)
    # all_gather: the chunk's balanced halves (device 0) against all keys.
    qa, ka, va, _ = arrays(half, total, n, kh, seed=1)
    mask, scores = Mask(is_causal=True), Scores(scale=h ** -0.5)
    prob = checks.check_qkv(qa, ka, va)
    plan = _dispatch.select(None, qa, prob, dtype, mask=mask, scores=scores)
    cfg = attention.config(plan, None, prob, dtype, mask, scores,
                           is_causal=True)
    fwd = jax.jit(_primitive._chunk_forward, static_argnums=4)
    bwd = jax.jit(_primitive._chunk_backward, static_argnums=8)
    offsets = [jnp.zeros((1,), jnp.int32),
               jnp.full((1,), (2 * p - 1) * half, jnp.int32)]
    try:
      seconds = 0.0
      for off in offsets:
        operands = Operands(q_offsets=off)
        o, lse = fwd(qa, ka, va, operands, cfg)
        seconds += _time(lambda *a: fwd(*a, cfg), (qa, ka, va, operands),
                         args.calls, args.repeats)
        delta = softmax.backward_delta(o, do[:, :half])
        seconds += _time(lambda *a: bwd(*a, cfg),
                         (qa, ka, va, operands, delta, lse, do[:, :half],
                          jnp.zeros_like(lse)), args.calls, args.repeats)
      work = flops(p * chunk * chunk / 2, n) * 3.5
      rows["all_gather"] = dict(ms=seconds * 1e3,
                                tflops=work / seconds / 1e12,
                                plan=f"{cfg.plan.forward.name}/"
                                     f"{_primitive._chunk_config(cfg, qa, ka, va).plan.backward.name}")
    except Exception as e:  # Say so, go on.
      rows["all_gather"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    if total <= args.all_to_all_max and kh % p == 0:
      q2, k2, v2, do2 = arrays(total, total, n // p, kh // p, seed=2)
      rows["all_to_all"] = _measure(causal, "fwd+bwd", q2, k2, v2, do2,
                                    flops(total * total / 2, n // p),
                                    args.calls, args.repeats)
    for name, row in rows.items():
      if "tflops" in row and "tflops" in base:
        row["time_vs_chunk_rate"] = base["tflops"] / row["tflops"]
      print(json.dumps(dict(total=total, devices=p, heads=n, kv_heads=kh,
                            head_dim=h, strategy=name, **row)), flush=True)


if __name__ == "__main__":
  main()
