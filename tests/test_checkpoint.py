"""Tests of k3jax.training.checkpoint: round trip, retention, unfinalised directories, model-only
restore, trees that do not fit, damaged steps, the conversion hook, layout conversion onto a
mesh."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import CheckpointConfig
from k3jax.training.checkpoint import (Checkpointer, CorruptCheckpointError,
                                       IncompatibleCheckpointError)
from k3jax.training.run_dir import config_differences
from testlib import random_like


def _state(seed: int, big: bool = False):
  """A small training state; big=True adds a 128 KiB weight (tensorstore keeps arrays this small
  inline in its index, where damaging the data files would not touch them)."""
  rng = np.random.default_rng(seed)
  params = {"layer_0": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                        "scale": jnp.asarray(rng.normal(size=(3,)), jnp.float32)},
            "embedding": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)}
  if big:
    params["big"] = jnp.asarray(rng.normal(size=(128, 256)), jnp.float32)
  moe_state = {"layer_1": {"moe": {"bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}}
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  opt_state = opt.init(params)
  # one real update so that the moments and the count are not trivial
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + seed), params)
  _, opt_state = opt.update(grads, opt_state, params)
  return dict(params=params, moe_state=moe_state, opt_state=opt_state,
              rng=jax.random.PRNGKey(seed))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_async(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep_last=2, async_save=True))
  state = _state(1)
  ckpt.save(7, **state, meta={"stage": 1, "seq_len": 32, "data_position": 7})
  ckpt.wait()
  template = _state(2)   # same structure, different values
  out = ckpt.restore(7, **template)
  ckpt.close()
  for k in ("params", "moe_state", "opt_state", "rng"):
    _assert_trees_equal(out[k], state[k])
  assert out["meta"] == {"stage": 1, "seq_len": 32, "data_position": 7, "step": 7}


def test_keeps_last_n_plus_stage_boundaries(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep_last=2, async_save=False),
                      keep_steps=[3, 7])
  state = _state(0)
  for step in range(1, 11):
    ckpt.save(step, **state, meta={"stage": 0, "seq_len": 8, "data_position": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 7, 9, 10]
  ckpt.close()
  on_disk = sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
  assert on_disk == [3, 7, 9, 10]


def test_unfinalised_checkpoint_is_never_restored(tmp_path):
  directory = tmp_path / "ckpt"
  ckpt = Checkpointer(str(directory), CheckpointConfig(keep_last=3))
  good = _state(3)
  ckpt.save(4, **good, meta={"stage": 0, "seq_len": 8, "data_position": 4})
  ckpt.wait()
  ckpt.close()
  # A save of step 6 that was killed half-way: orbax writes into a temporary directory and only
  # renames it to '6' once complete.
  partial = directory / "6.orbax-checkpoint-tmp-1234567890"
  (partial / "model").mkdir(parents=True)
  (partial / "model" / "garbage").write_bytes(b"\x00" * 10)
  ckpt = Checkpointer(str(directory), CheckpointConfig(keep_last=3))
  assert ckpt.latest_step() == 4
  assert ckpt.all_steps() == [4]
  out = ckpt.restore(4, **_state(9))
  _assert_trees_equal(out["params"], good["params"])
  ckpt.close()


def test_restore_model_only(tmp_path):
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, CheckpointConfig())
  state = _state(5)
  ckpt.save(2, **state, meta={"stage": 0, "seq_len": 8, "data_position": 2})
  later = _state(6)
  ckpt.save(5, **later, meta={"stage": 1, "seq_len": 16, "data_position": 5})
  ckpt.wait()
  ckpt.close()
  reader = Checkpointer(directory, CheckpointConfig(), read_only=True)
  params, moe_state, meta = reader.restore_model()          # latest
  _assert_trees_equal(params, later["params"])
  _assert_trees_equal(moe_state, later["moe_state"])
  assert meta["step"] == 5 and meta["seq_len"] == 16
  params, _, meta = reader.restore_model(2)
  _assert_trees_equal(params, state["params"])
  with pytest.raises(ValueError, match="step=3"):
    reader.restore_model(3)
  reader.close()


def test_restore_model_from_empty_directory(tmp_path):
  os.makedirs(tmp_path / "ckpt")
  reader = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(), read_only=True)
  with pytest.raises(FileNotFoundError, match="no finalised checkpoint"):
    reader.restore_model()
  reader.close()


# ------------------------------------------------------------------------------------------------
# Integrity: a tree that does not fit, damaged steps, the conversion hook.


def _damage(step_dir: str, fault: str) -> None:
  """Makes a finalised step unreadable as a crash or a full disk would: 'truncate' halves the
  data files of the 'model' item (with arrays this small, which file holds which array is up to
  tensorstore), 'ocdbt' deletes its ocdbt.process_0/ directory."""
  data_dir = os.path.join(step_dir, "model", "ocdbt.process_0")
  if fault == "ocdbt":
    shutil.rmtree(data_dir)
    return
  for name in os.listdir(os.path.join(data_dir, "d")):
    path = os.path.join(data_dir, "d", name)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


def _saved(directory, steps):
  ckpt = Checkpointer(directory, CheckpointConfig(keep_last=5, async_save=False))
  for step in steps:
    ckpt.save(step, **_state(step, big=True),
              meta={"stage": 0, "seq_len": 8, "data_position": step})
  ckpt.wait()
  ckpt.close()


def test_tree_that_does_not_fit_is_named_before_reading(tmp_path):
  directory = str(tmp_path / "ckpt")
  _saved(directory, [1])
  template = _state(2, big=True)
  template["params"]["embedding"] = jnp.zeros((5, 6), jnp.float32)       # a changed width
  template["params"]["layer_0"]["scale"] = jnp.zeros((3,), jnp.bfloat16)  # a changed dtype
  del template["params"]["layer_0"]["w"]                                   # a removed weight
  template["opt_state"] = optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(1e-3)).init(template["params"])
  ckpt = Checkpointer(directory, CheckpointConfig())
  with pytest.raises(IncompatibleCheckpointError) as info:
    ckpt.restore_latest(**template)
  ckpt.close()
  diffs = info.value.differences
  assert "params/embedding: stored float32[5, 4], expected float32[5, 6]" in diffs
  assert "params/layer_0/scale: stored float32[3], expected bfloat16[3]" in diffs
  assert "params/layer_0/w: stored float32[4, 3], not in the model" in diffs
  # The optimizer moments follow the parameters they belong to (named by field, as stored).
  assert any(d.startswith("opt_state/1/0/mu/embedding:") for d in diffs)
  assert os.listdir(directory) == ["1"]   # nothing moved: the checkpoint is not damaged


@pytest.mark.parametrize("fault", ["truncate", "ocdbt"])
def test_damaged_newest_step_is_moved_aside_and_the_previous_one_restored(tmp_path, fault):
  directory = str(tmp_path / "ckpt")
  _saved(directory, [2, 4])
  _damage(os.path.join(directory, "4"), fault)
  lines = []
  ckpt = Checkpointer(directory, CheckpointConfig())
  out = ckpt.restore_latest(**_state(9, big=True), log=lines.append)
  assert ckpt.all_steps() == [2]
  ckpt.close()
  assert out["meta"]["step"] == 2
  _assert_trees_equal(out["params"], _state(2, big=True)["params"])
  assert len(lines) == 1 and lines[0].startswith("checkpoint step 4 cannot be read (")
  assert "moved to" in lines[0] and "\n" not in lines[0]
  assert sorted(os.listdir(directory)) == ["2", "corrupt"]
  assert os.listdir(os.path.join(directory, "corrupt")) == ["4"]


def test_read_only_reader_skips_a_damaged_step_without_moving_it(tmp_path):
  directory = str(tmp_path / "ckpt")
  _saved(directory, [2, 4])
  _damage(os.path.join(directory, "4"), "truncate")
  lines = []
  reader = Checkpointer(directory, CheckpointConfig(), read_only=True)
  params, _, meta = reader.restore_model(log=lines.append)
  assert meta["step"] == 2
  _assert_trees_equal(params, _state(2, big=True)["params"])
  assert len(lines) == 1 and "skipping it" in lines[0]
  with pytest.raises(CorruptCheckpointError, match="step 4 cannot be read"):
    reader.restore_model(4)
  with pytest.raises(RuntimeError, match="read_only"):
    reader.save(5, **_state(5, big=True), meta={})
  reader.close()
  assert sorted(os.listdir(directory)) == ["2", "4"]


def test_every_step_damaged_raises(tmp_path):
  directory = str(tmp_path / "ckpt")
  _saved(directory, [2])
  _damage(os.path.join(directory, "2"), "ocdbt")
  ckpt = Checkpointer(directory, CheckpointConfig())
  with pytest.raises(CorruptCheckpointError, match="no checkpoint .* can be read: checkpoint step 2"):
    ckpt.restore_latest(**_state(9, big=True), log=lambda line: None)
  ckpt.close()


def test_convert_restructures_an_old_tree(tmp_path):
  """A checkpoint with an old parameter structure restores through `convert`: here the old
  'layer_0' subtree has become 'block' (as a scan-over-layers conversion would rename and stack);
  the optimizer moments are converted the same way."""
  directory = str(tmp_path / "ckpt")
  _saved(directory, [3])
  old = _state(3, big=True)

  def rename(tree):
    if isinstance(tree, dict):
      return {("block" if k == "layer_0" else k): rename(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
      return type(tree)(rename(v) for v in tree)
    return tree

  template = _state(8, big=True)
  template["params"] = rename(template["params"])
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  template["opt_state"] = opt.init(template["params"])
  calls = []

  def convert(item, tree):
    calls.append(item)
    return rename(tree)

  ckpt = Checkpointer(directory, CheckpointConfig())
  with pytest.raises(IncompatibleCheckpointError, match="params/block/w: not stored"):
    ckpt.restore(3, **template)
  out = ckpt.restore(3, **template, convert=convert)
  ckpt.close()
  assert "model" in calls and "train" in calls
  _assert_trees_equal(out["params"], rename(old["params"]))
  assert jax.tree.structure(out["opt_state"]) == jax.tree.structure(template["opt_state"])
  np.testing.assert_array_equal(out["opt_state"][1][0].mu["block"]["w"],
                                old["opt_state"][1][0].mu["layer_0"]["w"])


def test_config_differences():
  old = "# model\nModelConfig.d_model = 64\nModelConfig.num_layers = 4\nConfig.seed = 0\n"
  new = "# model\nModelConfig.d_model = 96\nModelConfig.num_layers = 4\nConfig.seed = 0\n" \
        "ImplConfig.remat = 'full'\n"
  assert config_differences(old, new) == ["ImplConfig.remat: (unset) -> 'full'",
                                          "ModelConfig.d_model: 64 -> 96"]
  assert config_differences(old, old) == []


@pytest.mark.slow
def test_runs_restore_across_the_decoder_layouts(tmp_path):
  """A workdir trained before the decoder became a scan (per-layer trees) resumes and evaluates
  with the scanned decoder, and a scanned run resumes and evaluates with scan_layers off (the
  setting of small.gin and medium.gin since run 15): train() and restore_run convert the stored
  trees, the optimizer state included."""
  from k3jax import config as config_lib
  from k3jax import training as train_lib
  from k3jax.model import K3Model, is_scanned_path, layer_plan
  from k3jax.training import checkpoint as checkpoint_lib
  from k3jax.training import run_dir
  # One stage: the last run's step and evaluation have the first run's shapes (the compilation
  # cache holds them); the layouts are the point here, not the stages. Three MLA layers, each its
  # own AttnRes block: the smallest decoder with two scanned groups (the six-layer KDA/MLA one
  # took twice as long; test_model's converter tests have KDA's layers).
  bindings = ["StagesConfig.stages = ((16, 4),)", "StagesConfig.tokens_per_step = 256",
              "ModelConfig.num_layers = 3", "ModelConfig.mla_every = 1",
              "ModelConfig.attnres_block_size = 1", "DataConfig.max_bytes = 200000",
              "EvalConfig.num_batches = 1", "EvalConfig.passkey_multipliers = ()",
              "CheckpointConfig.async_save = False"]
  old = config_lib.from_gin(["gin_configs/tiny.gin"], bindings + ["ImplConfig.scan_layers = False"])
  new = config_lib.from_gin(["gin_configs/tiny.gin"], bindings)
  workdir = str(tmp_path / "run")
  # the scan stacks layers 1 and 2 as two groups
  assert layer_plan(new.model, new.impl.scan_layers).num_groups == 2
  train_lib.train(old, workdir, max_steps=2, progress=False, tensorboard=False)
  # restore_run reads config.gin of the run: write the scanned config in its place, as a run
  # directory from before scan_layers existed gets the new default when it is parsed.
  run_dir.write_config(workdir, new)
  cfg, params, moe_state, meta = checkpoint_lib.restore_run(workdir, log=lambda _: None)
  assert meta["step"] == 2 and cfg.impl.scan_layers
  assert "layer_1" not in params and any(is_scanned_path((k,)) for k in params)
  tokens = np.zeros((1, 16), np.int32)
  logits = jax.jit(K3Model(cfg.model, cfg.impl).apply)({"params": params, "moe_state": moe_state},
                                                       tokens)
  assert np.all(np.isfinite(np.asarray(logits)))
  result = train_lib.train(new, workdir, max_steps=3, progress=False, tensorboard=False)
  assert result.step == 3
  cfg, params, _, meta = checkpoint_lib.restore_run(workdir, log=lambda _: None)   # as it is
  assert meta["step"] == 3 and cfg.impl.scan_layers and "layer_1" not in params
  # ... and back: the scanned checkpoint of step 3 into the per-layer decoder.
  run_dir.write_config(workdir, old)
  cfg, params, _, meta = checkpoint_lib.restore_run(workdir, log=lambda _: None)
  assert meta["step"] == 3 and not cfg.impl.scan_layers
  assert "layer_1" in params and not any(is_scanned_path((k,)) for k in params)
  result = train_lib.train(old, workdir, progress=False, tensorboard=False)
  assert result.finished and result.step == 4


# ------------------------------------------------------------------------------------------------
# Layout conversion onto a mesh: values and shardings of every restored leaf.

# tiny.gin with six layers (KDA/MLA alternating, AttnRes blocks of two): layer 0 is dense and
# unrolled, layers 1-4 are two scanned groups of period 2 (positions layer_1 and layer_2), the
# final MLA layer 5 is unrolled after the scan.
_LAYOUT_BINDINGS = ["ModelConfig.num_layers = 6", "ModelConfig.mla_every = 2",
                    "ModelConfig.attnres_block_size = 2", "ModelConfig.first_k_dense = 1"]
_SCAN = "scanned_period_2"


def _flat(tree) -> dict:
  """{'opt_state/1/0/mu/layer_3/moe/w_up': leaf} of a tree (dict keys, indices, field names)."""
  def name(key):
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)
  return {"/".join(name(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _scanned_place(per_layer_path: str) -> tuple[str, int | None]:
  """Where a per-layer leaf lives in the scanned layout, written out for this test's plan:
  layer i in 1..4 is entry g = (i-1)//2 of 'scanned_period_2/layer_{1 + (i-1)%2}'; the other
  leaves keep their path (entry None)."""
  parts = per_layer_path.split("/")
  for k, part in enumerate(parts):
    if part in ("layer_1", "layer_2", "layer_3", "layer_4"):
      i = int(part.split("_")[1])
      scanned = parts[:k] + [_SCAN, f"layer_{1 + (i - 1) % 2}"] + parts[k + 1:]
      return "/".join(scanned), (i - 1) // 2
  return per_layer_path, None


@functools.lru_cache(maxsize=None)
def _abstract_state(model_cfg, impl):
  """(the state's shapes, boxed abstract variables) of `model_cfg` in the layout of `impl`, traced
  once per layout (each trace runs the model's Python)."""
  from k3jax.config import OptimizerConfig
  from k3jax.model import init_variables
  from k3jax.training import optim
  abstract = jax.eval_shape(lambda: init_variables(model_cfg, jax.random.PRNGKey(0), 1, 16,
                                                   impl=impl))
  params = optim.unbox(abstract["params"])
  optimizer, _ = optim.make_optimizer(OptimizerConfig(), 100,
                                      optim.logical_axes(abstract["params"]))
  shapes = {"params": params, "moe_state": optim.unbox(abstract["moe_state"]),
            "opt_state": jax.eval_shape(optimizer.init, params),
            "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
  return shapes, abstract


def _random_state(model_cfg, impl, seed):
  """(state dict with random values for every leaf, boxed abstract variables) of `model_cfg` in
  the layout of `impl`: params, moe_state, optimizer moments (the run's AdamW) and rng, as numpy
  arrays."""
  shapes, abstract = _abstract_state(model_cfg, impl)
  return random_like(shapes, seed), abstract


def _check_restored(restored, target, expected):
  """Every restored leaf has the expected value (numpy, by path) and the target's sharding."""
  got, want = _flat({k: restored[k] for k in target}), _flat(target)
  assert set(got) == set(want) == set(expected)
  for path, leaf in got.items():
    assert leaf.dtype == expected[path].dtype, path
    np.testing.assert_array_equal(np.asarray(leaf), expected[path], err_msg=path)
    assert leaf.sharding == want[path].sharding, \
        f"{path}: restored on {leaf.sharding}, target {want[path].sharding}"


def _check_expert_shards(leaf, expected, spec, shard_shape):
  """An expert weight really is split over the mesh: 8 shards of `shard_shape`, each holding its
  slice of the expected value."""
  assert leaf.sharding.spec == spec
  shards = leaf.addressable_shards
  assert len(shards) == 8 and len({s.device for s in shards}) == 8
  for shard in shards:
    assert shard.data.shape == shard_shape
    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


def test_layout_conversion_onto_a_mesh_restores_values_and_shardings(tmp_path):
  """A per-layer checkpoint restored into the scanned decoder on a 'data:2,expert:4' mesh with
  FSDP rules (as train() restores it: the state's shardings as targets, `to_layout` as convert),
  and a scanned one (saved from an 'expert:2' mesh of two of the devices, without FSDP) into the
  per-layer decoder: every leaf of params, moe_state, the optimizer moments and the rng equals the
  source stacked / unstacked in numpy here (entry g of 'scanned_period_2/layer_j' = layer j + 2g)
  and lies on the target's sharding; an expert weight and its moment really are split over the 8
  devices."""
  from jax.sharding import PartitionSpec as P
  from k3jax import config as config_lib
  from k3jax.model import layer_plan, to_layout
  from k3jax.parallel import sharding
  from k3jax.training import checkpoint as checkpoint_lib
  scan_run = config_lib.from_gin(["gin_configs/tiny.gin"], _LAYOUT_BINDINGS)
  loop_run = config_lib.from_gin(["gin_configs/tiny.gin"],
                                 _LAYOUT_BINDINGS + ["ImplConfig.scan_layers = False"])
  model_cfg, scan_impl, loop_impl = scan_run.model, scan_run.impl, loop_run.impl
  assert loop_run.model == model_cfg and scan_impl.scan_layers and not loop_impl.scan_layers
  plan = layer_plan(model_cfg, scan_impl.scan_layers)
  assert (plan.prefix, plan.scan_name, plan.group_layers, plan.num_groups, plan.suffix) == \
      ((0,), _SCAN, (1, 2), 2, (5,))   # what _scanned_place writes out
  mesh = sharding.make_mesh("data:2,expert:4")
  fsdp = sharding.logical_axis_rules(fsdp=True)
  keys = ("params", "moe_state", "opt_state", "rng")
  config = CheckpointConfig(keep_last=1, async_save=False)
  meta = {"stage": 0, "seq_len": 16, "data_position": 1}
  expert_path = f"params/{_SCAN}/layer_1/moe/w_up"

  # Per-layer (as saved by a single-device run) -> scanned on the mesh.
  loop_state, _ = _random_state(model_cfg, loop_impl, seed=1)
  scan_like, scan_abstract = _random_state(model_cfg, scan_impl, seed=0)   # only its shapes
  target = sharding.restore_args_for(jax.eval_shape(lambda: scan_like), scan_abstract, mesh,
                                     fsdp)
  specs = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(target)}
  assert any("expert" in s for s in specs) and any("data" in s for s in specs)  # non-trivial
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "loop"), config)
  ckpt.save(1, **jax.tree.map(jnp.asarray, loop_state), meta=meta)
  restored = ckpt.restore_latest(**target, convert=lambda item, tree: to_layout(
      tree, model_cfg, scan_impl.scan_layers))
  ckpt.close()
  expected, groups = {}, {}
  for path, value in _flat(loop_state).items():
    place, g = _scanned_place(path)
    if g is None:
      expected[place] = value
    else:
      groups.setdefault(place, {})[g] = value
  for place, entries in groups.items():
    assert sorted(entries) == [0, 1], place
    expected[place] = np.stack([entries[0], entries[1]])
  assert set(target) == set(keys) and {f"opt_state/1/0/{m}/{_SCAN}/layer_1/moe/w_up"
                                        for m in ("mu", "nu")} <= set(expected)
  _check_restored(restored, target, expected)
  # [groups, experts, latent, hidden]: experts over 'expert' (4), latent over 'data' (2, FSDP).
  _check_expert_shards(restored["params"][_SCAN]["layer_1"]["moe"]["w_up"], expected[expert_path],
                       P(None, "expert", "data", None), (2, 2, 16, 64))
  _check_expert_shards(restored["opt_state"][1][0].mu[_SCAN]["layer_1"]["moe"]["w_up"],
                       expected[f"opt_state/1/0/mu/{_SCAN}/layer_1/moe/w_up"],
                       P(None, "expert", "data", None), (2, 2, 16, 64))

  # Scanned (saved from another mesh, without FSDP: the restore must re-place the leaves, not
  # keep the saved shardings) -> per-layer on the mesh with FSDP. Two devices: orbax saves a
  # replicated leaf in one slice per replica, each slice an eager program of its own (on all 8
  # devices, 280 of them: half the test's time).
  scan_state, _ = _random_state(model_cfg, scan_impl, seed=2)
  save_mesh = sharding.make_mesh("expert:2", jax.devices()[-2:])
  saved, saved_on = sharding.shard_train_state(scan_state, scan_abstract, save_mesh)
  assert saved_on["params"][_SCAN]["layer_1"]["moe"]["w_up"].spec == P(None, "expert", None, None)
  loop_like, loop_abstract = _random_state(model_cfg, loop_impl, seed=0)
  target = sharding.restore_args_for(jax.eval_shape(lambda: loop_like), loop_abstract, mesh,
                                     fsdp)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "scan"), config)
  ckpt.save(1, **saved, meta=meta)
  restored = ckpt.restore_latest(**target, convert=lambda item, tree: to_layout(
      tree, model_cfg, loop_impl.scan_layers))
  ckpt.close()
  source = _flat(scan_state)
  expected = {}
  for path in _flat(target):
    place, g = _scanned_place(path)
    expected[path] = source[place] if g is None else source[place][g]
  assert set(target) == set(keys)
  _check_restored(restored, target, expected)
  for path in ("params/layer_3/moe/w_up", "opt_state/1/0/nu/layer_3/moe/w_up"):
    _check_expert_shards(_flat(restored)[path], expected[path], P("expert", "data", None),
                         (2, 16, 64))
