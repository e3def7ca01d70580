"""The ring: each device holds a chunk of the sequence (queries, keys,
values); the key/value chunks travel around the devices with `ppermute`
while each device runs its (query chunk, key chunk) pairs on the flash
kernels, merging the partial outputs by their logsumexps. The backward
travels the ring again: dQ accumulates where the queries live, and the
dK/dV partials travel with their keys and values back to their owners.

Causal rings run in the balanced (zigzag) layout: the sequence cut into 2P
chunks, device d holding chunks d and 2P-1-d, so that every device does the
same work at every step (`lowerings.ring` moves the arrays into it).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax

from jax_flash.context_parallel.collectives import in_turn, moved
from jax_flash.core import dropout, softmax
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores

if TYPE_CHECKING:
  from jax_flash._dispatch import Configs, Plan

FULL, CAUSAL, SKIP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Ring:
  """This device's ring: over mesh axis (or axes) `axis` of `size`
  devices, causal or not, each pair of chunks run by `plan`'s backends
  with `configs`' block sizes."""
  axis: str
  size: int
  causal: bool
  scores: Scores
  plan: Plan  # The backends of one pair of chunks,
  configs: Configs  # and their block sizes.
  # A causal sliding window of `window` keys to the left of each query
  # (`Mask.window_left`): contiguous chunks (no zigzag), only the steps
  # whose keys the window reaches (`_steps`); after the first, a pair's
  # queries sit at an offset from its keys (`band_plan`, `band_configs`:
  # the backends of such a pair).
  window: int | None = None
  band_plan: Plan | None = None
  band_configs: Configs | None = None
  # ALiBi: every FULL pair's queries at their offset from its keys (the
  # band plan's), so that |i - j| is the distance in the whole sequence.
  alibi: bool = False
  # The backward's heads in this many groups (whole KV heads with their
  # query heads), one group's ring after another: a device holds one
  # group's float32 sums and visiting keys at a time (`_in_head_groups`).
  head_groups: int = 1

  @property
  def zigzag(self) -> bool:
    return self.causal and self.window is None

  @property
  def offsets(self) -> bool:
    """Whether FULL pairs run with query offsets (`_place`)."""
    return self.window is not None or self.alibi


# The backward's most head groups (`Ring.head_groups`), each of at least
# two KV heads.
MAX_HEAD_GROUPS = 4


def head_groups(kv_heads: int) -> int:
  """How many groups the ring's backward takes the heads in: the most, up
  to MAX_HEAD_GROUPS, that divide the KV heads into groups of two or
  more: a device holds the float32 sums and visiting keys of a quarter of
  the heads at a time where there are 8 or more (their memory:
  docs/devices.md)."""
  return max(g for g in range(1, MAX_HEAD_GROUPS + 1)
             if kv_heads % g == 0 and (g == 1 or kv_heads // g >= 2))


def _steps(ring: Ring, chunk: int) -> int:
  """How many key chunks a device's queries visit: all P, or with a window
  of w keys to the left the chunks d - i with (i - 1) * chunk < w."""
  if ring.window is None:
    return ring.size
  return min(ring.size, (ring.window - 1) // chunk + 2)


def _masks(ids, ring: Ring):
  """The masks of a pair's kinds FULL and CAUSAL (with segment ids if
  given: the ring takes no lengths, so no id marks padding); with a
  window, FULL is a key chunk before the queries' (at query offsets) and
  CAUSAL the queries' own; with ALiBi, FULL pairs are at query offsets."""
  has_ids = ids[0] is not None
  kw = dict(has_ids=has_ids, segments_only=has_ids)
  if ring.window is None:
    return (Mask(has_q_offsets=ring.alibi, **kw),
            Mask(is_causal=True, **kw))
  return (Mask(is_causal=True, window_left=ring.window, has_q_offsets=True,
               **kw),
          Mask(is_causal=True, window_left=ring.window, **kw))


def _plan_of(ring: Ring, mask: Mask):
  if mask.has_q_offsets:
    return ring.band_plan, ring.band_configs
  return ring.plan, ring.configs


@dataclasses.dataclass(frozen=True)
class _Extras:
  """A pair's arrays besides q, k, v and ids: the queries' offsets from
  its keys (`_place`), dropout's seed at its place (`_pair_extras`) and
  ALiBi's slopes."""
  offsets: object
  seed: object = None
  slopes: object = None


def _pair_operands(mask: Mask, ids, extras: _Extras) -> Operands:
  """A pair's operands: its ids, the query offsets of a FULL pair with a
  window or ALiBi, dropout's seed and ALiBi's slopes."""
  return Operands(q_ids=ids[0], kv_ids=ids[1],
                  q_offsets=extras.offsets if mask.has_q_offsets else None,
                  dropout_seed=extras.seed, alibi_slopes=extras.slopes)


def _pair_forward(kind, q, k, v, ids, extras: _Extras, ring: Ring):
  """(o, lse) of one (query chunk, key chunk) pair: full, causal or
  skipped."""
  def run(mask):
    plan, configs = _plan_of(ring, mask)
    return lambda q, k, v, ids: plan.forward.forward(
        q, k, v, _pair_operands(mask, ids, extras), mask=mask,
        scores=ring.scores, config=configs.forward)

  def skip(q, k, v, ids):
    b, t, n, _ = q.shape
    return (jnp.zeros(q.shape, q.dtype),
            jnp.full((b, n, t), -jnp.inf, jnp.float32))

  full, causal = _masks(ids, ring)
  return lax.switch(kind, [run(full), run(causal), skip], q, k, v, ids)


def _pair_backward(kind, q, k, v, ids, extras: _Extras, delta, lse, do,
                   sums, ring: Ring):
  """The float32 sums (dq, dk, dv) with one pair's gradients added, from
  the merged lse, dO and D = rowsum(dO * O) - dlse of the merged O
  (`delta`). The sums go into the branch and come out of it, so a
  skipped pair returns them as they are and a run one adds to them in
  place of holding its own float32 gradients beside them."""
  def run(mask):
    plan, configs = _plan_of(ring, mask)

    def f(q, k, v, ids, delta, lse, do, sums):
      grads = plan.backward.backward(
          q, k, v, _pair_operands(mask, ids, extras), delta, lse, do,
          None, mask=mask, scores=ring.scores, config=configs.backward)[:3]
      return tuple(s + g.astype(jnp.float32) for s, g in zip(sums, grads))
    return f

  def skip(q, k, v, ids, delta, lse, do, sums):
    return sums

  full, causal = _masks(ids, ring)
  return lax.switch(kind, [run(full), run(causal), skip], q, k, v, ids,
                    delta, lse, do, sums)


def _pairs(ring: Ring, step):
  """[(query half, key half, kind)] for this device at this step.

  Without causality each device holds one chunk and every pair is full. With
  the zigzag layout device d holds chunks (d, 2P-1-d) as halves (0, 1); at
  step i it holds the keys of device s = d - i. With a window, chunk d
  against chunk d - i: its own (causal), an earlier one (FULL: the window
  at offsets), or one after it, come round the ring (skipped).
  """
  if ring.window is not None:
    d = lax.axis_index(ring.axis)
    kind = jnp.where(step == 0, CAUSAL, jnp.where(d >= step, FULL, SKIP))
    return [(None, None, kind)]
  if not ring.causal:
    return [(None, None, jnp.int32(FULL))]
  d = lax.axis_index(ring.axis)
  s = lax.rem(d - step + ring.size, ring.size)
  # Chunk d vs chunk s: earlier keys are full, the same chunk is causal.
  first = jnp.where(s < d, FULL, jnp.where(s == d, CAUSAL, SKIP))
  last = jnp.where(s > d, FULL, jnp.where(s == d, CAUSAL, SKIP))
  return [(0, 0, first), (1, 0, jnp.int32(FULL)), (1, 1, last)]
  # (Half 0 never sees key half 1: chunk 2P-1-s comes after chunk d.)


def _place(ring: Ring, step, qh, kh, rows: int):
  """(first query, first key) of this device's pair (query half qh, key
  half kh) at `step` in the whole sequence: chunk d of the queries and d
  - step of the keys, or in the zigzag layout halves 0 and 1 of chunks d
  and 2P-1-d of 2P. `rows`: a device's rows (both halves)."""
  d = lax.axis_index(ring.axis)
  s = lax.rem(d - step + ring.size, ring.size)
  if qh is None:
    return d * rows, s * rows
  half = rows // 2
  chunk = lambda c, h: c if h == 0 else 2 * ring.size - 1 - c
  return chunk(d, qh) * half, chunk(s, kh) * half


def _pair_extras(ring: Ring, step, qh, kh, q, seed, slopes) -> _Extras:
  """The `_Extras` of this device's pair at `step`: the queries' offset
  from its keys (FULL pairs take it with `Ring.offsets`; a CAUSAL pair's
  is 0), and dropout's seed (None without dropout) at the pair's first
  row and column in the whole sequence, so its bits are the unsharded
  call's; with offsets the kernels count a pair's rows from its keys'
  first and add the offsets themselves."""
  first_q, first_k = _place(ring, step, qh, kh, q.shape[1])
  offsets = jnp.full((q.shape[0],), first_q - first_k, jnp.int32)
  if seed is not None:
    seed = dropout.at_positions(seed, first_k if ring.offsets else first_q,
                                first_k)
  return _Extras(offsets=offsets, seed=seed, slopes=slopes)


def _half(x, half):
  if half is None:
    return x
  n = x.shape[1] // 2
  return x[:, half * n:(half + 1) * n]


def _halves(ring: Ring):
  """The halves a device's chunk is cut into: the zigzag's two, else one."""
  return [0, 1] if ring.zigzag else [None]


def _parts(x, ring: Ring):
  """x [B, L, ...] as a tuple of its halves (`_halves`). Arrays that travel
  the ring are carried so, each half sent on its own, so that what is in
  flight beside what a device keeps need not be a whole chunk."""
  return tuple(_half(x, h) for h in _halves(ring))


def _rotate(ring: Ring, *groups):
  """Each of `groups` (tuples of arrays: halves, `_parts`) one device on
  around the ring, every array sent after the one before has arrived
  (`in_turn`): one array's received copy in flight at a time."""
  perm = [(j, (j + 1) % ring.size) for j in range(ring.size)]
  send = lambda x: moved(lax.ppermute, x, ring.axis, perm)
  flat = [x for group in groups for x in group]
  done = iter(in_turn([send] * len(flat), flat))
  return tuple(tuple(next(done) for _ in group) for group in groups)


def _ids_half(q_ids, kv_ids, qh, kh):
  if q_ids is None:
    return (None, None)
  return _half(q_ids, qh), _half(kv_ids, kh)


def forward(q, k, v, q_ids, kv_ids, sinks, ring: Ring, seed=None,
            slopes=None):
  """(out, lse) of this device's query chunk: the P steps in a loop (one
  step's buffers live at a time), each pair's partial merged into the
  running (o, lse) of its query half by their logsumexps. `seed`:
  dropout's (int32 [4]), drawn at each pair's place in the sequence;
  `slopes`: ALiBi's (with `Ring.alibi`)."""
  halves = _halves(ring)
  b, _, n, _ = q.shape
  rows = q.shape[1] // len(halves)
  steps = _steps(ring, q.shape[1])

  def pairs(step, k, v, kv_ids, acc):
    acc = dict(zip(halves, acc))
    for qh, kh, kind in _pairs(ring, step):
      o, part_lse = _pair_forward(
          kind, _half(q, qh), k[halves.index(kh)], v[halves.index(kh)],
          _ids_half(q_ids, kv_ids, qh, kh),
          _pair_extras(ring, step, qh, kh, q, seed, slopes), ring)
      # The running output in the query's layout [B, T, N, H], its lse
      # [B, T, N]: a pair's lse moves, not its output.
      acc[qh] = softmax.merge_two(*acc[qh], o, part_lse.transpose(0, 2, 1))
    return tuple(acc[h] for h in halves)

  def step_and_rotate(step, carry):  # Segment ids travel with their keys.
    k, v, kv_ids, acc = carry
    acc = pairs(step, k, v, kv_ids, acc)
    if kv_ids is None:
      k, v = _rotate(ring, k, v)
    else:
      k, v, (kv_ids,) = _rotate(ring, k, v, (kv_ids,))
    return k, v, kv_ids, acc

  empty = (jnp.zeros((b, rows, n, v.shape[-1]), jnp.float32),
           jnp.full((b, rows, n), -jnp.inf, jnp.float32))
  k, v, kv_ids, acc = lax.fori_loop(
      0, steps - 1, step_and_rotate,
      (_parts(k, ring), _parts(v, ring), kv_ids, (empty,) * len(halves)))
  acc = pairs(steps - 1, k, v, kv_ids, acc)  # The last: no rotation.
  out, lse = [], []
  for merged, merged_lse in acc:
    if sinks is not None:  # Each head's sink joins the merged denominator.
      merged, merged_lse = softmax.with_sink(merged, merged_lse,
                                             sinks[None, None, :])
    out.append(merged.astype(q.dtype))
    lse.append(merged_lse.transpose(0, 2, 1))
  return jnp.concatenate(out, axis=1), jnp.concatenate(lse, axis=-1)


def backward(q, k, v, q_ids, kv_ids, delta, lse, do, ring: Ring,
             seed=None, slopes=None):
  """(dq, dk, dv) of this device's chunks from its lse, dO and D =
  rowsum(dO * O) - dlse (`delta`): the pairs' gradients, float32
  dK/dV travelling with their keys as halves (`_parts`; after P moves
  they are home again; a windowed ring's, after fewer, are sent home);
  with `ring.head_groups`, a group of heads at a time."""
  do = do.astype(q.dtype)
  run = lambda q, k, v, delta, lse, do, seed, slopes: _backward(
      q, k, v, q_ids, kv_ids, delta, lse, do, ring, seed, slopes)
  if ring.head_groups == 1:
    return run(q, k, v, delta, lse, do, seed, slopes)
  # A group's bits are its heads' (with one mask for every head, the same).
  shift = seed is not None and not ring.scores.dropout_broadcast
  seed_of = lambda g: (dropout.shifted(seed, 0, g * q.shape[2]
                                       // ring.head_groups) if shift else seed)
  return _in_head_groups(run, ring.head_groups, q, k, v, delta, lse, do,
                         seed_of, slopes)


def _in_head_groups(run, groups: int, q, k, v, delta, lse, do, seed_of,
                    slopes):
  """run(q, k, v, delta, lse, do, seed, slopes) -> (dq, dk, dv) over
  `groups` equal groups of heads in turn, group g the KV heads [g * K/G,
  (g + 1) * K/G) and their query heads: each group's arrays sliced out
  (dropout's seed `seed_of(g)`, shifted to the group's first head), its
  gradients written into the whole's. One group's buffers live at a
  time."""
  qn, kn = q.shape[2] // groups, k.shape[2] // groups

  def group(g, grads):
    take = lambda x, n, axis: lax.dynamic_slice_in_dim(x, g * n, n, axis)
    out = run(take(q, qn, 2), take(k, kn, 2), take(v, kn, 2),
              take(delta, qn, 1), take(lse, qn, 1), take(do, qn, 2),
              seed_of(g), None if slopes is None else take(slopes, qn, 1))
    return tuple(lax.dynamic_update_slice_in_dim(whole, part, g * n, 2)
                 for whole, part, n in zip(grads, out, (qn, kn, kn)))
  return lax.fori_loop(0, groups, group,
                       tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v)))


def _backward(q, k, v, q_ids, kv_ids, delta, lse, do, ring: Ring, seed,
              slopes):
  """`backward` of one group of heads."""
  halves = _halves(ring)
  zeros = lambda x: tuple(jnp.zeros(y.shape, jnp.float32)
                          for y in _parts(x, ring))

  def lse_half(x, qh):
    n = x.shape[-1] // 2
    return x if qh is None else x[..., qh * n:(qh + 1) * n]

  def step(i, carry):  # One step's buffers live at a time.
    k, v, kv_ids, dq, dk, dv = carry
    dq, dk, dv = list(dq), list(dk), list(dv)
    for qh, kh, kind in _pairs(ring, i):
      a, b = halves.index(qh), halves.index(kh)
      dq[a], dk[b], dv[b] = _pair_backward(
          kind, _half(q, qh), k[b], v[b], _ids_half(q_ids, kv_ids, qh, kh),
          _pair_extras(ring, i, qh, kh, q, seed, slopes),
          lse_half(delta, qh), lse_half(lse, qh), _half(do, qh),
          (dq[a], dk[b], dv[b]), ring)
    if kv_ids is None:
      k, v, dk, dv = _rotate(ring, k, v, dk, dv)
    else:
      k, v, dk, dv, (kv_ids,) = _rotate(ring, k, v, dk, dv, (kv_ids,))
    return k, v, kv_ids, tuple(dq), dk, dv

  steps = _steps(ring, q.shape[1])
  _, _, _, dq, dk, dv = lax.fori_loop(
      0, steps, step, (_parts(k, ring), _parts(v, ring), kv_ids, zeros(q),
                       zeros(k), zeros(v)))
  dq, dk, dv = (jnp.concatenate(x, axis=1) for x in (dq, dk, dv))
  if steps % ring.size:  # dK/dV are `steps` devices past their keys' home.
    home = [(j, (j - steps) % ring.size) for j in range(ring.size)]
    dk, dv = (lax.ppermute(x, ring.axis, home) for x in (dk, dv))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
