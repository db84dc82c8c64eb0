"""The end-of-run plots (k3jax.training.plots) from synthetic metrics.jsonl records: what each
figure's axes hold, checked against the records, and the loss-by-position buckets that follow the
run's stages (EvalConfig.position_bucket_edges). No training."""

from __future__ import annotations

import os

import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.image import AxesImage

from k3jax import config as config_lib
from k3jax.training import plots

GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin_configs")
# tiny.gin's stages, shortened: 16 -> 128 -> 512 -> 2048 tokens per row.
STAGES = ((16, 40), (128, 20), (512, 10), (2048, 10))
LAYERS = ["layer_2/moe", "layer_3/moe", "layer_4/moe"]


def _stage_at(step: int) -> int:
  """The stage of the step that ends at global step `step` (>= 1)."""
  return int(np.searchsorted(np.cumsum([n for _, n in STAGES]), step, side="left"))


def _records():
  """(train records, eval records) as the loop writes them: training every 5 steps and at stage
  ends with a MaxVio per MoE layer (layer_3 missing at step 15), validation at step 0, every
  20 steps and at stage ends at the stage's length, listed out of step order."""
  rng = np.random.default_rng(0)
  train = []
  for step in sorted(set(range(5, 81, 5)) | {40, 60, 70, 80}):
    stage = _stage_at(step)
    r = {"kind": "train", "step": step, "stage": stage, "seq_len": STAGES[stage][0],
         "loss": float(4.0 - 0.02 * step)}
    for name in LAYERS:
      if not (step == 15 and name == "layer_3/moe"):
        r[f"max_vio/{name}"] = float(rng.uniform(0, 1))
    train.append(r)
  evals = []
  for step in (0, 20, 40, 60, 70, 80):
    stage = _stage_at(max(step, 1))
    evals.append({"kind": "eval", "step": step, "stage": stage, "seq_len": STAGES[stage][0],
                  "val_loss": float(4.5 - 0.02 * step - 0.3 * stage)})
  return train, evals[::-1]


def test_validation_is_one_series_per_length_and_never_joins_lengths():
  train, evals = _records()
  loss_at = {(r["step"], r["val_loss"]): r["seq_len"] for r in evals}
  lengths = sorted({r["seq_len"] for r in evals})
  series = plots.validation_series(evals)
  assert sorted(series) == lengths
  for seq_len, (steps, losses) in series.items():
    mine = sorted((r["step"], r["val_loss"]) for r in evals if r["seq_len"] == seq_len)
    assert list(zip(steps, losses)) == mine
  ax = plots.loss_figure(train, evals, STAGES).axes[0]
  val_lines = [l for l in ax.get_lines() if l.get_label().startswith("validation")]
  assert len(val_lines) == len(lengths)           # one line per length, not one for all
  for line in val_lines:
    points = list(zip(line.get_xdata(), line.get_ydata()))
    assert len({loss_at[p] for p in points}) == 1, line.get_label()   # never two lengths
    assert line.get_label() == f"validation at T={loss_at[points[0]]}"
  # Training: one line per stage, each holding exactly that stage's records.
  train_lines = [l for l in ax.get_lines() if l.get_label().startswith("train")]
  assert len(train_lines) == len(STAGES)
  for i, line in enumerate(train_lines):
    assert list(line.get_xdata()) == [r["step"] for r in train if r["stage"] == i]


def test_validation_line_takes_the_colour_of_its_stage():
  train, evals = _records()
  ax = plots.loss_figure(train, evals, STAGES).axes[0]
  colour = {l.get_label(): l.get_color() for l in ax.get_lines()}
  for i, (seq_len, _) in enumerate(STAGES):
    assert colour[f"validation at T={seq_len}"] == colour[f"train, stage {i} (T={seq_len})"]


def test_max_vio_over_training_is_layers_by_logged_steps():
  train, _ = _records()
  names, steps, vio = plots.max_vio_over_training(train + [{"kind": "train", "step": 1,
                                                              "loss": 5.0}])
  logged = sorted(r["step"] for r in train)
  assert names == LAYERS and steps == logged and vio.shape == (len(LAYERS), len(logged))
  for j, r in enumerate(sorted(train, key=lambda r: r["step"])):
    for i, name in enumerate(LAYERS):
      want = r.get(f"max_vio/{name}", np.nan)
      np.testing.assert_equal(vio[i, j], want)
  assert np.isnan(vio[1, logged.index(15)])
  assert plots.max_vio_over_training([{"step": 3, "loss": 2.0}])[1] == []


def test_expert_load_heat_map_has_a_column_per_logged_step_and_a_row_per_layer():
  train, _ = _records()
  names, steps, vio = plots.max_vio_over_training(train)
  loads = np.arange(1, 1 + 3 * 8, dtype=np.float64).reshape(3, 8)
  fig = plots.expert_load_figure(train, STAGES, loads, LAYERS)
  over_time, last = fig.axes[:2]     # the panels, top to bottom; then their colour bars
  (mesh,) = [c for c in over_time.collections if isinstance(c, QuadMesh)]
  values = mesh.get_array()
  assert values.shape == (len(LAYERS), len(steps))
  np.testing.assert_array_equal(np.ma.filled(values, np.nan), vio)
  assert np.ma.getmaskarray(values)[1, steps.index(15)]
  # Column j spans step j (and no other logged step); row i is layer i, named on the axis.
  x_edges = mesh.get_coordinates()[0, :, 0]
  for j, step in enumerate(steps):
    assert x_edges[j] < step < x_edges[j + 1]
  assert [t.get_text() for t in over_time.get_yticklabels()] == LAYERS
  # The stage boundaries, where the row length changes.
  assert sorted(l.get_xdata()[0] for l in over_time.get_lines()) == [40, 60, 70]
  # The last step's panel: layers x experts, each load over its layer's mean.
  (image,) = [i for i in last.get_images() if isinstance(i, AxesImage)]
  np.testing.assert_allclose(image.get_array(), loads / loads.mean(axis=1, keepdims=True))


def test_expert_load_figure_with_one_panel_or_none():
  train, _ = _records()
  assert len(plots.expert_load_figure(train, STAGES).axes) == 2          # heat-map + colour bar
  only_last = plots.expert_load_figure([], STAGES, np.ones((3, 8)), LAYERS)
  assert len(only_last.axes) == 2 and only_last.axes[0].get_images()
  with pytest.raises(ValueError, match="nothing to plot"):
    plots.expert_load_figure([{"step": 5, "loss": 1.0}], STAGES)
  with pytest.raises(ValueError, match="one row per layer name"):
    plots.expert_load_figure(train, STAGES, np.ones((2, 8)), LAYERS)


def test_make_all_writes_every_plot(tmp_path):
  train, evals = _records()
  evals[0].update({"val_loss_by_pos/0-16": 3.0, "val_loss_by_pos/16-inf": 2.5})
  written = plots.make_all(str(tmp_path), train, evals, STAGES, np.ones((3, 8)), LAYERS,
                           {16: {16: 0.0, 32: 0.5}})
  assert sorted(os.path.basename(p) for p in written) == [
      "expert_load.png", "loss.png", "loss_by_position.png", "passkey.png"]
  for path in written:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # No MoE statistics anywhere: no expert-load plot.
  written = plots.make_all(str(tmp_path / "dense"), [{"step": 5, "stage": 0, "loss": 2.0}],
                           [], STAGES, None, [], {})
  assert [os.path.basename(p) for p in written] == ["loss.png"]


# ------------------------------------------------------------------------------------------------
# Loss-by-position buckets that follow the stages
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gin_file,edges", [
    ("tiny.gin", (0, 16, 128, 512)),
    ("small.gin", (0, 8192, 65536, 262144)),
])
def test_default_buckets_are_zero_and_every_stage_length_but_the_last(gin_file, edges):
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, gin_file)])
  assert cfg.eval.position_buckets == ()
  assert cfg.eval.position_bucket_edges(cfg.stages.stages) == edges


@pytest.mark.parametrize("stages,edges", [
    (((4096, 10),), (0, 512, 2048)),              # one length L: 0, L/8, L/2
    (((20, 10),), (0, 2, 10)),
    (((4, 10),), (0, 2)),                         # L // 8 = 0 collapses onto 0
    (((1, 10),), (0,)),
    (((16, 5), (16, 5), (64, 5)), (0, 16)),       # a repeated length is one edge
    (((16, 5), (16, 5)), (0, 2, 8)),              # ... and one length in all
])
def test_derived_buckets_for_other_stages(stages, edges):
  assert config_lib.EvalConfig().position_bucket_edges(stages) == edges


def test_explicit_buckets_are_kept():
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")],
                            ["EvalConfig.position_buckets = (0, 100, 1000)"])
  assert cfg.eval.position_bucket_edges(cfg.stages.stages) == (0, 100, 1000)


def test_loss_by_position_plot_shows_the_buckets_the_records_name():
  names = ["0-16", "16-128", "128-512", "512-inf"]
  evals = []
  for stage, (seq_len, _) in enumerate(STAGES):
    r = {"step": 10 * (stage + 1), "stage": stage, "seq_len": seq_len}
    for name in names:
      if int(name.split("-")[0]) < seq_len:
        r[f"val_loss_by_pos/{name}"] = 3.0 - 0.1 * stage - 0.01 * names.index(name)
    evals.append(r)
  ax = plots.loss_by_position_figure(evals, STAGES).axes[0]
  assert [t.get_text() for t in ax.get_xticklabels()] == names
  for stage, line in enumerate(ax.get_lines()):
    assert list(line.get_xdata()) == list(range(stage + 1))   # stage s reaches bucket s
    np.testing.assert_allclose(line.get_ydata(), [evals[stage][f"val_loss_by_pos/{n}"]
                                                  for n in names[:stage + 1]])
