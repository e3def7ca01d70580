"""`ring_attention`: context parallelism over a sequence-sharded mesh axis.

Each device holds a slice of the sequence (queries, keys, values). The key/value
slices travel around the ring with `ppermute` while every device runs the flash
kernels on the slice it holds, merging the partial outputs by their
logsumexp. The backward travels the ring again: dQ accumulates where the
queries live, and the dK/dV partials travel with their keys and values back
to their owners. Built on `jax.shard_map` and collectives only.

Causal attention uses a zigzag layout: the sequence is cut into 2P chunks and
device d holds chunks d and 2P-1-d, so every device does the same work at
every step (a contiguous split would leave the first devices idle).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_flash import _dispatch
from jax_flash._sharding import moved
from jax_flash.core import checks, dropout, softmax
from jax_flash.core.mask import Mask
from jax_flash.core.operands import Operands
from jax_flash.core.scores import Scores

FULL, CAUSAL, SKIP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Ring:
  axis: str
  size: int
  causal: bool
  scores: Scores
  plan: _dispatch.Plan  # The backends of one pair of chunks,
  configs: _dispatch.Configs  # and their block sizes.
  # A causal sliding window of `window` keys to the left of each query
  # (`Mask.window_left`): contiguous chunks (no zigzag), only the steps
  # whose keys the window reaches (`_steps`); after the first, a pair's
  # queries sit at an offset from its keys (`band_plan`, `band_configs`:
  # the backends of such a pair).
  window: int | None = None
  band_plan: _dispatch.Plan | None = None
  band_configs: _dispatch.Configs | None = None

  @property
  def zigzag(self) -> bool:
    return self.causal and self.window is None


def _steps(ring: _Ring, chunk: int) -> int:
  """How many key chunks a device's queries visit: all P, or with a window
  of w keys to the left the chunks d - i with (i - 1) * chunk < w."""
  if ring.window is None:
    return ring.size
  return min(ring.size, (ring.window - 1) // chunk + 2)


def _masks(ids, ring: _Ring):
  """The masks of a pair's kinds FULL and CAUSAL (with segment ids if
  given: the ring takes no lengths, so no id marks padding); with a
  window, FULL is a key chunk before the queries' (at query offsets) and
  CAUSAL the queries' own."""
  has_ids = ids[0] is not None
  kw = dict(has_ids=has_ids, segments_only=has_ids)
  if ring.window is None:
    return Mask(**kw), Mask(is_causal=True, **kw)
  return (Mask(is_causal=True, window_left=ring.window, has_q_offsets=True,
               **kw),
          Mask(is_causal=True, window_left=ring.window, **kw))


def _plan_of(ring: _Ring, mask: Mask):
  if mask.has_q_offsets:
    return ring.band_plan, ring.band_configs
  return ring.plan, ring.configs


def _pair_operands(mask: Mask, ids, offsets, seed) -> Operands:
  """A pair's operands: its ids, the query offsets of a windowed ring's
  FULL pair, and dropout's seed at the pair's place (`_pair_seed`)."""
  return Operands(q_ids=ids[0], kv_ids=ids[1],
                  q_offsets=offsets if mask.has_q_offsets else None,
                  dropout_seed=seed)


def _pair_forward(kind, q, k, v, ids, offsets, seed, ring: _Ring):
  """(o, lse) of one (query chunk, key chunk) pair: full, causal or skipped
  (`offsets`: the queries' positions past the keys' first, for a windowed
  ring's FULL pairs; `seed`: dropout's, at the pair's rows and columns)."""
  def run(mask):
    plan, configs = _plan_of(ring, mask)
    return lambda q, k, v, ids: plan.forward.forward(
        q, k, v, _pair_operands(mask, ids, offsets, seed), mask=mask,
        scores=ring.scores, config=configs.forward)

  def skip(q, k, v, ids):
    b, t, n, _ = q.shape
    return (jnp.zeros(q.shape, q.dtype),
            jnp.full((b, n, t), -jnp.inf, jnp.float32))

  full, causal = _masks(ids, ring)
  return lax.switch(kind, [run(full), run(causal), skip], q, k, v, ids)


def _pair_backward(kind, q, k, v, ids, offsets, seed, delta, lse, do,
                   ring: _Ring):
  """Float32 (dq, dk, dv) of one pair, from the merged lse, dO and D =
  rowsum(dO * O) - dlse of the merged O (`delta`)."""
  def run(mask):
    plan, configs = _plan_of(ring, mask)

    def f(q, k, v, ids, delta, lse, do):
      dq, dk, dv, _ = plan.backward.backward(
          q, k, v, _pair_operands(mask, ids, offsets, seed), delta, lse, do,
          None, mask=mask, scores=ring.scores, config=configs.backward)
      return tuple(x.astype(jnp.float32) for x in (dq, dk, dv))
    return f

  def skip(q, k, v, ids, delta, lse, do):
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

  full, causal = _masks(ids, ring)
  return lax.switch(kind, [run(full), run(causal), skip], q, k, v, ids,
                    delta, lse, do)


def _offsets(q, step):
  """A windowed ring's query offsets at `step`: its keys are `step` chunks
  before the queries."""
  return jnp.full((q.shape[0],), step * q.shape[1], jnp.int32)


def _pairs(ring: _Ring, step):
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


def _pair_seed(seed, ring: _Ring, step, qh, kh, rows: int):
  """Dropout's seed for this device's pair (query half qh, key half kh)
  at `step`: offset to the pair's first row and column in the whole
  sequence (chunk d of the queries, d - step of the keys; in the zigzag
  layout halves 0 and 1 are chunks d and 2P-1-d of 2P), so its bits are
  the unsharded call's. With a window the rows' offset is the keys'
  chunk's: its kernels count a pair's rows from there, adding the
  queries' offsets themselves (`_offsets`). `rows`: a device's rows (both
  halves). None without dropout."""
  if seed is None:
    return None
  d = lax.axis_index(ring.axis)
  s = lax.rem(d - step + ring.size, ring.size)
  if qh is None:
    first_row = s if ring.window is not None else d
    return dropout.at_positions(seed, first_row * rows, s * rows)
  half = rows // 2
  chunk = lambda c, h: c if h == 0 else 2 * ring.size - 1 - c
  return dropout.at_positions(seed, chunk(d, qh) * half,
                              chunk(s, kh) * half)


def _half(x, half):
  if half is None:
    return x
  n = x.shape[1] // 2
  return x[:, half * n:(half + 1) * n]


def _halves(ring: _Ring):
  """The halves a device's chunk is cut into: the zigzag's two, else one."""
  return [0, 1] if ring.zigzag else [None]


def _parts(x, ring: _Ring):
  """x [B, L, ...] as a tuple of its halves (`_halves`). Arrays that travel
  the ring are carried so, each half sent on its own, so that what is in
  flight beside what a device keeps need not be a whole chunk."""
  return tuple(_half(x, h) for h in _halves(ring))


def _rotate(ring: _Ring, *xs):
  perm = [(j, (j + 1) % ring.size) for j in range(ring.size)]
  return tuple(moved(lax.ppermute, x, ring.axis, perm) for x in xs)


def _ids_half(q_ids, kv_ids, qh, kh):
  if q_ids is None:
    return (None, None)
  return _half(q_ids, qh), _half(kv_ids, kh)


def _ring_forward(q, k, v, q_ids, kv_ids, sinks, ring: _Ring, seed=None):
  """(out, lse) of this device's query chunk: the P steps in a loop (one
  step's buffers live at a time), each pair's partial merged into the
  running (o, lse) of its query half by their logsumexps. `seed`:
  dropout's (int32 [4]), drawn at each pair's place in the sequence."""
  halves = _halves(ring)
  b, _, n, _ = q.shape
  rows = q.shape[1] // len(halves)
  steps = _steps(ring, q.shape[1])

  def pairs(step, k, v, kv_ids, acc):
    acc = dict(zip(halves, acc))
    for qh, kh, kind in _pairs(ring, step):
      o, part_lse = _pair_forward(
          kind, _half(q, qh), k[halves.index(kh)], v[halves.index(kh)],
          _ids_half(q_ids, kv_ids, qh, kh), _offsets(q, step),
          _pair_seed(seed, ring, step, qh, kh, q.shape[1]), ring)
      o = o.transpose(0, 2, 1, 3).astype(jnp.float32)  # [B, N, T, H]
      acc[qh] = softmax.merge(jnp.stack([acc[qh][0], o]),
                              jnp.stack([acc[qh][1], part_lse]), axis=0)
    return tuple(acc[h] for h in halves)

  def step_and_rotate(step, carry):  # Segment ids travel with their keys.
    k, v, kv_ids, acc = carry
    acc = pairs(step, k, v, kv_ids, acc)
    k, v = _rotate(ring, *k), _rotate(ring, *v)
    if kv_ids is not None:
      (kv_ids,) = _rotate(ring, kv_ids)
    return k, v, kv_ids, acc

  empty = (jnp.zeros((b, n, rows, v.shape[-1]), jnp.float32),
           jnp.full((b, n, rows), -jnp.inf, jnp.float32))
  k, v, kv_ids, acc = lax.fori_loop(
      0, steps - 1, step_and_rotate,
      (_parts(k, ring), _parts(v, ring), kv_ids, (empty,) * len(halves)))
  acc = pairs(steps - 1, k, v, kv_ids, acc)  # The last: no rotation.
  out, lse = [], []
  for merged, merged_lse in acc:
    if sinks is not None:  # Each head's sink joins the merged denominator.
      merged, merged_lse = softmax.with_sink(merged, merged_lse,
                                             sinks[None, :, None])
    out.append(merged.transpose(0, 2, 1, 3).astype(q.dtype))
    lse.append(merged_lse)
  return jnp.concatenate(out, axis=1), jnp.concatenate(lse, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, q_ids, kv_ids, sinks, seed, ring: _Ring):
  return _ring_forward(q, k, v, q_ids, kv_ids, sinks, ring, seed)[0]


def _ring_fwd(q, k, v, q_ids, kv_ids, sinks, seed, ring):
  out, lse = _ring_forward(q, k, v, q_ids, kv_ids, sinks, ring, seed)
  return out, (q, k, v, q_ids, kv_ids, sinks, seed, out, lse)


def _ring_backward(q, k, v, q_ids, kv_ids, delta, lse, do, ring: _Ring,
                   seed=None):
  """(dq, dk, dv) of this device's chunks from its lse, dO and D =
  rowsum(dO * O) - dlse (`delta`): the pairs' gradients, float32
  dK/dV travelling with their keys as halves (`_parts`; after P moves
  they are home again; a windowed ring's, after fewer, are sent home)."""
  do = do.astype(q.dtype)
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
      g_q, g_k, g_v = _pair_backward(
          kind, _half(q, qh), k[halves.index(kh)], v[halves.index(kh)],
          _ids_half(q_ids, kv_ids, qh, kh), _offsets(q, i),
          _pair_seed(seed, ring, i, qh, kh, q.shape[1]),
          lse_half(delta, qh), lse_half(lse, qh), _half(do, qh), ring)
      a, b = halves.index(qh), halves.index(kh)
      dq[a] = dq[a] + g_q
      dk[b] = dk[b] + g_k
      dv[b] = dv[b] + g_v
    k, v, dk, dv = (_rotate(ring, *x) for x in (k, v, dk, dv))
    if kv_ids is not None:
      (kv_ids,) = _rotate(ring, kv_ids)
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


def _ring_bwd(ring, residuals, do):
  q, k, v, q_ids, kv_ids, sinks, seed, out, lse = residuals
  ids_cotangents = (None if q_ids is None else jnp.zeros_like(q_ids),
                    None if kv_ids is None else jnp.zeros_like(kv_ids))
  delta = softmax.backward_delta(out, do.astype(q.dtype))
  dq, dk, dv = _ring_backward(q, k, v, q_ids, kv_ids, delta, lse, do, ring,
                              seed)
  dsinks = None
  if sinks is not None:  # The sink's gradient from this device's queries.
    dsinks = softmax.sink_gradient(sinks, delta, lse)
  return (dq, dk, dv, *ids_cotangents, dsinks,
          None if seed is None else jnp.zeros_like(seed))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _zigzag_order(size):
  order = []
  for d in range(size):
    order += [d, 2 * size - 1 - d]
  return order


@checks.in_x64_scope
def ring_attention(query, key, value, *, mesh, axis_name, is_causal=False,
                   segment_ids=None, scale=None, sinks=None,
                   dropout_rate=0.0, dropout_rng=None,
                   implementation=None, block_sizes=None):
  """Self-attention with the sequence sharded over `axis_name` of `mesh`.

  Args:
    query: [B, T, N, H]; key, value: [B, T, K, H] (K divides N), the same
      sequence. T must divide by P (2P when causal), P the axis size.
    mesh, axis_name: the mesh and its axis the sequence is split over
      (other mesh axes are left to the caller's sharding of batch/heads).
    is_causal: causal attention, computed with the zigzag layout (the
      sequence is reordered into it and back here).
    segment_ids: int [B, T] (packed documents: a query sees only keys with
      its id); the key ids travel around the ring with the keys.
    scale, sinks, dropout_rate, dropout_rng, block_sizes: as in
      `flash_attention` (dropout: the keep bits of the unsharded call,
      each pair of chunks drawing those of its place).
    implementation: as in `flash_attention`: the backend each device runs on
      each pair of chunks ("xla": the reference, differentiated).
  Returns [B, T, N, H], sequence-sharded over `axis_name`; differentiable with
  respect to query, key and value (the backward rings too).
  """
  p = checks.check_qkv(query, key, value)
  if p.unbatched or p.q_len != p.kv_len:
    raise ValueError("ring_attention takes batched self-attention: query "
                     "[B, T, N, H] and key/value [B, T, K, H]")
  size = mesh.shape[axis_name]
  chunks = 2 * size if is_causal else size
  if p.q_len % chunks:
    raise ValueError(f"sequence length {p.q_len} must divide by {chunks} "
                     f"(the {axis_name!r} axis has {size} devices"
                     f"{', twice that when causal' if is_causal else ''})")
  _dispatch.check_block_sizes(block_sizes)
  local = p.q_len // chunks
  pair = dataclasses.replace(p, q_len=local, kv_len=local)
  sinks = checks.check_sinks(sinks, p)
  # Sinks join the merge of the pairs' partials, not a pair's kernel.
  rate = checks.check_dropout(dropout_rate, dropout_rng)
  seed = dropout.seed_words(dropout_rng) if rate > 0 else None
  scores = Scores(scale=checks.check_scale(scale, p.head_dim),
                  dropout_rate=rate)
  mask = Mask(is_causal=bool(is_causal), has_ids=segment_ids is not None,
              segments_only=segment_ids is not None)
  plan = _dispatch.select(implementation, query, pair, query.dtype,
                          mask=mask, scores=scores)
  ring = _Ring(axis=axis_name, size=size, causal=bool(is_causal),
               scores=scores, plan=plan,
               configs=_dispatch.configure(plan, block_sizes, pair,
                                           query.dtype, is_causal=is_causal,
                                           scores=scores, mask=mask))

  def reorder(x, order):
    b, t = x.shape[:2]
    x = x.reshape((b, chunks, t // chunks) + x.shape[2:])
    return x[:, jnp.asarray(order)].reshape(x.shape[:1] + (t,) + x.shape[3:])

  ids = None
  if segment_ids is not None:
    q_ids, _ = checks.check_segment_ids(segment_ids, p)
    ids = q_ids.astype(jnp.int32)
  zigzag = _zigzag_order(size)
  if is_causal:
    query, key, value = (reorder(x, zigzag) for x in (query, key, value))
    if ids is not None:
      ids = reorder(ids, zigzag)
  spec = P(None, axis_name)
  ids_spec = None if ids is None else spec
  out = jax.shard_map(
      lambda q, k, v, ids, sinks, seed: _ring(q, k, v, ids, ids, sinks, seed,
                                              ring),
      mesh=mesh, in_specs=(spec, spec, spec, ids_spec, P(), P()),
      out_specs=spec, check_vma=False)(query, key, value, ids, sinks, seed)
  if is_causal:
    inverse = [zigzag.index(c) for c in range(chunks)]
    out = reorder(out, inverse)
  return out
