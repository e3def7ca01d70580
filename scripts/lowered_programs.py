"""The lowered GPU programs of a matrix of calls, as digests: a refactor that
leaves every digest unchanged leaves every kernel unchanged.

Each case lowers one call (forward and backward through `jax.grad`, or a
forward or decode alone) for an H200 on any machine, through the public
API only, so the same script reads any commit's tree:

    python scripts/lowered_programs.py --out before.json            # at A
    python scripts/lowered_programs.py --out after.json             # at B
    python scripts/lowered_programs.py --compare before.json after.json

`PYTHONPATH=<tree>` picks the tree (a `git worktree` of the other commit);
`--texts DIR` also writes each program's text (to diff one that changed);
`--only SUBSTRING` keeps the cases whose name holds it. The text holds
every Mosaic GPU kernel's serialized module and every Triton kernel's IR,
without source locations; each case lowers in a process of its own (a
Mosaic GPU module depends on what its process lowered before).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib
from jax._src import source_info_util

import jax_flash

H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                               platform="gpu")
BF16, F32 = jnp.bfloat16, jnp.float32


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _grad(impl, shape, dtype=BF16, value_head_dim=None, bias=None,
          **kwargs):
  """jax.grad of a call with respect to q, k, v (and a bias's shape)."""
  b, t, s, n, k, h = shape
  args = [_sds((b, t, n, h), dtype), _sds((b, s, k, h), dtype),
          _sds((b, s, k, value_head_dim or h), dtype)]
  if bias is not None:
    args.append(_sds(bias, F32))

  def loss(*a):
    out = jax_flash.flash_attention(*a, implementation=impl, **kwargs)
    return jnp.sum(out.astype(F32))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))), args


def _forward(impl, shape, dtype=BF16, **kwargs):
  b, t, s, n, k, h = shape
  args = [_sds((b, t, n, h), dtype), _sds((b, s, k, h), dtype),
          _sds((b, s, k, h), dtype)]
  return jax.jit(lambda *a: jax_flash.flash_attention(
      *a, implementation=impl, **kwargs)), args


def _float8_forward(shape):
  b, t, s, n, k, h = shape
  e4m3 = jnp.float8_e4m3fn
  args = [_sds((b, t, n, h), e4m3), _sds((b, s, k, h), e4m3),
          _sds((b, s, k, h), e4m3)]
  descale = (0.5, 0.25, 1.0)
  return jax.jit(lambda *a: jax_flash.flash_attention(
      *a, is_causal=True, descale=descale, implementation="mosaic")), args


def _decode(impl, q_len, head_dim=128, page_size=None, **kwargs):
  q = _sds((2, q_len, 8, head_dim), BF16)
  lengths = _sds((2,), jnp.int32)
  if page_size is None:
    cache = _sds((2, 2048, 2, head_dim), BF16)
    return jax.jit(lambda q, n, c: jax_flash.flash_decode(
        q, c, c, kv_lengths=n, implementation=impl, **kwargs)), [
            q, lengths, cache]
  pages = _sds((4096 // page_size, page_size, 2, head_dim), BF16)
  table = _sds((2, 2048 // page_size), jnp.int32)
  return jax.jit(lambda q, n, p, t: jax_flash.flash_decode(
      q, kv_lengths=n, key_pages=p, value_pages=p, page_table=t,
      implementation=impl, **kwargs)), [q, lengths, pages, table]


def _flex(impl, shape, mask, score_mod=True):
  b, t, s, n, k, h = shape
  mod = (lambda x, b, h, i, j: x - 0.01 * jnp.abs(i - j)) if score_mod else None
  args = [_sds((b, t, n, h), BF16), _sds((b, s, k, h), BF16),
          _sds((b, s, k, h), BF16)]

  def loss(*a):
    out = jax_flash.flex_attention(*a, mod, block_mask=mask,
                                   implementation=impl)
    return jnp.sum(out.astype(F32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args


def cases():
  """name -> a thunk giving (jitted function, abstract arguments)."""
  m = jax_flash.MosaicBlockSizes
  shape = (2, 300, 520, 8, 2, 128)  # Unaligned lengths, GQA 4.
  ids = (jnp.zeros((2, 300), jnp.int32), jnp.zeros((2, 520), jnp.int32))
  lengths = dict(query_seq_lengths=jnp.array([200, 300]),
                 key_value_seq_lengths=jnp.array([520, 77]))
  masks = {
      "none": {}, "causal": dict(is_causal=True),
      "window": dict(local_window_size=(64, 16)),
      "lengths": dict(is_causal=True, **lengths),
      "segments": dict(is_causal=True, segment_ids=ids),
      "dense": dict(mask=jnp.tril(jnp.ones((300, 520), bool))[None, None]),
      "alibi": dict(is_causal=True,
                    alibi_slopes=jnp.linspace(0.1, 0.8, 8)),
      "softcap": dict(is_causal=True, logits_soft_cap=30.0),
      "sinks": dict(is_causal=True, sinks=jnp.zeros(8)),
      "dropout": dict(is_causal=True, dropout_rate=0.1,
                      dropout_rng=jax.random.key(0)),
      "offset": dict(is_causal=True, query_offset=jnp.array([220, 3])),
  }
  flex_shape = (1, 256, 256, 4, 2, 64)
  block_mask = jax_flash.create_block_mask(  # Made here, on the host.
      lambda b, h, i, j: (i >= j) & (i - j < 200), None, None, 256, 256)
  out = {}
  for impl in ("mosaic", "triton"):
    for name, kwargs in masks.items():
      if name == "offset" and not _has_query_offset():
        continue
      out[f"{impl}/grad/{name}"] = lambda i=impl, kw=kwargs: _grad(
          i, shape, **kw)
    out[f"{impl}/grad/bias_pair"] = lambda i=impl: _grad(
        i, shape, bias=(1, 8, 300, 520), is_causal=True)
    out[f"{impl}/grad/bias_keys"] = lambda i=impl: _grad(
        i, shape, bias=(2, 8, 1, 520))
    for h in (64, 80, 96, 192, 256):
      for causal in (False, True):
        out[f"{impl}/grad/h{h}_causal{int(causal)}"] = (
            lambda i=impl, h=h, c=causal: _grad(
                i, (2, 300, 520, 8, 2, h), is_causal=c))
    out[f"{impl}/grad/mla_192_128"] = lambda i=impl: _grad(
        i, (1, 300, 300, 8, 8, 192), value_head_dim=128, is_causal=True)
    out[f"{impl}/grad/mqa"] = lambda i=impl: _grad(
        i, (2, 300, 520, 8, 1, 64), is_causal=True)
    out[f"{impl}/flex"] = lambda i=impl: _flex(i, flex_shape, block_mask)
    out[f"{impl}/decode/prompt_chunk"] = lambda i=impl: _decode(i, 128)
    out[f"{impl}/decode/tokens_h64"] = lambda i=impl: _decode(i, 2, 64)
    out[f"{impl}/decode/tokens_h128"] = lambda i=impl: _decode(i, 4)
  out["mosaic/flex/mask_only"] = lambda: _flex(
      "mosaic", flex_shape, block_mask, score_mod=False)
  out["triton/decode/paged"] = lambda: _decode("triton", 4, page_size=16)
  out["triton/decode/paged_chunk"] = lambda: _decode("triton", 128,
                                                     page_size=16)
  out["triton/grad/f32_h40"] = lambda: _grad(
      "triton", (2, 300, 250, 8, 2, 40), F32, is_causal=True)
  out["triton/forward/version1"] = lambda: _forward(
      "triton", (2, 300, 250, 8, 2, 64), is_causal=True, version=1)
  # Mosaic variants (block sizes).
  variants = {
      "persistent_h64": ((2, 2048, 2048, 8, 8, 64), dict(is_causal=True),
                         None),
      "not_persistent_h128": ((2, 2048, 2048, 8, 8, 128),
                              dict(is_causal=True), m(persistent=False)),
      "named_barriers": ((2, 1024, 1024, 8, 8, 128), {},
                         m(named_barriers=True)),
      "fused_dq_h64": ((2, 1024, 1024, 8, 8, 64), dict(is_causal=True),
                       m.get_default(64, True, fused_dq=True)),
      "fused_dq_h128": ((2, 1024, 1024, 8, 8, 128), {},
                        m.get_default(128, False, fused_dq=True)),
      "dv_before_ds": ((2, 1024, 1024, 8, 8, 128), dict(is_causal=True),
                       m(dv_before_ds=True)),
      "stages3": ((2, 1024, 1024, 8, 8, 64), dict(is_causal=True),
                  m(num_stages=3, num_stages_bwd=3)),
      "block_kv80_h256": ((1, 8192, 8192, 4, 4, 256), dict(is_causal=True),
                          None),
  }
  for name, (shp, kwargs, blocks) in variants.items():
    extra = {} if blocks is None else dict(block_sizes=blocks)
    out[f"mosaic/variant/{name}"] = lambda s=shp, kw=kwargs, e=extra: _grad(
        "mosaic", s, **kw, **e)
  for h in (64, 128, 256):
    for causal in (False, True):
      out[f"mosaic/fp8/h{h}_causal{int(causal)}"] = (
          lambda h=h, c=causal: _grad("mosaic", (2, 2048, 2048, 8, 2, h),
                                      is_causal=c, fp8=True))
  out["mosaic/fp8/h64_fp8_backward"] = lambda: _grad(
      "mosaic", (2, 2048, 2048, 8, 2, 64), is_causal=True, fp8=True,
      block_sizes=dataclasses.replace(m.get_default(64, True, kv_len=2048),
                                      fp8_backward=True))
  out["mosaic/fp8/h128_stmatrix"] = lambda: _grad(
      "mosaic", (2, 2048, 2048, 8, 2, 128), is_causal=True, fp8=True,
      block_sizes=dataclasses.replace(m.get_default(128, True, kv_len=2048),
                                      fp8_backward=True, e4m3_stmatrix=True))
  out["mosaic/fp8/float8_inputs"] = lambda: _float8_forward(
      (2, 2048, 2048, 8, 2, 128))
  return out


def _has_query_offset() -> bool:
  import inspect
  return "query_offset" in inspect.signature(
      jax_flash.flash_attention).parameters


def lower(thunk) -> str:
  """The program's text, without source locations: they would name the
  tree's path and the calling lines (Mosaic GPU gives a kernel the file
  and line of its caller's frame, `source_info_util.user_frame`)."""
  jax.config.update("jax_traceback_in_locations_limit", 0)
  source_info_util.user_frame = lambda *args, **kwargs: None
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    fn, args = thunk()
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _one(name: str, texts: str | None) -> str:
  """The digest of case `name`, lowered in this process."""
  try:
    text = lower(cases()[name])
  except Exception as e:  # A case a tree cannot lower is a result too.
    text = f"error: {type(e).__name__}: {e}"
  if texts:
    os.makedirs(texts, exist_ok=True)
    with open(os.path.join(texts, name.replace("/", "__") + ".txt"),
              "w") as f:
      f.write(text)
  return hashlib.sha256(text.encode()).hexdigest() + (
      " " + text[:200] if text.startswith("error") else "")


def _in_fresh_process(name: str, texts: str | None) -> str:
  """`_one` in a process of its own: a Mosaic GPU program depends on what
  the process lowered before it."""
  command = [sys.executable, __file__, "--case", name] + (
      ["--texts", texts] if texts else [])
  result = subprocess.run(command, capture_output=True, text=True,
                          check=False)
  if result.returncode:
    return "error: the process failed: " + result.stderr[-300:]
  return result.stdout.strip()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="write {case: sha256} here (JSON)")
  parser.add_argument("--texts", help="also write each program's text here")
  parser.add_argument("--only", default="", help="cases whose name holds it")
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                      help="report the cases whose digests differ")
  parser.add_argument("--case", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.case:
    print(_one(args.case, args.texts))
    return 0
  if args.compare:
    a, b = (json.load(open(p)) for p in args.compare)
    changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    for name in changed:
      print("changed:", name)
    for name in sorted(a.keys() ^ b.keys()):
      print("only in", args.compare[0] if name in a else args.compare[1],
            name)
    print(f"{len(a.keys() & b.keys()) - len(changed)} identical, "
          f"{len(changed)} changed")
    return 1 if changed else 0
  names = [n for n in cases() if args.only in n]
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    results = pool.map(lambda n: _in_fresh_process(n, args.texts), names)
    digests = {}
    for name, result in zip(names, results):
      digests[name] = result.split(" ")[0]
      print(f"{name}: {result[:12]}{result[64:]}", file=sys.stderr)
  print(f"{len(digests)} programs in {time.perf_counter() - start:.0f} s",
        file=sys.stderr)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(digests, f, indent=1, sort_keys=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
