"""Batch-, head- and sequence-sharded inputs under jax.jit: each shard runs
locally, a sequence shard through context parallelism (all-to-all or
all-gather).

Runs tests/sharded_run.py in a fresh process with 8 simulated host devices
(the device count is fixed when JAX starts): the sharded jit(grad) must give
the single-device results, and with whole GQA groups per device its compiled
HLO must hold no all-gather.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def _run(arg: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
  result = subprocess.run(
      [sys.executable, os.path.join(HERE, "sharded_run.py"), *arg.split()],
      capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  return result.stdout


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_sharded_over_batch_and_heads(num_kv_heads):
  assert f"kv_heads={num_kv_heads}" in _run(str(num_kv_heads))


def test_context_parallel_strategies_match_one_device():
  assert "every case matches one device" in _run("context_parallel")


def test_sequence_axis_inside_shard_map_matches_one_device():
  """`sequence_axis` inside a shard_map: every case of
  `sharded_run.sequence_axis` ran and matched one device, the Flax
  modules built with it too."""
  out = _run("sequence_axis")
  assert sum(line.startswith("sequence_axis ")
             for line in out.splitlines()) == 5, out
  assert "modules on sequence chunks" in out
  assert "every sequence_axis case matches one device" in out


def test_sequence_axis_ring_and_all_gather_match_one_device():
  """`sequence_axis` with context_parallel "ring" or "all_gather": every
  case of `sharded_run.sequence_axis_strategies` ran and matched one
  device, with the collectives each strategy promises."""
  out = _run("sequence_axis_strategies")
  assert sum(line.startswith("sequence_axis ")
             for line in out.splitlines()) == 7, out
  assert "every sequence_axis strategy case matches one device" in out


def test_operands_split_over_batch_and_heads():
  assert "operands: every case matches one device" in _run("operands")


def test_operands_under_each_sequence_strategy():
  assert ("operands by strategy: every case matches one device" in
          _run("operands_by_strategy"))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_every_strategy_with_every_optional_argument(num_kv_heads):
  """`sharded_run.matrix`: each strategy x each optional argument, 8 query
  heads on `num_kv_heads`, the sequence over 8 devices: one device's
  results, or a refusal naming the argument; "auto" runs every cell."""
  out = _run(f"matrix {num_kv_heads}")
  assert f"matrix kv_heads={num_kv_heads}: every cell matches" in out, out
  assert out.count("auto picks") == 1 and "whole" not in out, out


def test_sequence_sharded_forward_of_one_block_compiles():
  """`sharded_run.all_to_all_forward_one_block`, first in its process."""
  out = _run("all_to_all_forward_one_block")
  assert "all_to_all forward alone at 128 tokens" in out, out


def test_sequence_sharded_memory_falls_as_one_over_devices():
  """`sharded_run.memory_per_device`: a device's compiled memory of a
  sequence-sharded causal forward+backward over 2, 4 and 8 devices."""
  out = _run("memory_per_device")
  assert "memory: a device's share falls as 1 / P" in out, out


def test_mods_reading_the_batch_or_head_index_are_found():
  """A mask_mod or score_mod that reads its batch or head index keeps a
  call whole on several devices (a shard would count them from its
  first); one that reads positions alone splits."""
  from jax_flash.core.mods import ElementwiseMod, reads_batch_or_head
  assert reads_batch_or_head(ElementwiseMod(lambda s, b, h, i, j: s + h), 5)
  assert reads_batch_or_head(
      ElementwiseMod(lambda b, h, i, j: (i >= j) & (b % 2 == 0)), 4)
  assert not reads_batch_or_head(
      ElementwiseMod(lambda s, b, h, i, j: s - abs(i - j)), 5)
  assert not reads_batch_or_head(ElementwiseMod(lambda b, h, i, j: i >= j),
                                 4)
