"""Lowered kernels kept across processes: on by default.

A new process traces and lowers every Pallas kernel of a call before XLA
compiles it (1.2-2 s of a Mosaic GPU forward+backward's first call on an
H200's host). Each distinct forward and backward of the attention
primitive is kept as a serialized `jax.export.Exported` (its StableHLO,
the kernels' custom calls in it) in a folder of the user's
(`cache_folder()`), keyed by everything static about the call (plan,
tiles, mask, scores, operand layout), the input types, the device kind,
the jax and jaxlib versions and the library's own code (a hash of its
source files); a later process calls the stored program instead of
tracing and lowering the kernels again. With JAX's persistent compilation
cache on as well (`jax_compilation_cache_dir`), XLA's compile of the
program is skipped too.

`$JAX_FLASH_CACHE_DIR` moves the folder, or switches the cache off when
empty or "off"; otherwise it is `$XDG_CACHE_HOME/jax_flash/kernels`
(`~/.cache/jax_flash/kernels` without XDG_CACHE_HOME). Files are written
whole under a temporary name and renamed into place, so concurrent
processes read a program whole or not at all. Calls with a user's
mask_mod or score_mod (functions, whose identity does not survive a
process) are not kept, nor is anything in a process that sees more than
one device (its calls may be split over them).

The folder holds at most `$JAX_FLASH_CACHE_MAX_MB` megabytes (1024 by
default; a forward+backward's programs take about 0.3 MB): storing a
program past that removes the least recently used ones (a read counts as
a use) down to 80% of it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import re
import tempfile
import time

import jax
from jax import export

logger = logging.getLogger(__name__)

ENV = "JAX_FLASH_CACHE_DIR"
MAX_MB_ENV = "JAX_FLASH_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
# A file of another name (a program being written) younger than this is
# never removed.
_WRITING_S = 600
# Custom calls of the kernels: Mosaic GPU's and Triton's. A stored program
# is only ever read by the code that wrote it (its hash is in the key).
_KERNEL_TARGETS = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")
# Keys that failed to export in this process: not tried again.
_unkeepable: set[str] = set()


def cache_folder() -> str | None:
  """Where the programs are kept; None when the cache is off."""
  chosen = os.environ.get(ENV)
  if chosen is not None:
    return None if chosen.strip().lower() in ("", "off", "0") else chosen
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jax_flash", "kernels")


@functools.cache
def _versions() -> str:
  """jax's and jaxlib's versions and a hash of the library's source."""
  versions = []
  for name in ("jax", "jaxlib"):
    try:
      versions.append(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
      versions.append("-")
  source = hashlib.sha256()
  for package in ("jax_flash", "pallas_kernels"):
    root = pathlib.Path(__file__).resolve().parent.parent / package
    for path in sorted(root.rglob("*.py")):
      source.update(str(path.relative_to(root)).encode())
      source.update(path.read_bytes())
  return " ".join(versions + [source.hexdigest()])


# An object's address in a repr ("<function f at 0x7f...>"): a key that
# holds one differs in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _key(static, args) -> str | None:
  """The hash naming the stored program of `static` and the arguments'
  types, or None where the text it hashes names an object's address
  (never the same in another process: such a call is not kept)."""
  avals = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(
      jax.tree.map(jax.typeof, args))]
  device = jax.devices()[0]
  text = repr((static, avals, device.platform, device.device_kind,
               _versions()))
  if _ADDRESS.search(text):
    return None
  return hashlib.sha256(text.encode()).hexdigest()


def _spec(x) -> jax.ShapeDtypeStruct:
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def keepable(cfg) -> bool:
  """Whether a call's programs may be stored: the cache on, one device
  (no partitioning), the machine's own (no abstract device to compile
  for), no user functions in its mask or scores (their repr names an
  address), and no collectives over a shard_map's axis
  (`sequence_axis`)."""
  mesh = jax.sharding.get_abstract_mesh()
  return (cache_folder() is not None and jax.device_count() == 1
          and getattr(mesh, "abstract_device", None) is None
          and cfg.mask.mod is None and cfg.scores.mod is None
          and cfg.sequence_axis is None)


def call(jitted, static, *args):
  """`jitted(*args)`, through a stored `Exported` of it where there is one
  for `static` (hashable, with a repr that is the same in every process)
  and the arguments' types; otherwise exported, stored, then called. Where
  a program cannot be exported or stored, `jitted(*args)` as it is (the
  cache only saves time)."""
  folder = cache_folder()
  key = _key(static, args)
  if key is None or key in _unkeepable:
    return jitted(*args)
  path = os.path.join(folder, key + ".exported")
  try:
    with open(path, "rb") as f:
      exported = export.deserialize(bytearray(f.read()))
    _touch(path)
    return exported.call(*args)
  except FileNotFoundError:  # Not stored yet, or removed (`_trim`).
    pass
  except Exception as e:  # Unreadable: written again below.
    logger.warning("jax_flash: ignoring the stored kernel %s: %s", path, e)
  try:
    exported = export.export(
        jitted, platforms=(export.default_export_platform(),),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t)
                         for t in _KERNEL_TARGETS])(*jax.tree.map(_spec, args))
    data = exported.serialize()
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
      f.write(data)
    os.replace(f.name, path)  # Whole or absent, for a reader beside us.
  except Exception as e:
    _unkeepable.add(key)
    logger.warning("jax_flash: cannot keep a kernel in %s (%s: %s); set "
                   "%s=off to stop trying", folder, type(e).__name__, e, ENV)
    return jitted(*args)
  _trim(folder, keep=path)
  return exported.call(*args)


def max_bytes() -> int:
  """The folder's size limit in bytes (`$JAX_FLASH_CACHE_MAX_MB`)."""
  text = os.environ.get(MAX_MB_ENV, "").strip()
  try:
    megabytes = float(text) if text else DEFAULT_MAX_MB
  except ValueError:
    raise ValueError(f"{MAX_MB_ENV} must be a number of megabytes, got "
                     f"{text!r}") from None
  return int(megabytes * 2**20)


def _touch(path):
  """Marks a stored program used now (its modification time)."""
  try:
    os.utime(path)
  except OSError:
    pass


def _trim(folder, keep):
  """Past `max_bytes()`, removes the least recently used files of `folder`
  (all but `keep`, and files being written) down to 80% of it. Another
  process may remove the same files meanwhile."""
  limit, now, files = max_bytes(), time.time(), []
  try:
    entries = list(os.scandir(folder))
  except OSError:
    return
  for entry in entries:
    try:
      stat = entry.stat()
    except OSError:
      continue
    if entry.is_file():
      files.append((stat.st_mtime, stat.st_size, entry.path))
  total = sum(size for _, size, _ in files)
  if total <= limit:
    return
  for mtime, size, path in sorted(files):
    if total <= 0.8 * limit:
      break
    if path == keep or (not path.endswith(".exported")
                        and now - mtime < _WRITING_S):
      continue
    try:
      os.remove(path)
    except OSError:
      continue
    total -= size
