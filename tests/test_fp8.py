"""FP8 attention (`fp8=True`, float8_e4m3fn inputs with `descale`) on the
blockwise path: its error against float32 attention on the unquantized
inputs, next to the error that rounding the inputs alone causes, and its
arguments' checks."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.core import fp8
from pallas_kernels.mosaic_gpu import config
from tests.cases import random_inputs
from tests.conftest import HOPPER


def _rel(a, b):
  """RMS of a - b over the RMS of b (float32)."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))


def _grads(attend, q, k, v, do):
  return jax.grad(lambda q, k, v: jnp.sum(
      attend(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2))(q, k, v)


def _outliers(q, k):
  """q and k with feature columns 3 and 17 20x the rest (K's over 4.5)."""
  cols = jnp.ones(q.shape[-1]).at[jnp.array([3, 17])].set(20.0)
  return ((q * cols).astype(q.dtype), (k * cols / 4.5).astype(k.dtype))


def _check_against_rounding(ours, q, k, v, do, causal):
  """ours(q, k, v) (jitted) against float32 attention on the unquantized
  inputs: the output's error at most 1.6x, the gradients' at most 2x, the
  error of exact attention on the inputs rounded to e4m3 (per (batch, KV
  head) scales); outputs and gradients in the inputs' dtype. Returns
  (ours' output, the rounding's output error)."""
  num_kv_heads = k.shape[2]
  exact = lambda q, k, v: jax_flash.reference_attention(q, k, v,
                                                        is_causal=causal)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  rounded = lambda q, k, v: exact(*(fp8.round_trip(x, num_kv_heads)
                                    for x in (q, k, v)))
  out = jax.jit(ours)(q, k, v)
  assert out.dtype == q.dtype
  floor = _rel(rounded(*up), exact(*up))
  assert _rel(out, exact(*up)) <= 1.6 * floor
  want = _grads(exact, *up, do)
  for ours_g, floor_g, w in zip(jax.jit(lambda *a: _grads(ours, *a))(
      q, k, v, do), _grads(rounded, *up, do), want):
    assert ours_g.dtype == q.dtype
    assert _rel(ours_g, w) <= 2 * _rel(floor_g, w)
  return out, floor


@pytest.mark.parametrize("shape, causal", [
    ((2, 200, 300, 4, 2, 64), True), ((1, 129, 77, 4, 1, 96), False)])
def test_error_is_close_to_the_rounding_of_the_inputs(shape, causal):
  """The default's FP8 call (blockwise on the CPU) within the bounds of
  `_check_against_rounding`; the rounding's error is e4m3's, not bf16's."""
  q, k, v, do = random_inputs(*shape, jnp.bfloat16)
  _, floor = _check_against_rounding(
      lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal,
                                                fp8=True), q, k, v, do, causal)
  assert 0.01 < floor < 0.1  # e4m3's 3 mantissa bits, not bf16's.


def test_rotation_lowers_the_error_of_outlier_features():
  """Two feature columns 20x the rest (in query and key): one scale a
  (batch, KV head) leaves the other columns few of e4m3's values; the
  rotation spreads them, and the error falls below half."""
  q, k, v, _ = random_inputs(2, 256, 256, 4, 2, 64, jnp.bfloat16)
  q, k = _outliers(q, k)
  exact = jax_flash.reference_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  plain, rotated = (_rel(jax_flash.flash_attention(
      q, k, v, is_causal=True, fp8=mode), exact) for mode in (True, "rotate"))
  assert rotated < 0.5 * plain


def test_rounding_survives_jit():
  """Under jit the inputs are rounded (on a GPU XLA may otherwise drop a
  pair of conversions as excess precision)."""
  x = random_inputs(1, 64, 64, 2, 2, 32, jnp.float32)[0]
  rounded = jax.jit(lambda x: fp8.round_trip(x, 2))(x)
  assert 0.01 < _rel(rounded, x) < 0.1
  assert jnp.array_equal(rounded, fp8.round_trip(x, 2))


def _rounding_inputs(shape, dtype):
  """x [B, L, N, H] ~ 3 N(0, 1) in `dtype` with a NaN, an infinity and
  -700 (the largest magnitude) in the first (batch, KV head)."""
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32) * 3
  x = x.at[0, 5, 0, 3].set(jnp.nan).at[0, 7, 0, 2].set(jnp.inf)
  return x.at[0, 9, 0, 1].set(-700.0).astype(dtype)


def _check_rounding(rounding, x, num_kv_heads):
  """`rounding`'s max |x| and e4m3 values equal XLA's (`fp8.XLA`) bitwise
  (NaN where XLA's are NaN: x's non-finite values)."""
  want = fp8.amax(x, num_kv_heads)
  assert jnp.array_equal(jax.jit(rounding.amax, static_argnums=1)(
      x, num_kv_heads), want)
  assert want[0, 0] == 700.0
  scale = fp8.scale_of(want)
  ours, theirs = (jax.jit(f, static_argnums=2)(x, scale, num_kv_heads)
                  for f in (rounding.quantize, fp8.quantize))
  assert ours.dtype == theirs.dtype == fp8.E4M3
  nan = jnp.isnan(theirs.astype(jnp.float32))
  assert int(nan.sum()) == 2
  assert jnp.array_equal(jnp.isnan(ours.astype(jnp.float32)), nan)
  bits = [jax.lax.bitcast_convert_type(y, jnp.uint8) for y in (ours, theirs)]
  assert jnp.array_equal(jnp.where(nan, 0, bits[0]), jnp.where(nan, 0, bits[1]))


@pytest.mark.parametrize("shape, num_kv_heads, dtype", [
    ((2, 67, 4, 64), 2, jnp.bfloat16), ((1, 300, 3, 96), 1, jnp.float16),
    ((2, 33, 6, 40), 3, jnp.float32)])
def test_rounding_kernels_give_xla_values(shape, num_kv_heads, dtype):
  """The Triton rounding kernels (`pallas_kernels.triton.fp8_round`,
  interpreted): XLA's max and e4m3 values bitwise, on unaligned lengths,
  GQA groups and head dims off a power of two."""
  from pallas_kernels.triton import fp8_round
  _check_rounding(fp8_round.INTERPRET, _rounding_inputs(shape, dtype),
                  num_kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, num_kv_heads, dtype", [
    ((2, 1003, 8, 128), 2, jnp.bfloat16), ((1, 300, 3, 96), 1, jnp.float16),
    ((2, 777, 4, 256), 4, jnp.bfloat16), ((2, 33, 6, 40), 3, jnp.float32)])
def test_rounding_kernels_give_xla_values_on_the_gpu(shape, num_kv_heads,
                                                     dtype):
  """The same on the GPU (Triton's e4m3 conversion against XLA's)."""
  from pallas_kernels.triton import fp8_round
  _check_rounding(fp8_round.ROUNDING, _rounding_inputs(shape, dtype),
                  num_kv_heads)


@pytest.mark.parametrize("q_len, kv_len", [(0, 5), (5, 0)])
def test_fp8_takes_empty_sequences(q_len, kv_len):
  """No queries or no keys: fp8=True gives what the unquantized call
  gives (rows that see no key output 0), with gradients; the rounding's
  max over nothing is 0 (scale 1), in XLA's ops and the kernels."""
  from pallas_kernels.triton import fp8_round
  q = jnp.ones((1, q_len, 4, 64), jnp.bfloat16)
  kv = jnp.ones((1, kv_len, 2, 64), jnp.bfloat16)
  out = jax_flash.flash_attention(q, kv, kv, fp8=True)
  assert out.shape == q.shape
  assert jnp.array_equal(out, jax_flash.flash_attention(q, kv, kv))
  grad = jax.grad(lambda q: jax_flash.flash_attention(
      q, kv, kv, fp8=True).astype(jnp.float32).sum())(q)
  assert grad.shape == q.shape and not jnp.any(grad)
  for rounding in (fp8.XLA, fp8_round.INTERPRET):
    empty = q if q_len == 0 else kv
    assert jnp.array_equal(rounding.amax(empty, 2), jnp.zeros((1, 2)))
    assert rounding.quantize(empty, jnp.ones((1, 2)), 2).shape == empty.shape


def test_the_least_scale_has_a_normal_reciprocal():
  """Inputs below 448 * 2^-126 in magnitude get the least scale, 2^-126,
  so that 1 / scale is a normal float32 (kernels multiply by it)."""
  x = jnp.full((1, 4, 1, 8), 10 * 2.0 ** -126, jnp.float32)
  scale = fp8.scales(x, 1)
  assert scale[0, 0] == fp8.MIN_SCALE == 2.0 ** -126
  assert jnp.isfinite(1 / scale).all()
  assert fp8.quantize(x, scale, 1).astype(jnp.float32)[0, 0, 0, 0] == 10


def test_scales_are_powers_of_two_that_requantize_any_part_exactly():
  """Scales are the least powers of two at or above max |x| / 448; the
  rounded bf16 values are exact (their float32 values), and a part of a
  (batch, KV head) quantized again with its own scales gives the same
  e4m3 values times a power of two (what the Mosaic FP8 forward does on
  a shard)."""
  x = random_inputs(2, 96, 96, 4, 2, 64, jnp.bfloat16)[0] * 3.7
  s = fp8.scales(x, 2)
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(2, 96, 2, 2, 64),
                 axis=(1, 3, 4))
  assert jnp.array_equal(jnp.exp2(jnp.round(jnp.log2(s))), s)
  assert jnp.all((amax / s <= fp8.E4M3_MAX) & (amax / s > fp8.E4M3_MAX / 2))
  exact_amax = jnp.full((1, 1), fp8.E4M3_MAX * 0.25)  # 448 / 4: scale 1/4.
  assert fp8.scales(jnp.full((1, 2, 1, 2), exact_amax[0, 0]), 1) == 0.25
  rounded = fp8.round_trip(x, 2)
  assert rounded.dtype == jnp.bfloat16
  rounded32 = fp8.round_trip(x.astype(jnp.float32), 2)
  assert jnp.array_equal(rounded.astype(jnp.float32), rounded32)
  part = rounded[:, 10:40]  # A shard along the sequence.
  again = fp8.dequantize(fp8.quantize(part, fp8.scales(part, 2), 2),
                         fp8.scales(part, 2), 2)
  assert jnp.array_equal(again, part.astype(jnp.float32))


def test_rotation_is_orthogonal():
  for h in (64, 80):
    r = fp8.rotation(h)
    rrt = jnp.matmul(r, r.T, precision="highest")  # Not TF32 on a GPU.
    assert jnp.allclose(rrt, jnp.eye(h), atol=1e-5)


def test_float8_inputs_with_descale_match_fp8_true():
  """Inputs quantized by the caller with the same scales give fp8=True's
  output: bitwise against float32 inputs (the same float32 values and
  arithmetic); against bfloat16 inputs, whose rounded values travel as
  bfloat16 (a GPU's dots may sum them in another order), within a few of
  bfloat16's last bits. bfloat16 unless out_dtype says otherwise."""
  q, k, v, _ = random_inputs(2, 100, 130, 4, 2, 32, jnp.bfloat16)
  scales = tuple(fp8.scales(x, 2) for x in (q, k, v))
  q8, k8, v8 = (fp8.quantize(x, s, 2) for x, s in zip((q, k, v), scales))
  got = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, descale=scales))(q8, k8, v8)
  assert got.dtype == jnp.bfloat16
  want = jax_flash.flash_attention(q, k, v, fp8=True)
  assert _rel(got, want) < 2e-3  # The FP8 rounding's own error: ~0.04.
  f32 = jax_flash.flash_attention(q8, k8, v8, descale=scales,
                                  out_dtype=jnp.float32)
  assert f32.dtype == jnp.float32
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  assert jnp.array_equal(f32, jax_flash.flash_attention(*up, fp8=True))
  # A scalar descale per tensor, unbatched inputs.
  one = jax_flash.flash_attention(q8[0], k8[0], v8[0],
                                  descale=(0.01, 0.01, 0.01))
  assert one.shape == (100, 4, 32) and bool(jnp.isfinite(one).all())


def _depends_on(jaxpr, var, source) -> bool:
  """Whether `var` is computed from `source` in `jaxpr` (an equation's
  outputs taken to depend on all of its inputs)."""
  producers = {out: e for e in jaxpr.eqns for out in e.outvars}
  stack, seen = [var], set()
  while stack:
    x = stack.pop()
    if x is source:
      return True
    if id(x) in seen or x not in producers:
      continue
    seen.add(id(x))
    stack.extend(v for v in producers[x].invars if not hasattr(v, "val"))
  return False


def test_a_traced_scale_scales_the_values_that_are_quantized():
  """A traced scale (jax.nn takes one) multiplies the query before it is
  rounded (fp8=True) or joins the query's descale (float8 inputs): a
  power of two traced gives the static scale's result exactly."""
  q, k, v, _ = random_inputs(2, 100, 130, 4, 2, 64, jnp.bfloat16)
  static = jax_flash.flash_attention(q, k, v, fp8=True, scale=0.25)
  traced = jax.jit(lambda q, k, v, s: jax_flash.flash_attention(
      q, k, v, fp8=True, scale=s))(q, k, v, jnp.float32(0.25))
  assert jnp.array_equal(traced, static)
  # The e4m3 query a kernel reads (`Operands.fp8_q`) is made from the scale.
  jaxpr = jax.make_jaxpr(lambda q, k, v, s: jax_flash.flash_attention(
      q, k, v, fp8=True, scale=s))(q, k, v, jnp.float32(0.25)).jaxpr
  call, = (e for e in jaxpr.eqns
           if e.primitive.name.startswith("jax_flash_attention"))
  leaves = jax.tree.unflatten(call.params["tree"],
                              range(call.params["tree"].num_leaves))
  assert _depends_on(jaxpr, call.invars[3 + leaves.fp8_q], jaxpr.invars[3])
  descale = tuple(fp8.scales(x, 2) for x in (q, k, v))
  e4m3 = [fp8.quantize(x, s, 2) for x, s in zip((q, k, v), descale)]
  static = jax_flash.flash_attention(*e4m3, descale=descale, scale=0.25)
  traced = jax.jit(lambda q, k, v, s: jax_flash.flash_attention(
      q, k, v, descale=descale, scale=s))(*e4m3, jnp.float32(0.25))
  assert jnp.array_equal(traced, static)


def test_masked_positions_may_hold_nan():
  """Positions past the lengths count in no scale: NaN there reaches no
  result."""
  q, k, v, _ = random_inputs(2, 64, 80, 2, 2, 32, jnp.bfloat16)
  k = k.at[1, 50:].set(jnp.nan)
  v = v.at[1, 50:].set(jnp.nan)
  out = jax_flash.flash_attention(q, k, v, fp8=True,
                                  key_value_seq_lengths=jnp.array([80, 50]))
  assert bool(jnp.isfinite(out).all())


@pytest.mark.parametrize("call, match", [
    (lambda q, q8: jax_flash.flash_attention(q, q, q, descale=(1, 1, 1)),
     "descale and out_dtype are for float8_e4m3fn"),
    (lambda q, q8: jax_flash.flash_attention(q8, q8, q8),
     "need descale="),
    (lambda q, q8: jax_flash.flash_attention(q8, q, q, descale=(1, 1, 1)),
     "must all be float8_e4m3fn or none"),
    (lambda q, q8: jax_flash.flash_attention(q8, q8, q8,
                                             descale=(1, 1, jnp.ones(3))),
     r"v_descale must be a scalar or broadcastable to \[B, K\] = \[2, 2\]"),
    (lambda q, q8: jax_flash.flash_attention(q8, q8, q8, descale=(1, 1)),
     "descale must be a tuple"),
    (lambda q, q8: jax_flash.flash_attention(q8, q8, q8, descale=(1, 1, 1),
                                             fp8="rotate"),
     "quantized already"),
    (lambda q, q8: jax_flash.flash_attention(q, q, q, fp8="yes"),
     "fp8 must be False, True or 'rotate'"),
    (lambda q, q8: jax_flash.flash_attention(q, q, q, fp8=True,
                                             implementation="interpret"),
     "take no fp8 call"),
])
def test_bad_fp8_arguments_say_what(call, match):
  q = random_inputs(2, 16, 16, 2, 2, 32, jnp.bfloat16)[0]
  with pytest.raises(ValueError, match=match):
    call(q, q.astype(fp8.E4M3))


def test_float8_inputs_are_forward_only():
  q8 = random_inputs(1, 16, 16, 2, 2, 32, jnp.bfloat16)[0].astype(fp8.E4M3)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: jnp.sum(jax_flash.flash_attention(
        q, q8, q8, descale=(1, 1, 1)).astype(jnp.float32)))(q8)


def test_flax_modules_take_fp8():
  """nnx's and linen's FlashAttention pass `fp8` on (checked when built)."""
  from flax import nnx
  x = random_inputs(2, 64, 64, 1, 1, 32, jnp.float32)[0][:, :, 0]
  outs = []
  for fp8_mode in (False, True):
    attn = jax_flash.nnx.FlashAttention(num_heads=2, in_features=32,
                                        decode=False, fp8=fp8_mode,
                                        rngs=nnx.Rngs(0))
    outs.append(attn(x, is_causal=True))
  assert 0 < _rel(outs[1], outs[0]) < 0.1
  with pytest.raises(ValueError, match="fp8 must be False, True or 'rotate'"):
    jax_flash.nnx.FlashAttention(num_heads=2, in_features=32, fp8="on",
                                 rngs=nnx.Rngs(0))
  module = jax_flash.linen.FlashAttention(num_heads=2, fp8=True)
  params = module.init(jax.random.key(0), x)
  plain = jax_flash.linen.FlashAttention(num_heads=2)
  assert 0 < _rel(module.apply(params, x), plain.apply(params, x)) < 0.1
  with pytest.raises(ValueError, match="fp8 must be"):
    jax_flash.linen.FlashAttention(num_heads=2, fp8=1).init(
        jax.random.key(0), x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, outliers", [
    ((2, 1000, 1003, 8, 2, 64), True, False),
    ((1, 512, 777, 4, 4, 128), False, False),
    ((1, 700, 700, 8, 2, 128), True, True),
    ((1, 300, 1000, 4, 2, 256), True, False)])
def test_mosaic_fp8_forward_is_as_close_as_the_rounding(shape, causal,
                                                        outliers):
  """The Mosaic FP8 forward (e4m3 wgmma; H200) with the default backward
  (the bf16 kernels on the rounded values; at head dim 256 the FP8
  kernels): output and gradients within the bounds the
  blockwise path meets, and no further from the blockwise FP8 path's
  output than either is from float32 (P rounded against another running
  maximum). `outliers`: two feature columns of Q and K 20x the rest
  (large logits: a backward whose logits differ from the forward's by
  the rounding would be far off)."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, do = random_inputs(*shape, jnp.bfloat16)
  if outliers:
    q, k = _outliers(q, k)
  ours = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, fp8=True, implementation="mosaic")
  hlo = jax.jit(ours).lower(q, k, v).as_text()
  assert "flash_attention_forward_mosaic" in hlo and "f8E4M3FN" in hlo
  out, floor = _check_against_rounding(ours, q, k, v, do, causal)
  blockwise = jax_flash.flash_attention(q, k, v, is_causal=causal, fp8=True,
                                        implementation="xla")
  assert _rel(out, blockwise) <= floor


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, block_kv, persistent", [
    ((2, 1000, 1003, 8, 2, 64), True, 128, True),
    ((1, 512, 777, 4, 4, 128), False, 256, False),
    ((1, 700, 700, 8, 2, 128), True, 128, True),
    ((2, 1000, 1003, 8, 2, 128), False, 128, False),
    ((1, 300, 1000, 4, 2, 256), True, 64, False)])
def test_mosaic_fp8_forward_overlap_is_the_same_forward(shape, causal,
                                                        block_kv, persistent):
  """`MosaicBlockSizes.overlap` (a tile's softmax beside the previous
  tile's P V; H200): the same operations in the same order, so the same
  output and gradients bitwise as without it, on fp8=True and on float8
  inputs; and within the bounds of `_check_against_rounding`."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, do = random_inputs(*shape, jnp.bfloat16)
  calls = {}
  for overlap in (False, True):
    blocks = jax_flash.MosaicBlockSizes(block_kv=block_kv,
                                        persistent=persistent,
                                        overlap=overlap)
    calls[overlap] = functools.partial(
        jax_flash.flash_attention, is_causal=causal, fp8=True,
        implementation="mosaic", block_sizes=blocks)
  grads = {on: jax.jit(lambda *a, f=f: _grads(f, *a))(q, k, v, do)
           for on, f in calls.items()}
  for a, b in zip(grads[False], grads[True]):
    assert bool(jnp.all(a == b))
  outs = [jax.jit(calls[on])(q, k, v) for on in (False, True)]
  assert bool(jnp.all(outs[0] == outs[1]))
  num_kv_heads = shape[4]
  descale = tuple(fp8.scales(x, num_kv_heads) for x in (q, k, v))
  e4m3 = [fp8.quantize(x, s, num_kv_heads) for x, s in zip((q, k, v),
                                                           descale)]
  outs = [jax.jit(functools.partial(calls[on], fp8=False, descale=descale))(
      *e4m3) for on in (False, True)]
  assert bool(jnp.all(outs[0] == outs[1]))
  _check_against_rounding(calls[True], q, k, v, do, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", [
    ((2, 1000, 1003, 8, 2, 128), True), ((1, 512, 777, 4, 4, 256), False)])
def test_mosaic_fp8_forward_reads_float8_inputs_as_they_are(shape, causal):
  """float8 inputs with the caller's descales (not powers of two) on the
  Mosaic FP8 forward (H200): the output of the same e4m3 values on the
  blockwise path, within the blockwise path's own difference from the
  Mosaic forward on fp8=True (P rounded against another running maximum),
  and that of float32 attention on the dequantized values to FP8's
  error."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, _ = random_inputs(*shape, jnp.bfloat16)
  num_kv_heads = shape[4]
  descale = tuple(fp8.scales(x, num_kv_heads) * 0.77 for x in (q, k, v))
  e4m3 = [fp8.quantize(x, s, num_kv_heads) for x, s in zip((q, k, v),
                                                           descale)]
  ours = lambda implementation: jax.jit(
      lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal, descale=descale,
          implementation=implementation))
  hlo = ours("mosaic").lower(*e4m3).as_text()
  assert "flash_attention_forward_mosaic" in hlo
  out, blockwise = ours("mosaic")(*e4m3), ours("xla")(*e4m3)
  exact = jax_flash.reference_attention(
      *(fp8.dequantize(x, s, num_kv_heads) for x, s in zip(e4m3, descale)),
      is_causal=causal)
  assert _rel(out, exact) < 0.05  # P's e4m3 rounding and bf16 output.
  assert _rel(out, blockwise) < 0.05


@pytest.mark.gpu
def test_mosaic_fp8_forward_with_a_traced_scale():
  """A traced scale on the Mosaic FP8 forward (H200): the e4m3 values it
  reads are the scaled query's, as the blockwise path's are."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, _ = random_inputs(1, 512, 512, 4, 2, 128, jnp.bfloat16)
  scale = jnp.float32(0.3 / 128 ** 0.5)
  calls = {implementation: jax.jit(lambda q, k, v, s: jax_flash.flash_attention(
      q, k, v, is_causal=True, fp8=True, scale=s,
      implementation=implementation)) for implementation in ("mosaic", "xla")}
  exact = jax_flash.reference_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True,
      scale=0.3 / 128 ** 0.5)
  out = calls["mosaic"](q, k, v, scale)
  assert _rel(out, calls["xla"](q, k, v, scale)) < 0.05
  assert _rel(out, exact) < 0.08



@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, outliers", [
    ((2, 1000, 1003, 8, 2, 128), True, False),
    ((1, 512, 777, 4, 4, 64), False, False),
    ((1, 2048, 2048, 8, 8, 128), True, True),
    ((1, 300, 1000, 4, 2, 256), True, False)])
def test_mosaic_fp8_backward_is_as_close_as_the_rounding(shape, causal,
                                                         outliers):
  """The Mosaic FP8 backward (`MosaicBlockSizes.fp8_backward`: every
  matmul in e4m3; H200): gradients within the bounds of
  `_check_against_rounding`, finite where rows of dS^T are all but zero
  (outliers at 2048 tokens: keys whose dS^T rows lie far below e4m3's
  range), and bitwise the same from one run to the next; at head dim 256
  the dK/dV kernel's warpgroups split dV and dK."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, do = random_inputs(*shape, jnp.bfloat16)
  if outliers:
    q, k = _outliers(q, k)
  # (64-row K/V tiles: the FP8 forward's at head dim 256.)
  blocks = jax_flash.MosaicBlockSizes(fp8_backward=True, block_kv=64)
  ours = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, fp8=True, implementation="mosaic",
      block_sizes=blocks)
  grad = jax.jit(lambda *a: _grads(ours, *a))
  hlo = grad.lower(q, k, v, do).as_text()
  assert "flash_attention_dkv_mosaic" in hlo
  # Q^T and dO^T, [B, N, H, T'] in e4m3, for the dK/dV kernel.
  b, _, n, h = q.shape
  assert re.search(rf"tensor<{b}x{n}x{h}x\d+xf8E4M3FN>", hlo)
  _check_against_rounding(ours, q, k, v, do, causal)
  first, second = grad(q, k, v, do), grad(q, k, v, do)
  for a, b_ in zip(first, second):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
    assert bool(jnp.all(a == b_))


# The shapes the FP8 kernels' variants are checked at (`_check_variant`).
_VARIANT_CASES = [((2, 1000, 1003, 8, 2, 128), True),
                  ((1, 512, 777, 4, 4, 64), False),
                  ((1, 300, 1000, 4, 2, 256), True),
                  ((1, 2048, 2048, 8, 8, 128), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", _VARIANT_CASES)
def test_mosaic_fp8_stmatrix_stores_are_the_same_attention(shape, causal):
  """`MosaicBlockSizes.e4m3_stmatrix` (e4m3 tiles stored by `stmatrix`,
  permuted, the operands they meet permuted alike): the same products in
  another order of their terms, so output and gradients within float32's
  rounding of the 16-bit stores' (forward and the FP8 backward), within
  the bounds of `_check_against_rounding`, and bitwise the same from one
  run to the next."""
  block_kv = 64 if shape[-1] == 256 else 128
  _check_variant(shape, causal, 2e-2, *(jax_flash.MosaicBlockSizes(
      fp8_backward=True, block_kv=block_kv, e4m3_stmatrix=on)
                                        for on in (False, True)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", _VARIANT_CASES)
def test_mosaic_fp8_registers_operands_are_the_same_attention(shape, causal):
  """`MosaicBlockSizes.e4m3_registers` and `e4m3_registers_bwd` (the e4m3
  tiles handed to wgmma from registers, the operands they meet permuted as `stmatrix` stores
  permute their columns): the values wgmma reads from shared memory with
  `e4m3_stmatrix`, so output and gradients (the FP8 backward) the same to
  float32's rounding, within the bounds of `_check_against_rounding`,
  and bitwise the same from one run to the next; at the default's tiles,
  overlapped."""
  block_kv = config.FP8_BLOCK_KV[shape[-1]][not causal]
  _check_variant(shape, causal, 1e-3, *(jax_flash.MosaicBlockSizes(
      overlap=True, fp8_backward=True, e4m3_stmatrix=not registers,
      e4m3_registers=registers, e4m3_registers_bwd=registers,
      block_kv=block_kv)
                                        for registers in (False, True)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", _VARIANT_CASES)
def test_mosaic_fp8_ds_bound_is_the_same_attention(shape, causal):
  """`MosaicBlockSizes.fp8_ds_bound` (dS scaled by one bound a (batch, KV
  head), no row maxima or rescale): dS rounded to e4m3 at another scale,
  so the gradients within a few e4m3 roundings of the default's, within
  the bounds of `_check_against_rounding`, bitwise the same from one run
  to the next; the forward unchanged. (Each variant's dS rounding adds
  about 3% to the gradients' error against float32 on these inputs,
  independently: 0.1 bounds their difference.)"""
  block_kv = config.FP8_BLOCK_KV[shape[-1]][not causal]
  _check_variant(shape, causal, 1e-1, *(jax_flash.MosaicBlockSizes(
      overlap=True, fp8_backward=True, block_kv=block_kv, fp8_ds_bound=on)
                                        for on in (False, True)))


def test_ds_bound_bounds_ds():
  """`flash_bwd.ds_bound` (`fp8_ds_bound`'s scale): at or above |dS| =
  |P (dP - D)| over each (batch, KV head)'s query heads, rows and keys,
  with a logsumexp cotangent in D and large values; within 2^7 of it on
  these inputs (the bound spends at most seven of e4m3's binades)."""
  from pallas_kernels.mosaic_gpu.flash_bwd import ds_bound
  b, t, s, n, kv, h = 2, 300, 280, 8, 2, 64
  keys = jax.random.split(jax.random.key(3), 5)
  q = jax.random.normal(keys[0], (b, t, n, h))
  k, v = (c * jax.random.normal(x, (b, s, kv, h))
          for c, x in ((1.0, keys[1]), (30.0, keys[2])))
  do = jax.random.normal(keys[3], (b, t, n, h))
  kk, vv = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
  p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, kk) * h ** -0.5, -1)
  o = jnp.einsum("bnts,bsnh->btnh", p, vv)
  delta = (jnp.einsum("btnh,btnh->bnt", do, o)
           - 5.0 * jax.random.normal(keys[4], (b, n, t)))
  ds = p * (jnp.einsum("btnh,bsnh->bnts", do, vv) - delta[..., None])
  actual = jnp.abs(ds).reshape(b, kv, n // kv, t, s).max(axis=(2, 3, 4))
  bound = ds_bound(do, v, delta, kv)
  assert bound.shape == (b, kv)
  assert bool(jnp.all(actual <= bound))
  assert bool(jnp.all(bound <= 2.0 ** 7 * actual))


def _check_variant(shape, causal, bound, blocks, variant):
  """fp8=True on the Mosaic kernels at tiles `variant` against `blocks`
  (a GPU's): output and gradients within `bound` (relative) of each
  other, the variant's gradients bitwise the same from one run to the
  next, and within `_check_against_rounding`'s bounds."""
  if not HOPPER:
    pytest.skip("not a Hopper GPU")
  q, k, v, do = random_inputs(*shape, jnp.bfloat16)
  calls = [functools.partial(jax_flash.flash_attention, is_causal=causal,
                             fp8=True, implementation="mosaic",
                             block_sizes=b) for b in (blocks, variant)]
  outs = [jax.jit(f)(q, k, v) for f in calls]
  assert _rel(outs[1], outs[0]) < bound / 2
  grads = [jax.jit(lambda *a, f=f: _grads(f, *a))(q, k, v, do)
           for f in calls]
  for a, b in zip(grads[1], grads[0]):
    assert _rel(a, b) < bound
  again = jax.jit(lambda *a: _grads(calls[1], *a))(q, k, v, do)
  for a, b in zip(grads[1], again):
    assert bool(jnp.all(a == b))
  _check_against_rounding(calls[1], q, k, v, do, causal)


def test_e4m3_column_permutation_is_the_stores():
  """`tiles.E4m3Tiles.permute` moves column 8 h + 2 t + b of each
  16-column window to 4 t + 2 h + b (t < 4, h < 2, b < 2): where
  `stmatrix` stores put lane t's column pairs of two adjacent 8-column
  tiles; any axis; a matmul contracting two operands both permuted so
  gives the same product; without `stmatrix`, nothing moves."""
  import numpy as np

  from pallas_kernels.mosaic_gpu.tiles import E4m3Tiles
  tiles = E4m3Tiles(stmatrix=True)
  got = np.asarray(tiles.permute(jnp.arange(48)))
  for window in range(3):
    for t in range(4):
      for h in range(2):
        for b in range(2):
          assert got[16 * window + 4 * t + 2 * h + b] == (
              16 * window + 8 * h + 2 * t + b)
  a = jax.random.normal(jax.random.key(0), (8, 32))
  b = jax.random.normal(jax.random.key(1), (32, 5))
  permuted = tiles.permute(a) @ tiles.permute(b, axis=0)
  np.testing.assert_allclose(permuted, a @ b, rtol=1e-5, atol=1e-5)
  assert E4m3Tiles().permute(a) is a
