"""Test setup: the same cases run the kernels interpreted on the CPU and for
real (implementation="pallas") on a GPU. GPU-only tests carry `@pytest.mark.gpu`
and are skipped where there is no GPU."""
import os

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
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
