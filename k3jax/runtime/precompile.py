"""A run's programs compiled ahead of their use, in background threads (`RuntimeConfig.precompile`).

A curriculum compiles one training step per stage and one validation program per stage length.
On an H200 each took ~60-130 s to compile alone (small.gin, RESULTS.md runs 10-12), each when
the loop reached it: small.gin's 8K -> 1M curriculum compiles about ten programs, one after the
other, in the middle of the run. `Precompiler` traces and lowers the programs one after the other
in one background thread (tracing holds Python's lock anyway) and compiles them on `workers`
threads (XLA's compile releases it), from before the state is initialised on (the programs
need only the state's shapes and placements), while the state initialises and the first stages
train. A compiled program lands in JAX's persistent compilation cache (and its lowering in
k3jax's lowered cache); when the loop reaches it, `wait` blocks until it is there, and the loop's
own call reads it from the caches instead of compiling it again.

Without a persistent compilation cache nothing could be handed over, so `Precompiler` refuses to
start (the CLIs enable one by default). A program that fails to trace or compile in the background
is reported on stderr and compiled again where it is used, where its error (e.g. out of memory)
is raised as without precompiling. On a GPU, a compiled program whose temporaries and arguments
exceed the device's memory is reported at once, with the settings that would lower it.

Background compiles autotune their GEMMs on the GPU while the loop trains: the timings they pick
from are measured beside the running step.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import queue
import sys
import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from k3jax.runtime import kernel_prewarm
from k3jax.parallel import sharding as sharding_lib

# What a program's name says in messages, e.g. "train step of stage 3 (1048576 tokens)".
Describe = str


def train_program_name(stage: int, seq_len: int) -> Describe:
  return f"train step of stage {stage} ({seq_len} tokens)"


def validation_program_name(seq_len: int) -> Describe:
  return f"validation program at {seq_len} tokens"


def batch_shapes(batch_size: int, seq_len: int, sharding=None) -> dict:
  """The shapes of a training or validation batch: inputs/targets/segment_ids int32 and loss_mask
  fp32, [batch_size, seq_len]."""
  shape = lambda dtype: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=sharding)
  return {"inputs": shape(jnp.int32), "targets": shape(jnp.int32),
          "segment_ids": shape(jnp.int32), "loss_mask": shape(jnp.float32)}


def placed_shapes(tree):
  """ShapeDtypeStructs of a tree of arrays (or of ShapeDtypeStructs), each with its leaf's own
  sharding."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type,
                                                     sharding=x.sharding), tree)


def device_bytes_limit() -> Optional[int]:
  """Memory of the first device in bytes, or None where the backend does not say (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return None if not stats else stats.get("bytes_limit")


class Precompiler:
  """Traces and compiles programs in background threads; `wait(name)` before using one.

  Args:
    workers: compile threads (each compile of a long stage takes several GiB of host memory).
    memory_advice: name -> text naming the settings that lower that program's memory, printed
      when a compiled program does not fit the device (None: no check).

  Use `submit(name, lower)` in the order the programs are needed, where `lower()` returns a
  `jax.stages.Lowered` (or an object with `.compile()`); then `wait(name)` where it is needed,
  and `close()` when the run ends. The threads are daemons: a process that ends (an error, a
  signal, --max_steps) does not wait for the compiles still running; what they had finished is
  in the caches for the next launch. A process must not finalise the interpreter while one of
  them is inside XLA (a run that stopped at stage 3's out-of-memory with the validation program
  compiling beside it died in a segmentation fault, exit code 139): the CLIs end with
  `exit_process`, which leaves at once while `background_work_running()`.
  """

  def __init__(self, workers: int, memory_advice: Optional[Callable[[str], str]] = None):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
      raise ValueError("precompiling needs JAX's persistent compilation cache (the CLIs' "
                       "--compilation_cache_dir): without it the loop would compile every program "
                       "again")
    self._memory_advice = memory_advice
    self._limit = device_bytes_limit() if memory_advice is not None else None
    self._futures: dict[str, concurrent.futures.Future] = {}
    self._lowered: dict[str, threading.Event] = {}
    self._to_lower: queue.Queue = queue.Queue()
    self._to_compile: queue.Queue = queue.Queue()
    self._closed = threading.Event()
    threading.Thread(target=self._lower_loop, name="k3jax-trace", daemon=True).start()
    for i in range(workers):
      threading.Thread(target=self._compile_loop, name=f"k3jax-compile-{i}", daemon=True).start()

  def submit(self, name: Describe, lower: Callable[[], object]) -> None:
    """Queues `lower()` on the tracing thread, then its `.compile()` on a compile thread."""
    if name in self._futures:
      raise ValueError(f"{name!r} was submitted already")
    future = self._futures[name] = concurrent.futures.Future()
    self._lowered[name] = threading.Event()
    self._to_lower.put((name, lower, future))

  def wait_lowered(self, name: Describe) -> None:
    """Blocks until `name` is traced and lowered (or failed to be, or was dropped by `close`):
    from then on its compile releases Python's lock, so the caller's own tracing (the state's
    initialisation) does not slow the program's tracing down. No-op for a name never submitted."""
    event = self._lowered.get(name)
    if event is not None:
      event.wait()

  def close(self) -> None:
    """Drops the programs not yet started (`wait` gives them a report with "error": cancelled);
    a lowering or a compile already running goes on in its thread."""
    self._closed.set()
    for q in (self._to_lower, self._to_compile):
      while True:
        try:
          item = q.get_nowait()
        except queue.Empty:
          break
        item[-1].cancel()
        self._lowered[item[0]].set()

  def _take(self, q: queue.Queue):
    """The next job of `q`, with this thread marked as working; None (the job cancelled) once
    the precompiler is closed."""
    item = q.get()
    if self._closed.is_set():
      item[-1].cancel()
      self._lowered[item[0]].set()
      return None
    threading.current_thread().k3jax_working = True
    return item

  def _lower_loop(self):
    while True:
      if (item := self._take(self._to_lower)) is None:
        continue
      name, lower, future = item
      t0 = time.perf_counter()
      try:
        self._to_compile.put((name, lower(), time.perf_counter() - t0, future))
      except BaseException as e:  # pylint: disable=broad-except
        future.set_exception(e)
      finally:
        threading.current_thread().k3jax_working = False
        self._lowered[name].set()

  def _compile_loop(self):
    while True:
      if (item := self._take(self._to_compile)) is None:
        continue
      name, lowered, lower_s, future = item
      try:
        future.set_result(self._compile(name, lowered, lower_s))
      except BaseException as e:  # pylint: disable=broad-except
        future.set_exception(e)
      finally:
        threading.current_thread().k3jax_working = False

  def _compile(self, name, lowered, lower_s) -> dict:
    t0 = time.perf_counter()
    # A host-loop step (microbatch.HostLoopLowered) starts its own kernel prewarm.
    compiled = (kernel_prewarm.compile_lowered(lowered) if isinstance(lowered, jax.stages.Lowered)
                else lowered.compile())
    report = {"lower_s": round(lower_s, 2), "compile_s": round(time.perf_counter() - t0, 2)}
    programs = getattr(compiled, "programs", {name: compiled})  # the host micro-batch loop's
    need = 0
    for program in programs.values():
      mem = program.memory_analysis()
      if mem is not None:
        need = max(need, mem.temp_size_in_bytes + mem.argument_size_in_bytes)
        report["temp_gib"] = max(report.get("temp_gib", 0.0),
                                 round(mem.temp_size_in_bytes / 2**30, 2))
    if self._limit and need > self._limit:
      print(f"warning: the {name} needs {need / 2**30:.1f} GiB (temporaries and arguments) of "
            f"the device's {self._limit / 2**30:.1f} GiB: it will run out of memory when the "
            f"run gets there. {self._memory_advice(name)}", file=sys.stderr, flush=True)
    return report

  def wait(self, name: Describe) -> Optional[dict]:
    """Blocks until `name` is compiled; its report, or None when it was never submitted (or
    waited for already). A background failure is printed and gives a report with "error": the
    caller compiles the program itself."""
    future = self._futures.pop(name, None)
    if future is None:
      return None
    try:
      return future.result()
    except concurrent.futures.CancelledError:
      return {"error": "cancelled: the precompiler was closed before it started"}
    except Exception as e:  # pylint: disable=broad-except
      first = (str(e).strip().splitlines() or [""])[0][:300]
      print(f"warning: compiling the {name} in the background failed ({type(e).__name__}: "
            f"{first}); it is compiled where it is used", file=sys.stderr, flush=True)
      return {"error": f"{type(e).__name__}: {first}"}


def start_run_programs(cfg, first_stage: int, state_of_stage: Callable, step_of_stage: Callable,
                       evaluator, mesh_of_stage: Callable = lambda stage: None,
                       memory_advice: Optional[Callable[[int], str]] = None,
                       workers: int = 2, last_stage: Optional[int] = None) -> Precompiler:
  """A `Precompiler` working on a run's programs from `first_stage` to `last_stage` (default: the
  last stage of the curriculum), in the order the loop needs them: each stage's training step,
  then the validation program at the stage's end (one per distinct length; only for a stage on
  one device: on a mesh the evaluation's arguments are placed by its call).

  state_of_stage: stage -> the state's ShapeDtypeStructs with the shardings it has in that stage
  (`k3jax.training.state.placed_train_state_shapes` on the stage's mesh): the steps' arguments.
  step_of_stage: stage -> its training step (called here, in the calling thread). mesh_of_stage:
  stage -> its mesh (None: one device). memory_advice: stage -> the settings that lower its
  memory. workers: compile threads (RuntimeConfig.precompile_workers). last_stage: the stage
  that the run stops in (a run stopped by max_steps before the curriculum's end compiles no
  program of the stages after it).
  """
  scfg = cfg.stages
  last_stage = len(scfg.stages) - 1 if last_stage is None else last_stage
  if not 0 <= first_stage <= last_stage < len(scfg.stages):
    raise ValueError(f"stages {first_stage} to {last_stage}: not a range of the "
                     f"{len(scfg.stages)} stages")
  names = {}
  precompiler = Precompiler(workers,
                            None if memory_advice is None else
                            lambda name: memory_advice(names[name]))

  def lower_step(step, state_shapes, batch, mesh):
    # The loop traces its steps inside the mesh, where there is one.
    with contextlib.nullcontext() if mesh is None else sharding_lib.with_mesh(mesh):
      return step.lower(state_shapes, batch)

  for stage in range(first_stage, last_stage + 1):
    seq_len, mesh = scfg.stages[stage][0], mesh_of_stage(stage)
    state_shapes = placed_shapes(state_of_stage(stage))
    # Where the loop places a step's batch: committed to the state's device, or over the mesh.
    batch_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                      else sharding_lib.batch_sharding(mesh))
    name = train_program_name(stage, seq_len)
    names[name] = stage
    batch = batch_shapes(scfg.batch_size(stage), seq_len, batch_sharding)
    precompiler.submit(name, functools.partial(lower_step, step_of_stage(stage), state_shapes,
                                               batch, mesh))
    name = validation_program_name(seq_len)
    if mesh is None and name not in names:
      names[name] = stage
      # The evaluation's batches are uncommitted arrays: shapes without a sharding, or the
      # compile-cache key would differ from the call's.
      precompiler.submit(name, functools.partial(evaluator.lower_validation, state_shapes.params,
                                                 state_shapes.moe_state, seq_len))
  return precompiler


def background_work_running() -> bool:
  """Whether a precompiler thread is lowering or compiling a program right now."""
  return any(getattr(t, "k3jax_working", False) for t in threading.enumerate())


def exit_process(code: int = 0) -> None:
  """Ends a CLI process with `code`. While a background lowering or compile is inside XLA, the
  interpreter is not finalised under it (that crashed with a segmentation fault): the streams are
  flushed and the process leaves at once. Otherwise a normal `sys.exit`."""
  if background_work_running():
    print("note: leaving the programs still compiling in the background unfinished",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
