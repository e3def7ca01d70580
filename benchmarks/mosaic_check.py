"""The Mosaic GPU kernels on the H200: correctness over a sweep, in one run.

    PYTHONPATH=. python3 benchmarks/mosaic_check.py [--out DIR]

For each shape: `flash_attention(implementation="mosaic")` (the Mosaic
forward and backward) against
the float32 reference, output, logsumexp and gradients, with
`assert_attention_close` (bounds tied to plain attention in the same dtype),
plus a bitwise repeat of output and gradients. Prints
one JSON row per case and writes mosaic_check.json; exits 1 if any failed.
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.testing import assert_attention_close, relative_error
from tests.cases import plain_attention, random_inputs

# (batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal[, window])
CASES = [
    (1, 1024, 1024, 8, 2, 128, "bfloat16", True, (200, 0)),
    (1, 512, 768, 4, 4, 64, "float16", False, (100, 37)),
    (2, 1024, 1024, 8, 8, 128, "bfloat16", False),
    (2, 1024, 1024, 8, 2, 64, "bfloat16", True),
    (1, 256, 1536, 8, 2, 128, "bfloat16", True),   # T < S, causal top-left.
    (1, 1024, 264, 4, 4, 128, "bfloat16", False),  # S a multiple of 8 only.
    (1, 512, 520, 8, 1, 64, "float16", True),  # MQA, S padded in dK/dV.
    (1, 2048, 2048, 4, 1, 64, "float16", False),
    (2, 1024, 1024, 8, 8, 128, "bfloat16", True),
    (1, 4096, 4096, 16, 16, 128, "bfloat16", True),
    (2, 512, 512, 4, 4, 256, "bfloat16", False),
    (2, 512, 512, 4, 2, 256, "float16", True),
    (1, 512, 1032, 4, 2, 256, "bfloat16", True),  # T < S, S padded in dK/dV.
    # Lengths no tile divides (padded in XLA, keys past S masked).
    (1, 1000, 1003, 8, 2, 128, "bfloat16", True),
    (2, 77, 77, 4, 4, 64, "float16", False),
    (1, 300, 1003, 4, 2, 256, "bfloat16", True),
]


def check(case):
  b, t, s, n, k, h, dtype, causal = case[:8]
  window = dict(local_window_size=case[8]) if len(case) > 8 else {}
  q, kk, v, do = random_inputs(b, t, s, n, k, h, jnp.dtype(dtype))
  names = ("out", "lse", "dq", "dk", "dv")

  def run(attention, up, repeat=False, **kw):
    @jax.jit  # Arrays as arguments: closed-over ones get constant-folded.
    def results(q, k, v, do):
      def f(q, k, v):
        return attention(up(q), up(k), up(v), is_causal=causal,
                         return_residual=True, **window, **kw)
      (out, lse), vjp = jax.vjp(f, q, k, v)
      dlse = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(
          lse.shape)
      return dict(zip(names, (out, lse) + vjp((do.astype(out.dtype), dlse))))
    first = results(q, kk, v, do)
    if repeat:
      return first, jax.tree.all(jax.tree.map(
          jnp.array_equal, first, results(q, kk, v, do)))
    return first

  got, repeats = run(jax_flash.flash_attention, lambda x: x, repeat=True,
                     implementation="mosaic")
  ref = run(jax_flash.reference_attention, lambda x: x.astype(jnp.float32))
  plain = run(plain_attention(jnp.dtype(dtype)), lambda x: x)
  errors = {name: relative_error(jnp.where(jnp.isfinite(ref[name]),
                                           got[name], 0),
                                 jnp.where(jnp.isfinite(ref[name]),
                                           ref[name], 0)) for name in names}
  plain_errors = {name: relative_error(plain[name], ref[name])
                  for name in ("out", "dq", "dk", "dv")}
  row = dict(case=case, errors=errors, plain_errors=plain_errors,
             bitwise_repeat=bool(repeats))
  try:
    assert_attention_close(got, ref, dtype, baseline=plain)
    row["ok"] = row["bitwise_repeat"]
  except AssertionError as e:
    row["ok"], row["why"] = False, str(e)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=".")
  parser.add_argument("--head-dims", type=int, nargs="+",
                      help="only the cases of these head dims")
  parser.add_argument("--cases", type=int, nargs="+",
                      help="only these cases (indices into CASES)")
  args = parser.parse_args()
  rows = []
  for index, case in enumerate(CASES):
    if args.head_dims and case[5] not in args.head_dims:
      continue
    if args.cases and index not in args.cases:
      continue
    start = time.perf_counter()
    try:
      row = check(case)
    except Exception as e:  # Say what failed, go on.
      row = dict(case=case, ok=False,
                 why=f"{type(e).__name__}: {str(e)[:500]}")
    row["seconds"] = round(time.perf_counter() - start, 1)
    rows.append(row)
    print(json.dumps(row), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "mosaic_check.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f,
              indent=1)
  failed = [r for r in rows if not r["ok"]]
  print(f"{len(rows) - len(failed)} of {len(rows)} cases passed")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
