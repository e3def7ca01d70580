"""Every kernel variant goes through the Pallas -> Triton lowering for an H200.

Runs on the CPU: `jax.jit(...).lower(lowering_platforms=("cuda",))` under an
abstract mesh whose device is an "NVIDIA H200" builds the Triton IR of every
kernel exactly as on the GPU machine, so an op the Triton lowering lacks, a
wrong tile shape or a bad index fails here instead of on the H200. (Triton's own
compilation to PTX happens when XLA compiles on a GPU; that still needs one.)
"""
import dataclasses
import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

import jax_flash
from tests.lowering import (H200, TRITON_BACKWARD, lower_decode,
                            lower_grad)

B, T, S, N, K = 2, 300, 250, 8, 2


def _lower(dtype, head_dim, version=2, bias_shape=None, **kwargs):
  q = jax.ShapeDtypeStruct((B, T, N, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, head_dim), dtype)
  bias = None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape,
                                                              jnp.float32)

  def loss(q, k, v, bias):
    out = jax_flash.flash_attention(q, k, v, bias, implementation="triton",
                                    version=version, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(
        q, kv, kv, bias).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
# 320 and 512: lowered here and interpreted (tests/test_correctness.py), not
# yet compiled for a GPU, so only implementation="triton" picks them.
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256, 320, 512])
def test_core_kernels_lower(dtype, head_dim):
  text = _lower(dtype, head_dim, is_causal=True)
  for name in ("flash_attention_forward", "flash_attention_backward_dkdv",
               "flash_attention_backward_dq"):
    assert name in text


SEGMENTS = jax.ShapeDtypeStruct((B, T), jnp.int32)


@pytest.mark.parametrize("name, kwargs", [
    ("window", dict(local_window_size=(64, 16))),
    ("lengths", dict(query_seq_lengths=jnp.array([10, T]),
                     key_value_seq_lengths=jnp.array([S, 3]))),
    ("segments", dict(segment_ids=(jnp.zeros((B, T), jnp.int32),
                                   jnp.zeros((B, S), jnp.int32)))),
    ("dense_mask", dict(mask=jnp.ones((B, 1, T, S), bool))),
    ("mask_row", dict(mask=jnp.ones((1, 1, 1, S), bool))),
    ("soft_cap", dict(logits_soft_cap=30.0)),
    ("alibi", dict(alibi_slopes=jnp.ones((N,)))),
    ("dropout", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))),
    ("dropout_broadcast", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0),
                               dropout_broadcast=True)),
    ("everything", dict(is_causal=True, local_window_size=(128, 0),
                        key_value_seq_lengths=jnp.array([S, 7]),
                        mask=jnp.ones((1, N, T, S), bool),
                        logits_soft_cap=30.0, alibi_slopes=jnp.ones((B, N)),
                        dropout_rate=0.1, dropout_rng=jax.random.key(0))),
])
@pytest.mark.parametrize("version", [2, 1])
def test_variant_kernels_lower(name, kwargs, version):
  text = _lower(jnp.bfloat16, 64, version, **kwargs)
  forward = ("flash_attention_forward_v1" if version == 1 else
             "flash_attention_forward")
  assert forward in text and "flash_attention_backward_dq" in text


@pytest.mark.parametrize("bias_shape", [(B, N, T, S), (B, 1, 1, S),
                                        (1, N, T, 1), (1, 1, 1, 1), (T, S)])
def test_bias_kernels_lower(bias_shape):
  text = _lower(jnp.bfloat16, 128, bias_shape=bias_shape, is_causal=True)
  assert "flash_attention_backward_dbias" in text


# Paged: pages of 256 rows (two key tiles a page), 64 (one) and 16 (four
# a tile, one gather, or a load and a dot a page with `page_dots`); their
# page ids read in the tile's iteration or two tiles ahead.
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("paged", [None, 256, 64, 16, "16_page_dots"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_kernel_lowers(paged, dtype, prefetch, monkeypatch):
  from pallas_kernels.triton import config
  tiling = config.decode_blocks
  page_dots = paged == "16_page_dots"  # Its pages a load and a dot each.
  paged = 16 if page_dots else paged
  monkeypatch.setattr(config, "decode_blocks", lambda *a: dataclasses.replace(
      tiling(*a), prefetch_pages=prefetch, num_stages=2 + prefetch,
      page_dots=page_dots))
  q = jax.ShapeDtypeStruct((4, 2, 8, 128), dtype)
  lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
  if paged:
    pages = jax.ShapeDtypeStruct((4096 // paged, paged, 2, 128), dtype)
    table = jax.ShapeDtypeStruct((4, 1024 // paged), jnp.int32)
    f = lambda q, n, p, t: jax_flash.flash_decode(
        q, kv_lengths=n, key_pages=p, value_pages=p, page_table=t,
        implementation="triton", logits_soft_cap=30.0)
    args = (q, lengths, pages, table)
  else:
    cache = jax.ShapeDtypeStruct((4, 1000, 2, 128), dtype)
    f = lambda q, n, c: jax_flash.flash_decode(
        q, c, c, kv_lengths=n, implementation="triton", local_window_size=256)
    args = (q, lengths, cache)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_decode" in text
  # 8 query rows (T = 2, 4 heads a group) in the kernel's 16-row block: read
  # masked past the end, not padded by a copy of their own.
  assert "stablehlo.pad" not in text


def test_sinks_lower():
  text = _lower(jnp.bfloat16, 128, is_causal=True, sinks=jnp.zeros((N,)))
  assert "flash_attention_forward" in text


def test_value_head_dim_of_its_own_lowers():
  q = jax.ShapeDtypeStruct((B, T, N, 192), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, S, K, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((B, S, K, 128), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(jax_flash.flash_attention(
      q, k, v, is_causal=True, implementation="triton").astype(jnp.float32))
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_backward_dkdv" in text


@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_decode_of_a_prompt_chunk_lowers(page_size):
  """More than 64 new tokens: the training kernel with query offsets; a
  paged cache gathered into a contiguous one first (pages smaller and
  larger than the kernel's key tile)."""
  text = lower_decode("triton", 256, page_size)
  assert "flash_attention_forward" in text
  assert ("stablehlo.gather" in text) == (page_size is not None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_flex_attention_kernels_lower(dtype):
  """A mask_mod and a score_mod that close over no array, traced into the
  forward, dK/dV and dQ kernels; the tile ranges from the block mask."""
  q = jax.ShapeDtypeStruct((B, T, N, 64), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, 64), dtype)

  def loss(q, k, v):
    block_mask = jax_flash.create_block_mask(
        lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 100 * (h + 1)), None, N,
        T, S, block_size=64)
    out = jax_flash.flex_attention(
        q, k, v, lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0),
        block_mask, implementation="triton")
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("flash_attention_forward", "flash_attention_backward_dkdv",
               "flash_attention_backward_dq"):
    assert name in text


def test_flex_mask_mod_reading_a_traced_array_lowers():
  """Document ids closed over by the mask_mod (a traced argument, [B, T]):
  the kernels read them through a ref, one gather per index tile."""
  q = jax.ShapeDtypeStruct((B, T, N, 64), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def loss(q, k, v, ids):
    block_mask = jax_flash.create_block_mask(
        lambda b, h, qi, ki: (qi >= ki) & (ids[b, qi] == ids[b, ki]), B, None,
        T, T, block_size=64)
    out = jax_flash.flex_attention(q, k, v, block_mask=block_mask,
                                   implementation="triton")
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, q, q, ids).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("flash_attention_forward", "flash_attention_backward_dkdv",
               "flash_attention_backward_dq"):
    assert name in text


def test_score_mod_reading_a_table_gets_tiles_that_fit():
  """A relative-bias table read by a score_mod (a float32 tile gathered per
  key tile): key tiles of 64 in 2 stages on the Triton kernels; head dim
  128's non-causal 128 x 128 tiles in 3 stages asked the H200 for 360448
  bytes of shared memory at 16k (2026-12-01). Without a table, the default."""
  t = 4096
  q = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)
  table = jnp.linspace(-1.0, 1.0, 2 * t)
  block_mask = jax_flash.create_block_mask(lambda b, h, qi, ki: qi >= ki,
                                           None, None, t, t)

  def tiles(score_mod):
    f = lambda q, k, v: jax_flash.flex_attention(q, k, v, score_mod,
                                                 block_mask,
                                                 implementation="triton")
    with jax.sharding.use_abstract_mesh(
        mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
      jaxpr = jax.make_jaxpr(f)(q, q, q)
    (cfg,) = [e.params["cfg"] for e in jaxpr.eqns if "cfg" in e.params]
    return cfg.configs.forward.block_k, cfg.configs.forward.num_stages

  assert tiles(lambda s, b, h, qi, ki: s + table[qi - ki + t]) == (64, 2)
  assert tiles(lambda s, b, h, qi, ki: s * 0.5) == (128, 3)


@pytest.mark.parametrize("head_dim", [320, 512])
def test_head_dims_above_256_run_triton_by_default(head_dim):
  """The default on an H200 runs head dims 257..512 on the Triton kernels,
  forward and backward (the Mosaic kernels stop at 256)."""
  text = lower_grad(None, (B, T, S, N, K, head_dim), is_causal=True)
  assert "mosaic_gpu" not in text
  assert all(name in text for name in ("flash_attention_forward",)
             + TRITON_BACKWARD)
