"""Host-side scheduling of the Mosaic GPU kernels, in numpy at trace time:
which (batch, head, query tile) items a persistent forward CTA runs in
which order (`persistent_order`, weighing items by the key tiles their
band visits, `band_tiles`), and the split-KV decode kernel's stream-K
split of the cache's tiles over the CTAs (`stream_k`)."""
from __future__ import annotations

import numpy as np

from jax_flash.core.mask import Mask


def band_tiles(mask: Mask, num_tiles: int, rows: int, block_kv: int,
               kv_len: int):
  """Key tiles each of num_tiles query tiles of `rows` rows visits by the
  band (`mask.band`), as `kv_block_ranges` counts them (hi - lo), in numpy
  (at trace time, with no device)."""
  left, right = mask.band()
  r0 = np.arange(num_tiles) * rows
  first = np.zeros_like(r0) if left is None else np.maximum(r0 - left, 0)
  last = np.full_like(r0, kv_len - 1)
  if right is not None:
    last = np.minimum(r0 + rows - 1 + right, last)
  return np.maximum(last // block_kv + 1 - first // block_kv, 0)


# Rounds at the end of a persistent CTA's items sorted heaviest first, so
# the last ones are light ones (`persistent_order`).
TAIL_ROUNDS = 3


def persistent_order(mask: Mask, programs: int, batch: int, heads: int,
                     num_tiles: int, rows: int, block_kv: int, kv_len: int):
  """The persistent forward's items (batch, head, query tile of `rows`
  rows) as a static int32 table [rounds, programs] of item ids
  ((batch * heads + head) * num_tiles + tile; -1: none), or None where
  every item sees as many key tiles by the band (then CTA p takes item
  round * programs + p).

  Rounds take `programs` consecutive items in the order query tiles
  fastest (those seeing the most key tiles first), then heads, then batch,
  so the CTAs of a round share the K/V of a few (batch, head) in L2,
  except the last TAIL_ROUNDS rounds' items, heaviest first; in each
  round the heaviest item goes to the CTA with the least work so far (the
  band's key tiles plus one an item; a dynamic mask's or a query offset's
  tiles are not seen: they are taken as the band's). Under a causal mask
  no CTA's work exceeds the mean by more than 2% (a CPU test)."""
  weight = band_tiles(mask, num_tiles, rows, block_kv, kv_len) + 1
  if (weight == weight[0]).all():
    return None
  tiles = np.argsort(-weight, kind="stable")
  items = (np.arange(batch * heads)[:, None] * num_tiles + tiles).ravel()
  work = np.tile(weight[tiles], batch * heads)
  rounds = -(-items.size // programs)
  tail = max(0, rounds - TAIL_ROUNDS) * programs
  heavy = tail + np.argsort(-work[tail:], kind="stable")
  items[tail:], work[tail:] = items[heavy], work[heavy]
  order = np.full((rounds, programs), -1, np.int32)
  load = np.zeros(programs, np.int64)
  for r in range(rounds):
    ids, w = items[r * programs:(r + 1) * programs], work[r * programs:
                                                          (r + 1) * programs]
    heavy = np.argsort(-w, kind="stable")
    ctas = np.argsort(load, kind="stable")[:ids.size]
    order[r, ctas] = ids[heavy]
    load[ctas] += w[heavy]
  return order


def stream_k(groups: int, tiles: int, ctas: int):
  """The stream-K schedule of `groups` x `tiles` flattened tiles over at
  most `ctas` CTAs: (bounds int32 [CTAs + 1]: CTA c streams tiles bounds[c]
  to bounds[c + 1]; segments: the most groups one run crosses; owners
  int32 [groups]: the first CTA whose run crosses each group; crossed bool
  [groups, M]: whether group g's m-th part is written, i.e. a run of CTA
  owners[g] + m crosses it)."""
  total = groups * tiles
  ctas = min(ctas, total)
  bounds = np.arange(ctas + 1, dtype=np.int64) * total // ctas
  first, last = bounds[:-1] // tiles, (bounds[1:] - 1) // tiles
  segments = int(np.max(last - first)) + 1
  # CTAs crossing group g: those with first <= g <= last (runs in order).
  starts = np.arange(groups) * tiles
  owners = np.searchsorted(bounds, starts, side="right") - 1
  ends = np.searchsorted(bounds, starts + tiles - 1, side="right") - 1
  crossed = np.arange(int(np.max(ends - owners)) + 1) <= (ends - owners)[:,
                                                                         None]
  return bounds.astype(np.int32), segments, owners.astype(np.int32), crossed
