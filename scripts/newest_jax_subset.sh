#!/usr/bin/env bash
# The tests on the newest jax/jaxlib tested, requirements/newest.txt (the
# whole suite runs on requirements/pinned.txt: scripts/setup.sh). Creates
# .venv-newest. CI runs a quick subset; `--all` runs the whole suite, as a
# bump of requirements/newest.txt needs before it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
if [ ! -x .venv-newest/bin/python ]; then
  PY="$(find_python)"
  $PY -m venv .venv-newest
  .venv-newest/bin/python -m pip install -q --upgrade pip
fi
.venv-newest/bin/python -m pip install -q -c requirements/newest.txt -e ".[test]"
.venv-newest/bin/python -c 'import jax; print("newest jax tested:", jax.__version__)'
if [ "${1:-}" = "--all" ]; then
  exec .venv-newest/bin/python -m pytest -q -n auto -p no:cacheprovider tests/
fi
.venv-newest/bin/python -m pytest -q -n auto -p no:cacheprovider \
  tests/test_layout.py tests/test_testing.py tests/test_bad_inputs.py \
  tests/test_transforms.py tests/test_debug_modes.py \
  "tests/test_x64.py::test_decode_and_flex[xla]" \
  tests/test_mosaic_lowering.py::test_mosaic_forward_and_backward_lower \
  tests/test_mosaic_lowering.py::test_kernels_lower_with_64_bit_types_on \
  tests/test_mosaic_lowering.py::test_mosaic_split_kv_decode_lowers_within_shared_memory \
  "tests/test_triton_lowering.py::test_flex_attention_kernels_lower" \
  "tests/test_correctness.py::test_matches_reference[f32_mha_causal]" \
  "tests/test_correctness.py::test_matches_reference[bf16_gqa_small_tiles]" \
  "tests/test_correctness.py::test_xla_matches_reference"
