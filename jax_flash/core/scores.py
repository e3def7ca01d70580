"""From raw scores q.k to the logits the softmax sees, and back: backend-neutral.

    s   = scale * q.k                         (raw score, natural units)
    s   = cap * tanh(s / cap)                 if logits_soft_cap
    s   = s - slope[b, n] * |i - j|           if alibi_slopes (ALiBi)
    s   = s + bias[b, n, i, j]                if bias
    s   = score_mod(s, b, n, i, j)            if a user's score_mod (flex)
    P   = softmax over visible keys of s      (the mask: `mask`)

With dropout, P is multiplied by keep / (1 - rate) after the softmax; the
logsumexp is that of the undropped logits. With sinks, each head n has one
more logit, sinks[n], in the softmax's denominator (a key whose value is 0):
the logsumexp includes it, and a row that sees no key gets lse = sinks[n].

The kernels work in base 2: they keep `s * log2(e)` so every exponential is an
`exp2`. The backward needs dL/d(q.k) = scale * dS * dmod * dtanh, with
dS = dL/ds (dS * dmod is the bias gradient), dmod the score_mod's derivative
(it is elementwise) and dtanh the soft-cap's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Scores:
  """Static description of the score modifications (hashable: a jit static)."""
  scale: float
  soft_cap: float | None = None
  alibi: bool = False
  bias: bool = False
  # Dropout on the probabilities (keep bits from `dropout`); the forward
  # output and the backward's dV and dP are scaled by 1 / (1 - rate).
  dropout_rate: float = 0.0
  # One keep mask for every batch element and head (flax's broadcast_dropout).
  dropout_broadcast: bool = False
  # A sink logit per head in the softmax's denominator (`Operands.sinks`).
  sinks: bool = False
  # FP8: P V multiplies P rounded to e4m3 (`fp8.quantize_p`; Q, K and V
  # arrive rounded, `jax_flash.core.fp8`); the backward takes it as P.
  # False, "amax" (inputs rounded with the scales `fp8.scales` gives, so a
  # kernel may divide by them again exactly) or "descale" (float8 inputs
  # and the caller's scales).
  fp8: bool | str = False
  # A user's score_mod (`mods.ElementwiseMod`, flex attention), and how many
  # arrays it reads (`Operands.score_consts`).
  mod: Callable | None = None
  mod_arrays: int = 0

  @property
  def dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def plain(self) -> bool:
    return self.soft_cap is None and self._unshifted

  @property
  def capped(self) -> bool:
    """A soft-cap and no other modification: logits2 = tanh * (cap log2 e)."""
    return self.soft_cap is not None and self._unshifted

  @property
  def _unshifted(self) -> bool:
    return not self.alibi and not self.bias and self.mod is None

  def _tanh(self, qk):
    return jnp.tanh(qk * (self.scale / self.soft_cap))

  def logits2(self, qk, rows=None, cols=None, slope=None, bias=None,
              batch=None, head=None, mod_consts=()):
    """Base-2 logits from the raw dot products `qk` (float32 tile).

    Returns (s2, aux): what `dqk` needs for the derivative (None for plain
    scores; the soft-cap's tanh and the score_mod's derivative).
    """
    if self.plain:  # One multiply: the hot path of plain attention.
      return qk * (self.scale * LOG2E), None
    if self.capped:  # One multiply after the tanh.
      t = self._tanh(qk)
      return t * (self.soft_cap * LOG2E), (t, None)
    t = None
    if self.soft_cap is not None:
      t = self._tanh(qk)
      s = t * self.soft_cap
    else:
      s = qk * self.scale
    if self.alibi:
      s = s - slope * jnp.abs(rows - cols).astype(jnp.float32)
    if self.bias:
      s = s + bias
    dmod = None
    if self.mod is not None:
      s, dmod = jax.jvp(
          lambda s: self.mod(s, batch, head, rows, cols, consts=mod_consts),
          (s,), (jnp.ones_like(s),))
    return s * LOG2E, (t, dmod)

  def factored_logits2(self, qk, *args, **kwargs):
    """(t, c, aux): the base-2 logits as t * c with a static c > 0, the rest
    as `logits2`. For plain scores with a positive scale t is qk itself and
    c = scale * log2(e): a kernel takes the row max on t (max(t * c) =
    c * max(t), rounding included) and forms 2**(t * c - m) in one FMA,
    one multiply an element fewer; with only a soft-cap, t is the tanh and
    c = cap * log2(e); otherwise t = logits2(qk) and c = 1."""
    if self.plain and self.scale > 0:
      return qk, self.scale * LOG2E, None
    if self.capped:
      t = self._tanh(qk)
      return t, self.soft_cap * LOG2E, (t, None)
    s, aux = self.logits2(qk, *args, **kwargs)
    return s, 1.0, aux

  def dqk(self, ds, aux):
    """dL/d(q.k) / scale from dS = dL/ds (the caller multiplies by scale
    once); aux from `logits2`. Elementwise products only: a kernel may
    apply it to P before forming dS = P (dP - D)."""
    if aux is None:
      return ds
    t, dmod = aux
    if dmod is not None:
      ds = ds * dmod
    if t is not None:
      ds = ds * (1.0 - t * t)
    return ds
