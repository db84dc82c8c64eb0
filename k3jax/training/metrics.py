"""Run metrics: JSON lines in `workdir/metrics.jsonl`, TensorBoard events in `workdir/tb`, a tqdm
bar.

Every record is one flat JSON object with at least 'step' and a 'kind' ('train' or 'eval');
scalars go to TensorBoard under `<kind>/<name>`. On resume, `MetricsWriter(..., resume_step=s)`
drops records after step s, so the file always describes one consistent run.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import tqdm

# Peak dense bf16 FLOP/s used for the MFU estimate when --peak_tflops is not given.
DEFAULT_PEAK_FLOPS = {"gpu": 989e12, "tpu": 459e12, "cpu": 1e12}


def peak_flops_for(backend: str, override_tflops: float = 0.0) -> float:
  """Peak FLOP/s of one device: the override (in TFLOP/s) if > 0, else a default by backend."""
  if override_tflops > 0:
    return override_tflops * 1e12
  if backend not in DEFAULT_PEAK_FLOPS:
    raise ValueError(f"no default peak FLOP/s for backend {backend!r}; pass --peak_tflops")
  return DEFAULT_PEAK_FLOPS[backend]


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_total: float) -> float:
  """Model FLOP utilisation: flops_per_token * tokens/s / peak FLOP/s.

  flops_per_token: the training FLOPs of one token at the current row length,
  `k3jax.model.flops_per_token(cfg, seq_len)` (forward + backward, attention included).
  peak_flops_total: the peak FLOP/s of all devices the tokens ran on.
  """
  for name, value in (("flops_per_token", flops_per_token), ("peak_flops_total", peak_flops_total)):
    if not value > 0:
      raise ValueError(f"mfu: {name} = {value!r} must be a positive number")
  return flops_per_token * tokens_per_s / peak_flops_total


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)):
    v = v.tolist()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/inf; keep it readable
  return v


def read_jsonl(path: str) -> list[dict]:
  """All records of a metrics file (empty list if it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
  """Appends metric records to `workdir/metrics.jsonl` and TensorBoard (`workdir/tb`).

  Args:
    workdir: the run directory.
    resume_step: if given, records with step > resume_step are removed first (they belong to
      steps that will be re-run after restoring the checkpoint of resume_step).
    tensorboard: write TensorBoard events too.
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(self.path):
      kept = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
      with open(self.path, "w") as f:
        for r in kept:
          f.write(json.dumps(r) + "\n")
    elif resume_step is None and os.path.exists(self.path):
      os.remove(self.path)  # a fresh run
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      # Imported here, not with the module: tensorboardX imports torch where it is installed
      # (3.2 s of the GPU image's 5.2 s import of the training loop, RESULTS.md run 20), and the
      # CLI makes its writer while the first step compiles in the background.
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, kind: str, values: Mapping[str, Any]) -> dict:
    record = {"step": int(step), "kind": kind}
    record.update({k: _plain(v) for k, v in values.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in values.items():
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
          self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
    return record

  def write_text(self, tag: str, text: str) -> None:
    if self._tb is not None:
      self._tb.add_text(tag, text, 0)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class Throughput:
  """Tokens per second between successive `tick` calls (wall clock)."""

  def __init__(self):
    self._time = time.perf_counter()
    self._tokens = 0

  def add(self, tokens: int) -> None:
    self._tokens += tokens

  def tick(self) -> float:
    now = time.perf_counter()
    rate = self._tokens / max(now - self._time, 1e-9)
    self._time, self._tokens = now, 0
    return rate


class ProgressBar:
  """A tqdm bar over global steps showing loss, stage and sequence length."""

  def __init__(self, total: int, initial: int, enabled: bool = True):
    self._bar = tqdm.tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                          dynamic_ncols=True, desc="train")

  def update(self, step: int, loss: float, stage: int, seq_len: int) -> None:
    self._bar.set_postfix(loss=f"{loss:.4f}", stage=stage, seq_len=seq_len, refresh=False)
    self._bar.update(step - self._bar.n)

  def write(self, message: str) -> None:
    self._bar.write(message)

  def close(self) -> None:
    self._bar.close()


def mean_over(records: Iterable[Mapping[str, Any]], key: str) -> float:
  vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
  return float(np.mean(vals)) if vals else float("nan")
