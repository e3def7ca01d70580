"""Test setup: the same cases run the kernels interpreted on the CPU and for
real (implementation="pallas") on a GPU. GPU-only tests carry `@pytest.mark.gpu`
and are skipped where there is no GPU."""
import os
import shutil

# On a machine without an NVIDIA GPU, XLA compiles the CPU programs (the
# interpreted kernels, the references) without LLVM's optimizations: they
# run once or twice each, so compiling them dominates (about a third of
# the suite's time, measured on a 2-core machine). Set before JAX starts;
# JAX_FLASH_XLA_DEFAULT_OPTIMIZATION=1 keeps XLA's default (a test runs
# forward mode both ways in a subprocess).
OPTIMIZATION_LEVEL_0 = "--xla_backend_optimization_level=0"
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") or
        os.environ.get("JAX_FLASH_XLA_DEFAULT_OPTIMIZATION") == "1"):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " " + OPTIMIZATION_LEVEL_0).strip()

# The suite's calls keep no kernels in the user's cache folder
# (`jax_flash._kernel_cache`; tests/test_compile_cache.py names its own).
os.environ.setdefault("JAX_FLASH_CACHE_DIR", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
# An H100/H200 (sm90): where the Mosaic GPU kernels run.
HOPPER = ON_GPU and all(getattr(d, "compute_capability", "") == "9.0"
                        for d in jax.local_devices())
# The implementation every kernel test runs: real kernels where possible.
KERNEL_IMPL = "pallas" if ON_GPU else "interpret"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU (Pallas Triton kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_runtest_logreport(report):
  """With JAX_FLASH_FAILURE_LOG set, append each failure's report at once, so
  a GPU run cut short by its time limit still says why tests failed.

  Under pytest-xdist the controller sees every worker's reports: only it
  writes (a worker writing too would log each failure twice)."""
  path = os.environ.get("JAX_FLASH_FAILURE_LOG")
  if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
    with open(path, "a") as f:
      f.write(f"=== {report.nodeid} ({report.when})\n"
              f"{report.longreprtext[-4000:]}\n")
