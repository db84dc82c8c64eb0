"""End-of-run PNG plots (matplotlib, no pyplot: figures are plain `Figure` objects): losses per
stage, validation loss by position inside the document, expert load over training, passkey
accuracy.

Each plot has a `*_figure` function that builds the figure from the records (what the tests
inspect) and a `plot_*` function that writes it; the data each figure shows comes from a helper
that reads metrics.jsonl's records (`validation_series`, `max_vio_over_training`,
`loss_by_position_per_stage`). `make_all` writes every plot that has data.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import matplotlib
from matplotlib.figure import Figure
import numpy as np

MAX_VIO = "max_vio/"
LOSS_BY_POS = "val_loss_by_pos/"


def _save(fig: Figure, path: str) -> str:
  """Writes `fig` to `path` as PNG (110 dpi); returns `path`."""
  fig.savefig(path, dpi=110)
  return path


def _colors() -> list[str]:
  return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def _stage_boundaries(stages: Sequence[Sequence[int]]) -> list[int]:
  """The global steps at which each stage but the last ends."""
  return [int(x) for x in np.cumsum([n for _, n in stages])[:-1]]


def validation_series(eval_records: Sequence[Mapping]) -> dict[int, tuple[list[int], list[float]]]:
  """{seq_len: (steps, validation losses)} from the eval records ('step', 'seq_len', 'val_loss'),
  one series per evaluated length in step order: losses at different lengths are not comparable
  (a longer row gives each token more context), so no series mixes them. Records whose val_loss
  is not a number are left out."""
  out: dict[int, tuple[list[int], list[float]]] = {}
  for r in sorted(eval_records, key=lambda r: r["step"]):
    if isinstance(r.get("val_loss"), (int, float)):
      steps, losses = out.setdefault(int(r["seq_len"]), ([], []))
      steps.append(int(r["step"]))
      losses.append(float(r["val_loss"]))
  return dict(sorted(out.items()))


def loss_figure(train_records: Sequence[Mapping], eval_records: Sequence[Mapping],
                stages: Sequence[Sequence[int]]) -> Figure:
  """Training loss vs step, one line per stage, and validation loss vs step, one dashed line with
  markers per evaluated length (`validation_series`) in the colour of the stage of that length;
  stage boundaries as dotted vertical lines. Records are metrics.jsonl rows ('step', 'stage',
  'loss' for training; 'step', 'seq_len', 'val_loss' for evaluations)."""
  fig = Figure(figsize=(8, 4.5), layout="tight")
  ax = fig.add_subplot()
  colors = _colors()
  for i, (seq_len, _) in enumerate(stages):
    rows = [r for r in train_records if r.get("stage") == i and isinstance(r.get("loss"), float)]
    if rows:
      ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colors[i % len(colors)],
              lw=1.2, label=f"train, stage {i} (T={seq_len})")
  stage_lengths = [seq_len for seq_len, _ in stages]
  others = 0
  for seq_len, (steps, losses) in validation_series(eval_records).items():
    if seq_len in stage_lengths:
      color = colors[stage_lengths.index(seq_len) % len(colors)]
    else:  # a length no stage trains at: a colour after the stages'
      color = colors[(len(stages) + others) % len(colors)]
      others += 1
    ax.plot(steps, losses, "o--", color=color, ms=5, mec="black", mew=0.6, lw=1.0,
            label=f"validation at T={seq_len}")
  for boundary in _stage_boundaries(stages):
    ax.axvline(boundary, color="grey", lw=0.8, ls=":")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title("Loss per stage (validation: one line per length)")
  ax.legend(fontsize=8)
  return fig


def plot_losses(train_records: Sequence[Mapping], eval_records: Sequence[Mapping],
                stages: Sequence[Sequence[int]], path: str) -> str:
  """`loss_figure` written to `path`; returns `path`."""
  return _save(loss_figure(train_records, eval_records, stages), path)


def max_vio_over_training(train_records: Sequence[Mapping]
                          ) -> tuple[list[str], list[int], np.ndarray]:
  """(MoE layer names, logged steps, MaxVio [layers, steps]) from the training records'
  'max_vio/<layer>' entries (max load / mean load - 1 of each logged step's routing; 0 is
  balanced). Layers are in the order the records list them (the layer order); steps ascending;
  a layer a record does not have is NaN there. No record with MaxVio: ([], [], [0, 0] array)."""
  rows = sorted((r for r in train_records if any(k.startswith(MAX_VIO) for k in r)),
                key=lambda r: r["step"])
  names: list[str] = []
  for r in rows:
    for key in r:
      if key.startswith(MAX_VIO) and key[len(MAX_VIO):] not in names:
        names.append(key[len(MAX_VIO):])
  vio = np.full((len(names), len(rows)), np.nan)
  for j, r in enumerate(rows):
    for i, name in enumerate(names):
      value = r.get(MAX_VIO + name)
      if isinstance(value, (int, float)):
        vio[i, j] = value
  return names, [int(r["step"]) for r in rows], vio


def _step_edges(steps: Sequence[int]) -> np.ndarray:
  """Cell edges [len(steps) + 1] around ascending steps: midway between neighbours, and half the
  neighbouring gap (0.5 for a single step) beyond the ends."""
  s = np.asarray(steps, np.float64)
  if len(s) == 1:
    return np.array([s[0] - 0.5, s[0] + 0.5])
  mid = (s[1:] + s[:-1]) / 2
  return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def _layer_ticks(ax, names: Sequence[str]) -> None:
  """Layer names on the y axis, at most ~24 of them (every k-th for deep models)."""
  every = max(1, -(-len(names) // 24))
  ticks = list(range(0, len(names), every))
  ax.set_yticks(ticks, labels=[names[i] for i in ticks], fontsize=7)


def expert_load_figure(train_records: Sequence[Mapping], stages: Sequence[Sequence[int]],
                       last_loads: Optional[np.ndarray] = None,
                       layer_names: Sequence[str] = ()) -> Figure:
  """Expert load over training: a heat-map of MaxVio, one row per MoE layer and one column per
  logged step (`max_vio_over_training`; columns at their steps, stage boundaries dotted), over the
  last step's load of each expert relative to its layer's mean (last_loads [layers, experts] with
  layer_names, 1 = balanced), when given. Either panel is left out without its data; with
  neither, ValueError."""
  names, steps, vio = max_vio_over_training(train_records)
  has_last = last_loads is not None and len(layer_names) > 0
  if not steps and not has_last:
    raise ValueError("expert_load_figure: no training record has max_vio/<layer> and no last "
                     "loads were given: nothing to plot")
  panels = []
  if steps:
    panels.append(("vio", max(2.5, 0.22 * len(names) + 1.5)))
  if has_last:
    loads = np.asarray(last_loads, np.float64)
    if loads.ndim != 2 or loads.shape[0] != len(layer_names):
      raise ValueError(f"last_loads must be [layers, experts] with one row per layer name "
                       f"({len(layer_names)}), got shape {loads.shape}")
    panels.append(("last", max(2.5, 0.22 * len(layer_names) + 1.5)))
  heights = [min(h, 10.0) for _, h in panels]
  fig = Figure(figsize=(9, sum(heights) + 0.3), layout="constrained")
  axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
  for ax, (kind, _) in zip(axes, panels):
    if kind == "vio":
      mesh = ax.pcolormesh(_step_edges(steps), np.arange(len(names) + 1) - 0.5,
                           np.ma.masked_invalid(vio), cmap="magma", vmin=0.0, shading="flat")
      ax.set_ylim(len(names) - 0.5, -0.5)    # the first layer on top
      _layer_ticks(ax, names)
      for boundary in _stage_boundaries(stages):
        ax.axvline(boundary, color="white", lw=1.0, ls=":")
      ax.set_xlabel("step")
      ax.set_title("MaxVio per MoE layer over training (max load / mean load - 1; 0 = balanced)")
      fig.colorbar(mesh, ax=ax, label="MaxVio")
    else:
      rel = loads / np.maximum(loads.mean(axis=1, keepdims=True), 1e-9)
      im = ax.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest")
      _layer_ticks(ax, list(layer_names))
      ax.set_xlabel("expert")
      ax.set_title("Expert load / mean load of its layer, last step (1 = balanced)")
      fig.colorbar(im, ax=ax, label="load / mean")
  return fig


def plot_expert_load(train_records: Sequence[Mapping], stages: Sequence[Sequence[int]],
                     last_loads: Optional[np.ndarray], layer_names: Sequence[str],
                     path: str) -> str:
  """`expert_load_figure` written to `path`; returns `path`."""
  return _save(expert_load_figure(train_records, stages, last_loads, layer_names), path)


def passkey_figure(results: Mapping[int, Mapping[int, float]]) -> Figure:
  """Passkey accuracy vs context length. results: {training seq_len: {eval length: accuracy}}."""
  fig = Figure(figsize=(6, 4), layout="tight")
  ax = fig.add_subplot()
  for train_len, by_len in sorted(results.items()):
    lens = sorted(by_len)
    ax.plot(lens, [by_len[n] for n in lens], "o-", label=f"trained at T={train_len}")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("passkey accuracy")
  ax.set_title("Passkey retrieval")
  ax.legend(fontsize=8)
  return fig


def plot_passkey(results: Mapping[int, Mapping[int, float]], path: str) -> str:
  """`passkey_figure` written to `path`; returns `path`."""
  return _save(passkey_figure(results), path)


def loss_by_position_per_stage(eval_records: Sequence[Mapping]) -> dict[int, dict[str, float]]:
  """{stage: {bucket name '<lo>-<hi>': loss}} from the last evaluation record of each stage that has
  the loss by position (eval records of k3jax.training.evaluation); empty buckets (None) are left
  out."""
  out: dict[int, dict[str, float]] = {}
  for r in eval_records:
    by_pos = {k[len(LOSS_BY_POS):]: v for k, v in r.items()
              if k.startswith(LOSS_BY_POS) and isinstance(v, (int, float))}
    if by_pos and "stage" in r:
      out[int(r["stage"])] = by_pos
  return out


def loss_by_position_figure(eval_records: Sequence[Mapping],
                            stages: Sequence[Sequence[int]]) -> Figure:
  """Validation loss vs position inside the document (one line per stage, its last evaluation;
  the buckets are those the records name, `EvalConfig.position_bucket_edges`): whether tokens
  deep inside long documents gain from the longer context of later stages."""
  per_stage = loss_by_position_per_stage(eval_records)
  names = sorted({n for by_pos in per_stage.values() for n in by_pos},
                 key=lambda n: int(n.split("-")[0]))
  fig = Figure(figsize=(6.5, 4), layout="tight")
  ax = fig.add_subplot()
  for stage, by_pos in sorted(per_stage.items()):
    xs = [i for i, n in enumerate(names) if n in by_pos]
    seq_len = stages[stage][0] if stage < len(stages) else "?"
    ax.plot(xs, [by_pos[names[i]] for i in xs], "o-", label=f"stage {stage} (T={seq_len})")
  ax.set_xticks(range(len(names)), labels=names, fontsize=8)
  ax.set_xlabel("position inside the document (tokens)")
  ax.set_ylabel("validation loss (nats/token)")
  ax.set_title("Validation loss by position")
  ax.legend(fontsize=8)
  return fig


def plot_loss_by_position(eval_records: Sequence[Mapping], stages: Sequence[Sequence[int]],
                          path: str) -> str:
  """`loss_by_position_figure` written to `path`; returns `path`."""
  return _save(loss_by_position_figure(eval_records, stages), path)


def make_all(plot_dir: str, train_records, eval_records, stages, last_loads, layer_names,
             passkey_results) -> list[str]:
  """Writes every plot that has data into plot_dir; returns the written paths.

  train_records / eval_records: metrics.jsonl's rows of each kind; stages: StagesConfig.stages;
  last_loads: the last step's routed load [layers, experts] of the MoE layers `layer_names`, or
  None; passkey_results: {training seq_len: {eval length: accuracy}}.
  """
  os.makedirs(plot_dir, exist_ok=True)
  written = [plot_losses(train_records, eval_records, stages, os.path.join(plot_dir, "loss.png"))]
  if loss_by_position_per_stage(eval_records):
    written.append(plot_loss_by_position(eval_records, stages,
                                         os.path.join(plot_dir, "loss_by_position.png")))
  has_last = last_loads is not None and len(layer_names) > 0
  if max_vio_over_training(train_records)[1] or has_last:
    written.append(plot_expert_load(train_records, stages, last_loads if has_last else None,
                                    layer_names, os.path.join(plot_dir, "expert_load.png")))
  if passkey_results:
    written.append(plot_passkey(passkey_results, os.path.join(plot_dir, "passkey.png")))
  return written
