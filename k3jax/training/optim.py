"""Optimizers: AdamW or per-head Muon, the cosine schedule, the weight-decay mask, and QK-Clip.

`make_optimizer(opt_cfg, total_steps, param_axes)` returns `(optax transformation, lr schedule)`.
The schedule is one cosine over the whole run (all stages), so it carries across stage boundaries
through the optimizer's step count.

Which parameters get what is decided from the parameter path and its logical axis names (the names
given to `common.logical_param`), never from shapes alone:
  * weight decay: matrices only; never 1-D parameters, norm scales, biases or gate parameters
    (`decay_mask`).
  * Muon: matrices that are not the embedding or the LM head (no 'vocab' axis) and not
    convolution taps. Axes named 'heads' or 'expert' are batch axes, so each head / expert block is
    orthogonalised on its own (Per-Head Muon); the remaining two axes are (reduction, output) in
    x @ W order. Everything else goes to AdamW.
  * The decoder's scanned layers (`k3jax.model`) stack their parameters on a leading axis named
    'layers' (path through `scanned_period_{p}`): that axis is a batch axis for Muon and does not
    count as a dimension for the rules above (a stacked norm scale [G, d] is still a vector).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax.config import ModelConfig, OptimizerConfig
from k3jax.model import is_scanned_path

PyTree = Any

# Parameter names (last path component) that never get weight decay, whatever their rank: norm
# scales, biases, the KDA decay-gate parameters and the AttnRes pseudo-queries.
NO_DECAY_NAMES = ("scale", "bias", "A_log", "dt_bias", "query")
# Modules whose parameters are gate parameters (no weight decay, AdamW under Muon): the MoE router.
# (The SiTU-GLU 'gate' projection is an ordinary weight matrix and is decayed.)
NO_DECAY_MODULE_PATTERN = re.compile(r"^router$")
# Logical axis names treated as independent blocks by Muon (orthogonalised one by one).
MUON_BATCH_AXES = ("heads", "expert", "layers")
# Logical axis names whose parameters never go to Muon.
MUON_EXCLUDED_AXES = ("vocab", "conv", "norm")


def path_names(path) -> tuple[str, ...]:
  """Turns a jax tree path into a tuple of plain strings (dict keys / attribute names)."""
  names = []
  for p in path:
    if isinstance(p, jax.tree_util.DictKey):
      names.append(str(p.key))
    elif isinstance(p, jax.tree_util.GetAttrKey):
      names.append(p.name)
    elif isinstance(p, jax.tree_util.SequenceKey):
      names.append(str(p.idx))
    else:
      names.append(str(p))
  return tuple(names)


def unbox(variables: PyTree) -> PyTree:
  """Strips flax `LogicallyPartitioned` boxes, leaving raw arrays."""
  return nn.meta.unbox(variables)


def logical_axes(boxed_params: PyTree) -> PyTree:
  """Tree (like params) of tuples of logical axis names; None entries for unnamed params/dims."""
  def names(x):
    if isinstance(x, nn.LogicallyPartitioned):
      return tuple(x.names)
    return (None,) * jnp.ndim(x)
  return jax.tree.map(names, boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def lr_schedule(opt_cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup over round(warmup_fraction * total_steps) steps to the peak, then cosine decay
  to end_lr_fraction * peak at step total_steps. The LR used by step s (0-based) is schedule(s)."""
  if total_steps <= 0:
    raise ValueError(f"total_steps must be positive, got {total_steps}")
  warmup_steps = int(round(opt_cfg.warmup_fraction * total_steps))
  peak = opt_cfg.learning_rate
  end = peak * opt_cfg.end_lr_fraction
  if warmup_steps == 0:
    return optax.cosine_decay_schedule(peak, decay_steps=total_steps,
                                       alpha=opt_cfg.end_lr_fraction)
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak,
                                            warmup_steps=warmup_steps,
                                            decay_steps=total_steps, end_value=end)


def _layer_ndim(names: Sequence[str], ndim: int) -> int:
  """The rank of one layer's parameter: without the stacked axis of a scanned layer."""
  return ndim - 1 if is_scanned_path(tuple(names)) else ndim


def _is_no_decay(names: Sequence[str], ndim: int) -> bool:
  """ndim: the array's rank (a scanned layer's stacked axis is discounted here)."""
  if _layer_ndim(names, ndim) < 2:
    return True
  if names and names[-1] in NO_DECAY_NAMES:
    return True
  return any(NO_DECAY_MODULE_PATTERN.search(n) for n in names[:-1])


def decay_mask(params: PyTree) -> PyTree:
  """Tree of bools: True where weight decay applies (matrices that are not norm/bias/gate params)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: not _is_no_decay(path_names(path), jnp.ndim(x)), params)


def muon_dimension_numbers(params: PyTree, axes: PyTree) -> PyTree:
  """Per-leaf `MuonDimensionNumbers` (Muon) or None (AdamW), from logical axis names.

  Args:
    params: the raw parameter tree (arrays or ShapeDtypeStructs).
    axes: a tree like params of tuples of logical axis names (see `logical_axes`).
  A Muon leaf must have exactly two axes that are not batch axes ('heads', 'expert'); the first is
  the reduction (input) axis and the second the output axis.
  """
  def rule(path, x, names):
    names = tuple(names)
    leaf_names = path_names(path)
    if _is_no_decay(leaf_names, jnp.ndim(x)):
      return None
    if any(n in MUON_EXCLUDED_AXES for n in names):
      return None
    matrix_axes = [i for i, n in enumerate(names) if n not in MUON_BATCH_AXES]
    if len(matrix_axes) != 2:
      return None
    return MuonDimensionNumbers(reduction_axis=matrix_axes[0], output_axis=matrix_axes[1])
  return jax.tree_util.tree_map_with_path(
      rule, params, axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(opt_cfg: OptimizerConfig, total_steps: int, param_axes: PyTree
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds the optimizer for `opt_cfg.name` and returns it with its LR schedule.

  Args:
    opt_cfg: the optimizer settings.
    total_steps: steps of the whole run (every stage); the cosine ends there.
    param_axes: tree like the params of logical axis-name tuples (`logical_axes(boxed_params)`);
      used by Muon to find head / expert blocks.
  """
  schedule = lr_schedule(opt_cfg, total_steps)
  adamw = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                      weight_decay=opt_cfg.weight_decay, mask=decay_mask)
  if opt_cfg.name == "adamw":
    core = adamw
  elif opt_cfg.name == "muon":
    core = _muon_with_adamw(opt_cfg, schedule, adamw, param_axes)
  else:
    raise ValueError(f"opt_cfg.name must be 'adamw' or 'muon', got {opt_cfg.name!r}")
  if opt_cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip_norm), core), schedule
  return core, schedule


def _muon_with_adamw(opt_cfg: OptimizerConfig, schedule: optax.Schedule,
                     adamw: optax.GradientTransformation, param_axes: PyTree
                     ) -> optax.GradientTransformation:
  """Muon (optax.contrib.muon, per-head blocks, Moonlight RMS matching) on hidden matrices;
  AdamW (with the decay mask) on embeddings, head, 1-D and gate parameters."""
  def labels(params):
    dims = muon_dimension_numbers(params, param_axes)
    return jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))

  def muon_dims(params):
    # Inside `optax.partition` the AdamW leaves arrive as MaskedNode; keep them MaskedNode here so
    # that the tree structures match.
    def rule(path, x, names):
      if isinstance(x, optax.MaskedNode):
        return optax.MaskedNode()
      return muon_dimension_numbers({"x": x}, {"x": names})["x"]
    return jax.tree_util.tree_map_with_path(
        rule, params, param_axes,
        is_leaf=lambda x: isinstance(x, (tuple, optax.MaskedNode)) and not hasattr(x, "shape"))

  muon = optax.contrib.muon(
      learning_rate=schedule, beta=0.95, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
      muon_weight_dimension_numbers=muon_dims, consistent_rms=0.2)
  return optax.partition({"muon": muon, "adamw": adamw}, labels)


# ------------------------------------------------------------------------------------------------
# QK-Clip (Kimi K2, MuonClip), for the gated MLA layers.
# ------------------------------------------------------------------------------------------------

def qk_clip_factors(max_logits: jax.Array, tau: float) -> jax.Array:
  """gamma_h = min(1, tau / S_max^h) per head. max_logits [H] fp32 -> [H] fp32."""
  s = jnp.asarray(max_logits, jnp.float32)
  return jnp.where(s > tau, tau / jnp.maximum(s, 1e-30), 1.0)


def qk_clip_mla(mla_params: Mapping[str, jax.Array], max_logits: jax.Array, tau: float,
                cfg: ModelConfig) -> dict:
  """QK-Clip for one gated-MLA layer (K2's rule for MLA).

  Heads whose max attention logit S_max^h exceeds tau get gamma_h = tau / S_max^h; that head's
  q^C (nope part of the query up-projection) and k^C (`wk_b`) are scaled by sqrt(gamma_h), its q^R
  (rope part of the query) by gamma_h. The shared k^R (`wk_rope`) is left untouched, so one
  head's clip does not leak to the others. Every logit q_h . k_h of a clipped head is thereby
  scaled by exactly gamma_h.

  Args:
    mla_params: the layer's params (`k3jax.layers.mla.GatedMLA`): the query weight `wq_b`
      [q_lora, H, nope+rope] (or `wq` [d, H, nope+rope] without query compression) and `wk_b`
      [kv_lora, H, nope].
    max_logits: [H] fp32, S_max^h = max over the batch of the scaled logits q_i . k_j / sqrt(dqk).
    tau: the threshold (K2: 100).
    cfg: the model config (head dims).
  Returns a new params dict for the layer.
  """
  nope = cfg.mla_qk_nope_dim
  q_name = "wq_b" if "wq_b" in mla_params else "wq"
  if q_name not in mla_params or "wk_b" not in mla_params:
    raise ValueError(f"MLA params must contain 'wq_b' or 'wq', and 'wk_b'; got "
                     f"{sorted(mla_params)}")
  wq, wk = mla_params[q_name], mla_params["wk_b"]
  if max_logits.shape != (wq.shape[1],):
    raise ValueError(f"max_logits must be [H={wq.shape[1]}], got {max_logits.shape}")
  gamma = qk_clip_factors(max_logits, tau)
  sqrt_gamma = jnp.sqrt(gamma)
  # Per head and query column: sqrt(gamma) on the nope columns, gamma on the rope columns.
  col_is_rope = jnp.arange(wq.shape[2]) >= nope
  q_scale = jnp.where(col_is_rope[None, :], gamma[:, None], sqrt_gamma[:, None])   # [H, dqk]
  new = dict(mla_params)
  new[q_name] = (wq * q_scale[None].astype(wq.dtype)).astype(wq.dtype)
  new["wk_b"] = (wk * sqrt_gamma[None, :, None].astype(wk.dtype)).astype(wk.dtype)
  return new


def apply_qk_clip(params: PyTree, max_logits: Mapping[tuple, jax.Array], tau: float,
                  cfg: ModelConfig) -> PyTree:
  """Applies `qk_clip_mla` to every MLA layer named in `max_logits`.

  Args:
    params: the model's params (nested dicts).
    max_logits: {path of the MLA module inside params (tuple of keys): [H] per-head max logits}.
      A module of the decoder's scan (path through `scanned_period_{p}`) has stacked params and
      [G, H] max logits, one row per group; each group's layer is clipped on its own.
  """
  params = jax.tree.map(lambda x: x, params)  # shallow structural copy of the dicts

  def get(tree, path):
    for k in path:
      tree = tree[k]
    return tree

  for path, s_max in max_logits.items():
    parent = get(params, path[:-1])
    if is_scanned_path(tuple(path)):
      if jnp.ndim(s_max) != 2:
        raise ValueError(f"max_logits of the scanned MLA module {'/'.join(path)} must be [G, H], "
                         f"got {jnp.shape(s_max)}")
      clip = lambda p, s: qk_clip_mla(p, s, tau, cfg)
      parent[path[-1]] = jax.vmap(clip)(parent[path[-1]], s_max)
    else:
      parent[path[-1]] = qk_clip_mla(parent[path[-1]], s_max, tau, cfg)
  return params
