"""Pallas kernel backends, one subpackage each (`triton/`), reading the
backend-neutral problem description in `jax_flash.spec`."""
