"""Helpers of the mqar_recall and situ_glu study launchers that common.py does not have: MQAR
accuracy of a finished run at several numbers of key-value pairs, the accuracy table and figure over
seeds, loss-spike and divergence bookkeeping, and training that records a failed run instead of
stopping the study.

The pure functions (accuracy_grid, loss_spikes, diverged_step) are tested in
tests/test_studies_recall.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import time
from typing import Callable, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

import common
from common import RunRecord, Setting, StudyRunError

from k3jax import compare  # noqa: E402  (common puts this checkout first on sys.path)
from k3jax.training import metrics as metrics_lib  # noqa: E402


def accuracy_grid(results: Sequence[tuple[str, int, int, Optional[float]]]
                  ) -> dict[str, dict[int, common.Spread]]:
  """{setting: {pairs: mean_min_max of the accuracies over seeds}} of (setting, seed, pairs,
  accuracy) tuples (accuracy None: not measured, left out). Settings and pairs keep their first
  order of appearance."""
  grid: dict[str, dict[int, list]] = {}
  for setting, _seed, pairs, acc in results:
    grid.setdefault(setting, {}).setdefault(int(pairs), []).append(acc)
  return {s: {p: common.mean_min_max(v) for p, v in by_pairs.items()}
          for s, by_pairs in grid.items()}


def loss_spikes(losses: Sequence[float], margin: float) -> int:
  """How many logged losses exceed the running minimum of the losses logged before them by more
  than `margin` (nats/token). The first loss has no minimum before it and never counts; a
  non-finite loss counts as a spike and does not move the minimum."""
  count, best = 0, math.inf
  for loss in losses:
    loss = float(loss)
    if not math.isfinite(loss):
      count += 1
      continue
    if best < math.inf and loss > best + margin:
      count += 1
    best = min(best, loss)
  return count


def diverged_step(records: Sequence[dict]) -> Optional[int]:
  """The first training step whose logged loss is not finite in a run's metrics records
  (metrics.jsonl's dicts), or None. `k3jax train` stops at a non-finite loss without logging
  that step, so a run that stopped that way reports its step through `train_or_record_failure`."""
  for r in sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"]):
    loss = r.get("loss")
    if loss is None or not math.isfinite(float(loss)):
      return int(r["step"])
  return None


_NON_FINITE = re.compile(r"non-finite loss at step (\d+)")


def nonfinite_step(output: str) -> Optional[int]:
  """The step of `k3jax train`'s NonFiniteLossError message ('non-finite loss at step N') in a
  run's output, or None when the run failed otherwise."""
  found = _NON_FINITE.search(output)
  return int(found.group(1)) if found else None


def read_records(workdir: str) -> list[dict]:
  """The JSON records of DIR/metrics.jsonl ([] without the file)."""
  path = os.path.join(workdir, "metrics.jsonl")
  return metrics_lib.read_jsonl(path) if os.path.isfile(path) else []


FAILURE_FILE = "failure.json"


def train_or_record_failure(study: str, setting: Setting, seed: int, root: str,
                            gin_files: Sequence[str], log: Callable[[str], None] = print
                            ) -> tuple[RunRecord, Optional[dict]]:
  """`common.run_settings` of one setting and seed, except that a failed `k3jax train` does not
  stop the study: its output's last lines and exit code are kept in DIR/failure.json (read back
  when the launcher runs again, so a failed run is not retrained) and returned as the second
  value; None for a run that finished."""
  workdir = os.path.join(common.REPO, common.workdir_of(root, study, setting.name, seed))
  failure_path = os.path.join(workdir, FAILURE_FILE)
  cmd = common.train_command(gin_files, list(setting.bindings) + common.seed_bindings(seed),
                             common.workdir_of(root, study, setting.name, seed))
  if os.path.isfile(failure_path):
    with open(failure_path) as f:
      failure = json.load(f)
    log(f"{workdir}: failed before ({failure['message']}), not started again")
    return (RunRecord(setting.name, tuple(setting.bindings), seed, workdir, tuple(cmd),
                      compare.read_wall_time(workdir), True), failure)
  output: list[str] = []

  def run(command, cwd):
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    print(proc.stdout[-3000:], end="", flush=True)
    output.append(proc.stdout)
    output.append(str(time.perf_counter() - start))
    return proc

  try:
    [record] = common.run_settings(study, [setting], [seed], root, gin_files, log=log, run=run)
    return record, None
  except StudyRunError as e:
    text, seconds = output[0], float(output[1])
    wall = compare.record_wall_time(workdir, seconds)
    tail = [line for line in text.splitlines() if line.strip()][-5:]
    failure = {"message": str(e).rsplit(" exited ", 1)[-1], "output_tail": tail,
               "diverged_step": nonfinite_step(text)}
    os.makedirs(workdir, exist_ok=True)
    with open(failure_path, "w") as f:
      json.dump(failure, f, indent=1)
    log(f"{workdir}: failed ({shlex.join(cmd)} {failure['message']})")
    return (RunRecord(setting.name, tuple(setting.bindings), seed, workdir, tuple(cmd), wall,
                      False), failure)


def mqar_accuracies(workdir: str, seq_len: int, pairs: Sequence[int], samples: int,
                    seed: int = 0) -> dict[int, float]:
  """{pairs: MQAR accuracy} of a run's newest checkpoint on `samples` fresh rows of `seq_len`
  tokens (`k3jax.training.evaluation.evaluate_mqar`)."""
  from k3jax.model import K3Model  # pylint: disable=import-outside-toplevel
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  from k3jax.training.evaluation import evaluate_mqar  # pylint: disable=import-outside-toplevel
  cfg, params, moe_state, _ = checkpoint_lib.restore_run(workdir, log=lambda _: None)
  model = K3Model(cfg.model, cfg.impl)
  return {p: evaluate_mqar(model, params, moe_state, seq_len, p, samples=samples, seed=seed)
          for p in pairs}


def spread_figure(grid: dict[str, dict[int, common.Spread]], xlabel: str, ylabel: str, title: str,
                  *, logx: bool = True, ylim: Optional[tuple] = None,
                  tick_label: Callable[[int], str] = "{:g}".format,
                  label: Callable[[str], str] = str, figsize: tuple = (6, 4)) -> Figure:
  """One line per setting of `grid` ({setting: {x: Spread}}): the mean with min-max error bars,
  the i-th setting in colour C<i> (a caller adding lines per run matches it); tick_label and
  label write an x tick and a setting's legend entry."""
  fig = Figure(figsize=figsize, layout="constrained")
  ax = fig.add_subplot(1, 1, 1)
  for i, (name, by_x) in enumerate(grid.items()):
    xs = sorted(x for x, s in by_x.items() if s.n)
    mean = np.array([by_x[x].mean for x in xs])
    err = np.array([[by_x[x].mean - by_x[x].lo for x in xs], [by_x[x].hi - by_x[x].mean for x in xs]])
    ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, color=f"C{i}", label=label(name))
  if logx:
    ax.set_xscale("log", base=2)
  ticks = sorted({x for by_x in grid.values() for x in by_x})
  ax.set_xticks(ticks)
  ax.set_xticklabels([tick_label(x) for x in ticks])
  if ylim is not None:
    ax.set_ylim(*ylim)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc="best")
  return fig
