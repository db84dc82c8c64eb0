"""The comparison's overlay figure (matplotlib, no pyplot: a plain `Figure`, as in
`k3jax.training.plots`): one panel per quantity, one line per run in the same colour in every
panel.

Panels, in order: training loss vs step; training loss vs tokens seen; validation loss vs step
(when a run has evaluations; one line per run and evaluated length, since losses at different
lengths are not comparable); MaxVio vs step (when a run logged it; the mean over the MoE layers).
"""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib
from matplotlib.figure import Figure

from k3jax.compare.runs import Run

TRAIN_STEP = "training loss vs step"
TRAIN_TOKENS = "training loss vs tokens seen"
VALIDATION = "validation loss vs step"
MAX_VIO = "MaxVio vs step (mean over MoE layers)"
LOSS_LABEL = "loss (nats/token)"
# Markers of the evaluated lengths, shortest first, when runs evaluated at several.
_LENGTH_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _colors() -> list[str]:
  return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def panels(runs: Sequence[Run]) -> list[str]:
  """The titles of the panels `overlay_figure` draws for these runs, in order."""
  out = [TRAIN_STEP, TRAIN_TOKENS]
  if any(run.validation for run in runs):
    out.append(VALIDATION)
  if any(len(run.max_vio_steps) for run in runs):
    out.append(MAX_VIO)
  return out


def overlay_figure(runs: Sequence[Run]) -> Figure:
  """The runs overlaid, one panel per quantity (`panels`), two panels a row.

  Lines are labelled with the run's label; validation lines with 'label (T=seq_len)', one marker
  per evaluated length. Training loss: `Run.train_loss` at `Run.train_steps` and at
  `Run.tokens`; validation: `Run.validation`; MaxVio: `Run.max_vio_mean` at `Run.max_vio_steps`.
  """
  if not runs:
    raise ValueError("overlay_figure: no runs to plot")
  titles = panels(runs)
  rows = -(-len(titles) // 2)
  fig = Figure(figsize=(12, 4.2 * rows), layout="constrained")
  colors = _colors()
  lengths = sorted({seq_len for run in runs for seq_len in run.validation})
  for i, title in enumerate(titles):
    ax = fig.add_subplot(rows, 2, i + 1)
    for j, run in enumerate(runs):
      color = colors[j % len(colors)]
      if title == TRAIN_STEP:
        ax.plot(run.train_steps, run.train_loss, color=color, lw=1.2, label=run.label)
      elif title == TRAIN_TOKENS:
        ax.plot(run.tokens, run.train_loss, color=color, lw=1.2, label=run.label)
      elif title == VALIDATION:
        for seq_len, (steps, losses) in run.validation.items():
          marker = _LENGTH_MARKERS[lengths.index(seq_len) % len(_LENGTH_MARKERS)]
          ax.plot(steps, losses, marker + "--", color=color, ms=4, lw=1.0,
                  label=f"{run.label} (T={seq_len})")
      elif len(run.max_vio_steps):
        ax.plot(run.max_vio_steps, run.max_vio_mean, color=color, lw=1.2, label=run.label)
    ax.set_title(title)
    ax.set_xlabel("tokens seen" if title == TRAIN_TOKENS else "step")
    ax.set_ylabel("MaxVio (max load / mean load - 1)" if title == MAX_VIO else LOSS_LABEL)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  return fig


def save_figure(fig: Figure, path: str) -> str:
  """Writes `fig` to `path` as PNG (110 dpi, the run plots' resolution), creating its folder;
  returns `path`."""
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)
  fig.savefig(path, dpi=110)
  return path
