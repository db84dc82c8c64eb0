"""Order statistics without a sort (k3jax.ops.order_statistics) against numpy's sort and lax.top_k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.order_statistics import (column_values_at_rank, ordered_key, top_k_by_rounds,
                                        value_of_key)


def test_ordered_key_is_monotone_and_inverts():
  x = np.array([-np.inf, -3e38, -1.5, -1e-40, -0.0, 0.0, 1e-40, 1.0, 2.5e30, np.inf], np.float32)
  key = np.asarray(ordered_key(jnp.asarray(x))).astype(np.int64)
  assert np.all(np.diff(key) > 0)
  back = np.asarray(value_of_key(jnp.asarray(key.astype(np.uint32))))
  np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))   # -0.0 stays -0.0


@pytest.mark.parametrize("seed", range(6))
def test_column_values_at_rank_equal_the_sorted_columns(seed):
  """Ties, -inf (masked tokens), zeros of both signs and every rank from 0 to N - 1."""
  rng = np.random.default_rng(seed)
  n, e = int(rng.integers(2, 200)), int(rng.integers(1, 7))
  x = rng.normal(size=(n, e)).astype(np.float32)
  if seed % 2:
    x = np.round(x * 2) / 2                     # many ties
  x[rng.random((n, e)) < 0.25] = -np.inf
  x[rng.random((n, e)) < 0.1] = 0.0
  want = -np.sort(-x, axis=0)
  select = jax.jit(column_values_at_rank)
  for rank in sorted({0, 1, n // 3, n - 2, n - 1, int(rng.integers(0, n))}):
    at, nxt = select(jnp.asarray(x), rank)
    np.testing.assert_array_equal(np.asarray(at), want[rank])
    np.testing.assert_array_equal(np.asarray(nxt), want[min(rank + 1, n - 1)])


def test_column_values_at_rank_wide_exponents():
  """Values that differ only in their lowest bits and values far apart in magnitude."""
  rng = np.random.default_rng(9)
  base = np.float32(1.0) + np.arange(64, dtype=np.float32) * np.float32(2 ** -23)
  x = np.stack([rng.permutation(base),
                rng.permutation(base * 2.0 ** rng.integers(-100, 100, 64)).astype(np.float32)], 1)
  want = -np.sort(-x, axis=0)
  for rank in (0, 5, 31, 62, 63):
    at, nxt = column_values_at_rank(jnp.asarray(x), rank)
    np.testing.assert_array_equal(np.asarray(at), want[rank])
    np.testing.assert_array_equal(np.asarray(nxt), want[min(rank + 1, 63)])


def test_top_k_by_rounds_equals_lax_top_k():
  rng = np.random.default_rng(1)
  x = np.round(rng.normal(size=(3, 50, 48)) * 4) / 4          # ties: lower index first
  x = jnp.asarray(x, jnp.float32)
  for k in (1, 4, 5, 48):
    values, indices = jax.jit(lambda v, k=k: top_k_by_rounds(v, k))(x)
    want_values, want_indices = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    assert indices.dtype == jnp.int32


def test_bad_arguments():
  with pytest.raises(ValueError, match=r"\[N, E\]"):
    column_values_at_rank(jnp.zeros(5), 0)
  with pytest.raises(ValueError, match="k=0"):
    top_k_by_rounds(jnp.zeros((2, 4)), 0)
