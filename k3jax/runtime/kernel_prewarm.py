"""A program's Mosaic GPU kernels compiled ahead of XLA's compile, on another thread.

XLA compiles each Mosaic GPU kernel of a program (tokamax's grouped matmul and attention forward,
k3jax's attention backward) when it builds that kernel's thunk, after the program's HLO passes,
one kernel after the other: in a profile of small.gin's cold start-up on an H200 host its
gradient program spent 6.9 s there, five kernels of about 1.3 s each, at the end of its compile
and so on the start-up's critical path (RESULTS.md, run 32). jaxlib keeps compiled Mosaic GPU
kernels in a process-wide cache keyed by the kernel's hash (`CachedCompile` in
jaxlib/mosaic/gpu/custom_call.cc). Compiling, while XLA runs the big program's HLO passes, a
program of one instruction that holds the same custom call leaves XLA a cache hit for it.

`prewarm_kernels` does that for every distinct kernel of some lowered programs. The one-call
programs are throwaway: their only effect is the cache entry, and a kernel they fail to compile
is compiled by XLA as before (the failure is logged).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from typing import Iterable, Sequence

from absl import logging
import jax
import jax.extend as jex
# The lowered programs' MLIR: Lowered.compiler_ir() returns these bindings' objects, and only
# they can walk it and build the one-call programs (jax.extend.mlir has no dialect builders).
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect

# Custom-call targets of Mosaic GPU kernels: the typed-FFI one Pallas emits, and the legacy one.
MOSAIC_GPU_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")


def _config_key(op: ir.Operation) -> str:
  """The part of a custom call's backend config that tells kernels apart. A typed-FFI call (API
  version 4, as Mosaic GPU's) keeps its attributes in the dictionary `mhlo.backend_config` and
  an empty `backend_config`; a Mosaic GPU call's `kernel_hash` there names its kernel (the
  dictionary also holds the whole kernel module, hundreds of KB to print)."""
  parts = []
  for name in ("backend_config", "mhlo.backend_config"):
    if name not in op.attributes:
      continue
    config = op.attributes[name]
    if isinstance(config, ir.DictAttr) and "kernel_hash" in config:
      parts.append(f"{name}.kernel_hash={config['kernel_hash']}")
    else:
      parts.append(f"{name}={config}")
  return "\n".join(parts)


def kernel_key(op: ir.Operation) -> str:
  """What tells kernel calls apart: target, backend config, operand and result types."""
  target = ir.StringAttr(op.attributes["call_target_name"]).value
  return hashlib.sha256("\n".join(
      [target, _config_key(op)] + [str(v.type) for v in op.operands]
      + [str(r.type) for r in op.results]).encode()).hexdigest()


def kernel_calls(module: ir.Module, targets: Sequence[str]) -> list[ir.Operation]:
  """The `stablehlo.custom_call`s of `module` (any region, any function) whose target is one of
  `targets`, one per distinct `kernel_key`. (Walking small.gin's gradient program, 34K
  operations, takes about 0.01 s.)"""
  found, seen = [], set()

  def visit(op):
    if (op.name == "stablehlo.custom_call"
        and ir.StringAttr(op.attributes["call_target_name"]).value in targets):
      key = kernel_key(op)
      if key not in seen:
        seen.add(key)
        found.append(op)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  return found


def single_call_module(op: ir.Operation) -> str:
  """StableHLO text of a module whose `main` takes `op`'s operands, runs `op` alone and returns
  its results. The op's Shardy attributes are dropped: they may name a mesh of the program it
  came from, and the one-call program runs on one device."""
  with op.context, ir.Location.unknown():
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
      fn_type = ir.FunctionType.get([v.type for v in op.operands], [r.type for r in op.results])
      fn = func_dialect.FuncOp("main", fn_type)
      fn.attributes["sym_visibility"] = ir.StringAttr.get("public")
      block = fn.add_entry_block()
      with ir.InsertionPoint(block):
        call = op.clone()
        for i, arg in enumerate(block.arguments):
          call.operands[i] = arg
        for name in [call.attributes[i].name for i in range(len(call.attributes))]:
          if name.startswith("sdy.") or name == "mhlo.sharding":
            del call.attributes[name]
        func_dialect.ReturnOp(call.results)
    return str(module)


def compile_single_call(text: str, device: jax.Device):
  """The one-call program `text` compiled for `device` (a loaded executable)."""
  client = device.client
  options = jex.backend.get_compile_options(num_replicas=1, num_partitions=1)
  return client.compile_and_load(text, [device], options)


class CompiledKernels:
  """The `kernel_key`s compiled already in this process, as jaxlib's own kernel cache is
  process-wide: a program compiled a second time (the training loop reading the step back from
  the caches after its background compile, a warm start's programs) then costs no one-call
  compiles (about 0.1 s each). Thread-safe."""

  def __init__(self):
    self._keys: set[str] = set()
    self._lock = threading.Lock()

  def __contains__(self, key: str) -> bool:
    with self._lock:
      return key in self._keys

  def add(self, key: str) -> None:
    with self._lock:
      self._keys.add(key)


# This process's record (see CompiledKernels). Tests pass their own.
PROCESS_KERNELS = CompiledKernels()


def prewarm_kernels(lowered: Iterable[jax.stages.Lowered], device: jax.Device,
                    targets: Sequence[str] = MOSAIC_GPU_TARGETS,
                    compiled: CompiledKernels = PROCESS_KERNELS) -> dict:
  """Compiles each distinct kernel call of the `lowered` programs with `targets`, not in
  `compiled` yet, as a one-call program for `device`, one after the other (jaxlib's Mosaic GPU
  cache compiles one kernel at a time anyway), and records it in `compiled`.
  Returns {'kernels': how many compiled, 'known': how many were in `compiled` already,
  'seconds', 'errors': [message, ...]}."""
  start = time.perf_counter()
  todo, known = {}, 0
  try:
    for program in lowered:
      for op in kernel_calls(program.compiler_ir("stablehlo"), targets):
        key = kernel_key(op)
        if key in compiled:
          known += 1
        elif key not in todo:
          todo[key] = single_call_module(op)
  except Exception as e:  # e.g. a jaxlib whose MLIR bindings differ; XLA compiles them as before
    logging.warning("kernel_prewarm: could not read the programs' kernel calls (XLA compiles "
                    "the kernels itself): %s: %s", type(e).__name__, e)
    return dict(kernels=0, known=known, seconds=time.perf_counter() - start,
                errors=[f"{type(e).__name__}: {e}"])
  errors = []
  for key, text in todo.items():
    try:
      compile_single_call(text, device)
      compiled.add(key)
    except Exception as e:  # XLA compiles the kernel itself then; the program is unaffected
      errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
  seconds = time.perf_counter() - start
  if errors:
    logging.warning("kernel_prewarm: %d of %d kernels did not compile ahead of XLA (XLA compiles "
                    "them itself): %s", len(errors), len(todo), errors[0])
  else:
    logging.info("kernel_prewarm: %d kernels compiled ahead of XLA in %.2f s (%d known)",
                 len(todo), seconds, known)
  return dict(kernels=len(todo) - len(errors), known=known, seconds=seconds, errors=errors)


@contextlib.contextmanager
def beside(lowered: Sequence[jax.stages.Lowered]):
  """On a GPU backend, `prewarm_kernels(lowered)` on a thread of its own while the block runs
  (the block compiles those programs), joined when it ends; elsewhere nothing."""
  if jax.default_backend() != "gpu":
    yield
    return
  thread = threading.Thread(target=prewarm_kernels, args=(list(lowered), jax.local_devices()[0]),
                            name="k3jax-kernel-prewarm", daemon=True)
  thread.start()
  try:
    yield
  finally:
    thread.join()


def compile_lowered(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
  """`lowered.compile()`, with its Mosaic GPU kernels compiled `beside` it."""
  with beside([lowered]):
    return lowered.compile()
