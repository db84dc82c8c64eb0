"""The training loop: one loop over global steps and the stages of a staged context extension.

  train(cfg, workdir) = set-up, restore (or initialise), the loop, the final report.

  * Stages. `cfg.stages.stages` = ((seq_len, steps), ...). Global step s (0-based) belongs to stage
    `stage_at(s)`; its batch is [tokens_per_step // seq_len, seq_len], and is a pure function of s
    (the data position is the step). The optimizer state, the MoE balance biases ('moe_state'), the
    data position and the LR schedule (one cosine over all steps) simply carry on across stage
    boundaries; only the batch shape changes (and with it the jit trace).
  * Checkpoints (`DIR/checkpoints`): every `CheckpointConfig.every_steps`, at every stage end (kept
    forever), at `max_steps`, and on SIGTERM/SIGINT (the handler sets a flag; the loop finishes the
    running step, saves, waits for the write, and returns the signal). Training again in the same
    directory restores the latest finalised checkpoint and continues bit-exactly.
  * A non-finite loss or gradient norm stops the run before anything of that step is saved.
  * Outputs: DIR/config.gin + config.json (`run_dir`), metrics.jsonl and tb/ (`metrics`),
    eval.json and plots/ at the end (`write_report`).
  * Elsewhere: the step (`step`), the state (`state`), the run's data (`run_data`), evaluation
    (`evaluation`); how programs are compiled and run, the runtime (`k3jax.runtime.Runtime`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config as config_lib
from k3jax.model import K3Model, flops_per_token, init_variables, to_layout
from k3jax.model.stats import max_violation, moe_stats_by_layer
from k3jax.parallel import sharding as sharding_lib
from k3jax.runtime import Runtime, train_program_name, validation_program_name
from k3jax.training import checkpoint as checkpoint_lib
from k3jax.training import metrics as metrics_lib
from k3jax.training import run_dir
from k3jax.training.evaluation import Evaluator, format_eval
from k3jax.training.run_data import make_data
from k3jax.training.state import TrainState, init_train_state, placed_train_state_shapes
from k3jax.training.step import make_train_step


# The key prefix of each MoE layer's per-expert loads in a training record
# (EvalConfig.log_expert_loads): 'load/<layer>', e.g. 'load/layer_2/moe'.
LOAD_PREFIX = "load/"


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm of a step was NaN/inf; nothing of that step was saved."""


class StageOutOfMemoryError(RuntimeError):
  """A stage's training step ran out of device memory (compiling or running); the message names
  the stage, its row length and batch, and the settings that lower memory."""


@dataclasses.dataclass
class TrainResult:
  step: int                            # global steps done
  finished: bool                       # all stages done
  stopped_by_signal: Optional[int] = None
  eval: Optional[dict] = None          # the final evaluation (when finished in this call)


def train(cfg: config_lib.Config, workdir: str, *, max_steps: Optional[int] = None,
          peak_tflops: float = 0.0, progress: bool = True, tensorboard: bool = True,
          runtime: Optional[Runtime] = None, take_over_lock: bool = False,
          init_from: Optional[str] = None) -> TrainResult:
  """Trains (or resumes training) in `workdir` until all stages are done or `max_steps`.

  init_from: a run directory (a training run, or a model imported by `k3jax.convert`) whose
    newest checkpoint's parameters and balance biases start a new run, with a new optimizer
    state; the model configs must give the same parameter shapes. Ignored when `workdir` already
    holds checkpoints (the run resumes).

  runtime: how the programs are compiled and run (default `Runtime(cfg.runtime)`, no
    lowered-program cache; the CLI keeps one in <--compilation_cache_dir>/lowered).
  take_over_lock: take the run directory's lock from a run on another host that is known to be
    gone (`run_dir.RunLock`; a dead run on this host is detected by itself).

  Raises:
    ConfigError: the workdir, the data or the mesh does not fit the config (the message names the
      setting), the workdir's checkpoints do not fit it, or another run holds the workdir
      (RunLockedError). A start-up that fails leaves no workdir it created behind.
    NonFiniteLossError: a step's loss or gradient norm was not finite (that step is not saved).
    StageOutOfMemoryError: a stage's step ran out of device memory.
    RunWriteError: the filesystem refused a write (no space left, no permission); the last
      complete checkpoint is untouched.
  """
  runtime = Runtime(cfg.runtime) if runtime is None else runtime
  # What needs no run directory is checked before one is created: the data and the mesh.
  data = make_data(cfg)
  meshes = sharding_lib.make_stage_meshes(cfg)
  if init_from is not None:
    _check_init_from(cfg, init_from)
  with run_dir.RunDirectory(workdir, lock=jax.process_index() == 0,
                            take_over_lock=take_over_lock) as directory:
    return _train(cfg, directory, data, meshes, runtime, max_steps=max_steps,
                  peak_tflops=peak_tflops, progress=progress, tensorboard=tensorboard,
                  init_from=init_from)


def _train(cfg: config_lib.Config, directory: run_dir.RunDirectory, data, meshes,
           runtime: Runtime, *, max_steps: Optional[int], peak_tflops: float, progress: bool,
           tensorboard: bool, init_from: Optional[str] = None) -> TrainResult:
  """`train` in its locked run directory: set-up, restore, the loop, the report."""
  workdir = directory.path
  scfg = cfg.stages
  total_steps, ends = scfg.total_steps, stage_ends(scfg)
  stop_at = total_steps if max_steps is None else min(total_steps, max_steps)

  # Set-up: each stage's step (compiled ahead where the runtime does so), the evaluator and the
  # checkpoints. Each stage runs on its mesh (MeshConfig.stage_axes; one for all by default).
  devices = [1 if m is None else m.devices.size for m in meshes]
  # The state's shapes on each stage's mesh, placed where the initialisation (or the move between
  # meshes) will put them: enough to trace and compile the steps, which may start compiling
  # before the state exists.
  placed = _StagePlacements(cfg, meshes, total_steps, runtime)
  step_of_stage = _stage_steps(cfg, placed, runtime, total_steps)
  evaluator = Evaluator(cfg, K3Model(cfg.model, cfg.impl), data)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint,
                                     keep_steps=ends)
  first = ckpt.latest_step() or 0   # where the run starts, unless that checkpoint is refused
  # Up to the stage this call stops in: a run stopped by max_steps compiles no later stage.
  programs = runtime.start_precompile(
      cfg, scfg.stage_at(first), placed.shapes, step_of_stage, evaluator, placed.mesh,
      memory_advice=lambda stage: out_of_memory_message(cfg, stage, devices[stage], runtime),
      last_stage=scfg.stage_at(stop_at - 1)) if first < stop_at else None

  # Restore the run so far, or initialise a new one, on the mesh of the stage it starts in.
  try:
    state_stage = scfg.stage_at(first)
    state = init_train_state(cfg, total_steps, meshes[state_stage], runtime)[0]
    shardings = placed.shardings(state_stage)
    state, start = _restore(cfg, workdir, ckpt, state, shardings)
    if start is None and init_from is not None:
      state = _initialise_from(cfg, init_from, state, shardings)
  except BaseException:
    ckpt.close()
    if programs is not None:
      programs.close()
    raise
  with _refused_writes(workdir, ckpt):
    run_dir.write_config(workdir, cfg)
    directory.started()
    writer = metrics_lib.MetricsWriter(workdir, resume_step=start, tensorboard=tensorboard)
    writer.write_text("config", "```\n" + config_lib.to_gin(cfg) + "```")
  start = start or 0
  # What a checkpoint needs on disk at most (orbax compresses; the old steps go after the new one
  # is complete, so the space must be there besides them).
  checkpoint_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                         for x in jax.tree.leaves(placed.shapes(0))) + 2**20
  # MFU by the model FLOPs of each stage's row length (attention grows with it).
  stage_flops = {seq: flops_per_token(cfg.model, seq) for seq, _ in scfg.stages}
  peak = metrics_lib.peak_flops_for(jax.default_backend(), peak_tflops)
  result = TrainResult(step=start, finished=start >= total_steps)
  last_loads, bar = None, None

  def ready(name: str) -> None:
    """Waits for a program that is compiling in the background; says how it went, once."""
    report = None if programs is None else programs.wait(name)
    if report and "error" not in report:
      line = (f"{name}: compiled in the background (lowered in {report['lower_s']:.1f} s, "
              f"compiled in {report['compile_s']:.1f} s"
              + (f", {report['temp_gib']} GiB of temporaries)" if "temp_gib" in report else ")"))
      (bar.write if bar is not None else print)(line)

  def evaluate(seq_len: int, passkey: bool) -> dict:
    """The evaluator on the current state at seq_len, once its program is compiled."""
    ready(validation_program_name(seq_len))
    return evaluator(state.params, state.moe_state, seq_len, seed=cfg.seed, passkey=passkey)

  def save(step: int) -> None:
    stage = scfg.stage_at(step - 1)
    run_dir.check_space(ckpt.directory, checkpoint_bytes, f"checkpoint step {step}",
                        ckpt.latest_step())
    ckpt.save(step, params=state.params, moe_state=state.moe_state, opt_state=state.opt_state,
              rng=state.rng, meta={"stage": stage, "seq_len": scfg.stages[stage][0],
                                   "data_position": step, "total_steps": total_steps})

  def run_step(stage: int, state: TrainState, batch: dict):
    """One step of `stage` on the batch (placed as its program expects); (state, metrics)."""
    train_step, mesh = step_of_stage(stage), meshes[stage]
    try:
      if mesh is None:
        # Committed to the state's device: the program is then the one the precompiler compiled
        # for arguments placed there (an uncommitted batch makes another compile-cache key).
        state, m = train_step(state, jax.device_put(batch, jax.devices()[0]))
      else:
        # Traced inside the mesh context, so the MoE takes its expert-parallel path.
        rows = sharding_lib.local_batch_rows(mesh, scfg.batch_size(stage))
        with sharding_lib.with_mesh(mesh):
          state, m = train_step(state, sharding_lib.shard_batch(
              {k: v[rows] for k, v in batch.items()}, mesh))
      return state, jax.device_get(m)
    except Exception as e:  # XlaRuntimeError/JaxRuntimeError; compile errors are others
      if not is_out_of_memory(e):
        raise
      raise StageOutOfMemoryError(out_of_memory_message(cfg, stage, devices[stage], runtime)
                                  ) from e

  # The loop.
  try:
    with StopSignal() as stop, _refused_writes(workdir, ckpt):
      iterator = data.train_iterator(start)
      if start == 0 and cfg.eval.every_steps:
        # The starting point of the validation curve (≈ ln(vocab) at initialisation).
        results = evaluate(scfg.stages[0][0], passkey=False)
        writer.write(0, "eval", dict(results, stage=0))
        print(f"validation loss at step 0: {results['val_loss']:.4f}")
      # The bar (and its ETA) counts to where this call stops, max_steps included.
      bar = metrics_lib.ProgressBar(stop_at, start, enabled=progress)
      throughput = metrics_lib.Throughput()
      step = start
      while step < stop_at and stop.signum is None:
        stage = scfg.stage_at(step)
        seq_len = scfg.stages[stage][0]
        batch = next(iterator)
        batch = {k: batch[k] for k in ("inputs", "targets", "segment_ids", "loss_mask")}
        if meshes[stage] is not meshes[state_stage]:
          # A stage on another mesh: the state moves there (device to device) before its step.
          state = jax.device_put(state, placed.shardings(stage))
          bar.write(f"stage {stage}: the state moved to the mesh "
                    f"{cfg.mesh.for_stage(stage) or 'of one device'}")
        state_stage = stage
        ready(train_program_name(stage, seq_len))
        state, m = run_step(stage, state, batch)
        step += 1
        if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
          raise NonFiniteLossError(
              f"non-finite loss at step {step} (loss={float(m['loss'])}, grad_norm="
              f"{float(m['grad_norm'])}); stopping without saving this state. Last good "
              f"checkpoint: step {ckpt.latest_step()}")
        throughput.add(scfg.tokens_per_step)
        layers = moe_stats_by_layer(m["moe_stats"])
        if layers and all("load" in v for v in layers.values()):
          last_loads = (list(layers), np.stack([np.asarray(v["load"]) for v in layers.values()]))
        at_end = step in ends
        if step % cfg.eval.log_every_steps == 0 or at_end or step == stop_at:
          rate = throughput.tick()
          writer.write(step, "train", _train_record(
              stage, seq_len, scfg.batch_size(stage), m, rate,
              metrics_lib.mfu(stage_flops[seq_len], rate, peak * devices[stage]),
              loads=cfg.eval.log_expert_loads))
        bar.update(step, float(m["loss"]), stage, seq_len)
        if at_end or step % cfg.checkpoint.every_steps == 0:
          save(step)
        if at_end or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
          # Passkey at 1-8x the length is the costly part: only at stage ends.
          results = evaluate(seq_len, passkey=at_end)
          writer.write(step, "eval", dict(results, stage=stage))
          bar.write(f"eval at step {step} (stage {stage}, seq_len {seq_len}):\n"
                    + format_eval(results))
          throughput.tick()  # evaluation time is not training throughput
      if ckpt.latest_step() != step:  # max_steps or a signal: keep where we stopped
        save(step)
      evals = [r for r in metrics_lib.read_jsonl(writer.path) if r["kind"] == "eval"]
      if (start < step < total_steps and stop.signum is None
          and not (evals and evals[-1]["step"] == step)):
        # Stopped by max_steps: a validation pass at the current length for eval.json (passkey
        # retrieval, the costly part, stays at stage ends).
        stage = scfg.stage_at(step - 1)
        results = evaluate(scfg.stages[stage][0], passkey=False)
        writer.write(step, "eval", dict(results, stage=stage))
      result.step, result.finished = step, step >= total_steps
      result.stopped_by_signal = stop.signum
  except BaseException:
    _close(programs, bar, ckpt, writer, workdir, failing=True)
    raise
  _close(programs, bar, ckpt, writer, workdir, failing=False)

  # The report.
  if result.step == start and result.stopped_by_signal is None:
    if result.finished:
      print(f"the run in {workdir} is finished ({total_steps} steps); its eval.json and plots/ "
            "are there.")
    else:
      print(f"the run in {workdir} is already at step {start} (--max_steps={max_steps}); to "
            f"continue, re-run with a larger --max_steps, or without it for all {total_steps} "
            "steps.")
  elif result.stopped_by_signal is not None:
    # No new evaluation: it would delay the exit the signal asked for.
    with _refused_writes(workdir, ckpt):
      result.eval = write_report(cfg, workdir, last_loads, final_label="last evaluation")
    print(f"stopped by signal {result.stopped_by_signal} after step {result.step}; checkpoint "
          "saved; eval.json and plots/ hold the evaluations so far (no final evaluation, so as "
          "not to delay the exit). Re-run the same command to resume.")
  else:
    with _refused_writes(workdir, ckpt):
      result.eval = write_report(cfg, workdir, last_loads)
    if not result.finished:
      print(f"stopped at step {result.step} of {total_steps} (--max_steps); eval.json and plots/ "
            "written. To continue, re-run with a larger --max_steps, or without it.")
  return result


# ------------------------------------------------------------------------------------------------
# Set-up and restore
# ------------------------------------------------------------------------------------------------

def stage_ends(stages_cfg: config_lib.StagesConfig) -> list[int]:
  """Global step counts at which each stage is complete."""
  return [int(x) for x in np.cumsum([n for _, n in stages_cfg.stages])]


class _StagePlacements:
  """Where the state lives in each stage: its placed shapes (`placed_train_state_shapes`) on the
  stage's mesh, built once per distinct mesh; the optimizer and the schedule (the same on any
  mesh)."""

  def __init__(self, cfg: config_lib.Config, meshes, total_steps: int, runtime: Runtime):
    self._meshes = meshes
    self._shapes: dict[int, TrainState] = {}
    for mesh in meshes:
      if id(mesh) not in self._shapes:
        self._shapes[id(mesh)], self.optimizer, self.schedule = placed_train_state_shapes(
            cfg, total_steps, mesh, runtime)

  def mesh(self, stage: int):
    return self._meshes[stage]

  def shapes(self, stage: int) -> TrainState:
    """The state's ShapeDtypeStructs with their shardings in `stage`."""
    return self._shapes[id(self._meshes[stage])]

  def shardings(self, stage: int):
    return jax.tree.map(lambda x: x.sharding, self.shapes(stage))


def _stage_steps(cfg: config_lib.Config, placed: _StagePlacements, runtime: Runtime,
                 total_steps: int) -> Callable[[int], Callable]:
  """stage -> its training step: one jitted step per distinct (ImplConfig, mesh) of the stages
  (ImplConfig.stage_remat, MeshConfig.stage_axes); each stage's batch shape traces it anew."""
  steps: dict = {}

  def step_of_stage(stage: int) -> Callable:
    impl, mesh = cfg.stage_impl(stage), placed.mesh(stage)
    key = (impl, id(mesh))
    if key not in steps:
      kwargs = dict(total_steps=total_steps)
      if mesh is not None:
        kwargs.update(state_shardings=placed.shardings(stage),
                      batch_shardings=sharding_lib.batch_sharding(mesh))
      steps[key] = make_train_step(dataclasses.replace(cfg, impl=impl),
                                   K3Model(cfg.model, impl), placed.optimizer, placed.schedule,
                                   runtime, **kwargs)
    return steps[key]

  return step_of_stage


def _restore(cfg: config_lib.Config, workdir: str, ckpt: checkpoint_lib.Checkpointer,
             state: TrainState, shardings) -> tuple[TrainState, Optional[int]]:
  """(the state of the workdir's latest checkpoint placed on `shardings`, its step), or (`state`,
  None) for a new run. Raises ConfigError when the checkpoints do not fit the config (naming the
  settings that changed) or none of them can be read."""
  latest, total = ckpt.latest_step(), cfg.stages.total_steps
  if latest is not None and latest > total:
    raise config_lib.ConfigError(
        f"--workdir={workdir} holds checkpoint step {latest}, past the end of StagesConfig.stages "
        f"= {cfg.stages.stages} ({total} steps): lengthen the stages to resume this run, or use a "
        "new --workdir")
  if latest is not None and ckpt.is_model_only(latest):
    raise config_lib.ConfigError(
        f"--workdir={workdir} holds a model imported by k3jax.convert (checkpoint step {latest}, "
        f"no optimizer state): train from it in a new run with --init_from={workdir} and another "
        "--workdir")
  changes = run_dir.changed_settings(workdir, cfg)
  try:
    restored = ckpt.restore_latest(params=state.params, moe_state=state.moe_state,
                                   opt_state=state.opt_state, rng=state.rng,
                                   log=lambda line: print(f"warning: {line}", file=sys.stderr),
                                   # checkpoints of the other decoder layout (scan_layers)
                                   convert=lambda item, tree: to_layout(
                                       tree, cfg.model, cfg.impl.scan_layers))
  except checkpoint_lib.IncompatibleCheckpointError as e:
    settings = "; ".join(changes) or "none in config.gin (the code's parameter tree changed?)"
    raise config_lib.ConfigError(
        f"--workdir={workdir} holds a run whose checkpoints do not fit this config ({e}). "
        f"Changed settings: {settings}. Use a new --workdir for the new config, or put the "
        "settings back to resume this run.") from e
  except checkpoint_lib.CorruptCheckpointError as e:
    raise config_lib.ConfigError(
        f"{e}. They were moved to {os.path.join(ckpt.directory, checkpoint_lib.CORRUPT_DIR)}; "
        "re-run to start from step 0, or use a new --workdir.") from e
  if restored is None:
    return state, None
  start = int(restored["meta"]["step"])
  if changes:
    print("note: the config differs from the one this run started with:\n  " +
          "\n  ".join(changes), file=sys.stderr)
  if restored["meta"]["data_position"] != start:
    raise ValueError(f"checkpoint {start}: data_position {restored['meta']['data_position']} "
                     "!= step")
  state = TrainState(step=jnp.asarray(start, jnp.int32), params=restored["params"],
                     opt_state=restored["opt_state"], moe_state=restored["moe_state"],
                     rng=restored["rng"])
  # Every leaf where the fresh state had it (the step counter too): arguments placed otherwise
  # than at the first launch would make the resumed step compile again (~100 s on the GPU).
  state = jax.device_put(state, shardings)
  print(f"resuming from step {start} (stage {cfg.stages.stage_at(max(start - 1, 0))})")
  return state, start


def _check_init_from(cfg: config_lib.Config, init_from: str) -> None:
  """ConfigError unless `init_from` is a run directory with a checkpoint whose model has the
  parameter shapes of cfg.model (checked on the configs, before anything is read or made)."""
  if not os.path.isfile(os.path.join(init_from, run_dir.CONFIG_GIN)):
    raise config_lib.ConfigError(f"--init_from={init_from} is not a k3jax run directory (no "
                                 f"{run_dir.CONFIG_GIN})")
  source = run_dir.read_config(init_from).model
  want = jax.eval_shape(lambda: _model_variables(cfg.model))
  have = jax.eval_shape(lambda: _model_variables(source))
  differences = checkpoint_lib.tree_differences(checkpoint_lib.flat_shapes(have),
                                                checkpoint_lib.flat_shapes(want))
  if differences:
    shown = "; ".join(differences[:2]) + (f"; and {len(differences) - 2} more"
                                          if len(differences) > 2 else "")
    fields = run_dir.config_differences(config_lib.to_gin(config_lib.Config(model=source)),
                                        config_lib.to_gin(config_lib.Config(model=cfg.model)))
    raise config_lib.ConfigError(
        f"--init_from={init_from}: its model does not fit this config's ({shown}). ModelConfig "
        f"settings that differ: {'; '.join(f for f in fields if f.startswith('ModelConfig.'))}")


def _model_variables(model_cfg: config_lib.ModelConfig) -> dict:
  """{'params', 'moe_state'} of a model in the per-layer layout (traced for its shapes)."""
  variables = init_variables(model_cfg, jax.random.key(0),
                             impl=config_lib.ImplConfig(scan_layers=False))
  return {name: variables[name] for name in ("params", "moe_state")}


def _initialise_from(cfg: config_lib.Config, init_from: str, state: TrainState,
                     shardings) -> TrainState:
  """`state` with the parameters and balance biases of `init_from`'s newest checkpoint (in this
  run's layout, dtypes and placement); the optimizer state stays the fresh one. The checkpoint is
  read whole to the host first (a 48B-parameter model in float32: 196 GB of host memory)."""
  _, params, moe_state, meta = checkpoint_lib.restore_run(init_from, log=lambda line: print(
      f"warning: {line}", file=sys.stderr))
  params, moe_state = (to_layout(t, cfg.model, cfg.impl.scan_layers) for t in (params, moe_state))
  cast = lambda new, like: jnp.asarray(new, like.dtype)  # noqa: E731
  state = state.replace(params=jax.tree.map(cast, params, state.params),
                        moe_state=jax.tree.map(cast, moe_state, state.moe_state))
  print(f"initialised from {init_from} (its checkpoint step {meta['step']})")
  return jax.device_put(state, shardings)


# ------------------------------------------------------------------------------------------------
# Errors, signals, records
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _refused_writes(workdir: str, ckpt: checkpoint_lib.Checkpointer):
  """Turns a write the filesystem refuses (`run_dir.write_failure`: no space left, no permission)
  into one RunWriteError naming the path and the last complete checkpoint, after removing what
  orbax had written of an unfinished checkpoint (finished ones are never touched)."""
  try:
    yield
  except run_dir.RunWriteError:
    raise
  except Exception as e:  # orbax and tensorstore raise their own types around the OSError
    what = run_dir.write_failure(e)
    if what is None:
      raise
    checkpoint_lib.remove_unfinished(ckpt.directory)
    raise run_dir.RunWriteError(
        f"{what}: writing {_refused_path(e) or 'into ' + workdir} failed. "
        f"{run_dir.resume_advice(ckpt.latest_step(), what)}") from e


def _refused_path(error: BaseException) -> Optional[str]:
  """The path of a refused write, from an OSError or from orbax's / tensorstore's message."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.filename:
      return str(error.filename)
    found = re.search(r'local file "([^"]+)"', str(error))
    if found:
      return found.group(1)
    error = error.__cause__ or error.__context__
  return None


def _close(programs, bar, ckpt, writer, workdir: str, *, failing: bool) -> None:
  """Ends the loop's helpers: the background compiles, the bar, the checkpoint writes (waited
  for) and the metrics. When the run is failing already, a refused write while closing adds
  nothing to the error in flight; otherwise it is a RunWriteError."""
  if programs is not None:
    programs.close()
  if bar is not None:
    bar.close()
  try:
    with _refused_writes(workdir, ckpt):
      try:
        ckpt.wait()
      finally:
        ckpt.close()
        writer.close()
  except run_dir.RunWriteError:
    if not failing:
      raise


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out-of-memory (RESOURCE_EXHAUSTED) at compile or run time."""
  text = str(error)
  return ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text
          or "out of memory" in text.lower())


def out_of_memory_message(cfg: config_lib.Config, stage: int, mesh_devices: int = 1,
                          runtime: Optional[Runtime] = None) -> str:
  """One line for a stage's out-of-memory: where it happened and what lowers memory."""
  scfg = cfg.stages
  seq_len = scfg.stages[stage][0]
  batch = scfg.batch_size(stage)
  rows = scfg.microbatch_rows(seq_len, batch)
  impl = cfg.stage_impl(stage)
  fraction = (runtime or Runtime(cfg.runtime)).device_memory_fraction()
  return (f"out of device memory in stage {stage} (seq_len {seq_len}, batch {batch} rows, "
          f"{rows} row(s) x {seq_len} tokens per micro-batch, remat {impl.remat!r}, "
          f"position_chunk_tokens {impl.position_chunk_tokens}, {mesh_devices} device(s)). "
          "To lower memory: ImplConfig.stage_remat (or ImplConfig.remat) = 'full' for this "
          "stage; ImplConfig.position_chunk_tokens > 0 (e.g. 65536); a smaller "
          "StagesConfig.microbatch_tokens; or a mesh with more devices (--mesh)"
          + (f"; or a larger --device_memory_fraction (now {fraction})."
             if jax.default_backend() == "gpu" else "."))


class StopSignal:
  """Context manager: SIGTERM/SIGINT set `signum` instead of killing the process (main thread
  only); a second signal raises KeyboardInterrupt. The old handlers come back on exit."""

  def __init__(self):
    self.signum: Optional[int] = None
    self._old = {}

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None:
      raise KeyboardInterrupt(f"second signal {signum} while stopping")
    self.signum = signum

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    return False


def _train_record(stage, seq_len, batch_size, m, tokens_per_s, mfu, *,
                  loads: bool = False) -> dict:
  """A logged step's record for metrics.jsonl: the losses, lr, gradient norm, throughput, MFU,
  each MoE layer's MaxVio ('max_vio/<layer>') and their mean; with `loads`
  (EvalConfig.log_expert_loads) also each MoE layer's routed assignments per expert
  ('load/<layer>': E ints)."""
  record = {"stage": stage, "seq_len": seq_len, "batch_size": batch_size,
            "loss": float(m["loss"]), "total_loss": float(m["total_loss"]),
            "aux_loss": float(m["aux_loss"]), "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]), "tokens_per_s": tokens_per_s, "mfu": mfu}
  vios = []
  layers = moe_stats_by_layer(m["moe_stats"])
  for name, layer in layers.items():
    if "max_vio" in layer:
      record[f"max_vio/{name}"] = float(layer["max_vio"])
      vios.append(float(layer["max_vio"]))
  if vios:
    record["max_vio_mean"] = float(np.mean(vios))
  if loads:
    # Integer-valued counts in fp32 (exact below 2**24 assignments an expert).
    for name, layer in layers.items():
      if "load" in layer:
        record[f"{LOAD_PREFIX}{name}"] = [int(round(float(x))) for x in layer["load"]]
  return record


def write_report(cfg: config_lib.Config, workdir: str, last_loads,
                 final_label: str = "final evaluation") -> dict:
  """Writes DIR/eval.json and DIR/plots/*.png from metrics.jsonl; returns the final evaluation
  (the last evaluation record: at the end of the run, at max_steps, or before a signal)."""
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  train_records = [r for r in records if r["kind"] == "train"]
  eval_records = [r for r in records if r["kind"] == "eval"]
  final = dict(eval_records[-1]) if eval_records else {}
  stage_evals = [r for r in eval_records if r["step"] in stage_ends(cfg.stages)]
  final_loads = {}
  if last_loads is not None:
    names, loads = last_loads
    final_loads = {f"train_max_vio/{n}": max_violation(l) for n, l in zip(names, loads)}
  curve = [{"step": r["step"], "seq_len": r["seq_len"], "val_loss": r["val_loss"]}
           for r in eval_records]
  report = {"final": final, "stages": stage_evals, "val_loss_by_step": curve,
            "last_step_max_vio": final_loads}
  with open(os.path.join(workdir, "eval.json"), "w") as f:
    json.dump(report, f, indent=2)
  passkey = {}
  for r in stage_evals:
    accs = {int(k.split("/")[1]): v for k, v in r.items()
            if k.startswith("passkey/") and v is not None}
    if accs:
      passkey[int(r["seq_len"])] = accs
  # matplotlib loads here, at the end, not on the way to the first step (0.5 s on the GPU image).
  from k3jax.training import plots  # pylint: disable=import-outside-toplevel
  plots.make_all(os.path.join(workdir, "plots"), train_records, eval_records, cfg.stages.stages,
                 None if last_loads is None else last_loads[1],
                 [] if last_loads is None else last_loads[0], passkey)
  print(f"{final_label} (step {final.get('step', '-')}):\n" + format_eval(final))
  return final
