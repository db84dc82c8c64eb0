"""The MoE layers' sown statistics ('moe_stats'), read per layer.

A LatentMoE layer sows its expert loads ('load', fp32 [E]; [G, E] stacked in a scanned group),
MaxVio ('max_vio') and, with aux-loss balancing, 'aux_loss' (`k3jax.layers.moe`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

from k3jax.model.layout import scanned_to_unrolled


def moe_stats_by_layer(moe_stats: Mapping) -> dict[str, dict[str, Any]]:
  """Flattens the sown 'moe_stats' collection to {layer name: {'load', 'max_vio', 'aux_loss'}}.

  The layer name is the path of the MoE module ('layer_3/moe'); sown values are tuples (one entry
  per call), of which the last is taken. Layers are ordered by their layer number. The stacked
  stats of the decoder's scanned layers are split into their layers first
  (`scanned_to_unrolled`), so the names are those of the unrolled model.
  """
  out: dict[str, dict[str, Any]] = {}
  flat = jax.tree_util.tree_flatten_with_path(
      scanned_to_unrolled(moe_stats),
      is_leaf=lambda x: isinstance(x, tuple) and not hasattr(x, "_fields"))[0]
  for path, value in flat:
    keys = [getattr(p, "key", getattr(p, "name", str(p))) for p in path]
    if isinstance(value, tuple):
      value = value[-1]
    name = "/".join(str(k) for k in keys[:-1])
    out.setdefault(name, {})[str(keys[-1])] = value
  return dict(sorted(out.items(), key=lambda kv: _natural_key(kv[0])))


def _natural_key(name: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def max_violation(load: np.ndarray) -> float:
  """MaxVio = (max_j load_j - mean load) / mean load of one layer's expert loads [E]."""
  load = np.asarray(load, np.float64)
  mean = load.mean()
  return float((load.max() - mean) / mean) if mean > 0 else 0.0
