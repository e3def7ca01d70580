"""The kernel cache (`jax_flash._kernel_cache`): a second process calls the
attention primitive's stored programs instead of tracing and lowering its
kernels again, with the same results; processes writing the same programs
at once leave them whole; the folder follows $JAX_FLASH_CACHE_DIR and
$XDG_CACHE_HOME."""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
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
if len(sys.argv) > 3:  # Start together: ready files in argv[3], argv[4] of them.
  open(os.path.join(sys.argv[3], os.path.basename(sys.argv[2])), "w").close()
  deadline = time.time() + 300
  while len(os.listdir(sys.argv[3])) < int(sys.argv[4]) and time.time() < deadline:
    time.sleep(0.01)
value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, k)
np.save(sys.argv[2], np.concatenate(
    [np.ravel(value)] + [np.ravel(g) for g in grads]))
print("traced", len(traced))
"""


def _start(folder, out, together=()):
  """The script in a process of its own; `together`: (folder, n): it calls
  once n processes have reached the call (each marks the folder)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_FLASH_CACHE_DIR=folder,
             PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
  return subprocess.Popen([sys.executable, "-c", SCRIPT, "-", out,
                           *map(str, together)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)


def _traced(process) -> int:
  """How many forwards the process traced (0: all came from the cache)."""
  stdout, stderr = process.communicate(timeout=600)
  assert process.returncode == 0, stderr[-3000:]
  return int(stdout.split("traced")[-1])


def _run(folder, out):
  return _traced(_start(folder, out))


def test_a_second_process_reads_the_stored_kernels(tmp_path):
  pytest.importorskip("flatbuffers")
  folder = str(tmp_path / "cache")
  first = _run(folder, str(tmp_path / "first.npy"))
  stored = os.listdir(folder)
  second = _run(folder, str(tmp_path / "second.npy"))
  assert first >= 1 and second == 0, (first, second)
  assert len(stored) == 2  # The forward and the backward.
  assert sorted(os.listdir(folder)) == sorted(stored)
  np.testing.assert_array_equal(np.load(tmp_path / "first.npy"),
                                np.load(tmp_path / "second.npy"))


def test_processes_writing_at_once_leave_whole_programs(tmp_path):
  """Two processes storing the same programs at the same time: each runs,
  the folder holds the two programs and nothing else, and a third process
  reads them."""
  pytest.importorskip("flatbuffers")
  folder = str(tmp_path / "cache")
  ready = tmp_path / "ready"
  ready.mkdir()
  # Both look in the cache before either stores (a loaded machine could
  # otherwise finish one before the other starts).
  both = [_start(folder, str(tmp_path / f"{i}.npy"), (ready, 2))
          for i in range(2)]
  assert all(_traced(p) >= 1 for p in both)
  assert len(os.listdir(folder)) == 2, os.listdir(folder)
  assert _run(folder, str(tmp_path / "third.npy")) == 0
  for i in range(2):
    np.testing.assert_array_equal(np.load(tmp_path / f"{i}.npy"),
                                  np.load(tmp_path / "third.npy"))


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
  from jax_flash import _kernel_cache
  monkeypatch.delenv("JAX_FLASH_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert _kernel_cache.cache_folder() == str(tmp_path / "jax_flash" /
                                             "kernels")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert _kernel_cache.cache_folder() == str(
      tmp_path / "home" / ".cache" / "jax_flash" / "kernels")
  monkeypatch.setenv("JAX_FLASH_CACHE_DIR", str(tmp_path / "mine"))
  assert _kernel_cache.cache_folder() == str(tmp_path / "mine")
  for off in ("", "off", "0"):
    monkeypatch.setenv("JAX_FLASH_CACHE_DIR", off)
    assert _kernel_cache.cache_folder() is None


def test_the_key_holds_the_versions_and_the_code():
  import jax

  from jax_flash import _kernel_cache
  versions = _kernel_cache._versions().split()
  assert versions[0] == jax.__version__ and len(versions[-1]) == 64


KEYS_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax
from jax_flash import _kernel_cache
import lowering
keys = []
_kernel_cache.keepable = lambda cfg: True  # Under the abstract device too.
def recording(jitted, static, *args):
  keys.append(_kernel_cache._key(static, args))
  return jitted(*args)
_kernel_cache.call = recording
import jax.numpy as jnp
lowering.lower_grad("mosaic", is_causal=True)
lowering.lower_grad("mosaic", fp8=True)
lowering.lower_grad("mosaic", is_causal=True, logits_soft_cap=30.0,
                    alibi_slopes=jnp.full((8,), 0.1),
                    dropout_rate=0.1, dropout_rng=jax.random.key(0))
lowering.lower_grad("mosaic", local_window_size=(64, 0),
                    sinks=jnp.zeros((8,)),
                    segment_ids=(jnp.zeros((2, 256), jnp.int32),
                                 jnp.zeros((2, 512), jnp.int32)))
lowering.lower_grad("triton", is_causal=True)
print("keys", " ".join(map(str, keys)))
"""


def test_the_gpu_kernels_keys_are_the_same_in_every_process():
  """The keys of the Mosaic GPU and Triton kernels' programs (lowered for
  an H200 here) name no object's address: a second process finds what the
  first stored."""
  def keys():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
    result = subprocess.run([sys.executable, "-c", KEYS_SCRIPT, HERE],
                            capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("keys")[-1].split()
  first = keys()
  assert len(first) == 10 and "None" not in first, first
  assert keys() == first


def test_a_key_naming_an_address_is_not_kept(tmp_path, monkeypatch):
  import jax
  import jax.numpy as jnp

  from jax_flash import _kernel_cache
  monkeypatch.setenv("JAX_FLASH_CACHE_DIR", str(tmp_path))
  x = jnp.arange(3.0)
  assert _kernel_cache._key(("forward", lambda: 0), (x,)) is None
  assert _kernel_cache._key(("forward", "plain"), (x,)) is not None
  out = _kernel_cache.call(jax.jit(lambda x: x * 2), ("f", lambda: 0), x)
  np.testing.assert_array_equal(out, 2 * np.arange(3.0))
  assert not os.listdir(tmp_path)


def test_the_folder_keeps_to_its_size_limit(tmp_path, monkeypatch):
  """Past $JAX_FLASH_CACHE_MAX_MB the least recently used programs go, down
  to 80% of it; the one just stored and a program being written stay."""
  from jax_flash import _kernel_cache
  monkeypatch.setenv("JAX_FLASH_CACHE_MAX_MB", "1")  # 1 MiB.
  kib = 1024
  old = 1_000_000.0
  names = [f"{i}.exported" for i in range(6)]
  for i, name in enumerate(names):  # 0 the least recently used.
    path = tmp_path / name
    path.write_bytes(b"x" * (256 * kib))
    os.utime(path, (old + i, old + i))
  writing = tmp_path / "tmpwriting"  # Another process's, being written.
  writing.write_bytes(b"x" * (256 * kib))
  keep = str(tmp_path / names[0])  # Just stored (an old time, even so).
  _kernel_cache._trim(str(tmp_path), keep=keep)
  left = sorted(os.listdir(tmp_path))
  # 7 x 256 KiB in 1 MiB: the oldest go (not `keep`, not the one being
  # written) until at most 819 KiB stay.
  assert left == sorted([names[0], names[5], "tmpwriting"]), left
  assert sum(os.path.getsize(tmp_path / n) for n in left) <= 0.8 * 2**20
  _kernel_cache._trim(str(tmp_path), keep=keep)  # Under the limit: no-op.
  assert sorted(os.listdir(tmp_path)) == left


def test_a_read_marks_a_program_used(tmp_path, monkeypatch):
  import jax
  import jax.numpy as jnp

  from jax_flash import _kernel_cache
  monkeypatch.setenv("JAX_FLASH_CACHE_DIR", str(tmp_path))
  x = jnp.arange(4.0)
  double = jax.jit(lambda x: x * 2)
  np.testing.assert_array_equal(
      _kernel_cache.call(double, ("double",), x), 2 * np.arange(4.0))
  [name] = os.listdir(tmp_path)
  os.utime(tmp_path / name, (1_000_000.0, 1_000_000.0))
  np.testing.assert_array_equal(
      _kernel_cache.call(double, ("double",), x), 2 * np.arange(4.0))
  assert os.path.getmtime(tmp_path / name) > 1_000_000.0
  assert os.listdir(tmp_path) == [name]


def test_a_bad_size_limit_names_the_variable(monkeypatch):
  from jax_flash import _kernel_cache
  monkeypatch.setenv("JAX_FLASH_CACHE_MAX_MB", "lots")
  with pytest.raises(ValueError, match="JAX_FLASH_CACHE_MAX_MB"):
    _kernel_cache.max_bytes()
  monkeypatch.delenv("JAX_FLASH_CACHE_MAX_MB")
  assert _kernel_cache.max_bytes() == 1024 * 2**20
