"""The verdict and the measurement cache of the context_extension study launcher
(experiments/studies/context_extension.py), on hand-made accuracies."""

import json
import os

import pytest

from testlib import load_experiment

ce = load_experiment("studies", "context_extension")
Spread = ce.common.Spread


def by_mult(*means):
  """{1: Spread, 2: ..., 4: ..., 8: ...} of these means (one seed each)."""
  return {m: Spread(x, x, x, 1) for m, x in zip((1, 2, 4, 8), means)}


def test_learned_needs_half_the_rows_at_1x():
  assert ce.learned(by_mult(0.5, 0, 0, 0))
  assert not ce.learned(by_mult(0.49, 1, 1, 1))
  assert not ce.learned({1: Spread(float("nan"), float("nan"), float("nan"), 0)})


def test_holds_at_compares_with_the_settings_own_1x():
  # 0.8 x 0.9 = 0.72: 0.75 and 0.73 hold, 0.7 does not.
  assert ce.holds_at(by_mult(0.9, 0.75, 0.7, 0.73)) == [2, 8]
  assert ce.holds_at(by_mult(0.4, 0.4, 0.4, 0.4)) == []   # not learned: holds nowhere


@pytest.mark.parametrize("staged, final, word", [
    ((1.0, 0.9, 0.85, 0.8), (1.0, 0.9, 0.5, 0.1), "reproduced"),
    ((1.0, 0.9, 0.85, 0.8), (1.0, 1.0, 0.9, 0.8), "partly"),        # final_only holds too
    ((1.0, 0.9, 0.5, 0.1), (1.0, 0.1, 0.0, 0.0), "partly"),         # staged holds at 2x only
    ((1.0, 0.9, 0.85, 0.8), (0.3, 0.1, 0.0, 0.0), "partly"),        # final_only never learned
    ((1.0, 0.7, 0.5, 0.1), (1.0, 0.1, 0.0, 0.0), "not reproduced"),  # 0.7 < 0.8 x 1.0
    ((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0), "not reproduced"),  # nothing learned
])
def test_verdict_word(staged, final, word):
  assert ce.verdict_word({"staged": by_mult(*staged), "final_only": by_mult(*final)}) == word


def test_grid_of_groups_the_runs_accuracies_by_multiplier():
  record = ce.common.RunRecord
  records = [record("staged", (), 0, "a", (), None, True),
             record("staged", (), 1, "b", (), None, True),
             record("final_only", (), 0, "c", (), None, True)]
  accs = {"a": {256: 1.0, 512: 0.5}, "b": {256: 0.5, 512: 0.25}, "c": {256: 0.75}}
  grid = ce.grid_of(records, accs, (1, 2), 256)
  assert grid["staged"][1] == Spread(0.75, 0.5, 1.0, 2)
  assert grid["staged"][2] == Spread(0.375, 0.25, 0.5, 2)
  assert grid["final_only"][1].n == 1 and grid["final_only"][2].n == 0


def test_cached_accuracies_measures_again_only_when_the_key_changes(tmp_path, monkeypatch):
  calls = []

  def measure(workdir, lengths, samples, eval_tokens):
    calls.append((tuple(lengths), samples))
    return {int(x): 0.5 for x in lengths}
  monkeypatch.setattr(ce, "passkey_accuracies", measure)
  with open(tmp_path / "eval.json", "w") as f:
    json.dump({"final": {"step": 10}}, f)
  log = lambda _: None  # noqa: E731
  assert ce.cached_accuracies(str(tmp_path), [256, 512], 4, 1024, log) == {256: 0.5, 512: 0.5}
  assert ce.cached_accuracies(str(tmp_path), [256, 512], 4, 1024, log) == {256: 0.5, 512: 0.5}
  assert calls == [((256, 512), 4)]
  ce.cached_accuracies(str(tmp_path), [256, 512], 8, 1024, log)         # other rows
  with open(tmp_path / "eval.json", "w") as f:
    json.dump({"final": {"step": 20}}, f)                                # trained further
  ce.cached_accuracies(str(tmp_path), [256, 512], 8, 1024, log)
  assert calls == [((256, 512), 4), ((256, 512), 8), ((256, 512), 8)]
  assert sorted(os.listdir(tmp_path)) == sorted(["eval.json", ce.CACHE_FILE])


def test_settings_train_the_same_tokens():
  plan = ce.PLANS["tiny"]
  staged, final = ce.settings(plan)
  assert (staged.name, final.name) == ("staged", "final_only")
  assert f"StagesConfig.stages = {plan.stages!r}" in staged.bindings
  assert f"StagesConfig.stages = (({plan.final_len}, {plan.steps}),)" in final.bindings
  with pytest.raises(ValueError):
    ce.settings(ce.Plan(512, ((128, 1), (256, 1)), 4096, (), 8, 4096))


def test_the_verdict_names_the_word_the_holds_and_the_gaps():
  grid = {"staged": by_mult(1.0, 1.0, 0.9, 0.6), "final_only": by_mult(1.0, 1.0, 0.8, 0.3)}
  text = ce.verdict(grid, ce.PLANS["tiny"], "tiny")
  assert text.startswith("**Verdict: partly.**")
  assert "staged holds at 2x, 4x, final_only at 2x, 4x" in text
  assert "2x +0.000, 4x +0.100, 8x +0.300" in text


def test_rows_counts_the_examples_of_a_curriculum():
  plan = ce.Plan(256, ((128, 300), (256, 300)), 4096, (), 8, 4096)
  assert ce.rows(plan.stages, plan) == 300 * 32 + 300 * 16
  assert ce.rows(((256, 600),), plan) == 600 * 16


def test_unlearned_note_names_the_runs_that_never_learned_and_averages_the_others():
  record = ce.common.RunRecord
  records = [record("staged", (), 0, "a", (), None, True),
             record("staged", (), 1, "b", (), None, True),
             record("final_only", (), 0, "c", (), None, True),
             record("final_only", (), 1, "d", (), None, True)]
  accs = {"a": {256: 1.0, 512: 0.5}, "b": {256: 1.0, 512: 0.7},
          "c": {256: 1.0, 512: 0.25}, "d": {256: 0.0, 512: 0.0}}
  note = ce.unlearned_note(records, accs, (1, 2), 256)
  assert note.startswith("Runs that did not learn the task at L (1x accuracy below 0.5): "
                         "final_only seed 1 (0.000); ")
  assert ("staged (seeds 0, 1) 1x 1.000 [1.000, 1.000], 2x 0.600 [0.500, 0.700]; "
          "final_only (seed 0) 1x 1.000, 2x 0.250.") in note
  assert ce.unlearned_note(records[:3], accs, (1, 2), 256) == ""
