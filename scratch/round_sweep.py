import json, os
import jax, jax.numpy as jnp
from jax_flash import benchmark
from jax_flash.spec import fp8
from pallas_kernels.triton import fp8_round
for shape, K in [((2, 8192, 16, 128), 16), ((4, 8192, 32, 128), 8), ((2, 8192, 8, 256), 8)]:
  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  s = fp8.scales(x, K)
  mib = x.size * 2 / 2**20
  for tile in (8192, 16384, 32768):
    for warps in (4, 8):
      fp8_round.TILE_ELEMENTS, fp8_round.NUM_WARPS = tile, warps
      a = jax.jit(lambda x: fp8_round.amax(x, K))
      q = jax.jit(lambda x, s: fp8_round.quantize(x, s, K))
      ta = benchmark._time(a, (x,), 50, 3) * 1e3
      tq = benchmark._time(q, (x, s), 50, 3) * 1e3
      print(json.dumps(dict(shape=shape, tile=tile, warps=warps, amax_ms=round(ta, 4), quant_ms=round(tq, 4),
                            amax_tbs=round(mib / 2**10 * 1.0737 / ta, 2), quant_tbs=round(1.5 * mib / 2**10 * 1.0737 / tq, 2))), flush=True)
  xa = jax.jit(lambda x: fp8.amax(x, K)); xq = jax.jit(lambda x, s: jax.lax.optimization_barrier(fp8.quantize(x, s, K)))
  print(json.dumps(dict(shape=shape, xla_amax_ms=benchmark._time(xa, (x,), 50, 3) * 1e3, xla_quant_ms=benchmark._time(xq, (x, s), 50, 3) * 1e3)), flush=True)
