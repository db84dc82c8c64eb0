"""Tests of k3jax.training.evaluation (and the k3jax.evaluate CLI): metrics helpers, validation
through the hidden states (loss by position inside the document), passkey limits, and restoring a
run directory for evaluation."""

from __future__ import annotations

import dataclasses
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
from k3jax import training as train_lib
from k3jax.data import synthetic
from k3jax.data.tokenizers import ByteTokenizer
from k3jax.model import K3Model
from k3jax.model.stats import max_violation, moe_stats_by_layer
from k3jax.training import evaluation as evaluate_lib
from k3jax.training import run_dir
from k3jax.training.checkpoint import Checkpointer
from k3jax.training.loss import token_cross_entropy
from k3jax.training.run_data import make_data
from testlib import TINY_RUN_BINDINGS, random_like

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_RUN_BINDINGS + [
    "EvalConfig.num_batches = 2",
    "EvalConfig.passkey_multipliers = (1, 8)", "EvalConfig.passkey_samples = 2",
]


def test_max_violation_closed_form():
  assert max_violation(np.array([2.0, 2.0, 2.0, 2.0])) == 0.0
  # mean 2.5, max 4 -> (4 - 2.5) / 2.5
  np.testing.assert_allclose(max_violation(np.array([1.0, 4.0, 2.0, 3.0])), 0.6)


def test_moe_stats_by_layer_orders_layers_numerically():
  stats = {"layer_10": {"moe": {"load": np.ones(2), "max_vio": 0.1}},
           "layer_2": {"moe": {"load": np.zeros(2), "max_vio": (0.0, 0.2)}}}
  out = moe_stats_by_layer(stats)
  assert list(out) == ["layer_2/moe", "layer_10/moe"]
  assert out["layer_2/moe"]["max_vio"] == 0.2     # sown tuples: the last call's value


def test_token_cross_entropy_matches_naive():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 3)).astype(np.int32)
  mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
  s, n = token_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
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


def _random_train_state(cfg):
  """A train state of `cfg`'s shapes holding random values (floats ~ N(0, 0.3²)): no initialiser
  compiled (`init_train_state` runs the model's forward pass), and no two weights alike."""
  shapes, _, _ = train_lib.train_state_shapes(cfg, cfg.stages.total_steps)
  return jax.tree.map(jnp.asarray, random_like(shapes, seed=0, scale=0.3))


def _make_run_dir(tmp_path):
  """A run directory as k3jax.training.train leaves it (config.gin + a checkpoint of step 3), built
  from a state of random values so that no training is needed."""
  cfg = config_lib.from_gin([], TINY)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  run_dir.write_config(workdir, cfg)
  state = _random_train_state(cfg)
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
  data = make_data(cfg)
  apply = jax.jit(K3Model(cfg.model, cfg.impl).apply)
  total, count = 0.0, 0.0
  for batch in data.validation_batches(16, 4, 2):
    logits = apply({"params": params, "moe_state": moe_state}, jnp.asarray(batch["inputs"]),
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
  with open(os.path.join(workdir, "eval_step3_len16.json")) as f:
    results = json.load(f)
  assert results["step"] == 3 and results["seq_len"] == 16 and math.isfinite(results["val_loss"])
  # Another length is another file: the first result stays.
  other = subprocess.run([sys.executable, "-m", "k3jax.evaluate", f"--workdir={workdir}",
                          "--step=3", "--seq_len=32"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
  assert other.returncode == 0, other.stderr
  with open(os.path.join(workdir, "eval_step3_len32.json")) as f:
    assert json.load(f)["seq_len"] == 32
  with open(os.path.join(workdir, "eval_step3_len16.json")) as f:
    assert json.load(f) == results
  bad = subprocess.run([sys.executable, "-m", "k3jax.evaluate", f"--workdir={workdir}",
                        "--step=7"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert bad.returncode == 2 and "step=7" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------------------
# Validation through the hidden states: loss by position, passkey limits
# ------------------------------------------------------------------------------------------------

BUCKETS = "EvalConfig.position_buckets = (0, 3, 9, 16, 64)"


@pytest.fixture(scope="module")
def chunked_setup():
  """A tiny config whose head and loss run in chunks of 24 tokens (the 64-token validation
  batches take 3 chunks), its data, model and a state of random values (`_random_train_state`)."""
  cfg = config_lib.from_gin([], TINY + [BUCKETS, "ImplConfig.position_chunk_tokens = 24",
                                        "EvalConfig.passkey_max_len = 128"])
  state = _random_train_state(cfg)
  model = K3Model(cfg.model, cfg.impl)
  assert model.impl.position_chunk_tokens == 24     # the evaluator chunks by the model's impl
  return cfg, make_data(cfg), model, state


def _naive_positions(segment_ids):
  out = np.zeros(segment_ids.shape, np.int64)
  for b, t in np.ndindex(*segment_ids.shape):
    if t and segment_ids[b, t] == segment_ids[b, t - 1]:
      out[b, t] = out[b, t - 1] + 1
  return out


def test_validation_equals_the_logits_path(chunked_setup):
  cfg, data, model, state = chunked_setup
  evaluator = evaluate_lib.Evaluator(cfg, model, data)
  results = evaluator.validation(state.params, state.moe_state, 16)
  # Reference: full logits, token_cross_entropy, and buckets by a loop over the positions.
  edges = (0, 3, 9, 16)
  total, count = 0.0, 0.0
  sums, counts = np.zeros(len(edges)), np.zeros(len(edges))
  apply = jax.jit(model.apply)
  for batch in data.validation_batches(16, 4, 2):
    logits = apply({"params": state.params, "moe_state": state.moe_state},
                   jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"]))
    s, n = token_cross_entropy(logits, jnp.asarray(batch["targets"]),
                               jnp.asarray(batch["loss_mask"]))
    total += float(s)
    count += float(n)
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.asarray(batch["targets"])), np.float64) * batch["loss_mask"]
    bucket = np.searchsorted(edges, _naive_positions(batch["segment_ids"]), side="right") - 1
    for k in range(len(edges)):
      sums[k] += ce[bucket == k].sum()
      counts[k] += batch["loss_mask"][bucket == k].sum()
  np.testing.assert_allclose(results["val_loss"], total / count, rtol=1e-5)
  assert results["val_tokens"] == int(count)
  np.testing.assert_allclose(results["val_bpb"], results["val_loss"] / math.log(2))
  assert "val_max_vio/layer_1/moe" in results
  for name, s, n in zip(["0-3", "3-9", "9-16"], sums, counts):
    assert results[f"val_tokens_by_pos/{name}"] == int(n) and n > 0
    np.testing.assert_allclose(results[f"val_loss_by_pos/{name}"], s / n, rtol=1e-5)
  # Positions are < 16 at seq_len 16: the buckets from 16 on are left out, not reported empty.
  assert [k for k in results if "_by_pos/" in k and k.split("/")[1].startswith(("16-", "64-"))] \
      == []
  # The 16-64 bucket exists at seq_len 32; those rows hold documents longer than 16 tokens.
  longer = evaluator.validation(state.params, state.moe_state, 32)
  assert longer["val_tokens_by_pos/16-64"] > 0 and "val_loss_by_pos/64-inf" not in longer


def test_passkey_skips_lengths_above_the_limit_and_matches_full_logits(chunked_setup):
  cfg, data, model, state = chunked_setup
  cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval,
                                                          passkey_multipliers=(1, 8, 16)))
  evaluator = evaluate_lib.Evaluator(cfg, model, data)
  out = evaluator.passkey(state.params, state.moe_state, 16, seed=3)
  # 16 is shorter than the task (None), 128 runs, 256 > passkey_max_len = 128 is not run.
  assert out["passkey/16"] is None and "passkey/256" not in out
  assert out["passkey_skipped_lengths"] == [256]
  # Reference: the full logits of the same batch; the answer window's logits are their tail.
  batch = synthetic.passkey_batch(np.random.default_rng([3, 128]), cfg.eval.passkey_samples, 128,
                                  data.tokenizer, filler_tokens=data.filler_tokens)
  logits = jax.jit(model.apply)({"params": state.params, "moe_state": state.moe_state},
                                jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"]))
  assert out["passkey/128"] == float(np.mean(synthetic.passkey_accuracy(logits, batch)))
  first, end = evaluate_lib.answer_window(batch["loss_mask"])
  assert (first, end) == (123, 128)       # the 5 answer bytes of the byte tokenizer
  window = evaluator._answer_logits(state.params, state.moe_state,
                                    evaluate_lib._device_batch(batch), first)
  np.testing.assert_allclose(np.asarray(window), np.asarray(logits)[:, first:], rtol=1e-5,
                             atol=1e-5)
  # Nothing skipped: no skip entry.
  short = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, passkey_multipliers=(1,)))
  assert "passkey_skipped_lengths" not in evaluate_lib.Evaluator(short, model, data).passkey(
      state.params, state.moe_state, 16)


def test_answer_window():
  mask = np.zeros((2, 10))
  mask[0, 7:] = 1
  mask[1, 8:] = 1
  assert evaluate_lib.answer_window(mask) == (7, 10)
  with pytest.raises(ValueError, match="marks no answer"):
    evaluate_lib.answer_window(np.zeros((2, 10)))


def test_format_eval_puts_the_buckets_on_one_line():
  results = {"seq_len": 16, "val_loss": 2.5, "val_loss_by_pos/0-3": 3.0,
             "val_tokens_by_pos/0-3": 12, "val_loss_by_pos/3-inf": None,
             "val_tokens_by_pos/3-inf": 0, "passkey/16": None}
  lines = evaluate_lib.format_eval(results).splitlines()
  assert len(lines) == 4
  assert lines[2].split() == ["val_loss_by_pos", "0-3:", "3.0000", "(12)", "|", "3-inf:", "-",
                              "(0)"]
  assert lines[3].split() == ["passkey/16", "None"]


def test_bucket_names():
  assert evaluate_lib.bucket_names((0, 1024, 8192)) == ["0-1024", "1024-8192", "8192-inf"]


@pytest.mark.parametrize("binding,field", [
    ("EvalConfig.passkey_max_len = 0", "EvalConfig.passkey_max_len"),
    ("EvalConfig.passkey_max_len = 1.5", "EvalConfig.passkey_max_len"),
    ("EvalConfig.position_buckets = (1, 8)", "EvalConfig.position_buckets"),
    ("EvalConfig.position_buckets = (0, 8, 8)", "EvalConfig.position_buckets"),
    ("EvalConfig.position_buckets = (0, 8, 4)", "EvalConfig.position_buckets"),
    ("EvalConfig.position_buckets = (0, 2.5)", "EvalConfig.position_buckets"),
])
def test_eval_config_validation_names_the_field(binding, field):
  with pytest.raises(config_lib.ConfigError, match=field + ".*is not allowed"):
    config_lib.from_gin([], TINY + [binding])


def test_loss_by_position_plot_takes_each_stage_last_evaluation(tmp_path):
  from k3jax.training import plots
  records = [{"step": 1, "stage": 0, "seq_len": 4, "val_loss_by_pos/0-4": 3.0,
              "val_loss_by_pos/4-inf": 2.9},
             {"step": 2, "stage": 0, "seq_len": 4, "val_loss_by_pos/0-4": 2.0,
              "val_loss_by_pos/4-inf": None},
             {"step": 3, "stage": 1, "seq_len": 8, "val_loss_by_pos/0-4": 1.5,
              "val_loss_by_pos/4-inf": 1.2},
             {"step": 4, "stage": 1, "seq_len": 8, "val_loss": 1.4}]  # no buckets
  assert plots.loss_by_position_per_stage(records) == {0: {"0-4": 2.0},
                                                       1: {"0-4": 1.5, "4-inf": 1.2}}
  written = plots.make_all(str(tmp_path), [], records, [(4, 1), (8, 1)], None, [], {})
  path = os.path.join(str(tmp_path), "loss_by_position.png")
  assert path in written and os.path.getsize(path) > 1000
