"""What every backend may ask of the GPU it compiles for."""
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
