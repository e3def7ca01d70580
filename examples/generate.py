"""Generate tokens with a KV cache: a decoder in plain JAX around flash attention.

    python examples/generate.py [--steps 32] [--batch 4]

A randomly initialized 2-layer decoder (token embedding, causal
self-attention with GQA, an MLP, a readout) reads a prompt in one call of
`jax_flash.flash_attention` (causal) that also fills a preallocated KV
cache, then generates one token a step with `jax_flash.flash_decode`
against the cache, each sequence at its own length (prompts of different
lengths, padded on the right). Each step's logits are checked against
running the whole sequence so far through the model again, causally: the
cache and the decode kernel give the same next-token distribution.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 128, 4, 2, 32, 2


def init(key):
  keys = iter(jax.random.split(key, 4 * LAYERS + 2))
  normal = lambda shape: jax.random.normal(next(keys), shape) / shape[0] ** 0.5
  layers = [dict(q=normal((D_MODEL, HEADS * HEAD_DIM)),
                 kv=normal((D_MODEL, 2 * KV_HEADS * HEAD_DIM)),
                 out=normal((HEADS * HEAD_DIM, D_MODEL)),
                 mlp=normal((D_MODEL, D_MODEL))) for _ in range(LAYERS)]
  return dict(embed=normal((VOCAB, D_MODEL)), layers=layers,
              readout=normal((D_MODEL, VOCAB)))


def _project(p, x):
  b, t, _ = x.shape
  q = (x @ p["q"]).reshape(b, t, HEADS, HEAD_DIM)
  k, v = jnp.split((x @ p["kv"]).reshape(b, t, 2 * KV_HEADS, HEAD_DIM), 2,
                   axis=2)
  return q, k, v


def _finish(p, x, attended):
  b, t = x.shape[:2]
  x = x + attended.reshape(b, t, -1) @ p["out"]
  return x + jnp.tanh(x @ p["mlp"])


def forward(params, tokens, lengths):
  """Logits [B, T, VOCAB] of whole sequences (causal, padding past
  `lengths`), and each layer's keys and values."""
  x = params["embed"][tokens]
  kvs = []
  for p in params["layers"]:
    q, k, v = _project(p, x)
    kvs.append((k, v))
    x = _finish(p, x, jax_flash.flash_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths))
  return x @ params["readout"], kvs


@functools.partial(jax.jit, static_argnames="cache_len")
def prefill(params, prompts, lengths, cache_len):
  """Logits of each prompt's last token, and the KV cache [layers] of
  (k, v) [B, cache_len, KV_HEADS, HEAD_DIM] filled with the prompts."""
  logits, kvs = forward(params, prompts, lengths)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, cache_len - x.shape[1]), (0, 0),
                              (0, 0)))
  cache = [(pad(k), pad(v)) for k, v in kvs]
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
  return last[:, 0], cache


@jax.jit
def decode_step(params, cache, tokens, lengths):
  """Logits of one new token per sequence (tokens [B]) at position
  `lengths` [B]; the cache with its keys and values written there."""
  x = params["embed"][tokens][:, None]
  new_cache = []
  for p, (kc, vc) in zip(params["layers"], cache):
    q, k, v = _project(p, x)
    write = jax.vmap(lambda c, i, n: c.at[i].set(n[0]))
    kc, vc = write(kc, lengths, k), write(vc, lengths, v)
    new_cache.append((kc, vc))
    x = _finish(p, x, jax_flash.flash_decode(q, kc, vc,
                                             kv_lengths=lengths + 1))
  return (x @ params["readout"])[:, 0], new_cache


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  params = init(jax.random.key(args.seed))
  rng = np.random.default_rng(args.seed)
  lengths = rng.integers(4, 17, args.batch).astype(np.int32)
  cache_len = int(lengths.max()) + args.steps
  prompts = rng.integers(0, VOCAB, (args.batch, int(lengths.max())))
  tokens = np.zeros((args.batch, cache_len), np.int32)
  tokens[:, :prompts.shape[1]] = prompts
  logits, cache = prefill(params, jnp.asarray(prompts), jnp.asarray(lengths),
                          cache_len)
  worst = 0.0
  for step in range(args.steps):
    nxt = np.asarray(jnp.argmax(logits, axis=-1))  # Greedy.
    tokens[np.arange(args.batch), lengths] = nxt
    logits, cache = decode_step(params, cache, jnp.asarray(nxt),
                                jnp.asarray(lengths))
    lengths = lengths + 1
    # The same logits from the whole sequence, without the cache.
    full, _ = forward(params, jnp.asarray(tokens), jnp.asarray(lengths))
    want = jnp.take_along_axis(full, jnp.asarray(lengths - 1)[:, None, None],
                               axis=1)[:, 0]
    worst = max(worst, float(jnp.max(jnp.abs(logits - want))))
  print(f"generated {args.steps} tokens for {args.batch} sequences; "
        f"largest logit difference from full recomputation {worst:.2e}")
  for row in tokens[:2]:
    print(" ".join(map(str, row[:int(lengths.max())])))
  if not worst < 1e-3:
    raise SystemExit("the cached decode does not match the full forward")


if __name__ == "__main__":
  main()
