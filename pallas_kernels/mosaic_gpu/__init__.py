"""The Mosaic GPU backend: Pallas kernels for Hopper (sm90a) with TMA, wgmma
and warp specialization.

A forward kernel (`flash_fwd`) and a backward of two kernels (`flash_bwd`:
dK/dV and dQ). What it takes is narrower than the Triton backend
(`unsupported` says what, and the dispatch then runs Triton): bf16/fp16,
head dims up to 256 and value's of its own (in column parts one swizzle
atom wide where a head dim is off a multiple of 16, `tiles.Columns`;
else run at `config.kernel_head_dim`, a multiple of 16, Q, K and V padded
with zero columns: a value head dim of its own, the forward's K/V tiles
whose V cannot take the parts, a backward above
`config.BACKWARD_PARTS_MAX_KV_LEN` keys), any lengths (read in place, the
last tiles reaching past the ends, in column parts at a length off a
multiple of 8 where tiles are wider than a swizzle atom; XLA pads such a
length only where parts are not taken, `tiles.tma_rows`; the kernels
mask keys past the length), causal masks,
sliding windows, flex attention's mask_mods that close over no array, lengths and segment ids
(the band and the tile-range tables of the shared mask description),
soft-cap, ALiBi and score_mods (`Scores.logits2`), sinks (in each row's
denominator; their gradient comes from the logsumexp) and dropout (the keep
bits of `core.dropout`, every backend's); `flash_decode`'s prompt chunks of
more than `config.SPLIT_KV_MAX_QUERIES` tokens (the forward with query offsets)
and, against a contiguous cache at head dims `config.SPLIT_KV_HEAD_DIMS`,
shorter ones (the split-KV kernel `flash_decode`: a balanced stream of
K/V tiles a multiprocessor, two consumer warpgroups).
Dense masks and bias (a [Bm, Nm, T, S] tile read from global memory on
every tile, a row or column vector where it broadcasts; the dispatch takes
the bias gradient from the Triton backend's dbias kernel, and the whole
backward from the Triton kernels for a bias per (query, key) pair:
`backward_unsupported`). With `fp8=True` (inputs rounded to e4m3 with
per-(batch, KV head) scales, `jax_flash.core.fp8`) or float8 inputs with
`descale`, causal or no mask, head dims `config.FP8_BLOCK_KV`: the
forward in e4m3 on the call's e4m3 values (`flash_fwd`'s
`fp8_operands`), the backward (fp8=True) the same kernels on e4m3 tiles
(`BlockSizes.fp8_backward`: the default at head dims 128 and 256, an
option at 64; dO rounded by `MosaicGpuBackend.fp8_rounding`) or the
bf16 kernels on the rounded values.
Everything it takes has run on an H200 (tests/test_gpu.py,
test_flex.py, test_decode.py, test_fp8.py).
"""
