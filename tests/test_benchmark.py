"""The benchmark's tables (benchmarks.harness): what the results files and
the README quote."""
import jax.numpy as jnp
import pytest

from benchmarks import harness as benchmark
from benchmarks.harness import markdown


def _row(impl, mode, tflops, head_dim=128, causal=False):
  return dict(head_dim=head_dim, seq_len=8192, causal=causal, impl=impl,
              mode=mode, tflops=tflops)


@pytest.mark.parametrize("rows, ratio", [
    ([_row("flash_v2", "fwd", 300.0), _row("cudnn", "fwd", 400.0)], "0.75"),
    ([_row("flash_v2", "fwd", 300.0)], None)], ids=["with_ratio", "alone"])
def test_dense_table_has_one_cell_per_column(rows, ratio):
  """Every line has as many cells as the header; a ratio column only where
  both sides ran, with the quotient of their TFLOP/s."""
  head, rule, line = markdown(rows).splitlines()
  assert head.count("|") == rule.count("|") == line.count("|")
  cells = [c.strip() for c in line.strip("|").split("|")]
  names = [c.strip() for c in head.strip("|").split("|")]
  assert "" not in names
  assert dict(zip(names, cells))["flash_v2 fwd"] == "300"
  assert dict(zip(names, cells)).get("v2/cuDNN fwd") == ratio


SASS = """
        Function : flash_attention_forward_mosaic_mosaic_gpu_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA 0x120 ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   MUFU.EX2 R5, R5 ;
        /*0040*/               @P1 MUFU.EX2 R6, R6 ;
        /*0050*/                   FFMA R7, R5, R6, R7 ;
        Function : flash_attention_dq_mosaic_mosaic_gpu_kernel
        /*0000*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ ;
        /*0010*/                   FOO R1, R2 ;
"""


def test_sass_mix_counts_opcodes_per_function():
  from benchmarks.sass_mix import classify, instruction_mix
  mixes = instruction_mix(SASS)
  fwd = mixes["flash_attention_forward_mosaic_mosaic_gpu_kernel"]
  assert fwd == {"LDC": 1, "BRA": 1, "HGMMA": 1, "MUFU": 2, "FFMA": 1}
  assert classify(fwd) == {"memory": 1, "control": 1, "tensor": 1,
                           "special": 2, "float": 1}
  dq = mixes["flash_attention_dq_mosaic_mosaic_gpu_kernel"]
  assert classify(dq) == {"control": 1, "other": 1}


NVDISASM = """
//--------------------- .text.mosaic_gpu_kernel --------------------------
        .section        .text.mosaic_gpu_kernel,"ax",@progbits
        .global         mosaic_gpu_kernel
mosaic_gpu_kernel:
.text.mosaic_gpu_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R5, R5 ;
"""


def test_sass_mix_reads_a_folder_of_nvdisasm_dumps(tmp_path, capsys):
  """Mosaic GPU's MOSAIC_GPU_DUMP_TO writes nvdisasm's text, one file per
  module, every kernel with the same name: each file is its own function."""
  import json
  from benchmarks.sass_mix import main
  (tmp_path / "forward_0.sass").write_text(NVDISASM)
  (tmp_path / "dq_1.sass").write_text(NVDISASM.replace("MUFU.EX2", "HGMMA.64x64x16.F32.BF16"))
  (tmp_path / "forward_0.ptx").write_text("not SASS")
  main([str(tmp_path)])
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert {line["function"]: line["classes"] for line in lines} == {
      "dq_1/mosaic_gpu_kernel": {"memory": 1, "tensor": 1},
      "forward_0/mosaic_gpu_kernel": {"memory": 1, "special": 1}}


LOOPS = """
.text.mosaic_gpu_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   FMUL R5, R5, R6 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   SYNCS.PHASECHK.TRANS64 P1, [UR4], R2 ;
        /*0050*/              @!P1 BRA `(.L_x_2) ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/               @P2 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_sass_mix_counts_the_innermost_tensor_loops():
  """The per-tile body (a loop running HGMMA), not a polling wait's loop
  (no tensor op) nor the span of a branch back around the body."""
  from benchmarks.sass_mix import tensor_loops
  (body,) = tensor_loops(LOOPS)["mosaic_gpu_kernel"]
  assert body == {"HGMMA": 1, "FMUL": 1, "BRA": 1}


PTXAS = """\
ptxas warning : Registers are spilled to local memory in function 'dkv_kernel', 116 bytes spill stores, 132 bytes spill loads
ptxas info    : Compiling entry function 'dkv_kernel' for 'sm_90a'
ptxas info    : Function properties for dkv_kernel
    120 bytes stack frame, 116 bytes spill stores, 132 bytes spill loads
ptxas info    : Compiling entry function 'dq_kernel' for 'sm_90a'
ptxas info    : Function properties for dq_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_mosaic_tune_reads_each_kernels_spill_from_ptxas():
  """Spill bytes by kernel, each from the report after its entry line (the
  warning before it names a kernel not yet entered)."""
  from benchmarks.mosaic_tune import spills
  assert spills(PTXAS.splitlines()) == {"dkv_kernel": 116, "dq_kernel": 0}


def test_mosaic_tune_captures_what_native_code_writes():
  """ptxas's report comes from C++ on file descriptors 1 and 2, not through
  sys.stdout: the capture takes both, then restores them."""
  import os
  from benchmarks.mosaic_tune import captured_output
  before = [os.fstat(fd) for fd in (1, 2)]
  lines = []
  with captured_output(lines):
    os.write(2, b"ptxas info    : Compiling entry function 'k'\n")
    os.write(1, b"    0 bytes stack frame, 8 bytes spill stores\n")
  assert lines == ["ptxas info    : Compiling entry function 'k'",
                   "    0 bytes stack frame, 8 bytes spill stores"]
  after = [os.fstat(fd) for fd in (1, 2)]
  assert [(s.st_dev, s.st_ino) for s in after] == [
      (s.st_dev, s.st_ino) for s in before]


def test_decode_rows_build_each_paged_cache_only_for_their_row(monkeypatch):
  """Each paged copy of the cache exists only while its row is timed (at
  batch 64 x 128k a copy is 17 GB: built together, they ran the H200 out
  of memory); every row reads what its name says."""
  events = []
  build = benchmark._paged_cache

  def paged_cache(kc, vc, page_size, key):
    events.append(f"build {page_size}")
    return build(kc, vc, page_size, key)

  def time(fn, args, calls, repeats):
    events.append(f"time {args[1].shape[1]}")  # Page size, or cache length.
    return 1.0
  monkeypatch.setattr(benchmark, "_paged_cache", paged_cache)
  monkeypatch.setattr(benchmark, "_time", time)
  monkeypatch.setattr(benchmark, "copy_bandwidth", lambda c, r: 1.0)
  rows = benchmark.run_decode(64, 128, 1, [128], [2], jnp.float32, 1, 1)
  assert [r["impl"] for r in rows] == ["flash_decode", "paged_16", "paged_32",
                                       "paged_64", "xla", "cudnn"]
  assert events == ["time 128", "build 16", "time 16", "build 32", "time 32",
                    "build 64", "time 64", "time 128", "time 128"]


def test_profile_summary_times_each_region_per_warpgroup():
  """Durations (kcycles) come from each warpgroup's own begin/end pairs
  (nested regions included); the share is of the warpgroups' summed spans;
  the first occurrence a warpgroup apart; CTAs of a multiprocessor (a CTA:
  `warpgroups` consecutive tids) start `period_us` apart."""
  from benchmarks.profile_summary import summarise
  events = []
  # Two CTAs of one warpgroup each on multiprocessor 1, starting 13 us
  # apart, and one on multiprocessor 2.
  for tid, pid, offset in ((1, 1, 0.0), (2, 1, 13.0), (3, 2, 1.0)):
    for name, ph, ts in (("q_load", "B", 0.0), ("q_load", "E", 2.0),
                         ("tiles", "B", 2.0), ("k_wait", "B", 2.0),
                         ("k_wait", "E", 3.0), ("k_wait", "B", 5.0),
                         ("k_wait", "E", 5.5), ("tiles", "E", 8.0),
                         ("epilogue", "B", 8.0), ("epilogue", "E", 10.0)):
      events.append(dict(name=name, ph=ph, ts=ts + offset, tid=tid, pid=pid))
  stats = summarise({"traceEvents": events}, warpgroups=1)
  assert stats["q_load"] == dict(count=3, median_kcycles=2.0,
                                 mean_kcycles=2.0, first_median_kcycles=2.0,
                                 share=0.2)
  assert stats["tiles"]["mean_kcycles"] == 6.0
  assert stats["k_wait"]["count"] == 6
  assert stats["k_wait"]["first_median_kcycles"] == 1.0
  assert stats["k_wait"]["median_kcycles"] == 0.75
  assert stats["epilogue"]["share"] == 0.2
  assert stats["cta"] == dict(count=3, period_us=13.0, span_kcycles=10.0,
                              starts_us=13.0)


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_compiled_impls_carry_their_xla_options(mode):
  """`cudnn_deterministic`'s wrapper compiles each timed program with the
  options given (an unknown option is an error: they reach XLA) and runs
  what the plain jitted program runs."""
  import jax
  from benchmarks.harness import DETERMINISTIC_OPTIONS, _Compiled, _jitted
  fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                    implementation="xla")
  q, k, v, do = (jax.random.normal(jax.random.key(i), (1, 16, 2, 8))
                 for i in range(4))
  # (Full float32 matmuls: a GPU's default TF32 ones round differently in
  # programs compiled with other options.)
  with jax.default_matmul_precision("highest"):
    plain, args = _jitted(fn, mode, q, k, v, do)
    compiled, compiled_args = _jitted(_Compiled(fn, DETERMINISTIC_OPTIONS),
                                      mode, q, k, v, do)
    assert not hasattr(compiled, "lower")  # Compiled, not merely jitted.
    close = jax.tree.map(
        lambda a, b: bool(jnp.allclose(a, b, rtol=1e-6, atol=1e-6)),
        plain(*args), compiled(*compiled_args))
  assert all(jax.tree.leaves(close))
  with pytest.raises(Exception, match="no_such_option"):
    _jitted(_Compiled(fn, {"xla_no_such_option": True}), mode, q, k, v, do)


def test_dense_table_compares_with_deterministic_cudnn():
  rows = [_row("flash_mosaic", "bwd", 450.0), _row("cudnn", "bwd", 500.0),
          _row("cudnn_deterministic", "bwd", 400.0)]
  head, _, line = markdown(rows).splitlines()
  names = [c.strip() for c in head.strip("|").split("|")]
  cells = dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
  assert cells["cudnn_deterministic bwd"] == "400"
  assert cells["mosaic/cuDNN-det bwd"] == "1.12"
  assert cells["mosaic/cuDNN bwd"] == "0.90"


@pytest.mark.parametrize("name", ["flash_mosaic", "flash_mosaic_softcap",
                                  "flash_mosaic_fused_dq"])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_impls_lower_for_an_h200(name, causal):
  """Each Mosaic implementation the benchmark times builds its tiles and
  lowers for CUDA (on the CPU), forward and gradient."""
  import jax
  from jax._src import mesh as mesh_lib
  from tests.lowering import H200
  fn, _ = benchmark._impls(causal)[name]
  x = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_forward_mosaic" in text


def test_model_rows_time_every_shape_and_name_refusals():
  """The models scenario on the CPU, at small sizes: every implementation
  and mode gets a time or its error, and the table compares ours with the
  best other; a held-out shape's row says so."""
  import dataclasses

  import jax.numpy as jnp

  from benchmarks.harness import (HELD_OUT, MODELS, markdown_models,
                                   model_rows)
  small = [dataclasses.replace(m, batch=1, q_len=min(m.q_len, 40),
                               kv_len=min(m.kv_len, 30))
           for m in MODELS if m.name in ("phi2", "deepseek_v2_mla",
                                         "sd15_cross")]
  clip = next(m for m in HELD_OUT if m.name == "clip_text")
  rows = model_rows(small, ["flash", "cudnn", "xla"], jnp.float32, calls=1,
                    repeats=1)
  assert len(rows) == 3 * 3 * 2
  assert all(("ms" in r) != ("error" in r) for r in rows)
  assert all("ms" in r for r in rows if r["impl"] != "cudnn")
  assert not any(r["held_out"] for r in rows)
  held = [dict(r, model=clip.name, held_out=True) for r in rows[:6]]
  table = markdown_models(rows + held)
  assert table.count("\n") == 1 + len(small) + 1
  assert "phi2" in table and "refused" in table
  assert "| clip_text (held out) |" in table
  assert "first fwd+bwd s, flash / cudnn" in table.splitlines()[0]
  phi2 = next(line for line in table.splitlines() if "| phi2 |" in line)
  first = next(r["first_call_s"] for r in rows
               if r["model"] == "phi2" and r["impl"] == "flash"
               and r["mode"] == "fwd+bwd")
  assert phi2.endswith(f"| {first:.2f} / - |"), phi2


def test_refused_lengths_are_compared_at_cudnns_nearest_shapes():
  """Where cuDNN refuses an odd length, its TFLOP/s at the even lengths on
  either side is the yardstick: the neighbours are right, and the table
  divides ours by the better of them."""
  from benchmarks.harness import MODELS, even_neighbours, markdown_models
  vit = next(m for m in MODELS if m.name == "vit_b16")
  assert [(s.q_len, s.kv_len) for s in even_neighbours(vit)] == [
      (196, 196), (198, 198)]
  sd = next(m for m in MODELS if m.name == "sd15_cross")
  assert [(s.q_len, s.kv_len) for s in even_neighbours(sd)] == [
      (4096, 76), (4096, 78)]
  gpt = next(m for m in MODELS if m.name == "gpt2_small")
  assert even_neighbours(gpt) == []
  base = dict(model="vit_b16", batch=128, q_len=197, kv_len=197, heads=12,
              kv_heads=12, head_dim=64, value_head_dim=64, causal=False)
  rows = [dict(base, impl="flash", mode="fwd+bwd", ms=0.5, tflops=300.0),
          dict(base, impl="cudnn", mode="fwd+bwd",
               error="NotImplementedError: Unsupported sequence length"),
          dict(base, impl="cudnn_nearest", mode="fwd+bwd", q_len=196,
               kv_len=196, ms=0.5, tflops=250.0),
          dict(base, impl="cudnn_nearest", mode="fwd+bwd", q_len=198,
               kv_len=198, ms=0.5, tflops=240.0)]
  table = markdown_models(rows)
  assert "nearest shape it takes" in table.splitlines()[0]
  assert table.splitlines()[-1].endswith("| fwd+bwd 1.20 |")


def test_fp8_backward_error_study_separates_the_matmuls(capsys):
  """`benchmarks/fp8.py --parts backward` at a small size: bf16 matmuls on
  the rounded inputs err exactly as the rounding alone; each FP8 matmul
  adds error of its own (dV, dP: dV's; dQ, dK: dQ's and dK's, not dV's),
  all of it within the 2x the FP8 target allows."""
  import json

  from benchmarks.fp8 import backward_error
  backward_error(64, 256, outliers=False)
  rows = {r["impl"]: r for r in map(json.loads,
                                    capsys.readouterr().out.splitlines())}
  ratio = lambda impl, g: rows[impl][f"d{g}/alone"]
  assert all(abs(ratio("rounded_inputs", g) - 1) < 1e-4 for g in "qkv")
  assert ratio("dv_dp", "v") > 1.1 and ratio("dq_dk_tile", "v") < 1 + 1e-4
  assert ratio("dq_dk_tile", "q") > 1.02 and ratio("dq_dk_tile", "k") > 1.02
  assert all(1 < ratio("all_tile", g) < 2 for g in "qkv")
