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


def _fp32_matmul(x, w):
  """What `dot_in_fp32` replaced: both upcast, one matmul at HIGHEST precision."""
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def test_dot_in_fp32_on_fp32_x_is_the_highest_precision_matmul():
  from k3jax.layers.common import dot_in_fp32
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 16))
  w = jax.random.normal(jax.random.PRNGKey(4), (16, 6))
  cot = jax.random.normal(jax.random.PRNGKey(5), (2, 5, 6))
  np.testing.assert_array_equal(dot_in_fp32(x, w), _fp32_matmul(x, w))
  grads = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), (0, 1))(x, w)
  _close(grads(dot_in_fp32), grads(_fp32_matmul), 1e-6)


def test_bf16_pieces_sum_to_fp32_exactly():
  from k3jax.layers.common import bf16_pieces
  rng = np.random.default_rng(0)
  # Significands over every bit, exponents from 2^-60 to 2^60, both signs, and zero.
  a = (rng.uniform(-2, 2, 4096) * 2.0 ** rng.integers(-60, 60, 4096)).astype(np.float32)
  a[:3] = [0.0, 1.0, -np.float32(1 + 2 ** -23)]
  pieces = jax.jit(lambda v: bf16_pieces(v, 3))(jnp.asarray(a))
  assert all(p.dtype == jnp.bfloat16 for p in pieces)
  total = sum(np.asarray(p, np.float64) for p in pieces)
  np.testing.assert_array_equal(total, a.astype(np.float64))
  two = sum(np.asarray(p, np.float64) for p in pieces[:2])
  assert np.all(np.abs(two - a) <= 2.0 ** -14 * np.abs(a))
  assert np.any(two != a)      # the third piece is needed: the check is not blind


def test_dot_in_fp32_on_bf16_x_has_fp32_accuracy_and_keeps_x_in_bf16():
  """The split-bf16 matmul against a float64 reference: the forward and dw as close as the fp32
  HIGHEST matmul's, dx within bf16's rounding."""
  from k3jax.layers.common import dot_in_fp32
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(3), 3)
  x = jax.random.normal(kx, (3, 40, 96)).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (96, 12))
  cot = jax.random.normal(kc, (3, 40, 12))
  x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, cot))
  ref = x64 @ w64
  y = jax.jit(dot_in_fp32)(x, w)
  assert y.dtype == jnp.float32
  err_highest = np.abs(np.asarray(_fp32_matmul(x, w), np.float64) - ref).max()
  assert np.abs(np.asarray(y, np.float64) - ref).max() <= 2 * err_highest + 1e-9
  grads = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), (0, 1)))(x, w)
  dx, dw = grads(dot_in_fp32)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  dx_ref = c64 @ w64.T
  dw_ref = x64.reshape(-1, 96).T @ c64.reshape(-1, 12)
  # dx: at most half a bf16 step (2^-8 relative) from the exact value, plus the split's 2^-12.
  bound = 2.0 ** -8 * np.abs(dx_ref) + 2.0 ** -12 * (np.abs(c64) @ np.abs(w64.T))
  np.testing.assert_array_less(np.abs(np.asarray(dx, np.float64) - dx_ref), bound)
  _, dw_highest = grads(_fp32_matmul)
  err_highest = np.abs(np.asarray(dw_highest, np.float64) - dw_ref).max()
  assert np.abs(np.asarray(dw, np.float64) - dw_ref).max() <= 2 * err_highest + 1e-9
  assert (x.shape, jnp.dtype(jnp.float32)) not in _saved(dot_in_fp32, x, w)
  assert (x.shape, jnp.dtype(jnp.float32)) in _saved(_fp32_matmul, x, w)
