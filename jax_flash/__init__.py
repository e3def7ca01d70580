"""jax-flash: exact FlashAttention for JAX: Pallas GPU kernels (Mosaic GPU,
Triton) and a blockwise plain-JAX path for every other device.

The public names load on first use (PEP 562): `import jax_flash` imports no
kernel module, and `jax_flash.nnx` / `jax_flash.linen` import flax only
when asked for.
"""
import importlib as _importlib
import warnings as _warnings

# Every kernel compiled through the Pallas Triton backend emits this
# DeprecationWarning (upstream plans to remove the backend). Users of this
# library did not choose the backend; silence exactly that message.
_warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated",
    category=DeprecationWarning)

# Public name -> (module, attribute in it; None: the module itself).
_EXPORTS = {
    "flash_attention": ("jax_flash.attention", "flash_attention"),
    "flash_decode": ("jax_flash.decode", "flash_decode"),
    "flex_attention": ("jax_flash.flex", "flex_attention"),
    "create_block_mask": ("jax_flash.flex", "create_block_mask"),
    "and_masks": ("jax_flash.flex", "and_masks"),
    "or_masks": ("jax_flash.flex", "or_masks"),
    "reference_attention": ("jax_flash.reference", "reference_attention"),
    "ring_attention": ("jax_flash.ring", "ring_attention"),
    "dropout_keep_mask": ("jax_flash.core.dropout", "dropout_keep_mask"),
    "BlockSizes": ("pallas_kernels.triton.config", "BlockSizes"),
    "MosaicBlockSizes": ("pallas_kernels.mosaic_gpu.config", "BlockSizes"),
    "XlaBlockSizes": ("jax_flash.blockwise", "BlockSizes"),
    "nnx": ("jax_flash.nnx", None),
    "linen": ("jax_flash.linen", None),
}

__all__ = ["flash_attention", "flash_decode", "reference_attention",
           "flex_attention", "create_block_mask", "and_masks", "or_masks",
           "ring_attention", "BlockSizes", "MosaicBlockSizes",
           "XlaBlockSizes", "dropout_keep_mask"]
__version__ = "0.2.0"


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jax_flash' has no attribute {name!r}")
  module, attribute = _EXPORTS[name]
  value = _importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value  # Later lookups skip __getattr__.
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
