"""saved_residuals.py: the per-token bytes a config's forward pass saves for its backward pass."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
import saved_residuals  # noqa: E402

from k3jax import config as config_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_residuals_per_token_and_no_xla_decay_with_the_fused_gate():
  """Per-token rows that add up, sorted; and the KDA gate fused into the Pallas kernels: nothing of
  kda_gate's fp32 decay (or its intermediates) is saved, as it was when the layer formed g itself
  (83 KB a token for small.gin's nine KDA layers, RESULTS.md run 14)."""
  cfg = config_lib.from_gin([os.path.join(ROOT, "gin_configs", "tiny.gin")])
  out = saved_residuals.residual_table(cfg, seq_len=64, top=1000)
  rows = out["rows"]
  assert rows and out["bytes_per_token"] == round(sum(r[0] for r in rows), 1)
  assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True)
  assert any("pallas_kernels/kda" in r[3] for r in rows)          # the kernels' own residuals
  assert not [r for r in rows if "kda_gate" in r[3]], rows
