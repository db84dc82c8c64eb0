"""The decoder's variables: their initialisation, and the parameter counts."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import Config, ImplConfig, ModelConfig
from k3jax.model.decoder import LAYERS_AXIS, K3Model


def init_variables(cfg: ModelConfig, rng: jax.Array, batch_size: int = 1, seq_len: int = 8,
                   *, impl: ImplConfig = ImplConfig(), decode: bool = False) -> dict:
  """Initialises the variable collections 'params', 'moe_state', and 'cache' when decode=True.

  For decode, `seq_len` is the maximum length the cache can hold. The values are those of
  `K3Model(cfg, impl).init(rng, tokens)` (impl.scan_layers decides the layout), but through
  `lazy_init`: the forward pass is traced, not computed, so a jit of this function compiles only
  the initialisers (for small.gin on an H200, compiling `init` with its forward pass took 93 s).
  """
  model = K3Model(cfg, impl)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  # Training rows carry segment ids; an attention_impl that requires them ('tokamax_mosaic_bwd')
  # must see them when the forward pass is traced here too.
  segment_ids = None if decode else tokens
  collections = ["params", "moe_state"] + (["cache"] if decode else [])
  return dict(model.lazy_init(rng, tokens, segment_ids, decode=decode, mutable=collections))


def _is_routed_expert_leaf(spec) -> bool:
  """A routed expert's weight: its first logical name (after a scan's 'layers') is 'expert'."""
  if not isinstance(spec, nn.LogicallyPartitioned):
    return False
  names = [n for n in spec.names if n != LAYERS_AXIS]
  return len(names) > 0 and names[0] == "expert"


def count_params(cfg: ModelConfig | Config) -> tuple[int, int]:
  """(total, active) parameter counts, computed with `jax.eval_shape` (no memory is allocated).

  cfg: a `ModelConfig`, or the run's `Config` (`config.from_gin`), whose `model` is used.
  Total counts every parameter. Active follows the published "A3B"-style convention: the
  non-embedding parameters one token uses, i.e. total minus the input embedding and LM head, minus
  the routed experts a token does not use (each MoE layer activates top_k of moe_num_experts).
  """
  if isinstance(cfg, Config):
    cfg = cfg.model
  if not isinstance(cfg, ModelConfig):
    raise TypeError("count_params: cfg must be a ModelConfig or a Config, got "
                    f"{type(cfg).__name__}")
  shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), 1, 1))["params"]
  total, routed, embeddings = 0, 0, 0
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_box)[0]:
    value = leaf.value if is_box(leaf) else leaf
    n = math.prod(value.shape)
    total += n
    if _is_routed_expert_leaf(leaf):
      routed += n
    if jax.tree_util.keystr(path) in ("['embedding']", "['lm_head']"):
      embeddings += n
  inactive = routed * (1.0 - cfg.moe_top_k / cfg.moe_num_experts) if cfg.moe_num_experts else 0
  return total, int(round(total - embeddings - inactive))
