"""depth_mix's hand-written VJP: values and gradients against autodiff of the stacked formulation
(the DepthMix code before the custom VJP), and the residuals it keeps for the backward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ModelConfig
from k3jax.layers.attnres import DepthMix, depth_mix
from k3jax.layers.common import rms_norm

EPS = 1e-6
D = 16
CFG = dataclasses.replace(ModelConfig(), d_model=D, norm_eps=EPS)


def stacked_depth_mix(sources, query, valid, eps):
  """The former DepthMix body: fp32 values and RMS-normalised keys stacked to [S, B, T, d]."""
  dtype = sources[0].dtype
  values = jnp.stack([s.astype(jnp.float32) for s in sources], axis=0)
  keys = rms_norm(values, eps)
  logits = jnp.einsum("s...d,d->s...", keys, query.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  if valid is not None:
    logits = jnp.where(valid.reshape((-1,) + (1,) * (logits.ndim - 1)), logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("s...,s...d->...d", alpha, values,
                    precision=jax.lax.Precision.HIGHEST).astype(dtype)


def _inputs(num_sources, dtype, masked, seed=0, shape=(2, 5, D)):
  """Sources of different scales (so r_i matters), a query giving far-from-uniform weights, an
  output weighting (so dh is not constant) and a mask leaving out every other early source."""
  rng = np.random.default_rng(seed)
  sources = [jnp.asarray(rng.normal(0.3 * i, 1 + i, shape), dtype) for i in range(num_sources)]
  query = jnp.asarray(rng.normal(0, 0.5, D), jnp.float32)
  out_weight = jnp.asarray(rng.normal(size=shape), jnp.float32)
  valid = None
  if masked:
    valid = jnp.asarray([i % 2 == 1 or i == num_sources - 1 for i in range(num_sources)])
  return sources, query, valid, out_weight


def _value_and_grads(mix, sources, query, valid, out_weight):
  def loss(srcs, q):
    h = mix(srcs, q, valid)
    return jnp.sum(h.astype(jnp.float32) * out_weight), h
  (_, h), (d_sources, d_query) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      sources, query)
  return h, d_sources, d_query


def _module_mix(sources, query, valid):
  return DepthMix(CFG).apply({"params": {"query": query}}, sources, valid)


def _reference_mix(sources, query, valid):
  return stacked_depth_mix(sources, query, valid, EPS)


def _assert_close(got, want, rel, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(float(np.abs(want).max()), 1e-30)
  np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all_valid", "masked"])
@pytest.mark.parametrize("num_sources", [1, 2, 5])
def test_matches_autodiff_of_stacked_formulation(num_sources, masked, dtype):
  sources, query, valid, out_weight = _inputs(num_sources, dtype, masked)
  h, d_sources, d_query = _value_and_grads(_module_mix, sources, query, valid, out_weight)
  h_ref, d_sources_ref, d_query_ref = _value_and_grads(_reference_mix, sources, query, valid,
                                                       out_weight)
  assert h.dtype == dtype and d_query.dtype == jnp.float32
  assert all(g.dtype == dtype for g in d_sources)
  # fp32: only summation order differs. bf16: both compute in fp32 from the same bf16 inputs and
  # round once at the end, so they differ by at most about one bf16 ulp (2^-8 relative).
  rel = 1e-5 if dtype == jnp.float32 else 1e-2
  _assert_close(h, h_ref, rel, "h")
  for i, (g, g_ref) in enumerate(zip(d_sources, d_sources_ref)):
    _assert_close(g, g_ref, rel, f"d_source {i}")
    if valid is not None and not bool(valid[i]):
      np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)   # left out of the mix
  # The query's gradient is fp32 in both (dh is the same bf16 array), so fp32 tolerance holds.
  _assert_close(d_query, d_query_ref, 1e-5 if dtype == jnp.float32 else 1e-4, "d_query")
  num_valid = num_sources if valid is None else int(np.sum(np.asarray(valid)))
  if num_valid == 1:
    np.testing.assert_allclose(np.asarray(d_query), 0.0, atol=1e-6)    # softmax of one: constant
  else:
    assert float(np.abs(np.asarray(d_query)).max()) > 1e-2             # the check is not vacuous


def test_bf16_query_gets_bf16_gradient():
  sources, query, valid, out_weight = _inputs(3, jnp.bfloat16, masked=False, seed=1)
  query = query.astype(jnp.bfloat16)
  _, _, d_query = _value_and_grads(_module_mix, sources, query, valid, out_weight)
  _, _, d_query_ref = _value_and_grads(_reference_mix, sources, query, valid, out_weight)
  assert d_query.dtype == jnp.bfloat16
  _assert_close(d_query, d_query_ref, 1e-2, "d_query")


def _large_residuals(mix, sources, query, valid):
  """(shape, dtype) of each residual the VJP keeps that is an [S, ...] stack of full sources or an
  fp32 copy of one source (the bf16 sources themselves are allowed: they are alive anyway)."""
  vjp_fn = jax.eval_shape(lambda s, q: jax.vjp(lambda s_, q_: mix(s_, q_, valid), s, q)[1],
                          sources, query)
  leaves = jax.tree_util.tree_leaves(vjp_fn)
  assert leaves, "found no residuals at all: the inspection is broken"
  source_shape = sources[0].shape
  return [(x.shape, x.dtype) for x in leaves
          if x.shape == (len(sources),) + source_shape
          or (x.shape == source_shape and x.dtype == jnp.float32)]


@pytest.mark.parametrize("masked", [False, True], ids=["all_valid", "masked"])
def test_backward_keeps_no_fp32_copies_of_the_sources(masked):
  sources, query, valid, _ = _inputs(5, jnp.bfloat16, masked)
  # The stacked formulation keeps fp32 [S, B, T, d] values and keys: the check catches those.
  assert _large_residuals(_reference_mix, sources, query, valid)
  assert _large_residuals(_module_mix, sources, query, valid) == []
  assert _large_residuals(lambda s, q, v: depth_mix(s, q, v, EPS), sources, query, valid) == []


def test_rejects_bad_arguments():
  sources, query, _, _ = _inputs(3, jnp.float32, masked=False)
  with pytest.raises(ValueError, match="valid must have shape"):
    depth_mix(sources, query, jnp.ones((2,), bool), EPS)
  with pytest.raises(ValueError, match="valid must be a bool"):
    depth_mix(sources, query, jnp.ones((3,), jnp.int32), EPS)
  with pytest.raises(ValueError, match="query must have shape"):
    depth_mix(sources, query[:4], None, EPS)
  with pytest.raises(ValueError, match="non-empty"):
    depth_mix([], query, None, EPS)
  with pytest.raises(ValueError, match="DepthMix: valid must have shape"):
    DepthMix(CFG).apply({"params": {"query": query}}, sources, jnp.ones((4,), bool))
