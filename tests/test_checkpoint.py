"""Tests of k3jax.checkpoint: round trip, retention, unfinalised directories, model-only restore."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.checkpoint import Checkpointer
from k3jax.config import CheckpointConfig


def _state(seed: int):
  rng = np.random.default_rng(seed)
  params = {"layer_0": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                        "scale": jnp.asarray(rng.normal(size=(3,)), jnp.float32)},
            "embedding": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)}
  moe_state = {"layer_1": {"moe": {"bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}}
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  opt_state = opt.init(params)
  # one real update so that the moments and the count are not trivial
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + seed), params)
  _, opt_state = opt.update(grads, opt_state, params)
  return dict(params=params, moe_state=moe_state, opt_state=opt_state,
              rng=jax.random.PRNGKey(seed))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_async(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep_last=2, async_save=True))
  state = _state(1)
  ckpt.save(7, **state, meta={"stage": 1, "seq_len": 32, "data_position": 7})
  ckpt.wait()
  template = _state(2)   # same structure, different values
  out = ckpt.restore(7, **template)
  ckpt.close()
  for k in ("params", "moe_state", "opt_state", "rng"):
    _assert_trees_equal(out[k], state[k])
  assert out["meta"] == {"stage": 1, "seq_len": 32, "data_position": 7, "step": 7}


def test_keeps_last_n_plus_stage_boundaries(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep_last=2, async_save=False),
                      keep_steps=[3, 7])
  state = _state(0)
  for step in range(1, 11):
    ckpt.save(step, **state, meta={"stage": 0, "seq_len": 8, "data_position": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 7, 9, 10]
  ckpt.close()
  on_disk = sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
  assert on_disk == [3, 7, 9, 10]


def test_unfinalised_checkpoint_is_never_restored(tmp_path):
  directory = tmp_path / "ckpt"
  ckpt = Checkpointer(str(directory), CheckpointConfig(keep_last=3))
  good = _state(3)
  ckpt.save(4, **good, meta={"stage": 0, "seq_len": 8, "data_position": 4})
  ckpt.wait()
  ckpt.close()
  # A save of step 6 that was killed half-way: orbax writes into a temporary directory and only
  # renames it to '6' once complete.
  partial = directory / "6.orbax-checkpoint-tmp-1234567890"
  (partial / "model").mkdir(parents=True)
  (partial / "model" / "garbage").write_bytes(b"\x00" * 10)
  ckpt = Checkpointer(str(directory), CheckpointConfig(keep_last=3))
  assert ckpt.latest_step() == 4
  assert ckpt.all_steps() == [4]
  out = ckpt.restore(4, **_state(9))
  _assert_trees_equal(out["params"], good["params"])
  ckpt.close()


def test_restore_model_only(tmp_path):
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, CheckpointConfig())
  state = _state(5)
  ckpt.save(2, **state, meta={"stage": 0, "seq_len": 8, "data_position": 2})
  later = _state(6)
  ckpt.save(5, **later, meta={"stage": 1, "seq_len": 16, "data_position": 5})
  ckpt.wait()
  ckpt.close()
  reader = Checkpointer(directory, CheckpointConfig(), read_only=True)
  params, moe_state, meta = reader.restore_model()          # latest
  _assert_trees_equal(params, later["params"])
  _assert_trees_equal(moe_state, later["moe_state"])
  assert meta["step"] == 5 and meta["seq_len"] == 16
  params, _, meta = reader.restore_model(2)
  _assert_trees_equal(params, state["params"])
  with pytest.raises(ValueError, match="step=3"):
    reader.restore_model(3)
  reader.close()


def test_restore_model_from_empty_directory(tmp_path):
  os.makedirs(tmp_path / "ckpt")
  reader = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(), read_only=True)
  with pytest.raises(FileNotFoundError, match="no finalised checkpoint"):
    reader.restore_model()
  reader.close()
