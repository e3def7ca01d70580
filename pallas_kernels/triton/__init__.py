"""The Triton backend: Pallas kernels lowered through Triton (any CUDA GPU),
or run by the Pallas interpreter (`TritonBackend(interpret=True)`, any
machine: what the CPU tests run).

It takes every feature of the problem description (`jax_flash.core`); its
limits are the dtypes and head dims of `config`. Files: `config` (block
sizes, limits), `tiles` (masked tile loads/stores, the dot), `tile_context`
(a program's view of the mask and scores), `operand_specs` (BlockSpecs of the
optional operands), one file per kernel family with its launcher:
`flash_fwd`, `flash_fwd_v1`, `flash_bwd`, `flash_decode`, and
`fp8_round` (fp8=True's rounding of the inputs to e4m3 on a Hopper GPU,
whichever backend then runs the call: `jax_flash._dispatch.fp8_rounding`).
"""
