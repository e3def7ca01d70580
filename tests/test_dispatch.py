"""Which backend and which defaults a call gets on a Hopper GPU, decided
on the CPU: the dispatch's choices, the Mosaic kernels' default tiles and
variants, and the errors that say why a backend cannot take a call."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.core.mask import Mask
from jax_flash.core.problem import Problem
from jax_flash.core.scores import Scores
from pallas_kernels.mosaic_gpu.backend import MosaicGpuBackend
from tests.lowering import (MOSAIC_BACKWARD, MOSAIC_CALL,
                            TRITON_BACKWARD, TRITON_FORWARD, lower_flex,
                            lower_grad)


def test_head_splits_give_every_share_a_head():
  from pallas_kernels.mosaic_gpu.flash_bwd import head_splits
  blocks = lambda s: jax_flash.MosaicBlockSizes(dkv_head_splits=s)
  assert head_splits(blocks(8), 71, 64, fp8=False) == 8  # Shares of 9, 8.
  assert head_splits(blocks(7), 8, 64, fp8=False) == 4  # Shares of 2.
  assert head_splits(blocks(200), 64, 64, fp8=False) == 64
  assert head_splits(blocks(8), 71, 64, fp8=True) == 1
  assert head_splits(jax_flash.MosaicBlockSizes(dkv_head_splits=8,
                                                fused_dq=True), 8, 64,
                     fp8=False) == 1
  with pytest.raises(ValueError, match="dkv_head_splits=0 must be"):
    blocks(0)


@pytest.mark.parametrize("group, ctas, splits", [
    (71, 64, 15), (64, 64, 16), (32, 128, 8), (16, 256, 4), (8, 512, 2),
    (4, 1024, 1), (1, 64, 1), (3, 64, 3), (8, 100, 8)])
def test_default_head_splits_reach_the_ctas(group, ctas, splits):
  """None: the fewest shares giving `config.DKV_CTAS` CTAs (the group's
  heads at most; shares as even as the group allows)."""
  from pallas_kernels.mosaic_gpu.flash_bwd import head_splits
  assert head_splits(jax_flash.MosaicBlockSizes(), group, ctas,
                     fp8=False) == splits


@pytest.mark.parametrize("name, shape, dtype, kwargs, mosaic", [
    ("eligible", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(is_causal=True), True),
    ("odd_q_len", (2, 300, 512, 8, 2, 128), jnp.bfloat16, {}, True),
    ("odd_kv_len", (2, 256, 521, 8, 2, 128), jnp.bfloat16, {}, True),
    # Up to 320 keys (the dispatch's `NEXT_IS_FASTER`) the Triton kernels
    # where the Mosaic forward would copy arrays (`test_short_keys_...` below).
    ("short_keys", (2, 256, 300, 8, 2, 192), jnp.bfloat16, {}, False),
    ("short_keys_in_parts", (2, 256, 300, 8, 2, 128), jnp.bfloat16, {},
     True),
    ("head_dim_96", (2, 256, 512, 8, 2, 96), jnp.bfloat16, {}, True),
    ("head_dim_192", (2, 256, 512, 8, 2, 192), jnp.bfloat16, {}, True),
    ("head_dim_80", (2, 256, 512, 8, 2, 80), jnp.bfloat16,
     dict(is_causal=True), True),
    ("head_dim_72_padded", (2, 256, 512, 8, 2, 72), jnp.bfloat16, {}, True),
    ("head_dim_264", (2, 256, 512, 8, 2, 264), jnp.bfloat16, {}, False),
    ("float32", (2, 256, 512, 8, 2, 128), jnp.float32, {}, False),
    ("window", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(local_window_size=64), True),
    ("causal_window", (2, 256, 512, 8, 2, 64), jnp.bfloat16,
     dict(is_causal=True, local_window_size=(100, 0)), True),
    ("soft_cap", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(logits_soft_cap=30.0), True),
    ("alibi", (2, 256, 512, 8, 2, 64), jnp.bfloat16,
     dict(is_causal=True, alibi_slopes=jnp.ones((2, 8))), True),
    ("bias", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(bias=jnp.zeros((1, 1, 256, 512))), True),
    ("dense_mask", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(mask=jnp.ones((2, 1, 256, 512), bool)), True),
    ("sinks", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(sinks=jnp.zeros((8,))), True),
    ("dropout", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), True),
    ("lengths", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(key_value_seq_lengths=jnp.array([512, 3])), True),
    ("segment_ids", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(segment_ids=(jnp.zeros((2, 256), jnp.int32),
                       jnp.zeros((2, 512), jnp.int32))), True),
    ("version_1", (2, 256, 512, 8, 2, 128), jnp.bfloat16,
     dict(version=1), False),
])
def test_pallas_picks_mosaic_where_it_takes_the_call(name, shape, dtype,
                                                     kwargs, mosaic):
  text = lower_grad("pallas", shape, dtype, **kwargs)
  assert (MOSAIC_CALL in text) == mosaic, name
  if not mosaic:
    assert TRITON_FORWARD in text


@pytest.mark.parametrize("shape, causal, forward, backward", [
    ((2, 256, 300, 8, 2, 192), False, "triton", "triton"),
    ((2, 256, 300, 8, 2, 128), False, "mosaic", "mosaic"),
    ((4, 257, 257, 4, 4, 80), False, "mosaic", "mosaic"),
    ((4, 197, 197, 8, 8, 64), True, "mosaic", "mosaic"),
    ((4, 256, 256, 4, 4, 72), False, "mosaic", "mosaic"),
    ((4, 256, 256, 4, 4, 64), False, "mosaic", "mosaic"),
    ((4, 77, 77, 4, 4, 64), True, "mosaic", "triton"),
    ((4, 300, 77, 4, 4, 40), False, "mosaic", "triton"),
    ((4, 300, 77, 4, 4, 20), False, "triton", "triton"),
    ((4, 300, 300, 4, 4, 20), False, "triton", "triton")])
def test_short_keys_pick_each_direction_by_its_copies(shape, causal, forward,
                                                      backward):
  """Up to 320 keys (`_dispatch.NEXT_IS_FASTER`) the default runs the Triton
  forward where XLA would copy arrays around the Mosaic one (a length off
  8 read tiled: 300 at head dim 192; a head dim padded: 20) and the Mosaic
  forward where it reads them in place (197 tokens at head dim 64, head
  dims 72 and 40 in column parts, 128 and 80 in parts at lengths off 8);
  the Triton backward after a Triton forward, up to
  128 keys, and where the Mosaic backward
  would pad head dims (20), the Mosaic one elsewhere (it reads any length
  and head dim 72 in place)."""
  text = lower_grad("pallas", shape, is_causal=causal)
  assert ("flash_attention_forward_mosaic" in text) == (forward == "mosaic")
  names = MOSAIC_BACKWARD if backward == "mosaic" else TRITON_BACKWARD
  others = TRITON_BACKWARD if backward == "mosaic" else MOSAIC_BACKWARD
  assert all(n in text for n in names) and not any(n in text for n in others)


def test_mosaic_named_runs_short_keys_too():
  """`slower` only steers the choice when no backend is named."""
  text = lower_grad("mosaic", (2, 197, 197, 4, 4, 64))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in MOSAIC_BACKWARD)


def test_mosaic_named_for_a_call_it_cannot_take_says_why():
  with pytest.raises(ValueError, match=r"head_dim \(last axis of query, "
                     r"key\) must be at most 256 for the Mosaic GPU kernels, "
                     "got 264"):
    lower_grad("mosaic", (2, 256, 512, 8, 2, 264))
  with pytest.raises(ValueError, match="query dtype must be bfloat16 or "
                     "float16 for the Mosaic GPU kernels, got float32"):
    lower_grad("mosaic", dtype=jnp.float32)


def test_mosaic_without_a_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation='mosaic' .* needs a "
                     "GPU"):
    jax_flash.flash_attention(q, q, q, implementation="mosaic")


@pytest.mark.parametrize("head_dim,kv_len,mask,persistent", [
    (128, 2048, Mask(), True), (64, 1000, Mask(), True),
    (128, 16384, Mask(), True), (96, 2048, Mask(), True),
    (256, 1024, Mask(), False), (128, 2048, Mask(is_causal=True), True),
    (64, 1024, Mask(window_left=100, window_right=100), False),
    (64, 1024, Mask(has_ids=True, segments_only=True), False),
    (64, 1024, Mask(is_causal=True, has_q_offsets=True), False),
    (64, 1024, None, False)])
def test_default_is_persistent_only_without_a_mask_but_causality(
    head_dim, kv_len, mask, persistent):
  """The default tiles run the persistent forward where it measured
  faster: no mask but causality (items weighed by the band), head dims
  64, 96 and 128."""
  problem = Problem(batch=2, q_len=kv_len, kv_len=kv_len, num_heads=8,
                    num_kv_heads=8, head_dim=head_dim, unbatched=False)
  blocks = MosaicGpuBackend().config(
      None, problem, jnp.bfloat16,
      is_causal=mask is not None and mask.is_causal, mask=mask)
  assert blocks.persistent is persistent


@pytest.mark.parametrize("head_dim,kv_len,causal,block_kv", [
    (64, 1024, True, 128), (64, 2048, True, 128), (64, 2049, True, 256),
    (64, 16384, True, 256), (64, 1024, False, 256), (128, 1024, True, 128),
    (192, 1024, True, 96), (192, 16384, False, 96), (256, 1024, True, 64),
    (256, 4096, False, 64), (256, 4097, False, 80), (256, 16384, True, 80)])
def test_default_key_tiles_follow_head_dim_causality_and_length(
    head_dim, kv_len, causal, block_kv):
  """Head dim 64 causal takes 128-key tiles up to SHORT_KV_LEN keys (faster
  at 1k/2k on the H200, slower at 4k/16k), 256 above and non-causal; head
  dim 192 96-key tiles; 256 64, or 80 above LONG_KV_LEN keys."""
  problem = Problem(batch=2, q_len=kv_len, kv_len=kv_len, num_heads=8,
                    num_kv_heads=8, head_dim=head_dim, unbatched=False)
  blocks = MosaicGpuBackend().config(
      None, problem, jnp.bfloat16, is_causal=causal,
      mask=Mask(is_causal=causal))
  assert blocks.block_kv == block_kv


@pytest.mark.parametrize("head_dim,causal", [(64, True), (64, False),
                                             (128, False), (256, True)])
def test_default_key_tiles_with_alibi_take_its_vectors(head_dim, causal):
  """With ALiBi the default forward's K/V tiles are at most
  `ALIBI_VECTORS_MAX_COLUMNS` rows, so that ALiBi is added by vectors
  (head dim 64: 128 rows, not 256); without it, and with a call's own
  tiles, they are as they were."""
  from pallas_kernels.mosaic_gpu import config
  problem = Problem(batch=2, q_len=8192, kv_len=8192, num_heads=8,
                    num_kv_heads=8, head_dim=head_dim, unbatched=False)
  backend, mask = MosaicGpuBackend(), Mask(is_causal=causal)

  def tiles(block_sizes=None, **scores):
    return backend.config(block_sizes, problem, jnp.bfloat16,
                          is_causal=causal, mask=mask,
                          scores=Scores(scale=0.1, **scores)).block_kv
  plain = tiles()
  assert tiles(alibi=True) == min(plain, config.ALIBI_VECTORS_MAX_COLUMNS)
  assert (head_dim == 64) == (tiles(alibi=True) < plain)
  if head_dim == 64:  # A call's own 256-row tiles stay.
    own = jax_flash.MosaicBlockSizes(block_kv=256)
    assert tiles(own, alibi=True) == 256


def test_persistent_forward_names_what_it_cannot_take():
  with pytest.raises(ValueError, match="persistent=True needs "
                     "named_barriers=False"):
    jax_flash.MosaicBlockSizes(persistent=True, named_barriers=True)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_fused_dq_names_the_head_dims_it_takes(head_dim):
  with pytest.raises(ValueError, match=r"fused_dq=True needs a head_dim in "
                     rf"\(64, 128\), got {head_dim}"):
    lower_grad("mosaic", (1, 256, 256, 4, 4, head_dim),
               block_sizes=jax_flash.MosaicBlockSizes(fused_dq=True))


def test_mosaic_block_sizes_are_validated():
  with pytest.raises(ValueError, match="block_q=48 must be a multiple of 64"):
    jax_flash.MosaicBlockSizes(block_q=48)
  with pytest.raises(ValueError, match="block_kv=72 must be a multiple of "
                     "16 from 64 up"):
    jax_flash.MosaicBlockSizes(block_kv=72)
  with pytest.raises(ValueError, match="block_kv=48 must be a multiple of "
                     "16 from 64 up"):
    jax_flash.MosaicBlockSizes(block_kv=48)
  with pytest.raises(ValueError, match="block_kv_dq=80 must be a multiple "
                     "of 64"):
    jax_flash.MosaicBlockSizes(block_kv_dq=80)
  with pytest.raises(ValueError, match="named_barriers=1 must be a bool"):
    jax_flash.MosaicBlockSizes(named_barriers=1)
  with pytest.raises(ValueError, match="dv_before_ds=0 must be a bool"):
    jax_flash.MosaicBlockSizes(dv_before_ds=0)
  with pytest.raises(ValueError, match="fp8_backward=1 must be a bool"):
    jax_flash.MosaicBlockSizes(fp8_backward=1)
  with pytest.raises(ValueError, match="fp8_backward=True needs "
                     "fused_dq=False"):
    jax_flash.MosaicBlockSizes(fp8_backward=True, fused_dq=True)
  with pytest.raises(ValueError, match="overlap=1 must be a bool"):
    jax_flash.MosaicBlockSizes(overlap=1)
  with pytest.raises(ValueError, match="alibi_fold=None must be a bool"):
    jax_flash.MosaicBlockSizes(alibi_fold=None)
  with pytest.raises(ValueError, match="overlap=True needs "
                     "named_barriers=False"):
    jax_flash.MosaicBlockSizes(overlap=True, named_barriers=True)
  with pytest.raises(ValueError, match="producer_registers=20 must be a "
                     "multiple of 8 in"):
    jax_flash.MosaicBlockSizes(producer_registers=20)
  assert jax_flash.MosaicBlockSizes().consumer_registers(2) == 232
  assert jax_flash.MosaicBlockSizes(
      producer_registers=24).consumer_registers(2) == 240
  with pytest.raises(ValueError, match="shared memory"):
    lower_grad("mosaic", (2, 256, 512, 8, 2, 256),
               block_sizes=jax_flash.MosaicBlockSizes(block_kv=128,
                                                       num_stages=4))
  with pytest.raises(ValueError, match="shared memory in the backward"):
    lower_grad("mosaic", (2, 256, 512, 8, 2, 128),
               block_sizes=jax_flash.MosaicBlockSizes(block_kv_dq=256,
                                                       num_stages_bwd=3))


def test_flex_mod_the_mosaic_lowering_lacks_runs_triton():
  """floor is not among the primitives the Mosaic kernels take in a mod:
  the default picks Triton; naming Mosaic says why."""
  mod = lambda b, h, q, k: jnp.floor(q / 2.0) >= jnp.floor(k / 2.0)
  text = lower_flex(None, mod)
  assert MOSAIC_CALL not in text and TRITON_FORWARD in text
  with pytest.raises(ValueError, match=r"cannot run a mask_mod/score_mod "
                     r"made of \['floor'\]"):
    lower_flex("mosaic", mod)


def test_flex_mask_mod_reading_an_array_runs_triton():
  """Document ids closed over by the mask_mod: the Mosaic kernels cannot
  read them, so the default picks Triton; naming Mosaic says why."""
  ids = jnp.arange(300) // 70
  mod = lambda b, h, q, k: ids[q] == ids[jnp.minimum(k, 299)]
  text = lower_flex(None, mod)
  assert MOSAIC_CALL not in text and TRITON_FORWARD in text
  with pytest.raises(ValueError, match="cannot read the arrays a mask_mod "
                     "or score_mod closes over"):
    lower_flex("mosaic", mod)


def test_flex_score_mod_reading_a_table_runs_triton():
  """A relative-bias table closed over by the score_mod: the default on an
  H200 runs Triton's forward, dK/dV and dQ kernels, which read the table
  element by element, and the blockwise loops for the table's gradient
  (here unused: XLA drops them); naming Mosaic says why."""
  table = jnp.linspace(-1.0, 1.0, 300 + 520 + 1)
  mod = lambda s, b, h, q, k: s + table[q - k + 520]
  causal = lambda b, h, q, k: q >= k
  text = lower_flex(None, causal, mod)
  assert MOSAIC_CALL not in text
  assert all(name in text for name in (TRITON_FORWARD,) + TRITON_BACKWARD)
  with pytest.raises(ValueError, match="cannot read the arrays a mask_mod "
                     "or score_mod closes over"):
    lower_flex("mosaic", causal, mod)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_query_offsets_run_the_mosaic_forward_and_triton_backward(head_dim):
  """query_offset: the Mosaic forward reads the offsets as scalars; its
  backward declines them, so the plan's backward is Triton's."""
  text = lower_grad("pallas", (2, 256, 512, 8, 2, head_dim), jnp.bfloat16,
                    is_causal=True, query_offset=jnp.array([256, 3]),
                    alibi_slopes=jnp.linspace(0.1, 0.8, 8))
  assert "flash_attention_forward_mosaic" in text
  assert all(name in text for name in TRITON_BACKWARD)
  assert not any(name in text for name in MOSAIC_BACKWARD)


@pytest.mark.parametrize("shape, kwargs, match", [
    ((2, 256, 520, 8, 2, 96), {}, r"head dims \(64, 128, 256\)"),
    ((2, 256, 520, 8, 2, 64), dict(logits_soft_cap=30.0), "no soft-cap"),
    ((2, 256, 520, 8, 2, 64), dict(local_window_size=(64, 0)),
     "only a causal mask"),
])
def test_fp8_calls_the_forward_lacks_say_why(shape, kwargs, match):
  """Named, the Mosaic backend says what its FP8 forward lacks; the
  default runs such a call on the blockwise path."""
  with pytest.raises(ValueError, match=match):
    lower_grad("mosaic", shape, fp8=True, **kwargs)
  text = lower_grad(None, shape, fp8=True, **kwargs)
  assert MOSAIC_CALL not in text and "flash_attention_forward" not in text


@pytest.mark.parametrize("head_dim, on", [(64, False), (128, True),
                                          (256, False)])
def test_fp8_stores_by_stmatrix_by_default_at_128(head_dim, on):
  """fp8=True's default tiles store e4m3 tiles by `stmatrix` at head dim
  128 only (`config.FP8_STMATRIX_DEFAULT_HEAD_DIMS`); a call's own
  BlockSizes keep theirs."""
  problem = Problem(batch=2, q_len=2048, kv_len=2048, num_heads=8,
                    num_kv_heads=2, head_dim=head_dim, unbatched=False)
  scores = Scores(scale=head_dim ** -0.5, fp8="amax")
  backend = MosaicGpuBackend()
  blocks = backend.config(None, problem, jnp.bfloat16, is_causal=True,
                          scores=scores, mask=Mask(is_causal=True))
  assert blocks.e4m3_stmatrix == on
  own = jax_flash.MosaicBlockSizes(block_kv=64)
  assert not backend.config(own, problem, jnp.bfloat16, is_causal=True,
                            scores=scores,
                            mask=Mask(is_causal=True)).e4m3_stmatrix


@pytest.mark.parametrize("head_dim, forward, backward", [
    (64, False, False), (128, False, True), (256, True, True)])
def test_fp8_hands_tiles_from_registers_by_default(head_dim, forward,
                                                   backward):
  """fp8=True's default tiles hand the forward's P to wgmma from
  registers at head dim 256 and the FP8 backward's tiles at 128 and 256
  (`config.FP8_REGISTERS_DEFAULT_HEAD_DIMS`, `..._BWD_...`); a call's
  own BlockSizes keep theirs."""
  problem = Problem(batch=2, q_len=2048, kv_len=2048, num_heads=8,
                    num_kv_heads=2, head_dim=head_dim, unbatched=False)
  scores = Scores(scale=head_dim ** -0.5, fp8="amax")
  backend = MosaicGpuBackend()
  for causal in (False, True):
    blocks = backend.config(None, problem, jnp.bfloat16, is_causal=causal,
                            scores=scores, mask=Mask(is_causal=causal))
    assert (blocks.e4m3_registers, blocks.e4m3_registers_bwd) == (
        forward, backward)
  own = backend.config(jax_flash.MosaicBlockSizes(block_kv=64), problem,
                       jnp.bfloat16, is_causal=True, scores=scores,
                       mask=Mask(is_causal=True))
  assert not own.e4m3_registers and not own.e4m3_registers_bwd
