"""Batch-, head- and sequence-sharded inputs run without gathering them.

The Pallas kernels are opaque custom calls to XLA's partitioner, which would
otherwise gather sharded inputs onto every device. `custom_partitioning`
tells it that attention is independent per (batch, head): the forward and the
backward run on each device's shard of the batch and of the heads. Heads
shard only where the kv heads divide evenly, so that every device holds
whole GQA groups.

Queries sharded along the sequence (keys sharded over the same mesh axes,
or not sharded along it) run context parallelism, one of three strategies
(`STRATEGIES`; `context_parallel` picks, "auto" by the bytes each device
moves, `plan.cost`, among those that hold at most `plan.MEMORY_SLACK`
times the least, `plan.held`):

* all_to_all (DeepSpeed-Ulysses): an all-to-all over the sequence axes
  trades each device's sequence chunk of every head for the whole sequence
  of a few heads, attention runs on them as on one device (every mask of
  the call unchanged), and an all-to-all returns the output (and the
  backward's gradients) to sequence chunks. It needs keys sharded like the
  queries and the query heads of a device's head shard in whole groups
  of lcm(K, P) KV heads: KV heads fewer than the devices are sent as
  copies, their gradients summed (`plan.kv_repeats`).
* all_gather: each device gathers the whole of K and V and runs its own
  queries against them at their positions in the sequence (query offsets);
  the backward's dK and dV partials are reduce-scattered back. Causal
  calls balance the work: the halves of the chunks are exchanged so that
  device d holds chunks d and 2P-1-d of 2P (`collectives.to_zigzag`),
  and the results go back. Queries are never gathered.
* ring (it moves as much as all_gather, and spares memory: "auto" picks
  it where all_gather would hold too much):
  self-attention with causal or full masks or causal sliding windows
  (segment ids, lengths, sinks, dropout and ALiBi too); K/V chunks
  travel around the devices while each runs its pairs (`ring`; `jax_flash.ring_attention`
  runs it inside a shard_map), causal calls in the balanced layout,
  windowed ones in order, stopping after the chunks the window reaches.

A call with optional operands (`Operands`: ids, a dense mask, a bias,
ALiBi slopes, sinks, query offsets, tile kinds, dropout's seed) splits
over batch and heads too, each operand along its own batch and head dims
(`partition.operand_factors`; a dim of 1 that broadcasts stays whole,
and a gradient summed over a split it broadcasts along is summed over
those devices); its sequence splits by the strategies its arrays allow
(`plan.STRATEGY_OPERANDS`), else is gathered. Dropout's seed is shifted
to each device's place in the batch and the heads, and all_gather's
chunks draw the bits of their queries' positions, so its keep bits are
the whole call's. A mask_mod or
score_mod that reads its batch or head index and a mod's arrays keep the
call whole (`partition.splittable`).

A strategy named that cannot run a call whatever its sharding (its
arrays, its mask, T != S on a ring: `plan.refused_by`) is a ValueError
as the call traces. One that cannot run the sharding (known only in
XLA's partitioner, where an exception reaches the user as an INTERNAL
error) warns and the cheapest strategy that can runs the call
(`plan.plan`'s `fallback`).

Modules: `plan` (the split of a call, the cost model, what each strategy
refuses), `collectives` (moves between chunks and heads, the balanced
layout), `lowerings` (each strategy's per-device function), `ring` (the
ring's loops), `partition` (the one custom_partitioning builder and the
split forward and backward), `sequence_axis` (calls inside a shard_map).
Nothing here imports the dispatch or a backend: the backends' functions
come in as arguments (`partition.sharded_forward`).
"""
from jax_flash.context_parallel.partition import (sharded_backward,
                                                  sharded_forward, splittable)

__all__ = ["sharded_backward", "sharded_forward", "splittable"]
