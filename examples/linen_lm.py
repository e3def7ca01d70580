"""A small linen language model with `jax_flash.linen.FlashAttention`.

    python examples/linen_lm.py [--steps 100]

Pre-LayerNorm decoder blocks (causal flash attention, an MLP) trained with
optax AdamW on the character-level text of `examples/data/` under
`jax.jit`; prints the loss before and after. The module has the fields and
parameters of `nn.MultiHeadDotProductAttention`, so a linen model swaps it
in and keeps its checkpoint.
"""
import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jax_flash

DATA = os.path.join(os.path.dirname(__file__), "data", "genesis_kjv.txt")


class Block(nn.Module):
  heads: int
  implementation: str | None = None

  @nn.compact
  def __call__(self, x):
    attention = jax_flash.linen.FlashAttention(
        num_heads=self.heads, is_causal=True,
        implementation=self.implementation)
    x = x + attention(nn.LayerNorm()(x))
    h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class LanguageModel(nn.Module):
  vocab: int
  max_len: int
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  implementation: str | None = None

  @nn.compact
  def __call__(self, tokens):
    positions = jnp.arange(tokens.shape[1])[None]
    x = (nn.Embed(self.vocab, self.d_model)(tokens) +
         nn.Embed(self.max_len, self.d_model)(positions))
    for _ in range(self.layers):
      x = Block(self.heads, self.implementation)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--implementation", default=None)
  args = parser.parse_args(argv)
  text = open(DATA, encoding="utf-8").read()
  chars = sorted(set(text))
  data = np.array([chars.index(c) for c in text[:200_000]], np.int32)
  model = LanguageModel(len(chars), args.seq_len,
                        implementation=args.implementation)
  rng = np.random.default_rng(0)

  def batch():
    starts = rng.integers(0, len(data) - args.seq_len - 1, args.batch)
    return jnp.asarray(np.stack([data[s:s + args.seq_len + 1]
                                 for s in starts]))

  def loss_fn(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  params = model.init(jax.random.key(0), batch()[:, :-1])
  optimizer = optax.adamw(3e-3)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  held_out = batch()
  first = float(loss_fn(params, held_out))
  for _ in range(args.steps):
    params, state, loss = step(params, state, batch())
  last = float(loss_fn(params, held_out))
  print(f"linen model, {args.steps} steps: held-out loss {first:.3f} -> "
        f"{last:.3f}; parameters {sorted(params['params'])}")
  if not last < first - 0.3:
    raise SystemExit("the loss did not fall")


if __name__ == "__main__":
  main()
