"""The K3 decoder: KDA/MLA hybrid (3:1), Block AttnRes wiring, SiTU-GLU FFN / Stable LatentMoE, LM head.

Wiring of Block Attention Residuals (docs/architecture.md). Sources are the frozen block
representations `blocks = [b_0 = embedding, b_1, ...]` and the running partial sum `partial` of the
current block:

    for each layer l:
      if l % attnres_block_size == 0:  blocks.append(partial); partial = None   # freeze
      h = DepthMix(blocks + [partial])          # softmax over depth, zero-initialised query
      partial += Attn(RMSNorm(h))               # KDA or gated MLA
      h = DepthMix(blocks + [partial])
      partial += FFN(RMSNorm(h))                # dense SiTU-GLU or LatentMoE
    h = DepthMix(blocks + [partial]); logits = Head(RMSNorm(h))

The embedding enters as the initial partial, so it becomes b_0 at layer 0. With `attnres=False` the
same code runs a plain PreNorm residual network (x += sublayer(norm(x))).

Scanned layers (ImplConfig.scan_layers; `k3jax.model.layer_plan`): the repeated middle of the
decoder runs as one `nn.scan` over groups of layers, its variables stacked on a leading axis
(`k3jax.model.layout`).

Inside the scan the AttnRes blocks frozen by earlier groups sit in a fixed-size stack
[groups·boundaries_per_group, B, T, d] (the scan's carry, with a count of written slots); DepthMix
masks the unwritten slots. Blocks frozen before the scan are a loop-invariant input. Costs against
the loop: every DepthMix inside the scan mixes over all slots (unwritten ones masked), i.e.
O(max_blocks·B·T·d) per mix instead of O(blocks so far·B·T·d); and the backward pass keeps the
stack once per group (the carry of each scan step) instead of each block once, i.e. groups ×
in-scan slots [B, T, d] arrays instead of the in-scan slots.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers import common
from k3jax.layers.attnres import DepthMix
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.layers.moe import LatentMoE
from k3jax.layers.remat import OrderedRemat
from k3jax.model.layer_plan import LayerPlan, layer_plan

# Logical name of the stacked (per-group) axis of scanned variables; replicated by the rule table.
LAYERS_AXIS = "layers"
_ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")


class Blocks(NamedTuple):
  """AttnRes's frozen blocks b_0, b_1, ..., in the order they were frozen.

  frozen: [B,T,d] arrays frozen before the scan (loop-invariant inside it).
  stack: [S,B,T,d] slots written by earlier scan steps, or None outside the scan.
  count: int32 [], the written slots of `stack` (slots 0..count-1), or None.
  recent: [B,T,d] arrays frozen since (in this scan step, or anywhere when unrolled).
  """
  frozen: tuple = ()
  stack: Optional[jax.Array] = None
  count: Optional[jax.Array] = None
  recent: tuple = ()

  def append(self, block: jax.Array) -> "Blocks":
    return self._replace(recent=self.recent + (block,))

  def sources(self, partial: Optional[jax.Array]) -> tuple[list, Optional[jax.Array]]:
    """(DepthMix sources in freezing order, then partial if any; [S] bool valid mask or None)."""
    stacked = [] if self.stack is None else [self.stack[i] for i in range(self.stack.shape[0])]
    tail = list(self.recent) + ([] if partial is None else [partial])
    sources = list(self.frozen) + stacked + tail
    if self.stack is None:
      return sources, None
    valid = jnp.concatenate([jnp.ones((len(self.frozen),), bool),
                             jnp.arange(len(stacked)) < self.count, jnp.ones((len(tail),), bool)])
    return sources, valid

  def all_frozen(self) -> tuple:
    """Every block as a tuple (outside the scan, where all stack slots are written)."""
    stacked = () if self.stack is None else tuple(self.stack[i] for i in range(self.stack.shape[0]))
    return self.frozen + stacked + self.recent


class DecoderLayer(nn.Module):
  """One layer's two sublayers (attention, then FFN/MoE); see the module docstring for the wiring.

  `layer_index` decides the layer's kind, dense/MoE and AttnRes boundary; inside the scan it is the
  index of the layer in the first group (the same decisions hold for every group).
  """
  config: ModelConfig
  impl: ImplConfig
  layer_index: int

  @nn.compact
  def __call__(self, blocks: Blocks, partial: Optional[jax.Array], segment_ids, mask,
               decode: bool, update_balance: int):
    # decode and update_balance are positional so that the remat transforms can mark them static.
    cfg, impl = self.config, self.impl
    dtype = common.to_dtype(cfg.dtype)
    norm = lambda name: common.RMSNorm(cfg.norm_eps, dtype, common.to_dtype(cfg.param_dtype),
                                       impl.norm_kernel, name=name)
    if cfg.layer_kind(self.layer_index) == "mla":
      attn = GatedMLA(cfg, impl, name="mla")
    else:
      attn = KDALayer(cfg, impl, name="kda")
    if cfg.layer_uses_moe(self.layer_index):
      ffn = lambda y: LatentMoE(cfg, impl, name="moe")(y, mask, update_balance=update_balance)
    else:
      ffn = lambda y: SiTUGLU(cfg, hidden_dim=cfg.dense_ffn_dim,
                              chunk_tokens=impl.position_chunk_tokens, name="ffn")(y)

    if cfg.attnres:
      if self.layer_index % cfg.attnres_block_size == 0:
        blocks = blocks.append(partial)
        partial = None
      h = DepthMix(cfg, impl, name="attn_mix")(*blocks.sources(partial))
      out = attn(norm("attn_norm")(h), segment_ids, decode=decode)
      partial = out if partial is None else partial + out
      h = DepthMix(cfg, impl, name="ffn_mix")(*blocks.sources(partial))
      partial = partial + ffn(norm("ffn_norm")(h))
      return blocks, partial
    # Plain PreNorm residual stream, kept in `partial`.
    x = partial
    x = x + attn(norm("attn_norm")(x), segment_ids, decode=decode)
    x = x + ffn(norm("ffn_norm")(x))
    return blocks, x


def _layer_class(impl: ImplConfig, decode: bool):
  """DecoderLayer, rematerialised per ImplConfig.remat when training: 'full' through
  `OrderedRemat` (the recomputation waits for the output's gradient, so the layers of a scanned
  group are recomputed one at a time), 'dots' through `nn.remat` with its saving policy."""
  if impl.remat == "none" or decode:
    return DecoderLayer
  # Argument 0 is the module itself: 5 and 6 are decode and update_balance.
  if impl.remat == "full":
    return OrderedRemat(DecoderLayer, static_argnums=(5, 6))
  return nn.remat(DecoderLayer, static_argnums=(5, 6),
                  policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


class DecoderGroup(nn.Module):
  """One period of layers: the body of the decoder's scan.

  Call: carry (stack [S,B,T,d] | None, count int32 [] | None, partial [B,T,d]), frozen (tuple of
  [B,T,d], blocks frozen before the scan), segment_ids, mask -> (carry, None). The blocks this
  group freezes are written into the stack at its end, so every layer of the group reads the
  stack it received (one copy of it per scan step is what the backward pass keeps).
  """
  config: ModelConfig
  impl: ImplConfig
  plan: LayerPlan
  decode: bool
  update_balance: int

  @nn.compact
  def __call__(self, carry, frozen, segment_ids, mask):
    cfg = self.config
    stack, count, partial = carry
    blocks = Blocks(frozen=tuple(frozen), stack=stack, count=count)
    layer_cls = _layer_class(self.impl, self.decode)
    for i in self.plan.group_layers:
      blocks, partial = layer_cls(cfg, self.impl, i, name=f"layer_{i}")(
          blocks, partial, segment_ids, mask, self.decode, self.update_balance)
      partial = nn.with_logical_constraint(partial, _ACTIVATION_AXES)
    if blocks.recent:
      new = jnp.stack(blocks.recent).astype(stack.dtype)
      stack = jax.lax.dynamic_update_slice_in_dim(stack, new, count, axis=0)
      count = count + len(blocks.recent)
    return (stack, count, partial), None


class K3Model(nn.Module):
  """The K3 language model.

  config: what it computes (its parameters follow from it); impl: how (kernels, remat, the scan
  over layers: ImplConfig's defaults pick the fastest kernels of the backend).
  __call__(tokens [B,T] int32, segment_ids [B,T] int32 | None, *, decode, update_balance,
           return_hidden) -> logits [B,T,vocab] float32.
  return_hidden=True returns (h [B,T,d] in config.dtype, head [d,vocab] in param_dtype) instead:
  the final normed hidden states and the LM head, logits = h @ head in fp32, for a loss that never
  holds [B,T,vocab] logits (`k3jax.training.loss.chunked_cross_entropy`).
  segment_ids: 0 = padding, 1.. = documents within a row (state resets and attention masking).
  update_balance: False, or a training forward whose MoE layers sow their balance statistics
  (`k3jax.layers.moe.balance_statistics`): True when the batch is the whole optimizer step, else
  the number of equal micro-batches of the step it is one of (`LatentMoE`).
  """
  config: ModelConfig
  impl: ImplConfig = ImplConfig()

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False, update_balance: int = False, return_hidden: bool = False):
    cfg, impl = self.config, self.impl
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
    x = nn.with_logical_constraint(x, _ACTIVATION_AXES)
    mask = None if segment_ids is None else segment_ids != 0

    plan = layer_plan(cfg, impl.scan_layers)
    layer_cls = _layer_class(impl, decode)

    def unrolled(indices, blocks, partial):
      for i in indices:
        blocks, partial = layer_cls(cfg, impl, i, name=f"layer_{i}")(
            blocks, partial, segment_ids, mask, decode, update_balance)
        partial = nn.with_logical_constraint(partial, _ACTIVATION_AXES)
      return blocks, partial

    blocks, partial = unrolled(plan.prefix, Blocks(), x)
    if plan.num_groups:
      frozen = blocks.all_frozen()
      stack = count = None
      if cfg.attnres:
        per_group = sum(1 for i in plan.group_layers if i % cfg.attnres_block_size == 0)
        stack = jnp.zeros((plan.num_groups * per_group,) + x.shape, dtype)
        stack = nn.with_logical_constraint(stack, (None,) + _ACTIVATION_AXES)
        count = jnp.zeros((), jnp.int32)
      scan = nn.scan(DecoderGroup, variable_axes={True: 0}, split_rngs={"params": True},
                     in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=plan.num_groups,
                     metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
      (stack, _, partial), _ = scan(cfg, impl, plan, decode, update_balance, name=plan.scan_name)(
          (stack, count, partial), frozen, segment_ids, mask)
      blocks = Blocks(frozen=Blocks(frozen=frozen, stack=stack).all_frozen())
    blocks, partial = unrolled(plan.suffix, blocks, partial)
    if cfg.attnres:
      h = DepthMix(cfg, impl, name="final_mix")(*blocks.sources(partial))
    else:
      h = partial
    h = common.RMSNorm(cfg.norm_eps, dtype, param_dtype, impl.norm_kernel, name="final_norm")(h)
    if cfg.tie_embeddings:
      head = embedding.T
    else:
      head = common.logical_param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  common.normal_init(1.0 / math.sqrt(cfg.d_model)), param_dtype)
    if return_hidden:
      return h.astype(dtype), head
    logits = jnp.dot(h.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)
