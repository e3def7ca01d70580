"""`jax_flash.testing.assert_attention_close` fails where it must."""
import jax
import jax.numpy as jnp
import pytest

from jax_flash.testing import assert_attention_close, tolerance

REF = {"out": jax.random.normal(jax.random.key(0), (2, 8, 3, 16)),
       "lse": jnp.array([[1.0, -jnp.inf], [2.0, 3.0]]),
       "dq": jax.random.normal(jax.random.key(1), (2, 8, 3, 16))}


def _perturbed(name, relative):
  x = REF[name]
  noise = jax.random.normal(jax.random.key(2), x.shape)
  return dict(REF, **{name: x + relative * jnp.linalg.norm(x) /
                      jnp.linalg.norm(noise) * noise})


def test_equal_trees_pass():
  assert_attention_close(REF, REF)


@pytest.mark.parametrize("name, kind", [("out", "out"), ("dq", "grad")])
def test_error_just_over_the_bound_fails_naming_the_leaf(name, kind):
  bound = getattr(tolerance(jnp.float32), kind)
  assert_attention_close(_perturbed(name, 0.9 * bound), REF)
  with pytest.raises(AssertionError, match=rf"\['{name}'\]: error"):
    assert_attention_close(_perturbed(name, 1.2 * bound), REF)


def test_nan_and_misplaced_minus_infinity_fail():
  with pytest.raises(AssertionError, match=r"\['out'\]: error inf"):
    assert_attention_close(dict(REF, out=REF["out"].at[0, 0, 0, 0].set(
        jnp.nan)), REF)
  with pytest.raises(AssertionError, match=r"\['lse'\]"):
    assert_attention_close(dict(REF, lse=REF["lse"].at[0, 1].set(0.0)), REF)


def test_low_precision_bound_follows_the_baseline():
  bf16 = jnp.bfloat16
  plain = _perturbed("dq", 0.01)  # Plain attention's own error: 1e-2.
  assert_attention_close(_perturbed("dq", 0.019), REF, bf16, baseline=plain)
  with pytest.raises(AssertionError, match=r"\['dq'\]"):
    assert_attention_close(_perturbed("dq", 0.021), REF, bf16, baseline=plain)
  # Without a baseline, the fixed bound of the table.
  with pytest.raises(AssertionError, match=r"\['dq'\]"):
    assert_attention_close(_perturbed("dq", 0.019), REF, bf16)
