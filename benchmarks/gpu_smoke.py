"""Quick GPU check: do the kernels compile, are they right, how fast (rough).

    PYTHONPATH=. python3 benchmarks/gpu_smoke.py

Produced benchmarks/results/2026-11-30-h200/first_smoke.log (one-off; the
benchmark proper is `python -m benchmarks.harness`).
"""
import time, traceback
import jax, jax.numpy as jnp
import jax_flash
from benchmarks.harness import _time
from jax_flash.testing import relative_error
from tests.cases import Case, inputs

def run(case, version=2, bs=None):
    q, k, v, do = inputs(case)
    f = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=case.causal, implementation="pallas", version=version, block_sizes=bs)
    r = lambda q, k, v: jax_flash.reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=case.causal)
    t = time.time()
    o, vjp = jax.vjp(f, q, k, v); g = vjp(do)
    jax.block_until_ready(g)
    ct = time.time() - t
    ro, rvjp = jax.vjp(r, q, k, v); rg = rvjp(do.astype(jnp.float32))
    print(case, f"v{version}", f"compile+run {ct:.1f}s", "out", relative_error(o, ro), "grads", [relative_error(a, b) for a, b in zip(g, rg)], flush=True)

for c, ver in [(Case(1, 255, 255, 2, 2, 64, "bfloat16", True), 2), (Case(1, 255, 1000, 4, 2, 96, "float16", False), 2),
               (Case(1, 300, 200, 4, 1, 128, "float32", True), 2), (Case(2, 130, 77, 4, 4, 256, "bfloat16", False), 2),
               (Case(1, 255, 255, 2, 2, 64, "bfloat16", True), 1), (Case(1, 1000, 300, 2, 1, 40, "float32", False), 1)]:
    try:
        run(c, ver)
    except Exception:
        traceback.print_exc()

def bench(f, *args):
    return _time(f, args, calls=20, repeats=5)

for H, causal in [(128, False), (128, True), (64, False)]:
    B, T, N = 2, 8192, 2048 // H
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in ks)
    flops = 4 * B * N * T * T * H / (2 if causal else 1)
    for name, fn in [("ours", lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal)),
                     ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))]:
        try:
            fwd = jax.jit(fn)
            fb = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](do))
            tf = bench(fwd, q, k, v); tb = bench(fb, q, k, v)
            print(f"H{H} causal={causal} {name}: fwd {flops/tf/1e12:.0f} TFLOP/s, fwd+bwd {3.5*flops/tb/1e12:.0f} TFLOP/s", flush=True)
        except Exception:
            traceback.print_exc()
