"""The compiled programs of sequence-sharded calls on 8 simulated CPU
devices, as digests without names or source locations: a refactor of
`jax_flash.context_parallel` that leaves every digest unchanged leaves
every collective and every per-device program unchanged.

    PYTHONPATH=<tree> python scripts/sharded_programs.py --out before.json
    python scripts/sharded_programs.py --compare before.json after.json

Cases: each strategy, causal or not, forward and gradients through
`jax.value_and_grad`, on the "xla" backend (a 2 x 4 mesh; ring_all_to_all
over both axes, the others over the 4).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402

STRATEGIES = ("all_to_all", "all_gather", "ring", "ring_all_to_all")


def normalized(text: str) -> str:
  """A compiled module's text without names, metadata or source frames."""
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r"%[\w.\-]+", "%x", text)
  text = re.sub(r"(to_apply|calls|body|condition|branch_computations)="
                r"[^,\n]*", r"\1=..", text)
  text = re.sub(r"^(\w*\s*)?[\w.\-]+ (\{|\()", r"\1C \2", text, flags=re.M)
  text = "".join(line for line in text.splitlines(True) if not re.search(
      r'file_name_id|file_location_id|^\d+ "', line))
  return re.sub(r", stack_frame_id=\d+", "", text)


def digests() -> dict[str, str]:
  mesh = jax.make_mesh((2, 4), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 64, 8, 32)) for key in keys)
  out = {}
  for strategy in STRATEGIES:
    seq = ("a", "b") if strategy == "ring_all_to_all" else "b"
    sharding = NamedSharding(mesh, P(None, seq, None, None))
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    for causal in (False, True):
      def loss(q, k, v, causal=causal, strategy=strategy):
        return jax_flash.flash_attention(
            q, k, v, is_causal=causal, implementation="xla",
            context_parallel=strategy).sum()
      text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(
          *args).compile().as_text()
      out[f"{strategy} causal={causal}"] = hashlib.sha1(
          normalized(text).encode()).hexdigest()[:16]
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out")
  parser.add_argument("--compare", nargs=2)
  args = parser.parse_args()
  if args.compare:
    a, b = (json.load(open(path)) for path in args.compare)
    changed = [name for name in a if a[name] != b.get(name)]
    print(f"{len(a) - len(changed)} of {len(a)} identical; changed: "
          f"{changed or 'none'}")
    return
  result = digests()
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
