"""`jit` with the compiler options k3jax needs on the current backend.

XLA:CPU in jaxlib 0.10.2 crashes the process (SIGSEGV, no Python error) while *running* the gradient
of the chunked KDA for some shapes, e.g. chunk_size 32 with 2 heads: B=8, T=32, H=2, K=V=32. The
crash is in its YNNPACK fusion pass: disabling that pass (`xla_cpu_experimental_ynn_fusion_type`
empty) makes the same computation run and give the same numbers as on other shapes. It is an XLA
bug, not a k3jax one, so the option is set only where it is known: on the CPU backend, and only if
this jaxlib accepts it (checked once by compiling a trivial function; jaxlibs without the pass
reject the name, and then nothing is set). Reproducer: tests/test_compiler.py.

Scope: k3jax's top-level jits (the training step, evaluation, decoding, and eager calls of the KDA
ops) carry the option. A jit of your own around k3jax code does not; on XLA:CPU set it for the
whole process before JAX starts, as the test suite does (tests/conftest.py):
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=
"""

from __future__ import annotations

import functools
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


def compiler_options() -> dict:
  """The XLA options for k3jax computations on the default backend (a fresh dict)."""
  if jax.default_backend() == "cpu" and _cpu_options_supported():
    return dict(_CPU_OPTIONS)
  return {}


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
