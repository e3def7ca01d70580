"""`ring_attention`: self-attention with the sequence sharded over one mesh
axis, run by the ring of `jax_flash.context_parallel`."""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_flash.attention import flash_attention
from jax_flash.core import checks


def ring_attention(query, key, value, *, mesh, axis_name, is_causal=False,
                   segment_ids=None, scale=None, sinks=None,
                   dropout_rate=0.0, dropout_rng=None, alibi_slopes=None,
                   implementation=None, block_sizes=None):
  """Self-attention with the sequence sharded over `axis_name` of `mesh`.

  `flash_attention(..., sequence_axis=axis_name, context_parallel="ring")`
  inside a `jax.shard_map` over that axis: key/value chunks travel around
  the devices while each attends its queries to them (causal calls in the
  balanced layout, device d holding chunks d and 2P-1-d of 2P).

  Args:
    query: [B, T, N, H]; key, value: [B, T, K, H] (K divides N), the same
      sequence. T must divide by P (2P when causal), P the axis size.
    mesh, axis_name: the mesh and its axis the sequence is split over
      (other mesh axes are left to the caller's sharding of batch/heads).
    is_causal: causal attention.
    segment_ids: int [B, T] (packed documents: a query sees only keys with
      its id); the key ids travel around the ring with the keys.
    scale, sinks, dropout_rate, dropout_rng, alibi_slopes: as in
      `flash_attention` (dropout: the keep bits of the unsharded call;
      ALiBi: distances in the whole sequence).
    implementation, block_sizes: as in `flash_attention` (the backend each
      device runs on each pair of chunks).
  Returns [B, T, N, H], sequence-sharded over `axis_name`; differentiable
  with respect to query, key, value and sinks (the backward rings too).
  """
  p = checks.check_qkv(query, key, value)
  if p.unbatched or p.q_len != p.kv_len:
    raise ValueError("ring_attention takes batched self-attention: query "
                     "[B, T, N, H] and key/value [B, T, K, H]")
  size = mesh.shape[axis_name]
  chunks = 2 * size if is_causal else size
  if p.q_len % chunks:
    raise ValueError(f"sequence length {p.q_len} must divide by {chunks} "
                     f"(the {axis_name!r} axis has {size} devices"
                     f"{', twice that when causal' if is_causal else ''})")
  spec = P(None, axis_name)

  def attend(q, k, v, ids, sinks, rng, slopes):
    return flash_attention(
        q, k, v, is_causal=is_causal, segment_ids=ids, scale=scale,
        sinks=sinks, dropout_rate=dropout_rate, dropout_rng=rng,
        alibi_slopes=slopes, implementation=implementation,
        block_sizes=block_sizes, context_parallel="ring",
        sequence_axis=axis_name)
  return jax.shard_map(
      attend, mesh=mesh,
      in_specs=(spec, spec, spec, None if segment_ids is None else spec,
                P(), P(), P()),
      out_specs=spec)(query, key, value, segment_ids, sinks, dropout_rng,
                      alibi_slopes)
