"""Checkpoints with orbax-checkpoint's `CheckpointManager` (V0 API).

A checkpoint at step s holds the state *after* s optimizer steps, in three items:
  'model': {'params', 'moe_state'}        -- all that inference needs (restored alone for evaluation)
  'train': {'opt_state', 'rng'}           -- the rest of the training state
  'meta':  JSON {'step', 'stage', 'seq_len', 'data_position', ...}
The data position equals the step: the training source's batch at global step s depends only on s.

Orbax writes each step into a temporary directory and renames it when the save is complete (and,
since 0.12.3, writes `commit_success.txt`); the manager only lists finalised steps, so a partially
written checkpoint is never restored. Kept: the last `keep_last` steps plus every stage boundary.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from k3jax import config as config_lib
from k3jax.config import CheckpointConfig

PyTree = Any
ITEMS = ("model", "train", "meta")


class Checkpointer:
  """Saves and restores training state under `directory` (normally `workdir/checkpoints`).

  Args:
    directory: where the step directories live.
    ckpt_cfg: keep_last and async_save.
    keep_steps: steps preserved whatever keep_last says (stage boundaries).
    read_only: True for evaluation (never writes or deletes).
  """

  def __init__(self, directory: str, ckpt_cfg: CheckpointConfig, keep_steps: Sequence[int] = (),
               *, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    preservation = policies.AnyPreservationPolicy([
        policies.LatestN(n=ckpt_cfg.keep_last),
        policies.CustomSteps(steps=list(keep_steps)),
    ])
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=ckpt_cfg.async_save,
        preservation_policy=preservation,
        create=not read_only,
        read_only=read_only,
    )
    self._manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, *, params: PyTree, moe_state: PyTree, opt_state: PyTree,
           rng: jax.Array, meta: dict) -> None:
    """Starts saving step `step` (asynchronously when async_save; `wait` blocks until done)."""
    if self._manager.latest_step() == step:
      return  # already saved (e.g. a stage boundary that is also a periodic save)
    self._manager.save(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave({"params": params, "moe_state": moe_state}),
            train=ocp.args.StandardSave({"opt_state": opt_state, "rng": rng}),
            meta=ocp.args.JsonSave(dict(meta, step=int(step))),
        ),
        force=True)

  def restore(self, step: int, *, params: PyTree, moe_state: PyTree, opt_state: PyTree,
              rng: jax.Array) -> dict:
    """Restores the full training state of `step`, shaped like the given (abstract) trees.

    The arguments are templates (arrays or jax.ShapeDtypeStruct, optionally with shardings);
    returns a dict with 'params', 'moe_state', 'opt_state', 'rng' and 'meta'.
    """
    abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)
    out = self._manager.restore(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract({"params": params, "moe_state": moe_state})),
            train=ocp.args.StandardRestore(abstract({"opt_state": opt_state, "rng": rng})),
            meta=ocp.args.JsonRestore(),
        ))
    return dict(params=out.model["params"], moe_state=out.model["moe_state"],
                opt_state=out.train["opt_state"], rng=out.train["rng"], meta=dict(out.meta))

  def restore_model(self, step: Optional[int] = None) -> tuple[PyTree, PyTree, dict]:
    """Restores only what inference needs: (params, moe_state, meta) of `step` (default latest).

    The trees come back as saved (nested dicts of arrays); the optimizer state is not read.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finalised checkpoint in {self.directory}")
    elif step not in self._manager.all_steps():
      raise ValueError(f"step={step} has no checkpoint in {self.directory}; available: "
                       f"{self.all_steps()}")
    out = self._manager.restore(
        step, args=ocp.args.Composite(model=ocp.args.StandardRestore(),
                                      meta=ocp.args.JsonRestore()))
    return out.model["params"], out.model.get("moe_state", {}), dict(out.meta)

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are finalised."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def to_host(tree: PyTree) -> PyTree:
  """Copies a tree of arrays to numpy (for JSON-free inspection / comparisons)."""
  return jax.tree.map(np.asarray, tree)


def restore_run(workdir: str, step: Optional[int] = None
                ) -> tuple[config_lib.Config, PyTree, PyTree, dict]:
  """(config, params, moe_state, meta) of `step` (default: latest) of a k3jax.train run directory.

  Reads DIR/config.gin and only what inference needs from the checkpoint (no optimizer state).
  """
  gin_path = os.path.join(workdir, "config.gin")
  if not os.path.isfile(gin_path):
    raise FileNotFoundError(f"--workdir={workdir!r} has no config.gin (not a k3jax.train run?)")
  cfg = config_lib.from_gin([gin_path])
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint, read_only=True)
  try:
    params, moe_state, meta = ckpt.restore_model(step)
  finally:
    ckpt.close()
  return cfg, params, moe_state, meta
