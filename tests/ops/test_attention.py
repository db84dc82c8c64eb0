"""attention() against a naive numpy softmax attention with explicit masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import attention


def naive_attention(q, k, v, *, q_seg=None, kv_seg=None, q_pos=None, kv_pos=None, causal=True,
                    scale=None):
  """Per (batch, head, query) loop in float64."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  if q_pos is None:
    q_pos = np.broadcast_to(np.arange(t), (b, t))
    kv_pos = np.broadcast_to(np.arange(s), (b, s))
  q_pos, kv_pos = np.broadcast_to(q_pos, (b, t)), np.broadcast_to(kv_pos, (b, s))
  out = np.zeros((b, t, h, v.shape[-1]))
  for bi in range(b):
    for hi in range(h):
      kh = hi // (h // hk)
      for ti in range(t):
        allowed = np.ones(s, bool)
        if causal:
          allowed &= kv_pos[bi] <= q_pos[bi, ti]
        if q_seg is not None:
          allowed &= (kv_seg[bi] == q_seg[bi, ti]) & (q_seg[bi, ti] != 0)
        if not allowed.any():
          continue
        logits = (k[bi, :, kh] @ q[bi, ti, hi]) * scale
        logits = np.where(allowed, logits, -np.inf)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[bi, ti, hi] = p @ v[bi, :, kh]
  return out


def _rand(key, *shapes):
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(kk, sh, jnp.float32) for kk, sh in zip(keys, shapes)]


SEG = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("use_seg", [False, True])
@pytest.mark.parametrize("hk", [3, 1])
def test_matches_naive(causal, use_seg, hk):
  b, t, h, d, dv = 2, 9, 3, 8, 5
  q, k, v = _rand(jax.random.PRNGKey(0), (b, t, h, d), (b, t, hk, d), (b, t, hk, dv))
  seg = SEG if use_seg else None
  out = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal,
                  implementation="xla")
  ref = naive_attention(q, k, v, q_seg=seg, kv_seg=seg, causal=causal)
  assert out.shape == (b, t, h, dv) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
  if use_seg:
    assert np.all(np.asarray(out)[0, 7:] == 0.0)  # padding queries give zeros


def test_auto_on_cpu_matches_xla_and_custom_scale():
  q, k, v = _rand(jax.random.PRNGKey(1), (1, 6, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8))
  a = attention(q, k, v, scale=0.3)
  ref = naive_attention(q, k, v, scale=0.3)
  np.testing.assert_allclose(np.asarray(a), ref, atol=1e-5, rtol=1e-5)


def test_positions_decode_against_cache():
  """Queries at positions p see keys at positions <= p; keys past the cache index are never seen."""
  b, s, h, d = 2, 10, 2, 8
  q, k, v = _rand(jax.random.PRNGKey(2), (b, 3, h, d), (b, s, h, d), (b, s, h, d))
  q_pos = np.array([[4, 5, 6], [2, 3, 4]], np.int32)
  kv_pos = np.arange(s, dtype=np.int32)
  out = attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, implementation="xla")
  ref = naive_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
  # Garbage beyond position 6 in row 0 must not matter.
  k2 = k.at[0, 7:].set(1e3)
  out2 = attention(q, k2, v, q_positions=q_pos, kv_positions=kv_pos, implementation="xla")
  np.testing.assert_allclose(np.asarray(out2), np.asarray(out), atol=1e-6)


def test_query_blocks_match_single_block():
  b, t, h, d = 1, 37, 2, 8
  q, k, v = _rand(jax.random.PRNGKey(3), (b, t, h, d), (b, t, h, d), (b, t, h, 4))
  seg = np.array([[1] * 20 + [2] * 15 + [0] * 2], np.int32)
  full = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, implementation="xla")
  blocked = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, implementation="xla",
                      q_block=8)
  plain = attention(q, k, v, implementation="xla", q_block=8)
  np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=1e-6)
  np.testing.assert_allclose(np.asarray(plain), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
  # Gradients go through the blocked (rematerialised) path too.
  g1 = jax.grad(lambda q: attention(q, k, v, implementation="xla").sum())(q)
  g2 = jax.grad(lambda q: attention(q, k, v, implementation="xla", q_block=8).sum())(q)
  np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), atol=1e-5)


def test_bad_inputs_raise():
  q, k, v = _rand(jax.random.PRNGKey(4), (1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8))
  with pytest.raises(ValueError, match="needs q_positions"):
    attention(q, k, v)
  with pytest.raises(ValueError, match="implementation"):
    attention(q, k, v, causal=False, implementation="flash")
  with pytest.raises(ValueError, match="together"):
    attention(q, k, v, causal=False, q_segment_ids=np.ones((1, 4), np.int32))
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    attention(jnp.zeros((1, 6, 3, 8)), k, v, causal=False)
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="cudnn"):
      attention(q, k, v, causal=False, implementation="cudnn")


def test_max_attention_logits_matches_naive_masked_max():
  from k3jax.ops.attention import max_attention_logits
  rng = np.random.default_rng(7)
  b, t, h, d = 2, 37, 3, 8
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k = rng.normal(size=(b, t, h, d)).astype(np.float32)
  seg = np.ones((b, t), np.int32)
  seg[0, 20:] = 2
  seg[1, 30:] = 0
  want = np.full(h, -np.inf)
  for bi in range(b):
    for i in range(t):
      for j in range(i + 1):
        if seg[bi, i] != 0 and seg[bi, i] == seg[bi, j]:
          want = np.maximum(want, (q[bi, i] * k[bi, j]).sum(-1) * 0.5)
  got = max_attention_logits(jnp.asarray(q), jnp.asarray(k), segment_ids=jnp.asarray(seg),
                             scale=0.5, q_block=8)
  np.testing.assert_allclose(got, want, rtol=1e-5)
