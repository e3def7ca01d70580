#!/usr/bin/env bash
# Fetches tokamax and the pure-Python packages it imports that the GPU
# machine lacks, into .whl/ (ignored by git; carry it with the GPU run),
# and a stub of xprof (tokamax imports it for its own profiling only; the
# real one is ~100 MB with its dependencies). On the GPU machine
# scripts/gpu_check.sh installs them when .whl/ is there. Import checked on
# the CPU with jax 0.11.2 (tokamax 0.0.17).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  tokamax==0.0.17 einshape immutabledict pydantic pydantic-core \
  annotated-types typing-inspection qwix
mkdir -p .whl/stub/xprof/cli
touch .whl/stub/xprof/__init__.py .whl/stub/xprof/cli/__init__.py
echo 'get_kernel_stats_tool = None  # Stub: see scripts/tokamax_wheels.sh.' \
  > .whl/stub/xprof/cli/tools.py
ls .whl
