"""ring_attention on 8 simulated host devices: results and gradients equal the
single-device reference, causal (zigzag) and not, MHA/GQA/MQA."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("causal, kv_heads, devices", [
    ("plain", 4, 4), ("causal", 4, 4), ("causal", 2, 8), ("plain", 1, 8),
    ("causal", 1, 2)])
def test_ring_attention_matches_single_device(causal, kv_heads, devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
  result = subprocess.run(
      [sys.executable, os.path.join(HERE, "ring_run.py"), causal,
       str(kv_heads), str(devices)], capture_output=True, text=True, env=env,
      timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "errors=" in result.stdout
