"""Lowered kernels kept across processes, beside JAX's persistent compilation cache.

JAX's persistent cache keeps XLA's executables, but a new process still
traces and lowers every Pallas kernel before it can look one up (about 2 s
of a Mosaic GPU forward+backward's first call on an H200's host). Where
that cache is on (`jax_compilation_cache_dir` set), each distinct forward
and backward of the attention primitive is also kept as a serialized
`jax.export.Exported` (its StableHLO, the kernels' custom calls in it) in
the folder's `jax_flash/` subfolder, keyed by everything static about the
call (plan, tiles, mask, scores, operand layout), the input types, the
device kind and the jax, jaxlib and jax-flash versions; a later process
calls the stored program instead of tracing and lowering the kernels again.
Calls with a user's mask_mod or score_mod (functions, whose identity does
not survive a process) and calls split over several devices are not kept.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile

import jax
from jax import export

logger = logging.getLogger(__name__)

# Custom calls of the kernels: Mosaic GPU's and Triton's. A stored program
# is only ever read by the versions that wrote it (they are in the key).
_KERNEL_TARGETS = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")


def _folder() -> str | None:
  root = jax.config.jax_compilation_cache_dir
  return None if not root else os.path.join(root, "jax_flash")


def _versions() -> str:
  names = ("jax", "jaxlib", "jax-flash")
  versions = []
  for name in names:
    try:
      versions.append(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
      versions.append("-")
  return " ".join(versions)


def _key(static, args) -> str:
  avals = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(
      jax.tree.map(jax.typeof, args))]
  device = jax.devices()[0]
  text = repr((static, avals, device.platform, device.device_kind,
               _versions()))
  return hashlib.sha256(text.encode()).hexdigest()


def _spec(x) -> jax.ShapeDtypeStruct:
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def keepable(cfg) -> bool:
  """Whether a call's programs may be stored: a cache to store in, one
  device (no partitioning), the machine's own (no abstract device to
  compile for), no user functions in its mask or scores (their repr
  names an address), and no collectives over a shard_map's axis
  (`sequence_axis`)."""
  mesh = jax.sharding.get_abstract_mesh()
  return (_folder() is not None and jax.device_count() == 1
          and getattr(mesh, "abstract_device", None) is None
          and cfg.mask.mod is None and cfg.scores.mod is None
          and cfg.sequence_axis is None)


def call(jitted, static, *args):
  """`jitted(*args)`, through a stored `Exported` of it where there is one
  for `static` (hashable, with a repr that is the same in every process)
  and the arguments' types; otherwise exported, stored, then called. Where
  a program cannot be exported or stored, `jitted(*args)` as it is (the
  cache only saves time)."""
  folder = _folder()
  path = os.path.join(folder, _key(static, args) + ".exported")
  if os.path.exists(path):
    try:
      with open(path, "rb") as f:
        exported = export.deserialize(bytearray(f.read()))
      return exported.call(*args)
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
    logger.warning("jax_flash: cannot keep a kernel in %s: %s", folder, e)
    return jitted(*args)
  return exported.call(*args)
