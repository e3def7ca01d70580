"""Check your own model after swapping in flash attention: a pytest file to copy.

    pytest examples/chex_equivalence.py

`Block` stands for your model: a pre-LayerNorm transformer block built with
`nnx.MultiHeadAttention`. The test builds it twice from the same seed, swaps
`jax_flash.nnx.dot_product_attention` into one, and checks with chex that the
outputs and every parameter's gradient agree within the tolerance of
`jax_flash.testing` (under jit and without, with chex variants). Its bfloat16
test holds the swapped model to the error of the original model in bfloat16
against a float32 run: flash attention may not be less accurate than what it
replaces.
"""
import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.flatten_util import ravel_pytree

import jax_flash.nnx
from jax_flash.testing import assert_attention_close

# On a GPU the default runs the kernels; on a CPU name the interpreted
# kernels, or the default would compare the reference with itself.
IMPLEMENTATION = None if jax.default_backend() == "gpu" else "interpret"


class Block(nnx.Module):
  """Someone's model: nothing here knows about jax_flash."""

  def __init__(self, d_model=64, heads=4, dtype=jnp.float32, *, rngs):
    self.ln = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model,
                                       decode=False, dtype=dtype, rngs=rngs)
    self.mlp = nnx.Linear(d_model, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.ln(x), mask=mask)
    return x + self.mlp(jax.nn.gelu(x))


def swap_in_flash_attention(model):
  """The one line a user adds (per attention layer)."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.MultiHeadAttention):
      module.attention_fn = lambda *a, **k: jax_flash.nnx.dot_product_attention(
          *a, implementation=IMPLEMENTATION, **k)
  return model


def loss_and_grads(model, x, cotangent):
  """The output, and every parameter's gradient as one float32 vector.

  (One vector: the error is then relative to the whole gradient. Some
  leaves are 0 in exact arithmetic, like the key projection's bias, which
  softmax ignores: any relative error of those alone is rounding noise.)
  """
  def loss(m):
    out = m(x)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out
  (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  flat, _ = ravel_pytree(jax.tree.map(lambda g: g.astype(jnp.float32),
                                      nnx.to_pure_dict(grads)))
  return out, flat


class FlashAttentionSwapTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_same_outputs_and_gradients(self):
    x = jax.random.normal(jax.random.key(0), (2, 50, 64))
    cot = jax.random.normal(jax.random.key(1), x.shape)
    original = Block(rngs=nnx.Rngs(0))
    swapped = swap_in_flash_attention(Block(rngs=nnx.Rngs(0)))
    run = self.variant(loss_and_grads)
    with jax.default_matmul_precision("highest"):  # No TF32 on a GPU.
      out, grads = run(swapped, x, cot)
      ref_out, ref_grads = run(original, x, cot)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, ref_grads)
    assert_attention_close({"out": out, "grads": grads},
                           {"out": ref_out, "grads": ref_grads})

  def test_bfloat16_no_less_accurate_than_the_original(self):
    x = jax.random.normal(jax.random.key(2), (2, 50, 64))
    cot = jax.random.normal(jax.random.key(3), x.shape)
    with jax.default_matmul_precision("highest"):
      exact = loss_and_grads(Block(rngs=nnx.Rngs(0)), x, cot)
      original = loss_and_grads(Block(dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                                x, cot)
      swapped = loss_and_grads(swap_in_flash_attention(
          Block(dtype=jnp.bfloat16, rngs=nnx.Rngs(0))), x, cot)
    names = ("out", "grads")
    assert_attention_close(dict(zip(names, swapped)), dict(zip(names, exact)),
                           jnp.bfloat16, baseline=dict(zip(names, original)))
