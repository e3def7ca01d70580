"""Run by tests/test_ring.py in a fresh process with 8 host devices."""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash.testing import assert_attention_close, relative_error  # noqa: E402,E501


def main(causal, num_kv_heads, devices, segments=False,
         implementation="interpret", sinks=False, dropout=False,
         alibi=False):
  mesh = jax.make_mesh((devices,), ("seq",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])
  b, t, n, h = 2, 128, 4, 32
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (b, t, n, h))
  k = jax.random.normal(keys[1], (b, t, num_kv_heads, h))
  v = jax.random.normal(keys[2], (b, t, num_kv_heads, h))
  do = jax.random.normal(keys[3], (b, t, n, h))

  sink_values = jnp.linspace(-1.0, 2.0, n) if sinks else None

  def loss(attention):
    def f(q, k, v, s):
      out = attention(q, k, v, s)
      return jnp.sum(out * do), out
    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))

  ids = None
  if segments:  # Packed documents of random lengths.
    ids = jnp.sort(jax.random.randint(keys[3], (b, t), 0, 5), axis=1)
  drop = (dict(dropout_rate=0.25, dropout_rng=jax.random.key(7)) if dropout
          else {})
  if alibi:  # Per batch and head.
    drop["alibi_slopes"] = jnp.linspace(0.02, 0.4, b * n).reshape(b, n)
  ring = lambda q, k, v, s: jax_flash.ring_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, segment_ids=ids,
      sinks=s, implementation=implementation, **drop)
  ref = lambda q, k, v, s: jax_flash.reference_attention(
      q, k, v, is_causal=causal, segment_ids=ids, sinks=s, **drop)
  (_, out), grads = loss(ring)(q, k, v, sink_values)
  (_, ref_out), ref_grads = loss(ref)(q, k, v, sink_values)
  errors = [relative_error(out, ref_out)] + [
      relative_error(a, r) for a, r in zip(grads, ref_grads)]
  print(f"causal={causal} kv_heads={num_kv_heads} devices={devices} "
        f"segments={segments} implementation={implementation} "
        f"sinks={sinks} dropout={dropout} alibi={alibi} "
        f"errors={errors}")
  assert_attention_close({"out": out, "grads": grads},
                         {"out": ref_out, "grads": ref_grads})


if __name__ == "__main__":
  main(sys.argv[1] == "causal", int(sys.argv[2]), int(sys.argv[3]),
       sys.argv[4] == "segments", sys.argv[5],
       len(sys.argv) > 6 and "sinks" in sys.argv[6],
       len(sys.argv) > 6 and "dropout" in sys.argv[6],
       len(sys.argv) > 6 and "alibi" in sys.argv[6])
