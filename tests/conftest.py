"""Test setup: the same cases run the kernels interpreted on the CPU and for
real (implementation="pallas") on a GPU. GPU-only tests carry `@pytest.mark.gpu`
and are skipped where there is no GPU."""
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
