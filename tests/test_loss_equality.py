"""experiments/benchmarks/loss_equality.py: its comparison, and its smoke mode on CPU (where both
paths are XLA: the machinery, equal losses for equal programs, unequal ones reported)."""

import json
import math
import os
import subprocess
import sys

import pytest
from testlib import load_benchmark

le = load_benchmark("loss_equality")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_relative_differences_against_closed_form():
  diffs = le.relative_differences([2.0, 3.3, 0.0, 1.0, math.nan], [2.0, 3.0, 0.0, 0.0, 1.0])
  assert diffs[:2] == [0.0, pytest.approx(0.1)]
  assert diffs[2] == 0.0 and diffs[3] == math.inf and math.isnan(diffs[4])
  with pytest.raises(ValueError, match="reference"):
    le.relative_differences([1.0], [1.0, 2.0])


def test_compare_passes_within_tolerance_only():
  ref = dict(path="old", losses=[5.0, 4.0], grad_norms=[1.0, 2.0])
  close = dict(path="new", losses=[5.005, 4.0], grad_norms=[1.1, 2.0])
  row = le.compare(close, ref, 2e-3)
  assert row["passed"] and row["max_loss_rel_diff"] == pytest.approx(1e-3)
  assert row["grad_norm_rel_diff_first"] == pytest.approx(0.1)
  far = dict(path="new", losses=[5.0, 4.02], grad_norms=[1.0, 2.0])
  assert not le.compare(far, ref, 2e-3)["passed"]
  # A nan after a finite step fails (max() alone would skip it).
  broken = dict(path="new", losses=[5.0, math.nan], grad_norms=[1.0, 2.0])
  assert not le.compare(broken, ref, 2e-3)["passed"]


def test_parse_paths():
  assert le.parse_paths("new,old") == ["old", "new"]
  assert le.parse_paths(" old , new ") == ["old", "new"]
  # 'pallas_bwd' (ImplConfig.attention_impl = 'tokamax_pallas_bwd') went with its variant.
  for bad in ("new", "old", "old,old", "old,cudnn", "new,pallas_bwd", "old,new,pallas_bwd"):
    with pytest.raises(ValueError, match="--paths"):
      le.parse_paths(bad)


# Two decoder layers (one KDA, one MLA) instead of tiny.gin's four: the machinery is the point,
# and each path traces and initialises its own model.
_SMALLER = ["--gin_bindings=ModelConfig.num_layers = 2", "--gin_bindings=ModelConfig.mla_every = 2"]


def _smoke(cache_dir, *extra):
  """Runs `loss_equality.py --smoke` (two decoder layers) in a child process: (exit status,
  {event: [rows]})."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run(
      [sys.executable, os.path.join(_REPO, "experiments", "benchmarks", "loss_equality.py"),
       "--smoke", f"--cache_dir={cache_dir}", *_SMALLER, *extra],
      capture_output=True, text=True, timeout=600, env=env, cwd=_REPO)
  rows = {}
  for line in out.stdout.splitlines():
    if line.startswith("{"):
      row = json.loads(line)
      rows.setdefault(row["event"], []).append(row)
  assert "summary" in rows, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
  return out.returncode, rows


@pytest.mark.slow
def test_smoke_equal_paths_pass_and_a_different_seed_fails(tmp_path):
  # One compilation cache for both runs: on CPU every run compiles the same step program.
  cache = str(tmp_path / "cache")
  rc, rows = _smoke(cache)
  old, new = rows["path"]
  assert [old["path"], new["path"]] == ["old", "new"]
  # On CPU 'auto' resolves to the XLA attention and the tiled grouped matmul: the same program.
  assert old["attention"] == new["attention"] == "xla"
  assert len(old["losses"]) == 2 and all(math.isfinite(x) for x in old["losses"])
  assert new["losses"] == old["losses"] and new["grad_norms"] == old["grad_norms"]
  (cmp,) = rows["summary"][0]["comparisons"]
  assert rc == 0 and cmp["passed"] and cmp["max_loss_rel_diff"] == 0.0

  rc, rows = _smoke(cache, "--candidate_bindings=Config.seed = 1")
  old_again, other = rows["path"]
  assert old_again["losses"] == old["losses"]   # the reference is the same run again
  (cmp,) = rows["summary"][0]["comparisons"]
  assert rc == 1 and not cmp["passed"] and not rows["summary"][0]["passed"]
  # Another initialisation: the first step's loss differs by more than the tolerance.
  expected = abs(other["losses"][0] - old["losses"][0]) / old["losses"][0]
  assert cmp["loss_rel_diff"][0] == pytest.approx(expected) and expected > 2e-3
  assert cmp["grad_norm_rel_diff_first"] > 0
