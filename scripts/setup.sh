#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the versions of requirements/pinned.txt
# (jax/jaxlib 0.11.2 and everything else, exactly) and this package with
# its test extra. Idempotent: a second run only checks. On a GPU machine
# install the CUDA jaxlib plugin yourself (pip install "jax[cuda13]==0.11.2").
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python.sh

pinned=$(pinned_jax requirements/pinned.txt)
# The package itself must be installed (not merely importable from here).
if ! .venv/bin/python -c "import importlib.metadata as m, jax, pytest, xdist
assert jax.__version__ == '$pinned'; m.version('jax-flash')" 2>/dev/null; then
  PY="$(find_python)"
  $PY -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c requirements/pinned.txt -e ".[test]"
fi
