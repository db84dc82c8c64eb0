"""pallas_kernels/short_conv: the short conv + SiLU forward and backward kernels (Pallas
interpreter) against naive per-token loops of the same output and gradient, and against autodiff
of the forward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.conv import causal_conv1d
from pallas_kernels.short_conv import ConvConfig, conv_silu_bwd, conv_silu_fwd

# Documents of 3, 4, 2 tokens, padding, a document of 5; a row of two documents; 14 tokens, so the
# 4-token chunks below leave a partial last program, and documents cross chunk edges; 8 channels a
# program of 20 leave a partial channel block. Rows within W-1 tokens of a document's edges take the
# kernels' masked path, the other rows the branch without the masks' selects.
SEG = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0, 4, 4],
                [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]], np.int32)
SMALL = ConvConfig(chunk_t=4, block_c=8, interpret=True)


def naive_fwd(x, kernel, seg):
  """silu of the causal conv by its definition, one token at a time in float64: y[t] sums
  kernel[W-1-j] · x[t-j] over the taps j that stay in t's document; padding outputs 0."""
  x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  b, t, c = x.shape
  width = kernel.shape[0]
  seg = np.ones((b, t), np.int32) if seg is None else np.asarray(seg)
  out = np.zeros_like(x)
  for bi in range(b):
    for ti in range(t):
      if seg[bi, ti] == 0:
        continue
      y = sum(kernel[width - 1 - j] * x[bi, ti - j] for j in range(width)
              if ti - j >= 0 and seg[bi, ti - j] == seg[bi, ti])
      out[bi, ti] = y / (1.0 + np.exp(-y))
  return out


def naive_bwd(x, kernel, seg, dout):
  """The gradient by its definition, one token at a time in float64: dy[t] = dout[t]·silu'(y[t]),
  then each input's share of every output it reaches."""
  x, kernel, dout = (np.asarray(a, np.float64) for a in (x, kernel, dout))
  b, t, c = x.shape
  width = kernel.shape[0]
  seg = np.ones((b, t), np.int32) if seg is None else np.asarray(seg)
  dx, dk = np.zeros_like(x), np.zeros_like(kernel)
  for bi in range(b):
    for ti in range(t):
      if seg[bi, ti] == 0:
        continue
      taps = [j for j in range(width) if ti - j >= 0 and seg[bi, ti - j] == seg[bi, ti]]
      y = sum(kernel[width - 1 - j] * x[bi, ti - j] for j in taps)
      s = 1.0 / (1.0 + np.exp(-y))
      dy = dout[bi, ti] * s * (1.0 + y * (1.0 - s))
      for j in taps:
        dx[bi, ti - j] += kernel[width - 1 - j] * dy
        dk[width - 1 - j] += dy * x[bi, ti - j]
  return dx, dk


def _inputs(width, c, dtype, seed=0):
  kx, kk, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = (2.0 * jax.random.normal(kx, (2, 14, c))).astype(dtype)
  kernel = 0.5 * jax.random.normal(kk, (width, c))
  dout = jax.random.normal(kd, (2, 14, c)).astype(dtype)
  return x, kernel, dout


@pytest.mark.parametrize("width", [1, 3, 4])
@pytest.mark.parametrize("segments", [True, False])
def test_matches_the_naive_gradient(width, segments):
  x, kernel, dout = _inputs(width, 20, jnp.float32, seed=width)
  seg = jnp.asarray(SEG) if segments else None
  dx, dk = conv_silu_bwd(x, kernel, seg, dout, SMALL)
  want_dx, want_dk = naive_bwd(x, kernel, None if seg is None else SEG, dout)
  assert dx.shape == x.shape and dk.shape == kernel.shape
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dk), want_dk, rtol=1e-5, atol=1e-4)
  if segments:   # padding inputs get no gradient
    assert np.all(np.asarray(dx)[0, 9:12] == 0)


@pytest.mark.parametrize("width", [1, 3, 4])
@pytest.mark.parametrize("segments", [True, False])
def test_forward_matches_the_naive_output(width, segments):
  x, kernel, _ = _inputs(width, 20, jnp.float32, seed=width + 10)
  seg = jnp.asarray(SEG) if segments else None
  out = conv_silu_fwd(x, kernel, seg, jnp.float32, SMALL)
  want = naive_fwd(x, kernel, None if seg is None else SEG)
  assert out.shape == x.shape and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
  if segments:   # padding outputs are exactly zero
    assert np.all(np.asarray(out)[0, 9:12] == 0)


def test_a_row_shorter_than_a_chunk():
  """The default tiles (128 tokens, 256 channels) on rows of 14 tokens and 20 channels: one
  program, most of its rows past the row's end; and 32-token chunks of 16 channels."""
  x, kernel, dout = _inputs(4, 20, jnp.float32, seed=3)
  seg = jnp.asarray(SEG)
  want_out = naive_fwd(x, kernel, SEG)
  want_dx, want_dk = naive_bwd(x, kernel, SEG, dout)
  for cfg in (ConvConfig(interpret=True), ConvConfig(chunk_t=32, block_c=16, interpret=True)):
    np.testing.assert_allclose(np.asarray(conv_silu_fwd(x, kernel, seg, jnp.float32, cfg)),
                               want_out, rtol=1e-5, atol=1e-6)
    dx, dk = conv_silu_bwd(x, kernel, seg, dout, cfg)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dk), want_dk, rtol=1e-5, atol=1e-4)


def test_bf16_matches_autodiff_of_the_forward():
  x, kernel, dout = _inputs(4, 16, jnp.bfloat16, seed=7)
  kernel = kernel.astype(jnp.bfloat16)
  seg = jnp.asarray(SEG)

  def forward(x, k):
    y, _ = causal_conv1d(x, k, seg)
    return jax.nn.silu(y).astype(jnp.bfloat16)

  _, vjp = jax.vjp(forward, x, kernel)
  want_dx, want_dk = vjp(dout)
  dx, dk = conv_silu_bwd(x, kernel, seg, dout, SMALL)
  assert dx.dtype == jnp.bfloat16 and dk.dtype == jnp.bfloat16
  out = conv_silu_fwd(x, kernel, seg, jnp.bfloat16, SMALL)
  want_out = forward(x, kernel)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                             rtol=1e-2, atol=1e-2)
  for got, want in ((dx, want_dx), (dk, want_dk)):
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2 * scale)


def test_default_tiles_and_bad_input():
  x, kernel, dout = _inputs(4, 20, jnp.float32)
  dx, dk = conv_silu_bwd(x, kernel, jnp.asarray(SEG), dout, ConvConfig(interpret=True))
  want_dx, want_dk = naive_bwd(x, kernel, SEG, dout)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dk), want_dk, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="ConvConfig.chunk_t must be a power of two"):
    ConvConfig(chunk_t=48)
  with pytest.raises(ValueError, match="segment_ids"):
    conv_silu_bwd(x, kernel, jnp.asarray(SEG[:, :5]), dout, SMALL)
  with pytest.raises(ValueError, match="do not fit"):
    conv_silu_bwd(x, kernel[:, :3], None, dout, SMALL)
  with pytest.raises(ValueError, match="conv_silu_fwd: segment_ids"):
    conv_silu_fwd(x, kernel, jnp.asarray(SEG[:, :5]), jnp.float32, SMALL)
  with pytest.raises(ValueError, match="conv_silu_fwd: .* do not fit"):
    conv_silu_fwd(x, kernel[:, :3], None, jnp.float32, SMALL)
