"""flash_decode: split-KV decoding against contiguous and paged caches."""
import dataclasses
import chex
import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.testing import assert_attention_close
from tests.conftest import KERNEL_IMPL


def _cache(b, t, s, n, k, h, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h)).astype(dtype)
  kc = jax.random.normal(ks[1], (b, s, k, h)).astype(dtype)
  vc = jax.random.normal(ks[2], (b, s, k, h)).astype(dtype)
  return q, kc, vc


def _paginate(cache, page_size, num_pages, seed, lengths):
  """Scatters [B, S, K, H] into pages in random order: (pages, page_table).

  Positions past each length and unused pages are NaN: poison the kernel
  must never let into a result.
  """
  b, s = cache.shape[:2]
  per_seq = -(-s // page_size)
  order = jax.random.permutation(jax.random.key(seed), num_pages)
  table = order[:b * per_seq].reshape(b, per_seq).astype(jnp.int32)
  padded = jnp.pad(cache, ((0, 0), (0, per_seq * page_size - s), (0, 0),
                           (0, 0)))
  live = jnp.arange(per_seq * page_size)[None] < lengths[:, None]
  padded = jnp.where(live[:, :, None, None], padded, jnp.nan)
  pages = jnp.full((num_pages, page_size) + cache.shape[2:], jnp.nan,
                   cache.dtype)  # Unused pages are poison: never read them.
  pages = pages.at[table.reshape(-1)].set(
      padded.reshape((b * per_seq, page_size) + cache.shape[2:]))
  return pages, table


def _reference(q, kc, vc, lengths, **kwargs):
  """The dense statement: reference_attention with the decode mask, written
  out here (query t of sequence b at position lengths[b] - T + t)."""
  t, s = q.shape[1], kc.shape[1]
  window = kwargs.pop("window_left", None)
  position = (lengths[:, None] - t + jnp.arange(t)[None])[:, :, None]
  cols = jnp.arange(s)[None, None, :]
  visible = (cols <= position) & (cols < lengths[:, None, None])
  if window is not None:
    visible = visible & (cols >= position - window)
  up = lambda x: x.astype(jnp.float32)
  return jax_flash.reference_attention(up(q), up(kc), up(vc),
                                       mask=visible[:, None],
                                       return_residual=True, **kwargs)


CASES = [  # b, t, s, n, k, h, dtype, lengths
    (3, 1, 300, 8, 2, 64, "float32", [300, 1, 130]),
    (2, 4, 257, 4, 4, 80, "float32", [257, 4]),
    (2, 16, 200, 8, 1, 128, "bfloat16", [200, 16]),
    (4, 2, 1000, 16, 4, 64, "bfloat16", [1000, 2, 999, 513]),
    (1, 3, 64, 2, 2, 256, "float16", [40]),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(case):
  b, t, s, n, k, h, dtype, lengths = case
  q, kc, vc = _cache(b, t, s, n, k, h, jnp.dtype(dtype))
  lengths = jnp.array(lengths)
  out, lse = jax_flash.flash_decode(q, kc, vc, kv_lengths=lengths,
                                    implementation=KERNEL_IMPL,
                                    return_residual=True)
  ref, ref_lse = _reference(q, kc, vc, lengths)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  assert_attention_close({"out": out, "lse": lse},
                         {"out": ref, "lse": ref_lse}, dtype)


@pytest.mark.parametrize("kwargs", [dict(num_splits=1), dict(num_splits=7),
                                    dict(local_window_size=37),
                                    dict(logits_soft_cap=3.0),
                                    dict(scale=0.3)], ids=str)
def test_decode_options(kwargs):
  q, kc, vc = _cache(3, 4, 300, 8, 2, 64, jnp.float32, seed=1)
  lengths = jnp.array([300, 7, 150])
  out = jax_flash.flash_decode(q, kc, vc, kv_lengths=lengths,
                               implementation=KERNEL_IMPL, **kwargs)
  ref_kwargs = dict(kwargs)
  ref_kwargs.pop("num_splits", None)
  if "local_window_size" in ref_kwargs:
    ref_kwargs["window_left"] = ref_kwargs.pop("local_window_size")
  ref, _ = _reference(q, kc, vc, lengths, **ref_kwargs)
  assert_attention_close(out, ref)


# 16/32: several pages a key tile (a gather); 64: one; 256: two tiles a page.
@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
def test_paged_cache_in_random_order(page_size):
  q, kc, vc = _cache(3, 2, 300, 8, 2, 64, jnp.float32, seed=2)
  lengths = jnp.array([300, 1, 200])
  kp, table = _paginate(kc, page_size, 64, 3, lengths)
  vp, _ = _paginate(vc, page_size, 64, 3, lengths)
  out = jax_flash.flash_decode(q, kv_lengths=lengths, key_pages=kp,
                               value_pages=vp, page_table=table,
                               implementation=KERNEL_IMPL)
  ref, _ = _reference(q, kc, vc, lengths)
  assert_attention_close(out, ref)
  # The XLA path gathers the same pages.
  xla = jax_flash.flash_decode(q, kv_lengths=lengths, key_pages=kp,
                               value_pages=vp, page_table=table,
                               implementation="xla")
  assert_attention_close(xla, ref)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_cache_with_page_ids_read_ahead(monkeypatch, page_size,
                                              prefetch):
  """Page ids read `prefetch_pages` tiles ahead of their tile: the same
  result, with splits starting mid-cache and read-ahead past a split's end
  and past the table (poisoned pages there); 16-token pages in one
  gathered load a tile (`page_dots` off; on in the test below)."""
  from pallas_kernels.triton import config
  tiling = config.decode_blocks
  monkeypatch.setattr(config, "decode_blocks", lambda *a: dataclasses.replace(
      tiling(*a), prefetch_pages=prefetch, page_dots=False))
  q, kc, vc = _cache(3, 2, 300, 8, 2, 64, jnp.float32, seed=6)
  lengths = jnp.array([300, 1, 200])
  kp, table = _paginate(kc, page_size, 64, 7, lengths)
  vp, _ = _paginate(vc, page_size, 64, 7, lengths)
  out = jax_flash.flash_decode(q, kv_lengths=lengths, key_pages=kp,
                               value_pages=vp, page_table=table, num_splits=3,
                               implementation=KERNEL_IMPL)
  ref, _ = _reference(q, kc, vc, lengths)
  assert_attention_close(out, ref)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_tiles_read_a_page_at_a_time(monkeypatch, page_size, prefetch):
  """`DecodeBlocks.page_dots`: a 64-row tile's pages loaded and multiplied
  one at a time give the gathered tile's result (pages in random order,
  poison in unused ones, splits starting mid-cache)."""
  from pallas_kernels.triton import config
  tiling = config.decode_blocks
  monkeypatch.setattr(config, "decode_blocks", lambda *a: dataclasses.replace(
      tiling(*a), block_k=64, prefetch_pages=prefetch, page_dots=True))
  q, kc, vc = _cache(3, 2, 300, 8, 2, 64, jnp.float32, seed=8)
  lengths = jnp.array([300, 1, 200])
  num_pages = 3 * -(-300 // page_size) + 7  # Some never used (poison).
  kp, table = _paginate(kc, page_size, num_pages, 9, lengths)
  vp, _ = _paginate(vc, page_size, num_pages, 9, lengths)
  out = jax_flash.flash_decode(q, kv_lengths=lengths, key_pages=kp,
                               value_pages=vp, page_table=table, num_splits=3,
                               implementation=KERNEL_IMPL)
  ref, _ = _reference(q, kc, vc, lengths)
  assert_attention_close(out, ref)


def test_single_query_sees_the_whole_cache():
  q, kc, vc = _cache(2, 1, 100, 4, 2, 32, jnp.float32, seed=4)
  lengths = jnp.array([100, 37])
  out = jax_flash.flash_decode(q, kc, vc, kv_lengths=lengths,
                               implementation=KERNEL_IMPL)
  for b, n in enumerate([100, 37]):
    ref = jax_flash.reference_attention(q[b:b + 1], kc[b:b + 1, :n],
                                        vc[b:b + 1, :n])
    assert_attention_close(out[b:b + 1], ref)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
def test_decode_with_sinks(implementation):
  q, kc, vc = _cache(3, 2, 300, 8, 2, 64, jnp.float32, seed=5)
  lengths = jnp.array([300, 1, 150])
  sinks = jnp.linspace(-2.0, 3.0, 8)
  out, lse = jax_flash.flash_decode(q, kc, vc, kv_lengths=lengths,
                                    sinks=sinks, implementation=implementation,
                                    return_residual=True)
  ref, ref_lse = _reference(q, kc, vc, lengths, sinks=sinks)
  assert_attention_close({"out": out, "lse": lse},
                         {"out": ref, "lse": ref_lse})


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_with_a_value_head_dim_of_its_own(implementation, paged):
  q, kc, _ = _cache(2, 3, 200, 8, 2, 64, jnp.float32, seed=6)
  vc = jax.random.normal(jax.random.key(13), (2, 200, 2, 40))
  lengths = jnp.array([200, 77])
  kwargs = dict(key_cache=kc, value_cache=vc)
  if paged:
    kp, table = _paginate(kc, 16, 40, 3, lengths)
    vp, _ = _paginate(vc, 16, 40, 3, lengths)
    kwargs = dict(key_pages=kp, value_pages=vp, page_table=table)
  out = jax_flash.flash_decode(q, kv_lengths=lengths,
                               implementation=implementation, **kwargs)
  ref, _ = _reference(q, kc, vc, lengths)
  chex.assert_shape(out, (2, 3, 8, 40))
  assert_attention_close(out, ref)


def _poisoned_cache(kc, vc, lengths, paged: bool, num_pages: int):
  """flash_decode's cache arguments holding NaN past each length: the
  contiguous cache, or 16-token pages in random order (unused ones NaN)."""
  if paged:
    kp, table = _paginate(kc, 16, num_pages, 4, lengths)
    vp, _ = _paginate(vc, 16, num_pages, 4, lengths)
    return dict(key_pages=kp, value_pages=vp, page_table=table)
  live = (jnp.arange(kc.shape[1])[None] < lengths[:, None])[:, :, None, None]
  return dict(key_cache=jnp.where(live, kc, jnp.nan),
              value_cache=jnp.where(live, vc, jnp.nan))


def _check_new_tokens(implementation, q_len, paged, *, s, head_dim, dtype,
                      num_pages, **options):
  """flash_decode of q_len new tokens (ragged lengths, NaN past them, GQA,
  sinks, a window of 150, `options`) against the dense reference."""
  q, kc, vc = _cache(2, q_len, s, 8, 2, head_dim, dtype, seed=q_len)
  lengths = jnp.array([s, q_len + 37])
  kwargs = _poisoned_cache(kc, vc, lengths, paged, num_pages)
  sinks = jnp.linspace(-1.0, 1.0, 8)
  out, lse = jax_flash.flash_decode(
      q, kv_lengths=lengths, implementation=implementation, sinks=sinks,
      local_window_size=150, return_residual=True, **options, **kwargs)
  ref, ref_lse = _reference(q, kc, vc, lengths, sinks=sinks, window_left=150,
                            **options)
  assert_attention_close({"out": out, "lse": lse},
                         {"out": ref, "lse": ref_lse}, dtype)


@pytest.mark.parametrize("implementation", [KERNEL_IMPL, "xla"])
@pytest.mark.parametrize("q_len", [1, 7, 64, 65, 300])
@pytest.mark.parametrize("paged", [False, True])
def test_any_number_of_new_tokens(implementation, q_len, paged):
  """One token to a prompt chunk (split-KV kernel up to 64, the training
  kernel with query offsets past it), contiguous or paged (pages in random
  order, NaN in every unused slot)."""
  _check_new_tokens(implementation, q_len, paged, s=400, head_dim=32,
                    dtype=jnp.float32, num_pages=64)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_long_prompt_chunk_by_default(paged):
  """2048 new tokens against a 4096-token cache (16-token pages in random
  order, NaN in unused slots), bf16, the default dispatch: the Mosaic
  forward with query offsets on an H100/H200, Triton's elsewhere."""
  _check_new_tokens("pallas", 2048, paged, s=4096, head_dim=128,
                    dtype=jnp.bfloat16, num_pages=600)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [65, 300])
@pytest.mark.parametrize("paged", [False, True])
def test_mosaic_decodes_a_prompt_chunk(q_len, paged):
  """The Mosaic forward with query offsets (an H100/H200), bf16, a
  soft-cap too."""
  _check_new_tokens("mosaic", q_len, paged, s=1000, head_dim=128,
                    dtype=jnp.bfloat16, num_pages=160, logits_soft_cap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len", [1, 7, 16])
def test_mosaic_decodes_a_few_tokens(q_len, head_dim):
  """flash_decode(implementation="mosaic") of a few new tokens against a
  contiguous cache: the Mosaic split-KV kernel (tiles of both KV heads up
  to 64 query rows, of one past them: 16 tokens x 8 heads), bf16, ragged
  lengths, NaN past them, sinks, a window, a soft-cap."""
  _check_new_tokens("mosaic", q_len, False, s=1000, head_dim=head_dim,
                    dtype=jnp.bfloat16, num_pages=0, logits_soft_cap=30.0)


MOSAIC_SPLIT_KV_CASES = {  # b, t, s, n, k, h, lengths, CTAs, options
    "h128_gqa_ragged": (3, 1, 1000, 16, 4, 128, [1000, 1, 517], 5, {}),
    "h64_window_soft_cap_sinks": (2, 3, 520, 8, 2, 64, [520, 40], 3,
                                  dict(window=100, soft_cap=30.0,
                                       sinks=True)),
    "h256_mqa": (2, 1, 264, 8, 1, 256, [264, 130], None, {}),
    "h128_k8_t2": (2, 2, 704, 16, 8, 128, [704, 333], 7, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("all_heads", [False, True])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", MOSAIC_SPLIT_KV_CASES)
def test_mosaic_split_kv_decode_matches_reference(name, stages, all_heads,
                                                  consumers):
  """The Mosaic GPU split-KV decode kernel, its options by name: tiles of
  one KV head or of all, one or two consumer warpgroups, a few CTAs (each
  run crossing sequences and heads) or the default one a multiprocessor;
  bf16, NaN in the cache past each length, against the dense reference."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu import flash_decode as mosaic_decode
  b, t, s, n, k, h, lengths, ctas, opts = MOSAIC_SPLIT_KV_CASES[name]
  if h == 256 and consumers == 2:
    pytest.skip("two consumers' outputs at head dim 256 exceed shared "
                "memory (test_mosaic_lowering checks the error)")
  q, kc, vc = _cache(b, t, s, n, k, h, jnp.bfloat16, seed=t)
  lengths = jnp.array(lengths)
  cache = _poisoned_cache(kc, vc, lengths, False, 0)
  sinks = jnp.linspace(-1.0, 1.0, n) if opts.get("sinks") else None
  out, lse = jax.jit(lambda q, kc, vc: mosaic_decode.flash_decode(
      q, kc, vc, lengths, scores=Scores(scale=h ** -0.5,
                                        soft_cap=opts.get("soft_cap")),
      mask=Mask(is_causal=True, window_left=opts.get("window")),
      num_ctas=ctas, num_stages=stages,
      heads_per_cta=k if all_heads else 1, consumers=consumers,
      sinks=sinks))(
          q, cache["key_cache"], cache["value_cache"])
  ref_kwargs = dict(window_left=opts.get("window"))
  if opts.get("soft_cap"):
    ref_kwargs["logits_soft_cap"] = opts["soft_cap"]
  if sinks is not None:
    ref_kwargs["sinks"] = sinks
  ref, ref_lse = _reference(q, kc, vc, lengths, **ref_kwargs)
  assert_attention_close({"out": out, "lse": lse.transpose(0, 2, 1)},
                         {"out": ref, "lse": ref_lse}, jnp.bfloat16)
