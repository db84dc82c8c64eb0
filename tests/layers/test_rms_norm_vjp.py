"""rms_norm's hand-written VJP against autodiff of the plain fp32 formula, and what it saves."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.common import rms_norm

EPS = 1e-5


def plain_rms_norm(x, eps, weight=None):
  """The formula as autodiff sees it (the reference)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if weight is None else y * weight.astype(jnp.float32)


def _inputs(dtype, shape=(2, 5, 16)):
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(0), 3)
  x = (jax.random.normal(kx, shape) * 3.0).astype(dtype)
  w = (1.0 + 0.3 * jax.random.normal(kw, shape[-1:])).astype(dtype)
  cot = jax.random.normal(kc, shape)
  return x, w, cot


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_values_and_gradients_match_autodiff(dtype, tol, with_weight):
  x, w, cot = _inputs(dtype)
  w = w if with_weight else None
  loss = lambda f: (lambda x, w: jnp.sum(f(x, EPS, w) * cot))
  y_new, y_ref = rms_norm(x, EPS, w), plain_rms_norm(x, EPS, w)
  assert y_new.dtype == jnp.float32
  np.testing.assert_allclose(y_new, y_ref, rtol=1e-6, atol=1e-6)
  argnums = (0, 1) if with_weight else (0,)
  g_new = jax.grad(loss(rms_norm), argnums)(x, w)
  g_ref = jax.grad(loss(plain_rms_norm), argnums)(x, w)
  for a, b in zip(g_new, g_ref):
    assert a.dtype == b.dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol * scale)


def test_leading_axes_and_jit():
  x, w, cot = _inputs(jnp.float32, (3, 2, 4, 8))
  f = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(x, EPS, w) * cot), (0, 1)))
  g = jax.grad(lambda x, w: jnp.sum(plain_rms_norm(x, EPS, w) * cot), (0, 1))
  for a, b in zip(f(x, w), g(x, w)):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


def _saved_residuals(f, x, w):
  """Shapes and dtypes of the arrays the VJP of f at (x, w) keeps."""
  _, vjp = jax.vjp(f, x, w)
  return [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(vjp)
          if hasattr(a, "shape") and a.ndim > 0]


def test_backward_keeps_no_fp32_copy_of_a_bf16_input():
  x, w, _ = _inputs(jnp.bfloat16)
  full = (x.shape, jnp.dtype(jnp.float32))
  new = _saved_residuals(lambda x, w: rms_norm(x, EPS, w), x, w)
  assert full not in new, new
  assert (x.shape, jnp.dtype(jnp.bfloat16)) in new
  # The check sees the plain formula's fp32 copy: it is not blind.
  assert full in _saved_residuals(lambda x, w: plain_rms_norm(x, EPS, w), x, w)
