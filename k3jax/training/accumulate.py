"""Gradient accumulation over the micro-batches of a training step (StagesConfig.microbatch_tokens).

A step of B rows with n micro-batches (n = B // `StagesConfig.microbatch_rows`):
  * micro-batch i holds rows i, i + n, i + 2n, ..., so that with the batch sharded over devices in
    contiguous blocks every micro-batch spreads over all of them (and stays where it is);
  * each micro-batch's loss is weighted by its share w_i of the step's loss-mask tokens: the
    cross-entropy and its gradient are exactly those of the whole batch at once; aux losses are
    weighted the same way;
  * the balance statistics that the MoE layers sow (`k3jax.layers.moe.BALANCE_COLLECTION`) are
    pooled over the micro-batches (`pool_balance_statistics`: integer sums, or the exact
    quantile's merge), so the step's one bias update (`k3jax.layers.moe.balance_update`, in the
    step's update) sees all of its tokens as if they came in one batch; every micro-batch routes
    with the step's balance state, unless `loss_fn` writes a new one ('moe_state' among its mutated
    collections: ModelConfig.moe_qb_cadence = 'microbatch'), which the next micro-batch routes
    with and the step ends with;
  * 'moe_stats' loads and drop counts are summed and MaxVio recomputed from the summed loads;
    QK-Clip's per-head max logits are the max over micro-batches.

Two ways to run them (RuntimeConfig.microbatch_loop), with the same arithmetic (this module's
`add_microbatch` and `finish`), so they agree up to the rounding of XLA's different fusions:
  'scan'  `accumulate_scan`: a `lax.scan` inside the step's single program;
  'host'  `k3jax.runtime.host_loop.HostLoopStep`: a Python loop over jitted programs, one per
          micro-batch, then the update (docs/startup.md says why it exists).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from k3jax.layers import moe as moe_layers

PyTree = Any
# The collection in which MLA layers sow per-head max attention logits for QK-Clip: leaves named
# 'max_logits', shape [mla_num_heads] fp32, at the MLA module's path (e.g. layer_3/mla/max_logits).
QK_STATS_COLLECTION = "attn_stats"
# loss_fn(params, moe_state, batch) -> (total, (ce, aux, mutated collections)); the mutated
# collections hold the 'moe_stats', the balance statistics (BALANCE_COLLECTION) and, with QK-Clip,
# the QK_STATS_COLLECTION of `batch`.
LossFn = Callable[[PyTree, PyTree, dict], tuple]
BALANCE_COLLECTION = moe_layers.BALANCE_COLLECTION


def split(batch: dict, num_micro: int) -> dict:
  """[B, ...] arrays -> [num_micro, B // num_micro, ...]; micro-batch i = rows i, i + n, ..."""
  def one(x):
    x = x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(one, batch)


def token_weights(micro: dict) -> jax.Array:
  """[n] fp32: each micro-batch's share of the step's loss-mask tokens (`split`'s output)."""
  weights = jnp.sum(micro["loss_mask"].astype(jnp.float32), axis=(1, 2))
  return weights / jnp.maximum(jnp.sum(weights), 1.0)


def zero_accumulators(loss_fn: LossFn, params: PyTree, moe_state: PyTree, micro_batch: dict,
                      mutated_shape: PyTree = None) -> dict:
  """The running sums before the first micro-batch: {'grads': fp32 zeros like params, 'total',
  'ce', 'aux': fp32 scalars 0, 'stats': zeros like the 'moe_stats' collection, 'balance': the
  pooled balance statistics of no token (`empty_balance_statistics`), 'qk': -inf like the
  QK_STATS_COLLECTION one} (the collections' shapes: `mutated_shape`, the mutated collections'
  shapes of `loss_fn` when the caller traced it already, else an abstract trace)."""
  if mutated_shape is None:
    _, (_, _, mutated_shape) = jax.eval_shape(lambda: loss_fn(params, moe_state, micro_batch))
  zeros_of = lambda tree, fill: jax.tree.map(lambda a: jnp.full(a.shape, fill, a.dtype), tree)
  f32_zero = jnp.zeros([], jnp.float32)
  return {"grads": jax.tree.map(jnp.zeros_like, params), "total": f32_zero, "ce": f32_zero,
          "aux": f32_zero, "stats": zeros_of(mutated_shape.get("moe_stats", {}), 0),
          "balance": moe_layers.empty_balance_statistics(
              mutated_shape.get(BALANCE_COLLECTION, {})),
          "qk": zeros_of(mutated_shape.get(QK_STATS_COLLECTION, {}), -jnp.inf)}


def add_microbatch(loss_fn: LossFn, params: PyTree, moe_state: PyTree, micro_batch: dict,
                   weight: jax.Array, acc: dict) -> tuple[dict, PyTree]:
  """One micro-batch's forward and backward pass added to `acc` (`zero_accumulators`' layout)
  with weight `weight` (fp32 scalar); returns (acc, the balance state `loss_fn` wrote, or
  `moe_state` when it wrote none)."""
  (total, (ce, aux, mutated)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, moe_state, micro_batch)
  w = weight
  acc = {"grads": jax.tree.map(lambda a, g: a + w * g.astype(a.dtype), acc["grads"], grads),
         "total": acc["total"] + w * total, "ce": acc["ce"] + w * ce,
         "aux": acc["aux"] + w * aux,
         "stats": jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc["stats"],
                               mutated.get("moe_stats", {})),
         "balance": moe_layers.pool_balance_statistics(
             acc["balance"], mutated.get(BALANCE_COLLECTION, {})),
         "qk": jax.tree.map(jnp.maximum, acc["qk"], mutated.get(QK_STATS_COLLECTION, {}))}
  return acc, mutated.get("moe_state", moe_state)


def finish(acc: dict, moe_state: PyTree, num_micro: int) -> tuple:
  """The accumulators after the last micro-batch and the balance state it returned ->
  `loss_fn`'s value-and-grad contract for the whole step: ((total, (ce, aux, mutated)), grads),
  mutated holding that balance state, the step's 'moe_stats', its pooled balance statistics and
  QK-Clip's maxima."""
  mutated = {"moe_state": moe_state, "moe_stats": combine_stats(acc["stats"], num_micro),
             BALANCE_COLLECTION: acc["balance"]}
  if acc["qk"]:
    mutated[QK_STATS_COLLECTION] = acc["qk"]
  return (acc["total"], (acc["ce"], acc["aux"], mutated)), acc["grads"]


def combine_stats(summed: PyTree, num_micro: int) -> PyTree:
  """Per-layer stats summed over micro-batches -> those of the whole step: loads and drop counts
  stay sums, aux losses become means, MaxVio is recomputed from the summed load."""
  def fix(layer: dict) -> dict:
    out = dict(layer)
    if "aux_loss" in out:
      out["aux_loss"] = out["aux_loss"] / num_micro
    if "load" in out and "max_vio" in out:
      # A scanned layer's load is [G, E] (one row per group): MaxVio of each row.
      max_vio = jnp.vectorize(moe_layers.max_violation, signature="(e)->()")
      out["max_vio"] = max_vio(out["load"]).astype(layer["max_vio"].dtype)
    return out

  def walk(tree):
    if isinstance(tree, dict) or hasattr(tree, "items"):
      if "load" in tree or "max_vio" in tree or "aux_loss" in tree:
        return fix(tree)
      return {k: walk(v) for k, v in tree.items()}
    return tree

  return walk(summed)


def accumulate_scan(loss_fn: LossFn, params: PyTree, moe_state: PyTree, batch: dict,
                    num_micro: int) -> tuple:
  """Gradient accumulation over `num_micro` micro-batches of `batch` (module docstring) in a
  `lax.scan` (the activations of one micro-batch are alive at a time), with `loss_fn`'s
  value-and-grad contract ((total, (ce, aux, mutated)), grads)."""
  micro = split(batch, num_micro)
  weights = token_weights(micro)
  acc = zero_accumulators(loss_fn, params, moe_state, jax.tree.map(lambda x: x[0], micro))

  def body(carry, xs):
    acc, moe = carry
    mb, w = xs
    return add_microbatch(loss_fn, params, moe, mb, w, acc), None

  (acc, new_moe), _ = jax.lax.scan(body, (acc, moe_state), (micro, weights))
  return finish(acc, new_moe, num_micro)


def one_microbatch(loss_fn: LossFn, params: PyTree, moe_state: PyTree, batch: dict
                   ) -> tuple[dict, PyTree]:
  """A step of a single micro-batch in the accumulators' layout (`zero_accumulators`): that
  micro-batch's own values (nothing to add them to), and the balance state `loss_fn` wrote (or
  `moe_state` when it wrote none). `finish(acc, moe_state, 1)` gives the step's value-and-grad."""
  (total, (ce, aux, mutated)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, moe_state, batch)
  acc = {"grads": grads, "total": total, "ce": ce, "aux": aux,
         "stats": mutated.get("moe_stats", {}), "balance": mutated.get(BALANCE_COLLECTION, {}),
         "qk": mutated.get(QK_STATS_COLLECTION, {})}
  return acc, mutated.get("moe_state", moe_state)
