"""GatedMLA against a naive dense numpy computation; causality, segments, gate, decode."""

from __future__ import annotations

import dataclasses
import math
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers.mla import LORA_NORM_EPS, GatedMLA

BASE = ModelConfig(d_model=16, mla_num_heads=2, mla_kv_lora_rank=12, mla_qk_nope_dim=8,
                   mla_qk_rope_dim=4, mla_v_dim=6, init_std=0.3)
IMPL = ImplConfig(attention_impl="xla")


def _params(variables):
  return flax.core.meta.unbox(variables["params"])


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def naive_mla(p, x, cfg, seg=None):
  """Dense float64 reference: per (batch, head, query) softmax over visible keys."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  nope, rope, h = cfg.mla_qk_nope_dim, cfg.mla_qk_rope_dim, cfg.mla_num_heads
  if cfg.mla_q_lora_rank > 0:
    cq = _rms(x @ p["wq_a"], p["q_norm"]["scale"], LORA_NORM_EPS)
    q = np.einsum("btr,rhk->bthk", cq, p["wq_b"])
  else:
    q = np.einsum("btd,dhk->bthk", x, p["wq"])
  ckv = _rms(x @ p["wkv_a"], p["kv_norm"]["scale"], LORA_NORM_EPS)
  k_nope = np.einsum("btr,rhk->bthk", ckv, p["wk_b"])
  v = np.einsum("btr,rhv->bthv", ckv, p["wv_b"])
  k_rope = x @ p["wk_rope"] if rope > 0 else np.zeros((b, t, 0))
  o = np.zeros((b, t, h, cfg.mla_v_dim))
  for bi in range(b):
    for hi in range(h):
      for ti in range(t):
        if seg is not None and seg[bi, ti] == 0:
          continue
        keys = [s for s in range(ti + 1) if seg is None or seg[bi, s] == seg[bi, ti]]
        logits = np.array([q[bi, ti, hi, :nope] @ k_nope[bi, s, hi]
                           + q[bi, ti, hi, nope:] @ k_rope[bi, s] for s in keys])
        logits /= np.sqrt(nope + rope)
        w = np.exp(logits - logits.max())
        w /= w.sum()
        o[bi, ti, hi] = w @ v[bi, keys, hi]
  if cfg.mla_output_gate:
    o = o / (1.0 + np.exp(-np.einsum("btd,dhv->bthv", x, p["w_gate"])))
  return np.einsum("bthv,hvd->btd", o, p["wo"])


SEG = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("q_lora,rope,gate", [(0, 4, True), (10, 4, True), (0, 0, False)])
def test_matches_naive(q_lora, rope, gate):
  cfg = dataclasses.replace(BASE, mla_q_lora_rank=q_lora, mla_qk_rope_dim=rope,
                            mla_output_gate=gate)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, cfg.d_model))
  layer = GatedMLA(cfg, IMPL)
  variables = layer.init(jax.random.PRNGKey(1), x)
  for seg in (None, SEG):
    y = layer.apply(variables, x, seg)
    ref = naive_mla(_params(variables), x, cfg, seg)
    np.testing.assert_allclose(np.asarray(y), ref, atol=2e-5, rtol=1e-4)


def test_param_axes():
  variables = GatedMLA(BASE, IMPL).init(jax.random.PRNGKey(1), jnp.ones((1, 4, BASE.d_model)))
  p = variables["params"]
  assert p["wq"].names == ("embed", "heads", "head_dim")
  assert p["wo"].names == ("heads", "head_dim", "embed")
  assert p["wkv_a"].names == ("embed", "kv_lora")


def test_causality_and_segment_isolation():
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 8, BASE.d_model))
  layer = GatedMLA(BASE, IMPL)
  variables = layer.init(jax.random.PRNGKey(3), x)
  y = np.asarray(layer.apply(variables, x, SEG))
  # Future tokens of row 1 change: earlier outputs must not.
  x_future = x.at[1, 5:].set(5.0)
  y_future = np.asarray(layer.apply(variables, x_future, SEG))
  np.testing.assert_array_equal(y_future[1, :5], y[1, :5])
  assert not np.allclose(y_future[1, 5:], y[1, 5:])
  # Document 1 of row 0 changes: document 2 must not.
  x_doc = x.at[0, :4].set(-2.0)
  y_doc = np.asarray(layer.apply(variables, x_doc, SEG))
  np.testing.assert_array_equal(y_doc[0, 4:], y[0, 4:])
  assert np.all(y[0, 7] == 0.0)  # padding


def test_output_gate_closes():
  x = jax.random.normal(jax.random.PRNGKey(4), (1, 6, BASE.d_model))
  layer = GatedMLA(BASE, IMPL)
  variables = layer.init(jax.random.PRNGKey(5), x)
  y_open = np.asarray(layer.apply(variables, x))
  params = _params(variables)
  # A gate weight aligned with x and huge in magnitude drives sigmoid(x W_g) to ~0.
  closed = dict(params, w_gate=-1e4 * jnp.broadcast_to(
      jnp.sign(x[0, :, :]).mean(0)[:, None, None], params["w_gate"].shape))
  pre = np.einsum("btd,dhv->bthv", np.asarray(x), np.asarray(closed["w_gate"]))
  assert pre.max() < -50  # every gate is shut
  y_closed = np.asarray(layer.apply({"params": closed}, x))
  assert np.abs(y_open).max() > 1e-3
  assert np.abs(y_closed).max() < 1e-12
  ungated = dataclasses.replace(BASE, mla_output_gate=False)
  no_gate = {k: v for k, v in params.items() if k != "w_gate"}
  y_ungated = np.asarray(GatedMLA(ungated, IMPL).apply({"params": no_gate}, x))
  np.testing.assert_allclose(y_ungated, naive_mla(no_gate, x, ungated), atol=2e-5, rtol=1e-4)
  assert not np.allclose(y_ungated, y_open)


@pytest.mark.parametrize("q_lora", [0, 10])
def test_decode_equals_full_forward(q_lora):
  cfg = dataclasses.replace(BASE, mla_q_lora_rank=q_lora)
  b, max_len, prefill = 2, 10, 4
  x = jax.random.normal(jax.random.PRNGKey(6), (b, max_len, cfg.d_model))
  layer = GatedMLA(cfg, IMPL)
  variables = layer.init(jax.random.PRNGKey(7), jnp.zeros((b, max_len, cfg.d_model)), decode=True)
  cache = variables["cache"]
  assert cache["cached_ckv"].shape == (b, max_len, cfg.mla_kv_lora_rank)
  assert cache["cached_krope"].shape == (b, max_len, cfg.mla_qk_rope_dim)
  assert int(cache["cache_index"]) == 0
  full = np.asarray(layer.apply({"params": variables["params"]}, x))
  step = jax.jit(lambda c, xt: layer.apply({"params": variables["params"], "cache": c}, xt,
                                           decode=True, mutable=["cache"]))
  y, upd = step(cache, x[:, :prefill])
  outs = [np.asarray(y)]
  cache = upd["cache"]
  for i in range(prefill, max_len):
    y, upd = step(cache, x[:, i:i + 1])
    outs.append(np.asarray(y))
    cache = upd["cache"]
  assert int(cache["cache_index"]) == max_len
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5, rtol=1e-4)


def test_decode_left_padding():
  b, t = 1, 7
  x = jax.random.normal(jax.random.PRNGKey(8), (b, t, BASE.d_model))
  layer = GatedMLA(BASE, IMPL)
  variables = layer.init(jax.random.PRNGKey(9), jnp.zeros((b, t, BASE.d_model)), decode=True)
  seg = np.array([[0, 0, 1, 1, 1, 1, 1]], np.int32)
  y, _ = layer.apply(variables, x, seg, decode=True, mutable=["cache"])
  ref = layer.apply({"params": variables["params"]}, x[:, 2:])
  np.testing.assert_allclose(np.asarray(y)[:, 2:], np.asarray(ref), atol=2e-5, rtol=1e-4)
  assert np.all(np.asarray(y)[:, :2] == 0)


def test_bfloat16_close_to_float32():
  x = jax.random.normal(jax.random.PRNGKey(10), (2, 8, BASE.d_model))
  variables = GatedMLA(BASE, IMPL).init(jax.random.PRNGKey(11), x)
  y32 = np.asarray(GatedMLA(BASE, IMPL).apply(variables, x, SEG))
  y16 = GatedMLA(dataclasses.replace(BASE, dtype="bfloat16"), IMPL).apply(variables, x, SEG)
  assert y16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(y16.astype(jnp.float32)) - y32).max()
  assert err < 0.05 * np.abs(y32).max(), err


def _largest_shape(hlo_text: str) -> int:
  """Elements of the largest array shape named in StableHLO (tensor<AxBx..xf32>) or HLO text."""
  dims = re.findall(r"tensor<((?:\d+x)+)[a-z]", hlo_text)
  dims = [d.rstrip("x").split("x") for d in dims]
  dims += [d.split(",") for d in re.findall(r"[a-z]\d*\[([\d,]+)\]", hlo_text)]
  return max(math.prod(int(n) for n in d if n) for d in dims)


def test_training_grad_holds_no_t_squared_array():
  """jit(grad) of the MLA training forward at T = 65536 with segment ids (and QK-Clip's max-logit
  statistic): no array of T² elements in the lowered or the compiled program (not run)."""
  t = 65536
  layer = GatedMLA(BASE, IMPL)
  params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 16)),
                                             jnp.ones((1, 8), jnp.int32)))

  def loss(p, x, seg):
    y, stats = layer.apply(p, x, seg, mutable=["attn_stats"])
    return jnp.sum(y * y) + jnp.sum(stats["attn_stats"]["max_logits"][0])

  lowered = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, t, 16), jnp.float32),
                                          jax.ShapeDtypeStruct((1, t), jnp.int32))
  assert _largest_shape(lowered.as_text()) < t * t
  assert _largest_shape(lowered.compile().as_text()) < t * t
  # The same check sees a dense mask: the detector itself is not blind.
  dense = jax.jit(lambda s: s[:, :, None] == s[:, None, :]).lower(
      jax.ShapeDtypeStruct((1, t), jnp.int32))
  assert _largest_shape(dense.as_text()) >= t * t
