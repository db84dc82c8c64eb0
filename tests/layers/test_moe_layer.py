"""Router, LatentMoE and the balancing rules, against dense references and closed forms."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers.moe import (BALANCE_COLLECTION, LatentMoE, Router, aux_balance_loss,
                              balance_update, empty_balance_statistics, loss_free_bias_update,
                              max_violation, pool_balance_statistics, qb_bias_from_top, qb_depth,
                              qb_top_margins, quantile_balance_thresholds,
                              quantile_balance_update)
from k3jax.ops.moe_ep import (qb_bias_from_histogram, qb_histogram,
                              quantile_balance_update_histogram)
from testlib import np_qb_bias_from_histogram, np_qb_exact_bias, np_qb_histogram


def _cfg(**kw):
  base = dict(d_model=16, moe_num_experts=6, moe_top_k=2, moe_latent_dim=8, moe_expert_dim=12,
              moe_num_shared=2, moe_shared_dim=5, moe_routed_scale=1.5, init_std=0.3)
  base.update(kw)
  return dataclasses.replace(ModelConfig(), **base)


def _apply(layer, variables, x, mask=None, update_balance=False, mutable=("moe_stats",)):
  """layer.apply under jit (one compile instead of many eager ops)."""
  f = jax.jit(lambda v, x, m: layer.apply(v, x, m, update_balance=update_balance,
                                          mutable=list(mutable)))
  return f(variables, x, mask)


def _random_variables(layer, seed, *args):
  """Variables of `layer` filled from numpy (avoids compiling the PRNG for every init)."""
  shapes = nn.unbox(jax.eval_shape(layer.init, jax.random.PRNGKey(0), *args))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    if "moe_state" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    scale = 1.0 + 0.1 * rng.normal(size=leaf.shape) if "scale" in name else \
        0.3 * rng.normal(size=leaf.shape)
    return jnp.asarray(scale, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _load(scores, bias, k):
  _, idx = jax.lax.top_k(scores + bias, k)
  return jnp.zeros(scores.shape[1]).at[idx.reshape(-1)].add(1.0)


# ---------------------------------------------------------------------------------------- router

def test_router_matches_numpy():
  cfg = _cfg()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 7, 16)), jnp.float32)
  bias = jnp.array([0.0, 0.3, -0.2, 0.1, 0.5, -0.4])
  router = Router(cfg)
  params = _random_variables(router, 1, x, bias)["params"]
  scores, idx, weights = router.apply({"params": params}, x, bias)
  s = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(params["kernel"], np.float64))))
  np.testing.assert_allclose(np.asarray(scores), s, rtol=1e-5)
  ref_idx = np.argsort(-(s + np.asarray(bias)), axis=-1)[..., :2]
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(ref_idx, -1))
  chosen = np.take_along_axis(s, np.asarray(idx), -1)  # weights use the unbiased scores
  np.testing.assert_allclose(np.asarray(weights), 1.5 * chosen / chosen.sum(-1, keepdims=True),
                             rtol=1e-5)
  assert scores.dtype == weights.dtype == jnp.float32 and idx.dtype == jnp.int32


# ------------------------------------------------------------------------------------- LatentMoE

def _dense_reference(params, cfg, x, bias):
  """Every expert on every token (fp64 numpy), masked by the top-k choice."""
  p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
  xn = np.asarray(x, np.float64).reshape(-1, cfg.d_model)
  s = 1 / (1 + np.exp(-(xn @ p["router/kernel"])))
  k = cfg.moe_top_k
  idx = np.argsort(-(s + bias), axis=-1)[:, :k]
  mask = np.zeros_like(s)
  np.put_along_axis(mask, idx, 1.0, axis=-1)
  weights = s * mask / (s * mask).sum(-1, keepdims=True) * cfg.moe_routed_scale   # [N, E]

  def glu(v, wg, wu, wo):
    a, b = v @ wg, v @ wu
    if cfg.ffn_activation == "swiglu":
      return (a / (1 + np.exp(-a)) * b) @ wo
    b1, b2 = cfg.situ_beta1, cfg.situ_beta2
    return (b1 * np.tanh(a / b1) / (1 + np.exp(-a)) * b2 * np.tanh(b / b2)) @ wo

  z = xn @ p["down/kernel"] if cfg.moe_latent_dim > 0 else xn
  every = np.stack([glu(z, p["w_gate"][e], p["w_up"][e], p["w_out"][e])
                    for e in range(cfg.moe_num_experts)], axis=1)          # [N, E, ℓ]
  routed = np.einsum("nel,ne->nl", every, weights)
  if cfg.moe_latent_norm:
    routed = routed / np.sqrt(np.mean(routed**2, -1, keepdims=True) + cfg.norm_eps)
    routed = routed * p["latent_norm/scale"]
  if cfg.moe_latent_dim > 0:
    routed = routed @ p["up/kernel"]
  if cfg.moe_num_shared > 0:
    routed = routed + glu(xn, p["shared/gate/kernel"], p["shared/up/kernel"],
                          p["shared/out/kernel"])
  return routed.reshape(x.shape), np.bincount(idx.ravel(), minlength=cfg.moe_num_experts)


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize("overrides,impl", [
    ({}, ImplConfig()),
    ({"moe_latent_dim": 0, "moe_latent_norm": False, "moe_num_shared": 0}, ImplConfig()),
    ({"moe_latent_norm": False, "moe_balance": "aux_loss"}, ImplConfig()),
    ({}, ImplConfig(moe_grouped_matmul="tokamax")),
    ({}, ImplConfig(moe_grouped_matmul="tiled")),
    ({"ffn_activation": "swiglu", "moe_latent_dim": 0, "moe_latent_norm": False,
      "moe_routed_scale": 2.446}, ImplConfig()),
    ({"ffn_activation": "swiglu"}, ImplConfig(moe_situ_glu="pallas")),
])
def test_latent_moe_matches_dense_reference(overrides, impl):
  cfg = _cfg(**overrides)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 16)), jnp.float32)
  layer = LatentMoE(cfg, impl)
  params = _random_variables(layer, 1, x)["params"]
  bias = np.array([0.05, -0.1, 0.0, 0.2, -0.05, 0.1], np.float32)
  y, aux = _apply(layer, {"params": params, "moe_state": {"bias": jnp.asarray(bias)}}, x)
  ref, load = _dense_reference(params, cfg, x, bias)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)
  stats = aux["moe_stats"]
  np.testing.assert_array_equal(np.asarray(stats["load"]), load)
  assert stats["load"].dtype == jnp.float32 and stats["max_vio"].shape == ()
  np.testing.assert_allclose(float(stats["max_vio"]), (load.max() - load.mean()) / load.mean(),
                             rtol=1e-6)
  assert ("aux_loss" in stats) == (cfg.moe_balance == "aux_loss")
  if cfg.moe_latent_dim == 0:
    assert params["w_gate"].shape == (6, 16, 12) and "down" not in params


def test_latent_moe_padding_state_and_update():
  cfg = _cfg(moe_num_experts=8, moe_top_k=2)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 16, 16)), jnp.float32)
  mask = jnp.ones((2, 16), bool).at[1, 10:].set(False)
  layer = LatentMoE(cfg)
  # An rbg key: the default threefry PRNG takes ~10 s to compile on CPU for a dozen parameters.
  variables = jax.jit(layer.init)(jax.random.key(3, impl="rbg"), x, mask)
  assert set(variables) == {"params", "moe_state"}
  np.testing.assert_array_equal(np.asarray(variables["moe_state"]["bias"]), np.zeros(8))
  # Padding is left out of the load, and does not change the valid tokens' outputs.
  y, aux = _apply(layer, variables, x, mask)
  assert float(jnp.sum(aux["moe_stats"]["load"])) == 26 * 2
  x2 = x.at[1, 10:].set(100.0)
  y2, _ = _apply(layer, variables, x2, mask)
  np.testing.assert_allclose(np.asarray(y2)[np.asarray(mask)], np.asarray(y)[np.asarray(mask)],
                             rtol=1e-6, atol=1e-6)
  # update_balance sows this batch's balance statistics and never writes the bias; the update
  # from them is this batch's QB bias of its valid scores (exact, or from the 1000-bin histogram).
  params = nn.unbox(variables["params"])
  scores = jax.nn.sigmoid(x.reshape(-1, 16) @ params["router"]["kernel"])
  collections = ("moe_state", "moe_stats", BALANCE_COLLECTION)
  for bins in (0, 1000):
    qb = LatentMoE(dataclasses.replace(cfg, moe_qb_histogram_bins=bins))
    _, new = _apply(qb, variables, x, mask, True, collections)
    np.testing.assert_array_equal(np.asarray(new["moe_state"]["bias"]), np.zeros(8))
    assert int(new[BALANCE_COLLECTION]["tokens"]) == 26
    if bins:
      expected = quantile_balance_update_histogram(scores, jnp.zeros(8), 2, mask.reshape(-1),
                                                   bins=bins, rate=cfg.moe_qb_rate,
                                                   cutoff=cfg.moe_qb_cutoff)
    else:
      expected = quantile_balance_update(scores, jnp.zeros(8), 2, mask.reshape(-1),
                                         cfg.moe_qb_rate, cutoff=cfg.moe_qb_cutoff)
    updated = balance_update(qb.config, variables["moe_state"], new[BALANCE_COLLECTION])
    np.testing.assert_allclose(np.asarray(updated["bias"]), np.asarray(expected), atol=1e-6)
    assert not np.allclose(np.asarray(updated["bias"]), 0.0)
  # Without update_balance nothing is sown; loss-free's statistic is the load, its update the
  # sign step.
  _, same = _apply(layer, variables, x, mask, False, collections)
  assert not same.get(BALANCE_COLLECTION)
  lf = LatentMoE(dataclasses.replace(cfg, moe_balance="loss_free"))
  _, new_lf = _apply(lf, variables, x, mask, True, collections)
  np.testing.assert_array_equal(np.asarray(new_lf[BALANCE_COLLECTION]["load"]),
                                np.asarray(new_lf["moe_stats"]["load"]).astype(np.int32))
  np.testing.assert_allclose(
      np.asarray(balance_update(lf.config, variables["moe_state"],
                                new_lf[BALANCE_COLLECTION])["bias"]),
      np.asarray(loss_free_bias_update(new_lf["moe_stats"]["load"], jnp.zeros(8), 1e-3)))
  with pytest.raises(ValueError, match="update_balance"):
    layer.apply(variables, x, mask, update_balance=-1, mutable=list(collections))
  # Gradients reach the router (through the weights) but never the bias.
  def loss(p):
    y, _ = layer.apply({"params": p, "moe_state": variables["moe_state"]}, x, mask,
                       mutable=["moe_stats"])
    return jnp.sum(y**2)

  grads = jax.jit(jax.grad(loss))(params)
  assert float(jnp.abs(grads["router"]["kernel"]).sum()) > 0
  assert float(jnp.abs(grads["w_gate"]).sum()) > 0


def test_latent_moe_gradients_equal_across_grouped_matmuls():
  """The layer's loss and gradients (parameters and input, padding included) with 'tokamax' (the
  default on the GPU) equal those with 'tiled' (the default on CPU) and 'ragged_dot'."""
  x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 12, 16)), jnp.float32)
  mask = jnp.ones((2, 12), bool).at[0, 9:].set(False)
  results = {}
  for choice in ("tokamax", "tiled", "ragged_dot"):
    layer = LatentMoE(_cfg(), ImplConfig(moe_grouped_matmul=choice))
    variables = _random_variables(layer, 7, x, mask)

    def loss(params, x, layer=layer, variables=variables):
      y, _ = layer.apply({"params": params, "moe_state": variables["moe_state"]}, x, mask,
                         mutable=["moe_stats"])
      return jnp.sum(jnp.sin(y))

    results[choice] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables["params"], x)
  # Equal to fp32 rounding: each choice is its own compiled program (fused differently), and an
  # entry that is a cancelling sum can differ by more than rtol alone allows (2 of 576 entries,
  # 6e-5 relative, once situ_glu's backward stopped sharing the forward's tanh); atol is relative
  # to the leaf's scale. A wrong grouped matmul is off by the scale itself.
  for choice in ("tiled", "ragged_dot"):
    for got, want in zip(jax.tree.leaves(results["tokamax"]), jax.tree.leaves(results[choice])):
      scale = float(np.max(np.abs(np.asarray(want))))
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale,
                                 err_msg=choice)


def test_latent_moe_capacity_and_bf16():
  cfg = _cfg(moe_capacity_factor=1.0, dtype="bfloat16")
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8, 16)), jnp.float32)
  layer = LatentMoE(cfg)
  variables = _random_variables(layer, 5, x)
  y, aux = _apply(layer, variables, x)
  assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
  load = np.asarray(aux["moe_stats"]["load"])
  cap = int(np.ceil(16 * 2 / 6))
  assert int(aux["moe_stats"]["dropped"]) == np.maximum(load - cap, 0).sum()


@pytest.mark.parametrize("balance", ["quantile", "loss_free", "aux_loss"])
def test_latent_moe_chunked_equals_unchunked(balance):
  """ImplConfig.position_chunk_tokens: outputs, loads, MaxVio, aux loss, the balance statistics
  and the bias update from them, and the gradients (params and input) equal the whole-batch
  layer; T is not a multiple of the chunk and the batch has padding."""
  cfg = _cfg(moe_num_experts=8, moe_top_k=2, moe_balance=balance)
  x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 11, 16)), jnp.float32)
  mask = jnp.ones((2, 11), bool).at[1, 7:].set(False)
  whole = LatentMoE(cfg)
  chunked = LatentMoE(cfg, ImplConfig(position_chunk_tokens=6))
  variables = _random_variables(whole, 9, x, mask)
  variables["moe_state"]["bias"] = jnp.linspace(-0.2, 0.2, 8)
  shapes = nn.unbox(jax.eval_shape(chunked.init, jax.random.PRNGKey(0), x, mask))
  assert jax.tree.structure(shapes) == jax.tree.structure(variables)

  def run(layer):
    def loss(params, x):
      y, new = layer.apply({"params": params, "moe_state": variables["moe_state"]}, x, mask,
                           update_balance=True, mutable=["moe_stats", BALANCE_COLLECTION])
      return jnp.sum(jnp.sin(y)), (y, new)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(variables["params"], x)

  (l0, (y0, new0)), g0 = run(whole)
  (l1, (y1, new1)), g1 = run(chunked)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(new1["moe_stats"]["load"]),
                                np.asarray(new0["moe_stats"]["load"]))
  assert float(jnp.sum(new1["moe_stats"]["load"])) == 18 * 2
  assert set(new1["moe_stats"]) == set(new0["moe_stats"])
  for name in new0["moe_stats"]:
    np.testing.assert_allclose(np.asarray(new1["moe_stats"][name]),
                               np.asarray(new0["moe_stats"][name]), rtol=1e-6, err_msg=name)
  assert jax.tree.structure(new1.get(BALANCE_COLLECTION, {})) == \
      jax.tree.structure(new0.get(BALANCE_COLLECTION, {}))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               new1.get(BALANCE_COLLECTION, {}), new0.get(BALANCE_COLLECTION, {}))
  bias0, bias1 = (balance_update(cfg, variables["moe_state"], new.get(BALANCE_COLLECTION, {}))
                  ["bias"] for new in (new0, new1))
  np.testing.assert_array_equal(np.asarray(bias1), np.asarray(bias0))
  if balance != "aux_loss":
    assert not np.allclose(np.asarray(bias0), np.linspace(-0.2, 0.2, 8))
  for got, want in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ quantile balance

# k = 1, n = 3, m = 6, so q = 2: t_j is the 3rd largest margin of column j.
_S = np.array([[0.9, 0.5, 0.1],
               [0.8, 0.6, 0.2],
               [0.7, 0.3, 0.4],
               [0.6, 0.5, 0.3],
               [0.2, 0.9, 0.1],
               [0.3, 0.1, 0.8]], np.float32)


def test_qb_hand_computed():
  # Cutoffs (2nd largest per row): .5 .6 .4 .5 .2 .3. Margins s − c, by column:
  #   e0: .4 .2 .3 .1 0 0 → 3rd largest .2;   e1: 0 0 −.1 0 .7 −.2 → 0;
  #   e2: −.4 −.4 0 −.2 −.1 .5 → −.1
  # b = −t = (−.2, 0, .1), centred (mean −1/30): (−1/6, 1/30, 2/15).
  b = quantile_balance_update(jnp.asarray(_S), jnp.zeros(3), 1)
  np.testing.assert_allclose(np.asarray(b), [-1 / 6, 1 / 30, 2 / 15], atol=1e-6)
  # rate 1/2 damps: b = −t/2 = (−.1, 0, .05), centred: (−.1, 0, .05) + 1/60.
  b = quantile_balance_update(jnp.asarray(_S), jnp.zeros(3), 1, rate=0.5)
  np.testing.assert_allclose(np.asarray(b), np.array([-0.1, 0.0, 0.05]) + 1 / 60, atol=1e-6)
  # Mask out the last token: m = 5, q = 5/3, read rank q+1 = 2.67 between the 2nd and 3rd largest:
  #   e0: .3 + 2/3·(.2 − .3) = .2333;  e1: 0;  e2: −.1 + 2/3·(−.2 + .1) = −.1667
  mask = jnp.array([True] * 5 + [False])
  b = quantile_balance_update(jnp.asarray(_S), jnp.zeros(3), 1, mask)
  t = np.array([0.3 - 0.1 * 2 / 3, 0.0, -0.1 - 0.1 * 2 / 3])
  np.testing.assert_allclose(np.asarray(b), -t - np.mean(-t), atol=1e-6)
  # A non-zero current bias: margins include it, so at rate 1 the result does not depend on it
  # except through the cutoffs; a uniform shift of the bias changes nothing at all.
  b_shift = quantile_balance_update(jnp.asarray(_S), jnp.full((3,), 7.0), 1)
  np.testing.assert_allclose(np.asarray(b_shift), [-1 / 6, 1 / 30, 2 / 15], atol=1e-5)


def test_qb_hand_computed_per_expert_cutoff():
  # Outsiders must beat the row maximum (k-th largest, k = 1); chosen experts the 2nd largest.
  #   e0: .4 .2 .3 .1 −.7 −.5 → 3rd largest .2;  e1: −.4 −.2 −.4 −.1 .7 −.7 → −.2;
  #   e2: −.8 −.6 −.3 −.3 −.8 .5 → −.3.   b = (−.2, .2, .3), centred: (−.3, .1, .2).
  b = quantile_balance_update(jnp.asarray(_S), jnp.zeros(3), 1, cutoff="per_expert")
  np.testing.assert_allclose(np.asarray(b), [-0.3, 0.1, 0.2], atol=1e-6)


def _skewed_scores(seed, tokens, skew):
  """sigmoid(N(0, 1) logits + a per-expert skew), fp32 [tokens, experts] (numpy-generated)."""
  logits = np.random.default_rng(seed).standard_normal((tokens, len(skew)), np.float32)
  return jax.nn.sigmoid(jnp.asarray(logits + np.asarray(skew, np.float32)))


def _skew(seed, experts, std):
  return np.random.default_rng(seed).normal(0.0, std, experts).astype(np.float32)


def test_qb_each_expert_gets_q_with_others_fixed():
  """'per_expert' margins are exact: moving only b_j to b_j − t_j gives expert j q tokens.

  (q + 1 when the token at the threshold ties with the expert it would displace.)
  """
  experts, k, tokens = 64, 4, 2048
  q = tokens * k // experts
  s = _skewed_scores(1, tokens, _skew(0, experts, 2.0))
  bias = jnp.asarray(_skew(2, experts, 0.1))
  t, _ = quantile_balance_thresholds(s, bias, k, cutoff="per_expert")
  loads = jax.vmap(lambda j: _load(s, bias.at[j].add(-t[j]), k)[j])(jnp.arange(experts))
  before = np.asarray(_load(s, bias, k))
  assert before.min() < q // 2 and before.max() > 2 * q  # far from q to begin with
  assert np.all((np.asarray(loads) >= q) & (np.asarray(loads) <= q + 1)), np.asarray(loads)


@pytest.mark.parametrize("cutoff,bound", [("token", 0.15), ("per_expert", 0.06)])
def test_qb_repeated_on_one_batch_balances_it(cutoff, bound):
  experts, k, tokens = 64, 4, 4096
  s = _skewed_scores(4, tokens, _skew(3, experts, 2.0))
  update = jax.jit(lambda b: quantile_balance_update(s, b, k, cutoff=cutoff))
  bias = jnp.zeros(experts)
  vios = [float(max_violation(_load(s, bias, k)))]
  for _ in range(8):
    bias = update(bias)
    vios.append(float(max_violation(_load(s, bias, k))))
  print(f"\nQB[{cutoff}] same batch, MaxVio per iteration: {np.round(vios, 3).tolist()}")
  assert vios[0] > 2.0 and vios[-1] < bound


def test_qb_is_jittable_with_traced_mask_and_ignores_masked_tokens():
  s = _skewed_scores(5, 512, np.linspace(-2, 2, 32))
  mask = jnp.asarray(np.random.default_rng(6).uniform(size=512) > 0.25)
  f = jax.jit(lambda s, b, m: quantile_balance_update(s, b, 3, m))
  b_masked = f(s, jnp.zeros(32), mask)
  # Masked rows may hold anything: the result equals the update on the valid rows alone.
  garbage = jnp.where(mask[:, None], s, 1.0)
  np.testing.assert_allclose(np.asarray(f(garbage, jnp.zeros(32), mask)), np.asarray(b_masked),
                             atol=1e-6)
  valid_rows = s[np.asarray(mask)]
  b_subset = quantile_balance_update(valid_rows, jnp.zeros(32), 3)
  np.testing.assert_allclose(np.asarray(b_masked), np.asarray(b_subset), atol=1e-6)
  # No valid token: the bias is returned unchanged.
  b0 = jnp.linspace(-1, 1, 32)
  np.testing.assert_array_equal(np.asarray(f(s, b0, jnp.zeros(512, bool))), np.asarray(b0))


def test_qb_rejects_bad_arguments():
  s = jnp.zeros((8, 4))
  with pytest.raises(ValueError, match="top_k"):
    quantile_balance_update(s, jnp.zeros(4), 4)
  with pytest.raises(ValueError, match="bias"):
    quantile_balance_update(s, jnp.zeros(5), 1)
  with pytest.raises(ValueError, match="rate"):
    quantile_balance_update(s, jnp.zeros(4), 1, rate=0.0)
  with pytest.raises(ValueError, match="cutoff"):
    quantile_balance_update(s, jnp.zeros(4), 1, cutoff="median")
  with pytest.raises(ValueError, match="mask"):
    quantile_balance_update(s, jnp.zeros(4), 1, jnp.ones((7,), bool))


def test_qb_stream_of_skewed_batches():
  """K3 shape (896 experts, top-16) on fresh, strongly skewed batches; each method sees the same
  batches. Per-batch MaxVio has a sampling floor (~0.5 at 4096 tokens: loads are ≈ Binomial with
  mean 73); the load summed over steps 10–40 shows the bias's own accuracy."""
  experts, k, tokens, steps = 896, 16, 4096, 41
  skew = _skew(0, experts, 2.0)
  methods = ("qb_per_expert", "qb_token", "loss_free", "none")

  @jax.jit
  def step(s, biases):
    loads = tuple(_load(s, b, k) for b in biases)
    new = (quantile_balance_update(s, biases[0], k, cutoff="per_expert"),
           quantile_balance_update(s, biases[1], k, cutoff="token"),
           loss_free_bias_update(loads[2], biases[2], 1e-3),
           biases[3])
    return jnp.stack(loads), new

  biases = tuple(jnp.zeros(experts) for _ in methods)
  history = []
  for i in range(steps):
    loads, biases = step(_skewed_scores(100 + i, tokens, skew), biases)
    history.append(np.asarray(loads))
  history = np.stack(history)                       # [steps, methods, experts]
  summed = history[10:41].sum(0)
  vio = {m: float(max_violation(jnp.asarray(summed[i]))) for i, m in enumerate(methods)}
  per_batch = {m: float(np.mean([max_violation(jnp.asarray(l)) for l in history[10:41, i]]))
               for i, m in enumerate(methods)}
  print("\nMaxVio of the load summed over steps 10-40:", {m: round(v, 4) for m, v in vio.items()})
  print("mean per-batch MaxVio over steps 10-40:   ",
        {m: round(v, 4) for m, v in per_batch.items()})
  assert vio["qb_per_expert"] < 0.05 and summed[0].min() > 0
  assert vio["qb_token"] < 0.2 and summed[1].min() > 0
  assert vio["none"] > 1.0 and vio["loss_free"] > 1.0


# ------------------------------------------------------------------ balance statistics of a step

@pytest.mark.parametrize("bins,cutoff", [(1000, "per_expert"), (1000, "token"), (0, "per_expert"),
                                         (0, "token")])
def test_balance_statistics_pool_over_micro_batches_like_numpy(bins, cutoff):
  """A step of 8 micro-batches (rows i, i + 8), each routed with the step's bias: the layer's
  balance statistics, pooled, equal those of the whole batch at once bit for bit, and numpy's
  over all the step's tokens (the histogram's counts; the exact statistic's largest margins);
  the bias update from them is numpy's."""
  cfg = _cfg(moe_num_experts=8, moe_top_k=2, moe_qb_histogram_bins=bins, moe_qb_cutoff=cutoff,
             moe_qb_rate=0.8)
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.normal(size=(16, 12, 16)), jnp.float32)
  mask = rng.random((16, 12)) > 0.2
  layer = LatentMoE(cfg)
  variables = _random_variables(layer, 11, x, jnp.asarray(mask))
  bias = jnp.asarray(0.2 * rng.normal(size=8), jnp.float32)
  variables["moe_state"]["bias"] = bias
  collect = jax.jit(lambda x, m, n: layer.apply(
      variables, x, m, update_balance=n, mutable=[BALANCE_COLLECTION])[1][BALANCE_COLLECTION],
                    static_argnums=2)
  whole = collect(x, jnp.asarray(mask), 1)
  pooled = empty_balance_statistics(whole)
  for i in range(8):
    pooled = pool_balance_statistics(pooled, collect(x[i::8], jnp.asarray(mask[i::8]), 8))
  assert jax.tree.structure(pooled) == jax.tree.structure(whole)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               pooled, whole)

  scores = jax.jit(lambda x: Router(cfg).apply({"params": variables["params"]["router"]}, x,
                                                bias)[0])(x)
  scores, flat_mask = np.asarray(scores).reshape(-1, 8), mask.reshape(-1)
  tokens = int(flat_mask.sum())
  assert int(pooled["tokens"]) == tokens
  if bins:
    counts, lo, width = np_qb_histogram(scores, bias, 2, flat_mask, bins, cutoff)
    np.testing.assert_array_equal(np.asarray(pooled["counts"]), counts)
    expected = np_qb_bias_from_histogram(counts, tokens, bias, 2, lo, width, rate=0.8)
  else:
    expected, desc = np_qb_exact_bias(scores, bias, 2, flat_mask, cutoff, rate=0.8)
    depth = qb_depth(16 * 12, 2, 8)
    assert pooled["top_margins"].shape == (8, depth)
    np.testing.assert_array_equal(np.asarray(pooled["top_margins"]), desc[:depth].T)
  new = balance_update(cfg, variables["moe_state"], pooled)["bias"]
  np.testing.assert_allclose(np.asarray(new), expected, rtol=0, atol=1e-6)


def test_exact_statistic_pools_exactly_when_one_part_holds_the_top():
  """`qb_top_margins` sized for the whole (`qb_depth` of all tokens) and pooled over four parts,
  one of which holds every large margin of expert 0: the statistic and the bias of all tokens at
  once, bit for bit."""
  experts, k, per_part = 16, 2, 64
  skew = np.zeros(experts, np.float32)
  parts = [_skewed_scores(20 + i, per_part, skew + (3.0 if i == 0 else 0.0) * (np.arange(experts)
                                                                                == 0))
           for i in range(4)]
  everything = jnp.concatenate(parts)
  bias = jnp.asarray(_skew(21, experts, 0.1))
  depth = qb_depth(4 * per_part, k, experts)
  assert depth == 4 * per_part * k // experts + 2 and depth < per_part   # parts hold more

  @jax.jit
  def run(parts, everything):
    pooled = empty_balance_statistics({"top_margins": jax.ShapeDtypeStruct((experts, depth),
                                                                           jnp.float32),
                                       "tokens": jax.ShapeDtypeStruct((), jnp.int32)})
    for part in parts:
      top, tokens = qb_top_margins(part, bias, k, cutoff="per_expert", depth=depth)
      pooled = pool_balance_statistics(pooled, {"top_margins": top, "tokens": tokens})
    top, tokens = qb_top_margins(everything, bias, k, cutoff="per_expert")
    return (pooled, {"top_margins": top, "tokens": tokens},
            qb_bias_from_top(pooled["top_margins"], pooled["tokens"], bias, k),
            quantile_balance_update(everything, bias, k, cutoff="per_expert"))

  pooled, whole, new, expected = run(parts, everything)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               pooled, whole)
  np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))


def test_balance_update_of_plain_and_stacked_layers():
  """`balance_update` walks the 'moe_state' tree: a plain layer's bias [E] and a scanned group's
  [G, E] each get their own layer's update (histogram QB; loss-free from the pooled load), and a
  layer without statistics keeps its bias."""
  experts, k, bins = 8, 2, 64
  rng = np.random.default_rng(12)
  biases = [jnp.asarray(0.1 * rng.normal(size=experts), jnp.float32) for _ in range(4)]
  scores = [_skewed_scores(30 + i, 40, _skew(31 + i, experts, 1.0)) for i in range(3)]
  state = {"layer_1": {"moe": {"bias": biases[0]}},
           "scan": {"layer_2": {"moe": {"bias": jnp.stack(biases[1:3])}}},
           "layer_9": {"moe": {"bias": biases[3]}}}
  cfg = _cfg(moe_num_experts=experts, moe_top_k=k, moe_qb_histogram_bins=bins)
  hist = [dict(zip(("counts", "tokens"), qb_histogram(s, b, k, bins=bins, cutoff="per_expert")))
          for s, b in zip(scores, biases)]
  stats = {"layer_1": {"moe": hist[0]},
           "scan": {"layer_2": {"moe": jax.tree.map(lambda *x: jnp.stack(x), *hist[1:])}}}
  new = jax.jit(balance_update, static_argnums=0)(cfg, state, stats)
  assert jax.tree.structure(new) == jax.tree.structure(state)
  expected = [qb_bias_from_histogram(h["counts"], h["tokens"], b, k, cfg.moe_qb_rate)
              for h, b in zip(hist, biases)]
  np.testing.assert_allclose(np.asarray(new["layer_1"]["moe"]["bias"]), np.asarray(expected[0]),
                             atol=1e-7)
  np.testing.assert_allclose(np.asarray(new["scan"]["layer_2"]["moe"]["bias"]),
                             np.stack(expected[1:]), atol=1e-7)
  np.testing.assert_array_equal(np.asarray(new["layer_9"]["moe"]["bias"]), np.asarray(biases[3]))
  lf = dataclasses.replace(cfg, moe_balance="loss_free")
  load = jnp.array([5, 1, 3, 3, 3, 3, 3, 3], jnp.int32)
  new = balance_update(lf, {"moe": {"bias": biases[0]}}, {"moe": {"load": load}})
  np.testing.assert_array_equal(np.asarray(new["moe"]["bias"]),
                                np.asarray(loss_free_bias_update(load, biases[0], 1e-3)))


# -------------------------------------------------------------------------------------- baselines

def test_loss_free_moves_bias_toward_balance():
  load = jnp.array([10.0, 2.0, 6.0, 6.0])       # mean 6
  new = loss_free_bias_update(load, jnp.array([0.0, 0.0, 0.5, -0.5]), rate=0.01)
  np.testing.assert_allclose(np.asarray(new), [-0.01, 0.01, 0.5, -0.5])
  # and it does reduce the overload on a batch
  s = _skewed_scores(7, 1024, np.linspace(-1, 1, 16))
  bias = jnp.zeros(16)
  first = float(max_violation(_load(s, bias, 2)))
  for _ in range(200):
    bias = loss_free_bias_update(_load(s, bias, 2), bias, 1e-3)
  assert float(max_violation(_load(s, bias, 2))) < 0.5 * first


def test_aux_loss_closed_form():
  scores = jnp.array([[0.8, 0.4, 0.2, 0.6],
                      [0.1, 0.9, 0.5, 0.5],
                      [0.3, 0.3, 0.7, 0.7],
                      [0.5, 0.5, 0.5, 0.5]])
  idx = jnp.array([[0, 3], [1, 2], [2, 3], [0, 1]])
  mask = jnp.array([True, True, True, False])
  # Valid tokens 0..2, k = 2: counts (1, 1, 2, 2) / 6. Normalised scores per token:
  #   t0 (.8 .4 .2 .6)/2, t1 (.1 .9 .5 .5)/2, t2 (.3 .3 .7 .7)/2 → P = (1.2, 1.6, 1.4, 1.8)/6.
  f = np.array([1, 1, 2, 2]) / 6
  p = np.array([1.2, 1.6, 1.4, 1.8]) / 6
  np.testing.assert_allclose(float(aux_balance_loss(scores, idx, mask, 4)), 4 * np.sum(f * p),
                             rtol=1e-6)
  # 1 at perfect balance with uniform scores
  uniform = aux_balance_loss(jnp.full((4, 4), 0.5), jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]]),
                             None, 4)
  np.testing.assert_allclose(float(uniform), 1.0, rtol=1e-6)
  # its gradient moves the scores away from the overloaded experts
  g = jax.grad(lambda s: aux_balance_loss(s, idx, mask, 4))(scores)
  assert float(g[0, 3]) > float(g[0, 0])


def test_max_violation():
  np.testing.assert_allclose(float(max_violation(jnp.array([1.0, 2.0, 3.0, 6.0]))), 1.0)
  assert float(max_violation(jnp.zeros(4))) == 0.0
