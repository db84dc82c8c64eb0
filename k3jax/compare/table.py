"""The comparison's summary: one row per run (final and best losses, tokens, steps, wall time, the
final MaxVio) and the settings whose values differ between the runs, as Markdown and as JSON.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from k3jax.compare.runs import Run

# The final training loss is the mean over this many of the last logged steps: one step's loss
# is the loss of one batch, noisy enough to reorder close runs.
TRAIN_LOSS_WINDOW = 5
UNSET = "(unset)"


def config_differences(runs: Sequence[Run]) -> list[str]:
  """The settings ('Configurable.field', sorted) whose values differ between the runs' stored
  configs; a setting one run lacks counts as UNSET there. Empty for fewer than two runs."""
  names = sorted({name for run in runs for name in run.config})
  return [name for name in names
          if len({run.config.get(name, UNSET) for run in runs}) > 1]


def _number(x) -> Optional[float]:
  """A finite float, or None (JSON has no NaN)."""
  return float(x) if x is not None and math.isfinite(float(x)) else None


def summary_rows(runs: Sequence[Run], window: int = TRAIN_LOSS_WINDOW) -> list[dict]:
  """One dict per run, in order:

  label, workdir; steps (the last logged step), planned_steps (StagesConfig's total); tokens
  (trained on up to `steps`); train_loss: the mean training loss of the last `window` logged
  steps (nats/token), train_loss_steps: how many steps that mean has (fewer when fewer were
  logged); val_loss, val_step, val_seq_len: the last evaluation; best_val_loss, best_val_step: the
  lowest validation loss at the last evaluation's length (losses at other lengths are not
  comparable); max_vio: MaxVio of the last logged step that has it, the mean over the MoE layers;
  wall_s: recorded wall time in seconds; config: {setting: value as gin text} of the
  `config_differences`. Values a run lacks are None.
  """
  if window < 1:
    raise ValueError(f"the final training loss needs a window of at least 1 step, got {window}")
  differences = config_differences(runs)
  rows = []
  for run in runs:
    tail = run.train_loss[-window:]
    row = {"label": run.label, "workdir": run.workdir, "steps": run.steps,
           "planned_steps": run.planned_steps, "tokens": int(run.tokens[-1]),
           "train_loss": float(np.mean(tail)), "train_loss_steps": int(len(tail)),
           "val_loss": None, "val_step": None, "val_seq_len": None, "best_val_loss": None,
           "best_val_step": None, "max_vio": None, "wall_s": _number(run.wall_s),
           "config": {name: run.config.get(name, UNSET) for name in differences}}
    if run.last_eval is not None:
      seq_len = int(run.last_eval["seq_len"])
      steps, losses = run.validation[seq_len]
      best = int(np.argmin(losses))
      row.update(val_loss=float(run.last_eval["val_loss"]), val_step=int(run.last_eval["step"]),
                 val_seq_len=seq_len, best_val_loss=losses[best], best_val_step=steps[best])
    if len(run.max_vio_steps):
      vio = run.max_vio_mean
      logged = np.flatnonzero(np.isfinite(vio))
      if logged.size:
        row["max_vio"] = float(vio[logged[-1]])
    rows.append(row)
  return rows


def _duration(seconds: Optional[float]) -> str:
  if seconds is None:
    return "-"
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 7200:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.2f} h"


def _cell(value, digits: int = 4) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.{digits}f}"
  return str(value).replace("|", "\\|")


def markdown(rows: Sequence[dict], window: int = TRAIN_LOSS_WINDOW) -> str:
  """The rows of `summary_rows` as a Markdown table, one column per differing setting at the end
  (its header is the setting's name), and a line saying what the columns are."""
  differences = list(rows[0]["config"]) if rows else []
  head = ["run", "steps", "tokens", "train loss", "val loss", "best val loss", "val T", "MaxVio",
          "wall time"] + differences
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    steps = f"{r['steps']}/{r['planned_steps']}"
    best = (f"{r['best_val_loss']:.4f} (step {r['best_val_step']})"
            if r["best_val_loss"] is not None else "-")
    train = _cell(r["train_loss"]) + (f" ({r['train_loss_steps']} steps)"
                                      if r["train_loss_steps"] < window else "")
    cells = [_cell(r["label"]), steps, f"{r['tokens']:,}", train,
             _cell(r["val_loss"]), best, _cell(r["val_seq_len"]), _cell(r["max_vio"], 3),
             _duration(r["wall_s"])] + [_cell(r["config"][name]) for name in differences]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", f"steps: last logged / planned. train loss: mean of the last {window} logged "
            "training steps, or of as many as were logged (nats/token). val loss: the last "
            "evaluation, at length val T; best: the lowest at that length. MaxVio: the last "
            "logged step's, mean over the MoE layers. wall time: as recorded by the launcher "
            "(DIR/wall_time.json)."
            + (" Settings that differ between the runs: " + ", ".join(differences) + "."
               if differences else " The runs' settings are all the same.")]
  return "\n".join(lines) + "\n"


def summary_json(rows: Sequence[dict], window: int = TRAIN_LOSS_WINDOW) -> dict:
  """What DIR/summary.json holds: {'train_loss_window', 'config_differences', 'runs': rows}."""
  return {"train_loss_window": window,
          "config_differences": list(rows[0]["config"]) if rows else [], "runs": list(rows)}
