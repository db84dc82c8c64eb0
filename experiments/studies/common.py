"""What the study launchers in this folder share: train named settings x seeds through the real CLI,
aggregate a metric over the seeds, keep one section per study in RESULTS.md, and plot the runs
(`k3jax.compare`).

A launcher is a script in this folder that names its settings and calls `run_study`:

    from common import Setting, run_study
    SETTINGS = [Setting("lr1e-3", ("OptimizerConfig.learning_rate = 1e-3",)),
                Setting("lr3e-3", ("OptimizerConfig.learning_rate = 3e-3",))]
    run_study("lr", SETTINGS, seeds=(0, 1, 2), gin_files=["gin_configs/tiny.gin"],
              root="runs/studies", description="Learning rate on the tiny config.")

Each run is `python -m k3jax train` in ROOT/<study>/<setting>_seed<seed>, with the seed bound by
SEED_BINDINGS (the initialisation and the data order; the validation split does not depend on it).
A run whose directory already holds a finished run (`is_finished`) is not started again, so a
launcher can be re-run after an interruption or to rewrite its section; an unfinished one resumes
from its checkpoint. Each call's wall time is added to the run's DIR/wall_time.json
(`k3jax.compare.record_wall_time`), which the tables report. The study's section goes to
RESULTS.md in this folder and its figure to plots/<study>.png here (RESULTS, PLOTS).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

STUDIES_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(STUDIES_DIR))
# This checkout's k3jax, the one the runs use (`python -m k3jax train` starts in REPO), whichever
# k3jax is installed.
sys.path.insert(0, REPO)
from k3jax import compare  # noqa: E402  pylint: disable=wrong-import-position
RESULTS = os.path.join(STUDIES_DIR, "RESULTS.md")
PLOTS = os.path.join(STUDIES_DIR, "plots")
SEED_BINDINGS = ("Config.seed = {seed}", "DataConfig.seed = {seed}")
RESULTS_HEADER = ("# Studies\n\nOne section per study, each written by its launcher in this folder "
                  "(common.py: `run_study`); re-running a launcher replaces its own section only. "
                  "Metrics are the mean [min, max] over the seeds.\n")
_NAME = re.compile(r"^[\w.-]+$")
# The numeric values of `k3jax.compare.summary_rows` a study can aggregate over its seeds.
METRICS = ("val_loss", "best_val_loss", "train_loss", "max_vio", "tokens", "steps", "wall_s")


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of a study: its name (a directory name) and its gin bindings, applied after the
  study's gin files."""
  name: str
  bindings: tuple = ()


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """One trained (or found finished) run: its setting's name and bindings, its seed, directory
  and command, its total recorded wall time in seconds (None when never recorded), and whether it
  was found finished and not started."""
  setting: str
  bindings: tuple
  seed: int
  workdir: str
  command: tuple
  wall_s: Optional[float]
  skipped: bool


class StudyRunError(RuntimeError):
  """A `k3jax train` of a study failed: the message has the command and its exit code."""


def train_command(gin_files: Sequence[str], bindings: Sequence[str], workdir: str,
                  max_steps: Optional[int] = None, extra_flags: Sequence[str] = (),
                  python: str = sys.executable) -> list[str]:
  """`python -m k3jax train` with these gin files, bindings and --workdir (no progress bar)."""
  cmd = [python, "-m", "k3jax", "train", *[f"--gin_file={f}" for f in gin_files],
         *[f"--gin_bindings={b}" for b in bindings], f"--workdir={workdir}", "--noprogress"]
  if max_steps is not None:
    cmd.append(f"--max_steps={max_steps}")
  return cmd + list(extra_flags)


def seed_bindings(seed: int | str) -> list[str]:
  """SEED_BINDINGS for `seed` (a string such as 'SEED' for a command's text)."""
  return [b.format(seed=seed) for b in SEED_BINDINGS]


def workdir_of(root: str, study: str, setting: str, seed: int | str) -> str:
  return os.path.join(root, study, f"{setting}_seed{seed}")


def is_finished(workdir: str, max_steps: Optional[int] = None) -> bool:
  """Whether `workdir` holds a run that has ended where this launch would end it: its eval.json
  (written last, when a call ends) has its final evaluation at the planned steps, or at
  `max_steps` when that is sooner. False for a missing or unreadable run."""
  try:
    run = compare.load_run(workdir)
    with open(os.path.join(workdir, "eval.json")) as f:
      final_step = json.load(f)["final"]["step"]
  except (compare.CompareError, OSError, ValueError, KeyError, TypeError):
    return False
  target = run.planned_steps if max_steps is None else min(max_steps, run.planned_steps)
  return run.steps >= target and final_step >= target


def run_settings(study: str, settings: Sequence[Setting], seeds: Sequence[int], root: str,
                 gin_files: Sequence[str], max_steps: Optional[int] = None,
                 extra_flags: Sequence[str] = (), log: Callable[[str], None] = print,
                 run: Callable = subprocess.run) -> list[RunRecord]:
  """Trains every setting with every seed, one run after the other, skipping finished runs
  (`is_finished`); returns one RunRecord per run, settings outer, seeds inner. Relative paths
  (root, gin_files) are relative to the repository's root, where the commands run. Raises
  StudyRunError at the first run that fails (the ones before it stay; re-running goes on from
  there). `run` starts a command (subprocess.run's signature; the tests replace it)."""
  for name in [study] + [s.name for s in settings]:
    if not _NAME.match(name):
      raise ValueError(f"study and setting names must be directory names ([A-Za-z0-9_.-]), got "
                       f"{name!r}")
  records = []
  for setting in settings:
    for seed in seeds:
      workdir = workdir_of(root, study, setting.name, seed)
      cmd = train_command(gin_files, list(setting.bindings) + seed_bindings(seed), workdir,
                          max_steps, extra_flags)
      # The command runs in REPO: a relative root is relative to it, wherever the launcher runs.
      workdir = os.path.join(REPO, workdir)
      record = functools.partial(RunRecord, setting.name, tuple(setting.bindings), seed, workdir,
                                 tuple(cmd))
      if is_finished(workdir, max_steps):
        log(f"{workdir}: finished, not started again")
        records.append(record(compare.read_wall_time(workdir), True))
        continue
      log(f"=== {study}: {setting.name}, seed {seed}: {shlex.join(cmd)}")
      start = time.perf_counter()
      proc = run(cmd, cwd=REPO)
      seconds = time.perf_counter() - start
      if proc.returncode != 0:
        raise StudyRunError(f"{shlex.join(cmd)} exited with code {proc.returncode}")
      records.append(record(compare.record_wall_time(workdir, seconds), False))
  return records


@dataclasses.dataclass(frozen=True)
class Spread:
  """A metric over seeds: the mean, the minimum and the maximum of the n finite values."""
  mean: float
  lo: float
  hi: float
  n: int

  def format(self, digits: int = 4) -> str:
    """'mean [min, max]' ('-' without values; the mean alone for one value)."""
    if self.n == 0:
      return "-"
    if self.n == 1:
      return f"{self.mean:.{digits}f}"
    return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def mean_min_max(values: Sequence[Optional[float]]) -> Spread:
  """The mean and the range (min-max) of the values that are finite numbers (None and NaN, a run
  without that metric, are left out); n is how many were used. The range rather than a standard
  deviation: a study has a few seeds, and the range shows every one of them."""
  finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
  if not finite:
    return Spread(math.nan, math.nan, math.nan, 0)
  return Spread(sum(finite) / len(finite), min(finite), max(finite), len(finite))


def _markers(study: str) -> tuple[str, str]:
  return f"<!-- study: {study} -->", f"<!-- end of study: {study} -->"


def replace_section(text: str, study: str, body: str) -> str:
  """`text` (RESULTS.md) with the study's section, between its two marker lines, set to `body`:
  in place when the study has a section, else appended. Other sections are untouched. Raises
  ValueError when the study's start marker has no end marker after it."""
  begin, end = _markers(study)
  section = f"{begin}\n{body.strip()}\n{end}\n"
  start = text.find(begin + "\n")
  if start < 0:
    return text.rstrip("\n") + ("\n\n" if text.strip() else "") + section
  stop = text.find(end, start)
  if stop < 0:
    raise ValueError(f"the section of study {study!r} has no end marker {end!r}: mend the file "
                     "by hand")
  stop += len(end)
  if text[stop:stop + 1] == "\n":
    stop += 1
  return text[:start] + section + text[stop:]


def write_section(study: str, body: str, path: str = RESULTS) -> None:
  """Sets the study's section of the file at `path` (`replace_section`; created with
  RESULTS_HEADER when missing), written whole through a temporary file."""
  text = RESULTS_HEADER
  if os.path.exists(path):
    with open(path) as f:
      text = f.read()
  text = replace_section(text, study, body)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|")


def _duration(seconds: float) -> str:
  return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def section_body(study: str, description: str, records: Sequence[RunRecord],
                 rows: Sequence[dict], metric: str, gin_files: Sequence[str], root: str,
                 max_steps: Optional[int] = None, extra_flags: Sequence[str] = ()) -> str:
  """The study's section: a title, the description, one table row per setting (the metric's
  `mean_min_max` over the seeds, the seeds, tokens, the mean wall time of one run, the command
  with the seed as SEED) and the plot. records and rows (`k3jax.compare.summary_rows` of the
  records' runs) are in the same order."""
  settings = list(dict.fromkeys(r.setting for r in records))
  lines = [f"## {study}", ""] + ([description.strip(), ""] if description.strip() else []) + [
           f"| setting | {metric} | seeds | tokens | wall time per run | command |",
           "|---|---|---|---|---|---|"]
  for name in settings:
    mine = [(rec, row) for rec, row in zip(records, rows) if rec.setting == name]
    spread = mean_min_max([row[metric] for _, row in mine])
    tokens = sorted({row["tokens"] for _, row in mine})
    walls = mean_min_max([rec.wall_s for rec, _ in mine])
    first = mine[0][0]
    cmd = train_command(gin_files, list(first.bindings) + seed_bindings("SEED"),
                        workdir_of(root, study, name, "SEED"), max_steps, extra_flags, "python")
    lines.append("| " + " | ".join([
        _cell(name), spread.format(), ", ".join(str(rec.seed) for rec, _ in mine),
        " to ".join(f"{t:,}" for t in tokens),
        _duration(walls.mean) if walls.n else "-",
        f"`{_cell(shlex.join(cmd))}`"]) + " |")
  lines += ["", f"{metric}: mean [min, max] over the seeds (nats/token for losses; "
            "`k3jax.compare.summary_rows` says what each value is). The command trains one seed "
            "from the repository's root, with SEED replaced by it.", "",
            f"![{study}](plots/{study}.png)"]
  return "\n".join(lines)


def _labels(records: Sequence[RunRecord]) -> list[str]:
  return [f"{r.setting} seed {r.seed}" for r in records]


def save_plot(study: str, runs: Sequence[compare.Run], plots_dir: str = PLOTS) -> str:
  """The study's runs overlaid (`k3jax.compare.overlay_figure`, one line per setting and seed)
  in PLOTS/<study>.png; returns the path."""
  return compare.save_figure(compare.overlay_figure(runs), os.path.join(plots_dir, f"{study}.png"))


def run_study(study: str, settings: Sequence[Setting], seeds: Sequence[int],
              gin_files: Sequence[str], root: str, description: str = "",
              metric: str = "val_loss", max_steps: Optional[int] = None,
              extra_flags: Sequence[str] = (), results: str = RESULTS,
              plots_dir: str = PLOTS) -> str:
  """Trains the study (`run_settings`), writes its section of `results` (`section_body`,
  `write_section`) and its plot (`save_plot`); returns the section. metric: a numeric key of
  `k3jax.compare.summary_rows` (METRICS)."""
  if metric not in METRICS:
    raise ValueError(f"metric {metric!r} is not one of {METRICS}")
  records = run_settings(study, settings, seeds, root, gin_files, max_steps, extra_flags)
  runs = compare.load_runs([r.workdir for r in records], _labels(records))
  body = section_body(study, description, records, compare.summary_rows(runs), metric, gin_files,
                      root, max_steps, extra_flags)
  write_section(study, body, results)
  save_plot(study, runs, plots_dir)
  return body
