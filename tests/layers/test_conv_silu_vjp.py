"""conv_silu (the KDA short conv + SiLU with a hand-written VJP) against autodiff of the two-step
computation, causal_conv1d then silu, and on what its backward keeps."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.parallel import sharding
from k3jax.layers.conv import causal_conv1d, conv_silu


def reference(x, kernel, segment_ids, out_dtype):
  y, _ = causal_conv1d(x, kernel, segment_ids)
  return jax.nn.silu(y).astype(out_dtype)


SEG = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
                 [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)


def _inputs(dtype, width=4, shape=(2, 12, 6)):
  kx, kk, kc = jax.random.split(jax.random.PRNGKey(3), 3)
  x = (2.0 * jax.random.normal(kx, shape)).astype(dtype)
  kernel = (0.5 * jax.random.normal(kk, (width, shape[-1]))).astype(dtype)
  cot = jax.random.normal(kc, shape)
  return x, kernel, cot


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("kernel_choice", ["xla", "pallas"])
def test_values_and_gradients_match_autodiff(dtype, tol, segments, width, kernel_choice):
  x, kernel, cot = _inputs(dtype, width)
  seg = SEG if segments else None
  out = conv_silu(x, kernel, seg, dtype, kernel_choice)
  ref = reference(x, kernel, seg, dtype)
  assert out.dtype == ref.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=tol, atol=tol)
  ours = lambda x, k, seg, dtype: conv_silu(x, k, seg, dtype, kernel_choice)
  loss = lambda f: (lambda x, k: jnp.sum(f(x, k, seg, dtype).astype(jnp.float32) * cot))
  for a, b in zip(jax.grad(loss(ours), (0, 1))(x, kernel),
                  jax.grad(loss(reference), (0, 1))(x, kernel)):
    assert a.dtype == b.dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol * scale)


def test_nothing_crosses_documents_or_comes_from_padding():
  """The gradient of an output of document 2 reaches only inputs of document 2."""
  x, kernel, _ = _inputs(jnp.float32)
  g = jax.grad(lambda x: conv_silu(x, kernel, SEG, jnp.float32)[0, 5].sum())(x)
  touched = np.nonzero(np.abs(np.asarray(g[0])).sum(-1))[0]
  assert set(touched) <= {3, 4, 5}, touched
  assert np.all(np.asarray(conv_silu(x, kernel, SEG, jnp.float32))[0, 9:] == 0)


def _saved(f, x, kernel):
  _, vjp = jax.vjp(f, x, kernel)
  return [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(vjp) if hasattr(a, "shape")]


def test_backward_keeps_only_the_bf16_input():
  x, kernel, _ = _inputs(jnp.bfloat16)
  f32_full = (x.shape, jnp.dtype(jnp.float32))
  new = _saved(lambda x, k: conv_silu(x, k, SEG, jnp.bfloat16), x, kernel)
  assert f32_full not in new, new
  old = _saved(lambda x, k: reference(x, k, SEG, jnp.bfloat16), x, kernel)
  assert old.count(f32_full) >= 2, old   # the check sees what autodiff keeps


def test_bad_shapes_and_kernel_choice_raise():
  x, kernel, _ = _inputs(jnp.float32)
  with pytest.raises(ValueError, match=r"ImplConfig\.kda_conv_kernel = 'triton': expected one of"):
    conv_silu(x, kernel, None, jnp.float32, "triton")
  with pytest.raises(ValueError, match="kernel"):
    conv_silu(x, kernel[:, :3], None, jnp.float32)
  with pytest.raises(ValueError, match="segment_ids"):
    conv_silu(x, kernel, SEG[:, :5], jnp.float32)


def test_pallas_backward_under_a_batch_mesh_equals_one_device():
  """kernel_choice='pallas' under a mesh sharding the batch: each device runs the kernels on its own
  rows and the kernel's gradient is the sum of the devices' parts; the outputs and gradients of
  the XLA path on one device."""
  x, kernel, _ = _inputs(jnp.float32, shape=(8, 12, 6))
  seg = jnp.tile(SEG, (4, 1))
  cot = jax.random.normal(jax.random.PRNGKey(5), x.shape)

  def grads(kernel_choice):
    out = lambda x, k: conv_silu(x, k, seg, jnp.float32, kernel_choice)
    loss = lambda x, k: jnp.sum(out(x, k) * cot)
    return jax.jit(lambda x, k: (out(x, k),) + jax.grad(loss, argnums=(0, 1))(x, k))

  want = grads("xla")(x, kernel)
  mesh = sharding.make_mesh("data:2,expert:4")
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  with sharding.with_mesh(mesh):
    got = grads("pallas")(jax.device_put(x, rows), kernel)
  assert len(got) == 3
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
