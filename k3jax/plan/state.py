"""The training state's bytes on each device, exactly, from the abstract variables.

Nothing is allocated: the variables' shapes come from `jax.eval_shape` of the model's
initialisation (`init_variables`), the optimizer state's from `jax.eval_shape` of the optimizer's
`init`, assembled as `k3jax.training.state.init_train_state` assembles them, and each leaf's
placement from the shardings it gets there (`sharding.state_shardings` with the logical rule
table, FSDP's or the plain one). The partition specs do not depend on the axes' sizes, so they are
read once per config and the bytes of any mesh follow: a leaf's shard is its shape with each
dimension divided by the sizes of the mesh axes that split it (which must divide it, as
`sharding.param_shardings` checks), times its dtype's size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from k3jax import config as config_lib
from k3jax.model import init_variables
from k3jax.parallel import sharding as sharding_lib
from k3jax.training import optim
from k3jax.training.state import TrainState

# A leaf: (path, shape, dtype size, per dimension the mesh axes that split it).
Leaf = tuple[str, tuple[int, ...], int, tuple[tuple[str, ...], ...]]


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Bytes per device of the training state's parts.

  params: the parameters ('params', param_dtype). opt_state: the optimizer's moments and counts.
  other: the balance biases ('moe_state'), the step counter and the PRNG key.
  params_global: the parameters' bytes, one copy of the whole model.
  gathered_layer: the most bytes one decoder layer's parameters take on a device once the
    dimensions that only FSDP splits are gathered (what XLA all-gathers before the layer runs);
    0 without FSDP.
  """
  params: int
  opt_state: int
  other: int
  params_global: int
  gathered_layer: int

  @property
  def persistent(self) -> int:
    return self.params + self.opt_state + self.other


def _abstract_mesh(names: tuple[str, ...]) -> AbstractMesh:
  return AbstractMesh((1,) * len(names), names)


CONTEXT_AXIS = "context"


def fsdp_rules(over_context: bool) -> tuple:
  """`sharding.logical_axis_rules(fsdp=True)`; with `over_context`, the what-if in which the
  dimensions FSDP splits over 'data' are split over 'context' too (the rule table does not do
  this: a planning question, how far a context axis would spread the state). The what-if pads a
  dimension that its axes do not divide instead of refusing the mesh."""
  rules = sharding_lib.logical_axis_rules(True)
  if not over_context:
    return rules
  out, fsdp_names = [], ("embed", "latent")
  for name, axes in rules:
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if name in fsdp_names and "data" in names:
      axes = names + (CONTEXT_AXIS,)
    out.append((name, axes))
  return tuple(out)


def _path(path: Any) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _axes(spec: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
  out = []
  for i in range(ndim):
    names = spec[i] if i < len(spec) else None
    out.append(() if names is None else ((names,) if isinstance(names, str) else tuple(names)))
  return tuple(out)


def _leaves(tree: Any, shardings: Any) -> list[Leaf]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(_path(path), tuple(np.shape(x)), jnp.dtype(x.dtype).itemsize, _axes(sh.spec, np.ndim(x)))
          for (path, x), sh in zip(flat, jax.tree.leaves(shardings))]


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The state's leaves with the mesh axes that split them, by part: params, opt_state, other;
  `plain_params`: the parameters as the plain (non-FSDP) rules split them."""
  params: tuple[Leaf, ...]
  opt_state: tuple[Leaf, ...]
  other: tuple[Leaf, ...]
  plain_params: tuple[Leaf, ...]
  fsdp: bool
  uneven: bool = False
  _cache: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

  def bytes_for(self, sizes: dict[str, int]) -> StateBytes:
    """The state's bytes on one device of a mesh of `sizes` ({'data': 8, 'expert': 8, ...}).

    Raises ValueError naming the variable whose sharded dimension the mesh does not divide.
    """
    key = tuple(sorted((a, int(n)) for a, n in sizes.items() if n != 1))
    if key not in self._cache:
      self._cache[key] = self._bytes_for(dict(key))
    return self._cache[key]

  def _bytes_for(self, sizes: dict[str, int]) -> StateBytes:
    params = _shard_bytes(self.params, sizes, self.uneven)
    gathered = _largest_layer(self.plain_params, sizes) if self.fsdp else 0
    return StateBytes(params=params, opt_state=_shard_bytes(self.opt_state, sizes, self.uneven),
                      other=_shard_bytes(self.other, sizes, self.uneven),
                      params_global=sum(math.prod(s) * b for _, s, b, _ in self.params),
                      gathered_layer=gathered)


def _shard_shape(path: str, shape: tuple[int, ...], axes: tuple, sizes: dict[str, int],
                 uneven: bool = False) -> tuple[int, ...]:
  out = []
  for dim, names in zip(shape, axes):
    n = math.prod(int(sizes.get(a, 1)) for a in names)
    if uneven:
      out.append(-(-dim // n))          # the what-if pads a dimension its axes do not divide
      continue
    if dim % n:
      raise ValueError(f"variable {path} of shape {shape}: a dimension of size {dim} is sharded "
                       f"over mesh axes {names} of total size {n}, which does not divide it")
    out.append(dim // n)
  return tuple(out)


def _shard_bytes(leaves: tuple[Leaf, ...], sizes: dict[str, int], uneven: bool = False) -> int:
  return sum(math.prod(_shard_shape(p, s, a, sizes, uneven)) * b for p, s, b, a in leaves)


def _largest_layer(leaves: tuple[Leaf, ...], sizes: dict[str, int]) -> int:
  """The most bytes of one decoder layer's parameters on a device (a scanned group's stacked
  parameters count one group entry)."""
  per_layer: dict[str, int] = {}
  for path, shape, size, axes in leaves:
    names = path.split("/")
    layer = next((i for i, n in enumerate(names) if n.startswith("layer_")), None)
    if layer is None:
      continue
    shard = _shard_shape(path, shape, axes, sizes)
    if any(n.startswith("scanned_period_") for n in names):
      shard = shard[1:]
    key = "/".join(names[:layer + 1])
    per_layer[key] = per_layer.get(key, 0) + math.prod(shard) * size
  return max(per_layer.values(), default=0)


@functools.lru_cache(maxsize=8)
def abstract_variables(model: config_lib.ModelConfig, impl: config_lib.ImplConfig) -> Any:
  """The boxed variable tree's shapes (`init_variables` traced at one token: the parameters do
  not depend on the row length)."""
  return jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), 1, 1, impl=impl))


def abstract_train_state(cfg: config_lib.Config) -> tuple[TrainState, Any]:
  """(TrainState of jax.ShapeDtypeStructs as `init_train_state` builds it, the boxed abstract
  variables)."""
  boxed = abstract_variables(cfg.model, cfg.impl)
  optimizer, _ = optim.make_optimizer(cfg.optimizer, cfg.stages.total_steps,
                                      optim.logical_axes(boxed["params"]))

  def assemble(boxed):
    params = optim.unbox(boxed["params"])
    return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                      opt_state=optimizer.init(params),
                      moe_state=optim.unbox(boxed.get("moe_state", {})),
                      rng=jax.random.PRNGKey(0))

  return jax.eval_shape(assemble, boxed), boxed


@functools.lru_cache(maxsize=16)
def state_layout(model: config_lib.ModelConfig, impl: config_lib.ImplConfig,
                 optimizer: config_lib.OptimizerConfig, total_steps: int,
                 fsdp: bool, fsdp_context: bool = False) -> StateLayout:
  """The state's `StateLayout` under the plain or the FSDP rule table (`fsdp_rules`)."""
  cfg = config_lib.Config(model=model, impl=impl, optimizer=optimizer,
                          stages=config_lib.StagesConfig(stages=((1, total_steps),),
                                                         tokens_per_step=1))
  state, boxed = abstract_train_state(cfg)
  names = tuple(sharding_lib.MESH_AXES)
  mesh = _abstract_mesh(names + ((CONTEXT_AXIS,) if CONTEXT_AXIS not in names else ()))

  def leaves(rules):
    sh = sharding_lib.state_shardings(state, boxed, mesh, rules)
    return sh, _leaves(state.params, sh.params)

  sh, params = leaves(fsdp_rules(fsdp_context) if fsdp else sharding_lib.logical_axis_rules(False))
  _, plain = leaves(sharding_lib.logical_axis_rules(False))
  other = (_leaves(state.moe_state, sh.moe_state) + _leaves(state.step, sh.step)
           + _leaves(state.rng, sh.rng))
  return StateLayout(params=tuple(params), opt_state=tuple(_leaves(state.opt_state, sh.opt_state)),
                     other=tuple(other), plain_params=tuple(plain), fsdp=fsdp,
                     uneven=fsdp_context)


def state_bytes(cfg: config_lib.Config, sizes: dict[str, int], fsdp: bool = False,
                fsdp_context: bool = False) -> StateBytes:
  """The state's bytes on one device of a mesh of `sizes` ({'data': n, 'expert': m, ...});
  `fsdp_context`: the FSDP what-if of `fsdp_rules`."""
  layout = state_layout(cfg.model, cfg.impl, cfg.optimizer, cfg.stages.total_steps, fsdp,
                        fsdp and fsdp_context)
  return layout.bytes_for(sizes)
