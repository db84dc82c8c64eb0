r"""Training: one loop over global steps and the stages of a staged context extension.

  python -m k3jax.train --gin_file=gin_configs/tiny.gin [--gin_bindings='ModelConfig.d_model = 64'] \
      --workdir=DIR [--max_steps=N] [--mesh=data:2,expert:4] [--peak_tflops=989]

How the pieces fit:
  * Stages. `cfg.stages.stages` = ((seq_len, steps), ...). Global step s (0-based) belongs to stage
    `stage_at(s)`; its batch is [tokens_per_step // seq_len, seq_len], and is a pure function of s
    (the data position is the step). The optimizer state, the MoE balance biases ('moe_state'), the
    data position and the LR schedule (one cosine over all steps) simply carry on across stage
    boundaries; only the batch shape changes (and with it the jit trace).
  * Checkpoints (`DIR/checkpoints`): every `CheckpointConfig.every_steps`, at every stage end (kept
    forever), at --max_steps, and on SIGTERM/SIGINT (the handler sets a flag; the loop finishes the
    running step, saves, waits for the write, and exits with 128 + signal). Re-running the same
    command restores the latest finalised checkpoint and continues bit-exactly.
  * A non-finite loss or gradient norm stops the run before anything of that step is saved.
  * Outputs: DIR/config.gin + config.json (the operative config), metrics.jsonl, tb/ (TensorBoard),
    eval.json and plots/ at the end.
  * Elsewhere: the step and the state (`k3jax/train_step.py`), the data of a run
    (`k3jax/run_data.py`), the programs compiled ahead (`k3jax/precompile.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import traceback
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import checkpoint as checkpoint_lib
from k3jax import compiler
from k3jax import config as config_lib
from k3jax import device_memory
from k3jax import distributed
from k3jax import metrics as metrics_lib
from k3jax import precompile as precompile_lib
from k3jax import sharding as sharding_lib
from k3jax.evaluate import Evaluator, format_eval, max_violation, moe_stats_by_layer
from k3jax.flops import flops_per_token
from k3jax.model import K3Model, to_layout
# The step and the state live in k3jax.train_step; re-exported here, where callers have found them.
from k3jax.train_step import (TrainState, init_train_state, make_train_step,  # noqa: F401
                              placed_train_state_shapes, train_state_shapes)  # noqa: F401
# The run's data lives in k3jax.run_data; re-exported here, where callers have found it.
from k3jax.run_data import Data, make_data  # noqa: F401


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm of a step was NaN/inf; nothing of that step was saved."""


class StageOutOfMemoryError(RuntimeError):
  """A stage's training step ran out of device memory (compiling or running); the message names
  the stage, its row length and batch, and the settings that lower memory."""


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out-of-memory (RESOURCE_EXHAUSTED) at compile or run time."""
  text = str(error)
  return ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text
          or "out of memory" in text.lower())


def out_of_memory_message(cfg: config_lib.Config, stage: int, mesh_devices: int = 1) -> str:
  """One line for a stage's out-of-memory: where it happened and what lowers memory."""
  scfg = cfg.stages
  seq_len = scfg.stages[stage][0]
  batch = scfg.batch_size(stage)
  rows = scfg.microbatch_rows(seq_len, batch)
  mcfg = config_lib.stage_model_config(cfg, stage)
  return (f"out of device memory in stage {stage} (seq_len {seq_len}, batch {batch} rows, "
          f"{rows} row(s) x {seq_len} tokens per micro-batch, remat {mcfg.remat!r}, "
          f"position_chunk_tokens {mcfg.position_chunk_tokens}, {mesh_devices} device(s)). "
          "To lower memory: StagesConfig.remat (or ModelConfig.remat) = 'full' for this stage; "
          "ModelConfig.position_chunk_tokens > 0 (e.g. 65536); a smaller "
          "StagesConfig.microbatch_tokens; or a mesh with more devices (--mesh)"
          + (f"; or a larger --device_memory_fraction (now {device_memory.current_fraction()})."
             if jax.default_backend() == "gpu" else "."))


def config_from_flags(gin_files: Sequence[str], gin_bindings: Sequence[str], mesh: str = ""
                      ) -> config_lib.Config:
  """`from_gin` over the files and bindings; --mesh becomes `MeshConfig.axes`."""
  bindings = list(gin_bindings)
  if mesh:
    bindings.append(f"MeshConfig.axes = {mesh!r}")
  return config_lib.from_gin(gin_files, bindings)


def config_to_gin(cfg: config_lib.Config) -> str:
  """Gin bindings that rebuild `cfg` exactly (every field of every sub-config)."""
  lines = []
  for field in dataclasses.fields(cfg):
    value = getattr(cfg, field.name)
    if dataclasses.is_dataclass(value):
      lines.append(f"# {field.name}")
      cls = type(value).__name__
      lines += [f"{cls}.{f.name} = {getattr(value, f.name)!r}" for f in dataclasses.fields(value)]
    else:
      lines.append(f"Config.{field.name} = {value!r}")
  return "\n".join(lines) + "\n"


def write_config(workdir: str, cfg: config_lib.Config) -> None:
  """Writes DIR/config.gin (re-parsable with from_gin) and DIR/config.json (readable dump)."""
  text = config_to_gin(cfg)
  path = os.path.join(workdir, "config.gin")
  with open(path, "w") as f:
    f.write(text)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)


def _config_changes(workdir: str, cfg: config_lib.Config) -> list[str]:
  """'Configurable.field: old -> new' between DIR/config.gin (the run so far) and `cfg`."""
  path = os.path.join(workdir, "config.gin")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return checkpoint_lib.config_differences(f.read(), config_to_gin(cfg))


def stage_ends(stages_cfg: config_lib.StagesConfig) -> list[int]:
  """Global step counts at which each stage is complete."""
  return [int(x) for x in np.cumsum([n for _, n in stages_cfg.stages])]


def make_run_mesh(cfg: config_lib.Config):
  """The run's device mesh, or None for a single-device run (MeshConfig.axes empty).

  Raises ConfigError when the mesh does not fit the devices or a stage's batch does not split over
  the batch axes (data x expert).
  """
  if not cfg.mesh.axes:
    return None
  try:
    mesh = sharding_lib.make_mesh(cfg.mesh.axes)
  except ValueError as e:
    raise config_lib.ConfigError(f"MeshConfig.axes / --mesh: {e}") from e
  shards = math.prod(mesh.shape[a] for a in sharding_lib.BATCH_AXES)
  for i, (seq_len, _) in enumerate(cfg.stages.stages):
    if cfg.stages.batch_size(i) % shards:
      raise config_lib.ConfigError(
          f"StagesConfig.stages: stage {i} (seq_len {seq_len}) has batch "
          f"{cfg.stages.batch_size(i)}, which the mesh {cfg.mesh.axes!r} cannot split over its "
          f"{shards} batch shards; raise StagesConfig.tokens_per_step or use fewer devices")
    micro_rows = cfg.stages.microbatch_rows(seq_len, cfg.stages.batch_size(i))
    if micro_rows % shards:
      raise config_lib.ConfigError(
          f"StagesConfig.microbatch_tokens = {cfg.stages.microbatch_tokens}: stage {i} (seq_len "
          f"{seq_len}) would run micro-batches of {micro_rows} rows, which the mesh "
          f"{cfg.mesh.axes!r} cannot split over its {shards} batch shards; raise it")
  if cfg.model.moe_num_experts % mesh.shape["expert"]:
    raise config_lib.ConfigError(
        f"ModelConfig.moe_num_experts = {cfg.model.moe_num_experts} must be divisible by the mesh's "
        f"expert axis ({mesh.shape['expert']})")
  return mesh


# ------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
  step: int                            # global steps done
  finished: bool                       # all stages done
  stopped_by_signal: Optional[int] = None
  eval: Optional[dict] = None          # the final evaluation (when finished in this call)


def _train_record(step, stage, seq_len, batch_size, m, tokens_per_s, mfu) -> dict:
  record = {"stage": stage, "seq_len": seq_len, "batch_size": batch_size,
            "loss": float(m["loss"]), "total_loss": float(m["total_loss"]),
            "aux_loss": float(m["aux_loss"]), "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]), "tokens_per_s": tokens_per_s, "mfu": mfu}
  vios = []
  for name, layer in moe_stats_by_layer(m["moe_stats"]).items():
    if "max_vio" in layer:
      record[f"max_vio/{name}"] = float(layer["max_vio"])
      vios.append(float(layer["max_vio"]))
  if vios:
    record["max_vio_mean"] = float(np.mean(vios))
  return record


def train(cfg: config_lib.Config, workdir: str, *, max_steps: Optional[int] = None,
          peak_tflops: float = 0.0, progress: bool = True, tensorboard: bool = True,
          lowered_cache_dir: str = "") -> TrainResult:
  """Trains (or resumes training) in `workdir` until all stages are done or `max_steps`.

  lowered_cache_dir: non-empty: the initialisation's and the steps' traced and lowered programs
  are kept there (`k3jax.lowered_cache`); the CLI uses <--compilation_cache_dir>/lowered.

  Raises:
    ConfigError: the data cannot be loaded (message names the setting).
    NonFiniteLossError: a step's loss or gradient norm was not finite (that step is not saved).
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise config_lib.ConfigError(f"--workdir={workdir} is a file, not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise config_lib.ConfigError(f"--workdir={workdir} cannot be created: {e.strerror}") from e
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise config_lib.ConfigError(f"--workdir={workdir} is not writable")
  scfg = cfg.stages
  total_steps = scfg.total_steps
  ends = stage_ends(scfg)
  stop_at = total_steps if max_steps is None else min(total_steps, max_steps)
  data = make_data(cfg)
  model = K3Model(cfg.model)
  mesh = make_run_mesh(cfg)
  # The state's shapes, placed where the initialisation will put them: enough to trace and
  # compile the steps, which start compiling (precompile) before the state is initialised.
  state_shapes, optimizer, schedule = placed_train_state_shapes(cfg, total_steps, mesh,
                                                                lowered_cache_dir)
  step_kwargs = dict(lowered_cache_dir=lowered_cache_dir, total_steps=total_steps)
  state_sh = jax.tree.map(lambda x: x.sharding, state_shapes)
  if mesh is not None:
    step_kwargs.update(state_shardings=state_sh,
                       batch_shardings=sharding_lib.batch_sharding(mesh))
  # One jitted step per distinct stage model config (StagesConfig.remat); each stage's batch shape
  # traces it anew anyway.
  stage_steps: dict = {}

  def step_of_stage(stage: int) -> Callable:
    mcfg = config_lib.stage_model_config(cfg, stage)
    if mcfg not in stage_steps:
      stage_steps[mcfg] = make_train_step(dataclasses.replace(cfg, model=mcfg), K3Model(mcfg),
                                          optimizer, schedule, **step_kwargs)
    return stage_steps[mcfg]
  evaluator = Evaluator(cfg, model, data)
  devices = 1 if mesh is None else mesh.devices.size

  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint,
                                     keep_steps=ends)
  precompiler = None
  first = ckpt.latest_step() or 0   # where the run will start, unless that checkpoint is refused
  if (scfg.precompile == "on" or (scfg.precompile == "auto" and jax.default_backend() != "cpu")
     ) and first < total_steps:
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
      # The first stage's step compiles while the state initialises. Its tracing goes first,
      # alone: traced beside the initialisation's own tracing (Python's lock), small.gin's step
      # took 24.6 s to trace on the H200 instead of 14.5 (RESULTS.md, run 13); its compile
      # releases the lock.
      first_stage = scfg.stage_at(first)
      precompiler = precompile_lib.start_run_programs(
          cfg, first_stage, state_shapes, step_of_stage, evaluator, mesh,
          memory_advice=lambda stage: out_of_memory_message(cfg, stage, devices))
      precompiler.wait_lowered(precompile_lib.train_program_name(
          first_stage, scfg.stages[first_stage][0]))
    else:
      print(f"note: StagesConfig.precompile is '{scfg.precompile}', but JAX's persistent "
            "compilation cache is off (--compilation_cache_dir=''): each program compiles when "
            "the run reaches it", file=sys.stderr)
  try:   # the precompiler stops taking programs if the state cannot be built or restored
    state = init_train_state(cfg, total_steps, mesh, lowered_cache_dir)[0]
    changes = _config_changes(workdir, cfg)
    try:
      restored = ckpt.restore_latest(params=state.params, moe_state=state.moe_state,
                                     opt_state=state.opt_state, rng=state.rng,
                                     log=lambda line: print(f"warning: {line}", file=sys.stderr),
                                     # checkpoints of the other decoder layout (scan_layers)
                                     convert=lambda item, tree: to_layout(tree, cfg.model))
    except checkpoint_lib.IncompatibleCheckpointError as e:
      ckpt.close()
      settings = "; ".join(changes) or "none in config.gin (the code's parameter tree changed?)"
      raise config_lib.ConfigError(
          f"--workdir={workdir} holds a run whose checkpoints do not fit this config ({e}). "
          f"Changed settings: {settings}. Use a new --workdir for the new config, or put the "
          "settings back to resume this run.") from e
    except checkpoint_lib.CorruptCheckpointError as e:
      ckpt.close()
      raise config_lib.ConfigError(
          f"{e}. They were moved to {os.path.join(ckpt.directory, checkpoint_lib.CORRUPT_DIR)}; "
          "re-run to start from step 0, or use a new --workdir.") from e
    start = None if restored is None else int(restored["meta"]["step"])
    if start is not None:
      if changes:
        print("note: the config differs from the one this run started with:\n  " +
              "\n  ".join(changes), file=sys.stderr)
      if restored["meta"]["data_position"] != start:
        raise ValueError(f"checkpoint {start}: data_position "
                         f"{restored['meta']['data_position']} != step")
      state = TrainState(step=jnp.asarray(start, jnp.int32), params=restored["params"],
                         opt_state=restored["opt_state"], moe_state=restored["moe_state"],
                         rng=restored["rng"])
      # Every leaf where the fresh state had it (the step counter too): arguments placed
      # otherwise than at the first launch would make the resumed step compile again (~100 s on
      # the GPU).
      state = jax.device_put(state, state_sh)
      print(f"resuming from step {start} (stage {scfg.stage_at(max(start - 1, 0))})")
  except BaseException:
    if precompiler is not None:
      precompiler.close()
    raise
  write_config(workdir, cfg)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start, tensorboard=tensorboard)
  writer.write_text("config", "```\n" + config_to_gin(cfg) + "```")
  start = start or 0

  # MFU by the model FLOPs of each stage's row length (attention grows with it).
  stage_flops = {seq: flops_per_token(cfg.model, seq) for seq, _ in scfg.stages}
  peak = metrics_lib.peak_flops_for(jax.default_backend(), peak_tflops) * devices

  def save(step):
    stage = scfg.stage_at(step - 1)
    ckpt.save(step, params=state.params, moe_state=state.moe_state, opt_state=state.opt_state,
              rng=state.rng, meta={"stage": stage, "seq_len": scfg.stages[stage][0],
                                   "data_position": step, "total_steps": total_steps})

  result = TrainResult(step=start, finished=start >= total_steps)
  last_loads, bar = None, None

  def ready(name: str) -> None:
    """Waits for a program that the precompiler may be compiling; says how it went, once."""
    report = None if precompiler is None else precompiler.wait(name)
    if report and "error" not in report:
      line = (f"{name}: compiled in the background (lowered in {report['lower_s']:.1f} s, "
              f"compiled in {report['compile_s']:.1f} s"
              + (f", {report['temp_gib']} GiB of temporaries)" if "temp_gib" in report else ")"))
      if bar is not None:
        bar.write(line)
      else:
        print(line)

  def evaluate(seq_len: int, passkey: bool) -> dict:
    """The evaluator on the current state at seq_len, once its program is compiled."""
    ready(precompile_lib.validation_program_name(seq_len))
    return evaluator(state.params, state.moe_state, seq_len, seed=cfg.seed, passkey=passkey)

  try:
    with StopSignal() as stop:
      iterator = data.train_iterator(start)
      if start == 0 and cfg.eval.every_steps:
        # The starting point of the validation curve (≈ ln(vocab) at initialisation).
        results = evaluate(scfg.stages[0][0], passkey=False)
        writer.write(0, "eval", dict(results, stage=0))
        print(f"validation loss at step 0: {results['val_loss']:.4f}")
      # The bar (and its ETA) counts to where this call stops, --max_steps included.
      bar = metrics_lib.ProgressBar(stop_at, start, enabled=progress)
      throughput = metrics_lib.Throughput()
      step = start
      while step < stop_at and stop.signum is None:
        stage = scfg.stage_at(step)
        seq_len = scfg.stages[stage][0]
        batch = next(iterator)
        batch = {k: batch[k] for k in ("inputs", "targets", "segment_ids", "loss_mask")}
        ready(precompile_lib.train_program_name(stage, seq_len))
        train_step = step_of_stage(stage)
        try:
          if mesh is None:
            # Committed to the state's device: the program then is the one that
            # `k3jax.precompile` compiled for arguments placed there (an uncommitted batch makes
            # another XLA compile-cache key).
            state, m = train_step(state, jax.device_put(batch, jax.devices()[0]))
          else:
            # Traced inside the mesh context, so the MoE takes its expert-parallel path.
            rows = sharding_lib.local_batch_rows(mesh, scfg.batch_size(stage))
            with sharding_lib.with_mesh(mesh):
              state, m = train_step(state, sharding_lib.shard_batch(
                  {k: v[rows] for k, v in batch.items()}, mesh))
          m = jax.device_get(m)
        except Exception as e:  # XlaRuntimeError/JaxRuntimeError; compile errors are others
          if not is_out_of_memory(e):
            raise
          raise StageOutOfMemoryError(out_of_memory_message(cfg, stage, devices)) from e
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
              step, stage, seq_len, scfg.batch_size(stage), m, rate,
              metrics_lib.mfu(stage_flops[seq_len], rate, peak)))
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
      if ckpt.latest_step() != step:  # --max_steps or a signal: keep where we stopped
        save(step)
      evals = [r for r in metrics_lib.read_jsonl(writer.path) if r["kind"] == "eval"]
      if (step > start and step < total_steps and stop.signum is None
          and not (evals and evals[-1]["step"] == step)):
        # Stopped by --max_steps: a validation pass at the current length for eval.json (passkey
        # retrieval, the costly part, stays at stage ends).
        stage = scfg.stage_at(step - 1)
        results = evaluate(scfg.stages[stage][0], passkey=False)
        writer.write(step, "eval", dict(results, stage=stage))
      result.step = step
      result.finished = step >= total_steps
      result.stopped_by_signal = stop.signum
  finally:
    if precompiler is not None:
      precompiler.close()
    if bar is not None:
      bar.close()
    ckpt.wait()
    ckpt.close()
    writer.close()

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
    result.eval = finish(cfg, workdir, last_loads, final_label="last evaluation")
    print(f"stopped by signal {result.stopped_by_signal} after step {result.step}; checkpoint "
          "saved; eval.json and plots/ hold the evaluations so far (no final evaluation, so as "
          "not to delay the exit). Re-run the same command to resume.")
  else:
    result.eval = finish(cfg, workdir, last_loads)
    if not result.finished:
      print(f"stopped at step {result.step} of {total_steps} (--max_steps); eval.json and plots/ "
            "written. To continue, re-run with a larger --max_steps, or without it.")
  return result


def finish(cfg: config_lib.Config, workdir: str, last_loads,
           final_label: str = "final evaluation") -> dict:
  """Writes DIR/eval.json and DIR/plots/*.png from metrics.jsonl; returns the final evaluation
  (the last evaluation record: at the end of the run, at --max_steps, or before a signal)."""
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
  from k3jax import plots  # pylint: disable=import-outside-toplevel
  plots.make_all(os.path.join(workdir, "plots"), train_records, eval_records, cfg.stages.stages,
                 None if last_loads is None else last_loads[1],
                 [] if last_loads is None else last_loads[0], passkey)
  print(f"{final_label} (step {final.get('step', '-')}):\n" + format_eval(final))
  return final


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def main(argv):
  from absl import flags
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  checkpoint_lib.quiet_logging()
  FLAGS = flags.FLAGS
  try:
    device_memory.apply_flag()   # before anything touches a device
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  cache_folder = compiler.enable_compilation_cache(FLAGS.compilation_cache_dir)
  distributed.maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  try:
    cfg = config_from_flags(FLAGS.gin_file or [], FLAGS.gin_bindings or [], FLAGS.mesh)
    if FLAGS.max_steps is not None and FLAGS.max_steps < 0:
      raise config_lib.ConfigError(f"--max_steps = {FLAGS.max_steps} is not allowed: an integer >= 0")
    result = train(cfg, FLAGS.workdir, max_steps=FLAGS.max_steps, peak_tflops=FLAGS.peak_tflops,
                   progress=FLAGS.progress, tensorboard=FLAGS.tensorboard,
                   lowered_cache_dir=os.path.join(cache_folder, "lowered") if cache_folder else "")
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    precompile_lib.exit_process(2)
  except (NonFiniteLossError, StageOutOfMemoryError) as e:
    print(f"error: {e}", file=sys.stderr)
    precompile_lib.exit_process(1)
  except Exception:  # pylint: disable=broad-except
    if not precompile_lib.background_work_running():
      raise
    traceback.print_exc()
    precompile_lib.exit_process(1)
  precompile_lib.exit_process(0 if result.stopped_by_signal is None
                              else 128 + result.stopped_by_signal)


def define_flags():
  from absl import flags
  flags.DEFINE_multi_string("gin_file", [], "Gin config files, applied in order.")
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings applied after the files, e.g. "
                            "'ModelConfig.d_model = 128'.")
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, plots).",
                      required=True)
  flags.DEFINE_integer("max_steps", None, "Stop after this global step (with a checkpoint).")
  flags.DEFINE_string("mesh", "", "Device mesh, e.g. 'data:2,expert:4' (sets MeshConfig.axes).")
  flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0 (else from "
                      "JAX_COORDINATOR_ADDRESS / SLURM / Open MPI; see README).")
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
  flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per device for the MFU estimate "
                     "(0: a default by backend).")
  flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
  flags.DEFINE_bool("tensorboard", True, "Write TensorBoard events to DIR/tb.")
  compiler.define_compilation_cache_flag()
  device_memory.define_flag()


if __name__ == "__main__":
  from absl import app
  define_flags()
  app.run(main)
