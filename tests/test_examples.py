"""The examples run: the one-line swap into a Flax model, and the chex
equivalence test file users copy (collected here so CI runs it)."""
from examples import swap_into_flax_model
from examples.chex_equivalence import FlashAttentionSwapTest  # noqa: F401


def test_swap_into_flax_model_runs():
  swap_into_flax_model.main()
