"""With JAX's persistent compilation cache on, a second process calls the
attention primitive's stored programs instead of tracing and lowering its
kernels again, with the same results."""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import jax_flash
from pallas_kernels.triton.backend import TritonBackend
traced = []
original = TritonBackend.forward
def counting(self, *args, **kwargs):
  traced.append("forward")
  return original(self, *args, **kwargs)
TritonBackend.forward = counting
q = jax.random.normal(jax.random.key(0), (2, 100, 4, 32))
k = jax.random.normal(jax.random.key(1), (2, 70, 2, 32))
def loss(q, k, v):
  out = jax_flash.flash_attention(q, k, v, is_causal=True,
                                  implementation="interpret",
                                  key_value_seq_lengths=jnp.array([70, 33]))
  return jnp.sum(out ** 2)
value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, k)
np.save(sys.argv[2], np.concatenate(
    [np.ravel(value)] + [np.ravel(g) for g in grads]))
print("traced", len(traced))
"""


def _run(folder, out):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
  result = subprocess.run([sys.executable, "-c", SCRIPT, folder, out],
                          capture_output=True, text=True, env=env,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return int(result.stdout.split("traced")[-1])


def test_a_second_process_reads_the_stored_kernels(tmp_path):
  pytest.importorskip("flatbuffers")
  folder = str(tmp_path / "cache")
  first = _run(folder, str(tmp_path / "first.npy"))
  stored = os.listdir(os.path.join(folder, "jax_flash"))
  second = _run(folder, str(tmp_path / "second.npy"))
  assert first >= 1 and second == 0, (first, second)
  assert len(stored) == 2  # The forward and the backward.
  assert sorted(os.listdir(os.path.join(folder, "jax_flash"))) == sorted(
      stored)
  np.testing.assert_array_equal(np.load(tmp_path / "first.npy"),
                                np.load(tmp_path / "second.npy"))
