"""Pallas kernel backends, one subpackage each (`triton/`, `mosaic_gpu/`),
reading the backend-neutral problem description in `jax_flash.spec` (and
`spec.device`: what they ask of the GPU)."""
