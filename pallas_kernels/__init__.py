"""Pallas kernel backends, one subpackage each (`triton/`, `mosaic_gpu/`),
reading the backend-neutral problem description in `jax_flash.spec`;
`device.py`: what they ask of the GPU."""
