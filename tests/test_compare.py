"""k3jax.compare and `k3jax compare`: the comparison tool on two tiny runs trained through the CLI,
and on hand-written run directories for the cases a four-step run does not have.

Every expected value is computed here from metrics.jsonl's JSON lines, not through
k3jax.training.plots' readers that the tool uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from k3jax import compare
from k3jax import config as config_lib
from k3jax.training import run_dir
from testlib import TINY_RUN_BINDINGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Four steps of one 16-token stage, every step logged, validation at steps 0, 2 and 4.
STEPS, TOKENS_PER_STEP = 4, 64
RUN_BINDINGS = TINY_RUN_BINDINGS + [
    f"StagesConfig.stages = ((16, {STEPS}),)", "EvalConfig.num_batches = 1",
    "EvalConfig.passkey_multipliers = ()", "EvalConfig.every_steps = 2",
    "EvalConfig.log_every_steps = 1"]
# The runs differ in Config.seed alone (the initialisation): their programs are the same, so the
# second run loads all of them from the compilation cache (the suite's: conftest.py).
SEEDS = {"seed0": 0, "seed1": 1}
SEED = "Config.seed"


def _env() -> dict:
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
  """{label: workdir} of two tiny runs that differ in the seed alone, trained one after the other
  through `python -m k3jax.train`."""
  root = tmp_path_factory.mktemp("compare")
  for label, seed in SEEDS.items():
    args = [f"--gin_bindings={b}" for b in RUN_BINDINGS + [f"{SEED} = {seed}"]]
    proc = subprocess.run(
        [sys.executable, "-m", "k3jax.train", *args, f"--workdir={root / label}", "--noprogress",
         "--notensorboard"], cwd=REPO, env=_env(),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (label, proc.stdout, proc.stderr)
  return {label: str(root / label) for label in SEEDS}


def _expected(workdir: str, window: int) -> dict:
  """The summary's values, from the JSON lines."""
  records = _records(workdir)
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  last = evals[-1]
  same_length = [r for r in evals if r["seq_len"] == last["seq_len"]]
  best = min(same_length, key=lambda r: r["val_loss"])
  vio = [v for k, v in train[-1].items() if k.startswith("max_vio/")]
  return {"steps": train[-1]["step"], "tokens": train[-1]["step"] * TOKENS_PER_STEP,
          "train_loss": sum(r["loss"] for r in train[-window:]) / len(train[-window:]),
          "train_loss_steps": len(train[-window:]), "val_loss": last["val_loss"],
          "val_step": last["step"], "val_seq_len": last["seq_len"],
          "best_val_loss": best["val_loss"], "best_val_step": best["step"],
          "max_vio": sum(vio) / len(vio)}


@pytest.mark.slow
def test_the_comparison_of_two_tiny_runs(trained, tmp_path):
  """One test for the trained pair: under `pytest -n 2`, tests of one module may run on both
  workers, and each would train the pair again."""
  _check_summary(trained)
  _check_figure(trained)
  _check_command(trained, tmp_path)


def _check_summary(trained):
  """The summary's values equal metrics.jsonl's; the differing setting is named."""
  runs = compare.load_runs(list(trained.values()))
  assert [r.label for r in runs] == list(trained)         # the directories' names
  compare.record_wall_time(trained["seed0"], 10.0)
  compare.record_wall_time(trained["seed0"], 2.5)          # a resumed run: its calls add up
  for window in (3, 10):                                    # 10: more than were logged
    rows = compare.summary_rows(compare.load_runs(list(trained.values())), window)
    for row, (label, workdir) in zip(rows, trained.items()):
      expected = _expected(workdir, window)
      assert row["label"] == label and row["planned_steps"] == STEPS
      for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-12), (label, key)
      assert row["config"] == {SEED: repr(SEEDS[label])}
  assert rows[0]["wall_s"] == 12.5 and rows[1]["wall_s"] is None
  assert compare.config_differences(runs) == [SEED]
  assert rows[0]["train_loss_steps"] == STEPS               # window 10: all four steps
  # The seed shows: the initialisations differ.
  assert rows[0]["val_loss"] != rows[1]["val_loss"]


def _check_figure(trained):
  """One line per run in each panel, with the records' values."""
  runs = compare.load_runs(list(trained.values()))
  fig = compare.overlay_figure(runs)
  titles = [ax.get_title() for ax in fig.axes]
  assert titles == ["training loss vs step", "training loss vs tokens seen",
                    "validation loss vs step", "MaxVio vs step (mean over MoE layers)"]
  by_title = dict(zip(titles, fig.axes))
  for i, (label, workdir) in enumerate(trained.items()):
    records = _records(workdir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r["step"] for r in train]
    losses = [r["loss"] for r in train]
    vio = [np.mean([v for k, v in r.items() if k.startswith("max_vio/")]) for r in train]
    expected = {"training loss vs step": (label, steps, losses),
                "training loss vs tokens seen": (label, [s * TOKENS_PER_STEP for s in steps],
                                                 losses),
                "validation loss vs step": (f"{label} (T=16)", [r["step"] for r in evals],
                                            [r["val_loss"] for r in evals]),
                "MaxVio vs step (mean over MoE layers)": (label, steps, vio)}
    for title, (line_label, xs, ys) in expected.items():
      lines = by_title[title].get_lines()
      assert len(lines) == len(trained), title
      assert lines[i].get_label() == line_label
      np.testing.assert_array_equal(lines[i].get_xdata(), xs)
      np.testing.assert_allclose(lines[i].get_ydata(), ys, rtol=1e-12)
    colors = [line.get_color() for line in by_title["training loss vs step"].get_lines()]
    assert len(set(colors)) == len(trained)
  assert by_title["training loss vs tokens seen"].get_xlabel() == "tokens seen"


def _check_command(trained, tmp_path):
  """`k3jax compare` prints the table it writes and writes the figure and summary.json."""
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "k3jax", "compare", *trained.values(),
                         f"--out={out}", "--labels=slow,fast", "--train_loss_window=2"],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout, proc.stderr)
  table = (out / "summary.md").read_text()
  assert proc.stdout.startswith(table)                     # the table printed is the file's
  header = table.splitlines()[0].strip("| ").split(" | ")
  assert header[-1] == SEED and SEED not in header[:-1]
  rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:4]]
  assert [r[0] for r in rows] == ["slow", "fast"]
  assert [r[-1] for r in rows] == [repr(seed) for seed in SEEDS.values()]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["config_differences"] == [SEED] and summary["train_loss_window"] == 2
  for row, workdir in zip(summary["runs"], trained.values()):
    expected = _expected(workdir, 2)
    for key, value in expected.items():
      assert row[key] == pytest.approx(value, rel=1e-12), key
  assert [r["label"] for r in summary["runs"]] == ["slow", "fast"]
  png = (out / "compare.png").read_bytes()
  assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000


# ------------------------------------------------------------------------------------------------
# Hand-written run directories
# ------------------------------------------------------------------------------------------------

def _write_run(path, records, bindings=()) -> str:
  """A run directory with these metrics records and the config of TINY_RUN_BINDINGS + bindings."""
  os.makedirs(path)
  run_dir.write_config(str(path), config_lib.from_gin([], TINY_RUN_BINDINGS + list(bindings)))
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def _train(step, loss, stage=0, **extra):
  return dict({"step": step, "kind": "train", "stage": stage, "loss": loss}, **extra)


def _eval(step, seq_len, val_loss):
  return {"step": step, "kind": "eval", "seq_len": seq_len, "val_loss": val_loss}


def test_validation_at_several_lengths_and_runs_without_moe_statistics(tmp_path):
  """The best validation loss is the lowest at the last evaluation's length (a lower loss at a
  shorter length is not better); a run that logged no MaxVio has no MaxVio panel or value."""
  # TINY_RUN_BINDINGS: stages (16, 3), (32, 3), 64 tokens a step.
  a = _write_run(tmp_path / "a", [
      _eval(0, 16, 5.5), _train(2, 5.0), _eval(2, 16, 4.0), _train(3, 4.0), _train(5, 3.0, 1),
      _eval(3, 32, 4.6), _train(6, 2.0, 1), _eval(5, 32, 4.2), _eval(6, 32, 4.4)])
  b = _write_run(tmp_path / "b", [_train(1, 6.0), _train(2, 5.0)],
                 ["ModelConfig.d_model = 48", "Config.seed = 3"])
  runs = compare.load_runs([a, b])
  rows = compare.summary_rows(runs, window=2)
  assert rows[0] | {"config": None, "workdir": None} == {
      "label": "a", "workdir": None, "steps": 6, "planned_steps": 6, "tokens": 384,
      "train_loss": 2.5, "train_loss_steps": 2, "val_loss": 4.4, "val_step": 6, "val_seq_len": 32,
      "best_val_loss": 4.2, "best_val_step": 5, "max_vio": None, "wall_s": None, "config": None}
  assert rows[1]["val_loss"] is None and rows[1]["tokens"] == 128
  assert compare.config_differences(runs) == ["Config.seed", "ModelConfig.d_model"]
  assert rows[0]["config"] == {"Config.seed": "0", "ModelConfig.d_model": "32"}
  assert rows[1]["config"] == {"Config.seed": "3", "ModelConfig.d_model": "48"}
  fig = compare.overlay_figure(runs)
  assert [ax.get_title() for ax in fig.axes] == compare.panels(runs)[:3] == [
      "training loss vs step", "training loss vs tokens seen", "validation loss vs step"]
  assert [line.get_label() for line in fig.axes[2].get_lines()] == ["a (T=16)", "a (T=32)"]
  table = compare.markdown(rows, window=2).splitlines()
  assert table[0] == ("| run | steps | tokens | train loss | val loss | best val loss | val T | "
                      "MaxVio | wall time | Config.seed | ModelConfig.d_model |")
  assert table[2] == "| a | 6/6 | 384 | 2.5000 | 4.4000 | 4.2000 (step 5) | 32 | - | - | 0 | 32 |"


def test_bad_input_names_the_path_and_what_is_expected(tmp_path):
  good = _write_run(tmp_path / "good", [_train(1, 6.0)])
  (tmp_path / "empty").mkdir()
  no_train = _write_run(tmp_path / "no_train", [_eval(0, 16, 5.5)])
  broken = _write_run(tmp_path / "broken", [_train(1, 6.0)])
  with open(os.path.join(broken, "metrics.jsonl"), "a") as f:
    f.write('{"step": 2, "kind": "tra\n')
  no_config = tmp_path / "no_config"
  no_config.mkdir()
  (no_config / "metrics.jsonl").write_text(json.dumps(_train(1, 6.0)) + "\n")
  cases = [([], None, "no run directories given"),
           ([good, good], None, "two runs are labelled 'good'"),
           ([good], ["x", "y"], "--labels has 2 labels for 1 run directory"),
           ([str(tmp_path / "missing")], None, f"run directory {tmp_path / 'missing'} does not "
            "exist: expected a run directory written by `k3jax train`"),
           ([str(tmp_path / "empty")], None, f"{tmp_path / 'empty'} has no metrics.jsonl"),
           ([no_train], None, f"{no_train}/metrics.jsonl has no training record with a loss"),
           ([broken], None, f"{broken}/metrics.jsonl is not JSON lines"),
           ([str(no_config)], None, f"{no_config} has no config.gin")]
  for workdirs, labels, message in cases:
    with pytest.raises(compare.CompareError) as e:
      compare.load_runs(workdirs, labels)
    assert message in str(e.value), (message, str(e.value))
  assert [r.label for r in compare.load_runs([good, good], ["x", "y"])] == ["x", "y"]
  (tmp_path / "a_file").write_text("")
  with pytest.raises(compare.CompareError, match="is a file, not a directory"):
    compare.write_comparison(compare.load_runs([good]), str(tmp_path / "a_file"))
