"""FP8 (`fp8=True`) against our bf16 kernels and cuDNN's bf16: speed and error.

    PYTHONPATH=. python benchmarks/fp8.py [--seq-len 8192] \
        [--head-dims 128 256] [--parts speed error tiles exponentials overlap]

For each head dim and causality, at `--seq-len` tokens (batch and heads
from `--tokens` and `--hidden`, as `benchmarks.harness`): ms and TFLOP/s of
jitted calls forward, backward and forward+backward for "bf16" (the
default dispatch on bf16 inputs), "fp8" (the same with fp8=True: on an
H100/H200 the Mosaic FP8 forward, and the FP8 backward at head dims 128
and 256, the bf16 one on the rounded values at 64), "fp8_bwd16" (the
same with the bf16 backward on the rounded values,
`MosaicBlockSizes(fp8_backward=False)`), "fp8_stmatrix" (the fp8 call with
its e4m3 tiles stored by `stmatrix`, `MosaicBlockSizes.e4m3_stmatrix`),
"fp8_registers" (the e4m3 tiles handed to wgmma from registers,
`MosaicBlockSizes.e4m3_registers` and `e4m3_registers_bwd`),
"fp8_e4m3" (forward only: float8
inputs quantized beforehand, with descale), "cudnn" (jax.nn, bf16) and, forward only, "cudnn_fp8" (cuDNN's
FP8 attention through jax's private `fused_attention_stablehlo` API, the
inputs rounded with one scale a tensor, its output e4m3 with V's scale).
Then, at `--error-len` tokens, the error (RMS over RMS) of the FP8
calls' outputs and gradients against float32 attention on the
unquantized inputs, beside that of exact attention on the inputs rounded
to e4m3 (`jax_flash.core.fp8.round_trip`) and of the bf16 call. One JSON
line a row; an implementation that refuses a call gets its error.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import harness as benchmark
from jax_flash.core import fp8
from jax_flash.core.operands import Operands


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))


def cudnn_fp8(causal):
  """cuDNN's FP8 forward as f(q, k, v) on bf16 inputs: each tensor
  divided by max |x| / 448 and rounded to e4m3 (the scales given as its
  descales), P scaled by 448 into e4m3, the e4m3 output scaled by V's
  scale (attention's output is at most max |V|)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  def f(q, k, v):
    scales = [jnp.max(jnp.abs(x.astype(jnp.float32))) / fp8.E4M3_MAX
              for x in (q, k, v)]
    q8, k8, v8 = ((x.astype(jnp.float32) / s).astype(fp8.E4M3)
                  for x, s in zip((q, k, v), scales))
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {name: one for name in cudnn.fp8_params_keys}
    params.update(descale_q=one * scales[0], descale_k=one * scales[1],
                  descale_v=one * scales[2], scale_s=one * fp8.E4M3_MAX,
                  descale_s=one / fp8.E4M3_MAX, scale_o=one / scales[2],
                  descale_o=one * scales[2])
    out, _, _ = cudnn.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=q.shape[-1] ** -0.5,
        mask_type=(cudnn.MaskType.CAUSAL if causal else
                   cudnn.MaskType.NO_MASK), use_fp8=True)
    return (out.astype(jnp.float32) * scales[2]).astype(q.dtype)
  return f


def _call_blocks(q, k, causal):
  """The Mosaic tiles the default dispatch gives an fp8=True call on q, k
  (`MosaicGpuBackend.config`)."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.problem import Problem
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu.backend import MosaicGpuBackend
  b, t, n, h = q.shape
  problem = Problem(batch=b, q_len=t, kv_len=k.shape[1], num_heads=n,
                    num_kv_heads=k.shape[2], head_dim=h, unbatched=False)
  return MosaicGpuBackend().config(
      None, problem, q.dtype, is_causal=causal,
      scores=Scores(scale=h ** -0.5, fp8="amax"),
      mask=Mask(is_causal=causal))


def _float8_inputs(q, k, v):
  """(descale, [q8, k8, v8]): the inputs quantized by the caller, as
  float8 inputs with `descale` take them (per (batch, KV head) scales)."""
  heads = k.shape[2]
  descale = tuple(fp8.scales(x, heads) for x in (q, k, v))
  return descale, [fp8.quantize(x, s, heads)
                   for x, s in zip((q, k, v), descale)]


def fp8_variant(causal, **changes):
  """fp8=True on the Mosaic kernels at the tiles the default gives the
  call, with `changes` (BlockSizes fields), as f(q, k, v)."""
  def f(q, k, v):
    return jax_flash.flash_attention(
        q, k, v, is_causal=causal, fp8=True, implementation="mosaic",
        block_sizes=dataclasses.replace(_call_blocks(q, k, causal),
                                        **changes))
  return f


def fp8_backward(causal, on=True, **changes):
  """fp8=True on the Mosaic kernels with the FP8 backward
  (`MosaicBlockSizes.fp8_backward`; `on` False: the bf16 backward on the
  rounded values) as f(q, k, v), at the tiles the default gives the call
  otherwise, with `changes` (BlockSizes fields)."""
  def f(q, k, v):
    return jax_flash.flash_attention(
        q, k, v, is_causal=causal, fp8=True, implementation="mosaic",
        block_sizes=dataclasses.replace(_call_blocks(q, k, causal),
                                        fp8_backward=on, **changes))
  return f


def backward_tiles(head_dim, causal, seq_len, tokens, hidden, calls,
                   repeats, stages):
  """The FP8 backward's tiles: ms of the fp8=True call's backward with the
  FP8 backward kernels at `stages` pipeline stages and 64- or 128-row K/V
  tiles in the dQ kernel, beside the default's."""
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  rows = [("fp8", {}, lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, fp8=True))]
  for num_stages in stages:
    for block_kv_dq in (64, 128):
      changes = dict(num_stages_bwd=num_stages, block_kv_dq=block_kv_dq)
      rows.append(("fp8_bwd8", changes, fp8_backward(causal, **changes)))
  for name, changes, fn in rows:
    row = dict(kind="backward_tiles", impl=name, head_dim=head_dim,
               causal=causal, seq_len=seq_len, **changes)
    try:
      row.update(benchmark._measure(fn, "bwd", q, k, v, do, flops, calls,
                                    repeats))
    except Exception as e:  # Shared memory a variant lacks: say so.
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps(row), flush=True)


def _inputs(head_dim, causal, seq_len, tokens, hidden):
  """bf16 q, k, v, dO [B, L, N, H] (batch and heads from `tokens` and
  `hidden`) and the forward's FLOPs."""
  heads = hidden // head_dim
  batch = max(1, tokens // seq_len)
  keys = jax.random.split(jax.random.key(head_dim), 4)
  q, k, v, do = (jax.random.normal(kk, (batch, seq_len, heads, head_dim),
                                   jnp.bfloat16) for kk in keys)
  flops = 4 * batch * heads * seq_len * seq_len * head_dim / (2 if causal
                                                                else 1)
  return q, k, v, do, flops


def speed(head_dim, causal, seq_len, tokens, hidden, calls, repeats,
          names=None):
  """The speed rows of the implementations `names` (None: all)."""
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  batch, heads = q.shape[0], q.shape[2]
  impls = {
      "bf16": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal),
      "fp8": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal, fp8=True),
      # fp8=True with Q and K rotated first (the outliers' cure): its cost.
      "fp8_rotate": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=causal, fp8="rotate"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
      "cudnn_fp8": cudnn_fp8(causal),
      "fp8_bwd16": fp8_backward(causal, on=False),
      # The e4m3 tiles stored by stmatrix (`MosaicBlockSizes.e4m3_stmatrix`).
      "fp8_stmatrix": fp8_variant(causal, e4m3_stmatrix=True),
      # The e4m3 tiles handed to wgmma from registers
      # (`MosaicBlockSizes.e4m3_registers`, `e4m3_registers_bwd`).
      "fp8_registers": fp8_variant(causal, e4m3_registers=True,
                                   e4m3_registers_bwd=True),
      # dS scaled by one bound a (batch, KV head)
      # (`MosaicBlockSizes.fp8_ds_bound`).
      "fp8_ds_bound": fp8_variant(causal, fp8_ds_bound=True),
  }
  # Inputs the caller quantized (forward only): float8 with descale.
  descale, e4m3 = _float8_inputs(q, k, v)
  impls["fp8_e4m3"] = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, descale=descale)
  for name, fn in impls.items():
    if names is not None and name not in names:
      continue
    forward_only = name in ("cudnn_fp8", "fp8_e4m3")
    args = e4m3 if name == "fp8_e4m3" else (q, k, v)
    for mode in ("fwd",) if forward_only else ("fwd", "bwd", "fwd+bwd"):
      row = dict(kind="speed", impl=name, mode=mode, head_dim=head_dim,
                 causal=causal, seq_len=seq_len, batch=batch, heads=heads)
      row.update(benchmark._measure(fn, mode, *args, do, flops, calls,
                                    repeats))
      print(json.dumps(row), flush=True)


def _kernels(q, k, v, causal):
  """kernel(blocks, fp8_on) -> f(q, k, v): the Mosaic forward kernel alone
  (`flash_fwd.flash_forward`) at tiles `blocks`, in FP8 on the e4m3
  values fp8=True rounds q, k, v to (whatever f is given), else in bf16
  on f's arguments."""
  from jax_flash.core.mask import Mask
  from jax_flash.core.scores import Scores
  from pallas_kernels.mosaic_gpu import flash_fwd
  mask, scale = Mask(is_causal=causal), q.shape[-1] ** -0.5
  parts = [fp8.rounded(x, k.shape[2]) for x in (q, k, v)]
  q8, k8, vt8, scales = flash_fwd.fp8_operands(Operands(**fp8.as_operands(
      *(x8 for _, x8, _ in parts), [s for _, _, s in parts])))

  def kernel(blocks, fp8_on):
    def f(q, k, v):
      if fp8_on:
        return flash_fwd.flash_forward(
            q8, k8, vt8, Operands(), mask=mask,
            scores=Scores(scale=scale, fp8="amax"), block_sizes=blocks,
            fp8_scales=scales)[0]
      return flash_fwd.flash_forward(q, k, v, Operands(), mask=mask,
                                     scores=Scores(scale=scale),
                                     block_sizes=blocks)[0]
    return f
  return kernel


def tiles(head_dim, causal, seq_len, tokens, hidden, calls, repeats,
          block_kvs, stages):
  """The FP8 forward's K/V tile rows and pipeline stages (with `overlap`,
  not persistent): ms of the fp8=True
  call's forward (the same XLA passes around each) and of the Mosaic FP8
  kernel alone on e4m3 inputs (`flash_fwd.flash_forward`), beside the bf16
  kernel alone at its default tiles."""
  from pallas_kernels.mosaic_gpu import config
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  batch, heads = q.shape[0], q.shape[2]
  default = config.BlockSizes.get_default(head_dim, causal, kv_len=seq_len)
  kernel = _kernels(q, k, v, causal)

  rows = [("bf16_kernel", None, default, kernel(default, False))]
  for block_kv in block_kvs:
    for num_stages in stages:
      try:
        blocks = dataclasses.replace(default, block_kv=block_kv,
                                     num_stages=num_stages, overlap=True)
      except ValueError as e:
        print(json.dumps(dict(kind="tiles", head_dim=head_dim, error=str(e))))
        continue
      rows.append(("fp8_kernel", (block_kv, num_stages), blocks,
                   kernel(blocks, True)))
      rows.append(("fp8_call", (block_kv, num_stages), blocks,
                   lambda q, k, v, b=blocks: jax_flash.flash_attention(
                       q, k, v, is_causal=causal, fp8=True, block_sizes=b,
                       implementation="mosaic")))
  for name, tile, _, fn in rows:
    row = dict(kind="tiles", impl=name, head_dim=head_dim, causal=causal,
               seq_len=seq_len, batch=batch, heads=heads,
               block_kv=tile and tile[0], num_stages=tile and tile[1])
    row.update(benchmark._measure(fn, "fwd", q, k, v, do, flops, calls,
                                  repeats))
    print(json.dumps(row), flush=True)


def exponentials(head_dim, causal, seq_len, tokens, hidden, calls, repeats):
  """What the forward step's exponentials cost: ms of the Mosaic FP8 kernel
  alone on e4m3 inputs and of the bf16 kernel alone, at their default
  tiles (not persistent), as they are and with no exponential at all (P =
  the exponential's argument: wrong values, the time of a step whose
  exponentials were free)."""
  from pallas_kernels.mosaic_gpu import config, tiles
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  kernel = _kernels(q, k, v, causal)
  for fp8_on in (True, False):
    blocks = config.BlockSizes.get_default(head_dim, causal, kv_len=seq_len)
    if fp8_on:
      blocks = dataclasses.replace(
          blocks, block_kv=config.FP8_BLOCK_KV[head_dim][not causal])
    f = kernel(blocks, fp8_on)
    for exponentials_on in (True, False):
      row = dict(kind="exponentials",
                 impl="fp8_kernel" if fp8_on else "bf16_kernel",
                 head_dim=head_dim, causal=causal, seq_len=seq_len,
                 block_kv=blocks.block_kv, exponentials=exponentials_on)
      # Traced (in _measure) with online_softmax's exp2 patched out.
      tiles.jnp = tiles.jnp if exponentials_on else _NoExp2()
      try:
        row.update(benchmark._measure(f, "fwd", q, k, v, do, flops, calls,
                                      repeats))
      finally:
        tiles.jnp = jnp
      print(json.dumps(row), flush=True)


def overlap(head_dim, causal, seq_len, tokens, hidden, calls, repeats):
  """`MosaicBlockSizes.overlap` off and on: ms of the forward of the bf16
  call (reference), of fp8=True and of float8 inputs with descale
  ("fp8_e4m3"), each at the tiles the default gives the call, and of the
  Mosaic FP8 kernel alone at its default tiles not persistent."""
  from pallas_kernels.mosaic_gpu import config
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  default = _call_blocks(q, k, causal)
  kernel = _kernels(q, k, v, causal)
  descale, e4m3 = _float8_inputs(q, k, v)
  kernel_blocks = dataclasses.replace(
      config.BlockSizes.get_default(head_dim, causal, kv_len=seq_len),
      block_kv=config.FP8_BLOCK_KV[head_dim][not causal])
  rows = [("bf16", False, (q, k, v), lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal))]
  for on in (False, True):
    blocks = dataclasses.replace(default, overlap=on)
    rows += [
        ("fp8", on, (q, k, v), lambda q, k, v, b=blocks:
         jax_flash.flash_attention(q, k, v, is_causal=causal, fp8=True,
                                   implementation="mosaic", block_sizes=b)),
        ("fp8_e4m3", on, e4m3, lambda q, k, v, b=blocks:
         jax_flash.flash_attention(q, k, v, is_causal=causal,
                                   descale=descale, implementation="mosaic",
                                   block_sizes=b)),
        ("fp8_kernel", on, (q, k, v), kernel(
            dataclasses.replace(kernel_blocks, overlap=on), True))]
  for name, on, args, fn in rows:
    row = dict(kind="overlap", impl=name, overlap=on, head_dim=head_dim,
               causal=causal, seq_len=seq_len, block_kv=default.block_kv,
               persistent=default.persistent)
    row.update(benchmark._measure(fn, "fwd", *args, do, flops, calls,
                                  repeats))
    print(json.dumps(row), flush=True)


def persistent(head_dim, causal, seq_len, tokens, hidden, calls, repeats):
  """The FP8 forward (with its overlap) one CTA an item or persistent: ms
  of the kernel alone at 2 and 3 stages and of the float8-input call at 2,
  beside the bf16 call."""
  from pallas_kernels.mosaic_gpu import config
  q, k, v, do, flops = _inputs(head_dim, causal, seq_len, tokens, hidden)
  kernel = _kernels(q, k, v, causal)
  descale, e4m3 = _float8_inputs(q, k, v)
  base = config.BlockSizes(block_kv=config.FP8_BLOCK_KV[head_dim][not causal],
                           overlap=True)
  rows = [("bf16_call", None, None, (q, k, v), lambda q, k, v:
           jax_flash.flash_attention(q, k, v, is_causal=causal))]
  for on in (False, True):
    for stages in (2, 3):
      blocks = dataclasses.replace(base, persistent=on, num_stages=stages)
      rows.append(("fp8_kernel", on, stages, (q, k, v), kernel(blocks, True)))
    rows.append(("fp8_e4m3_call", on, 2, e4m3,
                 lambda q, k, v, b=dataclasses.replace(base, persistent=on):
                 jax_flash.flash_attention(
                     q, k, v, is_causal=causal, descale=descale,
                     implementation="mosaic", block_sizes=b)))
  for name, on, stages, args, fn in rows:
    row = dict(kind="persistent", impl=name, head_dim=head_dim,
               causal=causal, seq_len=seq_len, persistent=on,
               num_stages=stages)
    row.update(benchmark._measure(fn, "fwd", *args, do, flops, calls,
                                  repeats))
    print(json.dumps(row), flush=True)


class _NoExp2:
  """jax.numpy with exp2 the identity (`exponentials`' ablation)."""

  def __getattr__(self, name):
    return (lambda x: x) if name == "exp2" else getattr(jnp, name)


def error(head_dim, causal, seq_len, outliers, names=None):
  """Errors against float32 on the unquantized inputs of the
  implementations `names` (None: all); `outliers`: two feature columns of
  Q and K 20x the rest."""
  keys = jax.random.split(jax.random.key(1), 4)
  shape = (1, seq_len, 8, head_dim)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
  if outliers:
    cols = jnp.ones(head_dim).at[jnp.array([3, 17])].set(20.0)
    q, k = (q * cols).astype(jnp.bfloat16), (k * cols / 4.5).astype(
        jnp.bfloat16)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  exact = lambda q, k, v: jax_flash.reference_attention(q, k, v,
                                                        is_causal=causal)
  rounded = lambda q, k, v: exact(*(fp8.round_trip(x, 8) for x in (q, k, v)))
  calls = {"fp8": lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=causal, fp8=True),
           "fp8_rotate": lambda q, k, v: jax_flash.flash_attention(
               q, k, v, is_causal=causal, fp8="rotate"),
           "fp8_bwd8": fp8_backward(causal),
           "fp8_ds_bound": fp8_variant(causal, fp8_ds_bound=True),
           "bf16": lambda q, k, v: jax_flash.flash_attention(
               q, k, v, is_causal=causal),
           "rounding_alone": rounded}

  def grads(f, *args):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        f(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))(*args)
  want_o = jax.jit(exact)(*up)
  want_g = grads(exact, *up)
  calls["cudnn_fp8"] = cudnn_fp8(causal)  # Forward only.
  for name, f in calls.items():
    if names is not None and name not in names:
      continue
    args = up if name == "rounding_alone" else (q, k, v)
    row = dict(kind="error", impl=name, head_dim=head_dim, causal=causal,
               seq_len=seq_len, outliers=outliers)
    try:
      row["out"] = _rel(jax.jit(f)(*args), want_o)
      if name != "cudnn_fp8":
        row.update({f"d{n}": _rel(g, w) for n, g, w in zip(
            "qkv", grads(f, *args), want_g)})
    except Exception as e:  # cuDNN's FP8 off an H100/H200: say so.
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps(row), flush=True)


def _scaled_round(x, bound):
  """x float32 rounded to e4m3 with the power-of-two scale `fp8.scale_of`
  gives `bound` (an array that broadcasts against x: a bound on |x| where
  it broadcasts). The e4m3 values pass an optimization barrier, as in
  `fp8.quantize_p`: XLA on a GPU would drop the round trip."""
  scale = fp8.scale_of(bound)
  x8 = jax.lax.optimization_barrier((x / scale).astype(fp8.E4M3))
  return x8.astype(jnp.float32) * scale


def _tile_round(x, tile):
  """x [B, N, T, S] float32 rounded to e4m3 with a power-of-two scale per
  tile x tile block (from its max |x|: `_scaled_round`)."""
  b, n, t, s = x.shape
  blocks = x.reshape(b, n, t // tile, tile, s // tile, tile)
  amax = jnp.max(jnp.abs(blocks), axis=(3, 5), keepdims=True)
  return _scaled_round(blocks, amax).reshape(x.shape)


# Which of the backward's matmuls take e4m3 operands (`backward_error`),
# and how dS is scaled for dQ and dK: a scale per tile x tile block, per
# (batch, head) from its max |dS| ("head"), per query row from its max
# |dS| ("row"), or from bounds known before the backward: per query row
# 2 ||dO_i|| max_j ||V_j|| max_j P_ij ("row_bound"; max_j P_ij =
# exp(m_i - lse_i), m_i the forward's row max of the logits), per (batch,
# head) 1.25 (max_i ||dO_i|| max_j ||V_j|| + max_i |D_i|) ("head_bound",
# `flash_bwd.ds_bound`: no reduction of dS at all).
BACKWARD_VARIANTS = {
    "rounded_inputs": (),
    "dv_dp": ("dv", "dp"),
    "dq_dk_tile": ("dq", "dk"),
    "dq_dk_head": ("dq", "dk", "head"),
    "all_tile": ("dv", "dp", "dq", "dk"),
    "all_row": ("dv", "dp", "dq", "dk", "row"),
    "all_row_bound": ("dv", "dp", "dq", "dk", "row_bound"),
    "all_head_bound": ("dv", "dp", "dq", "dk", "head_bound"),
}


def backward_error(head_dim, seq_len, outliers, tile=128):
  """The backward's matmuls in e4m3, each variant of BACKWARD_VARIANTS
  against float32 on the unquantized inputs (causal, 8 heads): Algorithm
  2 in full matrices on the inputs rounded as fp8=True rounds them (P
  recomputed from the rounded logits). "dv", "dp": dV = P^T dO and dP =
  dO V^T with P as e4m3 values of P * 448 and dO rounded with
  per-(batch, head) power-of-two scales; "dq", "dk": dQ = dS K and dK =
  dS^T Q with dS rounded with a scale per tile x tile block ("head": one
  per (batch, head), which needs dS's max before the matmuls). Beside:
  the gradients of exact attention on the rounded inputs (the rounding
  alone). Matmuls in float32 (a GPU would round
  them to TF32 by default, an error of its own)."""
  with jax.default_matmul_precision("highest"):
    keys = jax.random.split(jax.random.key(1), 4)
    shape = (1, seq_len, 8, head_dim)
    q, k, v, do = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
    if outliers:
      cols = jnp.ones(head_dim).at[jnp.array([3, 17])].set(20.0)
      q, k = q * cols, k * cols / 4.5
    exact = lambda q, k, v: jax_flash.reference_attention(q, k, v,
                                                          is_causal=True)

    def grads(f, *args):  # The arrays as arguments: XLA folds constants.
      return jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(f(q, k, v) * do),
                              argnums=(0, 1, 2)))(*args, do)
    want = grads(exact, q, k, v)
    q8, k8, v8, do8 = (fp8.round_trip(x, 8) for x in (q, k, v, do))
    row = dict(kind="backward_error", head_dim=head_dim, seq_len=seq_len,
               outliers=outliers, tile=tile)
    alone = grads(exact, q8, k8, v8)
    print(json.dumps(dict(row, impl="rounding_alone", **{
        f"d{n}": _rel(g, w) for n, g, w in zip("qkv", alone, want)})),
          flush=True)
    scale = head_dim ** -0.5
    t = jnp.arange(seq_len)
    visible = t[:, None] >= t[None, :]

    @functools.partial(jax.jit, static_argnums=0)
    def backward(parts, q8, k8, v8, do, do8):
      bnth = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, N, H] -> [B, N, T, H]
      qh, kh, vh = bnth(q8), bnth(k8), bnth(v8)
      s = jnp.where(visible, scale * qh @ kh.swapaxes(-1, -2), -jnp.inf)
      p = jax.nn.softmax(s, axis=-1)
      o = p @ vh
      dof = bnth(do)
      delta = jnp.sum(dof * o, axis=-1, keepdims=True)
      dov = bnth(do8) if {"dv", "dp"} & set(parts) else dof
      p_in = (fp8.quantize_p(p) / fp8.E4M3_MAX if "dv" in parts else p)
      dv = p_in.swapaxes(-1, -2) @ (dov if "dv" in parts else dof)
      dp = (dov if "dp" in parts else dof) @ vh.swapaxes(-1, -2)
      ds = p * (dp - delta)
      norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
      v_max = jnp.max(norm(vh), axis=-2, keepdims=True)
      if "row" in parts:
        ds = _scaled_round(ds, jnp.max(jnp.abs(ds), -1, keepdims=True))
      elif "row_bound" in parts:
        ds = _scaled_round(ds, 2 * norm(dof) * v_max
                           * jnp.max(p, -1, keepdims=True))
      elif "head_bound" in parts:  # As `flash_bwd.ds_bound`.
        ds = _scaled_round(ds, 1.25 * (
            jnp.max(norm(dof), -2, keepdims=True) * v_max
            + jnp.max(jnp.abs(delta), -2, keepdims=True)))
      elif "dq" in parts:
        ds = (_tile_round(ds, seq_len) if "head" in parts else
              _tile_round(ds, tile))
      dq = scale * ds @ kh
      dk = scale * ds.swapaxes(-1, -2) @ qh
      back = lambda x: x.transpose(0, 2, 1, 3)
      return back(dq), back(dk), back(dv)
    for name, parts in BACKWARD_VARIANTS.items():
      got = backward(parts, q8, k8, v8, do, do8)
      errs = {f"d{n}": _rel(g, w) for n, g, w in zip("qkv", got, want)}
      ratios = {f"d{n}/alone": errs[f"d{n}"] / _rel(a, w)
                for n, a, w in zip("qkv", alone, want)}
      print(json.dumps(dict(row, impl=name, **errs, **ratios)), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--error-len", type=int, default=2048)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--parts", nargs="+", default=["speed", "error"],
                      choices=["speed", "error", "tiles", "backward",
                               "backward_tiles", "exponentials",
                               "overlap", "persistent"])
  parser.add_argument("--block-kvs", type=int, nargs="+",
                      default=[64, 128, 192, 256])
  parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
  parser.add_argument("--impls", nargs="+", default=None,
                      help="the speed and error parts' implementations "
                      "(default: all)")
  parser.add_argument("--masks", nargs="+", default=["causal", "none"],
                      choices=["causal", "none"],
                      help="the causalities the per-causality parts run")
  args = parser.parse_args()
  shape = (args.seq_len, args.tokens, args.hidden, args.calls, args.repeats)
  per_causality = {  # Each run at every head dim and each of --masks.
      "tiles": lambda h, c: tiles(h, c, *shape, args.block_kvs, args.stages),
      "exponentials": lambda h, c: exponentials(h, c, *shape),
      "overlap": lambda h, c: overlap(h, c, *shape),
      "persistent": lambda h, c: persistent(h, c, *shape),
      "backward_tiles": lambda h, c: backward_tiles(h, c, *shape,
                                                    args.stages),
      "speed": lambda h, c: speed(h, c, *shape, args.impls),
  }
  for part, run in per_causality.items():
    for head_dim in args.head_dims if part in args.parts else ():
      for mask in args.masks:
        run(head_dim, mask == "causal")
  for head_dim in args.head_dims if "error" in args.parts else ():
    for outliers in (False, True):
      error(head_dim, True, args.error_len, outliers, args.impls)
  for head_dim in args.head_dims if "backward" in args.parts else ():
    for outliers in (False, True):
      backward_error(head_dim, args.error_len, outliers)


if __name__ == "__main__":
  main()
