"""Side-by-side attention benchmark: `python -m benchmarks.harness`.

Runs ours (FlashAttention-2, and the FlashAttention-1 forward) next to
`jax.nn.dot_product_attention` with implementation="cudnn" and "xla" in one
process, on the same random inputs. Timing: after a warm-up call, `--calls`
back-to-back calls are dispatched with no host sync between them and the
batch is timed as a whole; the median over `--repeats` batches is reported.
FLOPs: forward 4*B*N*T*S*H (halved for causal), backward 2.5x forward.
Writes `<out>/benchmark.json` and `<out>/benchmark.md`.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.testing import relative_error


SOFT_CAP = 30.0  # The "_softcap" rows' logits_soft_cap (Gemma 2's).


def _impls(causal: bool):
  def ours(version, implementation="triton", soft_cap=None):
    return lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=causal, implementation=implementation,
        version=version, logits_soft_cap=soft_cap)

  def mosaic_fused_dq(q, k, v):
    # The Mosaic kernels with dQ in the dK/dV kernel (head dims 64, 128),
    # the forward as the default (the calls here have no mask but causality).
    blocks = jax_flash.MosaicBlockSizes.get_default(
        q.shape[-1], causal, fused_dq=True, band_only=True,
        kv_len=k.shape[1])
    return jax_flash.flash_attention(q, k, v, is_causal=causal,
                                     implementation="mosaic",
                                     block_sizes=blocks)

  def mosaic_alibi(positions: bool):
    # ALiBi with its paper's geometric slopes (its cost: -slope |i - j| a
    # score, forward and backward): the default (by vectors, on K/V
    # tiles of at most 128 rows), or by position tiles on the default
    # tiles without ALiBi (`MosaicBlockSizes.alibi_vectors=False`).
    def attention(q, k, v):
      n = q.shape[2]
      slopes = 2.0 ** (-8.0 * jnp.arange(1, n + 1, dtype=jnp.float32) / n)
      blocks = None
      if positions:
        blocks = dataclasses.replace(jax_flash.MosaicBlockSizes.get_default(
            q.shape[-1], causal, band_only=True, kv_len=k.shape[1]),
                                     alibi_vectors=False)
      return jax_flash.flash_attention(
          q, k, v, is_causal=causal, implementation="mosaic",
          alibi_slopes=slopes, block_sizes=blocks)
    return attention

  def jax_nn(impl):
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl)

  def jax_pallas(q, k, v):
    # jax's own Pallas-Triton attention, with the backward tiles the notes
    # measured best (its default 32x32 backward is about 2x slower).
    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as jpa
    return jpa.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal,
                   block_sizes=jpa.BlockSizes(128, 128, 64, 64, 64, 64))

  def tokamax_mosaic(q, k, v):
    # Google's Pallas kernel library, its Mosaic GPU attention (on the GPU
    # machine from wheels: scripts/tokamax_wheels.sh).
    import tokamax
    return tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation="mosaic")

  modes = ("fwd", "bwd", "fwd+bwd")
  # name -> (function, modes it is timed in)
  return {
      "flash_v2": (ours(2), modes),
      "flash_v1": (ours(1), ("fwd",)),
      # The Mosaic GPU kernels (the backward is flash_v2's at head dim 256).
      "flash_mosaic": (ours(2, "mosaic"), modes),
      # The same with a tanh soft-cap (its cost: a tanh per score, forward
      # and backward); nothing else in the table computes this function.
      "flash_mosaic_softcap": (ours(2, "mosaic", SOFT_CAP), modes),
      # The same with ALiBi, by vectors (the default) or by position tiles
      # (`MosaicBlockSizes.alibi_vectors`).
      "flash_mosaic_alibi": (mosaic_alibi(False), modes),
      "flash_mosaic_alibi_positions": (mosaic_alibi(True), modes),
      # dQ added by TMA reduce-add in the dK/dV kernel: not bitwise
      # deterministic, an option (`MosaicBlockSizes.fused_dq`).
      "flash_mosaic_fused_dq": (mosaic_fused_dq, ("bwd", "fwd+bwd")),
      "flash_v2_softcap": (ours(2, soft_cap=SOFT_CAP), modes),
      "cudnn": (jax_nn("cudnn"), modes),
      # cuDNN compiled as XLA compiles for deterministic results (its
      # backward like our default: the same bits every run).
      "cudnn_deterministic": (
          _Compiled(jax_nn("cudnn"), DETERMINISTIC_OPTIONS),
          ("bwd", "fwd+bwd")),
      "xla": (jax_nn("xla"), modes),
      # Our blockwise FlashAttention in plain JAX (memory linear in the
      # sequence; what the dispatch runs where no kernel takes the call).
      "flash_xla": (ours(2, "xla"), modes),
      "jax_pallas": (jax_pallas, modes),
      "tokamax": (tokamax_mosaic, modes),
  }


MIN_TIMED_SECONDS = 0.02
# Untimed back-to-back calls before the timed batches (the GPU idles while
# each program compiles).
WARMUP_SECONDS = 0.2


def _time(fn, args, calls: int, repeats: int) -> float:
  """Median seconds a call over `repeats` batches of back-to-back calls,
  after a warm-up of WARMUP_SECONDS; a batch has `calls` calls or more,
  enough to last MIN_TIMED_SECONDS (fast kernels: a few calls would time
  the launch). `fn` is called as users call it: a jitted function
  (dispatched by jit's C++ path), or a compiled executable.
  """
  jax.block_until_ready(fn(*args))  # First run (a jitted `fn` compiles).
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - start
  calls = max(calls, min(1000, int(MIN_TIMED_SECONDS / max(once, 1e-6))))
  out = None
  for _ in range(min(10000, int(WARMUP_SECONDS / max(once, 1e-6)))):
    out = fn(*args)
  jax.block_until_ready(out)
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / calls)
  return statistics.median(per_call)


_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # x forward FLOPs


@dataclasses.dataclass(frozen=True)
class _WithArrays:
  """fn(q, k, v, *arrays), timed with the arrays as arguments of the jitted
  program: closed over, a large one (a bias per head and pair) would be
  embedded in it as a constant. Gradients are taken for q, k, v only."""
  fn: Callable
  arrays: tuple


# XLA's compile options for operations that give the same bits every run
# (openxla/xla docs/determinism.md: attention among those that otherwise
# may not).
DETERMINISTIC_OPTIONS = {"xla_gpu_exclude_nondeterministic_ops": True}


@dataclasses.dataclass(frozen=True)
class _Compiled:
  """fn, each of its timed programs compiled with XLA `options`."""
  fn: Callable
  options: dict


def _jitted(fn, mode, q, k, v, do):
  """(jitted function, its arguments) running `fn` forward, backward or both."""
  if isinstance(fn, _Compiled):
    jitted, args = _jitted(fn.fn, mode, q, k, v, do)
    return jitted.lower(*args).compile(compiler_options=fn.options), args
  arrays = ()
  if isinstance(fn, _WithArrays):
    fn, arrays = fn.fn, fn.arrays
  if mode == "fwd":
    return jax.jit(fn), (q, k, v, *arrays)
  if mode == "bwd":  # The vjp closure (residuals included) is a pytree.
    jitted = jax.jit(fn)
    _, vjp_fn = jax.vjp(lambda q, k, v: jitted(q, k, v, *arrays), q, k, v)
    return jax.jit(lambda vjp_fn, do: vjp_fn(do)), (vjp_fn, do)
  return (jax.jit(lambda q, k, v, do, *arrays: jax.vjp(
      lambda q, k, v: fn(q, k, v, *arrays), q, k, v)[1](do)),
          (q, k, v, do, *arrays))


def compiled_gib(jitted, *args) -> float:
  """XLA's compiled memory of `jitted(*args)` (per device): arguments +
  outputs + temporaries, GiB. Compiles, does not run."""
  mem = jitted.lower(*args).compile().memory_analysis()
  return (mem.argument_size_in_bytes + mem.output_size_in_bytes
          + mem.temp_size_in_bytes) / 2**30


def _measure(fn, mode, q, k, v, do, fwd_flops, calls, repeats):
  """{"ms", "tflops", "first_call_s"} of `fn` forward, backward or both,
  or {"error"}. first_call_s: the first call of the jitted function in this
  process (tracing and compiling it; kernels another row traced already
  are not traced again)."""
  try:
    f, args = _jitted(fn, mode, q, k, v, do)
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - start
    seconds = _time(f, args, calls, repeats)
    flops = fwd_flops * _FLOPS[mode]
    return dict(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                first_call_s=first)
  except Exception as e:  # OOM or unsupported: say so, go on.
    traceback.print_exc(limit=2)
    return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def gpu_times(folder: str, calls: int) -> dict:
  """{"ops": {XLA op: ms a call}, "kernels": {GPU kernel: ms a call},
  "launches": kernels a call} from the `jax.profiler` trace in `folder`
  of `calls` calls (a training step's, an attention call's)."""
  path = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
  data = jax.profiler.ProfileData.from_file(path[0])
  ops, kernels = collections.Counter(), collections.Counter()
  launches = 0
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      into = ops if line.name == "XLA Ops" else (
          kernels if line.name.startswith("Stream") else None)
      if into is None:
        continue
      for event in line.events:
        into[event.name] += event.duration_ns / 1e6 / calls
        launches += into is kernels
  return {"ops": ops, "kernels": kernels, "launches": launches / calls}


def _record(rows, row, log):
  rows.append(row)
  print(json.dumps(row), flush=True)
  if log:
    with open(log, "a") as f:
      f.write(json.dumps(row) + "\n")


def run(head_dims, seq_lens, causals, tokens, hidden, dtype, calls, repeats,
        impl_names, kv_heads=None, log=None):
  """Times every implementation on every shape; one dict per measurement.

  Each row is also appended to the file `log` as it is measured, so a run
  cut short keeps what it measured.
  """
  rows = []
  for head_dim in head_dims:
    num_heads = hidden // head_dim
    num_kv_heads = kv_heads or num_heads
    for seq in seq_lens:
      batch = max(1, tokens // seq)
      keys = jax.random.split(jax.random.key(seq + head_dim), 4)
      q = jax.random.normal(keys[0], (batch, seq, num_heads, head_dim), dtype)
      k = jax.random.normal(keys[1], (batch, seq, num_kv_heads, head_dim),
                            dtype)
      v = jax.random.normal(keys[2], k.shape, dtype)
      do = jax.random.normal(keys[3], q.shape, dtype)
      for causal in causals:
        fwd_flops = 4 * batch * num_heads * seq * seq * head_dim
        fwd_flops /= 2 if causal else 1
        impls = _impls(causal)
        reference_out = None
        for name in impl_names:
          fn, modes = impls[name]
          for mode in modes:
            row = dict(impl=name, mode=mode, head_dim=head_dim, seq_len=seq,
                       batch=batch, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, causal=causal,
                       dtype=jnp.dtype(dtype).name)
            row.update(_measure(fn, mode, q, k, v, do, fwd_flops, calls,
                                repeats))
            # (The soft-capped and ALiBi rows compute another function.)
            if (mode == "fwd" and "error" not in row and
                not name.endswith("_softcap") and "_alibi" not in name):
              out = jax.jit(fn)(q, k, v)  # Compiled already: a cache hit.
              if reference_out is None:
                reference_out = out
              row["rel_err_vs_first"] = relative_error(out, reference_out)
            _record(rows, row, log)
  return rows


def run_sparse(scenario, head_dim, hidden, seq_len, sizes, dtype, calls,
               repeats, log=None):
  """Sliding windows or packed documents: time against the visible pairs.

  scenario "window": causal, local_window_size=(w, 0) for w in `sizes`;
  "documents": causal within each of d equal packed documents, d in `sizes`;
  "padding": causal, the last p keys padding, p in `sizes`: as lengths
  (flash_v2, cudnn), a [1, 1, 1, S] key mask (flash_key_mask: folded into
  ids) and the same mask as [1, 1, T, S] (flash_dense_mask: read per tile;
  triton_/mosaic_dense_mask: the same on each backend, named), and beside
  the lengths a float32 bias per (head, pair) (triton_/mosaic_bias) or per
  key (triton_/mosaic_key_bias).
  FLOPs count only the visible (query, key) pairs: 4*N*H per pair forward,
  3.5x that forward+backward. The full causal problem is timed alongside, so
  time / full-causal time can be read against visible / full-causal pairs.
  "flex" rows are the same masks written as mask_mods for `flex_attention`
  (formulas of the indices, no array); "flex_ids" (documents) reads the
  documents' ids from an array the mask_mod closes over (the Triton kernels
  read it element by element); "flex_table" (documents, full causal only)
  adds a relative-bias table read by a score_mod.
  """
  num_heads = hidden // head_dim
  keys = jax.random.split(jax.random.key(seq_len), 4)
  q, k, v, do = (jax.random.normal(kk, (1, seq_len, num_heads, head_dim),
                                   dtype) for kk in keys)
  rows = []
  positions = jnp.arange(seq_len)
  for size in (None,) + tuple(sizes):
    kwargs, visible = {"is_causal": True}, seq_len * (seq_len + 1) / 2
    label = "full causal"
    mask_mod = lambda b, h, qi, ki: qi >= ki
    if size is not None and scenario == "window":
      kwargs["local_window_size"] = (size, 0)
      visible = sum(min(i, size) + 1 for i in range(seq_len))
      label = f"window {size}"
      mask_mod = lambda b, h, qi, ki, w=size: (qi >= ki) & (qi - ki <= w)
    elif size is not None and scenario == "padding":
      keep = seq_len - size
      kwargs["key_value_seq_lengths"] = jnp.array([keep])
      visible = sum(min(i + 1, keep) for i in range(seq_len))
      label = f"last {size} keys padding"
      mask_mod = lambda b, h, qi, ki, n=keep: (qi >= ki) & (ki < n)
    elif size is not None:
      doc = seq_len // size
      ids = (positions // doc)[None]
      kwargs["segment_ids"] = ids
      visible = size * doc * (doc + 1) / 2
      label = f"{size} documents"
      mask_mod = lambda b, h, qi, ki, d=doc: (qi >= ki) & (qi // d == ki // d)
    block_mask = jax_flash.create_block_mask(mask_mod, None, None, seq_len,
                                             seq_len)
    impls = {"flash_v2": lambda q, k, v, kw=kwargs: jax_flash.flash_attention(
        q, k, v, implementation="pallas", **kw),
             "flex": lambda q, k, v, bm=block_mask: jax_flash.flex_attention(
                 q, k, v, block_mask=bm)}
    if "key_value_seq_lengths" in kwargs:  # The same keys hidden by masks.
      keys = (positions < kwargs["key_value_seq_lengths"][0])[None, None, None]
      pairs = jnp.broadcast_to(keys, (1, 1, seq_len, seq_len))
      impls["flash_key_mask"] = lambda q, k, v, m=keys: (
          jax_flash.flash_attention(q, k, v, mask=m, is_causal=True,
                                    implementation="pallas"))
      impls["flash_dense_mask"] = _WithArrays(
          lambda q, k, v, m: jax_flash.flash_attention(
              q, k, v, mask=m, is_causal=True, implementation="pallas"),
          (pairs,))
      # The dense mask, and a float32 bias per (head, pair) or per key
      # beside the same lengths, on each backend by name.
      b1, b2 = jax.random.split(jax.random.key(seq_len + 1))
      pair_bias = jax.random.normal(b1, (1, num_heads, seq_len, seq_len))
      key_bias = jax.random.normal(b2, (1, 1, 1, seq_len))
      for backend in ("triton", "mosaic"):
        impls[f"{backend}_dense_mask"] = _WithArrays(
            lambda q, k, v, m, i=backend: jax_flash.flash_attention(
                q, k, v, mask=m, is_causal=True, implementation=i), (pairs,))
        for name, bias in (("bias", pair_bias), ("key_bias", key_bias)):
          impls[f"{backend}_{name}"] = _WithArrays(
              lambda q, k, v, b, i=backend, kw=kwargs:
              jax_flash.flash_attention(q, k, v, b, implementation=i, **kw),
              (bias,))
    if size is None and scenario == "documents":
      # A relative-bias table read by a score_mod (T5-style, frozen here:
      # the kernels run it; a trained table's gradient would add the
      # blockwise backward).
      table = jnp.linspace(-1.0, 1.0, 2 * seq_len)
      impls["flex_table"] = lambda q, k, v, bm=block_mask, t=table: (
          jax_flash.flex_attention(
              q, k, v, lambda s, b, h, qi, ki: s + t[qi - ki + seq_len], bm))
    if "segment_ids" in kwargs:
      by_ids = lambda b, h, qi, ki, i=ids[0]: (qi >= ki) & (i[qi] == i[ki])
      impls["flex_ids"] = lambda q, k, v, bm=jax_flash.create_block_mask(
          by_ids, None, None, seq_len, seq_len): jax_flash.flex_attention(
              q, k, v, block_mask=bm)
    if "segment_ids" not in kwargs:
      impls["cudnn"] = lambda q, k, v, kw=kwargs: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn", **kw)
    else:  # cuDNN through jax.nn takes no segment ids: XLA with a dense mask.
      dense = (ids[:, :, None] == ids[:, None, :])[:, None]
      impls["xla_dense_mask"] = lambda q, k, v, m=dense: (
          jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True,
                                       implementation="xla"))
    for name, fn in impls.items():
      for mode in ("fwd", "fwd+bwd"):
        row = dict(scenario=scenario, case=label, impl=name, mode=mode,
                   seq_len=seq_len, head_dim=head_dim, num_heads=num_heads,
                   visible_fraction=visible / (seq_len * (seq_len + 1) / 2))
        row.update(_measure(fn, mode, q, k, v, do,
                            4 * num_heads * head_dim * visible, calls,
                            repeats))
        _record(rows, row, log)
  return rows


def _paged_cache(kc, vc, page_size: int, key):
  """The cache kc, vc [B, S, K, H] as pages [B * S / p, p, K, H] in a
  shuffled order, and its page table [B, S / p]: (k_pages, v_pages, table)."""
  batch, cache_len = kc.shape[:2]
  num = batch * cache_len // page_size
  order = jax.random.permutation(key, num)
  table = order.reshape(batch, cache_len // page_size).astype(jnp.int32)
  pages = [jnp.zeros((num, page_size) + x.shape[2:], x.dtype).at[order].set(
      x.reshape((num, page_size) + x.shape[2:])) for x in (kc, vc)]
  return (*pages, table)


def _arguments(args):
  """A row's arguments: a tuple, or a function making them (a paged copy
  of the cache, built only while its row runs: at batch 64 x 128k each
  copy is 17 GB)."""
  return args() if callable(args) else args


def _paged_decode(lengths, implementation="pallas", num_splits=None):
  return lambda q, k_pages, v_pages, table: jax_flash.flash_decode(
      q, kv_lengths=lengths, key_pages=k_pages, value_pages=v_pages,
      page_table=table, implementation=implementation, num_splits=num_splits)


def run_prefill(head_dim, hidden, kv_heads, cache_len, chunks, dtype, calls,
                repeats, log=None):
  """A prompt chunk of T tokens against a cache of `cache_len` (the chunk's
  own keys last): contiguous and paged (16 / 64 tokens a page, shuffled),
  and contiguous on the Mosaic forward; TFLOP/s on the visible pairs (query
  t sees S - T + t + 1 keys), forward."""
  num_heads = hidden // head_dim
  kv_heads = kv_heads or max(1, num_heads // 4)
  keys = jax.random.split(jax.random.key(cache_len), 4)
  kc = jax.random.normal(keys[1], (1, cache_len, kv_heads, head_dim), dtype)
  vc = jax.random.normal(keys[2], kc.shape, dtype)
  lengths = jnp.full((1,), cache_len, jnp.int32)
  rows = []
  for chunk in chunks:
    q = jax.random.normal(keys[0], (1, chunk, num_heads, head_dim), dtype)
    pairs = chunk * (cache_len - chunk) + chunk * (chunk + 1) / 2
    impls = {
        "contiguous": (lambda q, k, v: jax_flash.flash_decode(
            q, k, v, kv_lengths=lengths, implementation="pallas"),
                       (q, kc, vc)),
        "paged_16": (_paged_decode(lengths),
                     lambda: (q, *_paged_cache(kc, vc, 16, keys[3]))),
        "paged_64": (_paged_decode(lengths),
                     lambda: (q, *_paged_cache(kc, vc, 64, keys[3]))),
        # The Mosaic forward with query offsets (Hopper; an error row
        # elsewhere or for chunks it does not take).
        "contiguous_mosaic": (lambda q, k, v: jax_flash.flash_decode(
            q, k, v, kv_lengths=lengths, implementation="mosaic"),
                              (q, kc, vc)),
    }
    for name, (fn, args) in impls.items():
      row = dict(scenario="prefill", impl=name, chunk=chunk,
                 cache_len=cache_len, num_heads=num_heads,
                 num_kv_heads=kv_heads, head_dim=head_dim)
      try:
        seconds = _time(jax.jit(fn), _arguments(args), calls, repeats)
        row.update(ms=seconds * 1e3,
                   tflops=4 * num_heads * head_dim * pairs / seconds / 1e12)
      except Exception as e:  # Say what failed, go on.
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      _record(rows, row, log)
  return rows


def decode_inputs(keys, batch, cache_len, num_heads, kv_heads, head_dim,
                  dtype):
  """(one new query [B, 1, N, H], full caches [B, S, K, H], lengths [B]),
  standard normal from three PRNG keys."""
  q = jax.random.normal(keys[0], (batch, 1, num_heads, head_dim), dtype)
  kc = jax.random.normal(keys[1], (batch, cache_len, kv_heads, head_dim),
                         dtype)
  vc = jax.random.normal(keys[2], kc.shape, dtype)
  return q, kc, vc, jnp.full((batch,), cache_len, jnp.int32)


def copy_bandwidth(calls: int, repeats: int) -> float:
  """Bytes a second of a device copy (`x + 1` over 2 GiB: read + write)."""
  big = jnp.ones((2 ** 30,), jnp.bfloat16)
  return 2 * big.size * 2 / _time(jax.jit(lambda x: x + 1), (big,), calls,
                                  repeats)


def run_decode(head_dim, hidden, kv_heads, cache_lens, batches, dtype, calls,
               repeats, log=None):
  """One new token per sequence against a full cache: achieved bandwidth.

  Bytes counted: the K and V cache read once (2 * B * S * K * H * itemsize).
  The same run times a device copy (read + write) as the ceiling. The
  "paged_16"/"paged_32"/"paged_64" rows read the same cache as pages of 16,
  32 and 64 tokens in a random order (`flash_decode(key_pages=...,
  page_table=...)`).
  """
  num_heads = hidden // head_dim
  kv_heads = kv_heads or max(1, num_heads // 4)
  rows = []
  copy_bw = copy_bandwidth(calls, repeats)
  for batch in batches:
    for cache_len in cache_lens:
      keys = jax.random.split(jax.random.key(cache_len + batch), 3)
      q, kc, vc, lengths = decode_inputs(keys, batch, cache_len, num_heads,
                                         kv_heads, head_dim, dtype)
      nbytes = 2 * kc.size * kc.dtype.itemsize
      paged_decode = _paged_decode(lengths)
      # name: (function, its arguments)
      impls = {
          "flash_decode": lambda q, k, v: jax_flash.flash_decode(
              q, k, v, kv_lengths=lengths, implementation="pallas"),
          "paged_16": (paged_decode,
                       lambda: (q, *_paged_cache(kc, vc, 16, keys[2]))),
          "paged_32": (paged_decode,
                       lambda: (q, *_paged_cache(kc, vc, 32, keys[2]))),
          "paged_64": (paged_decode,
                       lambda: (q, *_paged_cache(kc, vc, 64, keys[2]))),
          "xla": lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, key_value_seq_lengths=lengths, implementation="xla"),
          "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, key_value_seq_lengths=lengths,
              implementation="cudnn"),
      }
      for name, fn in impls.items():
        fn, args = fn if isinstance(fn, tuple) else (fn, (q, kc, vc))
        row = dict(scenario="decode", impl=name, batch=batch,
                   cache_len=cache_len, num_heads=num_heads,
                   num_kv_heads=kv_heads, head_dim=head_dim,
                   copy_tb_s=copy_bw / 1e12)
        try:
          seconds = _time(jax.jit(fn), _arguments(args), calls, repeats)
          row.update(us=seconds * 1e6, tb_s=nbytes / seconds / 1e12,
                     of_copy=nbytes / seconds / copy_bw)
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        _record(rows, row, log)
  return rows


def markdown_decode(rows) -> str:
  lines = [f"Device copy (read + write): {rows[0]['copy_tb_s']:.2f} TB/s.\n",
           "| batch | cache | impl | us | TB/s (K+V read) | of copy |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    cells = (f"{r['us']:.1f} | {r['tb_s']:.2f} | {r['of_copy']:.2f}"
             if "us" in r else "fails | - | -")
    lines.append(f"| {r['batch']} | {r['cache_len']} | {r['impl']} | "
                 f"{cells} |")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """One attention call of a public model's configuration."""
  name: str
  source: str  # Where the configuration comes from.
  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  value_head_dim: int | None = None
  causal: bool = False
  soft_cap: float | None = None


# Shapes from public model configurations (batch sizes are ours: a few
# thousand to a few hundred thousand tokens a call).
MODELS = (
    ModelShape("gpt2_small", "GPT-2 small: 12 heads of 64, 1024 tokens",
               16, 1024, 1024, 12, 12, 64, causal=True),
    ModelShape("llama3_8b", "Llama 3 8B: 32 heads of 128 on 8 KV heads",
               2, 8192, 8192, 32, 8, 128, causal=True),
    ModelShape("phi2", "Phi-2: 32 heads of 80", 4, 2048, 2048, 32, 32, 80,
               causal=True),
    ModelShape("gemma2_9b", "Gemma 2 9B: 16 heads of 256 on 8, soft-cap 50",
               2, 4096, 4096, 16, 8, 256, causal=True, soft_cap=50.0),
    ModelShape("deepseek_v2_mla", "DeepSeek-V2 MLA: query/key 192, value 128",
               1, 4096, 4096, 16, 16, 192, value_head_dim=128, causal=True),
    ModelShape("vit_b16", "ViT-B/16 at 224 px: 197 tokens, 12 heads of 64",
               128, 197, 197, 12, 12, 64),
    ModelShape("dit_xl2", "DiT-XL/2 at 256 px: 256 tokens, 16 heads of 72",
               64, 256, 256, 16, 16, 72),
    ModelShape("sd15_unet", "Stable Diffusion 1.5 UNet, 64x64 latents: 8 "
               "heads of 40", 8, 4096, 4096, 8, 8, 40),
    ModelShape("sd15_cross", "Stable Diffusion 1.5 cross-attention: 4096 "
               "queries on 77 text tokens", 8, 4096, 77, 8, 8, 40),
    ModelShape("whisper_cross", "Whisper large decoder cross-attention: 448 "
               "queries on 1500 audio frames, 20 heads of 64",
               16, 448, 1500, 20, 20, 64),
    ModelShape("whisper_encoder", "Whisper large encoder: 1500 frames",
               8, 1500, 1500, 20, 20, 64),
    ModelShape("falcon_7b", "Falcon-7B: 71 query heads of 64 on one KV head "
               "(multi-query)", 4, 2048, 2048, 71, 1, 64, causal=True),
)
# Shapes like those of `MODELS` that no default was chosen on (`--held-out`).
HELD_OUT = (
    ModelShape("vit_l14", "ViT-L/14 at 224 px: 257 tokens, 16 heads of 64",
               64, 257, 257, 16, 16, 64),
    ModelShape("vit_h14", "ViT-H/14 at 224 px: 257 tokens, 16 heads of 80",
               64, 257, 257, 16, 16, 80),
    ModelShape("bert_base", "BERT-base: 512 tokens, 12 heads of 64", 32, 512,
               512, 12, 12, 64),
    ModelShape("clip_text", "CLIP text encoder: 77 tokens, causal, 12 heads "
               "of 64", 256, 77, 77, 12, 12, 64, causal=True),
    ModelShape("t5_cross", "T5-base cross-attention: 128 queries on 512",
               64, 128, 512, 12, 12, 64),
    ModelShape("llava_cross", "1k queries on 576 image tokens, 32 of 128",
               8, 1024, 576, 32, 32, 128),
    ModelShape("seq_1k_h128_causal", "1k tokens, causal, 16 heads of 128 on 4",
               16, 1024, 1024, 16, 4, 128, causal=True),
)


def even_neighbours(m: ModelShape) -> list[ModelShape]:
  """The shapes nearest `m` whose lengths are even, below and above: what
  cuDNN's backward takes where it refuses an odd length (with its
  TFLOP/s there, the target for a call it refuses)."""
  below = dataclasses.replace(m, q_len=m.q_len - m.q_len % 2,
                              kv_len=m.kv_len - m.kv_len % 2)
  above = dataclasses.replace(m, q_len=m.q_len + m.q_len % 2,
                              kv_len=m.kv_len + m.kv_len % 2)
  return [s for s in (below, above) if s != m]


def model_rows(shapes, impl_names, dtype, calls, repeats, log=None,
               extra_impls=None):
  """Forward and forward+backward of each model shape, each implementation
  in turn (jitted calls); a shape an implementation refuses gets its error.
  jax.nn's rows (no soft-cap; V padded to the query's head dim where it
  has its own) are the baselines the targets name. FLOPs: 2 B N T S
  (H + Hv) forward, halved for causal; 3.5x that forward+backward.
  "flash_triton": our Triton kernels named, beside the default (the Mosaic
  GPU kernels on Hopper where they take the call). extra_impls(shape):
  more implementations by name, for a shape. Where cuDNN refuses a
  sequence length, rows "cudnn_nearest" time it at `even_neighbours`."""
  rows = []
  for m in shapes:
    case = _model_case(m, dtype, extra_impls)
    for name in impl_names:
      for mode in ("fwd", "fwd+bwd"):
        row = _model_row(case, name, mode, calls, repeats)
        _record(rows, row, log)
        if name == "cudnn" and "sequence length" in row.get("error", ""):
          for near in even_neighbours(m):
            row = _model_row(_model_case(near, dtype, None), name, mode,
                             calls, repeats)
            _record(rows, dict(row, model=m.name, impl="cudnn_nearest"), log)
  return rows


def _model_case(m, dtype, extra_impls):
  """(row fields, inputs (q, k, v, dO), forward FLOPs, impls by name) of
  one model shape."""
  hv = m.value_head_dim or m.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (m.batch, m.q_len, m.heads, m.head_dim),
                        dtype)
  k = jax.random.normal(keys[1], (m.batch, m.kv_len, m.kv_heads,
                                  m.head_dim), dtype)
  v = jax.random.normal(keys[2], (m.batch, m.kv_len, m.kv_heads, hv), dtype)
  do = jax.random.normal(keys[3], q.shape[:-1] + (hv,), dtype)
  flops = 2 * m.batch * m.heads * m.q_len * m.kv_len * (m.head_dim + hv)
  flops /= 2 if m.causal else 1

  def jax_nn(impl):
    # jax.nn takes no value head dim of its own: V padded to the query's
    # (MLA's baseline, cuDNN at 192/192), the output cut back.
    def f(q, k, v):
      if hv == m.head_dim:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=m.causal, implementation=impl)
      v = jnp.pad(v, ((0, 0),) * 3 + ((0, m.head_dim - hv),))
      return jax.nn.dot_product_attention(
          q, k, v, is_causal=m.causal, implementation=impl)[..., :hv]
    return f

  impls = {
      "flash": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=m.causal, logits_soft_cap=m.soft_cap),
      "flash_triton": lambda q, k, v: jax_flash.flash_attention(
          q, k, v, is_causal=m.causal, logits_soft_cap=m.soft_cap,
          implementation="triton"),
      "cudnn": jax_nn("cudnn"), "xla": jax_nn("xla"),
      **(extra_impls(m) if extra_impls else {}),
  }
  fields = dict(model=m.name, source=m.source, held_out=m in HELD_OUT,
                batch=m.batch, q_len=m.q_len,
                kv_len=m.kv_len, heads=m.heads, kv_heads=m.kv_heads,
                head_dim=m.head_dim, value_head_dim=hv, causal=m.causal,
                soft_cap=m.soft_cap, dtype=jnp.dtype(dtype).name)
  return fields, (q, k, v, do), flops, impls


def _model_row(case, name, mode, calls, repeats):
  fields, inputs, flops, impls = case
  row = dict(fields, impl=name, mode=mode)
  row.update(_measure(impls[name], mode, *inputs, flops, calls, repeats))
  return row


def markdown_models(rows) -> str:
  """One line per model: ms of each implementation, forward and
  forward+backward, ours against cuDNN (or XLA where cuDNN refuses), and
  the first forward+backward call's seconds (tracing and compiling in
  this process), ours and cuDNN's."""
  impls = [i for i in ("flash", "flash_triton", "cudnn", "xla") if any(
      r["impl"] == i for r in rows)]
  cols = [(i, m) for m in ("fwd", "fwd+bwd") for i in impls]
  head = ("| model | shape | " + " | ".join(f"{i} {m} ms" for i, m in cols)
          + " | flash / best other fwd | fwd+bwd | first fwd+bwd s, flash "
          "/ cudnn |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  by = {}
  nearest = {}  # (model, mode): cuDNN's best TFLOP/s at an even neighbour.
  for r in rows:
    if r["impl"] == "cudnn_nearest":
      if "tflops" in r:
        key = (r["model"], r["mode"])
        nearest[key] = max(nearest.get(key, 0.0), r["tflops"])
      continue
    by.setdefault(r["model"], {})[(r["impl"], r["mode"])] = r
  if nearest:
    lines[0] += " flash TFLOP/s / cuDNN's at the nearest shape it takes |"
    lines[1] += "---|"
  for model, group in by.items():
    r0 = next(iter(group.values()))
    shape = (f"{r0['batch']} x {r0['q_len']}/{r0['kv_len']}, "
             f"{r0['heads']}/{r0['kv_heads']} x {r0['head_dim']}"
             f"{'/' + str(r0['value_head_dim']) if r0['value_head_dim'] != r0['head_dim'] else ''}"
             f"{', causal' if r0['causal'] else ''}")
    cells = [f"{group[c]['ms']:.3f}" if "ms" in group.get(c, {}) else
             "refused" for c in cols]
    ratios = []
    for mode in ("fwd", "fwd+bwd"):
      ours = group.get(("flash", mode), {}).get("ms")
      others = [group[(i, mode)]["ms"] for i in ("cudnn", "xla")
                if "ms" in group.get((i, mode), {})]
      ratios.append(f"{min(others) / ours:.2f}" if ours and others else "-")
    first = [group.get((i, "fwd+bwd"), {}).get("first_call_s")
             for i in ("flash", "cudnn")]
    ratios.append(" / ".join(f"{s:.2f}" if s is not None else "-"
                             for s in first))
    if nearest:
      ours = {mode: group.get(("flash", mode), {}).get("tflops")
              for mode in ("fwd", "fwd+bwd")}
      ratios.append(", ".join(
          f"{mode} {ours[mode] / nearest[model, mode]:.2f}"
          for mode in ours if (model, mode) in nearest and ours[mode])
                    or "-")
    name = f"{model} (held out)" if r0.get("held_out") else model
    lines.append(f"| {name} | {shape} | " + " | ".join(cells) + " | "
                 + " | ".join(ratios) + " |")
  return "\n".join(lines)


def markdown_sparse(rows) -> str:
  full = {(r["impl"], r["mode"]): r.get("ms") for r in rows
          if r["case"] == "full causal"}
  lines = ["| case | visible / causal | impl | mode | ms | time / causal "
           "time | TFLOP/s on visible pairs |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    base = full.get((r["impl"], r["mode"]))
    if "ms" in r:
      rel = f"{r['ms'] / base:.3f}" if base else "-"
      cells = f"{r['ms']:.2f} | {rel} | {r['tflops']:.0f}"
    else:
      cells = "OOM | - | -" if "RESOURCE_EXHAUSTED" in r["error"] else (
          "fails | - | -")
    lines.append(f"| {r['case']} | {r['visible_fraction']:.3f} | {r['impl']} "
                 f"| {r['mode']} | {cells} |")
  return "\n".join(lines)


def markdown(rows) -> str:
  """One line per (head dim, seq, causal): TFLOP/s and the ratio to cuDNN."""
  def key(r):
    return (r["head_dim"], r["seq_len"], r["causal"])
  groups = {}
  for r in rows:
    groups.setdefault(key(r), {})[(r["impl"], r["mode"])] = r
  present = {(r["impl"], r["mode"]) for r in rows}
  cols = [c for c in [
      ("flash_mosaic", "fwd"), ("flash_v2", "fwd"), ("flash_v1", "fwd"),
      ("cudnn", "fwd"), ("tokamax", "fwd"),
      ("jax_pallas", "fwd"), ("xla", "fwd"), ("flash_xla", "fwd"),
      ("flash_mosaic", "bwd"), ("flash_mosaic_fused_dq", "bwd"),
      ("flash_v2", "bwd"), ("cudnn", "bwd"), ("cudnn_deterministic", "bwd"),
      ("tokamax", "bwd"),
      ("jax_pallas", "bwd"),
      ("flash_mosaic", "fwd+bwd"), ("flash_mosaic_fused_dq", "fwd+bwd"),
      ("flash_v2", "fwd+bwd"),
      ("tokamax", "fwd+bwd"),
      ("cudnn", "fwd+bwd"), ("cudnn_deterministic", "fwd+bwd"),
      ("jax_pallas", "fwd+bwd"), ("xla", "fwd+bwd"),
      ("flash_xla", "fwd+bwd")]
          if c in present]
  # (ours, theirs, mode): the ratios of TFLOP/s shown, where both ran.
  short = {"flash_mosaic": "mosaic", "flash_v2": "v2", "cudnn": "cuDNN",
           "tokamax": "tokamax", "flash_mosaic_fused_dq": "fused_dq",
           "cudnn_deterministic": "cuDNN-det"}
  ratios = [(a, b, m) for a, b in (("flash_mosaic", "cudnn"),
                                   ("flash_mosaic", "cudnn_deterministic"),
                                   ("flash_mosaic_fused_dq", "cudnn"),
                                   ("flash_v2", "cudnn"),
                                   ("flash_mosaic", "tokamax"),
                                   ("flash_mosaic", "flash_v2"))
            for m in ("fwd", "bwd", "fwd+bwd")
            if (a, m) in present and (b, m) in present]
  names = ([f"{i} {m}" for i, m in cols] +
           [f"{short[a]}/{short[b]} {m}" for a, b, m in ratios])
  head = "| H | seq | causal | " + " | ".join(names) + " |"
  lines = [head, "|" + "---|" * (head.count("|") - 1)]

  def fmt(r):
    if r is None:
      return "-"
    if "tflops" in r:
      return f"{r['tflops']:.0f}"
    return "OOM" if "RESOURCE_EXHAUSTED" in r.get("error", "") else "fails"

  def ratio(g, ours, theirs, mode):
    a, b = g.get((ours, mode)), g.get((theirs, mode))
    if a and b and "tflops" in a and "tflops" in b:
      return f"{a['tflops'] / b['tflops']:.2f}"
    return "-"

  for (h, s, c), g in sorted(groups.items()):
    cells = [fmt(g.get(col)) for col in cols]
    cells += [ratio(g, *r) for r in ratios]
    lines.append(f"| {h} | {s} | {'yes' if c else 'no'} | " +
                 " | ".join(cells) + " |")
  return "\n".join(lines)


def markdown_first_calls(rows) -> str:
  """One line per (head dim, seq, causal): each row's first_call_s."""
  columns = sorted({(r["impl"], r["mode"]) for r in rows
                    if "first_call_s" in r})
  head = "| H | seq | causal | " + " | ".join(
      f"{i} {m}" for i, m in columns) + " |"
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  groups = {}
  for r in rows:
    groups.setdefault((r["head_dim"], r["seq_len"], r["causal"]), {})[
        (r["impl"], r["mode"])] = r
  for (h, seq, causal), group in sorted(groups.items()):
    cells = [f"{group[c]['first_call_s']:.2f}"
             if "first_call_s" in group.get(c, {}) else "-" for c in columns]
    lines.append(f"| {h} | {seq} | {causal} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows, out_dir):
  """tflops.png: TFLOP/s against sequence length, per head dim and mode."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  head_dims = sorted({r["head_dim"] for r in rows})
  modes = [m for m in _FLOPS if any(r["mode"] == m for r in rows)]
  fig, axes = plt.subplots(len(head_dims), len(modes), squeeze=False,
                           figsize=(5 * len(modes), 3.5 * len(head_dims)))
  for (i, h), (j, mode) in itertools.product(enumerate(head_dims),
                                             enumerate(modes)):
    ax = axes[i][j]
    for (impl, causal) in sorted({(r["impl"], r["causal"]) for r in rows}):
      pts = sorted((r["seq_len"], r["tflops"]) for r in rows
                   if r["impl"] == impl and r["causal"] == causal and
                   r["mode"] == mode and r["head_dim"] == h and "tflops" in r)
      if pts:
        ax.plot(*zip(*pts), marker="o", linestyle="--" if causal else "-",
                label=f"{impl}{' causal' if causal else ''}")
    ax.set_xscale("log", base=2)
    ax.set_title(f"head dim {h}, {mode}")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "tflops.png"), dpi=90)
  plt.close(fig)


def memory_rows(head_dim, hidden, seq_lens, dtype, implementation):
  """Compiled temp memory of jit(grad) of causal attention: ours vs XLA."""
  rows = []
  num_heads = hidden // head_dim
  for seq in seq_lens:
    x = jax.ShapeDtypeStruct((1, seq, num_heads, head_dim), dtype)
    for name, fn in (
        ("flash_v2", lambda q, k, v: jax_flash.flash_attention(
            q, k, v, is_causal=True, implementation=implementation)),
        ("xla", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"))):
      loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
          x, x, x).compile()
      rows.append(dict(impl=name, seq_len=seq, head_dim=head_dim,
                       temp_bytes=compiled.memory_analysis().temp_size_in_bytes))
  return rows


def plot_memory(rows, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for impl in sorted({r["impl"] for r in rows}):
    pts = sorted((r["seq_len"], r["temp_bytes"] / 2**30) for r in rows
                 if r["impl"] == impl)
    ax.plot(*zip(*pts), marker="o", label=impl)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length")
  ax.set_ylabel("compiled temp memory of jit(grad), GiB")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "memory.png"), dpi=90)
  plt.close(fig)


def render(meta, rows, note="") -> str:
  """The Markdown page for one run: what ran, how, and the table."""
  return (f"# Benchmark, {meta['date'][:10]}, {meta['device']}, "
          f"jax {meta['jax']}\n\n`{meta['command']}`\n\n"
          "TFLOP/s (forward 4*B*N*T*S*H, halved for causal; fwd+bwd 3.5x "
          "forward); batch = tokens / seq_len, num_heads = hidden / head_dim. "
          "OOM: ran out of the GPU's memory; -: not run.\n\n"
          + (note + "\n\n" if note else "") + markdown(rows) + "\n\n"
          "First call of each jitted function, seconds (tracing and "
          "compiling it in a process that ran the rows above it):\n\n"
          + markdown_first_calls(rows) + "\n")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--render", metavar="JSON",
                      help="print the Markdown page of a saved run and exit "
                      "(no GPU needed)")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128],
                      help="head dims H to time (num_heads = hidden / H)")
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      help="sequence lengths (query = key); decode: cache "
                      "lengths; window/documents: the one sequence length",
                      default=[1024, 2048, 4096, 8192, 16384])
  parser.add_argument("--causal", choices=["both", "yes", "no"],
                      help="causal masks, non-causal, or both (dense)",
                      default="both")
  parser.add_argument("--tokens", type=int, default=16384,
                      help="batch = tokens // seq_len")
  parser.add_argument("--hidden", type=int, default=2048,
                      help="num_heads = hidden // head_dim")
  parser.add_argument("--kv-heads", type=int, default=None,
                      help="GQA: key/value heads (default: num_heads)")
  parser.add_argument("--dtype", default="bfloat16",
                      help="input dtype (bfloat16, float16, float32)")
  parser.add_argument("--impls", nargs="+",
                      help="implementations, side by side: flash_mosaic "
                      "(Mosaic GPU forward), flash_v2 and flash_v1 (Triton), "
                      "flash_mosaic_softcap and flash_v2_softcap (the same "
                      f"with logits_soft_cap={SOFT_CAP}), "
                      "flash_mosaic_fused_dq (the Mosaic kernels with "
                      "MosaicBlockSizes(fused_dq=True): backward only), "
                      "cudnn and xla (jax.nn), cudnn_deterministic (cuDNN "
                      "compiled with XLA's deterministic-ops option: backward "
                      "only), flash_xla (ours in plain JAX, "
                      "blockwise), jax_pallas (jax's own Pallas "
                      "attention), tokamax (its Mosaic GPU attention; needs "
                      "its wheels: scripts/tokamax_wheels.sh)",
                      default=["flash_mosaic", "flash_v2", "flash_v1", "cudnn",
                               "jax_pallas", "xla"])
  parser.add_argument("--calls", type=int, default=10,
                      help="back-to-back calls per timed batch")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed batches; the median is reported")
  parser.add_argument("--out", default="benchmarks/results",
                      help="directory for benchmark.json/.md (and .jsonl, "
                      "each row as measured)")
  parser.add_argument("--plots", action="store_true",
                      help="also write tflops.png and memory.png")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64],
                      help="decode: batch sizes")
  parser.add_argument("--scenario",
                      choices=["dense", "window", "documents", "padding",
                               "decode", "prefill", "models"],
                      default="dense",
                      help="window: causal sliding windows of --sizes over "
                      "one --seq-lens[0] sequence; documents: --sizes packed "
                      "documents (segment ids); padding: the last --sizes "
                      "keys padding (lengths, a key mask, a dense mask); "
                      "decode: one new token against "
                      "caches of --seq-lens, --batches; prefill: chunks of "
                      "--sizes tokens against a --seq-lens[0] cache, "
                      "contiguous and paged; models: shapes of public model "
                      "configurations (`MODELS`), ours against cuDNN and "
                      "XLA")
  parser.add_argument("--models", nargs="+", default=None,
                      help="models: only these rows of `MODELS` (names; "
                      "with --held-out, of `HELD_OUT` too)")
  parser.add_argument("--held-out", action="store_true",
                      help="models: also the shapes of `HELD_OUT`, after "
                      "`MODELS`' (their rows marked held_out)")
  parser.add_argument("--sizes", type=int, nargs="+",
                      default=[1024, 2048, 4096],
                      help="window sizes, numbers of documents, or padding "
                      "keys")
  args = parser.parse_args(argv)
  if args.render:
    with open(args.render) as f:
      saved = json.load(f)
    print(render(saved["meta"], saved["rows"]), end="")
    return
  if jax.default_backend() != "gpu":
    sys.exit("the benchmark times the GPU kernels: no GPU found")
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  os.makedirs(args.out, exist_ok=True)
  open(os.path.join(args.out, "benchmark.jsonl"), "w").close()
  if args.scenario == "prefill":
    rows = run_prefill(args.head_dims[0], args.hidden, args.kv_heads,
                       args.seq_lens[0], args.sizes, jnp.dtype(args.dtype),
                       args.calls, args.repeats,
                       log=os.path.join(args.out, "benchmark.jsonl"))
    lines = ["| chunk | cache | impl | ms | TFLOP/s (visible pairs) |",
             "|---|---|---|---|---|"]
    for r in rows:
      cells = (f"{r['ms']:.2f} | {r['tflops']:.0f}" if "ms" in r else
               "fails | -")
      lines.append(f"| {r['chunk']} | {r['cache_len']} | {r['impl']} | "
                   f"{cells} |")
    with open(os.path.join(args.out, "prefill.md"), "w") as f:
      f.write(f"`python -m benchmarks.harness {' '.join(sys.argv[1:])}`\n\n"
              + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return
  if args.scenario == "models":
    models = MODELS + (HELD_OUT if args.held_out else ())
    if args.models:
      unknown = set(args.models) - {m.name for m in models}
      if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; known: "
                     f"{[m.name for m in models]}")
      models = [m for m in models if m.name in args.models]
    rows = model_rows(models, ["flash", "flash_triton", "cudnn", "xla"],
                      jnp.dtype(args.dtype), args.calls, args.repeats,
                      log=os.path.join(args.out, "benchmark.jsonl"))
    table = markdown_models(rows)
    with open(os.path.join(args.out, "models.json"), "w") as f:
      json.dump(dict(command="python -m benchmarks.harness " + " ".join(
          sys.argv[1:] if argv is None else argv), rows=rows), f, indent=1)
    with open(os.path.join(args.out, "models.md"), "w") as f:
      f.write(f"`python -m benchmarks.harness {' '.join(sys.argv[1:])}`\n\n"
              + table + "\n")
    print(table)
    return
  if args.scenario == "decode":
    rows = run_decode(args.head_dims[0], args.hidden, args.kv_heads,
                      args.seq_lens, args.batches, jnp.dtype(args.dtype),
                      args.calls, args.repeats,
                      log=os.path.join(args.out, "benchmark.jsonl"))
    table = markdown_decode(rows)
    with open(os.path.join(args.out, "decode.md"), "w") as f:
      f.write(f"`python -m benchmarks.harness {' '.join(sys.argv[1:])}`\n\n"
              + table + "\n")
    print(table)
    return
  if args.scenario != "dense":
    rows = run_sparse(args.scenario, args.head_dims[0], args.hidden,
                      args.seq_lens[0], args.sizes, jnp.dtype(args.dtype),
                      args.calls, args.repeats,
                      log=os.path.join(args.out, "benchmark.jsonl"))
    table = markdown_sparse(rows)
    with open(os.path.join(args.out, f"{args.scenario}.md"), "w") as f:
      f.write(f"`python -m benchmarks.harness {' '.join(sys.argv[1:])}`\n\n"
              + table + "\n")
    print(table)
    return
  rows = run(args.head_dims, args.seq_lens, causals, args.tokens, args.hidden,
             jnp.dtype(args.dtype), args.calls, args.repeats, args.impls,
             args.kv_heads, log=os.path.join(args.out, "benchmark.jsonl"))
  meta = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      command="python -m benchmarks.harness " + " ".join(
          sys.argv[1:] if argv is None else argv),
      device=jax.devices()[0].device_kind, jax=jax.__version__,
      python=platform.python_version())
  meta.update(tokens=args.tokens, hidden=args.hidden, dtype=args.dtype)
  with open(os.path.join(args.out, "benchmark.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  page = render(meta, rows)
  with open(os.path.join(args.out, "benchmark.md"), "w") as f:
    f.write(page)
  print(page)
  if args.plots:
    plot(rows, args.out)
    plot_memory(memory_rows(args.head_dims[-1], args.hidden, args.seq_lens,
                            jnp.dtype(args.dtype), "pallas"), args.out)


if __name__ == "__main__":
  main()
