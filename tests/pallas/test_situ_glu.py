"""pallas_kernels/situ_glu: the SiTU-GLU kernels (Pallas interpreter) against the closed form in
float64 and against autodiff of `k3jax.ops.situ_glu.situ_glu`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.situ_glu import situ_glu
from pallas_kernels.situ_glu import SituGluConfig, situ_glu_fused

B1, B2 = 4.0, 25.0
# 4-row, 8-column tiles: M = 21 leaves a partial last row tile (padded), f = 24 caps the column
# tile at 8 (the largest power of two dividing 24).
SMALL_TILES = SituGluConfig(block_m=4, block_f=64, interpret=True)


def closed_form(gate_up):
  """(h, dh/dgate, dh/dup) elementwise in float64."""
  g = np.asarray(gate_up, np.float64)
  f = g.shape[1] // 2
  a, b = g[:, :f], g[:, f:]
  sig = 1.0 / (1.0 + np.exp(-a))
  ta, tb = np.tanh(a / B1), np.tanh(b / B2)
  situ, cap = B1 * ta * sig, B2 * tb
  dsitu = (1.0 - ta ** 2) * sig + B1 * ta * sig * (1.0 - sig)
  return situ * cap, dsitu * cap, situ * (1.0 - tb ** 2)


@pytest.mark.parametrize("m,f", [(21, 24), (16, 8)])
def test_values_and_gradient_match_the_closed_form(m, f):
  rng = np.random.default_rng(m)
  # Wide pre-activations: tanh and sigmoid saturate at both ends.
  gate_up = jnp.asarray(rng.standard_normal((m, 2 * f)) * 8.0, jnp.float32)
  dh = jnp.asarray(rng.standard_normal((m, f)), jnp.float32)
  h, vjp = jax.vjp(lambda x: situ_glu_fused(x, B1, B2, config=SMALL_TILES), gate_up)
  (dgu,) = vjp(dh)
  want_h, dgate, dup = closed_form(gate_up)
  np.testing.assert_allclose(h, want_h, rtol=2e-5, atol=2e-5)
  dh64 = np.asarray(dh, np.float64)
  np.testing.assert_allclose(dgu, np.concatenate([dh64 * dgate, dh64 * dup], axis=1), rtol=2e-5,
                             atol=2e-5)


@pytest.mark.parametrize("num_rows", [0, 9, 21])
def test_rows_past_num_rows_give_zeros_whatever_they_hold(num_rows):
  """The rows from num_rows on hold NaN and Inf (a grouped matmul's unwritten rows): h and the
  gradient are zero there and equal the closed form before, in a row tile cut by num_rows too."""
  rng = np.random.default_rng(num_rows)
  m, f = 21, 24
  gate_up = rng.standard_normal((m, 2 * f)) * 4.0
  gate_up[num_rows:] = np.nan
  gate_up[num_rows::3, :f] = np.inf
  gate_up = jnp.asarray(gate_up, jnp.float32)
  dh = jnp.asarray(rng.standard_normal((m, f)), jnp.float32)
  h, vjp = jax.vjp(lambda x: situ_glu_fused(x, B1, B2, config=SMALL_TILES,
                                            num_rows=jnp.int32(num_rows)), gate_up)
  (dgu,) = vjp(dh)
  assert np.all(np.asarray(h)[num_rows:] == 0) and np.all(np.asarray(dgu)[num_rows:] == 0)
  want_h, dgate, dup = closed_form(gate_up[:num_rows])
  np.testing.assert_allclose(h[:num_rows], want_h, rtol=2e-5, atol=2e-5)
  dh64 = np.asarray(dh[:num_rows], np.float64)
  np.testing.assert_allclose(dgu[:num_rows], np.concatenate([dh64 * dgate, dh64 * dup], axis=1),
                             rtol=2e-5, atol=2e-5)


def test_bf16_matches_the_xla_activation_and_its_gradient():
  """bf16 in, bf16 out, fp32 math: the same values as situ_glu's (XLA) and its custom VJP."""
  rng = np.random.default_rng(0)
  m, f = 64, 16
  gate_up = jnp.asarray(rng.standard_normal((m, 2 * f)) * 3.0, jnp.bfloat16)
  dh = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)
  config = SituGluConfig(block_m=16, block_f=8, interpret=True)
  h, vjp = jax.vjp(lambda x: situ_glu_fused(x, B1, B2, config=config), gate_up)
  h_ref, vjp_ref = jax.vjp(lambda x: situ_glu(x[:, :f], x[:, f:], B1, B2), gate_up)
  assert h.dtype == jnp.bfloat16 and vjp(dh)[0].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(vjp(dh)[0], np.float32),
                                np.asarray(vjp_ref(dh)[0], np.float32))


def test_out_dtype_and_errors():
  gate_up = jnp.ones((8, 6), jnp.bfloat16)
  assert situ_glu_fused(gate_up, B1, B2, jnp.float32, SMALL_TILES).dtype == jnp.float32
  with pytest.raises(ValueError, match=r"\[M, 2f\]"):
    situ_glu_fused(jnp.ones((8, 5)), B1, B2, config=SMALL_TILES)
  with pytest.raises(ValueError, match="beta1"):
    situ_glu_fused(gate_up, 0.0, B2, config=SMALL_TILES)
  with pytest.raises(ValueError, match="floating"):
    situ_glu_fused(jnp.ones((8, 6), jnp.int32), B1, B2, config=SMALL_TILES)
  with pytest.raises(ValueError, match="num_rows must be an int scalar"):
    situ_glu_fused(gate_up, B1, B2, config=SMALL_TILES, num_rows=jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="block_m must be a power of two"):
    SituGluConfig(block_m=24)


def test_swiglu_kernels_match_the_closed_form():
  """Both bounds None: h = silu(a)·b, dh/da = σ(a)(1 + a(1 − σ(a)))·b, dh/db = silu(a), in
  float64, with wide pre-activations (silu is linear, not flat, for large positive a)."""
  rng = np.random.default_rng(7)
  m, f = 21, 24
  gate_up = jnp.asarray(rng.standard_normal((m, 2 * f)) * 8.0, jnp.float32)
  dh = jnp.asarray(rng.standard_normal((m, f)), jnp.float32)
  h, vjp = jax.vjp(lambda x: situ_glu_fused(x, None, None, config=SMALL_TILES), gate_up)
  (dgu,) = vjp(dh)
  g = np.asarray(gate_up, np.float64)
  a, b = g[:, :f], g[:, f:]
  sig = 1.0 / (1.0 + np.exp(-a))
  np.testing.assert_allclose(h, a * sig * b, rtol=2e-5, atol=2e-5)
  dh64 = np.asarray(dh, np.float64)
  want = np.concatenate([dh64 * sig * (1.0 + a * (1.0 - sig)) * b, dh64 * a * sig], axis=1)
  np.testing.assert_allclose(dgu, want, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("betas", [(None, 25.0), (4.0, None), (0.0, 1.0)])
def test_bounds_must_be_both_positive_or_both_none(betas):
  gate_up = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match="both be > 0 .SiTU-GLU. or both None .SwiGLU."):
    situ_glu_fused(gate_up, *betas, config=SMALL_TILES)
