"""Tests of k3jax.evaluate: metrics helpers, and restoring a run directory for evaluation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax import config as config_lib
from k3jax import evaluate as evaluate_lib
from k3jax import train as train_lib
from k3jax.checkpoint import Checkpointer
from k3jax.data import synthetic
from k3jax.data.tokenizers import ByteTokenizer
from testlib import TINY_RUN_BINDINGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_RUN_BINDINGS + [
    "EvalConfig.num_batches = 2",
    "EvalConfig.passkey_multipliers = (1, 8)", "EvalConfig.passkey_samples = 2",
]


def test_max_violation_closed_form():
  assert evaluate_lib.max_violation(np.array([2.0, 2.0, 2.0, 2.0])) == 0.0
  # mean 2.5, max 4 -> (4 - 2.5) / 2.5
  np.testing.assert_allclose(evaluate_lib.max_violation(np.array([1.0, 4.0, 2.0, 3.0])), 0.6)


def test_moe_stats_by_layer_orders_layers_numerically():
  stats = {"layer_10": {"moe": {"load": np.ones(2), "max_vio": 0.1}},
           "layer_2": {"moe": {"load": np.zeros(2), "max_vio": (0.0, 0.2)}}}
  out = evaluate_lib.moe_stats_by_layer(stats)
  assert list(out) == ["layer_2/moe", "layer_10/moe"]
  assert out["layer_2/moe"]["max_vio"] == 0.2     # sown tuples: the last call's value


def test_token_cross_entropy_matches_naive():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 3)).astype(np.int32)
  mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
  s, n = evaluate_lib.token_cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                          jnp.asarray(mask))
  naive = 0.0
  for b in range(2):
    for t in range(3):
      if mask[b, t]:
        z = logits[b, t].astype(np.float64)
        naive += math.log(np.exp(z).sum()) - z[targets[b, t]]
  np.testing.assert_allclose(float(s), naive, rtol=1e-5)
  assert float(n) == 4.0


def test_passkey_min_len_is_exact():
  tok = ByteTokenizer()
  n = evaluate_lib.passkey_min_len(tok)
  synthetic.passkey_batch(0, 1, n, tok)                      # accepted
  with pytest.raises(ValueError, match="too short"):
    synthetic.passkey_batch(0, 1, n - 1, tok)


def _make_run_dir(tmp_path):
  """A run directory as k3jax.train leaves it (config.gin + a checkpoint of step 3), built from
  an initialised state so that no training is needed."""
  cfg = config_lib.from_gin([], TINY)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  train_lib.write_config(workdir, cfg)
  state, _, _ = train_lib.init_train_state(cfg, cfg.stages.total_steps)
  # Give the balance biases non-trivial values, which inference routing must use.
  moe_state = jax.tree.map(lambda b: b + jnp.arange(b.shape[-1], dtype=b.dtype) * 0.1,
                           state.moe_state)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
  ckpt.save(3, params=state.params, moe_state=moe_state, opt_state=state.opt_state,
            rng=state.rng, meta={"stage": 0, "seq_len": 16, "data_position": 3})
  ckpt.wait()
  ckpt.close()
  return cfg, workdir, state.params, moe_state


@pytest.mark.slow
def test_evaluate_workdir_matches_direct_evaluation(tmp_path):
  cfg, workdir, params, moe_state = _make_run_dir(tmp_path)
  results = evaluate_lib.evaluate_workdir(workdir)
  assert results["step"] == 3 and results["seq_len"] == 16
  # Reference: the model applied directly to the same validation batches.
  data = train_lib.make_data(cfg)
  model = train_lib.K3Model(cfg.model)
  total, count = 0.0, 0.0
  for batch in data.validation_batches(16, 4, 2):
    logits = model.apply({"params": params, "moe_state": moe_state}, jnp.asarray(batch["inputs"]),
                         jnp.asarray(batch["segment_ids"]))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["targets"]))
    total += float(jnp.sum(ce * batch["loss_mask"]))
    count += float(np.sum(batch["loss_mask"]))
  np.testing.assert_allclose(results["val_loss"], total / count, rtol=1e-5)
  np.testing.assert_allclose(results["val_bpb"], results["val_loss"] / math.log(2))
  assert results["passkey/16"] is None          # shorter than the task needs: reported as None
  assert 0.0 <= results["passkey/128"] <= 1.0
  assert "val_max_vio/layer_1/moe" in results and results["val_max_vio/layer_1/moe"] >= 0


def test_evaluate_workdir_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.gin"):
    evaluate_lib.evaluate_workdir(str(tmp_path))
  with pytest.raises(ValueError, match="seq_len=0 is not allowed"):   # was: silently 2048
    evaluate_lib.evaluate_workdir(str(tmp_path), seq_len=0)


@pytest.mark.slow
def test_evaluate_cli(tmp_path):
  _, workdir, _, _ = _make_run_dir(tmp_path)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "k3jax.evaluate", f"--workdir={workdir}",
                         "--step=3"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert "val_loss" in proc.stdout
  with open(os.path.join(workdir, "eval_step3.json")) as f:
    results = json.load(f)
  assert results["step"] == 3 and math.isfinite(results["val_loss"])
  bad = subprocess.run([sys.executable, "-m", "k3jax.evaluate", f"--workdir={workdir}",
                        "--step=7"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert bad.returncode == 2 and "step=7" in bad.stderr and "Traceback" not in bad.stderr
