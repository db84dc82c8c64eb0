"""Hugging Face folders <-> k3jax variables: `load_hf`, `save_hf`.

`load_hf(folder, mesh)` reads config.json, picks the format by `model_type` (`kimi_linear`:
`k3jax.convert.kimi_linear`; `kimi_k3`: `k3jax.convert.kimi_k3`, which also takes a flat
'kimi_linear' config that sets K3's own keys), and builds every k3jax leaf from its HF tensors,
one leaf at a time: the leaf's tensors are read from the safetensors shards (lazily), transformed,
cast to the parameter dtype and placed on the device, or with a mesh straight into the leaf's
sharding (`k3jax.parallel.sharding.param_shardings`, FSDP rules: the big weights spread over
every device), before the next leaf is read. Host memory then holds one leaf at a time, in the
scanned layout the layers' leaves of one position stacked (`k3jax.model.layout`). The folder's
tensors that no leaf reads (K3's vision tower, ...) are reported through `log`.

`save_hf(folder, cfg, params, moe_state)` is the reverse, in the format `format_for(cfg)` picks:
Kimi-Linear-shaped models in transformers' spelling (or the release's), K3-shaped ones in the K3
release's, sharded with an index.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from k3jax import config as config_lib
from k3jax.config import ConfigError, ImplConfig, ModelConfig
from k3jax.convert import kimi_k3, kimi_linear
from k3jax.convert.kimi_linear import ConvertError
from k3jax.convert.safetensors_io import CheckpointFormatError, CheckpointReader, ShardedWriter
from k3jax.model import K3Model, layer_plan, scanned_to_unrolled
from k3jax.parallel import sharding

PyTree = Any
FORMATS = {kimi_linear.MODEL_TYPE: kimi_linear, kimi_k3.MODEL_TYPE: kimi_k3}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "uint8": np.uint8}
EXPORT_DTYPES = ("bfloat16", "float32")
# Leaves kept on the host while the export rules run (a layer's expert stacks feed many rules).
_EXPORT_CACHE_LEAVES = 3


def read_hf_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise ConvertError(f"{folder} has no config.json: not a Hugging Face model folder")
  with open(path) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ConvertError(f"{path} is not JSON ({e})") from None
  if hf.get("model_type") not in FORMATS:
    raise ConvertError(f"config.json: model_type = {hf.get('model_type')!r} is not supported: "
                       f"'{kimi_linear.MODEL_TYPE}' (Kimi-Linear) or '{kimi_k3.MODEL_TYPE}' "
                       "(Kimi K3)")
  return hf


def hf_format(hf: dict):
  """The format module of a config.json: by `model_type`, except that a flat 'kimi_linear'
  config setting K3's own keys (AttnRes, the latent MoE, ...) is K3's text model."""
  if hf.get("model_type") == kimi_linear.MODEL_TYPE and kimi_k3.is_k3_text_config(hf):
    return kimi_k3
  return FORMATS[hf["model_type"]]


def format_for(cfg: ModelConfig):
  """The format module that writes `cfg`: kimi_linear for a Kimi-Linear-shaped model, kimi_k3 for
  a K3-shaped one; ConvertError naming the field that fits neither."""
  order = (kimi_k3, kimi_linear) if cfg.attnres else (kimi_linear, kimi_k3)
  errors = []
  for fmt in order:
    try:
      fmt.check_expressible(cfg)
      return fmt
    except ConvertError as e:
      errors.append(str(e))
  names = {kimi_k3: "K3", kimi_linear: "Kimi-Linear"}
  raise ConvertError(f"{errors[0]} (the model is not {names[order[1]]}-shaped either: "
                     f"{errors[1]})")


def hf_model_config(folder: str, dtype: Optional[str] = None,
                    param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a Hugging Face folder's config.json (ConvertError when k3jax cannot
  express it)."""
  hf = read_hf_config(folder)
  return hf_format(hf).config_from_hf(hf, dtype, param_dtype)


def abstract_variables(cfg: ModelConfig, impl: ImplConfig = ImplConfig()) -> PyTree:
  """The boxed abstract 'params' and 'moe_state' of K3Model(cfg, impl) (no memory allocated)."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  variables = jax.eval_shape(lambda: K3Model(cfg, impl).init(jax.random.key(0), tokens))
  return {name: variables[name] for name in ("params", "moe_state") if name in variables}


def _target_layer_paths(path: tuple[str, ...], cfg: ModelConfig, impl: ImplConfig
                        ) -> list[tuple[str, ...]]:
  """The per-layer-layout paths whose values stack into the leaf at `path` (one path, itself, for
  a leaf outside the scan)."""
  plan = layer_plan(cfg, impl.scan_layers)
  if plan.num_groups and len(path) > 2 and path[1] == plan.scan_name:
    first = int(path[2].removeprefix("layer_"))
    return [(path[0], f"layer_{first + g * plan.period}") + path[3:]
            for g in range(plan.num_groups)]
  return [path]


def _path_of(keys) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", k)) for k in keys)


def load_hf(folder: str, mesh: Optional[Mesh] = None, *, dtype: Optional[str] = None,
            param_dtype: str = "float32", impl: ImplConfig = ImplConfig(),
            log: Callable[[str], None] = lambda line: None
            ) -> tuple[config_lib.Config, dict]:
  """A Hugging Face model folder as (Config, variables).

  `K3Model(cfg.model, impl).apply(variables, tokens)` gives the model's logits ([B, T, vocab],
  in cfg.model.dtype); with the default impl that is `K3Model(cfg.model)`. variables =
  {'params': ..., 'moe_state': ...} in impl's layout (scan_layers), params in `param_dtype`, the
  balance biases in fp32. `dtype`: the activations' dtype (default: config.json's, float32 or
  bfloat16). With `mesh`, each leaf is placed in its FSDP sharding on it as it is read.
  Raises ConvertError (a config.json field k3jax cannot express, a tensor missing or of the wrong
  shape) or CheckpointFormatError (unreadable shards), each one line.
  """
  hf = read_hf_config(folder)
  fmt = hf_format(hf)
  model_cfg = fmt.config_from_hf(hf, dtype, param_dtype)
  cfg = config_lib.Config(model=model_cfg, impl=impl,
                          mesh=config_lib.MeshConfig(_mesh_spec(mesh)))
  reader = CheckpointReader(folder)
  imports, _ = fmt.tensor_rules(model_cfg)
  rules = {rule.target: rule for rule in imports}
  boxed = abstract_variables(model_cfg, impl)
  shapes = nn.meta.unbox(boxed)
  shardings = None
  if mesh is not None:
    shardings = sharding.param_shardings(boxed, mesh, sharding.logical_axis_rules(fsdp=True))
  used: set[str] = set()

  def per_layer(path: tuple[str, ...]) -> np.ndarray:
    """The k3jax array at a per-layer path, from the HF tensors (ConvertError if missing)."""
    rule = rules.get(path)
    if rule is None:
      raise ConvertError(f"k3jax parameter {'/'.join(path)} has no source in the "
                         f"{hf['model_type']} format")
    for source in rule.sources:
      if all(name in reader for name in source.names):
        break
    else:
      # A source whose tensors are partly there names its first missing one.
      partial = [[n for n in s.names if n not in reader] for s in rule.sources
                 if any(n in reader for n in s.names)]
      wanted = (min(partial, key=len)[0] if partial
                else " or ".join(s.names[0] for s in rule.sources))
      raise ConvertError(f"{folder} has no tensor {wanted} (for k3jax's {'/'.join(path)})")
    arrays = []
    for name, want in zip(source.names, source.shapes):
      got = reader.shape(name)
      if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = ", ".join("*" if w is None else str(w) for w in want)
        raise ConvertError(f"tensor {name} has shape {list(got)}: expected [{shown}] from "
                           "config.json")
      arrays.append(reader.get(name))
      used.add(name)
    return source.build(*arrays)

  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  flat_shardings = treedef.flatten_up_to(shardings) if shardings is not None else None
  leaves = []
  for n, (keys, shape) in enumerate(flat):
    path = _path_of(keys)
    parts = [per_layer(p) for p in _target_layer_paths(path, model_cfg, impl)]
    value = parts[0] if len(parts) == 1 else np.stack(parts)
    del parts
    if value.shape != shape.shape:
      raise ConvertError(f"k3jax parameter {'/'.join(path)}: built shape {list(value.shape)}, "
                         f"expected {list(shape.shape)}")
    value = np.asarray(value, dtype=shape.dtype)
    if flat_shardings is None:
      leaves.append(jnp.asarray(value))
    else:
      leaves.append(jax.make_array_from_callback(value.shape, flat_shardings[n],
                                                 lambda index, v=value: v[index]))
    del value
  unused = [name for name in reader.names() if name not in used]
  if unused:
    log(f"skipped {len(unused)} tensors that k3jax does not model: {skipped_summary(unused)}")
  return cfg, jax.tree_util.tree_unflatten(treedef, leaves)


def skipped_summary(names: list[str], shown: int = 5) -> str:
  """The names grouped by their first component: 'vision_tower.* (165), mm_projector.* (3)' for
  a group of several, a lone name as itself; at most `shown` groups, then '...'."""
  groups: dict[str, list[str]] = {}
  for name in names:
    groups.setdefault(name.split(".", 1)[0], []).append(name)
  parts = [f"{head}.* ({len(group)})" if len(group) > 1 else group[0]
           for head, group in groups.items()]
  return ", ".join(parts[:shown]) + (" ..." if len(parts) > shown else "")


def _mesh_spec(mesh: Optional[Mesh]) -> str:
  if mesh is None:
    return ""
  return ",".join(f"{name}:{size}" for name, size in mesh.shape.items())


def save_hf(folder: str, cfg: ModelConfig, params: PyTree, moe_state: PyTree, *,
            dtype: str = "bfloat16", spelling: Optional[str] = None,
            source_config: Optional[dict] = None, max_shard_bytes: int = 5 * 2**30,
            experts: str = "bf16") -> list[str]:
  """Writes a Kimi-Linear- or K3-shaped model (`format_for`) as a Hugging Face folder:
  config.json and the tensors, in shards of at most `max_shard_bytes` with an index.
  params, moe_state: either layout, any placement (read leaf by leaf to the host).

  Kimi-Linear: every tensor in `dtype` ('bfloat16' or 'float32', as transformers saves a model of
  that dtype, buffers included); spelling: 'transformers' (the default: exactly the names and
  config keys its `save_pretrained` writes) or 'release' (the released checkpoints', which vLLM's
  and SGLang's loaders read).
  K3: the release's names, config keys and dtypes (`A_log`, `dt_bias`, the convolutions, `o_norm`
  and the routing bias in float32, the rest in `dtype`); spelling 'release' (the default, the
  only one); experts: 'bf16' (the routed experts in `dtype`) or 'mxfp4' (packed as the release
  ships them). source_config: the config.json the model came from (its token ids are kept).
  Returns the written shard names."""
  if dtype not in EXPORT_DTYPES:
    raise ConvertError(f"--dtype = {dtype!r}: expected one of {sorted(EXPORT_DTYPES)}")
  fmt = format_for(cfg)
  spelling = spelling or fmt.SPELLINGS[0]
  options = {}
  if fmt is kimi_k3:
    options["experts"] = experts
  elif experts != "bf16":
    raise ConvertError(f"--experts = {experts!r}: a Kimi-Linear checkpoint's experts are not "
                       "quantised (expected 'bf16')")
  hf_config = fmt.config_to_hf(cfg, dtype, spelling, source_config, **options)
  _, exports = fmt.tensor_rules(cfg, spelling, **options)
  tree = scanned_to_unrolled({"params": params, "moe_state": moe_state})
  os.makedirs(folder, exist_ok=True)
  writer = ShardedWriter(folder, max_shard_bytes)
  cache: dict[tuple[str, ...], np.ndarray] = {}

  def leaf(target: tuple[str, ...]) -> np.ndarray:
    """The leaf at `target` as fp32 on the host, kept for the next rules that read it."""
    if target not in cache:
      node = tree
      for key in target:
        node = node[key]
      if len(cache) >= _EXPORT_CACHE_LEAVES:
        del cache[next(iter(cache))]
      cache[target] = np.asarray(jax.device_get(node), np.float32)
    return cache[target]

  for rule in exports:
    stored = getattr(rule, "stored", None) or dtype
    writer.add(rule.name, np.asarray(rule.build(*(leaf(t) for t in rule.targets)),
                                     _NP_DTYPES[stored]))
  cache.clear()
  files = writer.close()
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  return files


__all__ = ["CheckpointFormatError", "ConfigError", "ConvertError", "format_for", "hf_format",
           "hf_model_config", "load_hf", "read_hf_config", "save_hf"]
