"""The benchmark's tables (jax_flash.benchmark): what the results files and
the README quote."""
import pytest

from jax_flash.benchmark import markdown


def _row(impl, mode, tflops, head_dim=128, causal=False):
  return dict(head_dim=head_dim, seq_len=8192, causal=causal, impl=impl,
              mode=mode, tflops=tflops)


@pytest.mark.parametrize("rows, ratio", [
    ([_row("flash_v2", "fwd", 300.0), _row("cudnn", "fwd", 400.0)], "0.75"),
    ([_row("flash_v2", "fwd", 300.0)], None)], ids=["with_ratio", "alone"])
def test_dense_table_has_one_cell_per_column(rows, ratio):
  """Every line has as many cells as the header; a ratio column only where
  both sides ran, with the quotient of their TFLOP/s."""
  head, rule, line = markdown(rows).splitlines()
  assert head.count("|") == rule.count("|") == line.count("|")
  cells = [c.strip() for c in line.strip("|").split("|")]
  names = [c.strip() for c in head.strip("|").split("|")]
  assert "" not in names
  assert dict(zip(names, cells))["flash_v2 fwd"] == "300"
  assert dict(zip(names, cells)).get("v2/cuDNN fwd") == ratio
