"""The training state and its initialisation: `TrainState`, `init_train_state`, and the shapes
that let a step compile before the state exists (`train_state_shapes`,
`placed_train_state_shapes`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax._src import config as jax_config  # threefry_gpu_kernel_lowering has no public context
from jax.sharding import Mesh, SingleDeviceSharding

from k3jax import config as config_lib
from k3jax.model import init_variables
from k3jax.parallel import sharding as sharding_lib
from k3jax.runtime import Runtime
from k3jax.training import optim

PyTree = Any


@struct.dataclass
class TrainState:
  """Everything that changes during training. step: int32 scalar, optimizer steps done; params,
  opt_state, moe_state (the balance biases): pytrees of arrays; rng: the training PRNG key."""
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  moe_state: PyTree
  rng: jax.Array


def _state_parts(cfg: config_lib.Config, total_steps: int, runtime: Runtime):
  """What the initialisation needs: (init rng, abstract variables, optimizer, schedule,
  assemble: boxed variables -> TrainState)."""
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
  seq_len = cfg.stages.stages[0][0]
  # Traced once per config: a warm launch reads the shapes and logical axes from the cache.
  abstract_vars = runtime.abstract(
      f"init_variables {cfg.model!r} {cfg.impl!r} 1 {seq_len}",
      lambda: jax.eval_shape(lambda: init_variables(cfg.model, init_rng, 1, seq_len,
                                                    impl=cfg.impl)))
  optimizer, schedule = optim.make_optimizer(cfg.optimizer, total_steps,
                                             optim.logical_axes(abstract_vars["params"]))

  def assemble(boxed):
    params = optim.unbox(boxed["params"])
    return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                      opt_state=optimizer.init(params),
                      moe_state=optim.unbox(boxed.get("moe_state", {})), rng=train_rng)

  return init_rng, abstract_vars, optimizer, schedule, assemble


def train_state_shapes(cfg: config_lib.Config, total_steps: int, runtime: Optional[Runtime] = None
                       ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """`init_train_state` without computing the state: a TrainState of jax.ShapeDtypeStructs (no
  shardings), the optimizer and the schedule. Enough to lower and compile a step (benchmarks)."""
  _, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps,
                                                                 runtime or Runtime(cfg.runtime))
  return jax.eval_shape(assemble, abstract_vars), optimizer, schedule


def placed_train_state_shapes(cfg: config_lib.Config, total_steps: int,
                              mesh: Optional[Mesh] = None, runtime: Optional[Runtime] = None
                              ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """`train_state_shapes` with each leaf's sharding where `init_train_state` places it (the
  first device; with a mesh, `sharding.state_shardings`): a step lowered for these shapes is the
  program that the initialised state's step runs, so it can compile while the state initialises
  (`k3jax.training.loop`)."""
  _, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps,
                                                                 runtime or Runtime(cfg.runtime))
  shapes = jax.eval_shape(assemble, abstract_vars)
  if mesh is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), shapes)
  else:
    shardings = sharding_lib.state_shardings(shapes, abstract_vars, mesh)
  placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh,
                                                           weak_type=x.weak_type),
                        shapes, shardings)
  return placed, optimizer, schedule


def init_train_state(cfg: config_lib.Config, total_steps: int, mesh: Optional[Mesh] = None,
                     runtime: Optional[Runtime] = None
                     ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """Fresh state (params, optimizer state, balance biases, rng) and the optimizer.

  One compiled computation builds the whole state. With a mesh it is compiled with the state's
  shardings (`sharding.state_shardings`) as out_shardings: each device computes only its own
  shard of the parameters and moments (the routed experts of its expert group), so no device
  ever holds the whole model; the values equal the single-device ones (threefry keys are
  partitionable). The placed shardings are `jax.tree.map(lambda x: x.sharding, state)`.
  runtime: compiles the initialisation (`Runtime.jit`; default `Runtime(cfg.runtime)`).
  """
  runtime = runtime or Runtime(cfg.runtime)
  init_rng, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps, runtime)
  seq_len = cfg.stages.stages[0][0]
  build = lambda rng: assemble(init_variables(cfg.model, rng, 1, seq_len, impl=cfg.impl))

  def cached(fun, **jit_kwargs):
    return runtime.jit(fun, **jit_kwargs, description=f"init_train_state {cfg!r} {total_steps}")

  if mesh is None:
    # On GPU, JAX lowers each threefry call to its unrolled rounds, one copy per parameter: for
    # small.gin on an H200 that made the initialisation's compile ~50 s (most of it XLA's fusion
    # pass). As one GPU kernel per call (the same bits) it compiles in seconds. Not with a mesh:
    # the SPMD partitioner cannot split that custom call and would compute every bit everywhere.
    with jax_config.threefry_gpu_kernel_lowering(True):
      state = cached(build)(init_rng)
    # Committed to the device, as every later state is (a step's outputs): the first step then
    # runs the program compiled for committed arguments, not a second one (XLA's compile cache
    # keys programs by their arguments' commitment; the precompiler compiles for committed).
    return jax.device_put(state, jax.devices()[0]), optimizer, schedule
  # The state's shapes from the variables' shapes: the model is not traced again for them.
  abstract_state = jax.eval_shape(assemble, abstract_vars)
  shardings = sharding_lib.state_shardings(abstract_state, abstract_vars, mesh)
  return cached(build, out_shardings=shardings)(init_rng), optimizer, schedule
