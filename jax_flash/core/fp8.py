"""FP8 (e4m3) attention: the quantization every backend applies.

Q, K and V are e4m3 values times a float32 scale per (batch, KV head):
x = x8 * scale, x8 = round_e4m3(x / scale) with scale the least power of
two at or above max |x| / 448 over the (batch, KV head)'s rows (its query
heads' for Q), and at least 2^-126, as FlashAttention-3 and cuDNN take
per-tensor or per-head descales. A power of two keeps e4m3's three
mantissa bits (only the subnormal threshold moves, by at most one
binade) and makes the rounded values exact in bfloat16 and exact to
divide again: any power-of-two scale that keeps a block's rounded values
within 448 gives back e4m3 values, so a kernel may quantize any part of a
(batch, KV head) again without a second rounding. The scores are formed
from the e4m3 values (exact products, float32 sums). The probabilities
P, in [0, 1] against their row's running maximum, multiply V as e4m3
too, scaled by 448 so that 1 is e4m3's largest value (`quantize_p`); the
row sums take P before that rounding. Gradients treat each rounding as
the identity (straight-through): they are exact attention's at the
rounded inputs.

`Rounding`: who computes max |x| and the e4m3 values, XLA's ops here
(`XLA`) or GPU kernels (`pallas_kernels.triton.fp8_round`), bitwise the
same.

Incoherent processing (`rotation`): Q and K multiplied by one orthogonal
matrix along the head dim before they are rounded. Q K^T is unchanged; an
outlier feature's magnitude is spread over every column, so a scale set
by the largest value wastes less of e4m3's range on the others.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3fn's largest finite value.
LOG2_E4M3_MAX = float(np.log2(E4M3_MAX))  # Kernels add it to P's exponent.
# The least scale: a normal float32 whose reciprocal is one too, so that a
# kernel may multiply by 1 / scale and get x / scale exactly.
MIN_SCALE_EXPONENT = -126
MIN_SCALE = 2.0 ** MIN_SCALE_EXPONENT
MODES = (False, True, "rotate")


def check_fp8(fp8) -> None:
  if not any(fp8 is m for m in MODES):
    raise ValueError(f"fp8 must be False, True or 'rotate', got {fp8!r}")


def _grouped(x, num_kv_heads: int):
  """[B, L, N, H] -> [B, L, K, N // K, H]."""
  b, length, n, h = x.shape
  return x.reshape(b, length, num_kv_heads, n // num_kv_heads, h)


def amax(x, num_kv_heads: int):
  """float32 [B, K]: max |x| over each (batch, KV head)'s rows and heads,
  values that are not finite (a masked position's NaN) left out (0 where
  there are none). x [B, L, N, H]."""
  a = jnp.abs(_grouped(x, num_kv_heads).astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=(1, 3, 4),
                 initial=0.0)


def scale_of(amax):
  """The least power of two at or above amax / E4M3_MAX, at least
  MIN_SCALE (1 where amax is 0)."""
  # amax / 448 = m * 2^e, m in [0.5, 1): 2^e, or 2^(e - 1) where m is 0.5;
  # formed from amax * 2^64 below 1 (amax / 448 alone would be subnormal,
  # flushed to 0, for amax below 448 * 2^-126).
  small = amax < 1
  m, e = jnp.frexp(jnp.where(small, amax * 2.0 ** 64, amax) / E4M3_MAX)
  e = jnp.where(m == 0.5, e - 1, e) - jnp.where(small, 64, 0)
  scale = jnp.ldexp(jnp.float32(1), jnp.maximum(e, MIN_SCALE_EXPONENT))
  return jnp.where(amax > 0, scale, 1.0)


def scales(x, num_kv_heads: int, rounding=None):
  """float32 [B, K]: `scale_of` each (batch, KV head)'s `amax` (by
  `rounding`'s amax: `Rounding`). x [B, L, N, H]."""
  return scale_of((rounding or XLA).amax(x, num_kv_heads))


def quantize(x, scale, num_kv_heads: int):
  """x [B, L, N, H] as e4m3 values x / scale (scale [B, K] float32)."""
  g = _grouped(x, num_kv_heads).astype(jnp.float32)
  return (g / scale[:, None, :, None, None]).astype(E4M3).reshape(x.shape)


def dequantize(x8, scale, num_kv_heads: int):
  """float32 x8 * scale: e4m3 x8 [B, L, N, H], scale [B, K]."""
  g = _grouped(x8, num_kv_heads).astype(jnp.float32)
  return (g * scale[:, None, :, None, None]).reshape(x8.shape)


@dataclasses.dataclass(frozen=True)
class Rounding:
  """Who makes the e4m3 values: `amax(x, num_kv_heads)` -> float32 [B, K]
  and `quantize(x, scale, num_kv_heads)` -> e4m3 [B, L, N, H], as this
  module's functions of those names define them, bitwise, and kept by XLA
  as they are (a kernel's output is; XLA's own conversion needs a barrier:
  `XLA`)."""
  name: str
  amax: Callable
  quantize: Callable


def _quantize_kept(x, scale, num_kv_heads: int):
  """`quantize` behind an optimization barrier: XLA on a GPU, allowed
  excess precision, would otherwise drop a conversion to e4m3 and back
  under jit and leave x unrounded."""
  return jax.lax.optimization_barrier(quantize(x, scale, num_kv_heads))


XLA = Rounding("xla", amax, _quantize_kept)


@jax.custom_jvp
def _straight_through(x, rounded):
  del x
  return rounded


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
  x, rounded = primals
  dx, _ = tangents
  return rounded, dx.astype(rounded.dtype)


def rounded_dtype(dtype):
  """The dtype `round_trip` gives for inputs of `dtype`: bfloat16 holds
  every rounded value exactly (a power-of-two scale, bfloat16's exponent
  range); float16 may not (its range), so float32 there."""
  return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else
                   jnp.float32)


def rounded(x, num_kv_heads: int, rounding=None):
  """(`dequantize(quantize(x))` with per-(batch, KV head) scales, in
  `rounded_dtype(x.dtype)` (exact) and differentiated as the identity (the
  gradient reaches x in its dtype); the e4m3 values; their scales [B, K]),
  the scales and values by `rounding` (`Rounding`; None: `XLA`)."""
  rounding = rounding or XLA
  x0 = jax.lax.stop_gradient(x)
  scale = jax.lax.stop_gradient(scales(x0, num_kv_heads, rounding))
  x8 = rounding.quantize(x0, scale, num_kv_heads)
  values = dequantize(x8, scale, num_kv_heads).astype(rounded_dtype(x.dtype))
  return _straight_through(x, values), x8, scale


def as_operands(q8, k8, v8, scales) -> dict:
  """`Operands`' FP8 fields (`fp8_q`, `fp8_k`, `fp8_v`, `fp8_scales`):
  e4m3 [B, L, N, H] arrays and their three [B, K] scales as one float32
  [B, K, 3]."""
  return dict(fp8_q=q8, fp8_k=k8, fp8_v=v8,
              fp8_scales=jnp.stack(scales, axis=-1).astype(jnp.float32))


def round_trip(x, num_kv_heads: int):
  """The first of `rounded`: x rounded to e4m3 and back, straight-through."""
  return rounded(x, num_kv_heads)[0]


@jax.custom_jvp
def no_gradient(x):
  """x; differentiating through it raises (float8 inputs: forward only)."""
  return x


@functools.partial(no_gradient.defjvp, symbolic_zeros=True)
def _no_gradient_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
    raise NotImplementedError(
        "float8_e4m3fn inputs with descale are forward only: for gradients "
        "pass bfloat16/float16 inputs with fp8=True")
  return x, dx


def quantize_p(p):
  """P (float32, in [0, 1]) as the e4m3 values of P * 448, in float32
  (exact in bfloat16 too): P V is their product with V, over 448. Through
  an optimization barrier, as in `round_trip` (XLA on a GPU would drop the
  pair of conversions)."""
  return jax.lax.optimization_barrier(
      (p * E4M3_MAX).astype(E4M3)).astype(jnp.float32)


def rotation(head_dim: int):
  """A fixed orthogonal [H, H] float32 matrix: a Hadamard matrix with
  random column signs (scaled by 1 / sqrt(H)) where H is a power of two,
  else the Q of a random Gaussian matrix's QR (seed 0 either way)."""
  rng = np.random.default_rng(0)
  if head_dim & (head_dim - 1) == 0:
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
      h = np.block([[h, h], [h, -h]])
    m = h * rng.choice([-1.0, 1.0], head_dim) / np.sqrt(head_dim)
  else:
    m, _ = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
  return jnp.asarray(m, jnp.float32)


def check_descale(descale, batch: int, num_kv_heads: int):
  """(q, k, v) descales as float32 [B, K]: each a scalar or an array
  broadcastable to [B, K]."""
  if not isinstance(descale, (tuple, list)) or len(descale) != 3:
    raise ValueError("descale must be a tuple (q_descale, k_descale, "
                     "v_descale) of float32 scalars or arrays broadcastable "
                     f"to [B, K] = [{batch}, {num_kv_heads}], got "
                     f"{type(descale).__name__}")
  out = []
  for name, d in zip(("q_descale", "k_descale", "v_descale"), descale):
    d = jnp.asarray(d, jnp.float32)
    try:
      out.append(jnp.broadcast_to(d, (batch, num_kv_heads)))
    except ValueError:
      raise ValueError(f"descale's {name} must be a scalar or broadcastable "
                       f"to [B, K] = [{batch}, {num_kv_heads}], got shape "
                       f"{d.shape}") from None
  return tuple(out)
