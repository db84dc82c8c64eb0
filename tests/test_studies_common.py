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
