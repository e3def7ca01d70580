import json, os, sys, tempfile
import jax, jax.numpy as jnp
import jax_flash
from jax_flash import benchmark
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
cases = [(2, 16, 16, 128, True), (2, 8, 8, 256, True), (4, 32, 8, 128, True)]
for b, n, kh, h, causal in cases:
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, 8192, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, 8192, kh, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, 8192, kh, h), jnp.bfloat16)
  do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
  fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal, fp8=True)
  for mode in ("fwd", "fwd+bwd"):
    f, args = benchmark._jitted(fn, mode, q, k, v, do)
    ms = benchmark._time(f, args, 20, 3) * 1e3
    with tempfile.TemporaryDirectory() as folder:
      with jax.profiler.trace(folder):
        out = None
        for _ in range(5):
          out = f(*args)
        jax.block_until_ready(out)
      t = benchmark.gpu_times(folder, 5)
    row = dict(b=b, n=n, kh=kh, h=h, causal=causal, mode=mode, ms=ms,
               kernels=[(kk[:70], round(x, 4)) for kk, x in t["kernels"].most_common(14)])
    print(json.dumps(row), flush=True)
    with open(f"{OUT}/rows.jsonl", "a") as fh:
      fh.write(json.dumps(row) + "\n")
    try:
      txt = f.lower(*args).compile().as_text()
      open(f"{OUT}/hlo_{b}_{n}_{kh}_{h}_{mode.replace('+','_')}.txt", "w").write(txt)
    except Exception as e:
      print("hlo", e)
