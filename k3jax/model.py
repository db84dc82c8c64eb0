"""The K3 decoder: KDA/MLA hybrid (3:1), Block AttnRes wiring, SiTU-GLU FFN / Stable LatentMoE, LM head.

Wiring of Block Attention Residuals (spec §3). Sources are the frozen block representations
`blocks = [b_0 = embedding, b_1, ...]` and the running partial sum `partial` of the current block:

    for each layer l:
      if l % attnres_block_size == 0:  blocks.append(partial); partial = None   # freeze
      h = DepthMix(blocks + [partial])          # softmax over depth, zero-initialised query
      partial += Attn(RMSNorm(h))               # KDA or gated MLA
      h = DepthMix(blocks + [partial])
      partial += FFN(RMSNorm(h))                # dense SiTU-GLU or LatentMoE
    h = DepthMix(blocks + [partial]); logits = Head(RMSNorm(h))

The embedding enters as the initial partial, so it becomes b_0 at layer 0. With `attnres=False` the
same code runs a plain PreNorm residual network (x += sublayer(norm(x))).
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.flops import flops_per_token  # noqa: F401
from k3jax.layers import common
from k3jax.layers.attnres import DepthMix
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.layers.moe import LatentMoE


class DecoderLayer(nn.Module):
  """One layer's two sublayers (attention, then FFN/MoE); see the module docstring for the wiring."""
  config: ModelConfig
  layer_index: int

  @nn.compact
  def __call__(self, blocks: list, partial: Optional[jax.Array], segment_ids, mask,
               decode: bool, update_balance: bool):
    # decode and update_balance are positional so that `nn.remat` can mark them static.
    cfg = self.config
    dtype = common.to_dtype(cfg.dtype)
    norm = lambda name: common.RMSNorm(cfg.norm_eps, dtype, common.to_dtype(cfg.param_dtype),
                                       name=name)
    if cfg.layer_kind(self.layer_index) == "mla":
      attn = GatedMLA(cfg, name="mla")
    else:
      attn = KDALayer(cfg, name="kda")
    if cfg.layer_uses_moe(self.layer_index):
      ffn = lambda y: LatentMoE(cfg, name="moe")(y, mask, update_balance=update_balance)
    else:
      ffn = lambda y: SiTUGLU(cfg, hidden_dim=cfg.dense_ffn_dim, name="ffn")(y)

    if cfg.attnres:
      if self.layer_index % cfg.attnres_block_size == 0:
        blocks = blocks + [partial]
        partial = None
      sources = lambda: blocks + ([partial] if partial is not None else [])
      h = DepthMix(cfg, name="attn_mix")(sources())
      out = attn(norm("attn_norm")(h), segment_ids, decode=decode)
      partial = out if partial is None else partial + out
      h = DepthMix(cfg, name="ffn_mix")(sources())
      partial = partial + ffn(norm("ffn_norm")(h))
      return blocks, partial
    # Plain PreNorm residual stream, kept in `partial`.
    x = partial
    x = x + attn(norm("attn_norm")(x), segment_ids, decode=decode)
    x = x + ffn(norm("ffn_norm")(x))
    return blocks, x


class K3Model(nn.Module):
  """The K3 language model.

  __call__(tokens [B,T] int32, segment_ids [B,T] int32 | None, *, decode, update_balance)
    -> logits [B,T,vocab] float32.
  segment_ids: 0 = padding, 1.. = documents within a row (state resets and attention masking).
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False, update_balance: bool = False) -> jax.Array:
    cfg = self.config
    if tokens.ndim != 2:
      raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids must have the shape of tokens {tokens.shape}, "
                       f"got {segment_ids.shape}")
    dtype = common.to_dtype(cfg.dtype)
    param_dtype = common.to_dtype(cfg.param_dtype)
    embedding = common.logical_param(self, "embedding", (cfg.vocab_size, cfg.d_model),
                                     ("vocab", "embed"), common.normal_init(1.0), param_dtype)
    x = jnp.take(embedding, tokens, axis=0).astype(dtype)
    x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
    mask = None if segment_ids is None else segment_ids != 0

    layer_cls = DecoderLayer
    if cfg.remat != "none" and not decode:
      # Argument 0 is the module itself: 5 and 6 are decode and update_balance.
      policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                if cfg.remat == "dots" else None)
      layer_cls = nn.remat(DecoderLayer, static_argnums=(5, 6), policy=policy)
    blocks, partial = [], x
    for i in range(cfg.num_layers):
      blocks, partial = layer_cls(cfg, i, name=f"layer_{i}")(
          blocks, partial, segment_ids, mask, decode, update_balance)
      partial = nn.with_logical_constraint(
          partial, ("activation_batch", "activation_length", "activation_embed"))
    if cfg.attnres:
      h = DepthMix(cfg, name="final_mix")(blocks + [partial])
    else:
      h = partial
    h = common.RMSNorm(cfg.norm_eps, dtype, param_dtype, name="final_norm")(h)
    if cfg.tie_embeddings:
      head = embedding.T
    else:
      head = common.logical_param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  common.normal_init(1.0 / math.sqrt(cfg.d_model)), param_dtype)
    logits = jnp.dot(h.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)


def init_variables(cfg: ModelConfig, rng: jax.Array, batch_size: int = 1, seq_len: int = 8,
                   *, decode: bool = False) -> dict:
  """Initialises the variable collections 'params', 'moe_state', and 'cache' when decode=True.

  For decode, `seq_len` is the maximum length the cache can hold. The values are those of
  `K3Model(cfg).init(rng, tokens)`, but through `lazy_init`: the forward pass is traced, not
  computed, so a jit of this function compiles only the initialisers (for small.gin on an H200,
  compiling `init` with its forward pass took 93 s).
  """
  model = K3Model(cfg)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  collections = ["params", "moe_state"] + (["cache"] if decode else [])
  return dict(model.lazy_init(rng, tokens, decode=decode, mutable=collections))


def _is_routed_expert_leaf(spec) -> bool:
  return isinstance(spec, nn.LogicallyPartitioned) and len(spec.names) > 0 and \
      spec.names[0] == "expert"


def count_params(cfg: ModelConfig) -> tuple[int, int]:
  """(total, active) parameter counts, computed with `jax.eval_shape` (no memory is allocated).

  Total counts every parameter. Active follows the published "A3B"-style convention: the
  non-embedding parameters one token uses, i.e. total minus the input embedding and LM head, minus
  the routed experts a token does not use (each MoE layer activates top_k of moe_num_experts).
  """
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
