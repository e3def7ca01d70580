"""What every backend may ask of the GPU it runs on or compiles for, and
how a call meets its mesh's axis types (`on_auto_axes`)."""
import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# Multiprocessors of an H100 SXM / H200: the answer where no GPU is (the
# kernels lowered on a CPU, or interpreted).
DEFAULT_MULTIPROCESSORS = 132


def num_multiprocessors() -> int:
  """Multiprocessors (SMs) of the first GPU, or DEFAULT_MULTIPROCESSORS
  without one: the persistent Mosaic forward's CTAs, the Triton decode
  kernel's programs per multiprocessor."""
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:
    return DEFAULT_MULTIPROCESSORS


def on_gpu(x) -> bool:
  """Whether `x` lives on a GPU (a tracer: where the computation runs)."""
  try:
    return any(d.platform == "gpu" for d in x.devices())
  except Exception:
    return gpu_target()


def gpu_target() -> bool:
  """A GPU to run on, or one to compile for (an abstract mesh's device)."""
  if jax.default_backend() == "gpu":
    return True
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform == "gpu"


def hopper_target() -> bool:
  """An sm90 GPU (H100/H200) to run on, or one to compile for."""
  if jax.default_backend() == "gpu":
    return all(getattr(d, "compute_capability", "") == "9.0"
               for d in jax.local_devices())
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform == "gpu" and any(
      name in device.device_kind for name in ("H100", "H200", "H800"))


def on_auto_axes(fn, query, *arrays):
  """fn(query, *arrays) -> (out [B, T, N, Hv], lse [B, N, T]). Where the
  arrays' shardings are part of their types (a mesh with Explicit axes,
  `jax.make_mesh`'s default), fn runs with those axes as Auto ones
  (`jax.sharding.auto_axes`), the way the kernels and their partitioning
  rules are written, and its results come out sharded as the query is
  (lse over its batch, heads and rows)."""
  mesh = _explicit_mesh(query, *arrays)
  if mesh is None:
    return fn(query, *arrays)
  b, t, n = (tuple(jax.typeof(query).sharding.spec) + (None,) * 3)[:3]
  return jax.sharding.auto_axes(fn, out_sharding=(
      NamedSharding(mesh, P(b, t, n, None)),
      NamedSharding(mesh, P(b, n, t))))(query, *arrays)


def _explicit_mesh(*arrays):
  """The mesh of the first array whose sharding type has Explicit axes,
  or None."""
  for x in jax.tree.leaves(arrays):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and any(
        t == AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None
