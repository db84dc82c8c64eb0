"""weighted_combine against a dense reference (a gather and an fp32 einsum, differentiated by
autodiff): values and gradients with unread NaN rows, left-out assignments and rows no assignment
owns; what its backward keeps; no scatter in its compiled gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.moe_rows import sort_with_inverse, weighted_combine


def _problem(seed: int, n: int = 12, k: int = 3, latent: int = 5, dtype=jnp.float32):
  """A permuted [n·k + 4, ℓ] output buffer: rows 0..n·k-1 are the assignments in a random order,
  the last 4 rows belong to nobody and hold NaN; every third assignment is left out."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  m = n * k + 4
  keys = jax.random.uniform(ks[0], (n * k,))
  order, inverse = sort_with_inverse(keys)                 # row r holds assignment order[r]
  y_rows = jax.random.normal(ks[1], (m, latent)).astype(dtype)
  y_rows = y_rows.at[n * k:].set(jnp.nan)
  ok = (jnp.arange(n * k) % 3 != 1).reshape(n, k)
  rows = inverse.reshape(n, k)
  src = jnp.concatenate([order, jnp.zeros((4,), jnp.int32)])
  src_ok = jnp.concatenate([ok.reshape(-1)[order], jnp.zeros((4,), bool)])
  weight = jax.random.uniform(ks[2], (n, k))
  dy = jax.random.normal(ks[3], (n, latent))
  return y_rows, rows, ok, weight, src, src_ok, dy


def _reference(y_rows, rows, ok, weight):
  picked = y_rows[rows].astype(jnp.float32)                # [n, k, ℓ]
  picked = jnp.where(ok[..., None], picked, 0.0)
  return jnp.einsum("nkl,nk->nl", picked, weight.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weighted_combine_matches_the_dense_reference(dtype):
  y_rows, rows, ok, weight, src, src_ok, dy = _problem(0, dtype=dtype)
  out = weighted_combine(y_rows, rows, ok, weight, src, src_ok, jnp.float32)
  ref = _reference(y_rows, rows, ok, weight)
  assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)

  loss = lambda fn: lambda y, w: jnp.sum(fn(y, w) * dy)
  ours = jax.grad(loss(lambda y, w: weighted_combine(y, rows, ok, w, src, src_ok, jnp.float32)),
                  argnums=(0, 1))(y_rows, weight)
  # The reference's gradient for the NaN rows is zero too (nothing reads them).
  theirs = jax.grad(loss(lambda y, w: _reference(y, rows, ok, w)), argnums=(0, 1))(
      jnp.nan_to_num(y_rows), weight)
  assert ours[0].dtype == dtype and ours[1].dtype == weight.dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(ours[0], np.float32), np.asarray(theirs[0], np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(ours[0][-4:], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(ours[1])[~np.asarray(ok)], 0.0)


def test_weighted_combine_output_dtype_and_what_it_keeps():
  """The result comes in out_dtype; the backward keeps the bf16 rows as given (no fp32 [n, k, ℓ]
  gathered copy, which autodiff of the reference keeps), and its gradient has no scatter."""
  from jax._src import ad_checkpoint
  y_rows, rows, ok, weight, src, src_ok, _ = _problem(1, n=16, k=2, latent=8,
                                                      dtype=jnp.bfloat16)
  f = lambda y, w: weighted_combine(y, rows, ok, w, src, src_ok, jnp.bfloat16)
  assert f(y_rows, weight).dtype == jnp.bfloat16
  kept = [a for a, _ in ad_checkpoint.saved_residuals(f, y_rows, weight)]
  assert not [a for a in kept if a.dtype == jnp.float32 and a.size >= 16 * 2 * 8], kept
  ref_kept = [a for a, _ in ad_checkpoint.saved_residuals(
      lambda y, w: _reference(y, rows, ok, w), y_rows, weight)]
  assert [a for a in ref_kept if a.dtype == jnp.float32 and a.size == 16 * 2 * 8]
  hlo = jax.jit(jax.grad(lambda y, w: jnp.sum(f(y, w).astype(jnp.float32)), argnums=(0, 1))) \
      .lower(y_rows, weight).as_text()
  assert "scatter" not in hlo


def test_weighted_combine_rejects_mismatched_shapes():
  y_rows, rows, ok, weight, src, src_ok, _ = _problem(2)
  with pytest.raises(ValueError, match="must all be \\[n, k\\]"):
    weighted_combine(y_rows, rows, ok[:, :2], weight, src, src_ok, jnp.float32)
  with pytest.raises(ValueError, match="src"):
    weighted_combine(y_rows, rows, ok, weight, src[:-1], src_ok, jnp.float32)
