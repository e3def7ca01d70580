"""Masks: the tile classification against brute force, and the kernels
against the reference for every mask kind, their combinations, and rows that
see no key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close
from jax_flash.core import mask as mask_lib
from jax_flash.core.prepare import masks_as_ids, prepare, with_dense_kinds
from tests.cases import compare_with_reference, jax_nn_attention, random_inputs
from tests.conftest import KERNEL_IMPL

BANDS = [mask_lib.Mask(), mask_lib.Mask(is_causal=True),
         mask_lib.Mask(window_left=5, window_right=3),
         mask_lib.Mask(window_left=40, window_right=None),
         mask_lib.Mask(window_left=None, window_right=17),
         mask_lib.Mask(is_causal=True, window_left=20),
         mask_lib.Mask(window_left=0, window_right=0)]


def _tile_classes(dense, r0, block_rows, block_cols, num_tiles,
                  short_tile_can_be_full=False):
  """Brute force: for each column tile, 'skip', 'full' or 'partial'.

  A last tile shorter than block_cols is 'partial' unless
  `short_tile_can_be_full` (its missing columns are padding that adds nothing).
  """
  classes = []
  rows = dense[r0:r0 + block_rows]
  for j in range(num_tiles):
    tile = rows[:, j * block_cols:(j + 1) * block_cols]
    whole = short_tile_can_be_full or tile.shape[1] == block_cols
    classes.append("skip" if not tile.any() else
                   "full" if tile.all() and whole else "partial")
  return classes


def _check_ranges(ranges, classes, tight=True):
  lo, full_lo, full_hi, hi = (int(x) for x in ranges)
  assert 0 <= lo <= full_lo <= full_hi <= hi <= len(classes)
  for j, c in enumerate(classes):
    if c != "skip":  # Every tile with a visible pair is visited ...
      assert lo <= j < hi, (j, c, ranges)
    if full_lo <= j < full_hi:  # ... and only truly full tiles skip the mask.
      assert c == "full", (j, c, ranges)
  if tight:  # Band masks: nothing visited needlessly, every full tile found.
    visited = [j for j, c in enumerate(classes) if c != "skip"]
    full = [j for j, c in enumerate(classes) if c == "full"]
    assert (lo, hi) == ((visited[0], visited[-1] + 1) if visited else (lo, lo))
    if full:
      assert (full_lo, full_hi) == (full[0], full[-1] + 1)


# Query offsets: 0 (training) and queries sitting after cached keys (decode,
# chunked prefill).
OFFSETS = [0, 45]


@pytest.mark.parametrize("mask", BANDS, ids=str)
@pytest.mark.parametrize("q_len, kv_len, block_q, block_k",
                         [(100, 90, 16, 32), (64, 64, 32, 16), (37, 130, 16, 16),
                          (100, 96, 16, 32)])
@pytest.mark.parametrize("q_offset", OFFSETS)
def test_kv_block_ranges_match_brute_force(mask, q_len, kv_len, block_q,
                                           block_k, q_offset):
  num_tiles = -(-kv_len // block_k)
  for r0 in range(0, q_len, block_q):
    ranges = mask_lib.kv_block_ranges(mask, r0, block_q, block_k, kv_len,
                                      q_offset)
    # Rows past q_len count like the kernels treat them (never stored).
    rows = np.arange(r0, r0 + block_q)[:, None]
    cols = np.arange(kv_len)[None, :]
    tile_rows = np.asarray(mask.visible(rows, cols, kv_len,
                                        q_offset=q_offset))
    classes = _tile_classes(tile_rows, 0, block_q, block_k, num_tiles)
    _check_ranges(ranges, classes)
    # A partial range the static mask rules out is empty (its loop unemitted).
    leading, trailing = mask_lib.kv_partial_ends(mask, block_k, kv_len)
    lo, full_lo, full_hi, hi = (int(x) for x in ranges)
    assert leading or full_lo == lo, ranges
    assert trailing or full_hi == hi, ranges


@pytest.mark.parametrize("mask", BANDS, ids=str)
@pytest.mark.parametrize("q_len, kv_len, block_q, block_k",
                         [(100, 90, 16, 32), (64, 64, 32, 16), (130, 37, 16, 16)])
@pytest.mark.parametrize("q_offset", OFFSETS)
def test_q_block_ranges_match_brute_force(mask, q_len, kv_len, block_q,
                                          block_k, q_offset):
  num_tiles = -(-q_len // block_q)
  for c0 in range(0, kv_len, block_k):
    ranges = mask_lib.q_block_ranges(mask, c0, block_k, block_q, q_len,
                                     q_offset)
    cols = np.arange(c0, c0 + block_k)[:, None]  # Key rows, query columns.
    rows = np.arange(q_len)[None, :]
    # Keys past kv_len and queries past q_len add nothing in the dK/dV
    # kernel: only real pairs count.
    vis = np.broadcast_to(mask.visible(rows, cols, np.iinfo(np.int32).max,
                                       q_offset=q_offset), (block_k, q_len))
    classes = _tile_classes(vis[:max(0, min(block_k, kv_len - c0))], 0,
                            block_k, block_q, num_tiles,
                            short_tile_can_be_full=True)
    _check_ranges(ranges, classes, tight=False)


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_id_block_table_is_safe(sorted_ids):
  rng = np.random.default_rng(0)
  q_ids = rng.integers(0, 5, (3, 75))
  kv_ids = rng.integers(0, 5, (3, 66))
  if sorted_ids:
    q_ids, kv_ids = np.sort(q_ids, 1), np.sort(kv_ids, 1)
  q_ids[1, 40:] = mask_lib.Q_PAD_ID  # A query length.
  kv_ids[2, 10:] = mask_lib.KV_PAD_ID  # A key length.
  table = np.asarray(mask_lib.id_block_table(jnp.asarray(q_ids),
                                            jnp.asarray(kv_ids), 16, 8))
  for b in range(3):
    dense = q_ids[b][:, None] == kv_ids[b][None, :]
    for i in range(table.shape[1]):
      classes = _tile_classes(dense, i * 16, 16, 8, -(-66 // 8),
                              short_tile_can_be_full=True)
      _check_ranges(table[b, i], classes, tight=False)
  if sorted_ids:  # Packed documents: some tiles are skipped, some are full.
    lo, full_lo, full_hi, hi = table[0].T
    assert (hi - lo).sum() < table.shape[1] * -(-66 // 8)
    assert (full_hi - full_lo).sum() > 0


def _segments(b, n, num, seed, packed=True):
  ids = jax.random.randint(jax.random.key(seed), (b, n), 0, num)
  return jnp.sort(ids, axis=1) if packed else ids


B, T, S, N, K, H = 2, 100, 90, 4, 2, 32
Q_SEG, KV_SEG = _segments(B, T, 4, 1), _segments(B, S, 4, 2)
MASK_KWARGS = {
    "window": dict(local_window_size=(7, 3)),
    "window_int_causal": dict(local_window_size=5, is_causal=True),
    "window_left_only": dict(local_window_size=(30, None)),
    "lengths": dict(query_seq_lengths=jnp.array([50, 100]),
                    key_value_seq_lengths=jnp.array([90, 1])),
    "lengths_zero": dict(query_seq_lengths=jnp.array([0, 3]),
                         key_value_seq_lengths=jnp.array([5, 0])),
    "segments": dict(segment_ids=(Q_SEG, KV_SEG)),
    "segments_unsorted": dict(segment_ids=(_segments(B, T, 3, 3, False),
                                           _segments(B, S, 3, 4, False))),
    "segments_causal_lengths": dict(segment_ids=(Q_SEG, KV_SEG),
                                    is_causal=True,
                                    key_value_seq_lengths=jnp.array([33, 90])),
    "segments_window_lengths": dict(segment_ids=(Q_SEG, KV_SEG),
                                    local_window_size=(20, 20),
                                    query_seq_lengths=jnp.array([70, 1])),
    # Queries at offsets (T=100 over S=90: S - T = -10 aligns bottom-right).
    "offset_bottom_right": dict(is_causal=True, query_offset=S - T),
    "offset_per_sequence_window": dict(
        local_window_size=(20, 4), query_offset=jnp.array([5, 40]),
        key_value_seq_lengths=jnp.array([90, 61])),
    "offset_causal_segments": dict(segment_ids=(Q_SEG, KV_SEG),
                                   is_causal=True,
                                   query_offset=jnp.array([3, 0])),
}


def _compare(kwargs, dtype=jnp.float32, version=2, shape=(B, T, S, N, K, H)):
  return compare_with_reference(kwargs, dtype, version, shape)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("name", MASK_KWARGS)
def test_mask_matches_reference(name, implementation):
  compare_with_reference(MASK_KWARGS[name], implementation=implementation)


@pytest.mark.parametrize("name", ["window_int_causal", "lengths_zero",
                                  "segments_causal_lengths"])
def test_mask_version1_matches_reference(name):
  _compare(MASK_KWARGS[name], version=1)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_query_offset_is_a_chunk_of_the_whole_call(implementation):
  """Queries [a, a + T) of a causal self-attention call, run alone with
  query_offset=a against every key (a chunked prefill), give the whole
  call's rows: outputs, logsumexp and the chunk's dq, with ALiBi and
  dropout, whose bits are drawn at the queries' positions."""
  q, k, v, _ = random_inputs(2, 96, 96, 4, 2, 32, jnp.float32)
  kwargs = dict(is_causal=True, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4]),
                dropout_rate=0.25, dropout_rng=jax.random.key(3),
                local_window_size=(40, None), return_residual=True,
                implementation=implementation)
  start, size = 40, 24
  chunk = lambda x: x[:, start:start + size]
  loss = lambda out: jnp.sum(jnp.sin(out[0]))
  out_whole = jax_flash.flash_attention(q, k, v, **kwargs)
  out_part = jax_flash.flash_attention(chunk(q), k, v, query_offset=start,
                                       **kwargs)
  assert_attention_close(out_part, jax.tree.map(chunk, out_whole))
  dq_whole = jax.grad(lambda q: loss(jax_flash.flash_attention(
      q, k, v, **kwargs)))(q)
  dq_part = jax.grad(lambda c: loss(jax_flash.flash_attention(
      c, k, v, query_offset=start, **kwargs)))(chunk(q))
  # The chunk's rows reach the loss only through themselves.
  assert_attention_close(dq_part, chunk(dq_whole))


def test_mask_bfloat16_gqa_unaligned():
  kwargs = dict(segment_ids=(_segments(1, 255, 5, 7), _segments(1, 300, 5, 8)),
                local_window_size=(64, 16), is_causal=True)
  _compare(kwargs, jnp.bfloat16, shape=(1, 255, 300, 8, 2, 80))


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("name", ["lengths", "lengths_zero",
                                  "segments_causal_lengths"])
def test_garbage_past_lengths_never_reaches_a_result(name, implementation):
  """Queries and keys/values past their lengths hold NaN: outputs and
  gradients equal the reference's on zero padding."""
  compare_with_reference(MASK_KWARGS[name], implementation=implementation,
                         garbage=True)


def test_fully_masked_batch_has_zero_output_and_gradients():
  kwargs = dict(key_value_seq_lengths=jnp.array([0, 90]))
  empty = _compare(kwargs)
  assert empty[0].all() and not empty[1].any()


def test_mask_matches_jax_nn_where_rows_see_keys():
  q, k, v, _ = random_inputs(B, T, S, N, K, H, jnp.float32)
  for kwargs in (dict(local_window_size=(7, 3)),
                 dict(query_seq_lengths=jnp.array([50, 100]),
                      key_value_seq_lengths=jnp.array([90, 20]))):
    ours, lse = jax_flash.flash_attention(
        q, k, v, implementation=KERNEL_IMPL, return_residual=True, **kwargs)
    theirs = jax_nn_attention(q, k, v, **kwargs)
    # jax.nn gives rows that see no key (and padded queries) some output;
    # ours gives 0 there. Compare where a row sees keys.
    sees = jnp.isfinite(lse)[..., None]
    if "query_seq_lengths" in kwargs:
      valid = jnp.arange(T)[None, :] < kwargs["query_seq_lengths"][:, None]
      sees = sees & valid[:, :, None, None]
    assert sees.sum() > sees.size // 2
    assert_attention_close(jnp.where(sees, ours, 0),
                           jnp.where(sees, theirs, 0))


# Padding masks (varying along one sequence axis only) become ids
# (`core.prepare.masks_as_ids`): tile skipping instead of a mask tile read
# everywhere. The reference keeps them dense: the two must agree.
_KEEP_KEYS = jax.random.bernoulli(jax.random.key(21), 0.7, (B, 1, 1, S))
_KEEP_ROWS = jax.random.bernoulli(jax.random.key(22), 0.8, (B, 1, T, 1))
PADDING_MASKS = {
    "keys": dict(mask=_KEEP_KEYS),
    "keys_broadcast_batch": dict(mask=_KEEP_KEYS[:1], is_causal=True),
    "rows": dict(mask=_KEEP_ROWS),
    "one_per_batch": dict(mask=jnp.array([True, False]).reshape(B, 1, 1, 1)),
    "keys_with_segments_lengths": dict(
        mask=_KEEP_KEYS, segment_ids=(Q_SEG, KV_SEG), is_causal=True,
        key_value_seq_lengths=jnp.array([33, 90])),
}


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("name", PADDING_MASKS)
def test_padding_masks_match_the_dense_reference(name, implementation):
  compare_with_reference(PADDING_MASKS[name], implementation=implementation)


def test_padding_masks_become_ids_and_others_stay_dense():
  q, k, v, _ = random_inputs(B, T, S, N, K, H, jnp.float32)
  spec = masks_as_ids(prepare(q, k, v, mask=_KEEP_KEYS))
  assert spec.mask.has_ids and not spec.mask.has_dense
  assert spec.operands.dense_mask is None
  np.testing.assert_array_equal(
      np.asarray(spec.operands.kv_ids) == mask_lib.KV_PAD_ID,
      ~np.asarray(_KEEP_KEYS[:, 0, 0, :]))
  for shape in ((B, 1, T, S), (1, N, 1, S)):  # Per pair, or per head.
    dense = jnp.ones(shape, bool)
    spec = masks_as_ids(prepare(q, k, v, mask=dense))
    assert spec.mask.has_dense and not spec.mask.has_ids


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_nan_at_masked_keys_reaches_nothing(implementation):
  """A key padding mask over keys holding NaN (a padded batch): outputs and
  gradients finite and equal to the reference's on zeros there."""
  q, k, v, do = random_inputs(B, T, S, N, K, H, jnp.float32)
  masked = ~_KEEP_KEYS[:, 0, 0, :, None, None]
  poison = lambda x: jnp.where(masked, jnp.nan, x)

  def grads(attention, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(attention(
        q, k, v, mask=_KEEP_KEYS) * do), argnums=(0, 1, 2))(q, k, v)
  got = grads(functools.partial(jax_flash.flash_attention,
                                implementation=implementation),
              poison(k), poison(v))
  ref = grads(jax_flash.reference_attention, k, v)
  for g in got:
    assert np.isfinite(np.asarray(g)).all()
  assert_attention_close(dict(zip(("dq", "dk", "dv"), got)),
                         dict(zip(("dq", "dk", "dv"), ref)))


@pytest.mark.parametrize("kwargs, segments_only", [
    (dict(segment_ids=jnp.zeros((B, T), jnp.int32)), True),
    (dict(segment_ids=jnp.zeros((B, T), jnp.int32),
          key_value_seq_lengths=jnp.full((B,), T - 10)), False),
    (dict(query_seq_lengths=jnp.full((B,), T - 10),
          key_value_seq_lengths=jnp.full((B,), T - 10)), False),
    (dict(segment_ids=jnp.zeros((B, T), jnp.int32),
          mask=jnp.arange(T)[None, None, None] < T - 10), False),
], ids=["segments", "segments_lengths", "lengths", "segments_key_mask"])
def test_padding_is_zeroed_only_where_ids_mark_it(kwargs, segments_only):
  """Segment ids alone mark no position as padding: q, k, v pass through
  untouched (no elementwise pass over them); with lengths or a padding mask
  folded into the ids, exactly the keys past them are zeroed."""
  q, k, v, _ = random_inputs(B, T, T, N, K, H, jnp.float32)
  spec = masks_as_ids(prepare(q, k, v, **kwargs))
  assert spec.mask.segments_only == segments_only
  ops = spec.operands
  nan = jnp.full_like(k, jnp.nan)
  (q2,), (k2, v2) = mask_lib.without_padding(spec.mask, ops.q_ids,
                                             ops.kv_ids, (q,), (nan, v))
  if segments_only:
    assert q2 is q and k2 is nan and v2 is v
  else:
    pad = np.asarray(ops.kv_ids == mask_lib.KV_PAD_ID)
    assert pad.any() and not pad.all()
    k2 = np.asarray(k2)
    assert (k2[pad] == 0).all() and np.isnan(k2[~pad]).all()


def _brute_kinds(dense, q_len, kv_len, tile):
  """Brute force of `mask.dense_tile_kinds`: [Bm, R, C] kinds."""
  dense = np.broadcast_to(np.asarray(dense) != 0,
                          np.asarray(dense).shape[:2] + (q_len, kv_len))
  rows, cols = -(-q_len // tile), -(-kv_len // tile)
  kinds = np.zeros((dense.shape[0], rows, cols), np.int8)
  for b in range(dense.shape[0]):
    for r in range(rows):
      for c in range(cols):
        block = np.zeros((dense.shape[1], tile, tile), bool)
        part = dense[b, :, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
        block[:, :part.shape[1], :part.shape[2]] = part
        kinds[b, r, c] = (mask_lib.FULL if block.all() else
                          mask_lib.PARTIAL if block.any() else mask_lib.EMPTY)
  return kinds


@pytest.mark.parametrize("shape", [(2, 1, 100, 90), (1, 3, 100, 90),
                                   (2, 2, 1, 90), (1, 2, 100, 1),
                                   (1, 1, 1, 1)])
def test_dense_tile_kinds_match_brute_force(shape):
  """Causal-with-padding-like structure (empty, full and partial tiles),
  per head, broadcast rows or columns; tiles past the end are partial."""
  q_len, kv_len, tile = 100, 90, 16
  rows = jnp.arange(shape[2])[:, None] * (shape[2] > 1)
  cols = jnp.arange(shape[3])[None] * (shape[3] > 1)
  heads = jnp.arange(shape[1])[:, None, None]
  dense = jnp.broadcast_to((cols <= rows + 7 * heads) & (cols < 70), shape)
  got = mask_lib.dense_tile_kinds(dense, q_len, kv_len, tile)
  np.testing.assert_array_equal(got, _brute_kinds(dense, q_len, kv_len, tile))
  if shape == (2, 1, 100, 90):
    assert {int(x) for x in np.unique(got)} == {mask_lib.EMPTY,
                                                 mask_lib.PARTIAL,
                                                 mask_lib.FULL}


# A dense mask with structure: its empty tiles skipped, its full ones
# spared the mask tile (`core.prepare.with_dense_kinds`). Long enough for
# whole 64 x 64 tiles of each kind.
T2, S2 = 256, 200
_CAUSAL_PADDED = (jnp.arange(S2)[None] <= jnp.arange(T2)[:, None] + 10) & (
    jnp.arange(S2)[None] < 150)
STRUCTURED_MASKS = {
    "causal_padding": dict(mask=_CAUSAL_PADDED[None, None]),
    "per_batch_with_lengths": dict(
        mask=jnp.stack([_CAUSAL_PADDED, ~_CAUSAL_PADDED])[:, None],
        key_value_seq_lengths=jnp.array([200, 130]), is_causal=True),
    "per_head_with_window": dict(
        mask=jnp.stack([_CAUSAL_PADDED, ~_CAUSAL_PADDED,
                        jnp.ones((T2, S2), bool), _CAUSAL_PADDED])[None],
        local_window_size=(100, 100)),
}


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("name", STRUCTURED_MASKS)
def test_structured_dense_masks_match_the_reference(name, implementation):
  compare_with_reference(STRUCTURED_MASKS[name], shape=(B, T2, S2, N, K, H),
                         implementation=implementation)


def test_dense_masks_carry_their_tile_kinds():
  q, k, v, _ = random_inputs(B, T2, S2, N, K, H, jnp.float32)
  spec = with_dense_kinds(masks_as_ids(prepare(
      q, k, v, mask=_CAUSAL_PADDED[None, None])))
  assert spec.mask.has_dense and spec.mask.has_kinds
  assert spec.mask.mod is None
  kinds = np.asarray(spec.operands.tile_kinds)
  tile = mask_lib.DENSE_KINDS_TILE
  np.testing.assert_array_equal(
      kinds, _brute_kinds(_CAUSAL_PADDED[None, None], T2, S2, tile))
  # Every kind occurs: the kernels skip tiles and spare others the mask.
  assert set(np.unique(kinds)) == {mask_lib.EMPTY, mask_lib.PARTIAL,
                                   mask_lib.FULL}
  # Padding masks become ids first and get no kinds table.
  q, k, v, _ = random_inputs(B, T, S, N, K, H, jnp.float32)
  spec = with_dense_kinds(masks_as_ids(prepare(q, k, v, mask=_KEEP_KEYS)))
  assert not spec.mask.has_kinds and spec.operands.tile_kinds is None
