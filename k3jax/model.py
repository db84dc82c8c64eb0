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

Scanned layers (`ModelConfig.scan_layers`, `layer_plan`). The layers repeat with a period of
lcm(mla_every, attnres_block_size): every group of that many layers has the same layer kinds, the
same dense/MoE choice and the same position relative to the AttnRes block boundaries. The decoder
runs the dense first layers (and any layers before the first whole group) unrolled, then one
`nn.scan` over the groups, then the rest unrolled (what is left, the final MLA layer included when
num_layers is not a multiple of mla_every). What is traced and compiled is one group, whatever the
depth. Variables of the scanned layers live under the module `scanned_period_{p}` (p = the period)
as `layer_{i}` for the layers i of the first group, with a leading axis (logical name 'layers') of
one entry per group: entry g of `scanned_period_{p}/layer_{i}` is layer i + g·p of the loop. This
holds for every collection ('params', 'moe_state', the sown 'moe_stats' / 'attn_stats' /
'intermediates', the decode 'cache'). `unrolled_to_scanned` and `scanned_to_unrolled` convert trees
between the two layouts.

Inside the scan the AttnRes blocks frozen by earlier groups sit in a fixed-size stack
[groups·boundaries_per_group, B, T, d] (the scan's carry, with a count of written slots); DepthMix
masks the unwritten slots. Blocks frozen before the scan are a loop-invariant input. Costs against
the loop: every DepthMix inside the scan mixes over all slots (unwritten ones masked), i.e.
O(max_blocks·B·T·d) per mix instead of O(blocks so far·B·T·d); and the backward pass keeps the
stack once per group (the carry of each scan step) instead of each block once, i.e. groups ×
in-scan slots [B, T, d] arrays instead of the in-scan slots.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import Config, ModelConfig
from k3jax.flops import flops_per_token  # noqa: F401
from k3jax.layers import common
from k3jax.layers.attnres import DepthMix
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.layers.moe import LatentMoE
from k3jax.layers.remat import OrderedRemat

# Logical name of the stacked (per-group) axis of scanned variables; replicated by the rule table.
LAYERS_AXIS = "layers"
_SCAN_MODULE = re.compile(r"^scanned_period_(\d+)$")
_LAYER_MODULE = re.compile(r"^layer_(\d+)$")
_ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Which layers run unrolled before the scan, in it, and after it.

  prefix: layer indices run unrolled before the scan (all layers when nothing is scanned).
  start: the first scanned layer; period: layers per group; num_groups: groups (0: no scan).
  suffix: layer indices run unrolled after the scan.
  """
  prefix: tuple[int, ...]
  start: int
  period: int
  num_groups: int
  suffix: tuple[int, ...]

  @property
  def scan_name(self) -> str:
    """The name of the scanned module (it carries the period, see `scanned_to_unrolled`)."""
    return f"scanned_period_{self.period}"

  @property
  def group_layers(self) -> tuple[int, ...]:
    """The layer indices of the first group (their names inside the scanned module)."""
    return tuple(range(self.start, self.start + self.period))

  @property
  def scanned_layers(self) -> tuple[int, ...]:
    return tuple(range(self.start, self.start + self.period * self.num_groups))


def layer_plan(cfg: ModelConfig) -> LayerPlan:
  """The split of `cfg`'s layers into unrolled prefix, scanned groups and unrolled suffix.

  The groups start at the first MoE layer (after the first_k_dense dense ones), hold
  lcm(mla_every, attnres_block_size) layers each (mla_every without AttnRes), and stop before the
  final layer when num_layers is not a multiple of mla_every (that layer is MLA out of pattern).
  Fewer than two groups, or scan_layers=False: everything unrolled.
  """
  n = cfg.num_layers
  unrolled = LayerPlan(prefix=tuple(range(n)), start=n, period=1, num_groups=0, suffix=())
  if not cfg.scan_layers:
    return unrolled
  period = math.lcm(cfg.mla_every, cfg.attnres_block_size) if cfg.attnres else cfg.mla_every
  start = min(cfg.first_k_dense, n) if cfg.moe_num_experts > 0 else 0
  end = n if n % cfg.mla_every == 0 else n - 1
  groups = max(0, (end - start) // period)
  if groups < 2:
    return unrolled
  stop = start + groups * period
  return LayerPlan(prefix=tuple(range(start)), start=start, period=period, num_groups=groups,
                   suffix=tuple(range(stop, n)))


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
  layer_index: int

  @nn.compact
  def __call__(self, blocks: Blocks, partial: Optional[jax.Array], segment_ids, mask,
               decode: bool, update_balance: bool):
    # decode and update_balance are positional so that the remat transforms can mark them static.
    cfg = self.config
    dtype = common.to_dtype(cfg.dtype)
    norm = lambda name: common.RMSNorm(cfg.norm_eps, dtype, common.to_dtype(cfg.param_dtype),
                                       cfg.norm_kernel, name=name)
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
        blocks = blocks.append(partial)
        partial = None
      h = DepthMix(cfg, name="attn_mix")(*blocks.sources(partial))
      out = attn(norm("attn_norm")(h), segment_ids, decode=decode)
      partial = out if partial is None else partial + out
      h = DepthMix(cfg, name="ffn_mix")(*blocks.sources(partial))
      partial = partial + ffn(norm("ffn_norm")(h))
      return blocks, partial
    # Plain PreNorm residual stream, kept in `partial`.
    x = partial
    x = x + attn(norm("attn_norm")(x), segment_ids, decode=decode)
    x = x + ffn(norm("ffn_norm")(x))
    return blocks, x


def _layer_class(cfg: ModelConfig, decode: bool):
  """DecoderLayer, rematerialised per cfg.remat when training: 'full' through `OrderedRemat`
  (the recomputation waits for the output's gradient, so the layers of a scanned group are
  recomputed one at a time), 'dots' through `nn.remat` with its saving policy."""
  if cfg.remat == "none" or decode:
    return DecoderLayer
  # Argument 0 is the module itself: 5 and 6 are decode and update_balance.
  if cfg.remat == "full":
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
  plan: LayerPlan
  decode: bool
  update_balance: bool

  @nn.compact
  def __call__(self, carry, frozen, segment_ids, mask):
    cfg = self.config
    stack, count, partial = carry
    blocks = Blocks(frozen=tuple(frozen), stack=stack, count=count)
    layer_cls = _layer_class(cfg, self.decode)
    for i in self.plan.group_layers:
      blocks, partial = layer_cls(cfg, i, name=f"layer_{i}")(
          blocks, partial, segment_ids, mask, self.decode, self.update_balance)
      partial = nn.with_logical_constraint(partial, _ACTIVATION_AXES)
    if blocks.recent:
      new = jnp.stack(blocks.recent).astype(stack.dtype)
      stack = jax.lax.dynamic_update_slice_in_dim(stack, new, count, axis=0)
      count = count + len(blocks.recent)
    return (stack, count, partial), None


class K3Model(nn.Module):
  """The K3 language model.

  __call__(tokens [B,T] int32, segment_ids [B,T] int32 | None, *, decode, update_balance,
           return_hidden) -> logits [B,T,vocab] float32.
  return_hidden=True returns (h [B,T,d] in config.dtype, head [d,vocab] in param_dtype) instead:
  the final normed hidden states and the LM head, logits = h @ head in fp32, for a loss that never
  holds [B,T,vocab] logits (`k3jax.loss.chunked_cross_entropy`).
  segment_ids: 0 = padding, 1.. = documents within a row (state resets and attention masking).
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False, update_balance: bool = False, return_hidden: bool = False):
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
    x = nn.with_logical_constraint(x, _ACTIVATION_AXES)
    mask = None if segment_ids is None else segment_ids != 0

    plan = layer_plan(cfg)
    layer_cls = _layer_class(cfg, decode)

    def unrolled(indices, blocks, partial):
      for i in indices:
        blocks, partial = layer_cls(cfg, i, name=f"layer_{i}")(
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
      (stack, _, partial), _ = scan(cfg, plan, decode, update_balance, name=plan.scan_name)(
          (stack, count, partial), frozen, segment_ids, mask)
      blocks = Blocks(frozen=Blocks(frozen=frozen, stack=stack).all_frozen())
    blocks, partial = unrolled(plan.suffix, blocks, partial)
    if cfg.attnres:
      h = DepthMix(cfg, name="final_mix")(*blocks.sources(partial))
    else:
      h = partial
    h = common.RMSNorm(cfg.norm_eps, dtype, param_dtype, cfg.norm_kernel, name="final_norm")(h)
    if cfg.tie_embeddings:
      head = embedding.T
    else:
      head = common.logical_param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  common.normal_init(1.0 / math.sqrt(cfg.d_model)), param_dtype)
    if return_hidden:
      return h.astype(dtype), head
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
  # Training rows carry segment ids; an attention_impl that requires them ('tokamax_pallas_bwd',
  # 'tokamax_mosaic_bwd', 'pallas') must see them when the forward pass is traced here too.
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


# ------------------------------------------------------------------------------------------------
# Converting variable trees between the unrolled (per-layer) and the scanned (stacked) layouts
# ------------------------------------------------------------------------------------------------

def _map_dicts(tree: Any, fn: Callable[[dict], dict]) -> Any:
  """Rebuilds `tree`, applying `fn` to every dict node bottom-up (inside tuples, NamedTuples such
  as optax states, lists and other pytree nodes too). Leaves are kept as they are."""
  if isinstance(tree, Mapping):
    return fn({k: _map_dicts(v, fn) for k, v in tree.items()})
  children, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda node: node is not tree)
  if treedef.num_leaves == 1 and treedef.num_nodes == 1 and children and children[0] is tree:
    return tree   # a leaf
  return jax.tree_util.tree_unflatten(treedef, [_map_dicts(c, fn) for c in children])


def _stack_trees(trees: list) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unrolled_to_scanned(tree: Any, cfg: ModelConfig) -> Any:
  """The scanned layout of a variable tree written in the per-layer layout (scan_layers=False).

  tree: unboxed arrays in any nesting: a 'params' or 'moe_state' collection, a dict of
    collections, an optimizer state (whose leaves mirror the params inside optax's NamedTuples).
    Every dict holding `layer_{i}` entries for layers of the scan gets those replaced by
    `scanned_period_{p}/layer_{j}` (j in the first group) stacked on a new leading axis, entry g
    from layer j + g·p. Other entries (prefix/suffix layers, embeddings, ...) are kept as they are.
  cfg: the config of the scanned model (`layer_plan(cfg)` decides the groups).
  Returns a new tree; a tree with no scanned layers (or a plan without a scan) comes back as is.
  Raises ValueError when a dict has some but not all of one position's layers across the groups.
  """
  plan = layer_plan(cfg)
  if not plan.num_groups:
    return tree

  def convert(node: dict) -> dict:
    stacked, taken = {}, set()
    for j in plan.group_layers:
      names = [f"layer_{j + g * plan.period}" for g in range(plan.num_groups)]
      present = [n for n in names if n in node]
      if not present:
        continue
      if len(present) != len(names):
        raise ValueError(f"unrolled_to_scanned: found {present} but the scan of {cfg.num_layers} "
                         f"layers (period {plan.period}) needs all of {names}")
      stacked[f"layer_{j}"] = _stack_trees([node[n] for n in names])
      taken.update(names)
    if not stacked:
      return node
    if plan.scan_name in node:
      raise ValueError(f"unrolled_to_scanned: the tree has both per-layer entries {sorted(taken)} "
                       f"and {plan.scan_name!r}")
    out = {k: v for k, v in node.items() if k not in taken}
    out[plan.scan_name] = stacked
    return out

  return _map_dicts(tree, convert)


def to_layout(tree: Any, cfg: ModelConfig) -> Any:
  """`tree` (scanned or per-layer layout, any scan period) in the layout of `cfg`'s decoder: a
  checkpoint written with scan_layers on restores into a model with it off, and the other way.
  Arguments as in `unrolled_to_scanned`. A tree already in that layout comes back as is (no
  unstacking and restacking of every scanned parameter on each restore; `unrolled_to_scanned`
  itself rejects a scanned tree, whose scan module holds some of each position's layer names).
  """
  plan = layer_plan(cfg)
  scans = _scan_modules(tree)
  if scans == ({plan.scan_name} if plan.num_groups else set()):
    return tree
  return unrolled_to_scanned(scanned_to_unrolled(tree) if scans else tree, cfg)


def _scan_modules(tree: Any) -> set[str]:
  """The names of the scanned modules (`scanned_period_{p}`) anywhere in `tree`'s dict keys."""
  names = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names.update(str(k.key) for k in path
                 if isinstance(k, jax.tree_util.DictKey) and _SCAN_MODULE.match(str(k.key)))
  return names


def scanned_to_unrolled(tree: Any) -> Any:
  """The per-layer layout of a tree in the scanned layout (the inverse of `unrolled_to_scanned`).

  Needs no config: `scanned_period_{p}/layer_{j}` entries (leading axis G) become `layer_{j+g·p}`
  for g < G. Works on any collection, sown ones included (e.g. 'moe_stats', whose per-layer names
  'layer_5/moe' the metrics use), in or outside a jit.
  """
  def convert(node: dict) -> dict:
    out = {}
    for key, value in node.items():
      scan = _SCAN_MODULE.match(str(key))
      if scan is None:
        out[key] = value
        continue
      period = int(scan.group(1))
      for child, layer in value.items():
        first = _LAYER_MODULE.match(str(child))
        leaves = jax.tree.leaves(layer)
        if first is None or not leaves:
          raise ValueError(f"scanned_to_unrolled: {key}/{child} is not a non-empty layer_<i> entry")
        for g in range(jnp.shape(leaves[0])[0]):
          out[f"layer_{int(first.group(1)) + g * period}"] = jax.tree.map(lambda x: x[g], layer)
    return out

  return _map_dicts(tree, convert)


def is_scanned_path(names: tuple[str, ...]) -> bool:
  """Whether a variable path (tuple of keys) goes through a scanned module, i.e. whether the
  variable has a leading stacked axis of one entry per group."""
  return any(_SCAN_MODULE.match(str(n)) for n in names)
