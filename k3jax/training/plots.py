"""End-of-run PNG plots (matplotlib, Agg backend): losses per stage, validation loss by position
inside the document, expert load, passkey accuracy."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: str) -> str:
  """Writes `fig` to `path` as PNG (110 dpi), closes it, returns `path`."""
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_losses(train_records: Sequence[Mapping], eval_records: Sequence[Mapping],
                stages: Sequence[Sequence[int]], path: str) -> str:
  """Training loss vs step (one colour per stage) with validation loss markers; stage boundaries
  as vertical lines. Records are metrics.jsonl rows ('step', 'loss' / 'val_loss', 'stage')."""
  fig, ax = plt.subplots(figsize=(8, 4.5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (seq_len, _) in enumerate(stages):
    rows = [r for r in train_records if r.get("stage") == i and isinstance(r.get("loss"), float)]
    if rows:
      ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colors[i % len(colors)],
              lw=1.2, label=f"train, stage {i} (T={seq_len})")
  evals = [r for r in eval_records if isinstance(r.get("val_loss"), float)]
  if evals:
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "ko--", ms=5,
            label="validation")
  boundary = 0
  for _, n in stages[:-1]:
    boundary += n
    ax.axvline(boundary, color="grey", lw=0.8, ls=":")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title("Loss per stage")
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_expert_load(loads: np.ndarray, layer_names: Sequence[str], path: str) -> str:
  """Heat-map of routed assignments, layers x experts, normalised by the mean load of each layer
  (1 = balanced). loads: [L, E]."""
  loads = np.asarray(loads, np.float64)
  if loads.ndim != 2:
    raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
  rel = loads / np.maximum(loads.mean(axis=1, keepdims=True), 1e-9)
  fig, ax = plt.subplots(figsize=(max(4, 0.35 * loads.shape[1] + 2), max(2.5, 0.4 * len(rel) + 1.5)))
  im = ax.imshow(rel, aspect="auto", cmap="viridis")
  ax.set_yticks(range(len(layer_names)), labels=list(layer_names), fontsize=8)
  ax.set_xlabel("expert")
  ax.set_title("Expert load / mean load (last step)")
  fig.colorbar(im, ax=ax)
  return _save(fig, path)


def plot_passkey(results: Mapping[int, Mapping[int, float]], path: str) -> str:
  """Passkey accuracy vs context length. results: {training seq_len: {eval length: accuracy}}."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for train_len, by_len in sorted(results.items()):
    lens = sorted(by_len)
    ax.plot(lens, [by_len[n] for n in lens], "o-", label=f"trained at T={train_len}")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("passkey accuracy")
  ax.set_title("Passkey retrieval")
  ax.legend(fontsize=8)
  return _save(fig, path)


LOSS_BY_POS = "val_loss_by_pos/"


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


def plot_loss_by_position(eval_records: Sequence[Mapping], stages: Sequence[Sequence[int]],
                          path: str) -> str:
  """Validation loss vs position inside the document (one line per stage, its last evaluation):
  whether tokens deep inside long documents gain from the longer context of later stages."""
  per_stage = loss_by_position_per_stage(eval_records)
  names = sorted({n for by_pos in per_stage.values() for n in by_pos},
                 key=lambda n: int(n.split("-")[0]))
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for stage, by_pos in sorted(per_stage.items()):
    xs = [i for i, n in enumerate(names) if n in by_pos]
    seq_len = stages[stage][0] if stage < len(stages) else "?"
    ax.plot(xs, [by_pos[names[i]] for i in xs], "o-", label=f"stage {stage} (T={seq_len})")
  ax.set_xticks(range(len(names)), labels=names, fontsize=8)
  ax.set_xlabel("position inside the document (tokens)")
  ax.set_ylabel("validation loss (nats/token)")
  ax.set_title("Validation loss by position")
  ax.legend(fontsize=8)
  return _save(fig, path)


def make_all(plot_dir: str, train_records, eval_records, stages, last_loads, layer_names,
             passkey_results) -> list[str]:
  """Writes every plot that has data into plot_dir; returns the written paths."""
  os.makedirs(plot_dir, exist_ok=True)
  written = [plot_losses(train_records, eval_records, stages, os.path.join(plot_dir, "loss.png"))]
  if loss_by_position_per_stage(eval_records):
    written.append(plot_loss_by_position(eval_records, stages,
                                         os.path.join(plot_dir, "loss_by_position.png")))
  if last_loads is not None and len(layer_names):
    written.append(plot_expert_load(last_loads, layer_names,
                                    os.path.join(plot_dir, "expert_load.png")))
  if passkey_results:
    written.append(plot_passkey(passkey_results, os.path.join(plot_dir, "passkey.png")))
  return written
