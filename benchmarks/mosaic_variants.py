"""One model shape under block-size variants of the Mosaic GPU or the
Triton kernels, beside both backends' defaults and cuDNN: which schedule
suits it, measured.

    PYTHONPATH=. python3 benchmarks/mosaic_variants.py whisper_cross \
        '{"persistent": false}' '{"block_kv": 256}' \
        'triton {"block_q_dkv": 32}'

The shape: a name of `benchmarks.harness.MODELS` or `HELD_OUT`. Each
variant: JSON of `MosaicBlockSizes` fields over the shape's defaults, or
after "triton ", of the Triton `BlockSizes` fields over its defaults
(`implementation="triton"`). Forward and forward+backward, bf16, jitted
calls; one JSON line a measurement.
"""
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks.harness import HELD_OUT, MODELS, _measure


def main(name, *variants):
  shape = next(m for m in MODELS + HELD_OUT if m.name == name)
  b, t, s, n, kh, h = (shape.batch, shape.q_len, shape.kv_len, shape.heads,
                       shape.kv_heads, shape.head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
  pairs = t * s / (2 if shape.causal else 1)
  flops = 4 * b * n * h * pairs
  default = jax_flash.MosaicBlockSizes.get_default(h, shape.causal)
  triton = jax_flash.BlockSizes.get_default(h, jnp.bfloat16, shape.causal)
  impls = {"triton": dict(implementation="triton"),
           "mosaic_default": dict(implementation="mosaic")}
  for text in variants:
    if text.startswith("triton "):
      impls[text] = dict(implementation="triton", block_sizes=(
          dataclasses.replace(triton, **json.loads(text.split(" ", 1)[1]))))
      continue
    impls[f"mosaic {text}"] = dict(
        implementation="mosaic",
        block_sizes=dataclasses.replace(default, **json.loads(text)))
  for label, options in impls.items():
    fn = lambda q, k, v, options=options: jax_flash.flash_attention(
        q, k, v, is_causal=shape.causal, **options)
    for mode in ("fwd", "fwd+bwd"):
      row = _measure(fn, mode, q, k, v, do, flops, 10, 5)
      print(json.dumps(dict(shape=name, impl=label, mode=mode, **row)),
            flush=True)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=shape.causal, implementation="cudnn")
  for mode in ("fwd", "fwd+bwd"):
    print(json.dumps(dict(shape=name, impl="cudnn", mode=mode,
                          **_measure(cudnn, mode, q, k, v, do, flops, 10,
                                     5))), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
