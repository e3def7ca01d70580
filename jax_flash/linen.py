"""Flash attention for `flax.linen`: a drop-in `attention_fn` and module.

    nn.MultiHeadDotProductAttention(..., attention_fn=jax_flash.linen.dot_product_attention)
    jax_flash.linen.FlashAttention(...)   # same fields, same parameters
"""
from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes

from jax_flash.nnx import check_sow_weights, module_options
from jax_flash.nnx import dot_product_attention as nnx_attention


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None,
                          force_fp32_for_softmax: bool = False,
                          einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None, *,
                          is_causal: bool = False, implementation=None,
                          block_sizes=None, sinks=None, fp8=False,
                          context_parallel="auto", sequence_axis=None):
  """Drop-in for `flax.linen.dot_product_attention`, computed by flash attention.

  Takes every argument linen passes; the softmax is always float32
  (`force_fp32_for_softmax` is moot), the custom einsum hooks and `precision`
  are not used. With `module` set (`sow_weights=True`, which needs the
  attention weights) it falls back to flax's implementation. `is_causal`,
  `implementation`, `block_sizes`, `sinks` ([num_heads] learned sink
  logits), `fp8`, `context_parallel` and `sequence_axis` are this
  library's additions; see
  `jax_flash.nnx.dot_product_attention` for the rest.
  """
  check_sow_weights(module, sinks)
  if module is not None:
    return nn.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng,
        dropout_rate, deterministic, dtype, precision, module,
        force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
        attn_weights_value_einsum)
  return nnx_attention(
      query, key, value, bias, mask, broadcast_dropout, dropout_rng,
      dropout_rate, deterministic, dtype,
      promote_dtype=lambda xs, dtype: dtypes.promote_dtype(*xs, dtype=dtype),
      is_causal=is_causal, implementation=implementation,
      block_sizes=block_sizes, sinks=sinks, fp8=fp8,
      context_parallel=context_parallel, sequence_axis=sequence_axis)


class FlashAttention(nn.MultiHeadDotProductAttention):
  """`nn.MultiHeadDotProductAttention` with flash attention inside.

  Same fields and parameters (a model swaps it in and keeps its checkpoint),
  plus `is_causal` (causal without a T x S mask), `implementation`,
  `block_sizes`, `fp8`, `context_parallel`, `sequence_axis`
  (`jax_flash.flash_attention`'s)
  and `sinks`: True
  adds a parameter `sinks` [num_heads]
  (float32, zeros at first), learned attention sinks (see
  `jax_flash.flash_attention`). Unnamed instances are named as flax names
  its own (`MultiHeadDotProductAttention_0`, ...), so the parameter paths of
  a model do not change when it swaps this in.
  """
  is_causal: bool = False
  implementation: str | None = None
  block_sizes: Any = None
  sinks: bool = False
  fp8: bool | str = False
  context_parallel: str = "auto"
  sequence_axis: Any = None

  def __post_init__(self):
    module_options(implementation=self.implementation,
                   block_sizes=self.block_sizes, fp8=self.fp8,
                   context_parallel=self.context_parallel)
    _name_as_flax(self)
    if self.attention_fn is nn.dot_product_attention:
      object.__setattr__(self, "attention_fn", functools.partial(
          dot_product_attention, is_causal=self.is_causal,
          implementation=self.implementation, block_sizes=self.block_sizes,
          fp8=self.fp8, context_parallel=self.context_parallel,
          sequence_axis=self.sequence_axis))
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, **kwargs):
    if not self.sinks:
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
    sinks = self.param("sinks", nn.initializers.zeros_init(),
                       (self.num_heads,), jnp.float32)
    # The attention function is a field: bind the sinks' value into it for
    # this call only (the module is a per-call bound clone).
    attention_fn = self.attention_fn
    object.__setattr__(self, "attention_fn",
                       functools.partial(attention_fn, sinks=sinks))
    try:
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
    finally:
      object.__setattr__(self, "attention_fn", attention_fn)


def _name_as_flax(module):
  """Names an unnamed instance as flax names its own
  (`MultiHeadDotProductAttention_0`, ... with the parent's counter for that
  name), so the parameter paths of a model do not change when it swaps this
  in. Flax's autonaming is internal to `Module.__post_init__`: this mirrors
  it, and leaves flax's own naming (`FlashAttention_0`) where its internals
  differ."""
  try:
    from flax.linen import module as linen_module
    parent = module.parent
    if parent is linen_module._unspecified_parent:
      parent = linen_module._context.module_stack[-1]
    if (module.name is not None or not isinstance(parent, nn.Module)
        or parent._state.in_setup or not parent._initialization_allowed):
      return
    prefix = nn.MultiHeadDotProductAttention.__name__
    cursor = parent._state.autoname_cursor.get(prefix, 0)
    parent._state.autoname_cursor[prefix] = cursor + 1
    object.__setattr__(module, "name", f"{prefix}_{cursor}")
  except AttributeError:
    return
