"""experiments/studies/common.py: the seeds' mean and range, one study's section of RESULTS.md,
the section's table, and the launcher's skipping of finished runs (hand-written run directories;
nothing is trained)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess

import pytest

from k3jax import config as config_lib
from k3jax.training import run_dir
from testlib import TINY_RUN_BINDINGS, load_experiment

common = load_experiment("studies", "common")


def test_mean_min_max_over_the_finite_values():
  spread = common.mean_min_max([5.0, None, float("nan"), 6.5, 5.5])
  assert (spread.n, spread.lo, spread.hi) == (3, 5.0, 6.5)
  assert spread.mean == pytest.approx((5.0 + 6.5 + 5.5) / 3, rel=1e-15)
  assert spread.format() == "5.6667 [5.0000, 6.5000]"
  assert spread.format(2) == "5.67 [5.00, 6.50]"
  assert common.mean_min_max([4.25]).format() == "4.2500"
  empty = common.mean_min_max([None, float("inf")])
  assert empty.n == 0 and math.isnan(empty.mean) and empty.format() == "-"


def test_a_study_section_is_replaced_and_the_others_are_kept():
  text = common.replace_section(common.RESULTS_HEADER, "lr", "## lr\n\nfirst")
  text = common.replace_section(text, "lr2", "## lr2\n\nother\n")
  assert text == (common.RESULTS_HEADER + "\n<!-- study: lr -->\n## lr\n\nfirst\n"
                  "<!-- end of study: lr -->\n\n<!-- study: lr2 -->\n## lr2\n\nother\n"
                  "<!-- end of study: lr2 -->\n")
  # 'lr' again: in place, whatever its length; lr2 (whose name starts with lr) is untouched.
  again = common.replace_section(text, "lr", "## lr\n\nsecond\nand a line more")
  assert again == text.replace("first\n", "second\nand a line more\n")
  assert common.replace_section(again, "lr", "## lr\n\nfirst") == text
  # Text a person added after the sections stays where it is.
  notes = text + "\nA note by hand.\n"
  assert common.replace_section(notes, "lr2", "x") == notes.replace("## lr2\n\nother\n", "x\n")
  with pytest.raises(ValueError, match="the section of study 'lr' has no end marker"):
    common.replace_section(text.replace("<!-- end of study: lr -->", ""), "lr", "x")


def test_write_section_creates_the_file_and_rewrites_one_section(tmp_path):
  path = str(tmp_path / "RESULTS.md")
  common.write_section("a", "## a\n\none", path)
  common.write_section("b", "## b\n\ntwo", path)
  common.write_section("a", "## a\n\nthree", path)
  text = open(path).read()
  assert text.startswith(common.RESULTS_HEADER)
  assert text.index("## a\n\nthree") < text.index("## b\n\ntwo")
  assert "one" not in text and text.count("<!-- study: a -->") == 1
  assert sorted(os.listdir(tmp_path)) == ["RESULTS.md"]


def _record(setting, seed, wall_s, bindings=("OptimizerConfig.learning_rate = 0.001",)):
  return common.RunRecord(setting, tuple(bindings), seed, f"runs/st/{setting}_seed{seed}", (),
                          wall_s, False)


def test_the_section_table_has_a_row_per_setting():
  records = [_record("low", 0, 30.0), _record("low", 1, 50.0), _record("high", 0, None)]
  rows = [{"val_loss": 5.0, "tokens": 256}, {"val_loss": 5.5, "tokens": 256},
          {"val_loss": 4.0, "tokens": 512}]
  body = common.section_body("st", "Two learning rates.", records, rows, "val_loss",
                             ["gin_configs/tiny.gin"], "runs", max_steps=4)
  lines = body.splitlines()
  assert lines[:3] == ["## st", "", "Two learning rates."]
  assert lines[4] == "| setting | val_loss | seeds | tokens | wall time per run | command |"
  command = ("python -m k3jax train --gin_file=gin_configs/tiny.gin "
             "'--gin_bindings=OptimizerConfig.learning_rate = 0.001' "
             "'--gin_bindings=Config.seed = SEED' '--gin_bindings=DataConfig.seed = SEED' "
             "--workdir=runs/st/low_seedSEED --noprogress --max_steps=4")
  assert lines[6] == f"| low | 5.2500 [5.0000, 5.5000] | 0, 1 | 256 | 40 s | `{command}` |"
  assert lines[7].startswith("| high | 4.0000 | 0 | 512 | - | `python -m k3jax train ")
  assert lines[-1] == "![st](plots/st.png)"


def _finished_run(workdir: str, steps: int = 6, final_step: int = 6) -> None:
  """A run directory as `k3jax train` leaves it after `steps` steps (the config of
  TINY_RUN_BINDINGS plans 6), its eval.json's final evaluation at `final_step`."""
  os.makedirs(workdir, exist_ok=True)
  run_dir.write_config(workdir, config_lib.from_gin([], TINY_RUN_BINDINGS))
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      f.write(json.dumps({"step": step, "kind": "train", "loss": 6.0 - 0.1 * step}) + "\n")
  with open(os.path.join(workdir, "eval.json"), "w") as f:
    json.dump({"final": {"step": final_step, "val_loss": 5.0}}, f)


def test_is_finished(tmp_path):
  _finished_run(str(tmp_path / "done"))
  _finished_run(str(tmp_path / "stopped"), steps=4, final_step=4)
  _finished_run(str(tmp_path / "killed"), steps=6, final_step=4)   # eval.json of an earlier call
  assert common.is_finished(str(tmp_path / "done"))
  assert not common.is_finished(str(tmp_path / "stopped"))
  assert common.is_finished(str(tmp_path / "stopped"), max_steps=4)
  assert not common.is_finished(str(tmp_path / "killed"))
  assert not common.is_finished(str(tmp_path / "missing"))


def test_run_settings_trains_the_unfinished_runs_only(tmp_path):
  root = str(tmp_path / "runs")
  settings = [common.Setting("a", ("OptimizerConfig.learning_rate = 0.001",))]
  _finished_run(common.workdir_of(root, "st", "a", 0))
  calls = []

  def fake_train(cmd, cwd):
    """Stands for `k3jax train`: leaves a finished run in the command's --workdir."""
    calls.append(cmd)
    assert cwd == common.REPO
    _finished_run([arg.split("=", 1)[1] for arg in cmd if arg.startswith("--workdir=")][0])
    return subprocess.CompletedProcess(cmd, 0)

  records = common.run_settings("st", settings, [0, 1], root, ["gin_configs/tiny.gin"],
                                log=lambda line: None, run=fake_train)
  workdir = os.path.join(root, "st", "a_seed1")
  assert calls == [[common.sys.executable, "-m", "k3jax", "train",
                    "--gin_file=gin_configs/tiny.gin",
                    "--gin_bindings=OptimizerConfig.learning_rate = 0.001",
                    "--gin_bindings=Config.seed = 1", "--gin_bindings=DataConfig.seed = 1",
                    f"--workdir={workdir}", "--noprogress"]]
  assert [(r.setting, r.seed, r.skipped) for r in records] == [("a", 0, True), ("a", 1, False)]
  assert records[0].wall_s is None and records[1].wall_s >= 0
  with open(os.path.join(workdir, "wall_time.json")) as f:
    assert json.load(f) == {"wall_s": records[1].wall_s, "calls": 1}
  # Launched again: everything is finished, nothing runs.
  again = common.run_settings("st", settings, [0, 1], root, ["gin_configs/tiny.gin"],
                              log=lambda line: None, run=fake_train)
  assert len(calls) == 1 and [r.skipped for r in again] == [True, True]
  assert again[1].wall_s == records[1].wall_s

  def failing(cmd, cwd):
    return subprocess.CompletedProcess(cmd, 3)

  with pytest.raises(common.StudyRunError) as e:
    common.run_settings("st", settings, [2], root, ["gin_configs/tiny.gin"],
                        log=lambda line: None, run=failing)
  assert str(e.value).endswith("--workdir=" + shlex.quote(common.workdir_of(root, "st", "a", 2))
                               + " --noprogress exited with code 3")
  with pytest.raises(ValueError, match="directory names"):
    common.run_settings("st", [common.Setting("a b")], [0], root, [], run=failing)


def test_a_table_of_several_columns_with_values_from_the_runs():
  records = [_record("a", 0, 30.0), _record("a", 1, 50.0), _record("b", 0, 10.0)]
  rows = [{"val_loss": 5.0, "tokens": 256}] * 3
  runs = [{"x": 1.0}, {"x": 3.0}, {"x": None}]
  columns = [common.Column("val", lambda rec, row, run: row["val_loss"], "the loss."),
             common.Column("x", lambda rec, row, run: run["x"], "a value of the run.", 1)]
  body = common.section_body("st", "About.", records, rows, "val_loss", ["g.gin"], "runs",
                             columns=columns, runs=runs, title="## st: tiny", after="Verdict.",
                             plots=["st.png", "st_more.png"])
  lines = body.splitlines()
  assert lines[0] == "## st: tiny"
  assert lines[4] == "| setting | val | x | seeds | tokens | wall time per run | command |"
  assert lines[5] == "|---|---|---|---|---|---|---|"
  assert lines[6].startswith("| a | 5.0000 [5.0000, 5.0000] | 2.0 [1.0, 3.0] | 0, 1 | 256 | 40 s "
                             "| `python -m k3jax train --gin_file=g.gin ")
  assert lines[7].startswith("| b | 5.0000 | - | 0 | 256 | 10 s |")
  assert "val: the loss. x: a value of the run." in lines[9]
  assert lines[-4:] == ["Verdict.", "", "![st](plots/st.png)", "![st_more](plots/st_more.png)"]
  with pytest.raises(ValueError, match="metric 'nope'"):
    common.metric_column("nope")


def test_parse_args_and_the_scales():
  args = common.parse_args([], "doc")
  assert (args.scale, args.root, args.seeds, args.settings, args.max_steps) == (
      "tiny", "runs/studies", (0, 1, 2), None, None)
  assert args.results == common.RESULTS and args.plots == common.PLOTS and args.bindings == []
  args = common.parse_args(["--scale=small", "--seeds=0,2", "--settings=a,b", "--max_steps=3",
                            "--bindings=X.y = 1", "--bindings=X.z = 2"], "doc")
  assert (args.root, args.seeds, args.settings, args.max_steps, args.bindings) == (
      "runs/studies_small", (0, 2), ["a", "b"], 3, ["X.y = 1", "X.z = 2"])
  small = common.SCALES["small"]
  assert small.gin_files == ("gin_configs/small.gin",) and small.suffix == "_small"
  assert "StagesConfig.stages = ((8192, 300),)" in small.bindings
  # Every scale's bindings make a valid config with its gin files.
  for scale in common.SCALES.values():
    config_lib.from_gin([os.path.join(common.REPO, f) for f in scale.gin_files],
                        list(scale.bindings))


def test_a_setting_with_its_own_seeds(tmp_path):
  calls = []

  def fake_train(cmd, cwd):
    calls.append(cmd)
    _finished_run([arg.split("=", 1)[1] for arg in cmd if arg.startswith("--workdir=")][0])
    return subprocess.CompletedProcess(cmd, 0)

  settings = [common.Setting("a"), common.Setting("b", (), seeds=(0,))]
  records = common.run_settings("st", settings, [0, 1], str(tmp_path), ["g.gin"],
                                log=lambda line: None, run=fake_train)
  assert [(r.setting, r.seed) for r in records] == [("a", 0), ("a", 1), ("b", 0)]
  assert calls[0][1:4] == ["-m", "k3jax", "train"]


def _loads_run(workdir, loads_by_step):
  """metrics.jsonl with training records carrying loads of one layer (a step without loads too)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "kind": "eval", "val_loss": 6.0}) + "\n")
    for step, load in loads_by_step.items():
      record = {"step": step, "kind": "train", "loss": 5.0}
      if load is not None:
        record[common.LOAD_PREFIX + "layer_1/moe"] = load
        record[common.LOAD_PREFIX + "layer_2/moe"] = [4, 4, 4, 4]
      f.write(json.dumps(record) + "\n")


def test_window_max_vio_and_dead_experts_from_the_logged_loads(tmp_path):
  workdir = str(tmp_path / "run")
  _loads_run(workdir, {1: [8, 0, 0, 0], 2: [0, 8, 0, 0], 3: None, 4: [2, 2, 2, 2],
                       5: [4, 4, 0, 0], 6: [4, 4, 0, 0]})
  steps, loads = common.step_loads(workdir)
  assert list(steps) == [1, 2, 4, 5, 6] and list(loads) == ["layer_1/moe", "layer_2/moe"]
  assert loads["layer_1/moe"].shape == (5, 4)
  ends, vio = common.window_max_vio(steps, loads, 2)
  # Steps 1-2 pooled: [8, 8, 0, 0] -> 8 / 4 - 1 = 1 (layer 2: 0), mean 0.5; step 4 alone: 0;
  # steps 5-6: [8, 8, 0, 0] -> 1, mean 0.5. Window (2, 4] has step 4 only.
  assert list(ends) == [2, 4, 6] and vio == pytest.approx([0.5, 0.0, 0.5])
  # Last 2 steps (5, 6): experts 3 and 4 of layer 1 got nothing; layer 2 none dead.
  assert common.dead_experts(steps, loads, 2) == 2
  assert common.dead_experts(steps, loads, 3) == 0      # steps 4-6: step 4 fed them all
  empty = str(tmp_path / "empty")
  _loads_run(empty, {1: None})
  steps, loads = common.step_loads(empty)
  assert len(steps) == 0 and loads == {}
  assert common.dead_experts(steps, loads, 2) is None
  assert len(common.window_max_vio(steps, loads, 2)[0]) == 0
