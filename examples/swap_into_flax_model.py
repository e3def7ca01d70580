"""Swap flash attention into an existing Flax model in one line.

    python examples/swap_into_flax_model.py

An ordinary nnx model built with `nnx.MultiHeadAttention` keeps its parameters
(and checkpoints); only the attention function changes.
"""
import jax
import jax.numpy as jnp
from flax import nnx

import jax_flash.nnx
from jax_flash.testing import relative_error


class Encoder(nnx.Module):
  """Someone's existing model: nothing here knows about jax_flash."""

  def __init__(self, d_model=128, heads=4, *, rngs):
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model,
                                       decode=False, rngs=rngs)
    self.ln = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, x, mask=None):
    return self.ln(x + self.attn(x, mask=mask))


def main():
  model = Encoder(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 256, 128))
  lengths = jnp.array([200, 256])
  valid = jnp.arange(256)[None] < lengths[:, None]
  mask = nnx.make_attention_mask(valid, valid)  # A padding mask.
  before = model(x, mask)

  # The one line: flash attention inside every MultiHeadAttention.
  for _, m in nnx.iter_modules(model):
    if isinstance(m, nnx.MultiHeadAttention):
      m.attention_fn = jax_flash.nnx.dot_product_attention

  after = nnx.jit(lambda m, x, mask: m(x, mask))(model, x, mask)
  # Padded query rows differ by design (flash attention gives them 0).
  err = relative_error(jnp.where(valid[..., None], after, 0),
                       jnp.where(valid[..., None], before, 0))
  print(f"same parameters, flash attention: relative difference {err:.1e}")
  # Or build new models with it: jax_flash.nnx.FlashAttention(...) takes the
  # arguments of nnx.MultiHeadAttention and creates the same parameters.
  assert err < 1e-4


if __name__ == "__main__":
  main()
