"""The training step and the training state: `make_train_step`, `init_train_state`,
`train_state_shapes` (the loop that drives them over the stages is `k3jax.train`).

The step: mean token cross-entropy over the loss mask (plus the MoE aux loss where configured),
gradients accumulated over micro-batches (`k3jax.microbatch`), the optimizer update, QK-Clip and the
MoE balance biases; jitted, its traced and lowered program optionally kept in `k3jax.lowered_cache`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax._src import config as jax_config  # threefry_gpu_kernel_lowering has no public context
from jax.sharding import Mesh, SingleDeviceSharding

from k3jax import config as config_lib
from k3jax import lowered_cache
from k3jax import microbatch
from k3jax import optim
from k3jax import sharding as sharding_lib
from k3jax.evaluate import moe_stats_by_layer, token_cross_entropy
from k3jax.loss import chunked_cross_entropy
from k3jax.model import K3Model, init_variables, is_scanned_path

PyTree = Any
# Where MLA layers sow the per-head max logits for QK-Clip (defined beside the accumulation).
QK_STATS_COLLECTION = microbatch.QK_STATS_COLLECTION


@struct.dataclass
class TrainState:
  """Everything that changes during training. step: int32 scalar, optimizer steps done."""
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  moe_state: PyTree
  rng: jax.Array



# ------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------

def _sown_max_logits(attn_stats: PyTree) -> dict:
  """{path of the MLA module: [H] max logits} from the QK_STATS_COLLECTION collection; [G, H], one
  row per group, for a module of the decoder's scan (`k3jax.model.is_scanned_path`)."""
  out = {}
  for path, value in jax.tree_util.tree_flatten_with_path(attn_stats)[0]:
    names = optim.path_names(path)
    if "max_logits" not in names:
      continue
    module = names[:names.index("max_logits")]
    value = jnp.asarray(value)
    groups = (value.shape[0],) if is_scanned_path(module) else ()
    out[module] = jnp.max(value.reshape(groups + (-1, value.shape[-1])), axis=-2)
  return out


def make_train_step(cfg: config_lib.Config, model: K3Model, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, *, state_shardings: Any = None,
                    batch_shardings: Any = None, lowered_cache_dir: str = "",
                    total_steps: Optional[int] = None) -> Callable:
  """The jitted training step `(state, batch) -> (state, metrics)`.

  Loss = mean token cross-entropy over loss_mask (fp32 logits), plus moe_aux_loss_coef x the sum
  of the layers' aux losses when moe_balance == 'aux_loss'. The model runs with
  update_balance=True; the balance biases it writes are kept when step % moe_qb_interval == 0.
  With qk_clip_tau > 0, QK-Clip rescales MLA weights after the update from the sown max logits.

  state_shardings / batch_shardings: passed to jax.jit as in/out shardings when given (the hook for
  `k3jax/sharding.py`); None leaves placement to JAX (single device).
  lowered_cache_dir: non-empty: the traced and lowered step is kept there (`k3jax.lowered_cache`),
  keyed by cfg, total_steps, the shardings and the sources; a warm launch skips tracing and
  lowering. Then total_steps, the one given to `init_train_state` for `optimizer` and `schedule`,
  is required (the schedule's constants are part of the program).

  Micro-batches (StagesConfig.microbatch_tokens, `k3jax.microbatch`): with
  StagesConfig.microbatch_loop 'scan' they run in a lax.scan inside the one jitted step; with
  'host' a step of several micro-batches runs as a host loop of jitted programs
  (`microbatch.HostLoopStep`, same contract and results), one of one micro-batch as two programs
  (its gradients, then the update), which compile at once.
  """
  mcfg = cfg.model
  use_aux = mcfg.moe_balance == "aux_loss"
  qk_tau = cfg.optimizer.qk_clip_tau
  mutable = ["moe_state", "moe_stats"] + ([QK_STATS_COLLECTION] if qk_tau > 0 else [])

  def loss_fn(params, moe_state, batch):
    variables = {"params": params, "moe_state": moe_state}
    if mcfg.position_chunk_tokens > 0:
      # The head and the loss over chunks of positions: no [B, T, vocab] logits.
      (h, head), mutated = model.apply(variables, batch["inputs"], batch["segment_ids"],
                                       update_balance=True, return_hidden=True, mutable=mutable)
      ce_sum, n = chunked_cross_entropy(h, head, batch["targets"], batch["loss_mask"],
                                        mcfg.position_chunk_tokens)
    else:
      logits, mutated = model.apply(variables, batch["inputs"], batch["segment_ids"],
                                    update_balance=True, mutable=mutable)
      ce_sum, n = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    ce = ce_sum / jnp.maximum(n, 1.0)
    stats = mutated.get("moe_stats", {})
    aux = jnp.zeros([], jnp.float32)
    if use_aux:
      for layer in moe_stats_by_layer(stats).values():
        aux = aux + layer["aux_loss"].astype(jnp.float32)
    return ce + mcfg.moe_aux_loss_coef * aux, (ce, aux, mutated)

  def grads_of_step(params, moe_state, batch):
    """(total, (ce, aux, mutated)), grads of the whole step, micro-batched when configured."""
    rows, seq_len = batch["inputs"].shape
    per_micro = cfg.stages.microbatch_rows(seq_len, rows)
    if per_micro == rows:
      return jax.value_and_grad(loss_fn, has_aux=True)(params, moe_state, batch)
    return microbatch.accumulate_scan(loss_fn, params, moe_state, batch, rows // per_micro)

  def apply_update(state: TrainState, total, ce, aux, mutated, grads):
    """Everything after the step's loss and gradients: (new state, metrics)."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if qk_tau > 0:
      max_logits = _sown_max_logits(mutated.get(QK_STATS_COLLECTION, {}))
      if not max_logits:
        raise ValueError("OptimizerConfig.qk_clip_tau > 0 but the model sows no per-head "
                         f"'max_logits' into the {QK_STATS_COLLECTION!r} collection")
      params = optim.apply_qk_clip(params, max_logits, qk_tau, mcfg)
    keep = (state.step % mcfg.moe_qb_interval) == 0
    new_moe = mutated.get("moe_state", state.moe_state)
    moe_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_moe, state.moe_state)
    metrics = {"loss": ce, "total_loss": total, "aux_loss": aux,
               "grad_norm": optax.global_norm(grads), "lr": schedule(state.step),
               "moe_stats": mutated.get("moe_stats", {})}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              moe_state=moe_state)
    return new_state, metrics

  def train_step(state: TrainState, batch: dict):
    (total, (ce, aux, mutated)), grads = grads_of_step(state.params, state.moe_state, batch)
    return apply_update(state, total, ce, aux, mutated, grads)

  jit_kwargs = {}
  if state_shardings is not None or batch_shardings is not None:
    jit_kwargs = dict(in_shardings=(state_shardings, batch_shardings),
                      out_shardings=(state_shardings, None))
  if lowered_cache_dir and total_steps is None:
    raise ValueError("make_train_step: lowered_cache_dir needs total_steps (the one given to "
                     "init_train_state)")
  description = f"make_train_step {cfg!r} {model!r} total_steps={total_steps}"
  if cfg.stages.microbatch_loop == "scan":
    return lowered_cache.cached_jit(train_step, cache_dir=lowered_cache_dir, donate_argnums=(0,),
                                    description=description, **jit_kwargs)
  return microbatch.HostLoopStep(
      loss_fn, apply_update, cfg.stages.microbatch_rows,
      state_shardings=state_shardings, batch_shardings=batch_shardings,
      cache_dir=lowered_cache_dir, description=description)


def _state_parts(cfg: config_lib.Config, total_steps: int, lowered_cache_dir: str):
  """What the initialisation needs: (init rng, abstract variables, optimizer, schedule,
  assemble: boxed variables -> TrainState)."""
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
  seq_len = cfg.stages.stages[0][0]
  # Traced once per config: a warm launch reads the shapes and logical axes from the cache.
  abstract_vars = lowered_cache.cached_abstract(
      lowered_cache_dir, f"init_variables {cfg.model!r} 1 {seq_len}",
      lambda: jax.eval_shape(lambda: init_variables(cfg.model, init_rng, 1, seq_len)))
  optimizer, schedule = optim.make_optimizer(cfg.optimizer, total_steps,
                                             optim.logical_axes(abstract_vars["params"]))

  def assemble(boxed):
    params = optim.unbox(boxed["params"])
    return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                      opt_state=optimizer.init(params),
                      moe_state=optim.unbox(boxed.get("moe_state", {})), rng=train_rng)

  return init_rng, abstract_vars, optimizer, schedule, assemble


def train_state_shapes(cfg: config_lib.Config, total_steps: int, lowered_cache_dir: str = ""
                       ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """`init_train_state` without computing the state: a TrainState of jax.ShapeDtypeStructs (no
  shardings), the optimizer and the schedule. Enough to lower and compile a step (benchmarks)."""
  _, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps,
                                                                 lowered_cache_dir)
  return jax.eval_shape(assemble, abstract_vars), optimizer, schedule


def placed_train_state_shapes(cfg: config_lib.Config, total_steps: int,
                              mesh: Optional[Mesh] = None, lowered_cache_dir: str = ""
                              ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """`train_state_shapes` with each leaf's sharding where `init_train_state` places it (the
  first device; with a mesh, `sharding.state_shardings`): a step lowered for these shapes is the
  program that the initialised state's step runs, so it can compile while the state initialises
  (`k3jax.train`)."""
  _, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps,
                                                                 lowered_cache_dir)
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
                     lowered_cache_dir: str = ""
                     ) -> tuple[TrainState, optax.GradientTransformation, optax.Schedule]:
  """Fresh state (params, optimizer state, balance biases, rng) and the optimizer.

  One compiled computation builds the whole state. With a mesh it is compiled with the state's
  shardings (`sharding.state_shardings`) as out_shardings: each device computes only its own
  shard of the parameters and moments (the routed experts of its expert group), so no device
  ever holds the whole model; the values equal the single-device ones (threefry keys are
  partitionable). The placed shardings are `jax.tree.map(lambda x: x.sharding, state)`.
  lowered_cache_dir: as for `make_train_step` (non-empty: the lowered computation is kept there).
  """
  init_rng, abstract_vars, optimizer, schedule, assemble = _state_parts(cfg, total_steps,
                                                                        lowered_cache_dir)
  seq_len = cfg.stages.stages[0][0]
  build = lambda rng: assemble(init_variables(cfg.model, rng, 1, seq_len))
  def cached(fun, **jit_kwargs):
    return lowered_cache.cached_jit(fun, cache_dir=lowered_cache_dir, **jit_kwargs,
                                    description=f"init_train_state {cfg!r} {total_steps}")

  if mesh is None:
    # On GPU, JAX lowers each threefry call to its unrolled rounds, one copy per parameter: for
    # small.gin on an H200 that made the initialisation's compile ~50 s (most of it XLA's fusion
    # pass). As one GPU kernel per call (the same bits) it compiles in seconds. Not with a mesh:
    # the SPMD partitioner cannot split that custom call and would compute every bit everywhere.
    with jax_config.threefry_gpu_kernel_lowering(True):
      state = cached(build)(init_rng)
    # Committed to the device, as every later state is (a step's outputs): the first step then
    # runs the program compiled for committed arguments, not a second one (XLA's compile cache
    # keys programs by their arguments' commitment; `k3jax.precompile` compiles for committed).
    return jax.device_put(state, jax.devices()[0]), optimizer, schedule
  # The state's shapes from the variables' shapes: the model is not traced again for them.
  abstract_state = jax.eval_shape(assemble, abstract_vars)
  shardings = sharding_lib.state_shardings(abstract_state, abstract_vars, mesh)
  return cached(build, out_shardings=shardings)(init_rng), optimizer, schedule
