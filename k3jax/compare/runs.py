"""Reading training runs for a comparison: one `Run` per run directory written by `k3jax train`.

A run directory holds metrics.jsonl (`k3jax.training.metrics`: one JSON record per logged training
step and per evaluation) and config.gin (`k3jax.training.run_dir`: every setting of the run). The
series come from the same readers as the run's own plots (`k3jax.training.plots`); tokens seen are
the step times StagesConfig.tokens_per_step (constant through the stages). The wall time is not
something `k3jax train` writes: a launcher that timed the command records it in DIR/wall_time.json
(`record_wall_time`), and it is None without that file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

import numpy as np

from k3jax import config as config_lib
from k3jax.training import metrics as metrics_lib
from k3jax.training import plots, run_dir

METRICS_FILE = "metrics.jsonl"
WALL_TIME_FILE = "wall_time.json"
EXPECTED = "a run directory written by `k3jax train` (with metrics.jsonl and config.gin)"


class CompareError(ValueError):
  """Runs that cannot be compared as asked: the message names the path or flag and what is
  expected (the compare command prints it as one line and exits with code 2)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """One run's series, as logged.

  label: the run's name in legends and tables; workdir: its directory.
  train_steps [n] int64: the logged training steps, ascending (every EvalConfig.log_every_steps,
    stage ends, the last step).
  train_loss [n] float64: the training loss of each logged step (nats/token, the record's 'loss':
    the cross-entropy without the balance loss).
  tokens [n] int64: tokens trained on up to and including each logged step.
  validation: {seq_len: (steps, validation losses in nats/token)}, `plots.validation_series`.
  last_eval: the last evaluation record with a numeric val_loss (metrics.jsonl's dict), or None.
  moe_layers, max_vio_steps [m] int64, max_vio [layers, m] float64: `plots.max_vio_over_training`
    (max load / mean load - 1 of each logged step's routing; NaN where a layer has no value).
  config: {'Configurable.field': value as gin text} of every setting (config.gin as the current
    code reads it: moved settings renamed, newer ones at the values that compute what the run did).
  planned_steps: StagesConfig's total steps; tokens_per_step: StagesConfig.tokens_per_step.
  wall_s: seconds of wall time a launcher recorded (`record_wall_time`), or None.
  """
  label: str
  workdir: str
  train_steps: np.ndarray
  train_loss: np.ndarray
  tokens: np.ndarray
  validation: dict
  last_eval: Optional[dict]
  moe_layers: list
  max_vio_steps: np.ndarray
  max_vio: np.ndarray
  config: dict
  planned_steps: int
  tokens_per_step: int
  wall_s: Optional[float]

  @property
  def steps(self) -> int:
    """The last logged training step."""
    return int(self.train_steps[-1])

  @property
  def max_vio_mean(self) -> np.ndarray:
    """[m] MaxVio of each logged step averaged over the MoE layers (the layers it has)."""
    if not self.max_vio.size:
      return np.zeros(0)
    return np.array([np.nanmean(col) if np.isfinite(col).any() else np.nan
                     for col in self.max_vio.T])


def _records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isdir(workdir):
    what = "is a file" if os.path.exists(workdir) else "does not exist"
    raise CompareError(f"run directory {workdir} {what}: expected {EXPECTED}")
  if not os.path.isfile(path):
    raise CompareError(f"{workdir} has no {METRICS_FILE}: expected {EXPECTED}")
  try:
    records = metrics_lib.read_jsonl(path)
  except json.JSONDecodeError as e:
    raise CompareError(f"{path} is not JSON lines ({e}): expected the records of "
                       "`k3jax train`") from e
  for number, r in enumerate(records, 1):
    if not isinstance(r, dict) or not isinstance(r.get("step"), int) or "kind" not in r:
      raise CompareError(f"{path}, record {number}: expected a JSON object with an integer 'step' "
                         f"and a 'kind', got {str(r)[:80]}")
  return records


def _config(workdir: str) -> config_lib.Config:
  try:
    return run_dir.read_config(workdir)
  except FileNotFoundError as e:
    raise CompareError(f"{workdir} has no {run_dir.CONFIG_GIN}: expected {EXPECTED}") from e
  except config_lib.ConfigError as e:
    raise CompareError(f"{os.path.join(workdir, run_dir.CONFIG_GIN)} is not a valid config for "
                       f"this code: {e}") from e


def read_wall_time(workdir: str) -> Optional[float]:
  """The seconds DIR/wall_time.json records (`record_wall_time`), or None without the file."""
  path = os.path.join(workdir, WALL_TIME_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      return float(json.load(f)["wall_s"])
  except (ValueError, KeyError, TypeError) as e:
    raise CompareError(f"{path} is not a wall time record ({e}): expected "
                       "{\"wall_s\": seconds, \"calls\": n}") from e


def record_wall_time(workdir: str, seconds: float) -> float:
  """Adds `seconds` (the wall time of one `k3jax train` call on `workdir`) to DIR/wall_time.json,
  {"wall_s": total seconds, "calls": number of calls}, so that a resumed run sums its calls.
  Returns the total."""
  total = (read_wall_time(workdir) or 0.0) + float(seconds)
  path = os.path.join(workdir, WALL_TIME_FILE)
  calls = 0
  if os.path.isfile(path):
    with open(path) as f:
      calls = int(json.load(f).get("calls", 0))
  with open(path + ".tmp", "w") as f:
    json.dump({"wall_s": total, "calls": calls + 1}, f)
  os.replace(path + ".tmp", path)
  return total


def load_run(workdir: str, label: Optional[str] = None) -> Run:
  """The `Run` of a run directory; `label` defaults to the directory's name. Raises CompareError
  naming the path when it is not a run directory or has no logged training step yet."""
  label = label if label is not None else default_label(workdir)
  records = _records(workdir)
  train = sorted((r for r in records if r["kind"] == "train"
                  and isinstance(r.get("loss"), (int, float))), key=lambda r: r["step"])
  if not train:
    raise CompareError(f"{os.path.join(workdir, METRICS_FILE)} has no training record with a "
                       "loss: the run has not logged a step yet")
  evals = [r for r in records if r["kind"] == "eval"]
  cfg = _config(workdir)
  steps = np.array([r["step"] for r in train], np.int64)
  names, vio_steps, vio = plots.max_vio_over_training(train)
  scored = [r for r in evals if isinstance(r.get("val_loss"), (int, float))]
  return Run(label=label, workdir=workdir, train_steps=steps,
             train_loss=np.array([r["loss"] for r in train], np.float64),
             tokens=steps * cfg.stages.tokens_per_step,
             validation=plots.validation_series(evals),
             last_eval=sorted(scored, key=lambda r: r["step"])[-1] if scored else None,
             moe_layers=names, max_vio_steps=np.array(vio_steps, np.int64), max_vio=vio,
             config=run_dir.gin_settings(config_lib.to_gin(cfg)),
             planned_steps=cfg.stages.total_steps, tokens_per_step=cfg.stages.tokens_per_step,
             wall_s=read_wall_time(workdir))


def default_label(workdir: str) -> str:
  """The directory's own name ('runs/lr3e-3/' -> 'lr3e-3')."""
  return os.path.basename(os.path.normpath(workdir))


def load_runs(workdirs: Sequence[str], labels: Optional[Sequence[str]] = None) -> list[Run]:
  """`load_run` of each directory, in order. labels: one per directory (default: the directories'
  names). Raises CompareError for no directories, a label count that differs from the directory
  count, or two runs with the same label (their lines could not be told apart)."""
  if not workdirs:
    raise CompareError("no run directories given: expected one or more, e.g. "
                       "`k3jax compare runs/a runs/b --out=runs/compare`")
  if labels is not None and len(labels) != len(workdirs):
    runs = f"{len(workdirs)} run director{'y' if len(workdirs) == 1 else 'ies'}"
    raise CompareError(f"--labels has {len(labels)} label{'s' * (len(labels) != 1)} for {runs}: "
                       "give one per directory, in order")
  labels = list(labels) if labels is not None else [default_label(w) for w in workdirs]
  for label in labels:
    if labels.count(label) > 1:
      raise CompareError(f"two runs are labelled {label!r}: give distinct names with "
                         "--labels=a,b,...")
  return [load_run(w, label) for w, label in zip(workdirs, labels)]
