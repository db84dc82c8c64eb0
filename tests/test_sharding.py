"""Mesh construction, the logical rule table, sharded training math and cross-mesh checkpoints.

Runs on the 8 virtual CPU devices of tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers.moe import BALANCE_COLLECTION, balance_update
from k3jax.model import K3Model
from k3jax.model.stats import moe_stats_by_layer
from k3jax.ops import moe_ep
from k3jax.parallel import distributed, sharding
from k3jax.ops.moe import routed_experts
from testlib import error_ratio as _error_ratio

B, T = 8, 32
TINY = ModelConfig(vocab_size=64, d_model=32, num_layers=4, moe_num_experts=8, moe_top_k=2,
                   kda_chunk_size=16)


# ------------------------------------------------------------------------------------------------
# make_mesh


def test_make_mesh_shapes():
  shape = lambda spec, **kw: dict(sharding.make_mesh(spec, **kw).shape)
  assert shape("") == {"data": 8, "context": 1, "expert": 1}
  assert shape("data:2,expert:4") == {"data": 2, "context": 1, "expert": 4}
  assert shape("expert:8") == {"data": 1, "context": 1, "expert": 8}
  assert shape("context:2,data:2,expert:2") == {"data": 2, "context": 2, "expert": 2}
  mesh = sharding.make_mesh("expert:4,data:2")
  assert mesh.axis_names == ("data", "context", "expert")   # fixed whatever the flag's order
  two = sharding.make_mesh("expert:2", devices=jax.devices()[:2])
  assert dict(two.shape) == {"data": 1, "context": 1, "expert": 2}
  assert set(two.devices.flat) == set(jax.devices()[:2])
  assert shape("", devices=jax.devices()[:2]) == {"data": 2, "context": 1, "expert": 1}


@pytest.mark.parametrize("flag,match", [
    ("data:3", r"'data:3'.*multiply to 3.*8 devices"),
    ("data:2,expert:2", r"'data:2,expert:2'.*multiply to 4.*8 devices"),
    ("data:16", r"multiply to 16.*8 devices"),
    ("model:8", r"'model:8'.*bad entry"),
    ("data:0,expert:8", r"bad entry 'data:0'"),
    ("data:two", r"bad entry"),
    ("data:2,data:4", r"'data' given twice"),
])
def test_make_mesh_errors(flag, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(flag)


# ------------------------------------------------------------------------------------------------
# Rule table


def _abstract_variables(cfg=TINY):
  return jax.eval_shape(lambda: K3Model(cfg).init(jax.random.PRNGKey(0),
                                                  jnp.zeros((B, T), jnp.int32)))


def _specs(shardings):
  return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def test_rule_table_partition_specs():
  abstract = _abstract_variables()
  mesh = sharding.make_mesh("data:2,expert:4")
  specs = _specs(sharding.param_shardings(abstract, mesh))
  moe = specs["params"]["layer_1"]["moe"]
  assert moe["w_gate"] == P("expert", None, None)
  assert moe["w_out"] == P("expert", None, None)
  assert moe["down"]["kernel"] == P(None, None)
  assert specs["params"]["embedding"] == P(None, None)
  assert specs["params"]["layer_3"]["mla"]["wq"] == P(None, None, None)
  assert specs["moe_state"]["layer_1"]["moe"]["bias"] == P()       # unboxed: replicated
  # FSDP: 'embed' over both batch axes, the experts' 'latent' over 'data'.
  fsdp = _specs(sharding.param_shardings(abstract, mesh, sharding.logical_axis_rules(fsdp=True)))
  moe = fsdp["params"]["layer_1"]["moe"]
  assert fsdp["params"]["embedding"] == P(None, ("data", "expert"))
  assert fsdp["params"]["lm_head"] == P(("data", "expert"), None)
  assert moe["w_gate"] == P("expert", "data", None)
  assert moe["w_out"] == P("expert", None, "data")
  assert moe["down"]["kernel"] == P(("data", "expert"), None)
  assert fsdp["params"]["layer_0"]["ffn"]["out"]["kernel"] == P(None, ("data", "expert"))
  # Activations.
  rules = sharding.LOGICAL_AXIS_RULES
  assert nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"),
                                 rules) == P(("data", "expert"), "context", None)
  assert nn.logical_to_mesh_axes(("activation_exp", None), rules) == P("expert", None)


def test_every_model_axis_name_has_a_rule():
  names = set()
  is_box = lambda x: isinstance(x, nn.Partitioned)
  for leaf in jax.tree.leaves(_abstract_variables(), is_leaf=is_box):
    if isinstance(leaf, nn.Partitioned):
      names.update(n for n in leaf.names if n is not None)
  assert names <= sharding.KNOWN_LOGICAL_NAMES, names - sharding.KNOWN_LOGICAL_NAMES


def test_param_shardings_errors():
  mesh = sharding.make_mesh("data:2,expert:4")
  bad_name = {"params": {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
                                                      ("expertz", None))}}
  with pytest.raises(ValueError, match="params/w.*'expertz'"):
    sharding.param_shardings(bad_name, mesh)
  indivisible = {"params": {"w": nn.LogicallyPartitioned(
      jax.ShapeDtypeStruct((6, 4), jnp.float32), ("expert", "mlp"))}}
  with pytest.raises(ValueError, match=r"params/w of shape \(6, 4\).*size 6.*size 4"):
    sharding.param_shardings(indivisible, mesh)


def test_state_shardings_cover_optimizer_state():
  abstract = _abstract_variables()
  mesh = sharding.make_mesh("expert:8")
  params = nn.meta.unbox(abstract)["params"]
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
           "opt_state": jax.eval_shape(opt.init, params),
           "moe_state": nn.meta.unbox(abstract)["moe_state"]}
  specs = _specs(sharding.state_shardings(state, abstract, mesh))
  adam = specs["opt_state"][1][0]
  assert specs["params"]["layer_2"]["moe"]["w_up"] == P("expert", None, None)
  assert adam.mu["layer_2"]["moe"]["w_up"] == P("expert", None, None)
  assert adam.nu["layer_2"]["moe"]["w_out"] == P("expert", None, None)
  assert adam.mu["embedding"] == P(None, None)
  assert adam.count == P()
  assert specs["step"] == P()
  assert specs["moe_state"]["layer_2"]["moe"]["bias"] == P()


def test_shard_batch():
  mesh = sharding.make_mesh("data:2,expert:4")
  batch = sharding.shard_batch({"inputs": np.zeros((8, 4), np.int32)}, mesh)
  assert batch["inputs"].sharding.spec == P(("data", "expert"))
  assert len(batch["inputs"].addressable_shards) == 8
  with pytest.raises(ValueError, match=r"batch\['inputs'\].*6.*8 devices"):
    sharding.shard_batch({"inputs": np.zeros((6, 4), np.int32)}, mesh)


# ------------------------------------------------------------------------------------------------
# The tiny model: loss, gradients and the QB bias update under meshes equal the single-device ones


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, TINY.vocab_size, (B, T + 1)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[:, T // 2:] = 2                     # two documents per row
  seg[::3, -5:] = 0                       # and some padding
  loss_mask = ((seg != 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
  loss_mask[:, -1] = seg[:, -1] != 0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "loss_mask": loss_mask}


def _loss_fn(model):
  """(params, moe_state, batch) -> ((loss, (the sown balance statistics, moe_stats)), grads)."""
  def loss(params, moe_state, batch):
    logits, mutated = model.apply({"params": params, "moe_state": moe_state}, batch["inputs"],
                                  batch["segment_ids"], update_balance=True,
                                  mutable=["moe_stats", BALANCE_COLLECTION])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    ce = jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])
    return ce, (mutated[BALANCE_COLLECTION], mutated["moe_stats"])
  return jax.value_and_grad(loss, has_aux=True)


def _random_variables(abstract, seed):
  """Random values for every variable, without compiling `model.init`.

  Scales are 1 + N(0, 0.02²), everything else N(0, 0.02²) (init_std), including the normally
  zero-initialised DepthMix queries (whose gradients at zero are sums of cancelling terms, too
  ill-conditioned for a 1e-5 comparison) and the balance bias (so that routing depends on it).
  """
  rng = np.random.default_rng(seed)

  def value(box):
    leaf = box.value if isinstance(box, nn.Partitioned) else box
    names = box.names if isinstance(box, nn.Partitioned) else ()
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    return (1.0 + 0.02 * noise) if tuple(names) == ("norm",) else 0.02 * noise

  return jax.tree.map(value, abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))


# The tiny model; the fast variant makes all four layers gated MLA (compiling KDA's chunked
# scan for the reference and three meshes would dominate the suite's run time) and runs on all
# three meshes, with MoE in layers 1-3; the slow variant, TINY's KDA/MLA hybrid cut to three layers
# (KDA, KDA + MoE, MLA + MoE: a KDA layer both with the dense FFN and with MoE; a fourth, KDA + MoE
# again, would only add compile time), runs on the mesh with both axes (KDA sees only the batch's
# data sharding; the expert axis is the MoE's, which the MLA variant covers on every mesh).
# 'mla16' (two gated MLA layers, MoE in layer 1) has 16 experts, four per device on an expert:4
# mesh of four devices: a wrong local expert id shows only with several experts on a device (two
# on data:2,expert:4 with 8).
# (ModelConfig, ImplConfig) by kind.
MODELS = {"mla": (ModelConfig(vocab_size=64, d_model=32, num_layers=4, mla_every=1,
                              moe_num_experts=8, moe_top_k=2),
                  ImplConfig(moe_grouped_matmul="ragged_dot")),
          "hybrid": (dataclasses.replace(TINY, num_layers=3), ImplConfig()),
          "mla16": (ModelConfig(vocab_size=64, d_model=32, num_layers=2, mla_every=1,
                                moe_num_experts=16, moe_top_k=2),
                    ImplConfig(moe_grouped_matmul="ragged_dot"))}
_REFERENCES: dict = {}


def _reference(kind):
  """Single-device loss, new QB bias, sown MoE stats and gradients (computed once per config)."""
  if kind not in _REFERENCES:
    model = K3Model(*MODELS[kind])
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(1),
                                                 jnp.zeros((B, T), jnp.int32)))
    variables = _random_variables(abstract, seed=1)
    batch = _batch()
    (loss, (balance, stats)), grads = jax.jit(_loss_fn(model))(variables["params"],
                                                                variables["moe_state"], batch)
    _REFERENCES[kind] = model, variables, batch, (loss, balance, stats, grads)
  return _REFERENCES[kind]


@pytest.mark.parametrize("kind,spec", [
    ("mla", "data:8"), ("mla", "data:2,expert:4"), ("mla", "expert:8"), ("mla16", "expert:4"),
    pytest.param("hybrid", "data:2,expert:4", marks=pytest.mark.slow),
])
def test_tiny_model_matches_single_device(kind, spec, monkeypatch):
  model, variables, batch, reference = _reference(kind)
  _check_against_reference(model, variables, batch, reference, spec, monkeypatch)


def test_tiled_grouped_matmul_under_expert_parallelism(monkeypatch):
  """The default grouped matmul off TPU ('tiled') in the expert-parallel path on expert:8 gives
  the loss, gradients and QB biases of the single-device `ragged_dot` path."""
  _, variables, batch, reference = _reference("mla")
  cfg, impl = MODELS["mla"]
  impl = dataclasses.replace(impl, moe_grouped_matmul="tiled")
  _check_against_reference(K3Model(cfg, impl), variables, batch, reference, "expert:8",
                           monkeypatch)


def _mesh(spec):
  """`sharding.make_mesh(spec)` on the first devices that the spec's sizes multiply to (all 8, or
  a sub-mesh such as 'expert:4' on four)."""
  count = int(np.prod([int(entry.split(":")[1]) for entry in spec.split(",")]))
  return sharding.make_mesh(spec, devices=jax.devices()[:count])


def _check_against_reference(model, variables, batch, reference, spec, monkeypatch):
  loss_ref, balance_ref, stats_ref, grads_ref = reference
  # LatentMoE dispatches through routed_experts_auto; count the expert-parallel calls.
  calls = []
  real_ep = moe_ep.routed_experts_ep
  monkeypatch.setattr(moe_ep, "routed_experts_ep",
                      lambda *a, **kw: calls.append(1) or real_ep(*a, **kw))

  mesh = _mesh(spec)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(1), jnp.zeros((B, T), jnp.int32)))
  var_sh = sharding.param_shardings(abstract, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  replicated = NamedSharding(mesh, P())
  step = jax.jit(_loss_fn(model), in_shardings=(var_sh["params"], var_sh["moe_state"], batch_sh),
                 out_shardings=((replicated, (replicated, replicated)), var_sh["params"]))
  params = jax.device_put(variables["params"], var_sh["params"])
  with sharding.with_mesh(mesh):
    (loss, (balance, stats)), grads = step(params, variables["moe_state"],
                                           sharding.shard_batch(batch, mesh))

  assert bool(calls) == (sharding.axis_size(mesh, "expert") > 1)
  w_gate_grad = grads["layer_1"]["moe"]["w_gate"]
  assert w_gate_grad.sharding.spec == var_sh["params"]["layer_1"]["moe"]["w_gate"].spec
  assert abs(float(loss) - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
  valid_tokens = int(np.sum(batch["segment_ids"] != 0))
  # 2e-5: the depth mixes' query gradients are sums over every token with heavy cancellation, so
  # their fp32 rounding shows most: on the mla config 6.2e-6 with the batch merely split (data:8),
  # 1.0e-5 under expert parallelism (9.9e-6 before the output gates' and the router's hand-written
  # VJPs reordered a few sums; every other leaf <= 6.3e-6). A routing or combine error is orders
  # of magnitude larger.
  for path_leaf, ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree_util.tree_leaves(grads_ref)):
    path, leaf = path_leaf
    assert _error_ratio(leaf, ref) <= 2e-5, jax.tree_util.keystr(path)
  # The QB histograms of every device's tokens, summed over the sharded batch, are the
  # single-device batch's, up to a token whose deficit sits at a bin edge and moves to the next
  # bin with the fp32 rounding of the sharded forward (mla16 on expert:4: one, moving its expert's
  # bias by 8e-6). A device's missing or doubled counts would shift the counts from below by a
  # whole shard's.
  assert jax.tree.structure(balance) == jax.tree.structure(balance_ref)
  for layer, layer_ref in zip(moe_stats_by_layer(balance).values(),
                              moe_stats_by_layer(balance_ref).values()):
    assert int(layer["tokens"]) == int(layer_ref["tokens"]) == valid_tokens
    upto, upto_ref = (np.cumsum(np.asarray(c), axis=-1) for c in (layer["counts"],
                                                                   layer_ref["counts"]))
    assert np.max(np.abs(upto - upto_ref)) <= 2
  new_moe, moe_ref = (balance_update(model.config, variables["moe_state"], b)
                      for b in (balance, balance_ref))
  for a, b in zip(jax.tree.leaves(new_moe), jax.tree.leaves(moe_ref)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
  # The sown expert loads of every MoE layer (all devices' valid assignments) are the
  # single-device ones, which count top_k assignments per valid (non-padding) token.
  layers, layers_ref = moe_stats_by_layer(stats), moe_stats_by_layer(stats_ref)
  assert layers and list(layers) == list(layers_ref), (list(layers), list(layers_ref))
  for name, layer in layers.items():
    np.testing.assert_array_equal(np.asarray(layer["load"]), np.asarray(layers_ref[name]["load"]),
                                  err_msg=name)
    assert float(np.sum(layers_ref[name]["load"])) == model.config.moe_top_k * valid_tokens, name


def test_pallas_kda_runs_per_batch_shard_under_a_mesh(monkeypatch):
  """Under a data:2,expert:4 mesh the Pallas KDA kernel (interpret mode here, with the fused gate)
  sees each device's rows only, and the sharded output, final state and gradients (the gate's
  shared parameters' summed over devices) equal the XLA path's without a mesh (fp32, error ratio
  <= 1e-5)."""
  from k3jax.ops import kda as kda_ops
  seen = []
  real_load = kda_ops._load_pallas_chunk_kda

  def recording_load():
    kernel = real_load()
    return lambda q, *a, **kw: seen.append(q.shape) or kernel(q, *a, **kw)
  monkeypatch.setattr(kda_ops, "_load_pallas_chunk_kda", recording_load)

  b, t, h, dk = 8, 32, 2, 16
  keys = jax.random.split(jax.random.PRNGKey(3), 7)
  q, k, v = (jax.random.normal(keys[i], (b, t, h, dk), jnp.float32) for i in range(3))
  x = jax.random.normal(keys[3], (b, t, h, dk))           # the gate's pre-activation
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  a_log = 0.3 * jax.random.normal(keys[5], (h,))
  dt_bias = 0.1 * jax.random.normal(keys[6], (h * dk,))
  seg = jnp.asarray(_batch()["segment_ids"])

  def loss(backend, q, k, v, x, beta, a_log, dt_bias):
    o, state = kda_ops.chunk_kda(q, k, v, x, beta, use_qk_l2norm=True, segment_ids=seg,
                                 output_final_state=True, chunk_size=16, backend=backend,
                                 A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)
    return jnp.sum(o * o) + jnp.sum(state), (o, state)

  grad = lambda backend: jax.value_and_grad(functools.partial(loss, backend), argnums=range(7),
                                            has_aux=True)
  (_, (o_ref, s_ref)), grads_ref = jax.jit(grad("xla"))(q, k, v, x, beta, a_log, dt_bias)

  mesh = sharding.make_mesh("data:2,expert:4")
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  args = [jax.device_put(a, rows) for a in (q, k, v, x, beta)]
  with sharding.with_mesh(mesh):
    (_, (o, state)), grads = jax.jit(grad("pallas"))(*args, a_log, dt_bias)
  assert seen and all(shape[0] == 1 for shape in seen), seen   # 8 rows over 8 devices
  assert o.sharding.spec[0] == sharding.BATCH_AXES
  assert _error_ratio(o, o_ref) <= 1e-5
  assert _error_ratio(state, s_ref) <= 1e-5
  for name, gr, gr_ref in zip("q k v x beta A_log dt_bias".split(), grads, grads_ref):
    assert _error_ratio(gr, gr_ref) <= 1e-5, name


def test_map_over_batch_shards_sums_the_shared_arrays_gradients_over_devices():
  """A shared (replicated) argument reaches every device's rows whole, and its gradient is the
  sum over all rows, as without a mesh; None passes through in both places."""
  x = jnp.arange(24.0).reshape(8, 3) / 10
  w = jnp.array([0.5, -1.0, 2.0])

  def loss(w, x):
    def rows(w, none, x, none2):
      assert none is None and none2 is None
      return jnp.sin(x * w)
    return jnp.sum(sharding.map_over_batch_shards(rows, x, None, shared=(w, None)) ** 2)

  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
  mesh = sharding.make_mesh("data:2,expert:4")
  with sharding.with_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
        w, jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES))))
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_map_over_batch_shards_rejects_indivisible_batch():
  mesh = sharding.make_mesh("data:8")
  with sharding.with_mesh(mesh), pytest.raises(ValueError, match=r"shape \(6, 3\).*dimension 0.*total size 8"):
    sharding.map_over_batch_shards(lambda x: x, jnp.zeros((6, 3)))


def test_init_train_state_builds_each_shard_on_its_device():
  """With a mesh the state is computed straight into its shardings (each device builds only its
  shard: the routed experts of its expert group), with the values of the single-device state."""
  from k3jax import training as train_lib
  from k3jax.cli import config_from_flags
  from testlib import TINY_RUN_BINDINGS
  cfg = config_from_flags([], TINY_RUN_BINDINGS)
  ref, _, _ = train_lib.init_train_state(cfg, total_steps=10)
  mesh = sharding.make_mesh("data:2,expert:4")
  state, _, _ = train_lib.init_train_state(cfg, total_steps=10, mesh=mesh)
  w_gate = state.params["layer_1"]["moe"]["w_gate"]          # [E=4, latent, hidden]
  assert w_gate.sharding.spec[0] == "expert"
  assert {s.data.shape[0] for s in w_gate.addressable_shards} == {1}   # 4 experts over 4
  moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
             if "['layer_1']['moe']['w_gate']" in jax.tree_util.keystr(path)]
  assert len(moments) == 2 and all(m.sharding.spec == w_gate.sharding.spec for m in moments)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               state, ref)


# ------------------------------------------------------------------------------------------------
# Checkpoints move between meshes


def test_checkpoint_restores_onto_another_mesh(tmp_path):
  model = K3Model(*MODELS["mla"])
  tokens = jnp.zeros((1, 8), jnp.int32)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens))
  variables = _random_variables(abstract, seed=2)
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, variables["params"])
  # Random optimizer moments, so that a mix-up between leaves would show.
  rng = np.random.default_rng(3)
  opt_state = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype)
                           if x.dtype == jnp.float32 else np.full(x.shape, 7, x.dtype), opt_state)
  state = {"step": np.asarray(7, np.int32), "params": variables["params"],
           "opt_state": opt_state, "moe_state": variables["moe_state"]}
  fsdp = sharding.logical_axis_rules(fsdp=True)

  save_mesh = sharding.make_mesh("data:8")
  saved, save_sh = sharding.shard_train_state(state, abstract, save_mesh, fsdp)
  emb = saved["params"]["embedding"]
  assert emb.sharding.spec == P(None, ("data", "expert"))
  assert len({str(s.index) for s in emb.addressable_shards}) == 8    # really split 8 ways
  path = tmp_path / "ckpt"
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, saved)
  ckptr.wait_until_finished()

  two = sharding.make_mesh("expert:2", devices=jax.devices()[:2])
  target = sharding.restore_args_for(jax.eval_shape(lambda: state), abstract, two)
  restored = ckptr.restore(path, target)
  for (p, got), want, tgt in zip(jax.tree_util.tree_leaves_with_path(restored),
                                 jax.tree.leaves(state), jax.tree.leaves(target)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(p))
    assert got.sharding == tgt.sharding, jax.tree_util.keystr(p)
    assert set(got.sharding.device_set) <= set(jax.devices()[:2])
  w = restored["opt_state"][0].mu["layer_1"]["moe"]["w_gate"]
  assert w.sharding.spec == P("expert", None, None)
  assert {tuple(s.index[0].indices(8)) for s in w.addressable_shards} == {(0, 4, 1), (4, 8, 1)}


# ------------------------------------------------------------------------------------------------
# Multi-process start-up


@pytest.fixture
def fake_initialize(monkeypatch):
  """Records jax.distributed.initialize calls instead of making them; clears launcher variables."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                        "JAX_PROCESS_ID", distributed.ENV_SWITCH)):
      monkeypatch.delenv(name)
  return calls


def test_maybe_initialize_single_process_is_a_no_op(fake_initialize, monkeypatch):
  assert distributed.maybe_initialize() is False
  assert distributed.maybe_initialize(num_processes=1, process_id=0) is False
  # A one-task SLURM allocation is a single process too.
  for name, value in dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n1", SLURM_NTASKS="1",
                          SLURM_PROCID="0", SLURM_LOCALID="0").items():
    monkeypatch.setenv(name, value)
  assert distributed.maybe_initialize() is False
  assert fake_initialize == []


def test_maybe_initialize_from_flags_env_and_launchers(fake_initialize, monkeypatch):
  assert distributed.maybe_initialize("10.0.0.1:1234", 4, 2) is True
  assert fake_initialize[-1]["coordinator_address"] == "10.0.0.1:1234"
  assert (fake_initialize[-1]["num_processes"], fake_initialize[-1]["process_id"]) == (4, 2)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h0:99")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert distributed.maybe_initialize() is True
  assert fake_initialize[-1]["coordinator_address"] == "h0:99"
  assert (fake_initialize[-1]["num_processes"], fake_initialize[-1]["process_id"]) == (2, 1)
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name)
  for name, value in dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="16",
                          SLURM_PROCID="3", SLURM_LOCALID="3").items():
    monkeypatch.setenv(name, value)
  assert distributed.detected_launcher() == "slurm"
  assert distributed.maybe_initialize() is True
  assert fake_initialize[-1]["coordinator_address"] is None       # JAX reads SLURM itself
  monkeypatch.setenv(distributed.ENV_SWITCH, "off")
  assert distributed.maybe_initialize() is False
  assert len(fake_initialize) == 3


def test_maybe_initialize_errors(fake_initialize, monkeypatch):
  with pytest.raises(ValueError, match="process_id=3 must be in"):
    distributed.maybe_initialize("h:1", 2, 3)
  with pytest.raises(ValueError, match="process_id=1 given without num_processes"):
    distributed.maybe_initialize(process_id=1)
  with pytest.raises(ValueError, match="number of processes is unknown"):
    distributed.maybe_initialize("h:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two'"):
    distributed.maybe_initialize()
  monkeypatch.setenv(distributed.ENV_SWITCH, "yes")
  with pytest.raises(ValueError, match="K3JAX_DISTRIBUTED='yes'"):
    distributed.maybe_initialize()
  assert fake_initialize == []


_WORKER = r"""
import sys
import numpy as np
import jax
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_default_matmul_precision", "highest")
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
from k3jax.parallel import distributed, sharding
from k3jax.ops import moe_ep

assert distributed.maybe_initialize(initialization_timeout=60)
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
data = np.load(sys.argv[1])
mesh = sharding.make_mesh("data:2,expert:4")
rows = sharding.local_batch_rows(mesh, data["z"].shape[0])
tokens = sharding.shard_batch({k: data[k][rows] for k in ("z", "idx", "w", "valid")}, mesh)
weights = [jax.make_array_from_callback(data[k].shape, NamedSharding(mesh, P("expert")),
                                        lambda i, k=k: data[k][i])
           for k in ("wg", "wu", "wo")]
with sharding.with_mesh(mesh):
  y, stats = jax.jit(lambda t, wg, wu, wo: moe_ep.routed_experts_auto(
      t["z"], t["idx"], t["w"], wg, wu, wo, valid=t["valid"], beta1=4.0, beta2=25.0))(
          tokens, *weights)
y = multihost_utils.process_allgather(y, tiled=True)
if jax.process_index() == 0:
  np.savez(sys.argv[2], y=y, load=np.asarray(stats["load"]), rows=[rows.start, rows.stop])
"""


def test_two_processes_expert_parallel(tmp_path):
  """Two real JAX processes (4 CPU devices each) form one data:2,expert:4 mesh over localhost."""
  rng = np.random.default_rng(7)
  n, latent, hidden, experts, k = 64, 16, 24, 8, 2
  z = rng.standard_normal((n, latent)).astype(np.float32)
  idx = np.argsort(-rng.random((n, experts)), axis=1)[:, :k].astype(np.int32)
  w = rng.random((n, k)).astype(np.float32)
  wg, wu = (0.3 * rng.standard_normal((2, experts, latent, hidden))).astype(np.float32)
  wo = (0.3 * rng.standard_normal((experts, hidden, latent))).astype(np.float32)
  valid = rng.random(n) < 0.8
  np.savez(tmp_path / "in.npz", z=z, idx=idx, w=w, wg=wg, wu=wu, wo=wo, valid=valid)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    procs.append(subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = []
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=180)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  got = np.load(tmp_path / "out.npz")
  assert list(got["rows"]) == [0, z.shape[0] // 2]           # process 0 holds the first half
  y_ref, stats_ref = jax.jit(lambda *a: routed_experts(*a, valid=valid, beta1=4.0, beta2=25.0))(
      z, idx, w, wg, wu, wo)
  assert _error_ratio(got["y"], y_ref) <= 1e-5
  np.testing.assert_array_equal(got["load"], stats_ref["load"])


def test_project_checkpointer_restores_onto_another_mesh(tmp_path):
  """The same move through k3jax.training.checkpoint.Checkpointer, as the training loop saves and
  restores."""
  from k3jax.training import checkpoint as checkpoint_lib
  from k3jax.config import CheckpointConfig
  model = K3Model(*MODELS["mla"])
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  variables = _random_variables(abstract, seed=4)
  rng = np.random.default_rng(5)
  opt_state = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype)
                           if x.dtype == jnp.float32 else np.full(x.shape, 3, x.dtype),
                           jax.eval_shape(optax.adamw(1e-3).init, variables["params"]))
  state = {"params": variables["params"], "moe_state": variables["moe_state"],
           "opt_state": opt_state, "rng": np.asarray([1, 2], np.uint32)}
  fsdp = sharding.logical_axis_rules(fsdp=True)
  saved, _ = sharding.shard_train_state(state, abstract, sharding.make_mesh("data:8"), fsdp)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpts"),
                                     CheckpointConfig(every_steps=1, keep_last=1, async_save=False))
  ckpt.save(3, meta={"data_position": 3}, **saved)
  ckpt.wait()
  two = sharding.make_mesh("expert:2", devices=jax.devices()[:2])
  target = sharding.restore_args_for(jax.eval_shape(lambda: state), abstract, two)
  restored = ckpt.restore(3, **target)
  ckpt.close()
  for key in state:
    for got, want, tgt in zip(jax.tree.leaves(restored[key]), jax.tree.leaves(state[key]),
                              jax.tree.leaves(target[key])):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
      assert got.sharding == tgt.sharding
  assert restored["params"]["layer_2"]["moe"]["w_out"].sharding.spec == P("expert", None, None)


def test_scanned_layers_shard_their_experts_and_replicate_the_stacked_axis():
  """With the decoder scanned, the stacked 'layers' axis is replicated, the routed experts stay
  sharded on 'expert' (now their second axis), and the optimizer moments follow the params."""
  cfg = dataclasses.replace(TINY, num_layers=10, mla_every=4, attnres_block_size=2)
  model = K3Model(cfg)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  assert ("layers", None) in sharding.LOGICAL_AXIS_RULES
  mesh = sharding.make_mesh("expert:8")
  params = nn.meta.unbox(abstract)["params"]
  opt = optax.adamw(1e-3)
  state = {"params": params, "opt_state": jax.eval_shape(opt.init, params),
           "moe_state": nn.meta.unbox(abstract)["moe_state"]}
  specs = _specs(sharding.state_shardings(state, abstract, mesh))
  scanned = specs["params"]["scanned_period_4"]
  assert params["scanned_period_4"]["layer_2"]["moe"]["w_up"].shape[:2] == (2, 8)
  assert scanned["layer_2"]["moe"]["w_up"] == P(None, "expert", None, None)
  assert specs["opt_state"][0].mu["scanned_period_4"]["layer_2"]["moe"]["w_up"] == \
      P(None, "expert", None, None)
  assert scanned["layer_3"]["mla"]["wq"] == P(None, None, None, None)
  assert specs["params"]["layer_0"]["ffn"]["gate"]["kernel"] == P(None, None)
  fsdp = _specs(sharding.param_shardings(abstract, mesh, sharding.logical_axis_rules(fsdp=True)))
  assert fsdp["params"]["scanned_period_4"]["layer_2"]["moe"]["w_up"] == \
      P(None, "expert", "data", None)
