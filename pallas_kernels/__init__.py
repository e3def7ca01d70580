"""Pallas kernel backends, one subpackage each (`triton/`, `mosaic_gpu/`),
reading the backend-neutral problem description in `jax_flash.core` (and
`core.device`: what they ask of the GPU)."""
