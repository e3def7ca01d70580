"""Train a small decoder-only transformer language model with flash attention.

    python examples/train_lm.py                      # CPU default: a few minutes
    python examples/train_lm.py --layers 12 --d-model 768 --heads 12 \\
        --seq-len 2048 --batch 8 --steps 2000         # a realistic size, on a GPU

Character-level model of the Book of Genesis (King James Version, public
domain, in examples/data/). Each block is pre-LayerNorm with
`jax_flash.nnx.FlashAttention` (causal, GQA) and a GELU MLP. Trains with optax
AdamW under `nnx.jit`, shows a progress bar with the loss and tokens/s,
evaluates on held-out text, saves a checkpoint and restores it into a fresh
model (checking it evaluates the same), and samples text with the KV cache.
On a GPU the attention runs the Pallas kernels; on a CPU the plain-XLA path
(`--implementation interpret` runs the kernels interpreted, slowly).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization

import jax_flash.nnx as flash_nnx

DATA = os.path.join(os.path.dirname(__file__), "data", "genesis_kjv.txt")


def cudnn_attention(query, key, value, *, mask=None, is_causal=False,
                    dropout_rate=0.0, deterministic=True, **unused):
  """`jax.nn.dot_product_attention` with cuDNN for training (a GPU, bf16/fp16
  and no dropout); with a mask (sampling from the cache), its XLA path."""
  del unused
  if dropout_rate and not deterministic:
    raise ValueError("--implementation cudnn takes no dropout")
  if mask is not None:  # flax builds it in the computation's dtype.
    mask = mask.astype(bool)
  return jax.nn.dot_product_attention(
      query, key, value, mask=mask, is_causal=is_causal,
      implementation="cudnn" if mask is None else None)


class Block(nnx.Module):
  def __init__(self, d_model, heads, kv_heads, dropout, implementation,
               dtype, *, rngs, fp8=False):
    self.ln1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    args = dict(num_heads=heads, num_kv_heads=kv_heads, in_features=d_model,
                dropout_rate=dropout, decode=False, dtype=dtype, rngs=rngs)
    if implementation == "flax":  # flax's own attention, same parameters.
      self.attn = nnx.MultiHeadAttention(**args)
    elif implementation == "cudnn":  # jax.nn's cuDNN kernel, same parameters.
      self.attn = nnx.MultiHeadAttention(**args, attention_fn=cudnn_attention)
    else:
      self.attn = flash_nnx.FlashAttention(**args,
                                           implementation=implementation,
                                           fp8=fp8)
    self.ln2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x, *, decode, deterministic):
    x = x + self.attn(self.ln1(x), is_causal=not decode, decode=decode,
                      deterministic=deterministic)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LanguageModel(nnx.Module):
  def __init__(self, vocab, max_len, d_model, layers, heads, kv_heads,
               dropout=0.0, implementation=None, dtype=jnp.float32, *,
               rngs, fp8=False):
    # Parameters are float32; `dtype` is the computation's (bfloat16: mixed
    # precision).
    self.max_len, self.dtype = max_len, dtype
    self.tokens = nnx.Embed(vocab, d_model, dtype=dtype, rngs=rngs)
    self.positions = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(d_model, heads, kv_heads, dropout,
                                  implementation, dtype, rngs=rngs, fp8=fp8)
                            for _ in range(layers)])
    self.ln = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, positions, *, decode=False, deterministic=True):
    x = self.tokens(tokens) + self.positions(positions)
    for block in self.blocks:
      x = block(x, decode=decode, deterministic=deterministic)
    return self.head(self.ln(x))


def loss_fn(model, tokens, deterministic=True):
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.arange(inputs.shape[1])[None]
  logits = model(inputs, positions, deterministic=deterministic)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def update(model, optimizer, tokens):
  """One step of AdamW on the batch `tokens`; the loss before it."""
  loss, grads = nnx.value_and_grad(
      lambda m: loss_fn(m, tokens, deterministic=False))(model)
  optimizer.update(model, grads)
  return loss


train_step = nnx.jit(update)


def jitted_train_step(model, optimizer):
  """(step, state): `train_step` as one `jax.jit` of the split model and
  optimizer state, `loss, state = step(state, tokens)`; `nnx.update((model,
  optimizer), state)` puts the state back. `nnx.jit` walks the module graph
  on every call, tens of milliseconds a step on a GPU's host for an
  8-layer model, while the GPU waits; this walks it once."""
  graphdef, state = nnx.split((model, optimizer))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss = update(model, optimizer, tokens)
    return loss, nnx.state((model, optimizer))

  return step, state


@nnx.jit
def eval_step(model, tokens):
  return loss_fn(model, tokens)


@nnx.jit
def decode_step(model, token, position):
  logits = model(token, position, decode=True)
  return logits[:, -1]


def generate(model, prompt_ids, length, temperature, seed):
  """Samples `length` tokens after the prompt, one at a time, with the KV cache."""
  batch = prompt_ids.shape[0]
  for block in model.blocks:
    block.attn.init_cache((batch, model.max_len, block.attn.in_features),
                          model.dtype)
  rng = jax.random.key(seed)
  out = list(prompt_ids[0])
  logits = None
  for pos in range(min(len(out) + length, model.max_len)):
    if pos < len(out):
      token = jnp.asarray([[out[pos]]] * batch)
    else:
      rng, sub = jax.random.split(rng)
      nxt = int(jax.random.categorical(sub, logits[0] / temperature))
      out.append(nxt)
      token = jnp.asarray([[nxt]] * batch)
    logits = decode_step(model, token, jnp.full((batch, 1), pos))
  return out


def save_params(model, path):
  with open(path, "wb") as f:
    f.write(serialization.msgpack_serialize(
        nnx.to_pure_dict(nnx.state(model, nnx.Param))))


def load_params(model, path):
  """Replaces the model's parameters by the checkpoint's."""
  state = nnx.state(model, nnx.Param)
  with open(path, "rb") as f:
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(f.read()))
  nnx.update(model, state)


def batches(data, batch, seq_len, rng):
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch)
    yield jnp.asarray(np.stack([data[s:s + seq_len + 1] for s in starts]))


def progress(step, steps, loss, tokens_per_s, width=30):
  done = int(width * step / steps)
  bar = "#" * done + "-" * (width - done)
  sys.stdout.write(f"\r[{bar}] {step}/{steps} loss {loss:.3f} "
                   f"{tokens_per_s:,.0f} tok/s")
  sys.stdout.flush()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--dropout", type=float, default=0.0)
  parser.add_argument("--dtype", default="float32",
                      choices=["float32", "bfloat16"],
                      help="computation dtype (parameters stay float32)")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--sample-len", type=int, default=200)
  parser.add_argument("--prompt", default="And God said")
  parser.add_argument("--implementation", default=None,
                      choices=[None, "pallas", "mosaic", "triton",
                               "interpret", "xla", "flax", "cudnn"],
                      help="flash attention's implementation (default: pallas "
                      "on a GPU, xla otherwise), or, on the same model to "
                      "compare, 'flax' for flax's own attention or 'cudnn' "
                      "for jax.nn.dot_product_attention's cuDNN kernel (GPU, "
                      "--dtype bfloat16)")
  parser.add_argument("--fp8", default="off", choices=["off", "on", "rotate"],
                      help="FP8 attention (flash_attention's fp8=True, or "
                      "'rotate'); flash attention only")
  parser.add_argument("--out-dir", default=None,
                      help="where the checkpoint is written and kept (default: a "
                      "temporary folder, removed at the end)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.fp8 != "off" and args.implementation in ("flax", "cudnn"):
    parser.error(f"--fp8 is flash attention's, not {args.implementation}'s")

  text = open(DATA, encoding="utf-8").read()
  chars = sorted(set(text))
  index = {c: i for i, c in enumerate(chars)}
  data = np.array([index[c] for c in text], np.int32)
  split = int(0.9 * len(data))
  train, val = data[:split], data[split:]
  max_len = max(args.seq_len, len(args.prompt) + args.sample_len)
  make = lambda seed: LanguageModel(
      len(chars), max_len, args.d_model, args.layers, args.heads,
      args.kv_heads, args.dropout, args.implementation,
      jnp.dtype(args.dtype), rngs=nnx.Rngs(seed),
      fp8={"off": False, "on": True, "rotate": "rotate"}[args.fp8])
  model = make(args.seed)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"{len(text):,} characters, vocab {len(chars)}; model {params:,} "
        f"parameters; attention on {jax.devices()[0].platform} "
        f"({args.implementation or 'auto'})")
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr / 10)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01),
                            wrt=nnx.Param)

  rng = np.random.default_rng(args.seed)
  val_batches = list(zip(range(args.eval_batches),
                         batches(val, args.batch, args.seq_len, rng)))

  def evaluate(m):
    return float(np.mean([eval_step(m, b) for _, b in val_batches]))

  first_eval = evaluate(model)
  train_iter = batches(train, args.batch, args.seq_len, rng)
  step_fn, state = jitted_train_step(model, optimizer)
  losses, start, tokens = [], None, 0
  for step in range(1, args.steps + 1):
    loss, state = step_fn(state, next(train_iter))
    losses.append(loss)  # Read every 10 steps: no sync a step.
    if step == 1:  # Compilation: time from the second step on.
      float(loss)
      start = time.perf_counter()
    else:
      tokens += args.batch * args.seq_len
    if step % 10 == 0 or step == args.steps:
      recent = float(np.mean([float(x) for x in losses[-10:]]))
      rate = tokens / max(time.perf_counter() - start, 1e-9)
      progress(step, args.steps, recent, rate)
  print()
  nnx.update((model, optimizer), state)
  losses = [float(x) for x in losses]
  final_eval = evaluate(model)
  print(f"eval loss {first_eval:.3f} -> {final_eval:.3f} "
        f"(train loss {np.mean(losses[:10]):.3f} -> "
        f"{np.mean(losses[-10:]):.3f})")
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"peak device memory {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")

  # Without --out-dir the checkpoint goes to a temporary folder, removed
  # once the restored model is checked.
  with contextlib.ExitStack() as stack:
    out_dir = args.out_dir or stack.enter_context(
        tempfile.TemporaryDirectory(prefix="jax_flash_train_lm_"))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "lm_params.msgpack")
    save_params(model, path)
    restored = make(args.seed + 1)  # Different initial parameters ...
    load_params(restored, path)  # ... replaced by the checkpoint's.
  restored_eval = evaluate(restored)
  kept = "" if args.out_dir else " (removed; --out-dir keeps it)"
  print(f"checkpoint {path}{kept}: restored model eval loss "
        f"{restored_eval:.3f}")
  if abs(restored_eval - final_eval) > 1e-5:
    raise SystemExit("restored checkpoint does not evaluate like the model")

  prompt = np.array([[index[c] for c in args.prompt]], np.int32)
  sample = generate(restored, prompt, args.sample_len, 0.8, args.seed)
  print("sample:", repr("".join(chars[i] for i in sample)))
  if not final_eval < first_eval - 0.5:
    raise SystemExit("the loss did not fall")


if __name__ == "__main__":
  main()
