"""Every example runs (quick settings, public API only), and the chex
equivalence test file users copy is collected here so CI runs it."""
import ast
import pathlib
import tempfile

import pytest

from examples import (generate, linen_lm, quickstart, swap_into_flax_model,
                      train_lm)
from examples.chex_equivalence import FlashAttentionSwapTest  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_swap_into_flax_model_runs():
  swap_into_flax_model.main()


def test_quickstart_runs():
  quickstart.main(["--seq", "100", "--batch", "1", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "32"])


def test_generate_matches_the_full_forward():
  generate.main(["--steps", "4", "--batch", "2"])


def test_linen_lm_trains():
  linen_lm.main(["--steps", "40"])


def test_train_lm_trains_checkpoints_and_samples(tmp_path, monkeypatch):
  """Without --out-dir its checkpoint's temporary folder is gone after."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  train_lm.main(["--steps", "30", "--batch", "8", "--seq-len", "64",
                 "--eval-batches", "1", "--sample-len", "8", "--lr", "1e-2"])
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")),
                         ids=lambda p: p.name)
def test_examples_use_only_the_public_api(path):
  """No example imports a private name of the library."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split(".")[0] == "jax_flash"):
      parts = node.module.split(".") + [a.name for a in node.names]
      assert not any(p.startswith("_") for p in parts), (path.name, parts)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "jax_flash":
      assert not node.attr.startswith("_"), (path.name, node.attr)
