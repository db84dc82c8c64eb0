"""ShortConv: naive loop, segment isolation, decode step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.conv import ShortConv, causal_conv1d


def naive_short_conv(x, w, seg=None):
  """Python loop over (b, t, j) in float64, then SiLU; padding outputs are zero."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  b, t, c = x.shape
  width = w.shape[0]
  y = np.zeros((b, t, c))
  for bi in range(b):
    for ti in range(t):
      if seg is not None and seg[bi, ti] == 0:
        continue
      for j in range(width):
        src = ti - (width - 1) + j
        if src < 0 or (seg is not None and seg[bi, src] != seg[bi, ti]):
          continue
        y[bi, ti] += w[j] * x[bi, src]
  return y / (1.0 + np.exp(-y))


def nn_unbox(p):
  return p.unbox() if hasattr(p, "unbox") else p


SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 0, 0],
                [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("width", [4, 2, 1])
@pytest.mark.parametrize("use_seg", [False, True])
def test_matches_naive_loop(width, use_seg):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 6))
  conv = ShortConv(width=width)
  seg = SEG if use_seg else None
  params = conv.init(jax.random.PRNGKey(1), x, seg)
  w = nn_unbox(params["params"]["kernel"])
  assert w.shape == (width, 6)
  y = conv.apply(params, x, seg)
  ref = naive_short_conv(x, w, seg)
  np.testing.assert_allclose(np.asarray(y), ref, atol=1e-6, rtol=1e-5)


def test_kernel_axes():
  params = ShortConv(width=4, channel_axis="heads").init(jax.random.PRNGKey(0), jnp.ones((1, 5, 3)))
  assert params["params"]["kernel"].names == ("conv", "heads")


def test_segment_isolation():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 4))
  conv = ShortConv(width=4)
  params = conv.init(jax.random.PRNGKey(1), x, SEG)
  y = conv.apply(params, x, SEG)
  # Change document 1 and the padding of row 0: documents 2 and 3 must not move.
  x2 = x.at[0, :5].set(7.0).at[0, 10:].set(-3.0)
  y2 = conv.apply(params, x2, SEG)
  np.testing.assert_array_equal(np.asarray(y2)[0, 5:], np.asarray(y)[0, 5:])
  assert not np.allclose(np.asarray(y2)[0, :5], np.asarray(y)[0, :5])
  assert np.all(np.asarray(y)[0, 10:] == 0.0)


def test_decode_step_by_step_equals_full():
  b, t, c = 2, 11, 5
  x = jax.random.normal(jax.random.PRNGKey(2), (b, t, c))
  conv = ShortConv(width=4)
  variables = conv.init(jax.random.PRNGKey(3), x, decode=True)
  assert variables["cache"]["conv_state"].shape == (b, 3, c)
  assert np.all(np.asarray(variables["cache"]["conv_state"]) == 0)
  full = conv.apply({"params": variables["params"]}, x)
  cache = variables["cache"]
  outs = []
  # Prefill 3 tokens, then one token at a time.
  y, upd = conv.apply({"params": variables["params"], "cache": cache}, x[:, :3], decode=True,
                      mutable=["cache"])
  outs.append(y)
  cache = upd["cache"]
  for i in range(3, t):
    y, upd = conv.apply({"params": variables["params"], "cache": cache}, x[:, i:i + 1],
                        decode=True, mutable=["cache"])
    outs.append(y)
    cache = upd["cache"]
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache["conv_state"]), np.asarray(x[:, -3:]))


def test_decode_left_padding_contributes_nothing():
  b, t, c = 1, 8, 3
  x = jax.random.normal(jax.random.PRNGKey(4), (b, t, c))
  conv = ShortConv(width=4)
  variables = conv.init(jax.random.PRNGKey(5), x, decode=True)
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
  y, _ = conv.apply(variables, x, seg, decode=True, mutable=["cache"])
  ref = naive_short_conv(x[:, 3:], nn_unbox(variables["params"]["kernel"]))
  np.testing.assert_allclose(np.asarray(y)[:, 3:], ref, atol=1e-6, rtol=1e-5)
  assert np.all(np.asarray(y)[:, :3] == 0)


def test_state_with_segments_raises():
  with pytest.raises(ValueError, match="segment_ids must be None"):
    causal_conv1d(jnp.ones((1, 3, 2)), jnp.ones((4, 2)), jnp.ones((1, 3), jnp.int32),
                  jnp.zeros((1, 3, 2)))


def test_pallas_chunk_rule_gives_each_direction_its_programs():
  """The kernels' chunk: the longest of 128, 64, 32 tokens that gives ≥ 1536 programs backward and
  ≥ 3072 forward (256 channels a program), as measured best on the H200 (RESULTS.md run 28):
  medium.gin's [4, 8192, 1536] 128 / 64, small.gin's [4, 8192, 768] 64 / 32; a 1M-token row keeps
  128; a short row bottoms out at 32; each device's shape decides under a mesh."""
  from k3jax.layers.conv import _pallas_config
  chunks = lambda shape: (_pallas_config("bwd", shape).chunk_t,
                          _pallas_config("fwd", shape).chunk_t)
  assert chunks((4, 8192, 1536)) == (128, 64)
  assert chunks((4, 8192, 768)) == (64, 32)
  assert chunks((1, 1 << 20, 1536)) == (128, 128)
  assert chunks((1, 256, 64)) == (32, 32)
  assert chunks((2, 8192, 1536)) == (64, 32)          # half the batch on each of two devices
  assert _pallas_config("bwd", (4, 8192, 1536)).block_c == 256
