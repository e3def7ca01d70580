"""What every backend may ask of the GPU it runs on or compiles for."""
import jax

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
