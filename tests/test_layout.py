"""The architecture, checked: the problem description imports no backend, and
a backend imports only the description (never another backend, never the
entry points)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(path):
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.append(node.module)
  return names


@pytest.mark.parametrize("path", sorted((ROOT / "jax_flash/core").glob("*.py")),
                         ids=lambda p: p.name)
def test_core_imports_nothing_above_it(path):
  ours = [n for n in _imports(path)
          if n.split(".")[0] in ("jax_flash", "pallas_kernels")]
  assert all(n.startswith("jax_flash.core") for n in ours), ours


@pytest.mark.parametrize("path", sorted((ROOT / "pallas_kernels").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_backend_imports_only_the_core_and_itself(path):
  parts = path.relative_to(ROOT / "pallas_kernels").parts
  own = f"pallas_kernels.{parts[0]}" if len(parts) > 1 else "pallas_kernels"
  ours = [n for n in _imports(path)
          if n.split(".")[0] in ("jax_flash", "pallas_kernels")]
  for name in ours:
    assert name.startswith(("jax_flash.core", own)), (path, name)


def test_a_backend_package_imports_first():
  """`import pallas_kernels.triton` before jax_flash (the backends import
  the spec; the dispatch imports them only when first used)."""
  import subprocess
  import sys
  for package in ("pallas_kernels.triton", "pallas_kernels.mosaic_gpu"):
    result = subprocess.run(
        [sys.executable, "-c", f"import {package}, jax_flash"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_backend_implements_the_interface():
  """Each registered backend is a `core.backend.Backend`, hashable, and its
  methods take the interface's parameters by the same names."""
  import inspect

  from jax_flash import _dispatch
  from jax_flash.core.backend import Backend
  for name, backend in _dispatch.backends().items():
    assert isinstance(backend, Backend), name
    assert backend.name == name
    hash(backend)
    for method in ("unsupported", "backward_unsupported", "config",
                   "forward", "backward", "decode"):
      want = inspect.signature(getattr(Backend, method)).parameters
      have = inspect.signature(getattr(backend, method)).parameters
      assert list(have) == list(want)[1:], (name, method)


def _loaded_after(statement: str) -> list[str]:
  """Our modules a fresh process holds after running `statement`."""
  import subprocess
  import sys
  code = (f"{statement}\nimport sys\nprint(' '.join(sorted(m for m in "
          "sys.modules if m.split('.')[0] in ('jax_flash', "
          "'pallas_kernels'))))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout.split()


def test_layers_load_downward_only():
  """`import jax_flash` loads nothing of ours but its own module; the
  problem description loads nothing above it; a call on the blockwise
  path (on any machine) loads the backends' descriptions (`backend`,
  `config`, `layout`) but no kernel module."""
  assert _loaded_after("import jax_flash") == ["jax_flash"]
  core = _loaded_after("import jax_flash.core.prepare")
  assert all(m == "jax_flash" or m.startswith("jax_flash.core")
             for m in core), core
  called = _loaded_after(
      "import jax.numpy as jnp, jax_flash\nq = jnp.ones((1, 8, 2, 16))\n"
      "jax_flash.flash_attention(q, q, q, implementation='xla')")
  kernels = [m for m in called if m.startswith("pallas_kernels.") and
             m.split(".")[-1] not in ("backend", "config", "layout")
             and m.count(".") == 2]
  assert not kernels, kernels
