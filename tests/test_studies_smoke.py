"""experiments/studies: launchers end to end, for a couple of steps of a smaller model (their runs
through the real CLI, their sections, their plots), into a temporary root, RESULTS.md and plots
folder: balance (with the per-step loads of EvalConfig.log_expert_loads) and context_extension
(with its passkey measurements of the final checkpoints)."""

from __future__ import annotations

import json
import os

from testlib import TINY_RUN_BINDINGS, load_experiment

balance = load_experiment("studies", "balance")


def test_the_balance_launcher_trains_and_writes_its_section(tmp_path):
  # A smaller model and corpus than the tiny scale's, at tiny.gin's layer pattern; two steps.
  small = [b for b in TINY_RUN_BINDINGS if not b.startswith(("StagesConfig", "ModelConfig.moe"))]
  argv = [f"--root={tmp_path / 'runs'}", f"--results={tmp_path / 'RESULTS.md'}",
          f"--plots={tmp_path / 'plots'}", "--max_steps=2", "--seeds=0",
          "--settings=quantile_e64"] + [f"--bindings={b}" for b in small + [
              "ModelConfig.moe_latent_dim = 16", "ModelConfig.moe_shared_dim = 16",
              "EvalConfig.num_batches = 1", "EvalConfig.every_steps = 1"]]
  body = balance.main(argv)
  text = open(tmp_path / "RESULTS.md").read()
  assert "<!-- study: balance -->" in text and body.strip() in text
  row = [line for line in body.splitlines() if line.startswith("| quantile_e64 |")]
  assert len(row) == 1
  cells = [c.strip() for c in row[0].split("|")[1:-1]]
  # final val loss, global MaxVio (from the logged loads), per-batch, validation, dead experts.
  assert all(c != "-" for c in cells[1:6]), cells
  assert cells[-1].startswith("`python -m k3jax train ") and \
      "EvalConfig.log_expert_loads = True" in cells[-1]
  assert sorted(os.listdir(tmp_path / "plots")) == ["balance.png", "balance_maxvio.png"]
  workdir = tmp_path / "runs" / "balance" / "quantile_e64_seed0"
  steps, loads = balance.step_loads(str(workdir))
  assert list(steps) == [1, 2] and len(loads) == 1      # TINY_RUN_BINDINGS: one MoE layer
  (load,) = loads.values()
  # Each step routes its 1024 tokens (packed rows: all valid) to 8 experts each.
  assert load.shape == (2, 64) and (load.sum(axis=1) == 8 * 1024).all()


context_extension = load_experiment("studies", "context_extension")


def test_the_context_extension_launcher_trains_measures_and_writes_its_section(tmp_path,
                                                                               monkeypatch):
  # Both settings for two steps of a smaller model (staged: 128, final_only: L = 256), 2 rows
  # at 1x and 2x L.
  small = [b for b in TINY_RUN_BINDINGS if not b.startswith("StagesConfig")]
  argv = [f"--root={tmp_path / 'runs'}", f"--results={tmp_path / 'RESULTS.md'}",
          f"--plots={tmp_path / 'plots'}", "--max_steps=2", "--seeds=0", "--samples=2",
          "--multipliers=1,2"] + [f"--bindings={b}" for b in small + [
              "StagesConfig.tokens_per_step = 1024", "EvalConfig.num_batches = 1"]]
  body = context_extension.main(argv)
  text = open(tmp_path / "RESULTS.md").read()
  assert "<!-- study: context_extension -->" in text and body.strip() in text
  for setting in ("staged", "final_only"):
    [row] = [line for line in body.splitlines() if line.startswith(f"| {setting} |")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # 1x (256), 2x (512): accuracies of 2 rows; the answer loss.
    assert all(0.0 <= float(c) <= 1.0 for c in cells[1:3]), cells
    assert float(cells[3]) > 0, cells
    workdir = tmp_path / "runs" / "context_extension" / f"{setting}_seed0"
    saved = json.load(open(workdir / context_extension.CACHE_FILE))
    assert saved["key"]["lengths"] == [256, 512] and saved["key"]["step"] == 2
  assert "| 1x (256) | 2x (512) | answer loss |" in body and "**Verdict: " in body
  assert sorted(os.listdir(tmp_path / "plots")) == ["context_extension.png",
                                                    "context_extension_val_loss.png"]

  # Again: the runs are finished and their accuracies kept, so nothing is trained or measured.
  def refuse(*args, **kwargs):
    raise AssertionError("measured again")
  monkeypatch.setattr(context_extension, "passkey_accuracies", refuse)
  assert context_extension.main(argv) == body
