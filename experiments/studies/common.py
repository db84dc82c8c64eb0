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

Launchers with more than one metric column and a --scale flag use `study_main` instead: SCALES
names what each scale trains (tiny: the CPU; small: what was run on one H100), `parse_args` the
flags every launcher takes (--scale, --root, --results, --plots, --max_steps, --seeds,
--settings, --bindings), `Column` a metric computed from a run. A run trained with
EvalConfig.log_expert_loads = True has each logged step's per-expert loads in its metrics.jsonl
('load/<layer>'); `step_loads` reads them, from which `window_max_vio` and `dead_experts` compute a
study's global balance.
"""

from __future__ import annotations

import argparse
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
# 'load/': the keys of the per-expert loads in a training record (EvalConfig.log_expert_loads).
from k3jax.training.loop import LOAD_PREFIX  # noqa: E402  pylint: disable=wrong-import-position
RESULTS = os.path.join(STUDIES_DIR, "RESULTS.md")
PLOTS = os.path.join(STUDIES_DIR, "plots")
SEED_BINDINGS = ("Config.seed = {seed}", "DataConfig.seed = {seed}")
RESULTS_HEADER = ("# Studies\n\nOne section per study, each written by its launcher in this folder "
                  "(through common.py); re-running a launcher replaces its own section only. "
                  "Metrics are the mean [min, max] over the seeds.\n")
_NAME = re.compile(r"^[\w.-]+$")
# The numeric values of `k3jax.compare.summary_rows` a study can aggregate over its seeds.
METRICS = ("val_loss", "best_val_loss", "train_loss", "max_vio", "tokens", "steps", "wall_s")


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of a study: its name (a directory name), its gin bindings, applied after the
  study's gin files, and its seeds when they are not the study's (None)."""
  name: str
  bindings: tuple = ()
  seeds: Optional[tuple] = None


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
  except (compare.CompareError, OSError, ValueError, KeyError, TypeError):
    return False
  step = final_step(workdir)
  target = run.planned_steps if max_steps is None else min(max_steps, run.planned_steps)
  return step is not None and run.steps >= target and step >= target


def final_step(workdir: str) -> Optional[int]:
  """The step of the final evaluation in DIR/eval.json (written last, when a `k3jax train` call
  ends); None without a readable one."""
  try:
    with open(os.path.join(workdir, "eval.json")) as f:
      return int(json.load(f)["final"]["step"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def cached_measurement(path: str, key: dict, measure: Callable[[], dict]) -> dict[int, float]:
  """{int: float} of `measure()`, kept in the JSON file at `path` with `key` (what it was measured
  with): read back while the saved key equals `key`, else measured again and the file replaced
  whole. A study measures its finished runs' checkpoints once, and re-running its launcher only
  re-renders."""
  if os.path.isfile(path):
    with open(path) as f:
      saved = json.load(f)
    if saved.get("key") == key:
      return {int(k): v for k, v in saved["accuracy"].items()}
  values = measure()
  with open(path + ".tmp", "w") as f:
    json.dump({"key": key, "accuracy": values}, f)
  os.replace(path + ".tmp", path)
  return values


def run_settings(study: str, settings: Sequence[Setting], seeds: Sequence[int], root: str,
                 gin_files: Sequence[str], max_steps: Optional[int] = None,
                 extra_flags: Sequence[str] = (), log: Callable[[str], None] = print,
                 run: Callable = subprocess.run) -> list[RunRecord]:
  """Trains every setting with every seed (its own seeds where it has them), one run after the
  other, skipping finished runs (`is_finished`); returns one RunRecord per run, settings outer,
  seeds inner. Relative paths (root, gin_files) are relative to the repository's root, where the
  commands run. Raises
  StudyRunError at the first run that fails (the ones before it stay; re-running goes on from
  there). `run` starts a command (subprocess.run's signature; the tests replace it)."""
  for name in [study] + [s.name for s in settings]:
    if not _NAME.match(name):
      raise ValueError(f"study and setting names must be directory names ([A-Za-z0-9_.-]), got "
                       f"{name!r}")
  records = []
  for setting in settings:
    for seed in (seeds if setting.seeds is None else setting.seeds):
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


@dataclasses.dataclass(frozen=True)
class Column:
  """One metric column of a study's table: its header, what it is (a sentence under the table)
  and its value for one run, `value(record, row, run)` (the RunRecord, the run's
  `k3jax.compare.summary_rows` row and its `compare.Run`; None where the run has none), shown as
  `mean_min_max` over the seeds with `digits` decimals."""
  name: str
  value: Callable[[RunRecord, dict, "compare.Run"], Optional[float]]
  doc: str = ""
  digits: int = 4


def metric_column(metric: str) -> Column:
  """The column of one numeric value of `summary_rows` (METRICS)."""
  if metric not in METRICS:
    raise ValueError(f"metric {metric!r} is not one of {METRICS}")
  return Column(metric, lambda record, row, run: row[metric])


def section_body(study: str, description: str, records: Sequence[RunRecord],
                 rows: Sequence[dict], metric: str, gin_files: Sequence[str], root: str,
                 max_steps: Optional[int] = None, extra_flags: Sequence[str] = (), *,
                 columns: Optional[Sequence[Column]] = None, runs: Optional[Sequence] = None,
                 title: Optional[str] = None, after: str = "",
                 plots: Optional[Sequence[str]] = None) -> str:
  """The study's section: a title, the description, one table row per setting (each column's
  `mean_min_max` over the seeds, the seeds, tokens, the mean wall time of one run, the command
  with the seed as SEED), `after` (a verdict, notes) and the plots. records, rows (`k3jax.compare
  .summary_rows` of the records' runs) and runs (their `compare.Run`s, for columns that read
  them) are in the same order.

  columns: the metric columns (default: the one of `metric`, `metric_column`); title: the heading
  (default '## <study>'); plots: file names in the plots folder (default ['<study>.png'])."""
  columns = [metric_column(metric)] if columns is None else list(columns)
  runs = [None] * len(records) if runs is None else list(runs)
  plots = [f"{study}.png"] if plots is None else list(plots)
  settings = list(dict.fromkeys(r.setting for r in records))
  lines = [title or f"## {study}", ""] + (
      [description.strip(), ""] if description.strip() else []) + [
      "| setting | " + " | ".join(_cell(c.name) for c in columns)
      + " | seeds | tokens | wall time per run | command |",
      "|---|" + "---|" * len(columns) + "---|---|---|---|"]
  for name in settings:
    mine = [(rec, row, run) for rec, row, run in zip(records, rows, runs) if rec.setting == name]
    values = [mean_min_max([c.value(rec, row, run) for rec, row, run in mine]).format(c.digits)
              for c in columns]
    tokens = sorted({row["tokens"] for _, row, _ in mine})
    walls = mean_min_max([rec.wall_s for rec, _, _ in mine])
    first = mine[0][0]
    cmd = train_command(gin_files, list(first.bindings) + seed_bindings("SEED"),
                        workdir_of(root, study, name, "SEED"), max_steps, extra_flags, "python")
    lines.append("| " + " | ".join([
        _cell(name), *values, ", ".join(str(rec.seed) for rec, _, _ in mine),
        " to ".join(f"{t:,}" for t in tokens),
        _duration(walls.mean) if walls.n else "-",
        f"`{_cell(shlex.join(cmd))}`"]) + " |")
  if len(columns) == 1 and columns[0].name == metric and not columns[0].doc:
    lines += ["", f"{metric}: mean [min, max] over the seeds (nats/token for losses; "
              "`k3jax.compare.summary_rows` says what each value is). The command trains one "
              "seed from the repository's root, with SEED replaced by it."]
  else:
    lines += ["", "Each metric: mean [min, max] over the seeds (one value: one seed). "
              + " ".join(f"{c.name}: {c.doc}" for c in columns if c.doc)
              + " The command trains one seed from the repository's root, with SEED replaced "
              "by it."]
  if after.strip():
    lines += ["", after.strip()]
  lines += [""] + [f"![{os.path.splitext(p)[0]}](plots/{p})" for p in plots]
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


# ------------------------------------------------------------------------------------------------
# Scales: what a launcher's --scale trains (the gin files, bindings before each setting's, the
# runs' root, the seeds) and how its table is labelled.


@dataclasses.dataclass(frozen=True)
class Scale:
  """name; gin_files; bindings (applied before each setting's); root of the run directories;
  seeds; label (the table's heading says it); suffix of the section's and plots' names."""
  name: str
  gin_files: tuple
  bindings: tuple
  root: str
  seeds: tuple
  label: str
  suffix: str


# tiny: the CPU scale. tiny.gin's model on one short stage (rows of 64 tokens, 16 a step), a small
# validation pass, one passkey sample, no checkpoint but the final one: about 1-2 minutes a run on
# 2 shared CPU cores, most of it start-up (compiled programs are cached between seeds).
TINY = Scale("tiny", ("gin_configs/tiny.gin",), (
    "StagesConfig.stages = ((64, 120),)", "StagesConfig.tokens_per_step = 1024",
    "EvalConfig.every_steps = 20", "EvalConfig.num_batches = 4",
    "EvalConfig.passkey_multipliers = (1,)", "EvalConfig.passkey_samples = 1",
    "CheckpointConfig.every_steps = 1000"), "runs/studies", (0, 1, 2),
    "tiny.gin on the CPU", "")
# small: what was run on one H100 (small.gin, 300 steps of 128K tokens at 8K, one seed).
SMALL = Scale("small", ("gin_configs/small.gin",), (
    "StagesConfig.stages = ((8192, 300),)", "StagesConfig.tokens_per_step = 131072",
    "StagesConfig.microbatch_tokens = 32768", "EvalConfig.every_steps = 50",
    "EvalConfig.passkey_multipliers = (1,)", "EvalConfig.passkey_samples = 4",
    "CheckpointConfig.every_steps = 1000", "ImplConfig.stage_remat = ()"),
    "runs/studies_small", (0,), "small.gin, one H100, one seed", "_small")
SCALES = {s.name: s for s in (TINY, SMALL)}


def parse_args(argv: Optional[Sequence[str]], description: str) -> argparse.Namespace:
  """A launcher's flags: --scale (tiny|small), --root (default: the scale's), --results,
  --plots, --max_steps, --seeds (comma-separated; default: the scale's), --settings
  (comma-separated names: only these settings), --bindings (repeatable: gin bindings applied
  after each setting's, e.g. a smaller model for a test)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
  parser.add_argument("--root", default=None, help="run directories' root (default: the scale's)")
  parser.add_argument("--results", default=RESULTS, help="the RESULTS.md to write")
  parser.add_argument("--plots", default=PLOTS, help="the plots folder")
  parser.add_argument("--max_steps", type=int, default=None, help="stop each run there")
  parser.add_argument("--seeds", default=None, help="e.g. 0,1 (default: the scale's)")
  parser.add_argument("--settings", default=None, help="only these settings, e.g. a,b")
  parser.add_argument("--bindings", action="append", default=[],
                      help="a gin binding after each setting's (repeatable; for tests)")
  args = parser.parse_args(argv)
  scale = SCALES[args.scale]
  args.root = args.root or scale.root
  args.seeds = (scale.seeds if args.seeds is None
                else tuple(int(x) for x in args.seeds.split(",") if x.strip()))
  args.settings = None if args.settings is None else [x for x in args.settings.split(",") if x]
  return args


@dataclasses.dataclass(frozen=True)
class Study:
  """What a launcher's runs gave: the records, their `compare.Run`s and `summary_rows` rows (same
  order), the scale, the section's name ('<study><suffix>'), and the arguments."""
  records: list
  runs: list
  rows: list
  scale: Scale
  section: str
  args: argparse.Namespace

  def by_setting(self) -> dict:
    """{setting: [(record, row, run), ...]} in the records' order."""
    out: dict = {}
    for triple in zip(self.records, self.rows, self.runs):
      out.setdefault(triple[0].setting, []).append(triple)
    return out

  def seeds_note(self) -> str:
    """'name: seeds 0, 1, 2; ...' for the protocol text, saying so when the settings ran
    different numbers of seeds."""
    seeds = {name: [rec.seed for rec, _, _ in triples]
             for name, triples in self.by_setting().items()}
    note = "; ".join(f"{name}: seed{'s' * (len(v) != 1)} {', '.join(map(str, v))}"
                     for name, v in seeds.items())
    if len({len(v) for v in seeds.values()}) > 1:
      note += ("; the shared CPU's time ran out before the other seeds were trained (re-running "
               "the launcher trains them)")
    return note


def study_main(study: str, settings: Sequence[Setting], args: argparse.Namespace,
               describe: Callable[[Study], tuple], columns: Optional[Sequence[Column]] = None,
               figures: Optional[Callable[[Study], dict]] = None,
               log: Callable[[str], None] = print) -> str:
  """A launcher's body: trains the settings at args.scale (its bindings before each setting's;
  settings with seeds of their own keep them, cut to args.seeds; args.bindings after each
  setting's), writes the section
  '<study><suffix>' of args.results and its plots (the overlay figure '<section>.png' and the
  `figures(study)` {file name: Figure}) into args.plots; returns the section.
  describe(study) -> (description above the table, text below it: the verdict)."""
  scale = SCALES[args.scale]
  chosen = [s for s in settings if args.settings is None or s.name in args.settings]
  if not chosen:
    raise ValueError(f"--settings={','.join(args.settings)} names none of "
                     f"{', '.join(s.name for s in settings)}")
  chosen = [Setting(s.name, scale.bindings + tuple(s.bindings) + tuple(args.bindings),
                    None if s.seeds is None else tuple(x for x in s.seeds if x in args.seeds))
            for s in chosen]
  records = run_settings(study, chosen, args.seeds, args.root, scale.gin_files, args.max_steps,
                         log=log)
  runs = compare.load_runs([r.workdir for r in records], _labels(records))
  section = study + scale.suffix
  result = Study(records, runs, compare.summary_rows(runs), scale, section, args)
  figs = {f"{section}.png": compare.overlay_figure(runs)}
  figs.update(figures(result) if figures is not None else {})
  for name, fig in figs.items():
    compare.save_figure(fig, os.path.join(args.plots, name))
  description, after = describe(result)
  body = section_body(study, description, records, result.rows, "val_loss", scale.gin_files,
                      args.root, args.max_steps, columns=columns, runs=runs,
                      title=f"## {study}: {scale.label}", after=after, plots=list(figs))
  write_section(section, body, args.results)
  return body


# ------------------------------------------------------------------------------------------------
# Per-step expert loads: a run trained with EvalConfig.log_expert_loads = True has, in each logged
# training record, each MoE layer's load of that step ('load/<layer>': the routed assignments per
# expert, a list of integers). With EvalConfig.log_every_steps = 1 every step is logged.


def step_loads(workdir: str) -> tuple:
  """(steps [n] int, {layer: loads [n, E] float64}) of the training records of the run's
  metrics.jsonl that carry loads (EvalConfig.log_expert_loads), ascending; empty without any."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from k3jax.training import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  records = sorted((r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
                    if r.get("kind") == "train"
                    and any(k.startswith(LOAD_PREFIX) for k in r)), key=lambda r: r["step"])
  layers = list(dict.fromkeys(k[len(LOAD_PREFIX):] for r in records for k in r
                              if k.startswith(LOAD_PREFIX)))
  steps = np.array([r["step"] for r in records], np.int64)
  return steps, {name: np.array([r[LOAD_PREFIX + name] for r in records], np.float64)
                 for name in layers}


def window_max_vio(steps, loads: dict, window: int) -> tuple:
  """Global MaxVio over windows of `window` steps: for the steps (k·window, (k+1)·window], the
  loads of the logged steps in it summed per expert, max / mean − 1 per layer, then the mean over
  the layers. steps, loads: `step_loads` of a run (EvalConfig.log_expert_loads). Returns (window
  end steps [w], MaxVio [w]); windows without a logged step are left out."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  steps = np.asarray(steps)
  if not len(steps) or not loads:
    return np.zeros(0, np.int64), np.zeros(0)
  ends, values = [], []
  for end in range(window, int(steps.max()) + window, window):
    inside = (steps > end - window) & (steps <= end)
    if not inside.any():
      continue
    vios = []
    for load in loads.values():
      pooled = load[inside].sum(axis=0)
      mean = pooled.mean()
      vios.append(pooled.max() / mean - 1.0 if mean > 0 else 0.0)
    ends.append(end)
    values.append(float(np.mean(vios)))
  return np.array(ends, np.int64), np.array(values)


def dead_experts(steps, loads: dict, window: int) -> Optional[int]:
  """Experts (summed over the layers) with no token routed to them in any logged step of the last
  `window` steps (steps > last − window); None without loads. steps, loads: `step_loads` of a
  run (EvalConfig.log_expert_loads)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  steps = np.asarray(steps)
  if not len(steps) or not loads:
    return None
  inside = steps > steps.max() - window
  return int(sum(int((load[inside].sum(axis=0) == 0).sum()) for load in loads.values()))
