"""The training step, `(state, batch) -> (state, metrics)`: `make_train_step`.

    loss   = mean token cross-entropy over the loss mask (fp32 logits)
             + moe_aux_loss_coef · Σ_layers aux_loss            (ModelConfig.moe_balance 'aux_loss')
    grads  = ∇ loss, summed over the step's micro-batches with token weights
             (`k3jax.training.accumulate`; one micro-batch: the plain gradient)
    params = optimizer update (AdamW or Muon, clipped; `k3jax.training.optim`), then QK-Clip of the
             MLA weights from the sown per-head max logits (OptimizerConfig.qk_clip_tau > 0)
    balance biases ('moe_state') = recomputed once from the balance statistics of all the step's
             tokens (every micro-batch routes with the step's biases; `k3jax.layers.moe.
             balance_update`), kept every ModelConfig.moe_qb_interval steps. With
             ModelConfig.moe_qb_cadence = 'microbatch', QB instead updates after each
             micro-batch from its own statistics, the next one routes with that bias and the step
             keeps the last

The loop that drives it over the stages is `k3jax.training.loop`; the state and its
initialisation `k3jax.training.state`. How the step is compiled and run (one program, or a host
loop of programs) is the runtime's (`k3jax.runtime.Runtime.train_step`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from k3jax import config as config_lib
from k3jax.layers import moe as moe_layers
from k3jax.model import K3Model, is_scanned_path
from k3jax.model.stats import moe_stats_by_layer
from k3jax.runtime import Runtime
from k3jax.training import accumulate
from k3jax.training import optim
from k3jax.training.accumulate import QK_STATS_COLLECTION
from k3jax.training.loss import chunked_cross_entropy, token_cross_entropy
from k3jax.training.state import TrainState

PyTree = Any


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
                    schedule: optax.Schedule, runtime: Optional[Runtime] = None, *,
                    state_shardings: Any = None, batch_shardings: Any = None,
                    total_steps: Optional[int] = None) -> Callable:
  """The jitted training step `(state, batch) -> (state, metrics)` (the module docstring's math).

  model: `K3Model(cfg.model, impl)` with the stage's ImplConfig. The model runs with
    update_balance (the number of micro-batches of the step): its MoE layers sow their balance
    statistics, which the step pools and turns into new biases, kept when
    step % moe_qb_interval == 0.
  runtime: compiles and runs the step (`Runtime.train_step`; default `Runtime(cfg.runtime)`).
  state_shardings / batch_shardings: passed to jax.jit as in/out shardings when given (the hook for
    `k3jax.parallel.sharding`); None leaves placement to JAX (single device).
  total_steps: the one given to `k3jax.training.state.init_train_state` for `optimizer` and
    `schedule` (the schedule's constants are part of the program, hence of the runtime's
    lowered-program cache key).

  Batch: {'inputs', 'targets', 'segment_ids'} int32 [B, T] and 'loss_mask' fp32 [B, T]. Metrics:
  'loss' (the cross-entropy), 'total_loss', 'aux_loss', 'grad_norm', 'lr' fp32 scalars and the
  sown 'moe_stats' of the step.
  """
  runtime = Runtime(cfg.runtime) if runtime is None else runtime
  mcfg = cfg.model
  use_aux = mcfg.moe_balance == "aux_loss"
  qk_tau = cfg.optimizer.qk_clip_tau
  chunk_tokens = model.impl.position_chunk_tokens
  mutable = (["moe_stats", moe_layers.BALANCE_COLLECTION]
             + ([QK_STATS_COLLECTION] if qk_tau > 0 else []))
  chained = mcfg.moe_balance == "quantile" and mcfg.moe_qb_cadence == "microbatch"

  def loss_fn(params, moe_state, batch, num_micro: int = 1):
    """(total loss, (cross-entropy, aux loss, the mutated collections)) of `batch`, one of the
    `num_micro` equal micro-batches of a step (which sizes the exact QB statistic)."""
    variables = {"params": params, "moe_state": moe_state}
    # A chained update reads this micro-batch's statistics alone.
    update_balance = 1 if chained else num_micro
    if chunk_tokens > 0:
      # The head and the loss over chunks of positions: no [B, T, vocab] logits.
      (h, head), mutated = model.apply(variables, batch["inputs"], batch["segment_ids"],
                                       update_balance=update_balance, return_hidden=True,
                                       mutable=mutable)
      ce_sum, n = chunked_cross_entropy(h, head, batch["targets"], batch["loss_mask"],
                                        chunk_tokens)
    else:
      logits, mutated = model.apply(variables, batch["inputs"], batch["segment_ids"],
                                    update_balance=update_balance, mutable=mutable)
      ce_sum, n = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    ce = ce_sum / jnp.maximum(n, 1.0)
    if chained:
      # This micro-batch's own update, which the accumulation hands to the next micro-batch.
      mutated = dict(mutated)
      mutated["moe_state"] = moe_layers.balance_update(
          mcfg, moe_state, mutated.pop(moe_layers.BALANCE_COLLECTION, {}))
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
    num_micro = rows // per_micro
    return accumulate.accumulate_scan(functools.partial(loss_fn, num_micro=num_micro), params,
                                      moe_state, batch, num_micro)

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
    if chained:
      new_moe = mutated["moe_state"]
    else:
      new_moe = moe_layers.balance_update(mcfg, state.moe_state,
                                          mutated.get(moe_layers.BALANCE_COLLECTION, {}))
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

  if runtime.lowered_cache_dir and total_steps is None:
    raise ValueError("make_train_step: a runtime with a lowered-program cache needs total_steps "
                     "(the one given to init_train_state)")
  return runtime.train_step(
      train_step, loss_fn=loss_fn, apply_update=apply_update, accumulate=accumulate,
      microbatch_rows=cfg.stages.microbatch_rows, state_shardings=state_shardings,
      batch_shardings=batch_shardings,
      description=f"make_train_step {cfg!r} {model!r} total_steps={total_steps}")
