#!/usr/bin/env bash
# On an H100/H200 (jax 0.11.2 and pytest-xdist installed), from the repo root,
# one or more of:
#   bash scripts/gpu_check.sh tests     # the tests with the real kernels (~5 min)
#   bash scripts/gpu_check.sh diagnose  # the small-shape error sweep
#   bash scripts/gpu_check.sh bench     # dense: ours v2/v1, cuDNN, jax's Pallas, XLA
#   bash scripts/gpu_check.sh sparse    # sliding windows, then `masks`
#   bash scripts/gpu_check.sh masks     # packed documents; padding as lengths,
#                                       # dense masks and bias on each backend
#   bash scripts/gpu_check.sh decode    # flash_decode bandwidth vs cache length
#   bash scripts/gpu_check.sh decode_tune # paged decode: tile rows x stages
#   bash scripts/gpu_check.sh long      # one 128k-token causal sequence
#   bash scripts/gpu_check.sh ring      # ring_attention on every local GPU
#   bash scripts/gpu_check.sh tune      # head-dim-256 block-size sweep
#   bash scripts/gpu_check.sh schedule  # Mosaic forward: mbarrier vs named barriers, 16k
#   bash scripts/gpu_check.sh registers # Mosaic backward: register split, dV before dS, 16k
#   bash scripts/gpu_check.sh fused     # Mosaic backward with dQ in the dK/dV kernel: tests, 16k
#   bash scripts/gpu_check.sh train     # train_lm at GPT-2-small size: flash, cuDNN, flax
#   bash scripts/gpu_check.sh dispatch  # host time a call: jit vs compiled vs jax.nn
#   bash scripts/gpu_check.sh compile   # first calls in stages, persistent cache (COMPILE_ARGS)
#   bash scripts/gpu_check.sh compile_parts # a new shape in a warm process; ptxas's share
#   bash scripts/gpu_check.sh train_step # a training step, ours vs cuDNN, profiled (TRAIN_ARGS)
#   bash scripts/gpu_check.sh models    # shapes of public model configurations vs cuDNN and XLA
#   bash scripts/gpu_check.sh profile   # the Mosaic forward's named regions at 2k (profiler;
#                                       # PROFILE_SEQ_LEN, PROFILE_OPTIONS, PROFILE_CALL)
#   bash scripts/gpu_check.sh persistent # the persistent forward: tests, vs one CTA an item 1k-16k
#   bash scripts/gpu_check.sh pending   # variants, decode and persistent tests (~5 min)
#   bash scripts/gpu_check.sh softcap   # the soft-cap's cost, Mosaic and Triton, 8k
#   bash scripts/gpu_check.sh alibi     # ALiBi's cost, by position tiles and by vectors
#   bash scripts/gpu_check.sh alibi_tiles # ALiBi's vectors and fold: their tests,
#                                       # then ALiBi against the tiles, 8k (ptxas's spills)
#   bash scripts/gpu_check.sh cp_work   # context parallelism's per-device work, 128k-1M
#   bash scripts/gpu_check.sh prefill   # prompt chunks vs a 32k cache (Triton, paged, Mosaic)
#   bash scripts/gpu_check.sh h512      # head dim 512: Triton vs cuDNN and XLA, 8k
#   bash scripts/gpu_check.sh dims      # head dims 96/192: Mosaic vs Triton and cuDNN, 8k
#   bash scripts/gpu_check.sh ptxas     # the Mosaic kernels' register/spill report
#   bash scripts/gpu_check.sh sass      # their PTX (instruction mix: sass_mix.py; SASS_WHICH, SASS_CALL)
#   bash scripts/gpu_check.sh fp8       # FP8: its tests, where an fp8 call's time goes (8k),
#                                       # speed and error vs bf16 and cuDNN (bf16 and FP8),
#                                       # train_lm with --fp8 on and off (~12 min)
#   bash scripts/gpu_check.sh fp8_train # train_lm --fp8 off/on at head dims 64 and 128
#   bash scripts/gpu_check.sh fp8_registers # the forward's P from registers: its
#                                       # tests, then fp8=True with and without it, 8k
#   bash scripts/gpu_check.sh fp8_ds_bound # the FP8 backward's dS at one bound a head:
#                                       # its tests, then fp8=True with and without it, 8k
#   bash scripts/gpu_check.sh head_splits # the dK/dV kernel split over query-head shares:
#                                       # its tests, then group sizes 1-71 vs cuDNN (fwd+bwd)
#   bash scripts/gpu_check.sh mosaic    # the Mosaic kernels: correctness sweep + 8k benchmark
#                                       # (with tokamax if .whl/ is carried: scripts/tokamax_wheels.sh)
# TESTS="tests/a.py::b ..." limits `tests` to those; BENCH_ARGS replaces
# `bench`'s shapes and implementations. Results go under $OUT (or
# ./gpu_out), a few files a mode; logs stay in /tmp unless a step fails
# (then their tail prints).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
# The tests compile XLA's own programs (the float32 reference, its gradient)
# without autotuning their matmuls: with it, one Mosaic test took 30.8 s
# against 5.9 s without (H200, 2026-11-30, the Mosaic tests, head dim 512 runs), and 16 workers
# autotuning on one GPU cut every run short. Benchmarks keep autotuning.
TEST_XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
if [ -d .whl ]; then  # tokamax for the benchmark (scripts/tokamax_wheels.sh).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=.:/tmp/site:.whl/stub
fi

bench() {  # bench NAME TIMEOUT ARGS...: one benchmark run into $OUT/NAME.
  local name=$1 limit=$2; shift 2
  if timeout "$limit" python3 -m benchmarks.harness "$@" --out "$OUT/$name" \
      > "/tmp/$name.log" 2>&1; then
    rm -f "$OUT/$name/benchmark.jsonl"  # Complete: the .md/.json hold it all.
  else
    echo "$name: exit $?"; tail -n 30 "/tmp/$name.log"
  fi
  tail -n 25 "$OUT/$name"/*.md
  grep -h '"error"' "/tmp/$name.log" | sed 's/.*"impl": \("[^"]*"\).*"mode": \("[^"]*"\).*"error": /\1 \2 /' \
    | cut -c1-400 | sort -u | head -n 12
}

fp8_variant() {  # fp8_variant IMPL TESTS: an FP8 option (benchmarks/fp8.py's
  # speed row IMPL): test_fp8.py -k TESTS, then fp8=True with and without
  # it beside bf16, 8k.
  local impl=$1 tests=$2
  XLA_FLAGS=$TEST_XLA_FLAGS timeout 200 python3 -m pytest -q -n 8 \
    -p no:cacheprovider tests/test_fp8.py -k "$tests" \
    > "$OUT/${impl}_tests.log" 2>&1
  grep -E "FAILED|passed|failed" "$OUT/${impl}_tests.log" | tail -n 8
  timeout "${BENCH_LIMIT:-240}" python3 benchmarks/fp8.py --parts speed \
    --impls bf16 fp8 "$impl" > "$OUT/$impl.jsonl" \
    2> "/tmp/$impl.err" || tail -n 20 "/tmp/$impl.err"
  cut -c1-220 "$OUT/$impl.jsonl"
}

fp8_train() {  # fp8_train HEADS...: train_lm with --fp8 off and on, the
  # same seed (d_model 512, causal, 1,024 tokens: head dim 512 / HEADS;
  # 8 heads, 64: the bf16 backward on the rounded inputs; 4 heads, 128: the
  # FP8 backward); eval losses side by side.
  local heads mode
  for heads in "$@"; do
    for mode in off on; do
      timeout ${FP8_TRAIN_LIMIT:-200} python3 examples/train_lm.py --layers 4 --d-model 512 \
        --heads "$heads" --kv-heads "$heads" --seq-len 1024 --batch 16 \
        --steps ${FP8_TRAIN_STEPS:-300} --lr 1e-3 --dtype bfloat16 --eval-batches 4 \
        --sample-len 20 --fp8 $mode > "$OUT/train_fp8_${heads}_$mode.log" 2>&1
      echo "train --heads $heads --fp8 $mode: exit $?"
      tr '\r' '\n' < "$OUT/train_fp8_${heads}_$mode.log" | tail -n 4
    done
  done
}

masks() {  # Packed documents; padding as lengths, masks and bias.
  bench documents 120 --scenario documents --seq-lens 16384 --sizes 16 \
    --head-dims 128
  bench padding 240 --scenario padding --seq-lens 8192 --sizes 2048 \
    --head-dims 128
}

for mode in "$@"; do
  echo "=== $mode ($(date -u +%H:%M:%S))"
  case "$mode" in
    tests)
      # Compilation dominates: 16 workers (one per core) share the GPU, each allocating as
      # needed. Left out: tests that run on the CPU wherever they are (the
      # Triton lowering for an abstract GPU, 8 simulated host devices).
      # Each failure goes to failures.log as it happens.
      # shellcheck disable=SC2086
      XLA_FLAGS=$TEST_XLA_FLAGS JAX_FLASH_FAILURE_LOG="$OUT/failures.log" \
        timeout "${TESTS_LIMIT:-560}" \
        python3 -m pytest -v -n 16 -rfE -p no:cacheprovider ${TESTS:-tests/} \
        --ignore=tests/test_triton_lowering.py --ignore=tests/test_sharding.py \
        --ignore=tests/test_ring.py > "$OUT/gpu_tests.log" 2>&1
      echo "pytest exit: $?; passed: $(grep -c ' PASSED ' "$OUT/gpu_tests.log")"
      grep -E " FAILED |^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests.log" | tail -30
      ;;
    head_splits)
      XLA_FLAGS=$TEST_XLA_FLAGS timeout 300 python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/test_gpu.py -k head_splits \
        > "$OUT/head_splits_tests.log" 2>&1
      grep -E "FAILED|passed|failed" "$OUT/head_splits_tests.log" | tail -n 20
      timeout "${BENCH_LIMIT:-300}" python3 benchmarks/head_splits.py \
        ${HEAD_SPLITS_ARGS:-} > "$OUT/head_splits.jsonl" 2> /tmp/head_splits.log \
        || tail -n 20 /tmp/head_splits.log
      cut -c1-200 "$OUT/head_splits.jsonl"
      ;;
    models)
      bench models "${BENCH_LIMIT:-400}" --scenario models
      ;;
    fp8)
      XLA_FLAGS=$TEST_XLA_FLAGS timeout 150 python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/test_fp8.py > "$OUT/fp8_tests.log" 2>&1
      tail -n 3 "$OUT/fp8_tests.log"
      timeout 120 python3 benchmarks/call_profile.py --shapes llama3_8b \
        --impls flash fp8 --modes fwd fwd+bwd --calls 5 \
        --out "$OUT/fp8_profile" > /tmp/fp8_profile.log 2>&1 \
        || tail -n 20 /tmp/fp8_profile.log
      cut -c1-400 "$OUT/fp8_profile/call_profile.md"
      timeout 300 python3 benchmarks/fp8.py > "$OUT/fp8.jsonl" \
        2> /tmp/fp8.err || tail -n 20 /tmp/fp8.err
      cut -c1-300 "$OUT/fp8.jsonl"
      fp8_train 8
      ;;
    fp8_train)
      # shellcheck disable=SC2086
      fp8_train ${FP8_TRAIN_HEADS:-8 4}
      ;;
    fp8_registers)
      fp8_variant fp8_registers "registers or stmatrix"
      ;;
    fp8_ds_bound)
      fp8_variant fp8_ds_bound ds_bound
      ;;
    dispatch)
      timeout "${DISPATCH_LIMIT:-240}" python3 benchmarks/dispatch_overhead.py \
        > "$OUT/dispatch.jsonl" 2> /tmp/dispatch.err || tail -n 20 /tmp/dispatch.err
      cat "$OUT/dispatch.jsonl"
      ;;
    compile)
      # shellcheck disable=SC2086
      timeout "${COMPILE_LIMIT:-300}" python3 benchmarks/compile_time.py --cache \
        ${COMPILE_ARGS:-} > "$OUT/compile.jsonl" 2> /tmp/compile.err \
        || tail -n 20 /tmp/compile.err
      cat "$OUT/compile.jsonl"
      ;;
    compile_parts)
      # A new shape's first call in a warm process (another shape's
      # kernels compiled before), ours and cuDNN's; then ptxas's share of
      # the kernels' compile: each Mosaic module's PTX (MOSAIC_GPU_DUMP_TO)
      # assembled again by the ptxas binary, timed.
      timeout 200 python3 benchmarks/compile_time.py --warm 2x2048x16x4x128 \
        --shapes 4x8192x32x8x128 2x8192x32x32x64 > "$OUT/compile_warm.jsonl" \
        2> /tmp/compile_warm.err || tail -n 20 /tmp/compile_warm.err
      cat "$OUT/compile_warm.jsonl"
      rm -rf /tmp/ptx && mkdir -p /tmp/ptx
      JAX_FLASH_CACHE_DIR=off MOSAIC_GPU_DUMP_TO=/tmp/ptx timeout 120 python3 -c "
import time, jax, jax.numpy as jnp, jax_flash
q = jnp.ones((4, 8192, 32, 128), jnp.bfloat16); k = jnp.ones((4, 8192, 8, 128), jnp.bfloat16)
f = lambda q, k: jax_flash.flash_attention(q, k, k, is_causal=True).astype(jnp.float32).sum()
lowered = jax.jit(jax.grad(f, argnums=(0, 1))).lower(q, k)
start = time.perf_counter(); lowered.compile()
print('compile_s (with the dumps)', round(time.perf_counter() - start, 3))" 2>&1 | tail -n 3
      # PTXAS: a ptxas of CUDA 12.9 or later (Mosaic GPU writes PTX 9.0);
      # else the first found (Triton's, PTX 8.7, refuses it).
      ptxas=${PTXAS:-$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')" \
        /usr/local/cuda/bin -name ptxas -type f 2>/dev/null | head -n 1)}
      echo "ptxas: ${ptxas:-none}"
      for ptx in /tmp/ptx/*.ptx; do
        [ -n "$ptxas" ] || break
        start=$EPOCHREALTIME
        "$ptxas" -arch=sm_90a -O3 "$ptx" -o /tmp/ptx/out.cubin || echo "ptxas failed"
        echo "$(basename "$ptx"): $(wc -c < "$ptx") bytes of PTX, ptxas" \
          "$(awk "BEGIN {print $EPOCHREALTIME - $start}") s"
      done | tee "$OUT/ptxas_times.txt"
      ;;
    train_step)
      # shellcheck disable=SC2086
      timeout "${TRAIN_LIMIT:-300}" python3 benchmarks/train_step.py \
        --profile /tmp/profiles --hlo /tmp/hlo ${TRAIN_ARGS:-} \
        > "$OUT/train_step.jsonl" 2> /tmp/train_step.err \
        || tail -n 20 /tmp/train_step.err
      cut -c1-2500 "$OUT/train_step.jsonl"
      ;;
    diagnose)
      timeout 400 python3 benchmarks/diagnose_small.py > "$OUT/diagnose.log" 2>&1
      cat "$OUT/diagnose.log"
      ;;
    bench)
      # shellcheck disable=SC2086
      bench dense "${BENCH_LIMIT:-540}" ${BENCH_ARGS:---seq-lens 1024 4096 16384 --plots}
      ;;
    sparse)
      bench window 150 --scenario window --seq-lens 32768 \
        --sizes 1024 2048 4096 --head-dims 128
      masks
      ;;
    masks) masks ;;
    decode)
      bench decode 200 --scenario decode --head-dims 128 \
        --seq-lens 1024 8192 32768 131072 --batches 1 8 64
      ;;
    decode_tune)
      # Paged decode: key tile rows x pipelining stages x page ids read
      # ahead x programs per multiprocessor, per page size.
      timeout "${BENCH_LIMIT:-300}" python3 benchmarks/decode_tune.py \
        --block-k 32 64 --stages 2 3 --prefetch 0 1 2 --programs-per-sm 2 4 \
        --out "$OUT/decode_tune" > /tmp/decode_tune.log 2>&1 \
        || tail -n 30 /tmp/decode_tune.log
      grep '^{' /tmp/decode_tune.log | cut -c1-300
      ;;
    long)
      timeout 150 python3 benchmarks/long_context.py --out "$OUT/long" \
        > /tmp/long.log 2>&1 || tail -n 30 /tmp/long.log
      grep '^{' /tmp/long.log
      ;;
    ring)
      # Every local GPU (run it on nvidia-h200-x2).
      timeout 300 python3 benchmarks/ring_scaling.py --out "$OUT/ring" \
        > /tmp/ring.log 2>&1 || tail -n 30 /tmp/ring.log
      grep '^{' /tmp/ring.log
      ;;
    schedule)
      # The Mosaic forward's consumer ping-pong: mbarrier (the default)
      # against hardware barriers (`named_barriers`), 16k, head dims 128
      # and 64, causal and not, cuDNN alongside (benchmarks/mosaic_tune.py).
      timeout "${BENCH_LIMIT:-300}" python3 benchmarks/mosaic_tune.py \
        --seq-len 16384 --head-dims 128 64 --modes fwd \
        --candidates '[{}, {"named_barriers": true}]' --out "$OUT/schedule" \
        > /tmp/schedule.log 2>&1 || tail -n 30 /tmp/schedule.log
      grep '^{' /tmp/schedule.log | cut -c1-400
      ;;
    registers)
      # The Mosaic backward's register budget (the dK/dV spill): the
      # producer warpgroup's registers (40, or 24: 240 a consumer thread)
      # and dV's matmul awaited before dS, 16k, head dims 128 and 64,
      # cuDNN alongside; each row with its kernels' spill bytes (ptxas).
      MOSAIC_GPU_DUMP_PTXAS=1 timeout "${BENCH_LIMIT:-300}" python3 \
        benchmarks/mosaic_tune.py --seq-len 16384 --head-dims 128 64 \
        --modes bwd --candidates '[{}, {"producer_registers": 24},
        {"dv_before_ds": true}, {"producer_registers": 24,
        "dv_before_ds": true}]' --out "$OUT/registers" \
        > /tmp/registers.log 2>&1 || tail -n 30 /tmp/registers.log
      grep '^{' /tmp/registers.log | cut -c1-800
      ;;
    fused)
      # dQ from the dK/dV kernel by TMA reduce-add (`fused_dq`): its GPU
      # tests first (each case under a short limit: a hang costs little),
      # then the backward at 16k, head dims 128 and 64, against the
      # two-kernel default and cuDNN, each row with its kernels' spill
      # bytes (ptxas).
      XLA_FLAGS=$TEST_XLA_FLAGS timeout 150 python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/test_gpu.py -k fused_dq \
        > "$OUT/fused_tests.log" 2>&1
      echo "fused_dq tests: exit $?"; tail -n 15 "$OUT/fused_tests.log"
      MOSAIC_GPU_DUMP_PTXAS=1 timeout "${BENCH_LIMIT:-360}" python3 \
        benchmarks/mosaic_tune.py --seq-len 16384 --head-dims 128 64 \
        --modes bwd fwd+bwd --candidates '[{}, {"fused_dq": true},
        {"fused_dq": true, "num_stages_bwd": 3}]' --out "$OUT/fused" \
        > /tmp/fused.log 2>&1 || tail -n 30 /tmp/fused.log
      grep '^{' /tmp/fused.log | cut -c1-800
      ;;
    tune)
      # Head dim 256 (the slowest shape; TUNE_HEAD_DIM=512 for 257..512),
      # non-causal, on one GPU.
      CUDA_VISIBLE_DEVICES=0 timeout "${TUNE_LIMIT:-200}" python3 \
        benchmarks/tune.py --head-dim "${TUNE_HEAD_DIM:-256}" --out "$OUT/tune" \
        > /tmp/tune.log \
        2>&1 || tail -n 30 /tmp/tune.log
      grep '^{' /tmp/tune.log | cut -c1-400
      ;;
    train)
      # GPT-2-small shape (12 layers, d_model 768, 12 heads), 2048 tokens per
      # sequence, bfloat16 compute: flash attention, jax.nn's cuDNN, then
      # flax's own.
      for impl in ${TRAIN_IMPLS:-pallas cudnn flax}; do
        timeout ${FP8_TRAIN_LIMIT:-200} python3 examples/train_lm.py --layers 12 --d-model 768 \
          --heads 12 --kv-heads 12 --seq-len 2048 --batch 8 --steps 60 \
          --lr 1e-3 --dtype bfloat16 --eval-batches 2 --sample-len 40 \
          --implementation $impl --out-dir /tmp/ckpt_$impl \
          > "$OUT/train_$impl.log" 2>&1
        echo "train $impl: exit $?"; tr '\r' '\n' < "$OUT/train_$impl.log" | tail -n 8
      done
      ;;
    persistent)
      # The persistent forward (persistent forward in L2 order runs (2026-12-01): items query tiles
      # fastest, `persistent_order`): its GPU tests, then against one CTA
      # an item at 1k-16k, head dims 64 and 128 (96 and 256 at 4k and 16k),
      # in batches of about 20 ms (PERSISTENT_SEQ_LENS to choose).
      XLA_FLAGS=$TEST_XLA_FLAGS JAX_FLASH_FAILURE_LOG="$OUT/failures.log" \
        timeout "${MOSAIC_LIMIT:-150}" \
        python3 -m pytest -v -n 16 -rfE -p no:cacheprovider tests/test_gpu.py \
        -k persistent > "$OUT/persistent_tests.log" 2>&1
      echo "pytest exit: $?"; grep -E "(PASSED|FAILED|ERROR) tests|passed|failed" \
        "$OUT/persistent_tests.log" | sed 's/.*\] //' | grep -v PASSED | tail -20
      for seq in ${PERSISTENT_SEQ_LENS:-1024 2048 4096 8192 16384}; do
        dims="64 128"
        case $seq in 4096|16384) dims="64 96 128 256";; esac
        # shellcheck disable=SC2086
        timeout 150 python3 benchmarks/mosaic_tune.py --seq-len "$seq" \
          --head-dims $dims --calls $((120000 / seq)) --repeats 5 \
          --candidates '[{}, {"persistent": true}]' \
          --out "$OUT/persistent_$seq" > "/tmp/persistent_$seq.log" 2>&1 \
          || tail -n 5 "/tmp/persistent_$seq.log"
        grep '^{' "/tmp/persistent_$seq.log" | python3 -c '
import json, sys
for line in sys.stdin:
  r = json.loads(line)
  print(r["impl"], r["head_dim"], "causal" if r["causal"] else "full",
        "persistent" if r.get("block_sizes", {}).get("persistent") else "",
        round(r.get("tflops", 0)), r.get("vs_cudnn", ""), r.get("error", "")[:120])'
      done
      ;;
    profile)
      # Where the Mosaic forward's time goes at 2k (the Mosaic-forward goal's short
      # sequences): Mosaic GPU's profiler over its named regions (q_load,
      # tiles with k_wait and v_wait a tile, epilogue) and the CTAs' start
      # times; head dims 64 and 128, causal and not. Each is launched 5
      # times back to back (clocks up) and the last launch's trace kept.
      # PROFILE_HEAD_DIMS ("64 128") the head dims;
      # PROFILE_OPTIONS='{"option": value}' sets MosaicBlockSizes fields
      # over the defaults (e.g. '{"persistent": true}'); PROFILE_CALL
      # adds flash_attention's arguments (e.g. '{"logits_soft_cap": 30}'); PROFILE_SEQ_LEN
      # (2048) the sequence length, 16k tokens a launch, with room for 4
      # events a 64-row key tile.
      mkdir -p "$OUT/profile"
      seq=${PROFILE_SEQ_LEN:-2048}
      JAX_FLASH_MOSAIC_PROFILE_EVENTS=$((4 * seq / 64 + 64)) \
      JAX_FLASH_MOSAIC_PROFILE_DIR="$OUT/profile" timeout 150 python3 -c "
import dataclasses, glob, json, os, jax, jax.numpy as jnp, jax_flash
options = json.loads(os.environ.get('PROFILE_OPTIONS') or '{}')
call = json.loads(os.environ.get('PROFILE_CALL') or '{}')
n = $seq
for h in map(int, '${PROFILE_HEAD_DIMS:-64 128}'.split()):
  for causal in (False, True):
    q = jax.random.normal(jax.random.key(0), (16384 // n, n, 2048 // h, h),
                          jnp.bfloat16)
    blocks = dataclasses.replace(
        jax_flash.MosaicBlockSizes.get_default(h, causal), **options)
    f = jax.jit(lambda q: jax_flash.flash_attention(
        q, q, q, is_causal=causal, implementation='mosaic',
        block_sizes=blocks, **call))
    for _ in range(5):
      jax.block_until_ready(f(q))
    traces = sorted(glob.glob('$OUT/profile/*-trace.json'), key=os.path.getmtime)
    os.rename(traces[-1], f'$OUT/profile/h{h}_causal{int(causal)}.last')
    for t in traces[:-1]:
      os.remove(t)
" > /tmp/profile.log 2>&1 || tail -n 20 /tmp/profile.log
      for t in "$OUT"/profile/*.last; do
        python3 benchmarks/profile_summary.py "$t"; rm -f "$t"
      done
      ;;
    pending)
      # The variants' and decode tests, and the persistent cases (~4 min).
      for tests in "tests/test_variants.py tests/test_decode.py" \
          "tests/test_gpu.py -k persistent"; do
        # shellcheck disable=SC2086
        XLA_FLAGS=$TEST_XLA_FLAGS timeout 300 python3 -m pytest -q -n 16 \
          -p no:cacheprovider $tests > /tmp/pending_tests.log 2>&1
        tail -n 1 /tmp/pending_tests.log
        grep -E "^FAILED" /tmp/pending_tests.log | head -20
      done
      ;;
    prefill)
      # Prompt chunks against a 32k cache: contiguous, paged, and on the
      # Mosaic forward with query offsets.
      bench prefill "${BENCH_LIMIT:-150}" --scenario prefill --head-dims 128 \
        --seq-lens 32768 --sizes 2048 256
      ;;
    h512)
      # Head dim 512 (Gemma-style global layers): the Triton kernels (named:
      # flash_v2) beside our blockwise XLA path (flash_xla), cuDNN and
      # jax.nn's XLA where they take it, 8k.
      bench h512 "${BENCH_LIMIT:-200}" --seq-lens 8192 --head-dims 512 \
        --impls flash_v2 flash_xla cudnn xla
      ;;
    dims)
      # Head dims 96 and 192: the Mosaic kernels (unpadded) beside Triton
      # (padded to 128/256) and cuDNN, 8k.
      bench dims "${BENCH_LIMIT:-200}" --seq-lens 8192 --head-dims 96 192 \
        --impls flash_mosaic flash_v2 cudnn
      ;;
    cp_work)
      # Context parallelism's per-device work (communication left out):
      # ring step, all_gather halves, all_to_all heads vs one chunk.
      timeout "${CP_LIMIT:-240}" python3 benchmarks/context_parallel_work.py \
        ${CP_ARGS:-} > "$OUT/cp_work.jsonl" 2> /tmp/cp_work.err \
        || tail -n 20 /tmp/cp_work.err
      cut -c1-400 "$OUT/cp_work.jsonl"
      ;;
    alibi)
      # ALiBi's cost: the Mosaic kernels with ALiBi by position tiles and
      # by vectors (`alibi_vectors`), their GPU tests first, beside plain
      # Mosaic and cuDNN (which takes no ALiBi); 2k and 8k.
      XLA_FLAGS=$TEST_XLA_FLAGS timeout 200 python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/test_gpu.py -k alibi \
        > "$OUT/alibi_tests.log" 2>&1
      grep -E "FAILED|passed|failed" "$OUT/alibi_tests.log" | tail -n 8
      bench alibi "${BENCH_LIMIT:-300}" --seq-lens 2048 8192 --head-dims 128 64 \
        --impls flash_mosaic flash_mosaic_alibi flash_mosaic_alibi_positions cudnn
      ;;
    alibi_tiles)
      # The GPU tests of `alibi_vectors` (causal and not) and `alibi_fold`,
      # then benchmarks/alibi_tiles.py at 8k (positions, vectors, the dQ
      # kernel's 64-row K/V tiles, the fold on causal masks) with ptxas's
      # spill report of each variant's kernels.
      XLA_FLAGS=$TEST_XLA_FLAGS timeout 150 python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/test_gpu.py -k "alibi_vectors or alibi_fold" \
        > "$OUT/alibi_vectors_tests.log" 2>&1
      grep -E "FAILED|passed|failed" "$OUT/alibi_vectors_tests.log" | tail -n 8
      MOSAIC_GPU_DUMP_PTXAS=1 timeout "${BENCH_LIMIT:-330}" python3 \
        benchmarks/alibi_tiles.py ${ALIBI_TILES_ARGS:-} \
        > "$OUT/alibi_tiles.jsonl" 2> "$OUT/alibi_tiles.err" \
        || tail -n 20 "$OUT/alibi_tiles.err"
      cut -c1-160 "$OUT/alibi_tiles.jsonl"
      awk '/^==/ {label = $0} / [1-9][0-9]* bytes spill/ {print label ": " $0}' \
        "$OUT/alibi_tiles.err" | sort | uniq -c | head -n 40
      ;;
    softcap)
      # The soft-cap's cost: Mosaic and Triton with logits_soft_cap=30
      # beside plain Mosaic and cuDNN (which takes no soft-cap), 8k.
      bench softcap "${BENCH_LIMIT:-240}" --seq-lens 8192 --head-dims 128 64 \
        --impls flash_mosaic flash_mosaic_softcap flash_v2_softcap cudnn
      ;;
    mosaic)
      timeout "${MOSAIC_LIMIT:-300}" python3 benchmarks/mosaic_check.py \
        --out "$OUT" > "$OUT/mosaic_check.log" 2>&1
      echo "mosaic_check exit: $?"; grep -E '^\{|passed' "$OUT/mosaic_check.log" | cut -c1-300
      impls=${MOSAIC_IMPLS:-flash_mosaic flash_v2 cudnn}
      [ -d .whl ] && impls="$impls tokamax"
      # shellcheck disable=SC2086
      bench mosaic_8k "${BENCH_LIMIT:-240}" --seq-lens 8192 \
        --head-dims 128 64 256 --impls $impls
      ;;
    ptxas)
      # ptxas's register and spill report of the Mosaic forward and backward
      # kernels (the Mosaic-forward goal's attribution), 8k, bf16, per head dim.
      for h in 64 128 192 256; do
        MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 -c "
import jax, jax.numpy as jnp, jax_flash
q = jnp.ones((1, 8192, 2048 // $h, $h), jnp.bfloat16)
f = lambda q: jax_flash.flash_attention(q, q, q, implementation='mosaic').sum()
jax.jit(jax.grad(f)).lower(q).compile()" > "$OUT/ptxas_h$h.log" 2>&1
        echo "head dim $h: exit $?"
        grep -iE "Function properties|registers|spill" "$OUT/ptxas_h$h.log" \
          | sort | uniq -c | head -n 12
      done
      ;;
    sass)
      # The Mosaic kernels' PTX for their static instruction mix (the Mosaic-forward goal's
      # attribution): 8k, bf16, causal forward and backward, head dims 128,
      # 64 and 256, and tokamax's Mosaic attention at 128 beside them, dumped
      # by MOSAIC_GPU_DUMP_TO (NAME.ptx and ptxas's report NAME.ptxas per
      # module) into $OUT/mosaic_ptx.tar.gz. This machine has no nvdisasm of
      # CUDA 13 (Mosaic GPU writes no .sass here); on the CPU machine:
      #   tar xzf mosaic_ptx.tar.gz && python benchmarks/sass_mix.py --assemble sass_flash_h128
      # SASS_CALL: more arguments of our call as JSON (e.g. '{"logits_soft_cap": 30}');
      # SASS_WHICH: the modules to dump (default: all four).
      for which in ${SASS_WHICH:-flash_h128 flash_h64 flash_h256 tokamax_h128}; do
        h=${which##*_h}
        rm -rf "/tmp/sass_$which"; mkdir -p "/tmp/sass_$which"
        MOSAIC_GPU_DUMP_TO="/tmp/sass_$which" timeout 150 python3 -c "
import json, os, jax, jax.numpy as jnp, jax_flash
call = json.loads(os.environ.get('SASS_CALL') or '{}')
q = jnp.ones((1, 8192, 2048 // $h, $h), jnp.bfloat16)
if '$which'.startswith('tokamax'):
  import tokamax
  attn = lambda q: tokamax.dot_product_attention(q, q, q, is_causal=True, implementation='mosaic')
else:
  attn = lambda q: jax_flash.flash_attention(q, q, q, is_causal=True, implementation='mosaic', **call)
jax.block_until_ready(jax.jit(jax.grad(lambda q: attn(q).astype(jnp.float32).sum()))(q))" \
          > "/tmp/sass_$which.log" 2>&1
        echo "$which: exit $?: $(cd /tmp/sass_$which && ls *.ptx | tr '\n' ' ')"
        grep -hE "registers|spill" /tmp/sass_"$which"/*.ptxas | sort | uniq -c
      done
      (cd /tmp && tar czf "$OUT/mosaic_ptx.tar.gz" sass_*/*.ptx sass_*/*.ptxas)
      ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
