"""ring_attention on simulated host devices: results and gradients equal the
single-device reference, causal (zigzag) and not, MHA/GQA/MQA, segments, with
the interpreted kernels and with the "xla" backend on each pair, with sinks
(their gradient summed over the devices), dropout (the reference's keep
bits) and ALiBi; the backward a group of heads at a time where there are
4 or more KV heads."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


# The ring's own work (the zigzag, the merge of partials, the rotations,
# the gradients travelling home) is the same on every backend: "xla" pairs
# check it in every case, the interpreted kernels in two (the kernels
# themselves are checked on their own elsewhere).
@pytest.mark.parametrize("causal, kv_heads, devices, segments, impl, sinks", [
    ("plain", 4, 4, "", "xla", ""), ("causal", 2, 8, "", "xla", ""),
    ("plain", 1, 8, "", "interpret", ""), ("causal", 1, 2, "", "interpret", ""),
    ("causal", 2, 4, "segments", "xla", ""),
    ("causal", 2, 4, "", "xla", "sinks"),
    ("plain", 4, 2, "segments", "xla", "sinks"),
    ("causal", 2, 4, "", "xla", "dropout"),
    ("causal", 1, 2, "segments", "interpret", "sinks+dropout"),
    ("causal", 2, 4, "", "interpret", "alibi"),
    ("plain", 2, 4, "segments", "xla", "alibi+dropout"),
    # 4 KV heads: the backward in two groups of heads (`ring.head_groups`).
    ("causal", 4, 4, "segments", "xla", "sinks+dropout+alibi"),
    ("causal", 4, 2, "", "interpret", "dropout")])
def test_ring_attention_matches_single_device(causal, kv_heads, devices,
                                              segments, impl, sinks):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
  result = subprocess.run(
      [sys.executable, os.path.join(HERE, "ring_run.py"), causal,
       str(kv_heads), str(devices), segments or "-", impl, sinks or "-"],
      capture_output=True, text=True,
      env=env,
      timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "errors=" in result.stdout
