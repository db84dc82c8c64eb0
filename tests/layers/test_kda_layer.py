"""KDALayer against an independent numpy computation; packing; decode; gate range."""

from __future__ import annotations

import dataclasses
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers import kda as kda_layer
from k3jax.layers.kda import KDALayer

BASE = ModelConfig(d_model=16, kda_num_heads=2, kda_head_dim=8, kda_value_dim=6, kda_conv_size=4,
                   kda_chunk_size=16, init_std=0.3)
IMPL = ImplConfig(kda_backend="xla")


def _params(variables):
  return jax.tree.map(lambda a: np.asarray(a, np.float64),
                      flax.core.meta.unbox(variables["params"]))


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _conv_silu(x, w, seg):
  """Causal depthwise conv by explicit loop; inputs from other documents are skipped."""
  b, t, c = x.shape
  width = w.shape[0]
  y = np.zeros((b, t, c))
  for bi in range(b):
    for ti in range(t):
      for j in range(width):
        src = ti - (width - 1) + j
        if src >= 0 and seg[bi, src] == seg[bi, ti]:
          y[bi, ti] += w[j] * x[bi, src]
  return _silu(y)


def naive_kda_layer(p, x, cfg, seg=None):
  """float64 numpy: projections, convs, gate, and a per-token python loop of the recurrence."""
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, dk, dv = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim
  seg = np.ones((b, t), np.int64) if seg is None else np.asarray(seg)
  q = _conv_silu((x @ p["q_proj"].reshape(-1, h * dk)), p["q_conv"]["kernel"], seg)
  k = _conv_silu((x @ p["k_proj"].reshape(-1, h * dk)), p["k_conv"]["kernel"], seg)
  v = _conv_silu((x @ p["v_proj"].reshape(-1, h * dv)), p["v_conv"]["kernel"], seg)
  q, k, v = q.reshape(b, t, h, dk), k.reshape(b, t, h, dk), v.reshape(b, t, h, dv)
  if cfg.kda_gate_rank > 0:
    gx = (x @ p["f_a_proj"]) @ p["f_b_proj"].reshape(cfg.kda_gate_rank, h * dk)
  else:
    gx = x @ p["f_proj"].reshape(-1, h * dk)
  gx = (gx + p["dt_bias"]).reshape(b, t, h, dk)
  rate = np.exp(p["A_log"])[:, None]
  lb = cfg.kda_gate_lower_bound
  if lb is None:
    g = -rate * np.log1p(np.exp(gx))
  else:
    g = lb * _sigmoid(rate * gx)
  beta = _sigmoid(x @ p["b_proj"])
  o = np.zeros((b, t, h, dv))
  for bi in range(b):
    for hi in range(h):
      s = np.zeros((dk, dv))
      for ti in range(t):
        if seg[bi, ti] == 0:
          continue
        if ti > 0 and seg[bi, ti] != seg[bi, ti - 1]:
          s = np.zeros((dk, dv))
        qt = q[bi, ti, hi] / np.sqrt(np.sum(q[bi, ti, hi] ** 2) + 1e-6)
        kt = k[bi, ti, hi] / np.sqrt(np.sum(k[bi, ti, hi] ** 2) + 1e-6)
        s = np.exp(g[bi, ti, hi])[:, None] * s
        s = s + beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi] - s.T @ kt)
        o[bi, ti, hi] = s.T @ (qt * dk ** -0.5)
  norm = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + cfg.norm_eps) * p["o_norm"]
  if cfg.kda_output_gate_rank > 0:
    gate = _sigmoid(np.einsum("btr,rhv->bthv", x @ p["g_a_proj"], p["g_b_proj"]))
  else:
    gate = _sigmoid(np.einsum("btd,dhv->bthv", x, p["g_proj"]))
  return np.einsum("bthv,hvd->btd", norm * gate, p["o_proj"])


SEG = np.array([[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 0, 0],
                [1] * 22], np.int32)


@pytest.mark.parametrize("gate_rank,lower_bound,output_gate_rank",
                         [(0, -5.0, 0), (4, -5.0, 0), (0, None, 0), (8, None, 8)])
def test_matches_naive(gate_rank, lower_bound, output_gate_rank):
  cfg = dataclasses.replace(BASE, kda_gate_rank=gate_rank, kda_gate_lower_bound=lower_bound,
                            kda_output_gate_rank=output_gate_rank)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 22, cfg.d_model))
  layer = KDALayer(cfg, IMPL)
  variables = layer.init(jax.random.PRNGKey(1), x)
  p = _params(variables)
  fwd = jax.jit(layer.apply)
  for seg in (None, SEG):
    y = fwd(variables, x, seg)
    np.testing.assert_allclose(np.asarray(y), naive_kda_layer(p, x, cfg, seg), atol=1e-5,
                               rtol=1e-4)


def test_init_and_axes():
  variables = KDALayer(BASE, IMPL).init(jax.random.PRNGKey(0), jnp.ones((1, 4, BASE.d_model)))
  p = variables["params"]
  assert p["q_proj"].names == ("embed", "heads", "head_dim")
  assert p["o_proj"].names == ("heads", "head_dim", "embed")
  assert p["q_conv"]["kernel"].names == ("conv", "heads")
  assert p["q_conv"]["kernel"].value.shape == (4, 16)
  assert np.all(np.asarray(p["A_log"].value) == 0.0)  # bounded gate
  dt = np.log1p(np.exp(np.asarray(p["dt_bias"].value)))  # softplus undoes the inverse
  assert p["dt_bias"].value.shape == (16,) and dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
  unbounded = dataclasses.replace(BASE, kda_gate_lower_bound=None)
  a = np.exp(np.asarray(KDALayer(unbounded, IMPL).init(jax.random.PRNGKey(0), jnp.ones(
      (1, 4, BASE.d_model)))["params"]["A_log"].value))
  assert a.min() >= 1.0 and a.max() <= 16.0


@pytest.mark.parametrize("a_log_init,lower_bound,zero", [
    ("auto", -5.0, True), ("auto", None, False), ("zero", None, True),
    ("log_uniform", -5.0, False)])
def test_a_log_init(a_log_init, lower_bound, zero):
  """ModelConfig.kda_a_log_init: zeros, or log U(1, 16) per head (distinct values)."""
  cfg = dataclasses.replace(BASE, kda_num_heads=8, kda_a_log_init=a_log_init,
                            kda_gate_lower_bound=lower_bound)
  a_log = np.asarray(KDALayer(cfg, IMPL).init(jax.random.PRNGKey(0), jnp.ones(
      (1, 4, cfg.d_model)))["params"]["A_log"].value)
  if zero:
    assert np.all(a_log == 0.0)
  else:
    assert a_log.min() >= 0.0 and a_log.max() <= np.log(16.0) and len(set(a_log.tolist())) == 8


def test_low_rank_output_gate_is_the_full_rank_gate_of_the_product():
  """kda_output_gate_rank = r: g_a_proj [d, r] and g_b_proj [r, H, V] in place of g_proj; the
  layer equals the full-rank one whose g_proj is their product (every other parameter shared)."""
  low = dataclasses.replace(BASE, kda_output_gate_rank=3)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 10, BASE.d_model))
  variables = flax.core.meta.unbox(KDALayer(low, IMPL).init(jax.random.PRNGKey(3), x))
  p = dict(variables["params"])
  assert p["g_a_proj"].shape == (16, 3) and p["g_b_proj"].shape == (3, 2, 6)
  assert "g_proj" not in p
  full = dict(p)
  full["g_proj"] = jnp.einsum("dr,rhv->dhv", full.pop("g_a_proj"), full.pop("g_b_proj"))
  y_low = KDALayer(low, IMPL).apply({"params": p}, x)
  y_full = KDALayer(BASE, IMPL).apply({"params": full}, x)
  np.testing.assert_allclose(np.asarray(y_low), np.asarray(y_full), rtol=1e-5, atol=1e-6)


def test_packed_rows_equal_separate_documents():
  layer = KDALayer(BASE, IMPL)
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 22, BASE.d_model))
  variables = layer.init(jax.random.PRNGKey(3), x)
  fwd = jax.jit(layer.apply)
  packed = np.asarray(fwd(variables, x, SEG[:1]))
  for lo, hi in ((0, 7), (7, 18), (18, 20)):
    alone = np.asarray(fwd(variables, x[:, lo:hi]))
    np.testing.assert_allclose(packed[:, lo:hi], alone, atol=1e-5, rtol=1e-4)
  assert np.all(packed[:, 20:] == 0.0)


@pytest.mark.parametrize("prefill", [5, 17])
def test_decode_equals_full_forward(prefill):
  b, t = 2, 21
  layer = KDALayer(BASE, IMPL)
  x = jax.random.normal(jax.random.PRNGKey(4), (b, t, BASE.d_model))
  variables = layer.init(jax.random.PRNGKey(5), jnp.zeros((b, t, BASE.d_model)), decode=True)
  cache = variables["cache"]
  assert cache["kda_state"].shape == (b, 2, 8, 6) and cache["kda_state"].dtype == jnp.float32
  assert cache["q_conv"]["conv_state"].shape == (b, 3, 16)
  assert cache["v_conv"]["conv_state"].shape == (b, 3, 12)
  full = np.asarray(jax.jit(layer.apply)({"params": variables["params"]}, x))
  step = jax.jit(lambda c, xt: layer.apply({"params": variables["params"], "cache": c}, xt,
                                           decode=True, mutable=["cache"]))
  y, upd = step(cache, x[:, :prefill])
  outs, cache = [np.asarray(y)], upd["cache"]
  for i in range(prefill, t):
    y, upd = step(cache, x[:, i:i + 1])
    outs.append(np.asarray(y))
    cache = upd["cache"]
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=1e-4)


def test_decode_padding_leaves_state():
  layer = KDALayer(BASE, IMPL)
  x = jax.random.normal(jax.random.PRNGKey(6), (1, 9, BASE.d_model))
  variables = layer.init(jax.random.PRNGKey(7), jnp.zeros((1, 9, BASE.d_model)), decode=True)
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]], np.int32)
  y, upd = layer.apply(variables, x, seg, decode=True, mutable=["cache"])
  ref = layer.apply({"params": variables["params"]}, x[:, 3:])
  np.testing.assert_allclose(np.asarray(y)[:, 3:], np.asarray(ref), atol=1e-5, rtol=1e-4)
  assert np.all(np.asarray(y)[:, :3] == 0.0)
  # A padding step leaves the KDA state as it is, outputs zeros, and (as in the non-decode path,
  # where padding occupies a slot) shifts a zero into each conv window.
  y2, upd2 = layer.apply({"params": variables["params"], **upd}, x[:, :1],
                         np.zeros((1, 1), np.int32), decode=True, mutable=["cache"])
  c1, c2 = upd["cache"], upd2["cache"]
  np.testing.assert_array_equal(np.asarray(c2["kda_state"]), np.asarray(c1["kda_state"]))
  assert np.abs(np.asarray(c1["kda_state"])).max() > 0
  assert np.all(np.asarray(y2) == 0.0)
  for name in ("q_conv", "k_conv", "v_conv"):
    s1, s2 = np.asarray(c1[name]["conv_state"]), np.asarray(c2[name]["conv_state"])
    np.testing.assert_array_equal(s2[:, :-1], s1[:, 1:])
    assert np.all(s2[:, -1] == 0.0)


def _gate(layer, variables, x):
  _, inter = jax.jit(lambda v, x: layer.apply(v, x, mutable=["intermediates"]))(variables, x)
  return np.asarray(inter["intermediates"]["gate"][0])


def test_bounded_gate_range():
  layer = KDALayer(BASE, IMPL)
  x = jax.random.normal(jax.random.PRNGKey(8), (2, 16, BASE.d_model))
  variables = layer.init(jax.random.PRNGKey(9), x)
  g = _gate(layer, variables, x)
  assert g.shape == (2, 16, 2, 8)
  assert g.min() >= -5.0 and g.max() < 0.0
  # Huge inputs saturate fp32's sigmoid at the ends but never leave [-5, 0].
  g_big = _gate(layer, variables, 1e3 * x)
  assert g_big.min() >= -5.0 and g_big.max() <= 0.0
  assert g_big.min() == -5.0 and g_big.max() > -1e-6
  unbounded = dataclasses.replace(BASE, kda_gate_lower_bound=None)
  layer_u = KDALayer(unbounded, IMPL)
  g_u = _gate(layer_u, layer_u.init(jax.random.PRNGKey(9), x), 1e3 * x)
  assert g_u.max() <= 0.0 and g_u.min() < -5.0


def test_bfloat16_close_to_float32():
  x = jax.random.normal(jax.random.PRNGKey(10), (1, 22, BASE.d_model))
  variables = KDALayer(BASE, IMPL).init(jax.random.PRNGKey(11), x)
  y32 = np.asarray(jax.jit(KDALayer(BASE, IMPL).apply)(variables, x, SEG[:1]))
  bf = dataclasses.replace(BASE, dtype="bfloat16")
  y16 = jax.jit(KDALayer(bf, IMPL).apply)(variables, x, SEG[:1])
  assert y16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(y16.astype(jnp.float32)) - y32).max()
  assert err < 0.05 * np.abs(y32).max(), err


def test_conv_kernel_setting_reaches_the_three_short_convs():
  """ImplConfig.kda_conv_kernel = 'pallas' puts the Pallas kernels in the layer's gradient, a
  forward and a backward kernel per short conv (their values: tests/layers/test_conv_silu_vjp.py,
  tests/pallas/test_short_conv.py); 'xla' has none."""
  x = jax.random.normal(jax.random.PRNGKey(4), (1, 22, BASE.d_model))
  variables = KDALayer(BASE, IMPL).init(jax.random.PRNGKey(6), x)

  def kernels_in_gradient(kernel_choice):
    layer = KDALayer(BASE, dataclasses.replace(IMPL, kda_conv_kernel=kernel_choice))
    loss = lambda v, x: jnp.sum(layer.apply(v, x, SEG[:1]))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(variables, x))
    # Calls of the jitted kernel functions (the printed jaxpr shows a jitted function's body, with
    # its pallas_call, once per distinct signature).
    calls = [len(re.findall(rf"\bname=conv_silu_{name}\b", jaxpr)) for name in ("fwd", "bwd")]
    kernels = [bool(re.search(rf"\bname=short_conv_silu_{name}\b", jaxpr))
               for name in ("fwd", "bwd")]
    return calls if all(kernels) or not any(calls) else None

  assert kernels_in_gradient("pallas") == [3, 3]
  assert kernels_in_gradient("xla") == [0, 0]


@pytest.mark.parametrize("backend,conv_kernel", [("xla", "xla"), ("pallas", "pallas")])
def test_unmasked_qkv_give_the_masking_paths_gradients(monkeypatch, backend, conv_kernel):
  """The layer tells chunk_kda that q, k, v are zero at padding (its short convolutions make them
  so) and skips their masking: its output and every gradient (parameters and input; padding
  inside a row and at its end) equal those of the layer with chunk_kda masking them."""
  cfg = dataclasses.replace(BASE, kda_gate_rank=4)
  layer = KDALayer(cfg, ImplConfig(kda_backend=backend, kda_conv_kernel=conv_kernel))
  seg = np.array(SEG)
  seg[1, 9:12] = 0                                   # padding inside the second row's document
  x = jax.random.normal(jax.random.PRNGKey(12), (2, 22, cfg.d_model))
  cot = jax.random.normal(jax.random.PRNGKey(13), (2, 22, cfg.d_model))
  variables = layer.init(jax.random.PRNGKey(14), x)
  loss = lambda v, x: jnp.sum(layer.apply(v, x, jnp.asarray(seg)) * cot)
  seen, unpatched = [], kda_layer.chunk_kda

  def masking(*args, **kwargs):
    seen.append(kwargs.pop("qkv_zero_at_padding"))
    return unpatched(*args, **kwargs)

  got = jax.value_and_grad(loss, argnums=(0, 1))(variables, x)
  monkeypatch.setattr(kda_layer, "chunk_kda", masking)
  want = jax.value_and_grad(loss, argnums=(0, 1))(variables, x)
  assert seen == [True]
  assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
  for path, a in jax.tree_util.tree_leaves_with_path(got[1]):
    b = dict(jax.tree_util.tree_leaves_with_path(want[1]))[path]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
