"""`jit` with the compiler options k3jax needs on the current backend and device count.

XLA:CPU in jaxlib 0.10.2 crashes the process (SIGSEGV, no Python error) while *running* the gradient
of the chunked KDA for some shapes, e.g. chunk_size 32 with 2 heads: B=8, T=32, H=2, K=V=32. The
crash is in its YNNPACK fusion pass: disabling that pass (`xla_cpu_experimental_ynn_fusion_type`
empty) makes the same computation run and give the same numbers as on other shapes. It is an XLA
bug, not a k3jax one, so the option is set only where it is known: on the CPU backend, and only if
this jaxlib accepts it (checked once by compiling a trivial function; jaxlibs without the pass
reject the name, and then nothing is set). Reproducer: tests/test_compiler.py.

On a single GPU the latency-hiding scheduler is off (`options_for`): with nothing to overlap, it
took 39 s of a 101-s profiled compile of small.gin's step. Any option that XLA_FLAGS names is
left to XLA_FLAGS.

Scope: k3jax's top-level jits (the training step, evaluation, decoding, and eager calls of the KDA
ops) carry the option. A jit of your own around k3jax code does not; on XLA:CPU set it for the
whole process before JAX starts, as the test suite does (tests/conftest.py):
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=

The persistent compilation cache (`enable_compilation_cache`, the CLIs' --compilation_cache_dir):
compiled executables are written to a folder and read back by the next process that compiles the
same computation with the same jax, backend and options, so that a restarted run skips the
minutes of compiling the initialisation and the training step (small.gin on an H200: ~3 minutes).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable

import jax
import numpy as np

# Empty = no YNNPACK fusions on XLA:CPU.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _cpu_options_supported() -> bool:
  try:
    jax.jit(lambda x: x + 1, compiler_options=_CPU_OPTIONS).lower(np.float32(0)).compile()
  except jax.errors.JaxRuntimeError as e:
    if "compile option" in str(e) or "enum value" in str(e):
      return False
    raise
  return True


# XLA:GPU's latency-hiding scheduler orders a program so that collectives and asynchronous copies
# overlap compute. With one GPU there are no collectives to hide, and it was the largest single
# phase of small.gin's step compile on an H200 (39 s of a 101-s compile, profiled; RESULTS.md run
# 13). Without it the compile took 62.4 s instead of 73.0, the step ran at the same speed (202.8
# against 200.4 ms, medium.gin 617.3 against 616.7 ms) with fewer temporaries (37.8 against 40.0
# GiB). With several GPUs it stays on: there it overlaps the expert and data all-to-alls.
_SINGLE_GPU_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": False}


def options_for(backend: str, device_count: int, xla_flags: str = "") -> dict:
  """The XLA options k3jax sets for `backend` with `device_count` devices in the run (a fresh
  dict), leaving out any option that `xla_flags` (the XLA_FLAGS environment variable) sets:
  the user's flag wins."""
  if backend == "cpu":
    options = dict(_CPU_OPTIONS) if _cpu_options_supported() else {}
  elif backend in ("gpu", "cuda", "rocm") and device_count == 1:
    options = dict(_SINGLE_GPU_OPTIONS)
  else:
    options = {}
  named = set(re.findall(r"--([A-Za-z0-9_]+)", xla_flags))
  return {k: v for k, v in options.items() if k not in named}


def compiler_options() -> dict:
  """The XLA options for k3jax computations on the default backend and its devices (a fresh
  dict): `options_for(jax.default_backend(), jax.device_count(), $XLA_FLAGS)`."""
  return options_for(jax.default_backend(), jax.device_count(), os.environ.get("XLA_FLAGS", ""))


def jit(fun: Callable, **jit_kwargs: Any) -> Callable:
  """`jax.jit(fun, **jit_kwargs)` with `compiler_options()`. Call at run time, not import time:
  it asks for the default backend, which initialises JAX's devices."""
  options = compiler_options()
  if options:
    jit_kwargs["compiler_options"] = {**options, **jit_kwargs.get("compiler_options", {})}
  return jax.jit(fun, **jit_kwargs)


def lazy_jit(fun: Callable, **jit_kwargs: Any) -> Callable:
  """`jit` for module-level functions: built on the first call, so that importing a module does
  not initialise JAX. JAX accepts compiler options only on a top-level jit called with concrete
  arrays, so a call with tracers (inside another jit, grad or vmap) uses the plain `jax.jit`; the
  enclosing top-level jit decides the options then (k3jax's own use `jit` above)."""
  plain = jax.jit(fun, **jit_kwargs)

  @functools.lru_cache(maxsize=None)
  def build(backend: str) -> Callable:
    del backend  # the cache key: compiler_options() depends on it
    return jit(fun, **jit_kwargs)

  @functools.wraps(fun)
  def call(*args, **kwargs):
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
      return plain(*args, **kwargs)
    return build(jax.default_backend())(*args, **kwargs)

  return call


# The CLIs' default for --compilation_cache_dir where JAX's own variable is not set.
DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/k3jax/jax_cache"
# JAX's environment variable for its persistent cache folder; the CLIs' default follows it.
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
COMPILATION_CACHE_FLAG_HELP = (
    "Folder of JAX's persistent compilation cache: a rerun with the same config, shapes and jax "
    "version loads the compiled initialisation and steps instead of compiling them again. "
    f"Default: ${CACHE_DIR_ENV} where set, else {DEFAULT_COMPILATION_CACHE_DIR}. Empty disables "
    "the cache.")


def default_compilation_cache_dir() -> str:
  """The CLIs' --compilation_cache_dir default: JAX's JAX_COMPILATION_CACHE_DIR where it is set
  and not empty (one folder for every JAX program of the environment, k3jax's included), else
  DEFAULT_COMPILATION_CACHE_DIR."""
  return os.environ.get(CACHE_DIR_ENV) or DEFAULT_COMPILATION_CACHE_DIR


def enable_compilation_cache(path: str) -> str:
  """Turns JAX's persistent compilation cache on in `path` (created if missing; '~' expanded), or
  off for the whole process when `path` is empty. Returns the absolute folder ('' when off).

  Every compiled computation is cached, whatever its compile time and size: JAX's defaults skip
  those compiled in under a second, which on a fast machine is some of a run's start-up (the
  evaluation's and the decoder's small jits), and reading one back is cheaper than compiling it.
  Call before the first compilation of the process: JAX sets its cache up once, at the first
  compile that asks for it.
  """
  if not isinstance(path, str):
    raise TypeError(f"compilation cache path must be a str, got {type(path).__name__}")
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    return ""
  folder = os.path.abspath(os.path.expanduser(path))
  os.makedirs(folder, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # -1: no size threshold at all (0 would let JAX substitute a per-filesystem minimum).
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return folder


def define_compilation_cache_flag() -> None:
  """Defines the absl flag --compilation_cache_dir (once per process: several CLI modules may be
  imported together)."""
  from absl import flags
  if "compilation_cache_dir" not in flags.FLAGS:
    flags.DEFINE_string("compilation_cache_dir", default_compilation_cache_dir(),
                        COMPILATION_CACHE_FLAG_HELP)
