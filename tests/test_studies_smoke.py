"""experiments/studies: one launcher end to end, for a couple of steps of a smaller model (its
runs through the real CLI with the per-step loads of EvalConfig.log_expert_loads, its section, its
plots), into a temporary root, RESULTS.md and plots folder."""

from __future__ import annotations

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
