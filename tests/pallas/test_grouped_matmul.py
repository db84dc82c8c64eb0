"""pallas_kernels/grouped_matmul: the grouped weight gradient (Pallas interpreter) against per-group
float64 products, and its place in the Mosaic path's VJP (`k3jax.ops.grouped_matmul`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import grouped_matmul
from pallas_kernels.grouped_matmul import GroupedGradConfig, grouped_weight_grad

# 8-row steps and 8 x 16 output tiles: groups start and end inside steps.
SMALL_TILES = GroupedGradConfig(block_k=8, block_n=16, block_rows=8, interpret=True)


def per_group(lhs, dout, sizes):
  """[G, K, N] float64: lhs[rows of g]ᵀ · dout[rows of g]."""
  lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
  return np.stack([lhs[s:s + z].T @ dout[s:s + z] for s, z in zip(starts, sizes)])


@pytest.mark.parametrize("m,sizes", [
    (45, (7, 0, 20, 13)),     # an empty group; Σ < M (rows past the groups count for none)
    (45, (5, 0, 0, 40)),      # the last group ends at M, inside a step (the step moved back)
    (40, (0, 0, 0, 0)),       # no rows at all: zeros
    (5, (2, 3)),              # fewer rows than one step
    (64, (1, 1, 61, 1)),      # one-row groups
])
def test_fp32_equals_per_group_products(m, sizes):
  rng = np.random.default_rng(m + sum(sizes))
  k, n = 24, 32                     # 24 caps block_k at 8 (the largest power of two dividing it)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  dout = rng.standard_normal((m, n)).astype(np.float32)
  sizes = np.asarray(sizes, np.int32)
  got = grouped_weight_grad(jnp.asarray(lhs), jnp.asarray(dout), jnp.asarray(sizes),
                            config=SMALL_TILES)
  assert got.shape == (len(sizes), k, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, per_group(lhs, dout, sizes), rtol=1e-5, atol=1e-5)


def test_bf16_operands_accumulate_in_fp32():
  """bf16 in, bf16 out: the sum of 200 products per entry is accumulated in fp32, so the result is
  the exact sum rounded once (an all-bf16 sum would drift by many bf16 ulps)."""
  rng = np.random.default_rng(0)
  m, k, n, sizes = 256, 16, 16, np.asarray([56, 200], np.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  got = grouped_weight_grad(lhs, dout, jnp.asarray(sizes), config=GroupedGradConfig(
      block_k=16, block_n=16, block_rows=32, interpret=True))
  assert got.dtype == jnp.bfloat16
  want = per_group(np.asarray(lhs, np.float32), np.asarray(dout, np.float32), sizes)
  # One bf16 rounding of the exact sum: |error| <= 2^-8 |value| (plus fp32 accumulation noise).
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=1e-3)


def test_bad_inputs_name_the_argument():
  x = jnp.zeros((8, 4))
  with pytest.raises(ValueError, match="lhs must be .M, K. and dout .M, N."):
    grouped_weight_grad(x, jnp.zeros((7, 4)), jnp.ones((2,), jnp.int32), config=SMALL_TILES)
  with pytest.raises(ValueError, match="share a dtype"):
    grouped_weight_grad(x, x.astype(jnp.bfloat16), jnp.ones((2,), jnp.int32), config=SMALL_TILES)
  with pytest.raises(ValueError, match="block_rows must be a power of two"):
    GroupedGradConfig(block_rows=48)


def test_mosaic_path_takes_its_weight_gradient_from_the_kernel(monkeypatch):
  """implementation='mosaic': forward and dlhs from tokamax (here its XLA implementation, as on a
  CPU there is no Mosaic), drhs from grouped_weight_grad (interpreted); the gradients equal
  jax.lax.ragged_dot's."""
  calls = []

  def kernel(lhs, dout, group_sizes, out_dtype):
    calls.append(lhs.shape)
    return grouped_weight_grad(lhs, dout, group_sizes, out_dtype, SMALL_TILES)

  monkeypatch.setattr(grouped_matmul, "_mosaic_implementation", lambda kernel: "xla")
  monkeypatch.setattr(grouped_matmul, "grouped_weight_grad", kernel)
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([9, 0, 14], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((30, 8)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, 8, 16)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((30, 16)), jnp.float32)

  def loss(fn, a, b):
    return jnp.sum(fn(a, b, sizes, preferred_element_type=jnp.float32) * cot)

  mosaic = functools.partial(grouped_matmul._tokamax_grouped, out_dtype=jnp.dtype(jnp.float32),
                             implementation="mosaic", zero_outside=True)
  got = jax.grad(lambda a, b: jnp.sum(mosaic(a, b, sizes) * cot), (0, 1))(lhs, rhs)
  want = jax.grad(lambda a, b: loss(jax.lax.ragged_dot, a, b), (0, 1))(lhs, rhs)
  assert calls == [(30, 8)]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
