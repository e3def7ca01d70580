"""What the lowering tests share: calls lowered for an H200 on the CPU.

`jax.jit(...).lower(lowering_platforms=("cuda",))` under an abstract mesh
whose device is an "NVIDIA H200" runs the Pallas Mosaic GPU and Triton
lowerings here: layout inference, the wgmma shape rules and the
shared-memory budget, so a bad tile or layout fails on the CPU.
"""
import re

import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib

import jax_flash


H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                               platform="gpu")
MOSAIC_CALL = "mosaic_gpu"  # The custom call of a Mosaic GPU kernel.
TRITON_FORWARD = "flash_attention_forward"


def lower_grad(implementation, shape=(2, 256, 512, 8, 2, 128),
               dtype=jnp.bfloat16, **kwargs):
  b, t, s, n, k, h = shape
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, k, h), dtype)

  def loss(q, k, v):
    out = jax_flash.flash_attention(q, k, v, implementation=implementation,
                                    **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


MOSAIC_BACKWARD = ("flash_attention_dkv_mosaic", "flash_attention_dq_mosaic")


TRITON_BACKWARD = ("flash_attention_backward_dkdv",
                   "flash_attention_backward_dq")


def sequence_copies(text):
  """The pads and slices of 4-D bf16 arrays (Q, K, V, O, dO and gradients:
  the [B, T, N, H] copies XLA would make around the kernels) in a lowered
  program's text, as 'op: operand -> result' types."""
  shape = r"tensor<\d+x\d+x\d+x\d+xbf16>"
  return re.findall(rf"stablehlo\.(?:pad|slice)[^\n]*?({shape})[^\n]*?-> "
                    rf"({shape})", text)


def lower_forward(shape, head_dim, **kwargs):
  b, t, s, n, k = shape
  q = jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, k, head_dim), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, implementation="mosaic", **kwargs)).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()


def lower_decode(implementation, q_len, page_size=None, **kwargs):
  q = jax.ShapeDtypeStruct((2, q_len, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if page_size is None:
    cache = jax.ShapeDtypeStruct((2, 2048, 2, 128), jnp.bfloat16)
    f = lambda q, n, c: jax_flash.flash_decode(
        q, c, c, kv_lengths=n, implementation=implementation, **kwargs)
    args = (q, lengths, cache)
  else:
    pages = jax.ShapeDtypeStruct((4096 // page_size, page_size, 2, 128),
                                 jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 2048 // page_size), jnp.int32)
    f = lambda q, n, p, t: jax_flash.flash_decode(
        q, kv_lengths=n, key_pages=p, value_pages=p, page_table=t,
        implementation=implementation, **kwargs)
    args = (q, lengths, pages, table)
  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(f).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


def kernel_modules(text):
  """{kernel name: its serialized Mosaic GPU module} of a lowered text,
  without the dump file name's process-wide counter."""
  modules = {}
  for line in text.splitlines():
    name = re.search(r"flash_attention_\w+_mosaic", line)
    if "mosaic_gpu" in line and name:
      modules[name.group(0)] = re.sub(
          r"(dump_basename\\00\w+?)_\d+\\00", r"\1\\00",
          line.split("module = ", 1)[1])
  return modules


def lower_flex(implementation, mask_mod, score_mod=None, t=300, s=520,
               head_dim=128):
  q = jax.ShapeDtypeStruct((2, t, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, s, 2, head_dim), jnp.bfloat16)
  block_mask = jax_flash.create_block_mask(mask_mod, None, None, t, s)

  def loss(q, k, v):
    out = jax_flash.flex_attention(q, k, v, score_mod, block_mask,
                                   implementation=implementation)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(
      mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H200)):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()


def kernel_operands(text, kernel):
  """The operand types of the first call of Mosaic GPU kernel `kernel`."""
  call = next(line for line in text.splitlines()
              if MOSAIC_CALL in line and kernel in line)
  return re.findall(r"tensor<([0-9x]+)x(?:bf16|f16)>", call)
