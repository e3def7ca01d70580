"""The collectives context parallelism moves arrays with, inside a
per-device function: all-to-all exchanges between sequence chunks and
heads, the balanced (zigzag) layout of causal calls, and barriers that
keep XLA from running every move at once."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def moved(collective, x, *args, **kwargs):
  """collective(x, *args, **kwargs) for a collective that only moves data
  (all_to_all, all_gather, ppermute), 16-bit floats sent as 16-bit
  integers: XLA's CPU backend runs collectives of bf16 and f16 in float32
  (a converted copy at twice the size on each side), while NCCL moves
  16-bit integers as they are. Bitwise the same result."""
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return collective(x, *args, **kwargs)
  bits = collective(lax.bitcast_convert_type(x, jnp.uint16), *args, **kwargs)
  return lax.bitcast_convert_type(bits, x.dtype)


def exchange(x, seq, split: int, concat: int):
  """lax.all_to_all(x, seq, split, concat, tiled=True), its pieces moved
  along a leading axis of their own (each piece one contiguous block, the
  received blocks laid out where the concatenated axis wants them)."""
  p = lax.axis_size(seq)
  shape = x.shape
  y = x.reshape(shape[:split] + (p, shape[split] // p) + shape[split + 1:])
  y = moved(lax.all_to_all, jnp.moveaxis(y, split, 0), seq, 0, 0,
            tiled=True)
  y = jnp.moveaxis(y, 0, concat)  # Block j, from device j, before j + 1.
  return y.reshape(y.shape[:concat] + (p * y.shape[concat + 1],)
                   + y.shape[concat + 2:])


def in_turn(moves, arrays):
  """[move(x) for move, x in zip(moves, arrays)], one after another: each
  move waits for the one before's result through an optimization barrier.
  XLA would otherwise run every collective first and hold all their
  received pieces at once."""
  done = []
  for move, x in zip(moves, arrays):
    if done:
      x, _ = lax.optimization_barrier((x, done[-1]))
    done.append(move(x))
  return done


def after_all(fn):
  """fn run once all of its arrays exist (an optimization barrier on
  them). A backward's moves of Q, K and V need no result of its forward:
  XLA would otherwise run them ahead of the forward and hold what they
  received through it."""
  def run(*arrays):
    return fn(*lax.optimization_barrier(arrays))
  return run


def _zigzag_perms(p):
  """ppermute pairs sending half 0 and half 1 of each device's chunk
  (chunks 2e, 2e + 1 of 2P) to the device that holds it in the balanced
  layout: chunk c on device c, or 2P-1-c from P on."""
  owner = lambda c: c if c < p else 2 * p - 1 - c
  return ([(e, owner(2 * e)) for e in range(p)],
          [(e, owner(2 * e + 1)) for e in range(p)])


def to_zigzag(x, axis, seq, p):
  """(chunk d, chunk 2P-1-d) on device d, from the contiguous chunk each
  device holds along `axis`. (Chunk d is even, arriving through the first
  permutation, exactly when d is.)"""
  first, second = _zigzag_perms(p)
  h0, h1 = jnp.split(x, 2, axis)
  a = moved(lax.ppermute, h0, seq, first)
  b = moved(lax.ppermute, h1, seq, second)
  even = lax.rem(lax.axis_index(seq), 2) == 0
  return jnp.where(even, a, b), jnp.where(even, b, a)


def from_zigzag(low, high, axis, seq, p):
  """The inverse of `to_zigzag`: each device's contiguous chunk again."""
  first, second = _zigzag_perms(p)
  even = lax.rem(lax.axis_index(seq), 2) == 0
  a, b = jnp.where(even, low, high), jnp.where(even, high, low)
  back = lambda perm: [(j, i) for i, j in perm]
  return jnp.concatenate([moved(lax.ppermute, a, seq, back(first)),
                          moved(lax.ppermute, b, seq, back(second))], axis)


def zigzag_whole(x, axis, seq, p):
  """This device's chunk of `x` in the balanced layout: (chunk d, chunk
  2P-1-d) joined along `axis`."""
  return jnp.concatenate(to_zigzag(x, axis, seq, p), axis)


def unzigzag_whole(x, axis, seq, p):
  return from_zigzag(*jnp.split(x, 2, axis), axis, seq, p)


def localize(x, factors: str, seq, p: int, to_heads: bool):
  """One array of an all_to_all call with operands, on a device, moved
  between its sequence chunk of every head (`to_heads` False) and the
  whole sequence of its 1 / P of the heads: per (token, head) arrays by
  an all-to-all, per-token ones (ids, a bias shared by the heads)
  gathered whole (back, a gradient's partials over the heads summed and
  cut to the chunk), per-head ones (ALiBi slopes, sinks) cut to its heads
  (and, back, gathered); others unchanged."""
  names = factors.split()
  length = next((i for i, f in enumerate(names) if f in "ts"), None)
  heads = next((i for i, f in enumerate(names) if f in "nk"), None)
  if length is not None and heads is not None:
    split, concat = (heads, length) if to_heads else (length, heads)
    return exchange(x, seq, split, concat)
  if length is not None:  # Back: a gradient's partial over these heads.
    if to_heads:
      return moved(lax.all_gather, x, seq, axis=length, tiled=True)
    return lax.psum_scatter(x, seq, scatter_dimension=length, tiled=True)
  if heads is not None:
    if not to_heads:
      return moved(lax.all_gather, x, seq, axis=heads, tiled=True)
    size = x.shape[heads] // p
    return lax.dynamic_slice_in_dim(x, lax.axis_index(seq) * size, size,
                                    heads)
  return x
