"""The Mosaic kernels' host-side schedules and tables, simulated in numpy:
the persistent forward's items, the split-KV decode's tiles, the named
barriers' pairing, the range tables of masks and ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.core.mask import Mask, kv_block_ranges
from pallas_kernels.mosaic_gpu import flash_fwd, scheduling


@pytest.mark.parametrize("groups, tiles, ctas", [
    (256, 512, 132), (32, 512, 132), (3, 7, 132), (12, 16, 5), (1, 1, 4)])
def test_decode_schedule_streams_each_tile_once_balanced(groups, tiles, ctas):
  """The Mosaic decode kernel's stream-K schedule: CTAs' runs cover the
  flattened tiles once and differ by at most one tile; a group's owner is
  the first CTA whose run crosses it and its written parts are exactly
  the CTAs that do; no run crosses more than `segments` groups."""
  bounds, segments, owners, crossed = scheduling.stream_k(groups, tiles, ctas)
  used = len(bounds) - 1
  assert used == min(ctas, groups * tiles)
  assert bounds[0] == 0 and bounds[-1] == groups * tiles
  assert np.ptp(np.diff(bounds)) <= 1 and np.all(np.diff(bounds) >= 1)
  crossing = {}
  for cta in range(used):
    for t in range(bounds[cta], bounds[cta + 1]):
      crossing.setdefault(t // tiles, set()).add(cta)
  assert segments == max(
      len({t // tiles for t in range(bounds[c], bounds[c + 1])})
      for c in range(used))
  for g in range(groups):
    named = {owners[g] + m for m in np.flatnonzero(crossed[g])}
    assert named == crossing[g], g
    assert owners[g] == min(crossing[g])


@pytest.mark.parametrize("mask", [Mask(), Mask(is_causal=True),
                                  Mask(is_causal=True, window_left=300)],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("batch,heads,tiles,programs", [
    (8, 16, 16, 132), (1, 16, 128, 132), (4, 16, 32, 132), (1, 2, 3, 5),
    (2, 3, 8, 7), (1, 1, 4, 4)])
def test_persistent_schedule_covers_every_item_once(
    mask, batch, heads, tiles, programs, monkeypatch):
  """`persistent_order` and `cta_schedule`: the persistent CTAs' items are
  every (batch, head, query tile) exactly once; a CTA's work (key tiles by
  the band, plus one an item) exceeds the mean by at most one item, and
  under a causal mask by at most 2% (or 3 tiles);
  a round before the last TAIL_ROUNDS (sorted by weight) holds the items of as
  few (batch, head) as it can (they share K/V in L2)."""
  rows = block_kv = 128
  kv_len = tiles * rows
  order = scheduling.persistent_order(mask, programs, batch, heads, tiles,
                                     rows, block_kv, kv_len)
  assert (order is None) == (mask == Mask())
  lo, _, _, hi = kv_block_ranges(mask, jnp.arange(tiles) * rows, rows,
                                 block_kv, kv_len)
  weight = np.broadcast_to(np.asarray(hi - lo), (tiles,)) + 1
  np.testing.assert_array_equal(
      scheduling.band_tiles(mask, tiles, rows, block_kv, kv_len) + 1, weight)
  seen, work, rounds = [], [], {}
  for pid in range(programs):
    monkeypatch.setattr(flash_fwd.lax, "axis_index",
                        lambda name, pid=pid: jnp.int32(pid))
    count, item_id, coords = flash_fwd.cta_schedule(
        mask, programs, batch, heads, tiles,
        None if order is None else jnp.asarray(order))
    items = [tuple(int(x) for x in coords(item_id(i)))
             for i in range(int(count))]
    seen += items
    work.append(sum(weight[t] for _, _, t in items))
    for i, (b, h, _) in enumerate(items):
      rounds.setdefault(i, set()).add((b, h))
  assert sorted(seen) == [(b, h, t) for b in range(batch)
                          for h in range(heads) for t in range(tiles)]
  excess = max(work) - np.mean(work)
  assert excess <= weight.max(), work  # At most one item more than its share.
  if mask == Mask(is_causal=True):  # Balanced within 2% (1-3 tiles at 2k).
    assert excess <= max(3, 0.02 * np.mean(work)), work
  local = len(rounds) - (0 if order is None else scheduling.TAIL_ROUNDS)
  for i in range(local):
    assert len(rounds[i]) <= -(-programs // tiles) + 1, (i, rounds[i])


def _schedule_calls(monkeypatch, wg, first, lo, hi, steps):
  """Warpgroup `wg`'s hardware-barrier ops, (op, id), as the forward's
  consumer makes them: warpgroup 1 opens half a step behind, key tiles
  [lo, hi) are computed (arrive and wait after Q K^T, arrive after the
  softmax, wait before P V), the rest of [first, steps) only released,
  and warpgroup 0 closes."""
  ops = []
  monkeypatch.setattr(flash_fwd, "_hardware_barrier",
                      lambda op, barrier_id: ops.append((op, barrier_id)))
  schedule = flash_fwd._Schedule(None, wg)
  if wg == 1:
    schedule.both(1)
  for j in range(first, steps):
    schedule.both(0)
    if lo <= j < hi:
      schedule.arrive(1)
      schedule.wait(1)
    else:
      schedule.both(1)
  if wg == 0:
    schedule.both(0)
  return ops


def _run_hardware_barriers(programs, rng):
  """Runs each warpgroup's (op, id) list in a random interleaving under
  `bar.arrive` / `bar.sync` semantics (a barrier completes at two
  warpgroups' arrivals, whoever they are; `sync` blocks until the one it
  joined completes). Returns the arrivers of each completion, or None
  on a deadlock."""
  pc = [0] * len(programs)
  blocked = [None] * len(programs)  # (barrier id, its generation).
  arrivals, generation, completions = {}, {}, []
  while any(pc[w] < len(p) for w, p in enumerate(programs)):
    ready = [w for w, p in enumerate(programs)
             if pc[w] < len(p) and blocked[w] is None]
    if not ready:
      return None
    w = ready[rng.integers(len(ready))]
    op, barrier_id = programs[w][pc[w]]
    pc[w] += 1
    arrivals.setdefault(barrier_id, []).append(w)
    gen = generation.get(barrier_id, 0)
    if op == "sync":
      blocked[w] = (barrier_id, gen)
    if len(arrivals[barrier_id]) == 2:
      completions.append(arrivals.pop(barrier_id))
      generation[barrier_id] = gen + 1
      blocked = [None if b == (barrier_id, gen) else b for b in blocked]
  return completions


@pytest.mark.parametrize("ranges", [
    ((0, 3), (0, 3)),  # Both warpgroups need every tile.
    ((0, 2), (0, 5)),  # Causal: warpgroup 0 releases the last three.
    ((2, 5), (0, 3)),  # Each releases what the other needs.
    ((0, 0), (1, 4)),  # Warpgroup 0 needs none.
])
def test_named_barrier_schedule_pairs_each_arrival_with_the_others_wait(
    monkeypatch, ranges):
  """In any interleaving, every hardware barrier completes with one
  arrival from each warpgroup, and nothing deadlocks: a warpgroup running
  ahead through tiles it only releases never arrives twice at a barrier
  the other has not yet waited on."""
  first = min(lo for lo, _ in ranges)
  steps = max(hi for _, hi in ranges)
  programs = [_schedule_calls(monkeypatch, wg, first, lo, hi, steps)
              for wg, (lo, hi) in enumerate(ranges)]
  rng = np.random.default_rng(0)
  for _ in range(200):
    completions = _run_hardware_barriers(programs, rng)
    assert completions is not None, "deadlock"
    assert all(sorted(arrivers) == [0, 1] for arrivers in completions)


@pytest.mark.parametrize("transposed", [False, True])
def test_mosaic_range_table_of_a_mask_mod_and_ids(transposed):
  """`tiles.range_table` (the Mosaic kernels' tile ranges, on the CPU:
  plain XLA): a mask_mod's kinds intersected with segment ids' ranges; every
  visible pair's tile is visited, every tile of the full range is wholly
  visible, the rows the kernel pads with are empty."""
  import numpy as np
  from jax_flash.core import mask as mask_lib
  from pallas_kernels.mosaic_gpu.tiles import range_table
  b, t, s, rows, cols = 2, 200, 300, 64, 32
  mod = lambda _b, _h, q, k: (q >= k) | (k < 40)
  block_mask = jax_flash.create_block_mask(mod, None, None, t, s,
                                           block_size=(16, 16))
  kinds = block_mask.kinds[:, 0].astype(jnp.int8)
  q_ids = jnp.sort(jax.random.randint(jax.random.key(0), (b, t), 0, 3), 1)
  kv_ids = jnp.sort(jax.random.randint(jax.random.key(1), (b, s), 0, 3), 1)
  mask = mask_lib.Mask(has_ids=True, mod=mod, mod_tiles=(16, 16))
  padded = 8  # Row tiles the kernel runs: more than the lengths need.
  table = np.asarray(range_table(mask, kinds, q_ids, kv_ids, rows, cols, t,
                                 s, padded, transposed=transposed))
  assert table.shape == (b, padded, 4)
  qi, ki = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = (np.asarray(mod(0, 0, qi, ki)) &
         (np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]))
  if transposed:
    vis = vis.transpose(0, 2, 1)
  for batch in range(b):
    for r in range(padded):
      lo, full_lo, full_hi, hi = table[batch, r]
      tile = vis[batch, r * rows:(r + 1) * rows]
      if not tile.size:  # Past the length: nothing to visit.
        assert lo == hi, (batch, r)
        continue
      seen = np.nonzero(tile.any(axis=0))[0] // cols
      assert all(lo <= c < hi for c in seen), (batch, r)
      for c in range(full_lo, full_hi):
        assert tile[:, c * cols:(c + 1) * cols].all(), (batch, r, c)
  if not transposed:  # Some query tiles skip the predicate on some keys.
    assert (table[..., 2] > table[..., 1]).any()


def test_pad_pairs_keeps_broadcast_dims_and_hides_the_padding():
  """`core.padding.pad_pairs` (plain XLA, what the Mosaic kernels read a
  dense mask or bias from): full dims padded with 0 to the kernels' rows,
  dims of 1 kept (broadcast in registers), the last two swapped for dK/dV."""
  from jax_flash.core.padding import pad_pairs
  x = jnp.arange(2 * 3 * 5 * 7, dtype=jnp.float32).reshape(2, 3, 5, 7) + 1
  padded = pad_pairs(x, 8, 16)
  assert padded.shape == (2, 3, 8, 16)
  assert (padded[:, :, :5, :7] == x).all()
  assert not padded[:, :, 5:].any() and not padded[:, :, :, 7:].any()
  assert (pad_pairs(x, 8, 16, transposed=True) == padded.swapaxes(2, 3)).all()
  assert pad_pairs(x[:, :, :1], 8, 16).shape == (2, 3, 1, 16)
  assert pad_pairs(x[:1, :, :, :1], 8, 16, transposed=True).shape == (
      1, 3, 1, 8)
  assert pad_pairs(None, 8, 16) is None
