"""The whole K3 decoder: parameter counts, AttnRes ≡ PreNorm at init, packing, causality, gradients."""

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax.config import ImplConfig
from k3jax.layers.moe import BALANCE_COLLECTION, balance_update
from k3jax.model import K3Model, count_params, init_variables, layer_plan
from k3jax.model import scanned_to_unrolled, to_layout, unrolled_to_scanned
from k3jax.model.stats import moe_stats_by_layer
from k3jax.training import optim as optim_lib
from testlib import error_ratio, random_variables, tiny_variables

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "gin_configs")


def tiny_cfg(**overrides) -> config_lib.ModelConfig:
  base = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")]).model
  cfg = dataclasses.replace(base, kda_chunk_size=16, **overrides)
  cfg.validate()
  return cfg


def test_published_parameter_counts():
  k3 = config_lib.from_gin([os.path.join(GIN_DIR, "k3.gin")]).model
  total, active = count_params(k3)
  assert abs(total / 2.8e12 - 1) < 0.03, total
  assert abs(active / 104e9 - 1) < 0.03, active
  kl = config_lib.from_gin([os.path.join(GIN_DIR, "kimi_linear_48b.gin")]).model
  total, active = count_params(kl)
  # transformers' KimiLinearForCausalLM with the release's config.json counts exactly this many.
  assert total == 49_122_675_072, total
  assert abs(active / 3e9 - 1) < 0.1, active


def test_attnres_with_zero_queries_equals_prenorm_residual_network():
  cfg = tiny_cfg()
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  variables = tiny_variables(cfg)
  logits_attnres = jax.jit(K3Model(cfg).apply)(variables, tokens)

  def drop_mix(tree):
    if isinstance(tree, dict):
      return {k: drop_mix(v) for k, v in tree.items() if "mix" not in k}
    return tree
  plain_vars = {**variables, "params": drop_mix(variables["params"])}
  logits_plain = jax.jit(K3Model(dataclasses.replace(cfg, attnres=False)).apply)(plain_vars,
                                                                                 tokens)
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
  apply = jax.jit(K3Model(cfg).apply)
  variables = tiny_variables(cfg)
  a, b = apply(variables, tokens), apply(variables, changed)
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
  # Checked on host: eager jnp reductions would compile a program per leaf shape.
  leaves = jax.tree_util.tree_leaves(jax.device_get(grads))
  assert np.isfinite(float(loss))
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert sum(float(np.sum(np.abs(g))) > 0 for g in leaves) > 0.9 * len(leaves)


def test_init_variables_has_moe_state_per_moe_layer():
  cfg = tiny_cfg()
  variables = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), 1, 8))
  n_moe = sum(cfg.layer_uses_moe(i) for i in range(cfg.num_layers))
  biases = jax.tree_util.tree_leaves(variables["moe_state"])
  assert len(biases) == n_moe and all(b.shape == (cfg.moe_num_experts,) for b in biases)


def test_remat_keeps_parameters_loss_gradients_and_balance_updates():
  """ImplConfig.remat changes what the backward keeps, nothing else: the same parameter tree
  (checkpoints stay compatible), and the loss, gradients, QB statistics and the bias updates
  from them of remat='none'."""
  base = tiny_cfg(num_layers=2, mla_every=1)  # MLA + dense, MLA + MoE: the wrapping is per layer
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 33), 0, base.vocab_size)
  segments = jnp.ones((2, 32), jnp.int32).at[1, 20:].set(2)

  def run(impl):
    model = K3Model(base, impl)
    variables = tiny_variables(base, impl)

    def loss_fn(params):
      logits, mutated = model.apply({**variables, "params": params}, tokens[:, :-1], segments,
                                    update_balance=True, mutable=["moe_stats", BALANCE_COLLECTION])
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), mutated

    (loss, mutated), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        variables["params"])
    balance = mutated[BALANCE_COLLECTION]
    return variables, loss, grads, (balance, balance_update(base, variables["moe_state"], balance))

  ref_vars, ref_loss, ref_grads, ref_state = run(ImplConfig())
  for remat in ("full", "dots"):
    variables, loss, grads, state = run(ImplConfig(remat=remat))
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(ref_vars)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), variables, ref_vars)
    assert error_ratio(loss, ref_loss) <= 1e-6, remat
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                                jax.tree_util.tree_leaves(ref_grads)):
      assert error_ratio(g, g_ref) <= 1e-5, (remat, jax.tree_util.keystr(path))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state[0], ref_state[0])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), state[1],
                 ref_state[1])
  assert any(float(jnp.abs(b).max()) > 0 for b in jax.tree_util.tree_leaves(state[1]))


def test_remat_policy_is_validated():
  with pytest.raises(config_lib.ConfigError, match=r"ImplConfig\.remat"):
    ImplConfig(remat="layer").validate()


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


# ------------------------------------------------------------------------------------------------
# The decoder as a scan (ImplConfig.scan_layers) against the unrolled loop
# ------------------------------------------------------------------------------------------------

def scan_cfg(**overrides) -> config_lib.ModelConfig:
  """By default 7 layers, mla_every 2, AttnRes blocks of 2, one dense layer: prefix layer 0, two
  scanned groups (1, 2), (3, 4) (KDA, MLA; a block boundary at the MLA), then layer 5 and the final
  MLA layer 6 after them. (mla_every 4 as in tiny.gin needs 10 layers for two groups: slower.)"""
  base = dict(num_layers=7, mla_every=2, attnres_block_size=2, d_model=32, kda_head_dim=16, kda_value_dim=16, mla_qk_nope_dim=16,
              mla_v_dim=16, mla_kv_lora_rank=16, dense_ffn_dim=32, moe_latent_dim=16,
              moe_expert_dim=16, moe_shared_dim=16)
  return tiny_cfg(**{**base, **overrides})


def test_layer_plan():
  small_run = config_lib.from_gin([os.path.join(GIN_DIR, "small.gin")])
  small = small_run.model
  # small.gin runs its 12 layers unrolled
  assert layer_plan(small, small_run.impl.scan_layers).num_groups == 0
  plan = layer_plan(small)      # scan_layers=True by default
  assert plan == layer_plan(small, True)
  assert (plan.prefix, plan.start, plan.period, plan.num_groups, plan.suffix) == \
      ((0,), 1, 4, 2, (9, 10, 11))
  assert layer_plan(dataclasses.replace(small, num_layers=24)).num_groups == 5
  assert layer_plan(small, scan_layers=False).prefix == tuple(range(12))
  plan = layer_plan(scan_cfg())
  assert (plan.prefix, plan.group_layers, plan.num_groups, plan.suffix) == \
      ((0,), (1, 2), 2, (5, 6))
  plan = layer_plan(scan_cfg(num_layers=10, mla_every=4))
  assert (plan.prefix, plan.group_layers, plan.num_groups, plan.suffix) == \
      ((0,), (1, 2, 3, 4), 2, (9,))
  assert layer_plan(scan_cfg(num_layers=20, mla_every=4, attnres_block_size=8)).period == 8
  assert layer_plan(scan_cfg(num_layers=10, mla_every=4, attnres_block_size=8)).num_groups == 0
  assert layer_plan(scan_cfg(attnres=False, attnres_block_size=3)).period == 2
  # tiny.gin (4 layers) has no two whole groups: its model is the loop's, whatever scan_layers.
  assert layer_plan(tiny_cfg()).num_groups == 0
  shapes = lambda cfg, impl=ImplConfig(): jax.tree.map(jnp.shape, jax.eval_shape(
      lambda: nn.meta.unbox(init_variables(cfg, jax.random.PRNGKey(0), impl=impl))))
  assert shapes(tiny_cfg()) == shapes(tiny_cfg(), ImplConfig(scan_layers=False))
  # Every scanned group has the first group's kinds, dense/MoE choice and AttnRes boundaries.
  for cfg in (small, scan_cfg(), dataclasses.replace(small, num_layers=23)):
    plan = layer_plan(cfg)
    signature = lambda i: (cfg.layer_kind(i), cfg.layer_uses_moe(i),
                           i % cfg.attnres_block_size == 0)
    for layer in plan.scanned_layers:
      first = plan.start + (layer - plan.start) % plan.period
      assert signature(layer) == signature(first), (cfg.num_layers, layer)


def test_scan_layers_is_validated():
  with pytest.raises(config_lib.ConfigError, match=r"ImplConfig\.scan_layers"):
    ImplConfig(scan_layers="yes").validate()


def _loss_and_grads(cfg, impl, variables, tokens, segments):
  model = K3Model(cfg, impl)

  def loss_fn(params):
    logits, mutated = model.apply({**variables, "params": params}, tokens[:, :-1], segments,
                                  update_balance=True, mutable=["moe_stats", BALANCE_COLLECTION])
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return loss, (logits, mutated)

  (loss, (logits, mutated)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      variables["params"])
  mutated = dict(mutated, moe_state=balance_update(cfg, variables["moe_state"],
                                                   mutated[BALANCE_COLLECTION]))
  return loss, logits, grads, mutated


def test_scan_equals_loop():
  """Logits, loss, gradients, QB bias updates and per-layer MoE stats of the scanned decoder equal
  the unrolled loop's, given the loop's variables converted with `unrolled_to_scanned`. (The
  exact QB statistic, whose margins compare to fp32 rounding: a histogram count can move to the
  next bin with it. AttnRes
  and KDA in the scan; 'full' remat inside the scan trains in
  test_train_steps_of_scan_equal_the_loop, the PreNorm stream's scan is
  test_prenorm_scan_equals_loop.)"""
  cfg = scan_cfg(moe_qb_histogram_bins=0)
  loop_impl = ImplConfig(scan_layers=False)
  loop_vars = random_variables(cfg, loop_impl, seed=3)
  # In one program: eagerly, each stacked leaf shape would compile its own concatenation.
  scan_vars = jax.jit(unrolled_to_scanned, static_argnums=1)(loop_vars, cfg)
  abstract = jax.eval_shape(lambda: nn.meta.unbox(init_variables(cfg, jax.random.PRNGKey(0))))
  assert jax.tree.structure(scan_vars) == jax.tree.structure(abstract)
  assert jax.tree.map(jnp.shape, scan_vars) == jax.tree.map(jnp.shape, abstract)

  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 17), 0, cfg.vocab_size)
  segments = jnp.ones((2, 16), jnp.int32).at[1, 10:].set(2).at[0, 13:].set(0)
  # Compared on host (numpy): eager slicing of the stacked leaves and eager per-leaf reductions
  # would compile a program per leaf shape.
  ref_loss, ref_logits, ref_grads, ref_mut = jax.device_get(
      _loss_and_grads(cfg, loop_impl, loop_vars, tokens, segments))
  loss, logits, grads, mutated = jax.device_get(
      _loss_and_grads(cfg, ImplConfig(), scan_vars, tokens, segments))

  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  grads = scanned_to_unrolled(grads)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree_util.tree_leaves(ref_grads)):
    assert float(np.max(np.abs(g - g_ref))) <= 1e-5 * max(1.0, float(np.max(np.abs(g_ref)))), \
        jax.tree_util.keystr(path)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               scanned_to_unrolled(mutated["moe_state"]), ref_mut["moe_state"])
  stats, ref_stats = moe_stats_by_layer(mutated["moe_stats"]), moe_stats_by_layer(
      ref_mut["moe_stats"])
  assert list(stats) == list(ref_stats) == [f"layer_{i}/moe" for i in range(1, cfg.num_layers)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), stats,
               ref_stats)


def test_prenorm_scan_equals_loop():
  """Without AttnRes the scan carries the plain residual stream: the scanned decoder's logits, QB
  bias updates and MoE stats equal the loop's (the forward; its backward is a residual add's,
  and the scan's backward is checked with AttnRes above and in training below)."""
  cfg = scan_cfg(attnres=False, moe_qb_histogram_bins=0)
  loop_impl = ImplConfig(scan_layers=False)
  assert layer_plan(cfg).num_groups == 2
  loop_vars = random_variables(cfg, loop_impl, seed=4)
  scan_vars = jax.jit(unrolled_to_scanned, static_argnums=1)(loop_vars, cfg)   # one program
  tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 16), 0, cfg.vocab_size)
  segments = jnp.ones((2, 16), jnp.int32).at[1, 9:].set(2)

  def forward(impl, variables):
    def apply(v):
      logits, mutated = K3Model(cfg, impl).apply(
          v, tokens, segments, update_balance=True, mutable=["moe_stats", BALANCE_COLLECTION])
      return logits, dict(mutated, moe_state=balance_update(cfg, v["moe_state"],
                                                            mutated[BALANCE_COLLECTION]))
    return jax.jit(apply)(variables)
  # On host: the stacked outputs are then split without an eager program per leaf shape.
  ref_logits, ref_mut = jax.device_get(forward(loop_impl, loop_vars))
  logits, mutated = jax.device_get(forward(ImplConfig(), scan_vars))
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               scanned_to_unrolled(mutated["moe_state"]), ref_mut["moe_state"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               moe_stats_by_layer(mutated["moe_stats"]), moe_stats_by_layer(ref_mut["moe_stats"]))


def test_layout_converters_round_trip_and_reject_partial_trees():
  cfg = scan_cfg(num_layers=10, mla_every=4)
  params = jax.eval_shape(lambda: nn.meta.unbox(init_variables(
      cfg, jax.random.PRNGKey(0), impl=ImplConfig(scan_layers=False))))["params"]
  params = jax.tree.map(lambda s: np.arange(np.prod(s.shape), dtype=np.float32).reshape(s.shape)
                        + hash(s.shape) % 97, params)
  scanned = unrolled_to_scanned(params, cfg)
  assert sorted(k for k in scanned if k.startswith("layer_")) == ["layer_0", "layer_9"]
  np.testing.assert_array_equal(scanned["scanned_period_4"]["layer_2"]["kda"]["q_proj"][1],
                                params["layer_6"]["kda"]["q_proj"])
  back = scanned_to_unrolled(scanned)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  # Inside optimizer-state NamedTuples too, and untouched without a scan.
  import optax
  opt_state = optax.adam(1e-3).init(params)
  converted = unrolled_to_scanned(opt_state, cfg)
  assert jax.tree.structure(converted[0].mu) == jax.tree.structure(scanned)
  assert unrolled_to_scanned(params, tiny_cfg()) is params    # tiny.gin: no two whole groups
  # to_layout: either layout into either; a tree already in the target layout keeps its arrays.
  jax.tree.map(np.testing.assert_array_equal, to_layout(scanned, cfg, False), params)
  jax.tree.map(np.testing.assert_array_equal, to_layout(params, cfg, True), scanned)
  assert to_layout(scanned, cfg, True) is scanned and to_layout(params, cfg, False) is params
  broken = {k: v for k, v in params.items() if k != "layer_5"}
  with pytest.raises(ValueError, match="layer_5"):
    unrolled_to_scanned(broken, cfg)


def test_count_params_accepts_the_run_config_and_ignores_the_layout():
  run_cfg = config_lib.from_gin([os.path.join(GIN_DIR, "small.gin")])
  assert not run_cfg.impl.scan_layers     # small.gin's decoder is unrolled: compare the scan
  assert count_params(run_cfg) == count_params(run_cfg.model)
  assert count_params(run_cfg) == count_params(dataclasses.replace(
      run_cfg, impl=dataclasses.replace(run_cfg.impl, scan_layers=True)))
  with pytest.raises(TypeError, match="ModelConfig or a Config"):
    count_params({"d_model": 64})


def _run_train_steps(cfg: config_lib.Config, state, mesh_spec: str, batches: list):
  """Losses and final state of `cfg`'s training step over `batches`, from `state` (host arrays),
  on one device or on the mesh `mesh_spec` (state placed with `sharding.state_shardings`)."""
  from k3jax.parallel import sharding as sharding_lib
  from k3jax import training as train_lib
  abstract_vars = jax.eval_shape(lambda: init_variables(cfg.model, jax.random.PRNGKey(0), 1, 16,
                                                        impl=cfg.impl))
  optimizer, schedule = optim_lib.make_optimizer(cfg.optimizer, cfg.stages.total_steps,
                                                 optim_lib.logical_axes(abstract_vars["params"]))
  model = K3Model(cfg.model, cfg.stage_impl(0))
  if not mesh_spec:
    step = train_lib.make_train_step(cfg, model, optimizer, schedule)
    losses = []
    for batch in batches:
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
    return losses, state
  mesh = sharding_lib.make_mesh(mesh_spec)
  state, state_sh = sharding_lib.shard_train_state(state, abstract_vars, mesh)
  step = train_lib.make_train_step(cfg, model, optimizer, schedule, state_shardings=state_sh,
                                   batch_shardings=sharding_lib.batch_sharding(mesh))
  losses = []
  with sharding_lib.with_mesh(mesh):
    for batch in batches:
      state, m = step(state, sharding_lib.shard_batch(batch, mesh))
      losses.append(float(m["loss"]))
  return losses, state


@pytest.mark.slow
def test_train_steps_of_scan_equal_the_loop():
  """Three training steps of the scanned model on an 8-device expert mesh, with Muon, QK-Clip,
  two micro-batches a step and 'full' remat, from the loop's initial state converted with
  `unrolled_to_scanned` (params, optimizer state, QB biases), have the loop's losses on the same
  mesh, and end in the loop's state."""
  from k3jax import training as train_lib
  from k3jax.cli import config_from_flags
  from testlib import TINY_RUN_BINDINGS
  mesh_spec = "expert:8"
  cfg = config_from_flags([], TINY_RUN_BINDINGS + [
      "ModelConfig.num_layers = 5", "ModelConfig.mla_every = 1", "ModelConfig.moe_num_experts = 8",
      "ImplConfig.remat = 'full'", "OptimizerConfig.name = 'muon'",
      "OptimizerConfig.qk_clip_tau = 2.0", "StagesConfig.microbatch_tokens = 64",
      "StagesConfig.tokens_per_step = 128", "StagesConfig.stages = ((16, 3),)"])
  # All layers MLA (KDA's chunked scan would dominate the compile time; test_scan_equals_loop has
  # KDA in the scan): layer 0 dense, then layers (1, 2), (3, 4) scanned.
  assert cfg.impl.scan_layers and layer_plan(cfg.model, cfg.impl.scan_layers).num_groups == 2
  loop_cfg = dataclasses.replace(cfg, impl=dataclasses.replace(cfg.impl, scan_layers=False))
  loop_state, _, _ = train_lib.init_train_state(loop_cfg, cfg.stages.total_steps)
  loop_state = jax.device_get(loop_state)
  # The three trees converted in one program: eagerly, each stacked leaf shape would compile its
  # own concatenation.
  params, opt_state, moe_state = jax.jit(lambda trees: [
      unrolled_to_scanned(tree, cfg.model) for tree in trees])(
          (loop_state.params, loop_state.opt_state, loop_state.moe_state))
  scan_state = loop_state.replace(params=params, opt_state=opt_state, moe_state=moe_state)
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(3):
    tokens = rng.integers(0, cfg.model.vocab_size, (8, 17)).astype(np.int32)
    seg = np.ones((8, 16), np.int32)
    seg[::2, 9:] = 2
    batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
                    "loss_mask": np.ones((8, 16), np.float32)})
  ref_losses, ref_state = _run_train_steps(loop_cfg, loop_state, mesh_spec, batches)
  losses, state = _run_train_steps(cfg, scan_state, mesh_spec, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
  assert ref_losses[-1] < ref_losses[0]
  for name in ("params", "moe_state"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 scanned_to_unrolled(jax.device_get(getattr(state, name))),
                 jax.device_get(getattr(ref_state, name)))
