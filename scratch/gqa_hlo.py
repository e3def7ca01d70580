import json, os, re, tempfile
import jax, jax.numpy as jnp
import jax_flash
from jax_flash import benchmark
OUT = os.environ.get("OUT", "/tmp/out")
b, n, kh, h = 2, 32, 8, 128
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (b, 8192, n, h), jnp.bfloat16)
k = jax.random.normal(ks[1], (b, 8192, kh, h), jnp.bfloat16)
v = jax.random.normal(ks[2], (b, 8192, kh, h), jnp.bfloat16)
do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True, fp8=True)
f, args = benchmark._jitted(fn, "fwd+bwd", q, k, v, do)
txt = f.lower(*args).compile().as_text()
open(f"{OUT}/gqa_fwd_bwd.txt", "w").write(txt)
