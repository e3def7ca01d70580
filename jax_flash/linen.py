"""Flash attention for `flax.linen`: a drop-in `attention_fn` and module.

    nn.MultiHeadDotProductAttention(..., attention_fn=jax_flash.linen.dot_product_attention)
    jax_flash.linen.FlashAttention(...)   # same fields, same parameters
"""
from __future__ import annotations

import functools
from typing import Any

from flax import linen as nn
from flax.linen import dtypes

from jax_flash.nnx import attend


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None,
                          force_fp32_for_softmax: bool = False,
                          einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None, *,
                          is_causal: bool = False, implementation=None,
                          block_sizes=None):
  """Drop-in for `flax.linen.dot_product_attention`, computed by flash attention.

  Takes every argument linen passes; the softmax is always float32
  (`force_fp32_for_softmax` is moot), the custom einsum hooks and `precision`
  are not used. With `module` set (`sow_weights=True`, which needs the
  attention weights) it falls back to flax's implementation. `is_causal`,
  `implementation` and `block_sizes` are this library's additions; see
  `jax_flash.nnx.dot_product_attention` for the rest.
  """
  if module is not None:
    return nn.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng,
        dropout_rate, deterministic, dtype, precision, module,
        force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
        attn_weights_value_einsum)
  query, key, value = dtypes.promote_dtype(query, key, value, dtype=dtype)
  return attend(query, key, value, bias, mask,
                broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                dropout_rate=dropout_rate, deterministic=deterministic,
                is_causal=is_causal, implementation=implementation,
                block_sizes=block_sizes)


class FlashAttention(nn.MultiHeadDotProductAttention):
  """`nn.MultiHeadDotProductAttention` with flash attention inside.

  Same fields and parameters (a model swaps it in and keeps its checkpoint),
  plus `is_causal` (causal without a T x S mask), `implementation` and
  `block_sizes`. Unnamed instances are named as flax names its own
  (`MultiHeadDotProductAttention_0`, ...), so the parameter paths of a model
  do not change when it swaps this in.
  """
  is_causal: bool = False
  implementation: str | None = None
  block_sizes: Any = None

  def __post_init__(self):
    if self.attention_fn is nn.dot_product_attention:
      object.__setattr__(self, "attention_fn", functools.partial(
          dot_product_attention, is_causal=self.is_causal,
          implementation=self.implementation, block_sizes=self.block_sizes))
    super().__post_init__()


# Flax names an unnamed submodule after its class (`type(m).__name__` and the
# parent's counter for that name): reporting flax's class name gives a model
# that swaps this in the parameter paths it had, and shares flax's counter
# with any nn.MultiHeadDotProductAttention beside it.
FlashAttention.__name__ = nn.MultiHeadDotProductAttention.__name__
