"""Stable LatentMoE with SiTU-GLU (or SwiGLU) experts, a sigmoid router and Quantile Balancing (QB).

    scores   s = sigmoid(x W_router)                      fp32, on the full-width x
    choice   top-k of s + b                               b: per-layer fp32 bias, no gradient
    weights  p = s_chosen / Σ s_chosen · routed_scale     from the *unbiased* scores
    z        = x W_down                                   d → ℓ (skipped when moe_latent_dim == 0)
    y        = W_up · RMSNorm(Σ_k p_k E_k(z)) + Shared(x)

(docs/architecture.md §4.) The bias b lives in the 'moe_state' collection and is only changed by the
balancing update; it never receives a gradient.

Balancing methods (`ModelConfig.moe_balance`):
  'quantile'  QB: the bias is recomputed from the scores of the step (`quantile_balance_update`).
  'loss_free' DeepSeek's sign update b += u·sign(mean load − load) (`loss_free_bias_update`).
  'aux_loss'  Switch/GShard auxiliary loss, sown as 'aux_loss' for the trainer to add.
  'none'      no balancing.

QB and loss-free update the bias once per optimizer step: every micro-batch of the step routes
with the step's bias, the layers of a training forward sow statistics of their tokens
(`balance_statistics`), the step pools them over its micro-batches (`pool_balance_statistics`;
over devices, the sums over the sharded batch are global) and computes each layer's new bias from
all of them at once (`balance_update`). The result does not depend on how the step's tokens are
split into micro-batches or over devices.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers import common
from k3jax.layers.ffn import Kernel, SiTUGLUWeights, situ_glu_ffn
from k3jax.ops.chunking import map_position_chunks
from k3jax.ops.kernel_choice import pallas_or_xla
from k3jax.ops.grouped_matmul import default_ragged_dot
from k3jax.ops.moe import qb_margins
from k3jax.ops.moe_ep import qb_bias_from_histogram, qb_histogram, routed_experts_auto

PyTree = Any


def _check_scores_bias(fn: str, scores: jax.Array, bias: jax.Array, top_k: int) -> None:
  if scores.ndim != 2:
    raise ValueError(f"{fn}: scores must be [tokens, experts], got shape {scores.shape}")
  n = scores.shape[1]
  if bias.shape != (n,):
    raise ValueError(f"{fn}: bias must be [experts={n}], got shape {bias.shape}")
  if not (isinstance(top_k, numbers.Integral) and 1 <= top_k < n):
    raise ValueError(f"{fn}: top_k={top_k!r} must be an integer in [1, experts={n})")


def _valid_rows(fn: str, mask: Optional[jax.Array], rows: int) -> jax.Array:
  if mask is None:
    return jnp.ones((rows,), bool)
  if mask.shape != (rows,):
    raise ValueError(f"{fn}: mask must be [tokens={rows}] bool, got shape {mask.shape}")
  return mask.astype(bool)


QB_CUTOFFS = ("token", "per_expert")


def qb_depth(tokens: int, top_k: int, num_experts: int) -> int:
  """How many of each expert's largest margins the exact quantile of `tokens` tokens can read:
  ⌊tokens·k/E⌋ + 2 (ranks ⌊q⌋+1 and ⌊q⌋+2 for any q = m·k/E with m <= tokens), at most `tokens`."""
  return min(tokens, tokens * top_k // num_experts + 2)


def qb_top_margins(scores: jax.Array, bias: jax.Array, top_k: int,
                   mask: Optional[jax.Array] = None, cutoff: str = "token",
                   depth: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
  """The exact QB statistic of a batch: per expert its `depth` largest margins M_ij = s_ij + b_j −
  bar_ij over the valid tokens (steps 1–2 of `quantile_balance_update`).

  Poolable: the `depth` largest of the concatenated statistics of several batches
  (`pool_balance_statistics`) are those of all their tokens at once, so with depth =
  `qb_depth(tokens of all of them, k, E)` the pooled statistic gives their exact quantile.

  Args: as in `quantile_balance_update`, plus depth (static int, default `qb_depth` of this
    batch's rows).
  Returns:
    (top margins fp32 [E, depth] descending, −inf past the valid tokens; number of valid tokens
    int32 []).
  """
  fn = "quantile_balance_update"
  _check_scores_bias(fn, scores, bias, top_k)
  if cutoff not in QB_CUTOFFS:
    raise ValueError(f"{fn}: cutoff={cutoff!r} must be one of {QB_CUTOFFS}")
  rows, n = scores.shape
  depth = qb_depth(rows, top_k, n) if depth is None else depth
  if not (isinstance(depth, numbers.Integral) and depth >= 1):
    raise ValueError(f"{fn}: depth={depth!r} must be a positive integer")
  valid = _valid_rows(fn, mask, rows)
  biased = scores.astype(jnp.float32) + bias.astype(jnp.float32)
  margin = jnp.where(valid[:, None], qb_margins(biased, top_k, cutoff), -jnp.inf)
  top = jax.lax.top_k(margin.T, min(rows, depth))[0]                  # [E, ≤ depth] descending
  if depth > rows:
    top = jnp.pad(top, ((0, 0), (0, depth - rows)), constant_values=-jnp.inf)
  return top, jnp.sum(valid, dtype=jnp.int32)


def qb_thresholds_from_top(top_margins: jax.Array, tokens: jax.Array, top_k: int) -> jax.Array:
  """Step 3 of `quantile_balance_update`: t_j, the (q+1)-th largest margin of expert j (q = m·k/E,
  m = tokens; fractional ranks interpolated), from `qb_top_margins`' statistic (pooled or not).

  top_margins: fp32 [E, D] descending, D >= `qb_depth` of the tokens it holds; tokens: int []
  valid tokens. Returns fp32 [E] (zeros when m = 0).
  """
  num_experts, depth = top_margins.shape
  num_valid = tokens.astype(jnp.float32)
  q = num_valid * top_k / num_experts
  last = jnp.maximum(tokens.astype(jnp.int32) - 1, 0)
  lo = jnp.minimum(jnp.floor(q).astype(jnp.int32), last)  # 0-based rank of the (q+1)-th largest
  hi = jnp.minimum(lo + 1, last)
  frac = q - jnp.floor(q)
  # Read ranks lo and hi by masked sums: indexing the top_k result also makes XLA:CPU fall back to a
  # full sort.
  rank = jnp.arange(depth, dtype=jnp.int32)
  t_lo = jnp.sum(jnp.where(rank == lo, top_margins, 0.0), axis=1)
  t_hi = jnp.sum(jnp.where(rank == hi, top_margins, 0.0), axis=1)
  return jnp.where(num_valid > 0, t_lo + frac * (t_hi - t_lo), 0.0)


def qb_bias_from_top(top_margins: jax.Array, tokens: jax.Array, bias: jax.Array, top_k: int,
                     rate: float = 1.0) -> jax.Array:
  """Step 4 of `quantile_balance_update` from `qb_top_margins`' statistic (pooled or not):
  b ← b − rate·t, centred; unchanged when no token was valid. Returns fp32 [E]."""
  if isinstance(rate, numbers.Real) and not 0.0 < rate <= 1.0:
    raise ValueError(f"quantile_balance_update: rate={rate} must be in (0, 1]")
  b = bias.astype(jnp.float32)
  new_bias = b - rate * qb_thresholds_from_top(top_margins, tokens, top_k)
  new_bias = new_bias - jnp.mean(new_bias)
  return jnp.where(tokens > 0, new_bias, b)


def quantile_balance_update(scores: jax.Array, bias: jax.Array, top_k: int,
                            mask: Optional[jax.Array] = None, rate: float = 1.0,
                            cutoff: str = "token") -> jax.Array:
  """One Quantile-Balancing step: the bias that would give every expert exactly q = m·k/n tokens.

  With b the current bias and m the number of valid tokens:
    1. c_i = the (k+1)-th largest biased score s_i + b (token i's cutoff);
    2. margins M_ij = s_ij + b_j − c_i: expert j is in token i's top-k exactly when M_ij > 0;
    3. t_j = the (q+1)-th largest margin of column j (valid tokens only), q = m·k/n;
    4. b ← b − rate·t_j, then b ← b − mean(b) (a common shift changes no top-k).

  Margins here include the bias. K3 writes M = s − c with the one-shot update b ← −t(s − c);
  both give the same new bias at rate 1 (t(s + b − c) = t(s − c) + b), and this form makes rate < 1
  a plain damping b ← (1 − rate)·b + rate·b_one_shot. With the cutoffs held fixed the new bias lets
  exactly q tokens clear the bar for each expert (ties aside).

  cutoff='per_expert' (k3jax's default, not K3's): for the experts token i does NOT choose, the bar
  is its k-th largest biased score instead of the (k+1)-th, because an outsider must beat the weakest
  chosen expert to get in (beating only the first outsider leaves it outside). The margins then say
  exactly which tokens expert j would win at bias b_j − t with the other biases fixed, and the
  iteration converges much faster (measured: 896 experts, top-16, skewed scores, repeated updates on
  one batch: MaxVio 0.57, 0.15, 0.05, 0.04 vs 0.76, 0.35, 0.29, 0.18 for 'token'; on a stream of
  fresh 4096-token batches, MaxVio of the load summed over steps 10–40: 0.04 vs 0.12). Both have the
  same fixed point (balanced loads) and agree on the margins of chosen experts.

  Non-integer q: t_j is read at the fractional (q+1)-th rank by linear interpolation between the
  (⌊q⌋+1)-th and (⌊q⌋+2)-th largest margins. It equals the exact order statistic whenever q is an
  integer and moves continuously with m in between (no jump as padding changes m by one).

  Masked tokens are set to −inf before the per-column selection, so every shape stays static and the
  mask may be traced. If no token is valid the bias is returned unchanged.

  In training the statistic of steps 1–3 is pooled over an optimizer step's micro-batches and
  devices before step 4 (`qb_top_margins`, `balance_update`); this function is one batch's update.

  Args:
    scores: [tokens, experts] router scores after the sigmoid (cast to fp32).
    bias: [experts] current fp32 bias.
    top_k: experts per token k (static int, 1 <= k < experts).
    mask: optional [tokens] bool, False for padding.
    rate: ρ in (0, 1]; 1 is the one-shot LP-dual update.
    cutoff: 'token' (K3's: one cutoff per token, its (k+1)-th largest biased score) or
      'per_expert' (see above).
  Returns:
    the new bias [experts] fp32, centred (mean zero).
  """
  if isinstance(rate, numbers.Real) and not 0.0 < rate <= 1.0:
    raise ValueError(f"quantile_balance_update: rate={rate} must be in (0, 1]")
  top, tokens = qb_top_margins(scores, bias, top_k, mask, cutoff)
  return qb_bias_from_top(top, tokens, bias, top_k, rate)


def quantile_balance_thresholds(scores: jax.Array, bias: jax.Array, top_k: int,
                                mask: Optional[jax.Array] = None,
                                cutoff: str = "token") -> tuple[jax.Array, jax.Array]:
  """Steps 1–3 of `quantile_balance_update`: the per-expert thresholds t_j.

  Returns (t [experts] fp32, number of valid tokens as an fp32 scalar). Lowering b_j by t_j (others
  fixed, and with cutoff='per_expert') gives expert j exactly q of this batch's tokens, up to a tie
  at the threshold. Arguments as in `quantile_balance_update`.
  """
  top, tokens = qb_top_margins(scores, bias, top_k, mask, cutoff)
  return qb_thresholds_from_top(top, tokens, top_k), tokens.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# The balance statistics of a training step and its once-per-step update

# The collection into which a training forward sows each MoE layer's balance statistics: additive
# (or, for the exact quantile, mergeable) over micro-batches, summed over devices by the sharding.
BALANCE_COLLECTION = "moe_balance"


def balance_statistics(cfg: ModelConfig, scores: jax.Array, bias: jax.Array,
                       valid: Optional[jax.Array], load: jax.Array,
                       micro_batches: int = 1) -> dict:
  """What one batch contributes to its optimizer step's balance update (`balance_update`).

  moe_balance 'quantile' with moe_qb_histogram_bins = n_b > 0:
    {'counts': int32 [E, n_b], 'tokens': int32 []} (`k3jax.ops.moe_ep.qb_histogram`); summed.
  'quantile' with n_b = 0 (exact): {'top_margins': fp32 [E, D], 'tokens': int32 []}
    (`qb_top_margins`, D = `qb_depth` of the whole step: rows · micro_batches tokens); merged by
    keeping the D largest.
  'loss_free': {'load': int32 [E]}, the routed assignments; summed.
  'aux_loss', 'none': {} (no bias update).

  Args:
    cfg: the model config (moe_balance, moe_top_k, moe_qb_cutoff, moe_qb_histogram_bins).
    scores: [tokens, E] router scores (no gradient is taken through them).
    bias: [E] the bias these tokens were routed with (the step's).
    valid: optional [tokens] bool, False for padding.
    load: [E] assignments per expert of the valid tokens (integer-valued).
    micro_batches: the number of equal micro-batches of the optimizer step this batch is one of.
  """
  if cfg.moe_balance == "quantile":
    scores = jax.lax.stop_gradient(scores)
    if cfg.moe_qb_histogram_bins > 0:
      counts, tokens = qb_histogram(scores, bias, cfg.moe_top_k, valid,
                                    bins=cfg.moe_qb_histogram_bins, cutoff=cfg.moe_qb_cutoff)
      return {"counts": counts, "tokens": tokens}
    rows, num_experts = scores.shape
    top, tokens = qb_top_margins(scores, bias, cfg.moe_top_k, valid, cfg.moe_qb_cutoff,
                                 qb_depth(rows * micro_batches, cfg.moe_top_k, num_experts))
    return {"top_margins": top, "tokens": tokens}
  if cfg.moe_balance == "loss_free":
    return {"load": jax.lax.stop_gradient(load).astype(jnp.int32)}
  return {}


def _leaf_name(path) -> str:
  last = path[-1]
  return str(getattr(last, "key", getattr(last, "name", last)))


def empty_balance_statistics(shapes: PyTree) -> PyTree:
  """The pooled statistics of no batch, like `shapes` (a BALANCE_COLLECTION tree of arrays or
  ShapeDtypeStructs): zeros, and −inf for the exact quantile's 'top_margins'."""
  def empty(path, x):
    fill = -jnp.inf if _leaf_name(path) == "top_margins" else 0
    return jnp.full(x.shape, fill, x.dtype)
  return jax.tree_util.tree_map_with_path(empty, shapes)


def pool_balance_statistics(pooled: PyTree, new: PyTree) -> PyTree:
  """Two BALANCE_COLLECTION trees of the same structure → the statistics of all their tokens:
  counts, token counts and loads add (integers: exact in any order); 'top_margins' [..., E, D]
  keep the D largest of both (exact too: the values, not their order of arrival)."""
  def pool(path, a, b):
    if _leaf_name(path) == "top_margins":
      return jax.lax.top_k(jnp.concatenate([a, b], axis=-1), a.shape[-1])[0]
    return a + b
  return jax.tree_util.tree_map_with_path(pool, pooled, new)


def _layer_bias_update(cfg: ModelConfig, bias: jax.Array, stats: dict) -> jax.Array:
  """One layer's new bias [E] from its pooled statistics (`balance_statistics`' layout)."""
  k = cfg.moe_top_k
  if "counts" in stats:
    return qb_bias_from_histogram(stats["counts"], stats["tokens"], bias, k, cfg.moe_qb_rate)
  if "top_margins" in stats:
    return qb_bias_from_top(stats["top_margins"], stats["tokens"], bias, k, cfg.moe_qb_rate)
  if "load" in stats:
    return loss_free_bias_update(stats["load"], bias, cfg.moe_loss_free_rate)
  return bias


def balance_update(cfg: ModelConfig, moe_state: PyTree, stats: PyTree) -> PyTree:
  """The balance state after an optimizer step: each layer's bias recomputed once from the
  statistics pooled over all the step's tokens (`balance_statistics`, `pool_balance_statistics`).

  moe_state: the 'moe_state' collection ({..., 'bias': fp32 [E]}; [G, E] for a layer of the
  decoder's scan); stats: the BALANCE_COLLECTION collection of the step, at the same module paths
  ([G, ...] stacked likewise). Layers without statistics keep their bias.
  """
  def walk(state, layer_stats):
    if not hasattr(state, "items"):
      return state
    if "bias" in state:
      if not layer_stats:
        return state
      bias = state["bias"]
      update = lambda b, s: _layer_bias_update(cfg, b, s)
      for _ in range(bias.ndim - 1):   # stacked layers: one update per leading index
        update = jax.vmap(update)
      return type(state)({**state, "bias": update(bias, dict(layer_stats)).astype(bias.dtype)})
    return type(state)({key: walk(value, layer_stats.get(key, {})) for key, value in state.items()})

  return walk(moe_state, stats)


def loss_free_bias_update(load: jax.Array, bias: jax.Array, rate: float = 1e-3) -> jax.Array:
  """DeepSeek's auxiliary-loss-free update b_j ← b_j + rate·sign(mean load − load_j).

  Args:
    load: [experts] assignments per expert in the batch.
    bias: [experts] current bias.
    rate: the step u (DeepSeek-V3: 1e-3).
  Returns:
    the new bias [experts] fp32.
  """
  if load.ndim != 1 or load.shape != bias.shape:
    raise ValueError(f"loss_free_bias_update: load {load.shape} and bias {bias.shape} must both be "
                     "[experts]")
  load = load.astype(jnp.float32)
  return bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)


def aux_balance_loss(scores: jax.Array, expert_idx: jax.Array, mask: Optional[jax.Array],
                     num_experts: int) -> jax.Array:
  """Switch/GShard load-balancing loss n·Σ_j f_j·P_j over valid tokens.

  f_j = (assignments to j) / (m·k) is the routed fraction (no gradient); P_j is the mean over valid
  tokens of the per-token normalised scores s_ij / Σ_j' s_ij'. It is 1 at perfect balance and up to
  n when everything goes to one expert; the gradient flows through P into the router.

  Args:
    scores: [tokens, experts] non-negative router scores (sigmoid outputs).
    expert_idx: [tokens, k] int chosen experts.
    mask: optional [tokens] bool, False for padding.
    num_experts: n.
  Returns:
    the unscaled loss, fp32 scalar (0 when no token is valid).
  """
  fn = "aux_balance_loss"
  if scores.ndim != 2 or scores.shape[1] != num_experts:
    raise ValueError(f"{fn}: scores must be [tokens, experts={num_experts}], got {scores.shape}")
  if expert_idx.ndim != 2 or expert_idx.shape[0] != scores.shape[0]:
    raise ValueError(f"{fn}: expert_idx must be [tokens={scores.shape[0]}, k], got "
                     f"{expert_idx.shape}")
  rows, k = expert_idx.shape
  valid = _valid_rows(fn, mask, rows).astype(jnp.float32)
  num_valid = jnp.maximum(jnp.sum(valid), 1.0)
  counts = jnp.zeros((num_experts,), jnp.float32).at[expert_idx.reshape(-1)].add(
      jnp.repeat(valid, k))
  frac_routed = jax.lax.stop_gradient(counts / (num_valid * k))
  s = scores.astype(jnp.float32)
  probs = s / (jnp.sum(s, axis=-1, keepdims=True) + 1e-20)
  mean_prob = jnp.sum(probs * valid[:, None], axis=0) / num_valid
  return num_experts * jnp.sum(frac_routed * mean_prob)


def max_violation(load: jax.Array) -> jax.Array:
  """MaxVio = (max_j load_j − mean load) / mean load; fp32 scalar, 0 when the load is all zero."""
  load = load.astype(jnp.float32)
  mean = jnp.mean(load)
  return jnp.where(mean > 0, (jnp.max(load) - mean) / jnp.where(mean > 0, mean, 1.0), 0.0)


class Router(nn.Module):
  """Sigmoid router: top-k on biased scores, weights from the unbiased scores.

  Attributes:
    config: model config (moe_num_experts, moe_top_k, moe_routed_scale, init_std, param_dtype).
  Call: x [..., d] any float dtype, bias [E] fp32 → (scores [..., E] fp32, expert_idx [..., k]
  int32, weights [..., k] fp32 summing to moe_routed_scale). The logits are computed in fp32 at the highest
  matmul precision (no TF32/bf16 passes), since ties and near-ties decide the routing.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    cfg = self.config
    num_experts, k = cfg.moe_num_experts, cfg.moe_top_k
    if bias.shape != (num_experts,):
      raise ValueError(f"Router: bias must be [moe_num_experts={num_experts}], got {bias.shape}")
    kernel = common.logical_param(self, "kernel", (x.shape[-1], num_experts), ("embed", None),
                                  common.normal_init(cfg.init_std),
                                  common.to_dtype(cfg.param_dtype))
    logits = common.dot_in_fp32(x, kernel)
    scores = jax.nn.sigmoid(logits)
    _, expert_idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), k)
    chosen = jnp.take_along_axis(scores, expert_idx, axis=-1)
    weights = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20) * cfg.moe_routed_scale
    return scores, expert_idx.astype(jnp.int32), weights


class _NormScale(nn.Module):
  """The learned scale [width] of an RMSNorm, stored as `<name>/scale` exactly where
  `common.RMSNorm` keeps it (ones at init, logical axis 'norm'); returned raw for `rms_norm`."""
  width: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self) -> jax.Array:
    return common.logical_param(self, "scale", (self.width,), ("norm",), nn.initializers.ones,
                                self.param_dtype)


def _sow_value(module: nn.Module, name: str, value: jax.Array,
               collection: str = "moe_stats") -> None:
  """Sows `value` itself (not a tuple of calls) so that the collection holds plain arrays."""
  module.sow(collection, name, value, init_fn=lambda: None, reduce_fn=lambda _, new: new)


class LatentMoE(nn.Module):
  """Stable LatentMoE: y = W_up · RMSNorm(Σ_k p_k E_k(W_down x)) + Shared(x).

  Attributes:
    config: model config; the moe_* and situ_* fields set the shapes and options.

  Parameters: 'router/kernel' [d, E] ('embed', None); 'down/kernel' [d, ℓ] ('embed', 'latent');
  'w_gate', 'w_up' [E, ℓ, m] ('expert', 'latent', 'mlp'); 'w_out' [E, m, ℓ] ('expert', 'mlp',
  'latent'); 'latent_norm/scale' [ℓ] ('norm',); 'up/kernel' [ℓ, d] ('latent', 'embed'); 'shared/…'
  (a SiTUGLU at width d).
  With moe_latent_dim == 0 there is no down/up projection: the experts run at width d and their
  ℓ axes are named 'embed'. moe_latent_norm applies the RMSNorm to the combined routed output in
  either case (so a plain-MoE baseline sets moe_latent_dim = 0 and moe_latent_norm = False).

  Shared experts: moe_num_shared GLUs of width moe_shared_dim are computed as ONE SiTU-GLU of width
  moe_num_shared·moe_shared_dim. That is the same function (a sum of GLUs with disjoint hidden units
  is a GLU over their concatenation) with fewer, larger matmuls.

  Variables: 'moe_state'/'bias' [E] fp32 (zeros at init), read-only here. Sown into 'moe_stats' on
  apply (not at init): 'load' [E] fp32 (routed assignments of valid tokens, before any capacity
  drop), 'max_vio' scalar, 'aux_loss' scalar (unscaled, only for moe_balance == 'aux_loss'; the
  trainer multiplies by moe_aux_loss_coef) and 'dropped' int32 scalar (only when
  moe_capacity_factor > 0). With update_balance, sown into BALANCE_COLLECTION: this batch's
  `balance_statistics`, from which the training step computes the next bias once per optimizer
  step (`balance_update`).

  Balancing options: moe_balance, moe_qb_cutoff, moe_qb_rate, moe_qb_histogram_bins (> 0: quantile
  from per-expert histograms; 0: exact quantile from each expert's largest margins).

  Sequence chunks (ImplConfig.position_chunk_tokens > 0): the router, the load statistics and the
  balancing statistics run over the whole batch (they need every token; the [B·T, E] scores are
  small), while
  the down projection, dispatch, grouped expert matmuls, combine, latent norm, up projection and
  shared experts run per chunk of positions (`k3jax.ops.chunking.map_position_chunks`), each
  rematerialised in the backward pass. Same values as unchunked.
  """
  config: ModelConfig
  impl: ImplConfig = ImplConfig()   # moe_grouped_matmul, moe_situ_glu, position_chunk_tokens

  @nn.compact
  def __call__(self, x: jax.Array, mask: Optional[jax.Array] = None, *,
               update_balance: int = False) -> jax.Array:
    """x [B, T, d] → y [B, T, d] in config.dtype.

    Args:
      x: [B, T, d] activations.
      mask: optional [B, T] bool, False at padding (not computed by the routed experts, left out of
        the load and the balancing statistics).
      update_balance: False (evaluation, decoding), or this batch feeds a training step's balance
        update: True when it is the whole step, else the number n >= 1 of equal micro-batches of the
        step that it is one of (the exact quantile's statistic is sized for the pooled step). Sows
        `balance_statistics` into BALANCE_COLLECTION when that collection is mutable (nothing for
        'aux_loss'/'none'); the bias itself is never written here.
    """
    cfg = self.config
    if x.ndim != 3:
      raise ValueError(f"LatentMoE: x must be [B, T, d], got shape {x.shape}")
    batch, length, width = x.shape
    if mask is not None and mask.shape != (batch, length):
      raise ValueError(f"LatentMoE: mask must be [B={batch}, T={length}] bool, got {mask.shape}")
    if not (isinstance(update_balance, numbers.Integral) and update_balance >= 0):
      raise ValueError(f"LatentMoE: update_balance={update_balance!r} must be a bool or a number "
                       "of micro-batches >= 1")
    num_experts, k = cfg.moe_num_experts, cfg.moe_top_k
    if num_experts <= 0:
      raise ValueError(f"LatentMoE: moe_num_experts={num_experts} must be > 0")
    dtype = common.to_dtype(cfg.dtype)
    param_dtype = common.to_dtype(cfg.param_dtype)
    init = common.normal_init(cfg.init_std)
    tokens = batch * length
    valid = None if mask is None else mask.reshape(tokens).astype(bool)

    bias_var = self.variable("moe_state", "bias", lambda: jnp.zeros((num_experts,), jnp.float32))
    bias = bias_var.value
    scores, expert_idx, weights = Router(cfg, name="router")(x, bias)
    scores = scores.reshape(tokens, num_experts)
    expert_idx = expert_idx.reshape(tokens, k)
    weights = weights.reshape(tokens, k)

    # Every weight is declared here, outside the chunk loop (flax modules cannot be called inside
    # a lax.map); `routed_and_shared` is then a pure function of a chunk of positions.
    kernel_kw = dict(init_std=cfg.init_std, param_dtype=param_dtype)
    if cfg.moe_latent_dim > 0:
      w_down = Kernel((width, cfg.moe_latent_dim), ("embed", "latent"), **kernel_kw,
                      name="down")()
      latent_axis = "latent"
    else:
      latent_axis = "embed"
    latent = cfg.moe_latent_dim if cfg.moe_latent_dim > 0 else width
    hidden = cfg.moe_expert_dim
    w_gate = common.logical_param(self, "w_gate", (num_experts, latent, hidden),
                                  ("expert", latent_axis, "mlp"), init, param_dtype)
    w_up = common.logical_param(self, "w_up", (num_experts, latent, hidden),
                                ("expert", latent_axis, "mlp"), init, param_dtype)
    w_out = common.logical_param(self, "w_out", (num_experts, hidden, latent),
                                 ("expert", "mlp", latent_axis), init, param_dtype)
    if cfg.moe_latent_norm:
      norm_scale = _NormScale(latent, param_dtype, name="latent_norm")()
    if cfg.moe_latent_dim > 0:
      w_lift = Kernel((latent, width), ("latent", "embed"), **kernel_kw, name="up")()
    if cfg.moe_num_shared > 0:
      shared = SiTUGLUWeights(cfg, cfg.moe_num_shared * cfg.moe_shared_dim, name="shared")(width)
    ragged_dot_fn = default_ragged_dot(self.impl.moe_grouped_matmul)
    activation = pallas_or_xla(self.impl.moe_situ_glu, "ImplConfig.moe_situ_glu")
    beta1, beta2 = cfg.glu_bounds()

    def routed_and_shared(x_c, valid_c, idx_c, weight_c):
      """[b, c, d] positions with their [b, c] validity and [b, c, k] routing -> ([b, c, d] in
      dtype, {'load': [E] fp32, 'dropped': int32 []} of these positions)."""
      b, c = x_c.shape[:2]
      n = b * c
      z = x_c.reshape(n, width).astype(dtype)
      if cfg.moe_latent_dim > 0:
        z = jnp.dot(z, w_down.astype(dtype))
      # Expert-parallel (all-to-all) when the active mesh has an expert axis > 1, else local.
      routed, stats = routed_experts_auto(
          z, idx_c.reshape(n, k), weight_c.reshape(n, k), w_gate, w_up, w_out,
          beta1=beta1, beta2=beta2, capacity_factor=cfg.moe_capacity_factor,
          valid=valid_c.reshape(n), ragged_dot_fn=ragged_dot_fn, activation=activation)
      if cfg.moe_latent_norm:
        routed = common.rms_norm(routed, cfg.norm_eps, norm_scale).astype(dtype)
      if cfg.moe_latent_dim > 0:
        routed = jnp.dot(routed.astype(dtype), w_lift.astype(dtype))
      y_c = routed.reshape(b, c, width).astype(dtype)
      if cfg.moe_num_shared > 0:
        y_c = y_c + situ_glu_ffn(x_c, *shared, dtype=dtype, beta1=beta1, beta2=beta2)
      return y_c, {"load": stats["load"], "dropped": stats["dropped"]}

    valid_bt = (jnp.ones((batch, length), bool) if valid is None
                else valid.reshape(batch, length))
    y, stats = map_position_chunks(
        routed_and_shared, [x, valid_bt, expert_idx.reshape(batch, length, k),
                            weights.reshape(batch, length, k)], self.impl.position_chunk_tokens)

    if not self.is_initializing():
      load = stats["load"]
      _sow_value(self, "load", load)
      _sow_value(self, "max_vio", max_violation(load))
      if cfg.moe_balance == "aux_loss":
        _sow_value(self, "aux_loss", aux_balance_loss(scores, expert_idx, valid, num_experts))
      if cfg.moe_capacity_factor > 0:
        _sow_value(self, "dropped", stats["dropped"])
      if update_balance:
        balance = balance_statistics(cfg, scores, bias, valid, load, int(update_balance))
        for name, value in balance.items():
          _sow_value(self, name, value, BALANCE_COLLECTION)
    return y
