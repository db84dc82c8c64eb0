"""How a run's programs are compiled and run: everything that makes start-up short and steps fast
without changing what is computed (docs/startup.md).

The training code reaches it through `Runtime`, one object per run (`Runtime.for_run(cfg,
compilation_cache_dir)` is the one `k3jax train` builds):

  runtime.jit(fun, description=...)        `jax.jit` with k3jax's compiler options, its traced and
                                           lowered program kept on disk when the run has a
                                           lowered-program cache (`lowered_cache`)
  runtime.abstract(description, compute)   `compute()`'s shapes, kept the same way
  runtime.train_step(...)                  the step as one program ('scan') or as a host loop of
                                           programs ('host', `host_loop`): RuntimeConfig
  runtime.start_precompile(...)            the stages' programs compiled ahead in background
                                           threads (`precompile`), or nothing where that is off

The modules behind it: `compiler` (XLA options, the persistent compilation cache),
`lowered_cache`, `host_loop`, `param_casts` (weights cast once per step in the host loop),
`precompile`, `kernel_prewarm` (Mosaic GPU kernels compiled beside XLA), `device_memory` (the GPU
allocator's share). None of them imports the model or the training code.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import jax

from k3jax.config import Config, ImplConfig, RuntimeConfig
from k3jax.runtime import compiler
from k3jax.runtime import device_memory
from k3jax.runtime import host_loop
from k3jax.runtime import lowered_cache
from k3jax.runtime import precompile
from k3jax.runtime.compiler import jit
from k3jax.runtime.precompile import batch_shapes, train_program_name, validation_program_name

__all__ = ["Runtime", "context_modules_for", "jit", "batch_shapes", "train_program_name",
           "validation_program_name"]


def context_modules_for(impl: ImplConfig, backend: str) -> tuple:
  """The `Runtime.context_modules` of a run with these implementation settings on `backend`
  ('cpu', 'gpu', 'tpu'): tokamax where its kernels can be traced, () on CPU unless a setting
  names them. On CPU 'auto' picks XLA's attention (k3jax/ops/attention.py) and the tiled grouped
  matmul (k3jax/ops/grouped_matmul.py); an explicit 'tokamax' grouped matmul runs there too."""
  names_tokamax = (impl.attention_impl.startswith("tokamax")
                   or impl.moe_grouped_matmul == "tokamax")
  if backend != "cpu" or names_tokamax:
    return lowered_cache.CONTEXT_REGISTERING_MODULES
  return ()


class _NoPrecompile:
  """The precompiler's interface where nothing is compiled ahead: every program is compiled
  where the loop first calls it."""

  def wait(self, name: str) -> None:
    del name

  def wait_lowered(self, name: str) -> None:
    del name

  def close(self) -> None:
    pass


class Runtime:
  """The runtime of one run.

  config: RuntimeConfig (the micro-batch loop, background compiles).
  lowered_cache_dir: where traced and lowered programs are kept between launches; '' keeps none
    (the CLIs use <--compilation_cache_dir>/lowered).
  context_modules: the libraries the lowered cache imports before it computes a key, because
    they register JAX user contexts when imported (`lowered_cache.CONTEXT_REGISTERING_MODULES`,
    tokamax); () for a run whose programs cannot import them while they are traced
    (`context_modules_for`).
  """

  def __init__(self, config: Optional[RuntimeConfig] = None, lowered_cache_dir: str = "",
               context_modules: tuple = lowered_cache.CONTEXT_REGISTERING_MODULES):
    self.config = RuntimeConfig() if config is None else config
    self.lowered_cache_dir = lowered_cache_dir
    self.context_modules = tuple(context_modules)

  def __repr__(self) -> str:
    return (f"Runtime({self.config!r}, lowered_cache_dir={self.lowered_cache_dir!r}, "
            f"context_modules={self.context_modules!r})")

  @classmethod
  def for_run(cls, cfg: Config, compilation_cache_dir: str) -> "Runtime":
    """The runtime `k3jax train` runs `cfg` with: traced and lowered programs kept in
    <compilation_cache_dir>/lowered ('' keeps none), and the context modules of its kernels on
    this backend (`context_modules_for`)."""
    lowered = os.path.join(compilation_cache_dir, "lowered") if compilation_cache_dir else ""
    return cls(cfg.runtime, lowered, context_modules_for(cfg.impl, jax.default_backend()))

  def jit(self, fun: Callable, *, description: str, **jit_kwargs: Any) -> Callable:
    """`jit(fun, **jit_kwargs)` (k3jax's compiler options); with a lowered-program cache, its
    traced and lowered program is kept there under a key that includes `description`, which must
    name everything `fun` closes over that the sources do not fix (`lowered_cache.cached_jit`)."""
    return lowered_cache.cached_jit(fun, cache_dir=self.lowered_cache_dir,
                                    description=description,
                                    context_modules=self.context_modules, **jit_kwargs)

  def abstract(self, description: str, compute: Callable[[], Any]) -> Any:
    """`compute()` (a tree of jax.ShapeDtypeStruct, possibly boxed), read from the lowered-program
    cache where it holds it (`lowered_cache.cached_abstract`)."""
    return lowered_cache.cached_abstract(self.lowered_cache_dir, description, compute,
                                         self.context_modules)

  def train_step(self, one_program: Callable, *, loss_fn: Callable, apply_update: Callable,
                 accumulate: Any, microbatch_rows: Callable[[int, int], int],
                 state_shardings: Any, batch_shardings: Any, description: str) -> Callable:
    """The training step `(state, batch) -> (state, metrics)` as RuntimeConfig.microbatch_loop
    runs it: 'scan', `one_program` jitted (the state donated); 'host', a `host_loop.HostLoopStep`
    over `loss_fn`, `accumulate`'s arithmetic and `apply_update` (the same results)."""
    if self.config.microbatch_loop == "scan":
      jit_kwargs = {}
      if state_shardings is not None or batch_shardings is not None:
        jit_kwargs = dict(in_shardings=(state_shardings, batch_shardings),
                          out_shardings=(state_shardings, None))
      return self.jit(one_program, donate_argnums=(0,), description=description, **jit_kwargs)
    return host_loop.HostLoopStep(
        loss_fn, apply_update, accumulate, microbatch_rows, state_shardings=state_shardings,
        batch_shardings=batch_shardings, cache_dir=self.lowered_cache_dir,
        description=description, context_modules=self.context_modules)

  @staticmethod
  def device_memory_fraction() -> str:
    """The share of each GPU's memory this process's allocator was given (--device_memory_fraction,
    `device_memory`)."""
    return device_memory.current_fraction()

  def precompiles(self) -> bool:
    """Whether the stages' programs are compiled ahead (RuntimeConfig.precompile; 'auto': where
    the steps run on an accelerator)."""
    mode = self.config.precompile
    return mode == "on" or (mode == "auto" and jax.default_backend() != "cpu")

  def start_precompile(self, cfg, first_stage: int, state_of_stage: Callable,
                       step_of_stage: Callable, evaluator, mesh_of_stage: Callable = lambda s: None,
                       memory_advice: Optional[Callable[[int], str]] = None,
                       last_stage: Optional[int] = None):
    """A precompiler working on the run's programs from `first_stage` to `last_stage`
    (`precompile.start_run_programs`; its arguments), with the first stage's step traced before
    this returns, so that the caller's own tracing does not slow it down. Where precompiling is
    off, or JAX's persistent compilation cache is (nothing could be handed over), an object with
    the same `wait`, `wait_lowered` and `close` that compiles nothing."""
    if not self.precompiles():
      return _NoPrecompile()
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
      print(f"note: RuntimeConfig.precompile is '{self.config.precompile}', but JAX's persistent "
            "compilation cache is off (--compilation_cache_dir=''): each program compiles when "
            "the run reaches it", file=sys.stderr)
      return _NoPrecompile()
    precompiler = precompile.start_run_programs(cfg, first_stage, state_of_stage, step_of_stage,
                                                evaluator, mesh_of_stage,
                                                memory_advice=memory_advice,
                                                workers=self.config.precompile_workers,
                                                last_stage=last_stage)
    # Its tracing goes first, alone: traced beside the state's initialisation (Python's lock),
    # small.gin's step took 24.6 s to trace on the H200 instead of 14.5 (RESULTS.md, run 13).
    precompiler.wait_lowered(train_program_name(first_stage, cfg.stages.stages[first_stage][0]))
    return precompiler
