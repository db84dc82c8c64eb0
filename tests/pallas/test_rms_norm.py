"""pallas_kernels/rms_norm: RMSNorm's backward kernel (Pallas interpreter) against autodiff of the
plain fp32 formula, through `rms_norm(..., kernel='pallas')`, and under a batch mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.parallel import sharding
from k3jax.layers.common import rms_norm
from pallas_kernels.rms_norm import RmsNormConfig, rms_norm_bwd

EPS = 1e-5


def plain_rms_norm(x, weight):
  """The formula as autodiff sees it (the reference), fp32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS) * weight


def _inputs(shape, dtype, seed=0):
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = (3.0 * jax.random.normal(kx, shape)).astype(dtype)
  w = 1.0 + 0.3 * jax.random.normal(kw, shape[-1:])
  cot = jax.random.normal(kc, shape)
  return x, w, cot


@pytest.mark.parametrize("shape, config", [
    ((2, 7, 48), RmsNormConfig(block_rows=4, block_d=16, interpret=True)),  # 3 chunks, padded rows
    ((3, 40), RmsNormConfig(block_rows=8, block_d=8, interpret=True)),      # 5 chunks of 8
    ((5, 24), RmsNormConfig(interpret=True)),                               # default tiles: Dc 8
])
def test_kernel_matches_autodiff_of_the_formula(shape, config):
  x, w, cot = _inputs(shape, jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
  dx, dw = rms_norm_bwd(x, w, r, cot, config)
  _, vjp = jax.vjp(plain_rms_norm, x, w)
  want_dx, want_dw = vjp(cot)
  assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_rms_norm_pallas_backward_equals_the_xla_one(dtype, tol):
  """The same values and gradients (x in its dtype, w fp32) from either backward, bf16 output
  included (its cotangent reaches the kernel in bf16)."""
  x, w, cot = _inputs((2, 6, 32), dtype, seed=1)

  def grads(kernel):
    loss = lambda x, w: jnp.sum(rms_norm(x, EPS, w, out_dtype=dtype, kernel=kernel)
                                .astype(jnp.float32) * cot)
    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

  (v_p, (dx_p, dw_p)), (v_x, (dx_x, dw_x)) = grads("pallas"), grads("xla")
  assert dx_p.dtype == dx_x.dtype == dtype and dw_p.dtype == jnp.float32
  assert float(v_p) == float(v_x)                     # the same forward
  for a, b in ((dx_p, dx_x), (dw_p, dw_x)):
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol * scale)


def test_under_a_batch_mesh_each_device_normalises_its_rows():
  """kernel='pallas' under a data:2,expert:4 mesh: each device runs the kernel on its own rows,
  the weight's gradient summed over devices; the values of the XLA backward on one device."""
  x, w, cot = _inputs((8, 4, 32), jnp.float32, seed=2)

  def grads(kernel):
    loss = lambda x, w: jnp.sum(rms_norm(x, EPS, w, kernel=kernel) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))

  want = grads("xla")(x, w)
  mesh = sharding.make_mesh("data:2,expert:4")
  with sharding.with_mesh(mesh):
    got = grads("pallas")(jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES))), w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bad_input_and_config():
  x, w, cot = _inputs((2, 16), jnp.float32)
  r = jnp.ones((2, 1))
  with pytest.raises(ValueError, match="power of two"):
    RmsNormConfig(block_rows=12)
  with pytest.raises(ValueError, match="do not fit"):
    rms_norm_bwd(x, w[:8], r, cot)
  with pytest.raises(ValueError, match="one scale per row"):
    rms_norm_bwd(x, w, jnp.ones((3,)), cot)
