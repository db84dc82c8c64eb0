"""Tests of k3jax.training.optim: schedule, decay mask, AdamW decay, per-head Muon, QK-Clip."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.training import optim
from k3jax.config import ModelConfig, OptimizerConfig

# A parameter tree shaped and named like the model's (k3jax/layers/*), with logical axis names.
PARAMS_AXES = {
    "embedding": ((32, 8), ("vocab", "embed")),
    "lm_head": ((8, 32), ("embed", "vocab")),
    "final_norm": {"scale": ((8,), ("norm",))},
    "layer_0": {
        "attn_norm": {"scale": ((8,), ("norm",))},
        "attn_mix": {"query": ((8,), ("norm",))},
        "mla": {"wq": ((8, 2, 6), ("embed", "heads", "head_dim")),
                "wk_b": ((4, 2, 4), ("kv_lora", "heads", "head_dim")),
                "wo": ((2, 4, 8), ("heads", "head_dim", "embed"))},
        "kda": {"A_log": ((2,), ("heads",)), "dt_bias": ((16,), ("heads",)),
                "conv": {"kernel": ((4, 16), ("conv", "heads"))}},
        "moe": {"router": {"kernel": ((8, 4), ("embed", None))},
                "w_up": ((4, 8, 6), ("expert", "embed", "mlp")),
                "down": {"kernel": ((8, 4), ("embed", "latent"))}},
        "ffn": {"gate": {"kernel": ((8, 12), ("embed", "mlp"))},
                "up": {"kernel": ((8, 12), ("embed", "mlp")), "bias": ((12,), ("mlp",))}},
    },
}


def _split(tree):
  is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)
  shapes = jax.tree.map(lambda s: s[0], tree, is_leaf=is_spec)
  axes = jax.tree.map(lambda s: s[1], tree, is_leaf=is_spec)
  is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=is_shape)
  return params, axes


def test_schedule_warmup_and_end_values():
  cfg = OptimizerConfig(learning_rate=2e-3, warmup_fraction=0.1, end_lr_fraction=0.1)
  total = 200
  sched = optim.lr_schedule(cfg, total)
  warmup = 20
  assert float(sched(0)) == 0.0
  np.testing.assert_allclose(float(sched(warmup // 2)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(sched(warmup)), 2e-3, rtol=1e-6)
  np.testing.assert_allclose(float(sched(total)), 2e-4, rtol=1e-6)
  # cosine in between: end + (peak - end) * (1 + cos(pi * progress)) / 2
  s = 110
  progress = (s - warmup) / (total - warmup)
  expected = 2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * progress))
  np.testing.assert_allclose(float(sched(s)), expected, rtol=1e-5)


def test_schedule_without_warmup_starts_at_peak():
  cfg = OptimizerConfig(learning_rate=1e-3, warmup_fraction=0.0, end_lr_fraction=0.0)
  sched = optim.lr_schedule(cfg, 10)
  np.testing.assert_allclose(float(sched(0)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(sched(10)), 0.0, atol=1e-12)


def test_decay_mask():
  params, _ = _split(PARAMS_AXES)
  mask = optim.decay_mask(params)
  layer = mask["layer_0"]
  assert mask["embedding"] and mask["lm_head"]
  assert layer["mla"]["wq"] and layer["mla"]["wo"] and layer["moe"]["w_up"]
  assert layer["ffn"]["gate"]["kernel"], "the SiTU-GLU gate projection is a weight matrix"
  assert not mask["final_norm"]["scale"] and not layer["attn_norm"]["scale"]
  assert not layer["attn_mix"]["query"]
  assert not layer["kda"]["A_log"] and not layer["kda"]["dt_bias"]
  assert not layer["moe"]["router"]["kernel"], "router (gate) params are not decayed"
  assert not layer["ffn"]["up"]["bias"]


def test_adamw_weight_decay_follows_mask():
  """With zero gradients, AdamW's update is exactly -lr * wd * p on decayed leaves, 0 elsewhere."""
  params, axes = _split(PARAMS_AXES)
  cfg = OptimizerConfig(learning_rate=1e-2, warmup_fraction=0.0, end_lr_fraction=1.0,
                        weight_decay=0.1, grad_clip_norm=1.0)
  opt, _ = optim.make_optimizer(cfg, 10, axes)
  state = jax.jit(opt.init)(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(opt.update)(zeros, state, params)
  mask = optim.decay_mask(params)
  for u, p, m in zip(jax.tree.leaves(updates), jax.tree.leaves(params), jax.tree.leaves(mask)):
    expected = -1e-2 * 0.1 * p if m else jnp.zeros_like(p)
    np.testing.assert_allclose(u, expected, rtol=1e-6, atol=1e-12)


def test_muon_dimension_numbers_per_head():
  params, axes = _split(PARAMS_AXES)
  dims = optim.muon_dimension_numbers(params, axes)
  layer = dims["layer_0"]
  assert layer["mla"]["wq"] == optim.MuonDimensionNumbers(0, 2)   # heads axis 1 is a batch axis
  assert layer["mla"]["wo"] == optim.MuonDimensionNumbers(1, 2)   # heads axis 0 is a batch axis
  assert layer["moe"]["w_up"] == optim.MuonDimensionNumbers(1, 2)  # per expert
  assert layer["ffn"]["gate"]["kernel"] == optim.MuonDimensionNumbers(0, 1)
  for adam_leaf in (dims["embedding"], dims["lm_head"], layer["kda"]["conv"]["kernel"],
                    layer["moe"]["router"]["kernel"], layer["attn_norm"]["scale"]):
    assert adam_leaf is None


def _muon_step(params, axes, grads):
  cfg = OptimizerConfig(name="muon", learning_rate=1e-2, warmup_fraction=0.0,
                        end_lr_fraction=1.0, weight_decay=0.0, grad_clip_norm=0.0)
  opt, _ = optim.make_optimizer(cfg, 10, axes)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  return updates


def test_muon_step_changes_matrices_and_orthogonalises_per_head():
  params, axes = _split(PARAMS_AXES)
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  updates = _muon_step(params, axes, grads)
  for leaf in jax.tree.leaves(updates):
    assert bool(jnp.all(jnp.isfinite(leaf)))
  new = jax.tree.map(lambda p, u: p + u, params, updates)
  assert not np.allclose(new["layer_0"]["mla"]["wq"], params["layer_0"]["mla"]["wq"])
  assert not np.allclose(new["layer_0"]["ffn"]["gate"]["kernel"],
                         params["layer_0"]["ffn"]["gate"]["kernel"])
  # AdamW leaves: the first Adam step is -lr * g / (|g| + eps) = -lr * sign(g).
  np.testing.assert_allclose(updates["embedding"], -1e-2 * np.sign(grads["embedding"]), rtol=1e-4)
  # Per-head blocks are orthogonalised independently: scaling head 1's gradient by 1000 leaves
  # head 0's update unchanged (whole-matrix Newton-Schulz would change it).
  g2 = jax.tree.map(lambda x: x, grads)
  g2["layer_0"]["mla"]["wq"] = grads["layer_0"]["mla"]["wq"].at[:, 1].multiply(1000.0)
  updates2 = _muon_step(params, axes, g2)
  np.testing.assert_allclose(updates2["layer_0"]["mla"]["wq"][:, 0],
                             updates["layer_0"]["mla"]["wq"][:, 0], rtol=1e-4, atol=1e-7)
  # The orthogonalised block has all singular values near 1 (times the RMS scale), so its
  # condition number is far below the raw gradient's.
  block = np.asarray(updates["layer_0"]["mla"]["wq"][:, 0])          # [8, 6]
  sv = np.linalg.svd(block, compute_uv=False)
  assert sv.max() / sv.min() < 2.0


def _mla_logits(wq, wk_b, wk_rope, x, c_kv, nope):
  """Naive per-head logits [H, T, T] of gated MLA (scaled by 1/sqrt(dqk))."""
  q = np.einsum("td,dhk->htk", x, wq)
  k_nope = np.einsum("tr,rhk->htk", c_kv, wk_b)
  k_rope = x @ wk_rope
  k = np.concatenate([k_nope, np.broadcast_to(k_rope, (wq.shape[1],) + k_rope.shape)], -1)
  return np.einsum("hik,hjk->hij", q, k) / math.sqrt(wq.shape[2])


def test_qk_clip_closed_form():
  cfg = ModelConfig(mla_num_heads=3, mla_qk_nope_dim=4, mla_qk_rope_dim=2, mla_kv_lora_rank=5)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(7, 8))
  c_kv = rng.normal(size=(7, 5))
  wq = rng.normal(size=(8, 3, 6))
  wq[:, 1] *= 5.0   # head 1 has much larger logits
  wk_b = rng.normal(size=(5, 3, 4))
  wk_rope = rng.normal(size=(8, 2))
  before = _mla_logits(wq, wk_b, wk_rope, x, c_kv, 4)
  s_max = before.reshape(3, -1).max(-1)
  tau = float(np.sort(s_max)[1]) + 1e-3   # exactly one head (the largest) is above tau
  clipped_head = int(np.argmax(s_max))
  params = {"wq": jnp.asarray(wq), "wk_b": jnp.asarray(wk_b), "wk_rope": jnp.asarray(wk_rope)}
  new = optim.qk_clip_mla(params, jnp.asarray(s_max, jnp.float32), tau, cfg)
  after = _mla_logits(np.asarray(new["wq"], np.float64), np.asarray(new["wk_b"], np.float64),
                      np.asarray(new["wk_rope"]), x, c_kv, 4)
  gamma = tau / s_max[clipped_head]
  for h in range(3):
    expected = before[h] * (gamma if h == clipped_head else 1.0)
    np.testing.assert_allclose(after[h], expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(after[clipped_head].max(), tau, rtol=1e-5)
  np.testing.assert_array_equal(new["wk_rope"], params["wk_rope"])   # shared k^R untouched


def test_apply_qk_clip_by_path():
  cfg = ModelConfig(mla_num_heads=2, mla_qk_nope_dim=4, mla_qk_rope_dim=2)
  params = {"layer_1": {"mla": {"wq": jnp.ones((8, 2, 6)), "wk_b": jnp.ones((4, 2, 4))}},
            "other": jnp.ones(3)}
  out = optim.apply_qk_clip(params, {("layer_1", "mla"): jnp.array([400.0, 50.0])}, 100.0, cfg)
  np.testing.assert_allclose(out["layer_1"]["mla"]["wq"][0, 0], [0.5] * 4 + [0.25] * 2)
  np.testing.assert_allclose(out["layer_1"]["mla"]["wq"][0, 1], [1.0] * 6)
  np.testing.assert_allclose(out["layer_1"]["mla"]["wk_b"][0, :, 0], [0.5, 1.0])
  assert params["layer_1"]["mla"]["wq"][0, 0, 0] == 1.0   # the input is not modified
  with pytest.raises(ValueError, match="max_logits"):
    optim.qk_clip_mla(params["layer_1"]["mla"], jnp.ones(3), 1.0, cfg)


def _stacked(tree, groups):
  """PARAMS_AXES-style specs with a leading 'layers' axis of `groups` entries (a scanned layer)."""
  is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)
  return jax.tree.map(lambda s: ((groups,) + s[0], ("layers",) + s[1]), tree, is_leaf=is_spec)


def test_scanned_layers_get_the_rules_of_unstacked_ones():
  """A scanned layer's parameters (leading 'layers' axis, path through scanned_period_<p>) get
  the decay mask and the Muon blocks of the same parameter in an unrolled layer."""
  specs = {"layer_0": PARAMS_AXES["layer_0"],
           "scanned_period_4": {"layer_1": _stacked(PARAMS_AXES["layer_0"], 3)}}
  params, axes = _split(specs)
  mask = optim.decay_mask(params)
  dims = optim.muon_dimension_numbers(params, axes)
  flat_mask = jax.tree_util.tree_leaves(mask["scanned_period_4"]["layer_1"])
  assert flat_mask == jax.tree_util.tree_leaves(mask["layer_0"])
  assert not mask["scanned_period_4"]["layer_1"]["attn_norm"]["scale"]   # [3, d]: still a vector
  is_dims = lambda d: d is None or isinstance(d, optim.MuonDimensionNumbers)
  shift = lambda d: None if d is None else optim.MuonDimensionNumbers(d.reduction_axis + 1,
                                                                      d.output_axis + 1)
  unrolled = jax.tree.map(shift, dims["layer_0"], is_leaf=is_dims)
  assert jax.tree.leaves(dims["scanned_period_4"]["layer_1"], is_leaf=is_dims) == \
      jax.tree.leaves(unrolled, is_leaf=is_dims)
  assert dims["scanned_period_4"]["layer_1"]["mla"]["wq"] == optim.MuonDimensionNumbers(1, 3)


def test_muon_orthogonalises_each_scanned_layer_on_its_own():
  """Muon's update of a stacked [G, d_in, d_out] matrix is the per-layer update of each entry."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(3, 8, 12)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(3, 8, 12)), jnp.float32)
  stacked = _muon_step({"scanned_period_4": {"layer_1": {"w": w}}},
                       {"scanned_period_4": {"layer_1": {"w": ("layers", "embed", "mlp")}}},
                       {"scanned_period_4": {"layer_1": {"w": g}}})
  for i in range(3):
    single = _muon_step({"layer_1": {"w": w[i]}}, {"layer_1": {"w": ("embed", "mlp")}},
                        {"layer_1": {"w": g[i]}})
    np.testing.assert_allclose(stacked["scanned_period_4"]["layer_1"]["w"][i],
                               single["layer_1"]["w"], rtol=1e-5, atol=1e-6)


def test_apply_qk_clip_on_a_scanned_layer_clips_each_group():
  cfg = ModelConfig(mla_num_heads=2, mla_qk_nope_dim=4, mla_qk_rope_dim=2)
  rng = np.random.default_rng(2)
  wq = jnp.asarray(rng.normal(size=(3, 8, 2, 6)), jnp.float32)
  wk_b = jnp.asarray(rng.normal(size=(3, 4, 2, 4)), jnp.float32)
  s_max = jnp.array([[400.0, 50.0], [50.0, 50.0], [90.0, 250.0]])
  path = ("scanned_period_4", "layer_3", "mla")
  params = {path[0]: {path[1]: {"mla": {"wq": wq, "wk_b": wk_b}}}}
  out = optim.apply_qk_clip(params, {path: s_max}, 100.0, cfg)[path[0]][path[1]]["mla"]
  for i in range(3):
    one = optim.qk_clip_mla({"wq": wq[i], "wk_b": wk_b[i]}, s_max[i], 100.0, cfg)
    np.testing.assert_allclose(out["wq"][i], one["wq"], rtol=1e-6)
    np.testing.assert_allclose(out["wk_b"][i], one["wk_b"], rtol=1e-6)
  with pytest.raises(ValueError, match=r"\[G, H\]"):
    optim.apply_qk_clip(params, {path: s_max[0]}, 100.0, cfg)
