"""experiments/benchmarks/train_bench.py: its rows and case sets (the GPU runs are the lead's)."""

import argparse

import numpy as np
import pytest
from testlib import load_benchmark

tb = load_benchmark("train_bench")


def test_packed_rows_have_geometric_documents():
  b = tb.random_rows(4, 4096, "packed", vocab_size=257, bos_id=256, doc_len=64, seed=1)
  seg, inputs, targets = b["segment_ids"], b["inputs"], b["targets"]
  assert seg.shape == inputs.shape == (4, 4096) and seg.dtype == np.int32
  starts = inputs == 256
  # A document starts at each BOS (and at position 0), numbered 1, 2, ... within the row.
  np.testing.assert_array_equal(seg, np.cumsum(starts | (np.arange(4096) == 0), axis=1))
  assert np.all(np.diff(seg, axis=1) >= 0) and np.all(seg[:, 0] == 1)
  mean_len = seg.size / seg.max(axis=1).sum()
  assert 48 < mean_len < 80  # geometric with mean 64 (16K tokens: a few % off at most)
  np.testing.assert_array_equal(b["loss_mask"], (targets != 256).astype(np.float32))
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_single_rows_are_one_document():
  b = tb.random_rows(2, 1024, "single", vocab_size=257, bos_id=256, doc_len=8, seed=0)
  assert np.all(b["segment_ids"] == 1) and np.all(b["loss_mask"] == 1)
  assert b["inputs"].max() < 256 and b["inputs"].min() >= 0
  with pytest.raises(ValueError, match="rows"):
    tb.random_rows(1, 8, "mixed", vocab_size=257, bos_id=256, doc_len=8)


def test_case_sets():
  args = argparse.Namespace(cases="curriculum", steps=0, warmup=None, gin_file=None, seq_len=8192,
                            batch=4, rows="packed", seq_lens=[8192, 65536, 262144, 1048576])
  cur = tb.case_sets(False, args)
  assert [(c["seq_len"], c["rows"]) for c in cur] == [
      (t, r) for t in (8192, 65536, 262144, 1048576) for r in ("single", "packed")]
  assert all(c["batch"] == 1 and c["gin_files"] == ["gin_configs/small.gin"] for c in cur)
  assert [c["warm_rerun"] for c in cur] == [True] + [False] * 7
  assert cur[-1]["steps"] < cur[0]["steps"]  # fewer steps for the 1M-token rows
  args.cases = "throughput"
  names = [c["name"] for c in tb.case_sets(False, args)]
  assert names == ["small_packed_4x8192", "medium_packed_4x8192"]
  smoke = tb.case_sets(True, args)
  assert smoke[0]["gin_files"] == ["gin_configs/tiny.gin"] and smoke[0]["steps"] == 2
  args.cases = "bogus"
  with pytest.raises(ValueError, match="--cases"):
    tb.case_sets(False, args)


def test_curriculum_row_lengths_are_chosen_in_order():
  args = argparse.Namespace(cases="curriculum", steps=0, warmup=None, gin_file=None, seq_len=8192,
                            batch=4, rows="packed", seq_lens=[65536, 8192])
  cur = tb.case_sets(False, args)
  assert [(c["seq_len"], c["rows"]) for c in cur] == [
      (65536, "single"), (65536, "packed"), (8192, "single"), (8192, "packed")]


def test_compile_only_state_shapes_key_the_program_that_a_run_reads(tmp_path):
  """A compile-only case lowers the step against the state's shapes placed on device 0; a later
  run with the initialised state finds that program in the lowered cache (no second trace)."""
  import jax.numpy as jnp
  from k3jax import config as config_lib
  from k3jax import training as train_lib
  from k3jax.model import K3Model
  from k3jax.runtime import Runtime
  from testlib import TINY_RUN_BINDINGS
  cfg = config_lib.from_gin(["gin_configs/tiny.gin"], TINY_RUN_BINDINGS)
  # As train_bench's compile-only case takes them: placed where the initialisation puts the state.
  shapes, optimizer, schedule = train_lib.placed_train_state_shapes(cfg, 10)
  state, _, _ = train_lib.init_train_state(cfg, 10)
  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule,
                                   Runtime(cfg.runtime, str(tmp_path)), total_steps=10)
  b, t = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  batch = {k: jnp.ones((b, t), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in ("inputs", "targets", "segment_ids", "loss_mask")}
  tb.lower_and_compile(step, shapes, batch)
  assert (step.hits, step.misses) == (0, 1)
  state, _ = step(state, batch)   # the step donates its state
  assert (step.hits, step.misses) == (0, 1)   # the same program object: nothing traced again
  again = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule,
                                    Runtime(cfg.runtime, str(tmp_path)), total_steps=10)
  again(state, batch)
  assert (again.hits, again.misses) == (1, 0)


def test_gaps_without_a_profile_is_refused(capsys):
  with pytest.raises(SystemExit):
    tb.main(["--gaps"])
  assert "--gaps reads the profile: give --profile=FOLDER too" in capsys.readouterr().err
