"""The whole K3 decoder: parameter counts, AttnRes ≡ PreNorm at init, packing, causality, gradients."""

import dataclasses
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax.model import K3Model, count_params, init_variables
from testlib import error_ratio

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "gin_configs")


def tiny_cfg(**overrides) -> config_lib.ModelConfig:
  base = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")]).model
  cfg = dataclasses.replace(base, kda_chunk_size=16, **overrides)
  cfg.validate()
  return cfg


@functools.lru_cache(maxsize=None)
def tiny_variables(cfg: config_lib.ModelConfig) -> dict:
  """Unboxed variables of K3Model(cfg) from PRNGKey(0), compiled once per config (the values of
  `model.init`, test_init_variables_equals_model_init; they do not depend on the token shape)."""
  init = jax.jit(init_variables, static_argnums=(0, 2, 3))
  return nn.meta.unbox(init(cfg, jax.random.PRNGKey(0), 1, 8))


def test_published_parameter_counts():
  k3 = config_lib.from_gin([os.path.join(GIN_DIR, "k3.gin")]).model
  total, active = count_params(k3)
  assert abs(total / 2.8e12 - 1) < 0.03, total
  assert abs(active / 104e9 - 1) < 0.03, active
  kl = config_lib.from_gin([os.path.join(GIN_DIR, "kimi_linear_48b.gin")]).model
  total, active = count_params(kl)
  assert abs(total / 48e9 - 1) < 0.04, total
  assert abs(active / 3e9 - 1) < 0.03, active


def test_attnres_with_zero_queries_equals_prenorm_residual_network():
  cfg = tiny_cfg()
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  variables = tiny_variables(cfg)
  logits_attnres = K3Model(cfg).apply(variables, tokens)

  def drop_mix(tree):
    if isinstance(tree, dict):
      return {k: drop_mix(v) for k, v in tree.items() if "mix" not in k}
    return tree
  plain_vars = {**variables, "params": drop_mix(variables["params"])}
  logits_plain = K3Model(dataclasses.replace(cfg, attnres=False)).apply(plain_vars, tokens)
  # Only the RMSNorm epsilon differs: the mean of the sources is the residual sum / n.
  assert error_ratio(logits_attnres, logits_plain) < 1e-3
  assert not np.allclose(logits_attnres, 0.0)


def test_packed_documents_equal_separate_runs():
  cfg = tiny_cfg()
  rng = jax.random.PRNGKey(2)
  a = jax.random.randint(rng, (1, 23), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.fold_in(rng, 1), (1, 18), 0, cfg.vocab_size)
  packed = jnp.concatenate([a, b], axis=1)
  seg = jnp.concatenate([jnp.ones((1, 23), jnp.int32), 2 * jnp.ones((1, 18), jnp.int32)], axis=1)
  apply = jax.jit(K3Model(cfg).apply)
  variables = tiny_variables(cfg)
  out_packed = apply(variables, packed, seg)
  out_a = apply(variables, a)
  out_b = apply(variables, b)
  np.testing.assert_allclose(out_packed[:, :23], out_a, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(out_packed[:, 23:], out_b, rtol=2e-4, atol=2e-4)


def test_model_is_causal():
  cfg = tiny_cfg()
  tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 48), 0, cfg.vocab_size)
  changed = tokens.at[:, 30:].set((tokens[:, 30:] + 7) % cfg.vocab_size)
  model = K3Model(cfg)
  variables = tiny_variables(cfg)
  a, b = model.apply(variables, tokens), model.apply(variables, changed)
  np.testing.assert_allclose(a[:, :30], b[:, :30], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[:, 30:], b[:, 30:])


@pytest.mark.parametrize("balance", ["quantile", "aux_loss"])
def test_tiny_model_gradient_is_finite_and_nonzero(balance):
  cfg = tiny_cfg(moe_balance=balance)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 33), 0, cfg.vocab_size)
  model = K3Model(cfg)
  variables = tiny_variables(cfg)

  def loss_fn(params):
    logits, _ = model.apply({**variables, "params": params}, tokens[:, :-1], update_balance=True,
                            mutable=["moe_state", "moe_stats"])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables["params"])
  leaves = jax.tree_util.tree_leaves(grads)
  assert np.isfinite(float(loss))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert sum(float(jnp.sum(jnp.abs(g))) > 0 for g in leaves) > 0.9 * len(leaves)


def test_init_variables_has_moe_state_per_moe_layer():
  cfg = tiny_cfg()
  variables = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), 1, 8))
  n_moe = sum(cfg.layer_uses_moe(i) for i in range(cfg.num_layers))
  biases = jax.tree_util.tree_leaves(variables["moe_state"])
  assert len(biases) == n_moe and all(b.shape == (cfg.moe_num_experts,) for b in biases)


def test_remat_keeps_parameters_loss_gradients_and_balance_updates():
  """ModelConfig.remat changes what the backward keeps, nothing else: the same parameter tree
  (checkpoints stay compatible), and the loss, gradients and QB bias updates of remat='none'."""
  base = tiny_cfg(num_layers=2, mla_every=1)  # MLA + dense, MLA + MoE: the wrapping is per layer
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 33), 0, base.vocab_size)
  segments = jnp.ones((2, 32), jnp.int32).at[1, 20:].set(2)

  def run(cfg):
    model = K3Model(cfg)
    variables = tiny_variables(cfg)

    def loss_fn(params):
      logits, mutated = model.apply({**variables, "params": params}, tokens[:, :-1], segments,
                                    update_balance=True, mutable=["moe_state", "moe_stats"])
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), mutated

    (loss, mutated), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        variables["params"])
    return variables, loss, grads, mutated["moe_state"]

  ref_vars, ref_loss, ref_grads, ref_state = run(base)
  for remat in ("full", "dots"):
    variables, loss, grads, state = run(dataclasses.replace(base, remat=remat))
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(ref_vars)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), variables, ref_vars)
    assert error_ratio(loss, ref_loss) <= 1e-6, remat
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                                jax.tree_util.tree_leaves(ref_grads)):
      assert error_ratio(g, g_ref) <= 1e-5, (remat, jax.tree_util.keystr(path))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), state,
                 ref_state)
  assert any(float(jnp.abs(b).max()) > 0 for b in jax.tree_util.tree_leaves(state))


def test_remat_policy_is_validated():
  with pytest.raises(config_lib.ConfigError, match="ModelConfig.remat"):
    dataclasses.replace(tiny_cfg(), remat="layer").validate()


def test_init_variables_equals_model_init():
  """init_variables (lazy_init: initialisers only) gives model.init's params and QB biases, and
  the decode cache with decode=True."""
  cfg = tiny_cfg(num_layers=2, mla_every=2)
  rng = jax.random.PRNGKey(7)
  full = jax.jit(lambda r: K3Model(cfg).init(r, jnp.zeros((2, 16), jnp.int32)))(rng)
  lazy = jax.jit(lambda r: init_variables(cfg, r, 2, 16))(rng)
  assert sorted(lazy) == ["moe_state", "params"]
  for name in lazy:
    assert jax.tree_util.tree_structure(lazy[name]) == jax.tree_util.tree_structure(full[name])
    jax.tree.map(np.testing.assert_array_equal, lazy[name], full[name])
  decode = jax.eval_shape(lambda: init_variables(cfg, rng, 2, 16, decode=True))
  assert sorted(decode) == ["cache", "moe_state", "params"]
