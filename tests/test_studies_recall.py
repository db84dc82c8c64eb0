"""The pure helpers of the mqar_recall and situ_glu study launchers (experiments/studies/recall.py)."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments", "studies"))
import recall  # noqa: E402  pylint: disable=wrong-import-position


def test_accuracy_grid_groups_by_setting_and_pairs_over_seeds():
  grid = recall.accuracy_grid([("kda", 0, 4, 1.0), ("kda", 1, 4, 0.5), ("kda", 0, 8, 0.25),
                               ("gla", 0, 4, None)])
  assert list(grid) == ["kda", "gla"]
  assert list(grid["kda"]) == [4, 8]
  spread = grid["kda"][4]
  assert (spread.mean, spread.lo, spread.hi, spread.n) == (0.75, 0.5, 1.0, 2)
  assert grid["kda"][8].n == 1
  assert grid["gla"][4].n == 0 and math.isnan(grid["gla"][4].mean)


@pytest.mark.parametrize("losses, margin, expected", [
    ([], 0.5, 0),
    ([3.0, 2.0, 1.0], 0.5, 0),              # falling: no spike
    ([3.0, 2.0, 2.4, 1.0], 0.5, 0),         # 0.4 above the minimum: under the margin
    ([3.0, 2.0, 2.6, 1.0, 1.9], 0.5, 2),    # 0.6 above 2.0, then 0.9 above 1.0
    ([3.0, float("nan"), 2.0], 0.5, 1),     # a non-finite loss counts, the minimum stays
    ([9.0], 0.0, 0),                        # the first loss never counts
])
def test_loss_spikes(losses, margin, expected):
  assert recall.loss_spikes(losses, margin) == expected


def test_diverged_step_is_the_first_non_finite_training_loss():
  records = [{"kind": "train", "step": 3, "loss": float("inf")},
             {"kind": "eval", "step": 1, "val_loss": float("nan")},
             {"kind": "train", "step": 1, "loss": 2.0},
             {"kind": "train", "step": 2, "loss": float("nan")}]
  assert recall.diverged_step(records) == 2
  assert recall.diverged_step(records[2:3]) is None


def test_nonfinite_step_reads_the_training_error_message():
  text = ("...\nNonFiniteLossError: non-finite loss at step 37 (loss=nan, grad_norm=nan); "
          "stopping without saving this state. Last good checkpoint: step 20\n")
  assert recall.nonfinite_step(text) == 37
  assert recall.nonfinite_step("RunLockedError: locked") is None
