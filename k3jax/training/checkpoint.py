"""Checkpoints with orbax-checkpoint's `CheckpointManager` (V0 API).

A checkpoint at step s holds the state *after* s optimizer steps, in three items:
  'model': {'params', 'moe_state'}        -- all that inference needs (restored alone for evaluation)
  'train': {'opt_state', 'rng'}           -- the rest of the training state
  'meta':  JSON {'step', 'stage', 'seq_len', 'data_position', ...}
The data position equals the step: the training source's batch at global step s depends only on s.

Orbax writes each step into a temporary directory and renames it when the save is complete (and,
since 0.12.3, writes `commit_success.txt`); the manager only lists finalised steps, so a partially
written checkpoint is never restored. Kept: the last `keep_last` steps plus every stage boundary.

Integrity. Before any array is read, the stored tree's paths, shapes and dtypes (orbax's metadata,
no array data) are compared with the target's; a difference raises `IncompatibleCheckpointError`
listing it (a changed model or optimizer, not a damaged file). A finalised step whose files cannot
be read (truncated or missing data) is damaged: `restore_latest` reports it in one line, moves it
to `checkpoints/corrupt/<step>` (never deleted: the user decides) and falls back to the newest step
that restores. Read-only users (evaluation, generation) skip such a step without moving it.

Conversion hook. A checkpoint written with another parameter-tree structure (e.g. per-layer keys
before a scan over layers) can still be restored through `convert(item, tree) -> tree`: it is
called with item 'model' ({'params', 'moe_state'}) or 'train' ({'opt_state', 'rng'}) and the stored
tree as nested dicts and lists, only when the stored paths differ from the target's. It must be a
pure restructuring that `jax.eval_shape` can trace (it is checked on the metadata first).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from k3jax import config as config_lib
from k3jax.config import CheckpointConfig
from k3jax.model import to_layout
from k3jax.training import run_dir

PyTree = Any
ITEMS = ("model", "train", "meta")
# Where restore_latest moves a damaged step (inside the checkpoint directory; orbax lists only
# integer-named step directories, so it never sees these).
CORRUPT_DIR = "corrupt"
# How many differing leaves an IncompatibleCheckpointError names before "... and N more".
_SHOWN_DIFFERENCES = 2
Convert = Callable[[str, PyTree], PyTree]


class IncompatibleCheckpointError(ValueError):
  """The stored tree of a step differs from the target in paths, shapes or dtypes.

  Attributes: step (int), differences (list of 'path: stored ..., expected ...' strings).
  """

  def __init__(self, step: int, differences: Sequence[str]):
    self.step = step
    self.differences = list(differences)
    shown = "; ".join(self.differences[:_SHOWN_DIFFERENCES])
    more = len(self.differences) - _SHOWN_DIFFERENCES
    super().__init__(f"checkpoint step {step} does not fit the model: {shown}"
                     + (f"; and {more} more" if more > 0 else ""))


class CorruptCheckpointError(RuntimeError):
  """No finalised step could be read (each was damaged); `reports` has one line per step."""

  def __init__(self, directory: str, reports: Sequence[str]):
    self.reports = list(reports)
    super().__init__(f"no checkpoint in {directory} can be read: " + "; ".join(self.reports))


def _key_name(key: Any) -> str:
  """One path entry as orbax names it on disk: dict keys, sequence indices, namedtuple fields."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def flat_shapes(tree: PyTree) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{'a/b/0/c': (shape, dtype)} of a tree of arrays, ShapeDtypeStructs or orbax ArrayMetadata.

  Namedtuples and tuples are named by field and index, as orbax stores them (as dicts / lists),
  so a target tree and the metadata of its checkpoint give the same keys.
  """
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if leaf is None or not hasattr(leaf, "shape"):
      continue  # empty optimizer states (optax.EmptyState) hold no arrays
    out["/".join(_key_name(k) for k in path)] = (tuple(leaf.shape), np.dtype(leaf.dtype))
  return out


def tree_differences(stored: dict, target: dict) -> list[str]:
  """Readable differences between two `flat_shapes` dicts (missing, unexpected, shape, dtype)."""
  fmt = lambda sd: f"{sd[1].name}{list(sd[0])}"
  diffs = []
  for path in sorted(set(stored) | set(target)):
    if path not in stored:
      diffs.append(f"{path}: not stored, expected {fmt(target[path])}")
    elif path not in target:
      diffs.append(f"{path}: stored {fmt(stored[path])}, not in the model")
    elif stored[path] != target[path]:
      diffs.append(f"{path}: stored {fmt(stored[path])}, expected {fmt(target[path])}")
  return diffs


def _is_out_of_memory(error: BaseException) -> bool:
  """Running out of memory while reading says nothing about the files: never a damaged step."""
  return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def _root_cause(error: BaseException) -> str:
  """The first line of the innermost exception (tensorstore's 'OUT_OF_RANGE: Error reading ...'
  under orbax's wrappers), at most 240 characters."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  return (lines[0] if lines else type(error).__name__)[:240]


@contextlib.contextmanager
def _unraisable_swallowed():
  """Inside: exceptions Python cannot raise (orbax's other read coroutines of a damaged step, each
  failing too and never awaited) are dropped instead of printed as 'Exception ignored in ...'
  tracebacks; the damaged step is reported once by the caller. The previous hook comes back."""
  previous = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    yield
  finally:
    gc.collect()  # the abandoned coroutines are finalised here, under the silent hook
    sys.unraisablehook = previous


class Checkpointer:
  """Saves and restores training state under `directory` (normally `workdir/checkpoints`).

  Args:
    directory: where the step directories live.
    ckpt_cfg: keep_last and async_save.
    keep_steps: steps preserved whatever keep_last says (stage boundaries).
    read_only: True for evaluation and generation: `save` raises, nothing is created, moved or
      deleted (orbax's own read_only option is not used: it logs a false "Given directory is read
      only" warning, and our reader writes nothing anyway).
  """

  def __init__(self, directory: str, ckpt_cfg: CheckpointConfig, keep_steps: Sequence[int] = (),
               *, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    preservation = policies.AnyPreservationPolicy([
        policies.LatestN(n=ckpt_cfg.keep_last),
        policies.CustomSteps(steps=list(keep_steps)),
    ])
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=ckpt_cfg.async_save,
        preservation_policy=preservation,
        create=not read_only,
    )
    # Handlers registered up front so that a step's metadata can be read before any restore.
    handlers = {"model": ocp.StandardCheckpointHandler(),
                "train": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, *, params: PyTree, moe_state: PyTree, opt_state: PyTree,
           rng: jax.Array, meta: dict) -> None:
    """Starts saving step `step` (asynchronously when async_save; `wait` blocks until done)."""
    if self.read_only:
      raise RuntimeError(f"Checkpointer({self.directory!r}, read_only=True) cannot save")
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

  def save_model(self, step: int, *, params: PyTree, moe_state: PyTree, meta: dict) -> None:
    """Saves the 'model' and 'meta' items of `step` only (an imported model: no optimizer state,
    `meta['imported_from']` says from where), and waits until the step is finalised. Inference
    restores it (`restore_model`); training refuses it (`is_model_only`) and starts a new run
    from it instead (`k3jax train --init_from`)."""
    if self.read_only:
      raise RuntimeError(f"Checkpointer({self.directory!r}, read_only=True) cannot save")
    self._manager.save(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave({"params": params, "moe_state": moe_state}),
            meta=ocp.args.JsonSave(dict(meta, step=int(step)))),
        force=True)
    self._manager.wait_until_finished()

  def meta(self, step: int) -> dict:
    """The 'meta' item of `step` (JSON; no array is read)."""
    out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out.meta)

  def is_model_only(self, step: int) -> bool:
    """Whether `step` was written by `save_model` (no 'train' item). A step whose meta cannot be
    read is not: the restore reports it as damaged (`restore_latest`)."""
    try:
      with _unraisable_swallowed():
        return "imported_from" in self.meta(step)
    except Exception:  # pylint: disable=broad-except  (orbax and tensorstore raise many types)
      return False

  def stored_shapes(self, step: int, item: str) -> dict:
    """`flat_shapes` of item 'model' or 'train' of `step`, from its metadata (no array data)."""
    return flat_shapes(self._manager.item_metadata(step)[item])

  def check_compatible(self, step: int, targets: dict[str, PyTree],
                       convert: Optional[Convert] = None) -> dict[str, bool]:
    """Compares the stored trees of `step` with `targets` ({'model': tree, 'train': tree}).

    Returns {item: whether `convert` is needed}; raises IncompatibleCheckpointError naming the
    differing leaves when the stored tree (converted, when its paths differ and `convert` is
    given) does not match the target's paths, shapes and dtypes.
    """
    needs_convert, diffs = {}, []
    for item, target in targets.items():
      want = flat_shapes(target)
      stored = self.stored_shapes(step, item)
      needs_convert[item] = convert is not None and set(stored) != set(want)
      if needs_convert[item]:
        stored_tree = self._manager.item_metadata(step)[item]
        stored_tree = getattr(stored_tree, "tree", stored_tree)  # orbax's wrapper -> nested dicts
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored_tree,
                                is_leaf=lambda x: hasattr(x, "shape"))
        stored = flat_shapes(jax.eval_shape(lambda t, item=item: convert(item, t), abstract))
      diffs += tree_differences(stored, want)
    if diffs:
      raise IncompatibleCheckpointError(step, diffs)
    return needs_convert

  def restore(self, step: int, *, params: PyTree, moe_state: PyTree, opt_state: PyTree,
              rng: jax.Array, convert: Optional[Convert] = None) -> dict:
    """Restores the full training state of `step`, shaped like the given (abstract) trees.

    The arguments are templates (arrays or jax.ShapeDtypeStruct, optionally with shardings);
    returns a dict with 'params', 'moe_state', 'opt_state', 'rng' and 'meta'. The stored trees are
    checked against them first (IncompatibleCheckpointError, nothing read); `convert` restructures
    a stored tree whose paths differ (see the module docstring).
    """
    abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)
    targets = {"model": {"params": params, "moe_state": moe_state},
               "train": {"opt_state": opt_state, "rng": rng}}
    needs_convert = self.check_compatible(step, targets, convert)
    args = {item: ocp.args.StandardRestore(None if needs_convert[item] else abstract(target))
            for item, target in targets.items()}
    out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
    trees = {}
    for item, target in targets.items():
      trees[item] = out[item]
      if needs_convert[item]:
        trees[item] = _into_target(convert(item, out[item]), target)
    return dict(params=trees["model"]["params"], moe_state=trees["model"]["moe_state"],
                opt_state=trees["train"]["opt_state"], rng=trees["train"]["rng"],
                meta=dict(out.meta))

  def restore_latest(self, *, params: PyTree, moe_state: PyTree, opt_state: PyTree,
                     rng: jax.Array, convert: Optional[Convert] = None,
                     log: Callable[[str], None] = print) -> Optional[dict]:
    """`restore` of the newest step that can be read, or None when there is no finalised step.

    A step that does not fit the templates stops everything (IncompatibleCheckpointError: the
    older steps of the same run would not fit either). A step whose files cannot be read is
    reported through `log` in one line, moved to `<directory>/corrupt/<step>` (not in read-only
    mode) and the next older step is tried; CorruptCheckpointError when none can be read.
    """
    reports = []
    for step in reversed(self.all_steps()):
      try:
        with _unraisable_swallowed():
          return self.restore(step, params=params, moe_state=moe_state, opt_state=opt_state,
                              rng=rng, convert=convert)
      except IncompatibleCheckpointError:
        raise
      except Exception as e:  # orbax and tensorstore raise many types for unreadable files
        if _is_out_of_memory(e):
          raise
        reports.append(self._set_aside(step, e))
        log(reports[-1])
    if reports:
      raise CorruptCheckpointError(self.directory, reports)
    return None

  def _set_aside(self, step: int, error: BaseException) -> str:
    """Moves a damaged step out of orbax's sight (not when read-only); returns the report line."""
    where = f"checkpoint step {step} cannot be read ({_root_cause(error)})"
    if self.read_only:
      return f"{where}; skipping it"
    target = os.path.join(self.directory, CORRUPT_DIR, str(step))
    suffix = 1
    while os.path.exists(target):
      target = os.path.join(self.directory, CORRUPT_DIR, f"{step}.{suffix}")
      suffix += 1
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(self._manager.directory / str(step), target)
    self._manager.reload()
    return f"{where}; moved to {target}, falling back to an older step"

  def restore_model(self, step: Optional[int] = None,
                    log: Callable[[str], None] = print) -> tuple[PyTree, PyTree, dict]:
    """Restores only what inference needs: (params, moe_state, meta) of `step`.

    The trees come back as saved (nested dicts of arrays); the optimizer state is not read.
    Without `step`, the newest step that can be read (a damaged one is reported through `log`
    and skipped, or moved aside when not read-only).
    """
    if step is not None and step not in self._manager.all_steps():
      raise ValueError(f"step={step} has no checkpoint in {self.directory}; available: "
                       f"{self.all_steps()}")
    candidates = [step] if step is not None else list(reversed(self.all_steps()))
    if not candidates:
      raise FileNotFoundError(f"no finalised checkpoint in {self.directory}")
    reports = []
    for candidate in candidates:
      try:
        with _unraisable_swallowed():
          out = self._manager.restore(
              candidate, args=ocp.args.Composite(model=ocp.args.StandardRestore(),
                                                 meta=ocp.args.JsonRestore()))
        return out.model["params"], out.model.get("moe_state", {}), dict(out.meta)
      except Exception as e:  # as in restore_latest
        if _is_out_of_memory(e):
          raise
        if step is not None:
          raise CorruptCheckpointError(self.directory, [
              f"checkpoint step {step} cannot be read ({_root_cause(e)})"]) from e
        reports.append(self._set_aside(candidate, e))
        log(reports[-1])
    raise CorruptCheckpointError(self.directory, reports)

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are finalised."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def remove_unfinished(directory: str) -> list[str]:
  """Removes the temporary folders of checkpoints whose write did not finish (orbax writes a step
  into `<step>.orbax-checkpoint-tmp...` and renames it when complete: finished steps are never
  touched). Returns the removed paths. Only the first process removes anything."""
  removed = []
  if jax.process_index() != 0 or not os.path.isdir(directory):
    return removed
  for name in sorted(os.listdir(directory)):
    if ".orbax-checkpoint-tmp" in name:
      path = os.path.join(directory, name)
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def _into_target(tree: PyTree, target: PyTree) -> PyTree:
  """The leaves of a converted stored tree (nested dicts/lists) placed in the target's structure
  (namedtuples included) by path, on the target leaves' shardings when they carry one."""
  leaves = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    leaves["/".join(_key_name(k) for k in path)] = leaf
  paths_and_targets, treedef = jax.tree_util.tree_flatten_with_path(target)
  out = []
  for path, want in paths_and_targets:
    value = leaves["/".join(_key_name(k) for k in path)]
    sharding = getattr(want, "sharding", None)
    out.append(jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value))
  return jax.tree_util.tree_unflatten(treedef, out)


def quiet_logging() -> None:
  """For the CLIs: absl logging (orbax logs every save and restore at INFO) at WARNING, unless the
  command line asks for more with absl's --verbosity / -v. Call after flags are parsed."""
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def to_host(tree: PyTree) -> PyTree:
  """Copies a tree of arrays to numpy (for JSON-free inspection / comparisons)."""
  return jax.tree.map(np.asarray, tree)


def restore_run(workdir: str, step: Optional[int] = None, log: Callable[[str], None] = print
                ) -> tuple[config_lib.Config, PyTree, PyTree, dict]:
  """(config, params, moe_state, meta) of `step` (default: the newest readable) of a training run
  directory, the trees in the layout of the config's decoder (ImplConfig.scan_layers).

  Reads DIR/config.gin and only what inference needs from the checkpoint (no optimizer state).
  """
  cfg = run_dir.read_config(workdir)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint, read_only=True)
  try:
    params, moe_state, meta = ckpt.restore_model(step, log=log)
  finally:
    ckpt.close()
  # A run's config may have changed scan_layers since its checkpoints were written (identity
  # when the layouts agree).
  params, moe_state = (to_layout(t, cfg.model, cfg.impl.scan_layers) for t in (params, moe_state))
  return cfg, params, moe_state, meta
