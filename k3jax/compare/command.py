r"""The `compare` command: several training runs overlaid in one figure and summarised in one table.

  python -m k3jax.compare runs/lr1e-3 runs/lr3e-3 [more run directories] --out=runs/compare \
      [--labels=slow,fast] [--train_loss_window=5]

(or `k3jax compare ...`). Each argument is a run directory of `k3jax train` (its metrics.jsonl and
config.gin); a run still training is read as far as it has logged. Writes OUT/compare.png
(training loss vs step and vs tokens seen, validation loss vs step, MaxVio vs step: the panels the
runs have data for), OUT/summary.md (the table, also printed) and OUT/summary.json (the same
values as numbers). The table has one row per run (steps, tokens, final training loss, final and
best validation loss, final MaxVio, wall time when a launcher recorded it) and one column per
setting whose value differs between the runs. Nothing is compiled. Exit codes: 0, 2 for a bad
flag or a directory that is not a run (one line naming it). docs/compare.md says more.
"""

from __future__ import annotations

from typing import Sequence

from absl import flags

from k3jax import cli
from k3jax.compare import (TRAIN_LOSS_WINDOW, CompareError, check_out_dir, load_runs,
                           write_comparison)


def define_flags() -> None:
  flags.DEFINE_string("out", None, "The folder for OUT/compare.png, OUT/summary.md and "
                      "OUT/summary.json (created if missing; the files are replaced).")
  flags.DEFINE_list("labels", None, "The runs' names in the figure and the table, comma-separated, "
                    "one per run directory in order (default: the directories' names).")
  flags.DEFINE_integer("train_loss_window", TRAIN_LOSS_WINDOW, "The final training loss is the "
                       "mean of this many last logged training steps.")


def run(workdirs: Sequence[str], out: str | None, labels: Sequence[str] | None,
        window: int) -> int:
  """The command's body: reads the runs, writes the comparison, prints the table. Raises
  CompareError naming the flag or the path for bad input."""
  if not out:
    raise CompareError("--out is missing: the folder for OUT/compare.png, OUT/summary.md and "
                       "OUT/summary.json, e.g. --out=runs/compare")
  check_out_dir(out)
  if window < 1:
    raise CompareError(f"--train_loss_window={window} is not allowed: a number of steps >= 1")
  runs = load_runs(list(workdirs), labels)
  written = write_comparison(runs, out, window)
  print(written["table"], end="")
  print(f"\nwrote {written['figure']}, {written['markdown']} and {written['json']}")
  return 0


def main(argv: Sequence[str]) -> None:
  FLAGS = flags.FLAGS
  # The run directories are the positional arguments: not `cli.start`, which refuses them, and
  # nothing here touches a device or compiles.
  cli.finish(lambda: run(argv[1:], FLAGS.out, FLAGS.labels, FLAGS.train_loss_window),
             usage_errors=(CompareError,))
