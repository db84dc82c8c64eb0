"""The device mesh (`data` x `context` x `expert`) and the one table mapping logical axis names to
mesh axes.

k3jax adds no distributed runtime of its own: it builds a `jax.sharding.Mesh`, gives every
parameter, optimizer-state leaf and batch an explicit `NamedSharding`, and lets XLA's SPMD
partitioner insert the collectives (NCCL on GPU). Only the MoE expert dispatch is written by hand
(`k3jax/ops/moe_ep.py`).

Mesh axes, in this order (the last one varies fastest over `jax.devices()`, so on a multi-host run
the `expert` groups stay inside a host's NVLink domain and `data` spans hosts):
  data:   pure data parallelism (batch sharded, weights replicated unless `fsdp=True`).
  context: context parallelism: each row's tokens split into contiguous slices, one per device of
          the axis. Position-wise layers run on their slice unchanged; KDA passes its state between
          slices and MLA all-gathers its compressed latent (`k3jax/parallel/context.py`).
  expert: expert parallelism inside the MoE (each device holds E / n_expert routed experts); outside
          the MoE it shards the batch too (MaxText's pattern), so no device idles in attention.

Logical names (declared by the layers, `k3jax/layers/common.py`) are mapped by `LOGICAL_AXIS_RULES`:

  activation_batch -> ('data', 'expert')   activation_exp -> 'expert'    expert -> 'expert'
  activation_length -> 'context'
  everything else  -> None (replicated; so is 'layers', the stacked axis of the decoder's scanned
                      layers); with fsdp=True, 'embed' -> ('data', 'expert') and the routed
                      experts' 'latent' -> 'data' (ZeRO-3 style: XLA all-gathers weights before
                      use).

Typical use (see `k3jax/training/loop.py`):

    mesh = make_mesh(cfg.mesh.axes)
    rules = logical_axis_rules(fsdp=False)
    abstract = jax.eval_shape(lambda: model.init(rng, tokens))          # boxed LogicallyPartitioned
    state_sh = state_shardings(abstract_state, abstract, mesh, rules)   # params + optimizer state
    step = jax.jit(train_step, in_shardings=(state_sh, batch_sharding(mesh)),
                   out_shardings=(state_sh, None))
    with with_mesh(mesh, rules):     # rules must be active while `step` is traced
      state, metrics = step(state, shard_batch(batch, mesh))
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax import config as config_lib

MESH_AXES = config_lib.MESH_AXES
BATCH_AXES = ("data", "expert")
CONTEXT_AXIS = "context"
# The axes a flattened [B * T] token dimension is split over (batch major, then the slices of a row).
TOKEN_AXES = BATCH_AXES + (CONTEXT_AXIS,)

# Logical name -> mesh axes. Order matters only where a name appears twice (first free assignment
# wins, flax's rule semantics); every logical name the layers use must appear, so that a typo in a
# layer is an error (see `param_shardings`) rather than a silently replicated weight.
LOGICAL_AXIS_RULES: tuple = (
    # activations
    ("activation_batch", BATCH_AXES),
    ("activation_exp", "expert"),
    ("activation_length", CONTEXT_AXIS),
    ("activation_embed", None),
    ("activation_heads", None),
    # parameters
    ("expert", "expert"),
    ("vocab", None),
    ("embed", None),
    ("heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("latent", None),
    ("kv_lora", None),
    ("q_lora", None),
    ("conv", None),
    ("norm", None),
    # the stacked axis of the decoder's scanned layers (`k3jax.model`): one entry per group
    ("layers", None),
)

# FSDP variant: the first matching free rule wins, so these go in front of the replicated ones.
# 'embed' takes both axes (dense weights, embedding, LM head); the routed experts already use
# 'expert' on their first dim, so their 'latent' dim takes 'data'. A weight with both 'embed' and
# 'latent' (the LatentMoE down projection) keeps 'latent' replicated because 'data' is taken.
_FSDP_RULES: tuple = (
    ("embed", BATCH_AXES),
    ("embed", "data"),
    ("latent", "data"),
)

KNOWN_LOGICAL_NAMES = frozenset(name for name, _ in LOGICAL_AXIS_RULES)


def logical_axis_rules(fsdp: bool = False) -> tuple:
  """The rule table; fsdp=True also shards the big weights over the batch axes (params only)."""
  if fsdp:
    # 'expert' must claim the expert axis before 'embed' asks for it, so that a weight with both
    # names falls back to 'embed' -> 'data'.
    first = tuple(r for r in LOGICAL_AXIS_RULES
                  if r[0].startswith("activation_") or r[0] == "expert")
    rest = tuple(r for r in LOGICAL_AXIS_RULES if r not in first)
    return first + _FSDP_RULES + rest
  return LOGICAL_AXIS_RULES


# ------------------------------------------------------------------------------------------------
# Mesh


def parse_mesh_spec(spec: str) -> dict[str, Optional[int]]:
  """'data:2,expert:4' -> {'data': 2, 'context': None, 'expert': 4}; a missing axis maps to None.

  Raises ValueError naming the flag for unknown names, repeated names or non-positive sizes.
  """
  sizes: dict[str, Optional[int]] = {a: None for a in MESH_AXES}
  if not spec:
    return sizes
  for part in spec.split(","):
    name, sep, size = part.strip().partition(":")
    if name not in MESH_AXES or not sep or not size.isdigit() or int(size) <= 0:
      raise ValueError(f"mesh flag {spec!r}: bad entry {part!r}; expected comma-separated "
                       f"'name:size' with name in {MESH_AXES} and size a positive integer, "
                       "e.g. 'data:2,expert:4'")
    if sizes[name] is not None:
      raise ValueError(f"mesh flag {spec!r}: axis {name!r} given twice")
    sizes[name] = int(size)
  return sizes


def make_mesh(spec: str = "", devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds the ('data', 'context', 'expert') mesh from a flag like 'data:2,context:4'.

  Args:
    spec: comma-separated 'axis:size'. Empty: all devices on 'data'. An axis not given has size 1.
    devices: the devices to use (default `jax.devices()`, all processes' devices).

  Returns:
    A `Mesh` with axis names ('data', 'context', 'expert') and `AxisType.Auto` axes (GSPMD-style
    propagation of `with_sharding_constraint` hints; `jax.make_mesh` defaults to Explicit).

  Raises:
    ValueError: naming the flag, the product of the sizes and the device count when they differ.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh_spec(spec)
  if all(size is None for size in sizes.values()):
    sizes = {"data": len(devices)}
  shape = tuple(1 if sizes.get(a) is None else sizes[a] for a in MESH_AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh flag {spec!r}: the axis sizes multiply to {math.prod(shape)} but "
                     f"there are {len(devices)} devices; they must be equal")
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # `jax.make_mesh` insists on a topology-aware layout of the whole slice; an arbitrary subset of
    # devices (tests, restoring onto fewer devices) gets the plain row-major layout instead.
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def make_run_mesh(cfg: config_lib.Config):
  """The run's device mesh, or None for a single-device run (MeshConfig.axes empty), when every
  stage runs on the same mesh; `make_stage_meshes` for a run whose stages differ.

  Raises ConfigError when the mesh does not fit the devices or a stage's batch does not split over
  the batch axes (data x expert), or when MeshConfig.stage_axes gives the stages different meshes.
  """
  meshes = make_stage_meshes(cfg)
  if any(m is not meshes[0] for m in meshes):
    raise config_lib.ConfigError(
        f"MeshConfig.stage_axes = {cfg.mesh.stage_axes!r} gives the stages different meshes, where "
        "one mesh for the whole run is needed; set MeshConfig.axes (--mesh) instead")
  return meshes[0]


def make_stage_meshes(cfg: config_lib.Config) -> tuple[Optional[Mesh], ...]:
  """Each curriculum stage's device mesh (`MeshConfig.for_stage`), None for a single-device stage;
  stages with the same mesh string share one Mesh object.

  Raises ConfigError naming the setting (MeshConfig.axes / --mesh, or MeshConfig.stage_axes[i])
  when a mesh does not fit the devices, a stage's batch or micro-batch does not split over its
  mesh's batch axes (data x expert), its rows do not split into the context slices, or the
  experts do not divide over the expert axis.
  """
  built: dict[str, Optional[Mesh]] = {}
  meshes = []
  for stage in range(len(cfg.stages.stages)):
    axes = cfg.mesh.for_stage(stage)
    setting = (f"MeshConfig.stage_axes[{stage}]" if cfg.mesh.stage_axes and
               cfg.mesh.stage_axes[stage] else "MeshConfig.axes / --mesh")
    if axes not in built:
      try:
        built[axes] = make_mesh(axes) if axes else None
      except ValueError as e:
        raise config_lib.ConfigError(f"{setting}: {e}") from e
    if built[axes] is not None:
      _check_stage_fits_mesh(cfg, stage, built[axes], f"{setting} = {axes!r}")
    meshes.append(built[axes])
  return tuple(meshes)


def _check_stage_fits_mesh(cfg: config_lib.Config, stage: int, mesh: Mesh, where: str) -> None:
  """ConfigError unless stage `stage`'s batch, micro-batches, rows and the experts split over
  `mesh` (`where` names the mesh's setting)."""
  seq_len = cfg.stages.stages[stage][0]
  batch = cfg.stages.batch_size(stage)
  shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if batch % shards:
    raise config_lib.ConfigError(
        f"StagesConfig.stages: stage {stage} (seq_len {seq_len}) has batch {batch}, which the "
        f"mesh of {where} cannot split over its {shards} batch shards; raise "
        "StagesConfig.tokens_per_step or use fewer devices")
  micro_rows = cfg.stages.microbatch_rows(seq_len, batch)
  if micro_rows % shards:
    raise config_lib.ConfigError(
        f"StagesConfig.microbatch_tokens = {cfg.stages.microbatch_tokens}: stage {stage} (seq_len "
        f"{seq_len}) would run micro-batches of {micro_rows} rows, which the mesh of {where} cannot "
        f"split over its {shards} batch shards; raise it")
  slices = mesh.shape[CONTEXT_AXIS]
  if seq_len % slices:
    raise config_lib.ConfigError(
        f"StagesConfig.stages: stage {stage} has seq_len {seq_len}, which the mesh of {where} "
        f"cannot split into {slices} equal slices along its context axis; use a context size that "
        "divides the stage's seq_len")
  if cfg.model.moe_num_experts % mesh.shape["expert"]:
    raise config_lib.ConfigError(
        f"ModelConfig.moe_num_experts = {cfg.model.moe_num_experts} must be divisible by the "
        f"expert axis ({mesh.shape['expert']}) of the mesh of {where}")


def axis_size(mesh: Mesh, axis: str) -> int:
  """Size of a mesh axis, 1 when the mesh has no such axis."""
  return int(dict(mesh.shape).get(axis, 1))


@contextlib.contextmanager
def with_mesh(mesh: Mesh, rules: Optional[Sequence] = None) -> Iterator[Mesh]:
  """Context in which `mesh` is the current mesh and the logical rules are active.

  Flax's `nn.with_logical_constraint` and the EP dispatcher read both at trace time, so jitted
  functions must be traced (first called) inside this context.
  """
  rules = LOGICAL_AXIS_RULES if rules is None else tuple(rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield mesh


# ------------------------------------------------------------------------------------------------
# Parameter, optimizer-state and batch shardings


def _key_str(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path(path: Sequence[Any]) -> tuple[str, ...]:
  return tuple(_key_str(k) for k in path)


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def logical_specs(abstract_variables: Any) -> Any:
  """PartitionSpecs of logical names for a (boxed) variable tree; unboxed leaves get P().

  The result has the structure of `nn.meta.unbox(abstract_variables)`.
  """
  return nn.get_partition_spec(abstract_variables)


def _check_names(path: tuple[str, ...], spec: P, rules: Sequence) -> None:
  known = {name for name, _ in rules}
  for name in spec:
    if isinstance(name, str) and name not in known:
      raise ValueError(f"variable {'/'.join(path)}: logical axis name {name!r} has no rule in the "
                       f"logical axis rule table; known names: {sorted(known)}")


def _check_divisible(path: tuple[str, ...], shape: Sequence[int], spec: P, mesh: Mesh) -> None:
  for dim, axes in zip(shape, spec):
    if axes is None:
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    n = math.prod(axis_size(mesh, a) for a in axes)
    if dim % n:
      raise ValueError(f"variable {'/'.join(path)} of shape {tuple(shape)}: a dimension of size "
                       f"{dim} is sharded over mesh axes {axes} of total size {n}, which does not "
                       "divide it; change the mesh flag or the model size")


def param_shardings(abstract_variables: Any, mesh: Mesh, rules: Optional[Sequence] = None) -> Any:
  """NamedShardings for a variable tree whose leaves carry flax `LogicallyPartitioned` boxes.

  Args:
    abstract_variables: e.g. `jax.eval_shape(model.init, ...)` (boxed; all collections).
    mesh: the mesh from `make_mesh`.
    rules: the logical rule table (default `LOGICAL_AXIS_RULES`).

  Returns:
    A tree shaped like `nn.meta.unbox(abstract_variables)` of `NamedSharding`; unboxed leaves (the
    MoE bias in 'moe_state', caches) are replicated.

  Raises:
    ValueError: a logical name without a rule, or a sharded dimension the mesh axes do not divide.
  """
  rules = LOGICAL_AXIS_RULES if rules is None else tuple(rules)
  specs = logical_specs(abstract_variables)
  values = nn.meta.unbox(abstract_variables)
  flat_specs, treedef = jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, P))
  flat_values = treedef.flatten_up_to(values)
  out = []
  for (path, spec), value in zip(flat_specs, flat_values):
    path = _path(path)
    _check_names(path, spec, rules)
    mesh_spec = nn.logical_to_mesh_axes(tuple(spec), rules)
    _check_divisible(path, np.shape(value), mesh_spec, mesh)
    out.append(NamedSharding(mesh, mesh_spec))
  return jax.tree_util.tree_unflatten(treedef, out)


def _variable_index(abstract_variables: Any, shardings: Any) -> dict:
  """Full variable path and in-collection path -> list of (collection, shape, sharding)."""
  values = nn.meta.unbox(abstract_variables)
  flat, treedef = jax.tree_util.tree_flatten_with_path(values)
  flat_sh = treedef.flatten_up_to(shardings)
  index: dict = {}
  for (path, value), sh in zip(flat, flat_sh):
    path = _path(path)
    entry = (path[0] if path else "", tuple(np.shape(value)), sh)
    index.setdefault(path, []).append(entry)
    if len(path) > 1:
      index.setdefault(path[1:], []).append(entry)
  return index


def state_shardings(abstract_state: Any, abstract_variables: Any, mesh: Mesh,
                    rules: Optional[Sequence] = None) -> Any:
  """Shardings for a whole train state: params, optimizer state, MoE state, step counters.

  A leaf of `abstract_state` takes a variable's sharding when its tree path ends with that
  variable's path (with or without the collection name) and the shapes agree: this covers params
  stored as `variables['params']` or the full dict, and optax's per-parameter moments (mu, nu,
  momentum buffers), whose paths end with the parameter's path. Everything else (step, counts,
  scalars, factored statistics) is replicated.

  Args:
    abstract_state: a pytree of arrays or `jax.ShapeDtypeStruct` (unboxed).
    abstract_variables: the boxed variable tree (`jax.eval_shape(model.init, ...)`).
    mesh, rules: as in `param_shardings`.

  Returns:
    A tree like `abstract_state` of `NamedSharding`.
  """
  index = _variable_index(abstract_variables,
                          param_shardings(abstract_variables, mesh, rules))
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf) -> NamedSharding:
    path = _path(path)
    shape = tuple(np.shape(leaf))
    for start in range(len(path)):
      candidates = [e for e in index.get(path[start:], ()) if e[1] == shape]
      if not candidates:
        continue
      in_path = [e for e in candidates if e[0] in path[:start + 1]]
      candidates = in_path or candidates
      specs = {e[2].spec for e in candidates}
      if len(specs) > 1:
        collections = sorted({e[0] for e in candidates})
        raise ValueError(f"state leaf {'/'.join(path)} matches variables of collections "
                         f"{collections} with different shardings; store them under their "
                         "collection name so that the path says which one it is")
      return candidates[0][2]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_state)


def shard_train_state(state: Any, abstract_variables: Any, mesh: Mesh,
                      rules: Optional[Sequence] = None) -> tuple[Any, Any]:
  """Places a train state on the mesh; returns (sharded state, its shardings).

  The shardings are what `jax.jit(in_shardings=..., out_shardings=...)` should use for the state.
  """
  shardings = state_shardings(state, abstract_variables, mesh, rules)
  return jax.device_put(state, shardings), shardings


def map_over_batch_shards(fn, *arrays, shared: Sequence = ()):
  """`fn(*shared, *arrays)`, computed by each device on its own rows when the current mesh shards
  the batch.

  For ops that XLA's SPMD partitioner cannot split: a Pallas kernel is an opaque custom call, and
  with a sharded batch XLA would gather the whole batch onto every device and run the kernel on
  all of it there (correct, but every device doing the whole batch's work). Here the kernel runs
  inside `jax.shard_map` over the mesh's batch axes (those of `BATCH_AXES` larger than 1).

  arrays: arrays with the batch on axis 0 (None entries are passed through as None); fn must
    treat rows independently and return a pytree of arrays (or None) with the batch on axis 0.
  shared: arrays without a batch axis, the same for every row (a kernel's parameters; None
    entries pass through). Each device gets its own copy as an input of the shard_map (not a
    closure), so that under autodiff their gradient is the sum of the devices' (the copies'
    broadcast transposes to that sum).
  Without a current mesh, or when its batch axes all have size 1, this is plain
  `fn(*shared, *arrays)`.

  Raises:
    ValueError: an array's batch size is not divisible by the batch axes' total size.
  """
  axes = split_axes(BATCH_AXES)
  return map_over_shards(fn, arrays, tuple(shared), P(axes) if axes else None,
                          "map_over_batch_shards")


def split_axes(names: Sequence[str]) -> tuple[str, ...]:
  """Those of the mesh axes `names` that the current mesh splits in more than one and that are not
  already manual (inside a `shard_map` over them, arrays are the device's own slices)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return tuple(a for a in names if sizes.get(a, 1) > 1 and a not in mesh.manual_axes)


def map_over_shards(fn, arrays: Sequence, shared: tuple, spec: Optional[P], caller: str):
  """`fn(*shared, *arrays)` under `jax.shard_map` over the current mesh, with every array split by
  `spec` (None: no split, a plain call) and the outputs joined by it; `shared` arrays are given to
  every device whole (see `map_over_batch_shards`). `caller` names the op in the ValueError raised
  for a dimension its mesh axes do not divide."""
  if spec is None:
    return fn(*shared, *arrays)
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  for dim, names in enumerate(spec):
    names = (names,) if isinstance(names, str) else tuple(names or ())
    parts = math.prod(sizes[a] for a in names)
    for i, x in enumerate(arrays):
      if x is not None and x.shape[dim] % parts:
        raise ValueError(f"{caller}: argument {i} has shape {x.shape}, whose dimension {dim} is "
                         f"not divisible by the mesh axes {names} (total size {parts})")
  device_axes = tuple(a for names in spec if names
                      for a in ((names,) if isinstance(names, str) else names))
  n = math.prod(sizes[a] for a in device_axes)
  inputs = [None if x is None else jnp.broadcast_to(x, (n,) + jnp.shape(x)) for x in shared]
  inputs += list(arrays)
  present = [i for i, x in enumerate(inputs) if x is not None]

  def local(*shards):
    full = list(inputs)
    for i, shard in zip(present, shards):
      full[i] = shard
    full[:len(shared)] = [None if x is None else x[0] for x in full[:len(shared)]]
    return fn(*full)

  in_specs = tuple(P(device_axes) if i < len(shared) else spec for i in present)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec,
                       check_vma=False)(*[inputs[i] for i in present])


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a [B, T] batch array: B over ('data', 'expert'), and T over 'context' when the mesh
  splits it."""
  if axis_size(mesh, CONTEXT_AXIS) > 1:
    return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))
  return NamedSharding(mesh, P(BATCH_AXES))


def local_batch_rows(mesh: Mesh, global_batch_size: int) -> slice:
  """The rows of the global batch that this process's devices hold (all rows for one process).

  A multi-process data pipeline loads `global_batch[local_batch_rows(mesh, B)]` on each process
  and passes that to `shard_batch`.

  Raises:
    ValueError: the batch axes do not divide the batch, or this process's rows are not contiguous
      (a mesh whose device order interleaves processes along the batch axes).
  """
  n = axis_size(mesh, "data") * axis_size(mesh, "expert")
  if global_batch_size % n:
    raise ValueError(f"global batch size {global_batch_size} is not divisible by the {n} devices "
                     f"of the mesh's batch axes {BATCH_AXES}")
  index_map = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map(
      (global_batch_size,))
  starts = sorted({idx[0].indices(global_batch_size)[:2] for idx in index_map.values()})
  lo, hi = starts[0][0], starts[-1][1]
  if sum(b - a for a, b in starts) != hi - lo:
    raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows {starts}; "
                     "build the mesh with make_mesh over jax.devices() (processes contiguous)")
  return slice(lo, hi)


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict:
  """Turns host arrays into global arrays sharded on the batch dim.

  Single process: `batch` is the global batch. Multi-process: `batch` is this process's slice of the
  global batch (`local_batch_rows`), assembled with `jax.make_array_from_process_local_data`.

  Raises:
    ValueError: naming the array whose batch dim the batch axes do not divide.
  """
  sharding = batch_sharding(mesh)
  n = axis_size(mesh, "data") * axis_size(mesh, "expert")
  nproc = jax.process_count()
  out = {}
  for name, value in batch.items():
    rows = np.shape(value)[0] * nproc
    if rows % n:
      raise ValueError(f"batch[{name!r}]: global batch size {rows} is not divisible by the "
                       f"{n} devices of the mesh's batch axes {BATCH_AXES}")
    if nproc == 1:
      out[name] = jax.device_put(value, sharding)
    else:
      out[name] = jax.make_array_from_process_local_data(sharding, np.asarray(value))
  return out


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
  """`jax.ShapeDtypeStruct`s carrying target shardings, e.g. for an Orbax restore."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), abstract_state,
      shardings)


def restore_args_for(abstract_state: Any, abstract_variables: Any, mesh: Mesh,
                     rules: Optional[Sequence] = None) -> Any:
  """Restore target for a checkpoint onto `mesh`, whatever mesh it was saved from.

  Orbax reads each device's slice directly when the target carries shardings ("if changing
  topologies, you MUST specify sharding when restoring"). Use as
  `ocp.StandardCheckpointer().restore(path, restore_args_for(...))` or
  `ocp.args.StandardRestore(restore_args_for(...))`.
  """
  return abstract_with_shardings(
      abstract_state, state_shardings(abstract_state, abstract_variables, mesh, rules))
