"""Time a call as users make it: jitted, against ahead-of-time compiled, against jax.nn.

    PYTHONPATH=. python benchmarks/dispatch_overhead.py [--calls N] [--rows NAME ...]

Each row times back-to-back calls (median of 5 batches, after a warm-up)
of one function three ways: `jax.jit(f)` (what users call), its executable
`jax.jit(f).lower(*args).compile()` (no dispatch but XLA's), and the same
function with `jax.nn.dot_product_attention` in place of ours (cuDNN on a
GPU, XLA elsewhere). Rows:

* tiny: 1 x 16 tokens, 2 heads of 64, causal forward: host-bound, the
  dispatch alone;
* gpt2_fwd / gpt2_fwd_bwd: batch 16, 1024 tokens, 12 heads of 64, causal
  (GPT-2 small's attention), forward and forward+backward (GPU only);
* model_step: a training step of a 2-layer transformer (d_model 256, 4
  heads of 64, 128 tokens, batch 8): projections, attention, MLP, loss,
  gradients, SGD update;
* decode_step: that model's step for one new token of 8 sequences against
  a 512-position KV cache (`flash_decode`; jax.nn with
  `key_value_seq_lengths`).

Prints one JSON line a row: microseconds a call, and the ratios the
targets read (jit / jax.nn jit, jit / our compiled).
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp

import jax_flash


def per_call_us(fn, args, calls):
  """Median over 5 batches of `calls` back-to-back calls, microseconds."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e6)
  return sorted(times)[2]


def _ours(q, k, v, causal=True):
  return jax_flash.flash_attention(q, k, v, is_causal=causal)


def _jax_nn(on_gpu):
  impl = "cudnn" if on_gpu else "xla"
  return lambda q, k, v, causal=True: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation=impl)


def _attention_rows(on_gpu, dtype):
  """name -> (function of an attention fn, args)."""
  key = jax.random.key(0)
  tiny = jax.random.normal(key, (1, 16, 2, 64), dtype)
  rows = {"tiny": (lambda attn: lambda q: attn(q, q, q), (tiny,))}
  if on_gpu:
    q = jax.random.normal(key, (16, 1024, 12, 64), dtype)
    do = jax.random.normal(jax.random.key(1), q.shape, dtype)
    rows["gpt2_fwd"] = (lambda attn: lambda q, k, v: attn(q, k, v),
                        (q, q, q))
    rows["gpt2_fwd_bwd"] = (
        lambda attn: lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do),
        (q, q, q, do))
  return rows


D_MODEL, HEADS, HEAD_DIM, LAYERS = 256, 4, 64, 2


def _params(key, dtype):
  keys = iter(jax.random.split(key, 4 * LAYERS + 1))
  normal = lambda shape: (jax.random.normal(next(keys), shape) /
                          shape[0] ** 0.5).astype(dtype)
  layers = [dict(qkv=normal((D_MODEL, 3 * HEADS * HEAD_DIM)),
                 out=normal((HEADS * HEAD_DIM, D_MODEL)),
                 up=normal((D_MODEL, 4 * D_MODEL)),
                 down=normal((4 * D_MODEL, D_MODEL))) for _ in range(LAYERS)]
  return dict(layers=layers, embed=normal((D_MODEL, D_MODEL)))


def _block(p, x, attend):
  b, t, _ = x.shape
  q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
  q, k, v = (y.reshape(b, t, HEADS, HEAD_DIM) for y in (q, k, v))
  o, cache = attend(q, k, v)
  x = x + o.reshape(b, t, -1) @ p["out"]
  return x + jax.nn.gelu(x @ p["up"]) @ p["down"], cache


def _model_step(attn):
  def loss(params, x):
    for p in params["layers"]:
      x, _ = _block(p, x, lambda q, k, v: (attn(q, k, v), None))
    return jnp.mean((x @ params["embed"]).astype(jnp.float32) ** 2)

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params,
                        grads)
  return step


def _decode_step(decode):
  """One new token per sequence: write its K/V into each layer's cache at
  the sequence's length, attend to the cache."""
  def step(params, x, caches, lengths):
    new_caches = []
    for p, (kc, vc) in zip(params["layers"], caches):
      def attend(q, k, v, kc=kc, vc=vc):
        index = lengths - 1
        kc = jax.vmap(lambda c, i, n: c.at[i].set(n[0]))(kc, index, k)
        vc = jax.vmap(lambda c, i, n: c.at[i].set(n[0]))(vc, index, v)
        return decode(q, kc, vc, lengths), (kc, vc)
      x, cache = _block(p, x, attend)
      new_caches.append(cache)
    return x, new_caches
  return step


def _model_rows(on_gpu, dtype):
  params = _params(jax.random.key(2), dtype)
  x = jax.random.normal(jax.random.key(3), (8, 128, D_MODEL), dtype)
  batch, cache_len = 8, 512
  caches = [(jnp.zeros((batch, cache_len, HEADS, HEAD_DIM), dtype),) * 2
            for _ in range(LAYERS)]
  token = jax.random.normal(jax.random.key(4), (batch, 1, D_MODEL), dtype)
  lengths = jnp.full((batch,), 300, jnp.int32)
  impl = "cudnn" if on_gpu else "xla"
  decoders = {
      "ours": lambda q, kc, vc, n: jax_flash.flash_decode(
          q, kc, vc, kv_lengths=n),
      "jax_nn": lambda q, kc, vc, n: jax.nn.dot_product_attention(
          q, kc, vc, key_value_seq_lengths=n, implementation=impl),
  }
  return {
      "model_step": ({"ours": _model_step(_ours),
                      "jax_nn": _model_step(_jax_nn(on_gpu))}, (params, x)),
      "decode_step": ({n: _decode_step(d) for n, d in decoders.items()},
                      (params, token, caches, lengths)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=500)
  parser.add_argument("--rows", nargs="+", default=None,
                      help="rows to time (default: every row this device "
                      "runs)")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  rows = {}
  for name, (make, fargs) in _attention_rows(on_gpu, dtype).items():
    rows[name] = ({"ours": make(_ours), "jax_nn": make(_jax_nn(on_gpu))},
                  fargs)
  rows.update(_model_rows(on_gpu, dtype))
  for name, (fns, fargs) in rows.items():
    if args.rows and name not in args.rows:
      continue
    row = dict(row=name, backend=jax.default_backend(), jax=jax.__version__)
    try:
      row["jit_us"] = per_call_us(jax.jit(fns["ours"]), fargs, args.calls)
      row["compiled_us"] = per_call_us(
          jax.jit(fns["ours"]).lower(*fargs).compile(), fargs, args.calls)
      row["jax_nn_jit_us"] = per_call_us(jax.jit(fns["jax_nn"]), fargs,
                                         args.calls)
      row["jit_over_jax_nn"] = row["jit_us"] / row["jax_nn_jit_us"]
      row["jit_over_compiled"] = row["jit_us"] / row["compiled_us"]
    except Exception as e:  # A refused shape: say so, go on.
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in row.items()}), flush=True)


if __name__ == "__main__":
  main()
