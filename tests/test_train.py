"""Tests of k3jax.training (and the k3jax.train CLI): staged training, exact resume, QB interval,
aux loss, NaN stop, CLI, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax import training as train_lib
from k3jax.model import K3Model
from k3jax.model.stats import moe_stats_by_layer
from k3jax.parallel import sharding as sharding_lib
from k3jax.parallel.sharding import make_run_mesh
from k3jax.training import accumulate as accumulate_lib
from k3jax.training import loop as loop_lib
from k3jax.training import metrics as metrics_lib
from k3jax.training.checkpoint import Checkpointer
from k3jax.training.loss import token_cross_entropy
from k3jax.training.run_data import make_data
from testlib import TINY_RUN_BINDINGS, error_ratio, mesh_train_step, run_command_forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = TINY_RUN_BINDINGS + [
    "CheckpointConfig.every_steps = 2",
    "EvalConfig.num_batches = 1", "EvalConfig.passkey_multipliers = ()",
    "EvalConfig.passkey_samples = 2", "EvalConfig.log_every_steps = 1",
]
# The full run and the runs compared with its eval.json also retrieve passkeys at each stage end
# (at 8x the length); the others skip those programs' compiles (the suite's time).
PASSKEY = "EvalConfig.passkey_multipliers = (8,)"
# The full run also logs each step's expert loads (host-side only: the same compiled step).
LOADS = "EvalConfig.log_expert_loads = True"


def tiny_config(*extra: str) -> config_lib.Config:
  return config_lib.from_gin([], TINY + list(extra))


def _train_losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["kind"] == "train"}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """An uninterrupted run of both stages."""
  workdir = str(tmp_path_factory.mktemp("full"))
  result = train_lib.train(tiny_config(PASSKEY, LOADS), workdir, progress=False)
  return workdir, result


@pytest.mark.slow
def test_full_run_outputs(full_run):
  workdir, result = full_run
  assert result.finished and result.step == 6
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  assert [(r["stage"], r["seq_len"], r["batch_size"]) for r in train] == \
      [(0, 16, 4)] * 3 + [(1, 32, 2)] * 3
  for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "max_vio/layer_1/moe"):
    assert all(np.isfinite(r[key]) for r in train), key
  # One cosine over all 6 steps (no warmup at 1% of 6 steps): lr decreases across the boundary.
  lrs = [r["lr"] for r in train]
  assert all(a > b for a, b in zip(lrs, lrs[1:]))
  evals = [r for r in records if r["kind"] == "eval"]
  assert [(r["step"], r["seq_len"]) for r in evals] == [(3, 16), (6, 32)]
  assert set(evals[0]) >= {"val_loss", "val_bpb", "passkey/128", "val_max_vio/layer_1/moe"}
  np.testing.assert_allclose(evals[1]["val_bpb"], evals[1]["val_loss"] / np.log(2))
  with open(os.path.join(workdir, "eval.json")) as f:
    report = json.load(f)
  assert report["final"]["val_loss"] == evals[1]["val_loss"]
  assert result.eval["val_loss"] == evals[1]["val_loss"]
  for name in ("loss.png", "expert_load.png", "passkey.png"):
    assert os.path.getsize(os.path.join(workdir, "plots", name)) > 1000
  assert os.listdir(os.path.join(workdir, "tb"))
  # The saved config rebuilds the run's config exactly.
  assert config_lib.from_gin([os.path.join(workdir, "config.gin")]) == tiny_config(PASSKEY, LOADS)
  # Checkpoints: keep_last=2 (steps 4 and 6) plus both stage ends (3 and 6).
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tiny_config().checkpoint,
                      read_only=True)
  assert ckpt.all_steps() == [3, 4, 6]
  ckpt.close()


@pytest.mark.slow
def test_logged_expert_loads_count_each_steps_routed_tokens(full_run):
  """EvalConfig.log_expert_loads: each logged step has 'load/<layer>' for exactly the MoE layers,
  E integers adding up to that step's valid tokens (segment_ids != 0) × top-k, and agreeing with
  the step's logged MaxVio."""
  workdir, _ = full_run
  cfg = tiny_config(PASSKEY, LOADS)
  model = cfg.model
  moe_layers = {f"layer_{i}/moe" for i in range(model.num_layers) if model.layer_uses_moe(i)}
  assert moe_layers == {"layer_1/moe"}
  train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
           if r["kind"] == "train"]
  iterator = make_data(cfg).train_iterator(0)
  valid = [int((next(iterator)["segment_ids"] != 0).sum()) for _ in range(6)]
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  for record in train:
    loads = {k[len(loop_lib.LOAD_PREFIX):]: v for k, v in record.items()
             if k.startswith(loop_lib.LOAD_PREFIX)}
    assert set(loads) == moe_layers, record
    for name, load in loads.items():
      assert len(load) == model.moe_num_experts and all(type(x) is int and x >= 0 for x in load)
      assert sum(load) == valid[record["step"] - 1] * model.moe_top_k
      np.testing.assert_allclose(max(load) / np.mean(load) - 1, record[f"max_vio/{name}"],
                                 rtol=1e-5)


@pytest.mark.slow
def test_resume_is_bit_exact(full_run, tmp_path):
  """Stop mid-stage 2 (--max_steps=5), lose the last checkpoint as if killed before it was
  written, resume: the losses equal those of the uninterrupted run exactly."""
  full_dir, _ = full_run
  workdir = str(tmp_path / "resumed")
  cfg = tiny_config(PASSKEY)
  first = train_lib.train(cfg, workdir, max_steps=5, progress=False)
  assert not first.finished and first.step == 5
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == [3, 4, 5]
  shutil.rmtree(os.path.join(ckpt_dir, "5"))
  second = train_lib.train(cfg, workdir, progress=False)   # resumes from step 4
  assert second.finished and second.step == 6
  assert _train_losses(workdir) == _train_losses(full_dir)   # exact float equality
  # Without EvalConfig.log_expert_loads (the full run has it) no record carries loads.
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert not [k for r in records for k in r if k.startswith(loop_lib.LOAD_PREFIX)]
  with open(os.path.join(workdir, "eval.json")) as f, \
      open(os.path.join(full_dir, "eval.json")) as g:
    assert json.load(f)["final"] == json.load(g)["final"]
  # re-running a finished run does nothing
  third = train_lib.train(cfg, workdir, progress=False)
  assert third.finished and third.step == 6 and third.eval is None


@pytest.mark.slow
def test_stages_on_their_own_meshes_train_the_same_losses(full_run, tmp_path, capsys):
  """MeshConfig.stage_axes: stage 1 on one device, stage 2 on `data:2,context:4` (its 32-token
  rows in slices of 8). The run stops inside stage 1 and resumes (restored onto stage 1's device),
  then moves its state onto stage 2's mesh at the boundary: the losses equal the one-device run's
  (stage 1 exactly, stage 2 fp32 1e-5 relative)."""
  full_dir, _ = full_run
  workdir = str(tmp_path / "context")
  cfg = tiny_config("MeshConfig.stage_axes = ('', 'data:2,context:4')")
  train_lib.train(cfg, workdir, max_steps=2, progress=False, tensorboard=False)
  capsys.readouterr()
  result = train_lib.train(cfg, workdir, progress=False, tensorboard=False)
  assert result.finished and result.step == 6
  assert "stage 1: the state moved to the mesh data:2,context:4" in capsys.readouterr().out
  got, want = _train_losses(workdir), _train_losses(full_dir)
  assert sorted(got) == sorted(want) and [got[s] for s in (1, 2, 3)] == [want[s] for s in (1, 2, 3)]
  np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=1e-5)


def test_stage_meshes_are_checked_per_stage():
  """Each stage's mesh is checked against that stage (the error names its setting); one run-wide
  mesh is refused where the stages differ; the entries count the stages."""
  cfg = tiny_config("MeshConfig.stage_axes = ('data:8', '')")   # stage batches 4 and 2
  with pytest.raises(config_lib.ConfigError, match=r"stage 0 .* MeshConfig.stage_axes\[0\]"):
    sharding_lib.make_stage_meshes(cfg)
  meshes = sharding_lib.make_stage_meshes(tiny_config(
      "MeshConfig.stage_axes = ('data:2,context:4', '')", "MeshConfig.axes = 'context:8'"))
  assert [dict(m.shape) for m in meshes] == [{"data": 2, "context": 4, "expert": 1},
                                             {"data": 1, "context": 8, "expert": 1}]
  with pytest.raises(config_lib.ConfigError, match="MeshConfig.stage_axes .* different meshes"):
    make_run_mesh(tiny_config("MeshConfig.stage_axes = ('context:8', '')"))
  with pytest.raises(config_lib.ConfigError, match="MeshConfig.stage_axes .* one entry per stage"):
    tiny_config("MeshConfig.stage_axes = ('data:2',)")
  with pytest.raises(config_lib.ConfigError, match=r"MeshConfig.stage_axes\[1\] = 'seq:2'"):
    tiny_config("MeshConfig.stage_axes = ('', 'seq:2')")


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_to_the_newest_readable_step(full_run, tmp_path, capsys):
  """Both faults of a crash or a full disk at once: stop at step 5 (checkpoints 3, 4, 5), delete
  step 5's ocdbt.process_0/ and truncate step 4's data files. Re-running reports each in one line,
  moves both to checkpoints/corrupt/, resumes from step 3, and the losses from there equal those
  of the uninterrupted run."""
  from test_checkpoint import _damage
  full_dir, _ = full_run
  workdir = str(tmp_path / "damaged")
  cfg = tiny_config()
  train_lib.train(cfg, workdir, max_steps=5, progress=False, tensorboard=False)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  _damage(os.path.join(ckpt_dir, "5"), "ocdbt")
  _damage(os.path.join(ckpt_dir, "4"), "truncate")
  capsys.readouterr()
  result = train_lib.train(cfg, workdir, progress=False, tensorboard=False)
  out, err = capsys.readouterr()
  assert result.finished and result.step == 6
  warnings = [line for line in err.splitlines() if line.startswith("warning: checkpoint step")]
  assert len(warnings) == 2 and "step 5 cannot be read" in warnings[0] \
      and "step 4 cannot be read" in warnings[1], err
  assert "resuming from step 3" in out
  assert sorted(os.listdir(os.path.join(ckpt_dir, "corrupt"))) == ["4", "5"]
  assert _train_losses(workdir) == _train_losses(full_dir)   # exact float equality


@pytest.mark.slow
def test_changed_model_is_a_config_error_naming_the_setting(tmp_path):
  """A workdir whose checkpoints have another d_model: ConfigError (exit 2 in the CLI) naming the
  changed setting, before anything is read; the checkpoints stay where they are."""
  workdir = str(tmp_path / "run")
  train_lib.train(tiny_config(), workdir, max_steps=1, progress=False, tensorboard=False)
  with pytest.raises(config_lib.ConfigError,
                     match=r"do not fit this config .* Changed settings: ModelConfig.d_model: "
                           r"32 -> 48\. Use a new --workdir"):
    train_lib.train(tiny_config("ModelConfig.d_model = 48"), workdir, progress=False,
                    tensorboard=False)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]


def _one_step_setup(*bindings):
  cfg = tiny_config(*bindings)
  state, optimizer, schedule = train_lib.init_train_state(cfg, cfg.stages.total_steps)
  model = K3Model(cfg.model, cfg.impl)
  data = make_data(cfg)
  step_fn = train_lib.make_train_step(cfg, model, optimizer, schedule)
  it = data.train_iterator(0)
  batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(3)]
  return cfg, state, step_fn, batches


def test_qb_bias_kept_only_every_interval():
  cfg, state, step_fn, batches = _one_step_setup("ModelConfig.moe_qb_interval = 2")
  bias = lambda s: np.asarray(s.moe_state["layer_1"]["moe"]["bias"])
  b0 = bias(state)
  state, _ = step_fn(state, batches[0])     # step 0: 0 % 2 == 0, kept
  b1 = bias(state)
  assert not np.array_equal(b0, b1)
  state, _ = step_fn(state, batches[1])     # step 1: discarded
  np.testing.assert_array_equal(bias(state), b1)
  state, _ = step_fn(state, batches[2])     # step 2: kept
  assert not np.array_equal(bias(state), b1)


def test_aux_loss_is_added():
  cfg, state, step_fn, batches = _one_step_setup("ModelConfig.moe_balance = 'aux_loss'",
                                                 "ModelConfig.moe_aux_loss_coef = 0.5")
  _, m = step_fn(state, batches[0])
  assert float(m["aux_loss"]) > 0
  np.testing.assert_allclose(float(m["total_loss"]),
                             float(m["loss"]) + 0.5 * float(m["aux_loss"]), rtol=1e-6)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  real = loop_lib.make_train_step

  def poisoned(cfg, model, optimizer, schedule, *args, **kw):
    step_fn = real(cfg, model, optimizer, schedule, *args, **kw)

    def wrapped(state, batch):
      bad = state.step >= 2   # the third step (global step 2) produces NaN
      new_state, m = step_fn(state, batch)
      m = dict(m, loss=jnp.where(bad, jnp.nan, m["loss"]))
      return new_state, m
    return wrapped

  monkeypatch.setattr(loop_lib, "make_train_step", poisoned)
  workdir = str(tmp_path / "nan")
  with pytest.raises(train_lib.NonFiniteLossError, match="non-finite loss at step 3"):
    train_lib.train(tiny_config(), workdir, progress=False)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tiny_config().checkpoint,
                      read_only=True)
  assert ckpt.all_steps() == [2]      # step 3 (a stage end) was not saved
  ckpt.close()


def _cli(args, **kw):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             JAX_DEFAULT_MATMUL_PRECISION="highest")
  return subprocess.Popen([sys.executable, "-m", "k3jax.train", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _cli_forked(args):
  """`_cli`'s command run to its end in a process forked from the tests' command server
  (`testlib.run_command_forked`): for configuration errors, which compute nothing, so without
  `_cli`'s JAX_DEFAULT_MATMUL_PRECISION (the server's JAX read its own at import)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return run_command_forked("k3jax.train", args, env, REPO)


@pytest.mark.parametrize("binding, name", [
    ("ModelConfig.d_modle = 3", "d_modle"),
    ("OptimizerConfig.name = 'sgd'", "OptimizerConfig.name"),
    ("StagesConfig.tokens_per_step = 100", "StagesConfig.tokens_per_step"),
])
def test_cli_bad_setting_fails_at_start(tmp_path, binding, name):
  proc = _cli_forked([f"--gin_bindings={binding}", f"--workdir={tmp_path}"])
  out, err = proc.stdout, proc.stderr
  assert proc.returncode == 2, (out, err)
  assert name in err
  assert "Traceback" not in err


def test_importing_the_training_module_leaves_tensorboard_and_matplotlib_for_later():
  """The CLI's start-up path (the command module, then the training library it runs) does not
  import tensorboardX (which imports torch where it is installed) or matplotlib: the writer and
  the plots import them where they are made."""
  code = ("import sys, k3jax.train, k3jax.training; "
          "print(sorted(m for m in ('tensorboardX', 'matplotlib', 'torch') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"), timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_cli_rejects_bad_mesh(tmp_path):
  proc = _cli_forked(["--mesh=model:2", f"--workdir={tmp_path}"])
  err = proc.stderr
  assert proc.returncode == 2 and "MeshConfig.axes" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_sigterm_saves_and_resumes(tmp_path):
  """SIGTERM mid-run: the running step finishes, is checkpointed, exit code 143; re-running the
  same command continues from there."""
  workdir = str(tmp_path / "run")
  args = [f"--gin_bindings={b}" for b in TINY + ["StagesConfig.stages = ((16, 400),)",
                                                 "CheckpointConfig.every_steps = 1000"]]
  args += [f"--workdir={workdir}", "--noprogress"]
  proc = _cli(args)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 400
  while time.time() < deadline and len(metrics_lib.read_jsonl(metrics)) < 3:
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, (out, err)
  assert "stopped by signal" in out
  last = max(r["step"] for r in metrics_lib.read_jsonl(metrics))
  assert 3 <= last < 400
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tiny_config().checkpoint,
                      read_only=True)
  assert ckpt.latest_step() == last
  ckpt.close()
  # resume for a few steps
  proc = _cli(args + [f"--max_steps={last + 2}"])
  out, err = proc.communicate(timeout=400)
  assert proc.returncode == 0, (out, err)
  assert f"resuming from step {last}" in out
  steps = [r["step"] for r in metrics_lib.read_jsonl(metrics) if r["kind"] == "train"]
  assert steps == list(range(1, last + 3))


def test_qk_clip_shrinks_mla_query_key_weights_only_when_logits_exceed_tau():
  """One step without QK-Clip, with a tau above every logit (the same MLA weights, bit for bit)
  and with a tiny tau (the query/key weight wk_b shrinks, the value weight wv_b does not). The
  clip reads MLA layers alone: an all-MLA model (KDA layers would only add to the compiles)."""
  def mla_params_after_step(*extra):
    cfg, state, step_fn, batches = _one_step_setup("ModelConfig.mla_every = 1", *extra)
    state, _ = step_fn(state, batches[0])
    return jax.device_get(state.params["layer_1"]["mla"])
  plain = mla_params_after_step()
  loose = mla_params_after_step("OptimizerConfig.qk_clip_tau = 1e9")
  tight = mla_params_after_step("OptimizerConfig.qk_clip_tau = 1e-4")
  for name in plain:
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(loose[name])[0]),
                                  np.asarray(jax.tree.leaves(plain[name])[0]))
  norm = lambda p, n: float(np.linalg.norm(np.asarray(jax.tree.leaves(p[n])[0], np.float64)))
  assert norm(tight, "wk_b") < 0.5 * norm(plain, "wk_b")
  assert norm(tight, "wv_b") == pytest.approx(norm(plain, "wv_b"), rel=1e-6)


@pytest.mark.slow
def test_training_losses_equal_on_an_expert_mesh(tmp_path):
  """A few steps on an (expert 8) mesh give the single-device losses. The (data 2, expert 4) mesh
  trains in test_precompile (with the host micro-batch loop, against one device's losses); the
  data-only mesh is left to test_sharding (each mesh's loss and gradients)."""
  extra = ("StagesConfig.tokens_per_step = 256", "EvalConfig.passkey_multipliers = ()",
           "ModelConfig.moe_num_experts = 8")
  losses = {}
  for axes in ("", "expert:8"):
    cfg = tiny_config(*extra, f"MeshConfig.axes = '{axes}'")
    workdir = str(tmp_path / (axes.replace(":", "").replace(",", "_") or "single"))
    train_lib.train(cfg, workdir, max_steps=3, progress=False, tensorboard=False)
    losses[axes] = [l for _, l in sorted(_train_losses(workdir).items())]
  assert len(losses[""]) == 3
  for axes, got in losses.items():
    np.testing.assert_allclose(got, losses[""], rtol=1e-5, err_msg=axes)


def test_validation_too_short_for_the_last_stage_is_a_config_error():
  # Caught at start-up, not at the last stage's evaluation after all its training.
  cfg = tiny_config("StagesConfig.stages = ((16, 3), (4096, 3))",
                    "StagesConfig.tokens_per_step = 4096", "DataConfig.validation_fraction = 0.01")
  with pytest.raises(config_lib.ConfigError, match="DataConfig.validation_fraction"):
    make_data(cfg)


def test_mesh_that_cannot_split_the_batch_is_a_config_error():
  cfg = tiny_config("MeshConfig.axes = 'data:8'")   # stage batches are 4 and 2
  with pytest.raises(config_lib.ConfigError, match="StagesConfig.stages"):
    make_run_mesh(cfg)


# ------------------------------------------------------------------------------------------------
# Gradient accumulation (StagesConfig.microbatch_tokens)


def _one_step(bindings, seed=0):
  cfg = config_lib.from_gin([], TINY + bindings)
  model = K3Model(cfg.model, cfg.impl)
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10)
  step = train_lib.make_train_step(cfg, model, optimizer, schedule)
  rng = np.random.default_rng(seed)
  B, T = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  tokens = rng.integers(1, 257, (B, T + 1)).astype(np.int32)
  mask = (rng.random((B, T)) > 0.3).astype(np.float32)   # unequal token counts per micro-batch
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.ones((B, T), np.int32), "loss_mask": mask}
  initial_moe_state = jax.device_get(state.moe_state)   # the step donates `state`
  new_state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
  return initial_moe_state, new_state, metrics


def test_microbatches_give_the_whole_batch_gradient():
  """Without balance-state updates (moe_balance 'none'), 4 micro-batches of unequal token
  counts give the loss, gradients and expert loads of the whole batch at once (fp32)."""
  cfg = config_lib.from_gin([], TINY + ["ModelConfig.moe_balance = 'none'"])
  model = K3Model(cfg.model, cfg.impl)
  state, _, _ = train_lib.init_train_state(cfg, total_steps=10)
  rng = np.random.default_rng(0)
  B, T = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  tokens = rng.integers(1, 257, (B, T + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.ones((B, T), np.int32),
           "loss_mask": (rng.random((B, T)) > 0.3).astype(np.float32)}
  batch = jax.tree.map(jnp.asarray, batch)

  def loss_fn(params, moe_state, b):
    logits, mutated = model.apply({"params": params, "moe_state": moe_state}, b["inputs"],
                                  b["segment_ids"], update_balance=True,
                                  mutable=["moe_state", "moe_stats"])
    ce_sum, n = token_cross_entropy(logits, b["targets"], b["loss_mask"])
    ce = ce_sum / jnp.maximum(n, 1.0)
    return ce, (ce, jnp.zeros([], jnp.float32), mutated)

  (loss, (_, _, mut)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      state.params, state.moe_state, batch)
  (loss_m, (_, _, mut_m)), grads_m = jax.jit(
      lambda p, m, b: accumulate_lib.accumulate_scan(loss_fn, p, m, b, 4))(
          state.params, state.moe_state, batch)
  assert abs(float(loss_m) - float(loss)) <= 1e-6 * float(loss)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(grads_m), jax.tree.leaves(grads_m),
                        jax.tree.leaves(grads)):
    assert error_ratio(a, b) <= 1e-5, jax.tree_util.keystr(path[0])
  layers_m = moe_stats_by_layer(mut_m["moe_stats"])
  for name, layer in moe_stats_by_layer(mut["moe_stats"]).items():
    np.testing.assert_allclose(layers_m[name]["load"], layer["load"])
    np.testing.assert_allclose(layers_m[name]["max_vio"], layer["max_vio"], rtol=1e-6)
  # And through the real training step (the same initial state and batch as above): the whole
  # batch's loss and gradient norm.
  _, _, m_micro = _one_step(["ModelConfig.moe_balance = 'none'",
                             "StagesConfig.microbatch_tokens = 16"])
  assert abs(float(m_micro["loss"]) - float(loss)) <= 1e-6 * float(loss)
  # On host: eagerly, optax.global_norm would compile its square and sum for every leaf shape.
  grad_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)))
                                for g in jax.tree.leaves(jax.device_get(grads)))))
  assert abs(float(m_micro["grad_norm"]) - grad_norm) <= 1e-5 * grad_norm


# One stage of 16 rows of 16 tokens: 8 micro-batches of 2 rows, or 2 of 8 rows (one row per device
# of an 8-device mesh). All-MLA: the balance statistics are the MoE layer's, whatever the attention
# before it, and XLA:CPU compiles MLA layers faster than KDA's chunked ones.
QB_STEP = ["StagesConfig.tokens_per_step = 256", "StagesConfig.stages = ((16, 3),)",
           "ModelConfig.mla_every = 1"]


def _balance_after_one_step(bindings, mesh_axes=""):
  """(initial 'moe_state', 'moe_state' after one training step) on host, for TINY + QB_STEP +
  `bindings` on `mesh_axes` (one device when empty), from the same initial state and batch (some
  padding, unequal loss-mask counts per micro-batch)."""
  cfg = config_lib.from_gin([], TINY + QB_STEP + bindings + [f"MeshConfig.axes = {mesh_axes!r}"])
  mesh = make_run_mesh(cfg)
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10, mesh=mesh)
  step = mesh_train_step(cfg, state, optimizer, schedule, mesh)
  rng = np.random.default_rng(0)
  rows, seq_len = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  tokens = rng.integers(1, 257, (rows, seq_len + 1)).astype(np.int32)
  segments = np.ones((rows, seq_len), np.int32)
  segments[::3, -5:] = 0
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
           "loss_mask": (rng.random((rows, seq_len)) > 0.3).astype(np.float32) * (segments > 0)}
  initial = jax.device_get(state.moe_state)       # the step donates `state`
  if mesh is None:
    new_state, _ = step(state, jax.tree.map(jnp.asarray, batch))
  else:
    with sharding_lib.with_mesh(mesh):
      new_state, _ = step(state, sharding_lib.shard_batch(batch, mesh))
  return initial, jax.device_get(new_state.moe_state)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [
    # Histogram QB (the default, 1000 bins): int32 counts add exactly, so bit for bit.
    ["ModelConfig.moe_qb_histogram_bins = 1000"],
    # Exact QB: each expert's largest margins, merged over micro-batches. Their values are the
    # router's fp32 scores, which a differently blocked program may round differently in the last
    # bit (bit-identical here on XLA:CPU): 1e-6 of a bias whose entries are ~1e-3 to 1e-1.
    ["ModelConfig.moe_qb_histogram_bins = 0"],
    # Loss-free: one sign step per optimizer step from the step's pooled load.
    ["ModelConfig.moe_balance = 'loss_free'"],
], ids=["histogram", "exact", "loss_free"])
def test_balance_update_is_once_per_step_whatever_the_split(balance):
  """The biases after one step are those of the whole batch at once (1 micro-batch, one device)
  with 8 micro-batches in the 'scan' and the 'host' loop, and on 8-device data:2 x expert:4 (2
  micro-batches) and data:8 meshes (the histogram default; the others on data:2 x expert:4 with
  its 2 micro-batches): the statistics are pooled over the micro-batches and the devices, and the
  bias is updated once, from all of them."""
  initial, reference = _balance_after_one_step(balance)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  moved = flat(reference) - flat(initial)
  if balance[0].startswith("ModelConfig.moe_balance = 'loss_free'"):
    steps = np.abs(moved) / 1e-3        # one sign step (or none at the mean load), not 8
    assert np.all((np.abs(steps - 1) < 1e-3) | (steps < 1e-3)) and np.max(steps) > 0.5
  else:
    assert np.max(np.abs(moved)) > 1e-4
  exact = balance == ["ModelConfig.moe_qb_histogram_bins = 0"]
  cases = {"8 micro-batches, scan": (["StagesConfig.microbatch_tokens = 32"], ""),
           "8 micro-batches, host loop": (["StagesConfig.microbatch_tokens = 32",
                                           "RuntimeConfig.microbatch_loop = 'host'"], ""),
           "data:2,expert:4, 2 micro-batches": (["StagesConfig.microbatch_tokens = 128"],
                                                "data:2,expert:4"),
           "data:8": ([], "data:8")}
  if balance != ["ModelConfig.moe_qb_histogram_bins = 1000"]:
    # The loops and meshes pool the statistics the same way for every method: the default checks
    # all four; the others the mesh with micro-batches, which pools over both (the suite's time).
    cases = {name: cases[name] for name in ("data:2,expert:4, 2 micro-batches",)}
  for name, (bindings, mesh_axes) in cases.items():
    _, got = _balance_after_one_step(balance + bindings, mesh_axes)
    assert jax.tree.structure(got) == jax.tree.structure(reference)
    if exact:
      np.testing.assert_allclose(flat(got), flat(reference), rtol=0, atol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(flat(got), flat(reference), err_msg=name)


def test_microbatch_cadence_chains_the_qb_bias():
  """ModelConfig.moe_qb_cadence = 'microbatch': each micro-batch updates the bias from its own
  tokens and the next routes with it, so 8 micro-batches end elsewhere than the step's one
  update from all of them."""
  chained = ["ModelConfig.moe_qb_cadence = 'microbatch'"]
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  initial, once = _balance_after_one_step(["StagesConfig.microbatch_tokens = 32"])
  _, chain = _balance_after_one_step(chained + ["StagesConfig.microbatch_tokens = 32"])
  assert not np.allclose(flat(chain), flat(initial)) and not np.allclose(flat(chain), flat(once))


def test_microbatch_tokens_config_errors():
  with pytest.raises(config_lib.ConfigError, match="StagesConfig.microbatch_tokens"):
    config_lib.from_gin([], TINY + ["StagesConfig.microbatch_tokens = 48"])


# ------------------------------------------------------------------------------------------------
# Memory settings: sequence chunks, remat per stage, the out-of-memory message


def test_position_chunks_give_the_unchunked_step():
  """ImplConfig.position_chunk_tokens (head + loss, FFN and MoE in chunks; 24 tokens = 6 positions
  x 4 rows, 16 not a multiple): the real step's loss, gradient norm and QB biases are those of the
  unchunked step."""
  moe0, whole, m_whole = _one_step([])
  _, chunked, m_chunked = _one_step(["ImplConfig.position_chunk_tokens = 24"])
  np.testing.assert_allclose(float(m_chunked["loss"]), float(m_whole["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m_chunked["grad_norm"]), float(m_whole["grad_norm"]),
                             rtol=1e-5)
  for a, b, b0 in zip(jax.tree.leaves(chunked.moe_state), jax.tree.leaves(whole.moe_state),
                      jax.tree.leaves(moe0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(b), np.asarray(b0))
  for a, b in zip(jax.tree.leaves(chunked.params), jax.tree.leaves(whole.params)):
    assert error_ratio(a, b) <= 1e-5


def test_stage_remat_and_out_of_memory_message(tmp_path, monkeypatch):
  """Each stage's step is built from its ImplConfig.stage_remat entry; an out-of-memory error in a
  stage's step becomes StageOutOfMemoryError naming the stage, its length and batch, and the
  settings that lower memory."""
  real = loop_lib.make_train_step
  built = []

  def recording(cfg, model, optimizer, schedule, *args, **kw):
    built.append((cfg.impl.remat, model.impl.remat))
    step_fn = real(cfg, model, optimizer, schedule, *args, **kw)
    if cfg.impl.remat != "full":
      return step_fn

    def out_of_memory(state, batch):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 151397597184 bytes.")
    return out_of_memory

  monkeypatch.setattr(loop_lib, "make_train_step", recording)
  cfg = tiny_config("ImplConfig.stage_remat = ('dots', 'full')")
  with pytest.raises(train_lib.StageOutOfMemoryError) as info:
    train_lib.train(cfg, str(tmp_path / "oom"), progress=False, tensorboard=False)
  assert built == [("dots", "dots"), ("full", "full")]
  message = str(info.value)
  for part in ("stage 1 (seq_len 32, batch 2 rows", "remat 'full'", "ImplConfig.stage_remat",
               "ImplConfig.position_chunk_tokens", "StagesConfig.microbatch_tokens", "--mesh"):
    assert part in message, (part, message)
  assert "\n" not in message
  # Stage 0 ran its three steps with 'dots' and was saved at its end.
  assert Checkpointer(os.path.join(tmp_path, "oom", "checkpoints"), cfg.checkpoint,
                      read_only=True).all_steps()[-1] == 3
  assert not loop_lib.is_out_of_memory(ValueError("shapes do not match"))


def test_train_state_shapes_compile_the_step_that_the_state_runs():
  """`train_state_shapes` gives the initialised state's shapes and dtypes without computing it,
  and the step compiled against them is the one the real state runs (same optimised program)."""
  cfg = tiny_config()
  shapes, optimizer, schedule = train_lib.train_state_shapes(cfg, total_steps=10)
  state, _, _ = train_lib.init_train_state(cfg, total_steps=10)
  assert jax.tree.structure(shapes) == jax.tree.structure(state)
  for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(state)):
    assert isinstance(s, jax.ShapeDtypeStruct) and (s.shape, s.dtype) == (x.shape, x.dtype)
  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule,
                                   total_steps=10)
  b, t = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  batch = jax.device_put({"inputs": jnp.ones((b, t), jnp.int32),
                          "targets": jnp.ones((b, t), jnp.int32),
                          "segment_ids": jnp.ones((b, t), jnp.int32),
                          "loss_mask": jnp.ones((b, t), jnp.float32)}, jax.devices()[0])
  # The initialised state is committed to its device (as a step's outputs are): so are the shapes.
  assert all(x.committed for x in jax.tree.leaves(state))
  device0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device0), shapes)
  from_shapes = step.lower(placed, batch).compile().as_text()
  assert from_shapes == step.lower(state, batch).compile().as_text()


@pytest.mark.parametrize("axes", ["", "data:2,expert:4"])
def test_placed_train_state_shapes_are_where_the_initialisation_puts_the_state(axes):
  """The shapes that the run's steps start compiling from before the state exists carry the
  shapes, dtypes and shardings of the initialised state (one device; an 8-device CPU mesh)."""
  cfg = tiny_config(f"MeshConfig.axes = '{axes}'", "ModelConfig.moe_num_experts = 8",
                    "StagesConfig.tokens_per_step = 256")
  mesh = make_run_mesh(cfg)
  shapes, _, _ = train_lib.placed_train_state_shapes(cfg, 10, mesh)
  state, _, _ = train_lib.init_train_state(cfg, 10, mesh)
  assert jax.tree.structure(shapes) == jax.tree.structure(state)
  for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(state)):
    assert (s.shape, s.dtype) == (x.shape, x.dtype)
    assert s.sharding == x.sharding, (s.sharding, x.sharding)
  if mesh is not None:   # the routed experts are split over the expert axis, not replicated
    assert any(len(s.sharding.device_set) > 1 and not s.sharding.is_fully_replicated
               for s in jax.tree.leaves(shapes))
