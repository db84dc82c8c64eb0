"""gated_rms_norm and sigmoid_gate (KDA's and MLA's output gates): hand-written VJPs against
autodiff of the plain fp32 formulas, and what they keep for the backward pass."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.common import gated_rms_norm, sigmoid_gate

EPS = 1e-5


def plain_gated_rms_norm(x, gate, eps, w):
  x32 = x.astype(jnp.float32)
  n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return n * w.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def plain_sigmoid_gate(x, gate):
  return x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def _inputs(dtype, shape=(2, 5, 3, 16)):
  kx, kg, kw, kc = jax.random.split(jax.random.PRNGKey(0), 4)
  x = (jax.random.normal(kx, shape) * 3.0).astype(dtype)
  gate = (2.0 * jax.random.normal(kg, shape)).astype(dtype)
  w = 1.0 + 0.3 * jax.random.normal(kw, shape[-1:])
  return x, gate, w, jax.random.normal(kc, shape)


def _close(new, ref, tol):
  for a, b in zip(new, ref):
    assert a.dtype == b.dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_gated_rms_norm_matches_autodiff(dtype, tol):
  x, gate, w, cot = _inputs(dtype)
  new = jax.jit(lambda x, g, w: gated_rms_norm(x, g, EPS, w))
  assert new(x, gate, w).dtype == jnp.float32
  np.testing.assert_allclose(new(x, gate, w), plain_gated_rms_norm(x, gate, EPS, w), rtol=1e-6,
                             atol=1e-6)
  grads = lambda f: jax.grad(lambda x, g, w: jnp.sum(f(x, g, w) * cot), (0, 1, 2))(x, gate, w)
  _close(grads(lambda x, g, w: gated_rms_norm(x, g, EPS, w)),
         grads(lambda x, g, w: plain_gated_rms_norm(x, g, EPS, w)), tol)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_sigmoid_gate_matches_autodiff(dtype, tol):
  x, gate, _, cot = _inputs(dtype)
  np.testing.assert_allclose(sigmoid_gate(x, gate), plain_sigmoid_gate(x, gate), rtol=1e-6)
  grads = lambda f: jax.grad(lambda x, g: jnp.sum(f(x, g) * cot), (0, 1))(x, gate)
  _close(grads(sigmoid_gate), grads(plain_sigmoid_gate), tol)


def _saved(f, *args):
  _, vjp = jax.vjp(f, *args)
  return [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(vjp)
          if hasattr(a, "shape") and a.ndim > 0]


def test_backward_keeps_the_inputs_in_bf16_and_no_fp32_factor():
  x, gate, w, _ = _inputs(jnp.bfloat16)
  full32 = (x.shape, jnp.dtype(jnp.float32))
  for new, plain in ((lambda x, g: gated_rms_norm(x, g, EPS, w),
                      lambda x, g: plain_gated_rms_norm(x, g, EPS, w)),
                     (sigmoid_gate, plain_sigmoid_gate)):
    kept = _saved(new, x, gate)
    assert full32 not in kept, kept
    assert kept.count((x.shape, jnp.dtype(jnp.bfloat16))) == 2      # x and the gate
    assert full32 in _saved(plain, x, gate)                           # the check is not blind


def test_dot_in_fp32_equals_autodiff_and_keeps_x_in_its_dtype():
  from k3jax.layers.common import dot_in_fp32
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(4), (16, 6))
  plain = lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST)
  cot = jax.random.normal(jax.random.PRNGKey(5), (2, 5, 6))
  np.testing.assert_array_equal(dot_in_fp32(x, w), plain(x, w))
  grads = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), (0, 1))(x, w)
  _close(grads(dot_in_fp32), grads(plain), 1e-6)
  assert (x.shape, jnp.dtype(jnp.float32)) not in _saved(dot_in_fp32, x, w)
  assert (x.shape, jnp.dtype(jnp.float32)) in _saved(plain, x, w)
