"""Variable trees in the two layouts of the decoder, and conversion between them.

Per-layer layout (ImplConfig.scan_layers False, or too few layers to scan): each layer's variables
under `layer_{i}`. Scanned layout: the variables of the scanned layers live under the module
`scanned_period_{p}` (p = the period, `k3jax.model.layer_plan`) as `layer_{i}` for the layers i of
the first group, with a leading axis (logical name 'layers') of one entry per group: entry g of
`scanned_period_{p}/layer_{i}` is layer i + g·p of the loop. This holds for every collection
('params', 'moe_state', the sown 'moe_stats' / 'attn_stats' / 'intermediates', the decode 'cache').
`unrolled_to_scanned`, `scanned_to_unrolled` and `to_layout` convert trees between the layouts:
checkpoints restore into either decoder.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.layer_plan import layer_plan

_SCAN_MODULE = re.compile(r"^scanned_period_(\d+)$")
_LAYER_MODULE = re.compile(r"^layer_(\d+)$")


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


def to_layout(tree: Any, cfg: ModelConfig, scan_layers: bool) -> Any:
  """`tree` (scanned or per-layer layout, any scan period) in the layout of the decoder of `cfg`
  with ImplConfig.scan_layers = `scan_layers`: a checkpoint written with scan_layers on restores
  into a model with it off, and the other way. `tree` as in `unrolled_to_scanned`. A tree already
  in that layout comes back as is (no unstacking and restacking of every scanned parameter on each
  restore; `unrolled_to_scanned` itself rejects a scanned tree, whose scan module holds some of
  each position's layer names).
  """
  plan = layer_plan(cfg, scan_layers)
  scans = _scan_modules(tree)
  if scans == ({plan.scan_name} if plan.num_groups else set()):
    return tree
  if not plan.num_groups:
    return scanned_to_unrolled(tree)
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
