"""pallas_kernels/depth_mix: the depth-mix kernels (Pallas interpreter) against `depth_mix`'s XLA
custom VJP and, in fp32, against autodiff of the dense stacked formulation; the config switch."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import config as config_lib
from k3jax.parallel import sharding
from k3jax.layers.attnres import DepthMix, depth_mix
from pallas_kernels.depth_mix import DepthMixConfig, depth_mix_fused

EPS = 1e-6
# 8-row tiles: N = 21 leaves a partial last tile (padded); d = 96 makes three chunks of 32.
SMALL_TILES = DepthMixConfig(block_rows=8, interpret=True)


def stacked_depth_mix(sources, query, valid, eps):
  """The dense formulation: fp32 [S, N, d] values and RMS-normalised keys, one softmax."""
  values = jnp.stack([s.astype(jnp.float32) for s in sources])
  keys = values * jax.lax.rsqrt(jnp.mean(values * values, axis=-1, keepdims=True) + eps)
  logits = jnp.einsum("snd,d->sn", keys, query.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  if valid is not None:
    logits = jnp.where(valid[:, None], logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sn,snd->nd", alpha, values,
                    precision=jax.lax.Precision.HIGHEST).astype(sources[0].dtype)


def _inputs(num_sources, rows, width, dtype, masked, seed=0):
  """Sources of different scales and offsets (so r_i and c_i matter), a query giving far from
  uniform weights, a random cotangent, and a mask leaving out every other early source."""
  rng = np.random.default_rng(seed)
  sources = tuple(jnp.asarray(rng.normal(0.3 * i, 1 + i, (rows, width)), dtype)
                  for i in range(num_sources))
  query = jnp.asarray(rng.normal(0, 0.5, width), jnp.float32)
  dh = jnp.asarray(rng.normal(size=(rows, width)), dtype)
  valid = None
  if masked:
    valid = jnp.asarray([i % 2 == 1 or i == num_sources - 1 for i in range(num_sources)])
  return sources, query, valid, dh


@functools.partial(jax.jit, static_argnums=4)
def _vjps(sources, query, valid, dh, config):
  """(h, d_sources, d_query) of the kernels, of the XLA custom VJP and of the stacked reference."""
  def vjp(mix):
    h, fn = jax.vjp(lambda s, q: mix(s, q, valid, EPS), sources, query)
    return (h,) + fn(dh)
  return (vjp(lambda *a: depth_mix_fused(*a, config=config)), vjp(depth_mix),
          vjp(stacked_depth_mix))


def _assert_close(got, want, rel, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(float(np.abs(want).max()), 1e-30)
  np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale, err_msg=name)


@pytest.mark.parametrize("dtype,num_sources,rows,width,masked,config", [
    (jnp.float32, 1, 16, 32, False, SMALL_TILES),
    (jnp.float32, 2, 21, 96, True, SMALL_TILES),
    (jnp.float32, 5, 40, 96, False, SMALL_TILES),
    (jnp.float32, 5, 24, 32, True, SMALL_TILES),
    (jnp.bfloat16, 2, 16, 32, False, SMALL_TILES),
    (jnp.bfloat16, 5, 21, 96, True, SMALL_TILES),
], ids=["f32-S1", "f32-S2-pad-masked", "f32-S5", "f32-S5-masked", "bf16-S2", "bf16-S5-pad-masked"])
def test_kernels_match_xla_and_stacked_autodiff(dtype, num_sources, rows, width, masked, config):
  sources, query, valid, dh = _inputs(num_sources, rows, width, dtype, masked)
  (h, d_sources, d_query), xla, stacked = _vjps(sources, query, valid, dh, config)
  assert h.dtype == dtype and d_query.dtype == jnp.float32
  assert all(ds.dtype == dtype and ds.shape == (rows, width) for ds in d_sources)
  # fp32: summation order only. bf16: the same fp32 math, rounded once to bf16 (1 ulp = 2^-8).
  refs = [("xla", xla)] + ([("stacked", stacked)] if dtype == jnp.float32 else [])
  rel = 1e-5 if dtype == jnp.float32 else 1e-2
  for ref_name, (h_ref, d_sources_ref, d_query_ref) in refs:
    _assert_close(h, h_ref, rel, f"h vs {ref_name}")
    for i, (ds, ds_ref) in enumerate(zip(d_sources, d_sources_ref)):
      _assert_close(ds, ds_ref, rel, f"d_source {i} vs {ref_name}")
    _assert_close(d_query, d_query_ref, rel, f"d_query vs {ref_name}")
  if masked:   # a source left out gets no weight, hence no gradient
    assert not np.any(np.asarray(d_sources[0], np.float32))


def test_under_a_batch_mesh_each_device_mixes_its_rows():
  """depth_mix(kernel='pallas') under a mesh: each device runs the kernels on its own rows (the
  query's gradient summed over devices), with the values of the XLA path."""
  rng = np.random.default_rng(1)
  sources = [jnp.asarray(rng.normal(0, 1 + i, (8, 4, 32)), jnp.float32) for i in range(3)]
  query = jnp.asarray(rng.normal(0, 0.5, 32), jnp.float32)
  valid = jnp.asarray([False, True, True])
  weight = jnp.asarray(rng.normal(size=(8, 4, 32)), jnp.float32)

  def grads(kernel):
    loss = lambda s, q: jnp.sum(depth_mix(s, q, valid, EPS, kernel=kernel) * weight)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  want = grads("xla")(sources, query)
  mesh = sharding.make_mesh("data:2,expert:4")
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  with sharding.with_mesh(mesh):
    got = grads("pallas")([jax.device_put(s, rows) for s in sources], query)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    _assert_close(g, w, 1e-5, "mesh")


def test_attnres_kernel_is_validated():
  with pytest.raises(config_lib.ConfigError, match=r"ImplConfig\.attnres_kernel"):
    dataclasses.replace(config_lib.ImplConfig(), attnres_kernel="triton").validate()
  with pytest.raises(ValueError, match=r"ImplConfig\.attnres_kernel = 'triton'.*'pallas'"):
    depth_mix([jnp.zeros((2, 8))], jnp.zeros(8), None, EPS, kernel="triton")
  module = DepthMix(config_lib.ModelConfig(),
                    dataclasses.replace(config_lib.ImplConfig(), attnres_kernel="cuda"))
  with pytest.raises(ValueError, match=r"ImplConfig\.attnres_kernel = 'cuda'"):
    module.init(jax.random.key(0), [jnp.zeros((2, 8))])
  with pytest.raises(ValueError, match=r"DepthMixConfig\.block_rows must be a power of two"):
    DepthMixConfig(block_rows=24)
