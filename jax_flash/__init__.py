"""jax-flash: exact FlashAttention for JAX: Pallas GPU kernels (Mosaic GPU,
Triton) and a blockwise plain-JAX path for every other device."""
import warnings as _warnings

# Every kernel compiled through the Pallas Triton backend emits this
# DeprecationWarning (upstream plans to remove the backend). Users of this
# library did not choose the backend; silence exactly that message.
_warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated",
    category=DeprecationWarning)

from jax_flash.attention import flash_attention  # noqa: E402
from jax_flash.blockwise import BlockSizes as XlaBlockSizes  # noqa: E402
from jax_flash.decode import flash_decode  # noqa: E402
from jax_flash.flex import (and_masks, create_block_mask,  # noqa: E402
                            flex_attention, or_masks)
from jax_flash.reference import reference_attention  # noqa: E402
from jax_flash.ring import ring_attention  # noqa: E402
from jax_flash.core.dropout import dropout_keep_mask  # noqa: E402
from pallas_kernels.mosaic_gpu.config import \
    BlockSizes as MosaicBlockSizes  # noqa: E402
from pallas_kernels.triton.config import BlockSizes  # noqa: E402

__all__ = ["flash_attention", "flash_decode", "reference_attention",
           "flex_attention", "create_block_mask", "and_masks", "or_masks",
           "ring_attention",
           "BlockSizes", "MosaicBlockSizes", "XlaBlockSizes",
           "dropout_keep_mask"]
__version__ = "0.2.0"


def __getattr__(name):
  """`jax_flash.nnx` and `jax_flash.linen` on first use (flax is imported
  only then)."""
  if name in ("nnx", "linen"):
    import importlib
    return importlib.import_module(f"jax_flash.{name}")
  raise AttributeError(f"module 'jax_flash' has no attribute {name!r}")
