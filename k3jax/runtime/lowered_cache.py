"""A disk cache of *lowered* programs, so that a warm launch neither traces nor lowers the model.

JAX's persistent compilation cache (`compiler.enable_compilation_cache`) is keyed by the lowered
module, so every launch still traces the training step to a jaxpr and lowers it to
StableHLO before it can look the executable up: for small.gin on an H200 that is ~26 s per launch,
most of it the Python lowering of the Pallas/Triton and tokamax Mosaic GPU kernels. `cached_jit`
keeps that work on disk through `jax.export`:

  miss  `jax.export.export(jit(flat_fun))(*abstract leaves)` traces and lowers `fun` once,
        `Exported.serialize()` goes to `<cache_dir>/<key>.jaxexport` (written to a temporary file
        and renamed: readers never see half an entry);
  hit   the entry is read and `jax.export.deserialize`d: `fun` is neither traced nor lowered.
Both then run the same wrapper, `jit(lambda *args: out_tree.unflatten(exported.call(*leaves)))`
over the deserialized `Exported` (the miss deserializes what it has just written), with the
caller's donate_argnums / in_shardings / out_shardings: the compiled module is the same on a miss
and on a hit, so JAX's persistent compilation cache hits too and a warm launch compiles nothing.
Calling `exported.call` inside `jit` still costs a parse of the serialized module and XLA's
compile-cache lookup, seconds instead of the tens of seconds of tracing and lowering.

Key: sha256 of a canonical JSON of (entry format; jax, jaxlib, flax, optax, tokamax and JAX plugin
versions; backend, platform version, device kinds and counts; a digest of every .py file under
k3jax/ and pallas_kernels/, so any code change misses; the function's name; the caller's
`description`, which must name everything the function closes over that the sources do not fix,
e.g. repr of the Config and the optimizer's total steps; donate_argnums and shardings; JAX's
trace context (config flags that change tracing, the current mesh, the user contexts that tokamax
registers at import: where the run's programs may trace tokamax it is imported first, so that no
key depends on whether it was; `context_modules`) and flax's logical axis rules;
the arguments' pytree structure and, per leaf, shape, dtype, weak type and sharding). The entry
stores that JSON too and a hit requires it to be equal, so even a sha256 collision could not
return another program. An entry that cannot be read, checked or deserialized is reported in one
warning line and rebuilt; it is never fatal.

Pytrees: `Exported.serialize` needs every custom pytree node of the in/out trees registered for
serialization. Instead `fun` is exported over flat leaves: the input tree is rebuilt on every call
from the arguments themselves (it is part of the key), and the output tree, known after the trace
of a miss, is stored in the entry as JSON (`treedef_to_json`): per node its type as
'module:qualname' and its auxiliary data (None, bools, numbers, strings, tuples, lists), rebuilt
with `PyTreeDef.from_node_data_and_children` after importing the type. That covers dicts, lists,
tuples, namedtuples (optax states) and dataclass nodes (flax struct, e.g. TrainState), and needs
nothing of the caller. A tree it cannot describe (a node type defined inside a function, aux data
of another kind) is found on the miss by a round trip: one warning, the program runs uncached.

Custom calls: export refuses custom-call targets outside its list of stable ones (Pallas Triton
'__gpu$xla.gpu.triton', tokamax's Mosaic GPU kernels, cuDNN attention, ...). That list exists for
programs reloaded by *other* jax versions; these entries are only ever loaded by the same jax and
jaxlib, the same backend and the same k3jax sources, which the key guarantees, so every target is
allowed (`DisabledSafetyCheck.custom_call('ALL')`, which jax's export check honours, instead of
lowering twice to collect the names first). The targets found are listed in the entry's header.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # trace_context(): the flags that change a trace

from k3jax.runtime import compiler

_log = logging.getLogger(__name__)

# Bumped whenever the entry layout or the key's contents change.
FORMAT = "k3jax-lowered-cache-1"
_MAGIC = FORMAT.encode() + b"\n"
ENTRY_SUFFIX = ".jaxexport"
# Python distributions whose versions change what a trace produces.
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "optax", "tokamax")
# Top-level source trees of the repository whose code is traced into the programs.
_SOURCE_PACKAGES = ("k3jax", "pallas_kernels")
_ALL_CUSTOM_CALLS = jax.export.DisabledSafetyCheck.custom_call("ALL")


class UndescribableTreeError(ValueError):
  """A pytree structure that `treedef_to_json` cannot write (a node type that cannot be imported
  by name, or auxiliary data that is not None, a bool, number, string, tuple or list)."""


# ------------------------------------------------------------------------------------------------
# Pytree structures as JSON
# ------------------------------------------------------------------------------------------------

def _aux_to_json(aux: Any) -> Any:
  if aux is None or isinstance(aux, (bool, int, float, str)):
    return aux
  if isinstance(aux, tuple):
    return {"tuple": [_aux_to_json(x) for x in aux]}
  if isinstance(aux, list):
    return {"list": [_aux_to_json(x) for x in aux]}
  raise UndescribableTreeError(f"pytree auxiliary data of type {type(aux).__name__}: {aux!r:.80}")


def _aux_from_json(value: Any) -> Any:
  if isinstance(value, dict):
    if "tuple" in value:
      return tuple(_aux_from_json(x) for x in value["tuple"])
    return [_aux_from_json(x) for x in value["list"]]
  return value


# NoneType cannot be looked up by name (builtins has no NoneType).
_NONE_TYPE = "builtins:NoneType"


def _type_name(typ: type) -> str:
  if typ is type(None):
    return _NONE_TYPE
  if "<locals>" in typ.__qualname__:
    raise UndescribableTreeError(f"pytree node type {typ.__qualname__} is defined in a function")
  return f"{typ.__module__}:{typ.__qualname__}"


def _type_from_name(name: str) -> type:
  if name == _NONE_TYPE:
    return type(None)
  module, qualname = name.split(":", 1)
  obj: Any = importlib.import_module(module)
  for part in qualname.split("."):
    obj = getattr(obj, part)
  return obj


def treedef_to_json(treedef: jax.tree_util.PyTreeDef) -> Any:
  """A JSON-able description of `treedef`: '*' for a leaf, else {'type': 'module:qualname',
  'aux': the node's auxiliary data, 'children': [...]}. Raises UndescribableTreeError."""
  if jax.tree_util.treedef_is_leaf(treedef) and treedef.num_nodes == 1 and treedef.num_leaves:
    return "*"
  typ, aux = treedef.node_data()
  return {"type": _type_name(typ), "aux": _aux_to_json(aux),
          "children": [treedef_to_json(c) for c in treedef.children()]}


def treedef_from_json(value: Any) -> jax.tree_util.PyTreeDef:
  """The inverse of `treedef_to_json` (imports the node types' modules)."""
  if value == "*":
    return jax.tree_util.tree_structure(0)
  node_data = (_type_from_name(value["type"]), _aux_from_json(value["aux"]))
  children = [treedef_from_json(c) for c in value["children"]]
  return jax.tree_util.PyTreeDef.from_node_data_and_children(
      jax.tree_util.default_registry, node_data, children)


# ------------------------------------------------------------------------------------------------
# The key
# ------------------------------------------------------------------------------------------------

def _source_dirs() -> list[str]:
  dirs = []
  for name in _SOURCE_PACKAGES:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      raise ImportError(f"lowered cache: package {name!r} not found; its sources are part of the "
                        "cache key")
    dirs.extend(spec.submodule_search_locations)
  return dirs


def sources_digest(dirs: Sequence[str]) -> str:
  """sha256 over the relative path and bytes of every .py file under `dirs` (sorted)."""
  digest = hashlib.sha256()
  for top in dirs:
    files = []
    for root, subdirs, names in os.walk(top):
      subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
      files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    for path in sorted(files):
      rel = os.path.join(os.path.basename(top), os.path.relpath(path, top))
      with open(path, "rb") as f:
        data = f.read()
      digest.update(f"{rel}\0{len(data)}\0".encode())
      digest.update(data)
  return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _environment() -> dict:
  """What a trace depends on besides the function and its arguments (once per process)."""
  versions = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name in _DISTRIBUTIONS or name.startswith(("jax-cuda", "jax-rocm")):
      versions[name] = dist.version
  versions.setdefault("jax", jax.__version__)
  devices = jax.devices()
  return {
      "versions": dict(sorted(versions.items())),
      "backend": jax.default_backend(),
      "platform_version": devices[0].client.platform_version,
      "device_kinds": sorted({d.device_kind for d in devices}),
      "device_count": len(devices),
      "process_count": jax.process_count(),
      "sources": sources_digest(_source_dirs()),
  }


def _stable_repr(value: Any) -> str:
  # Objects without a repr of their own print their address, which differs between launches.
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


# Libraries that register JAX user contexts (`jax.make_user_context`) when they are imported:
# each adds an entry to JAX's trace context, so a key computed before their import differs from
# one computed after. tokamax registers one per config option, and k3jax imports it on first use.
# A cold launch of small.gin on the H200 imported it while building the state's shapes, and
# computed every later key with its entries; the warm re-run read those shapes from this cache,
# had not imported it, and missed everything after (RESULTS.md, run 13). A cache imports them
# before it computes any key (`context_modules`, the default). A run whose programs cannot trace
# them passes `context_modules=()` and saves the import (tokamax: about 1.4 s of CPU a launch,
# RESULTS.md, run 44); it then never imports them, before or after a key.
CONTEXT_REGISTERING_MODULES = ("tokamax",)


def _import_modules(names: tuple) -> None:
  for name in names:
    if name not in sys.modules:
      importlib.import_module(name)


def _trace_context(context_modules: tuple = CONTEXT_REGISTERING_MODULES) -> list:
  """JAX's trace context (the config flags and context managers that change a trace, the current
  mesh among them, and the user contexts of `context_modules`, imported first) and flax's
  logical axis rules, which the model's sharding constraints and the expert-parallel dispatch
  read at trace time."""
  import flax.linen as nn
  _import_modules(context_modules)
  context = [[name, _stable_repr(value)] for name, value in
             zip(jax_config.trace_context_names(), jax_config.trace_context())]
  context.append(["flax_logical_axis_rules", _stable_repr(nn.get_logical_axis_rules())])
  return context


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
  shape: tuple
  dtype: Any
  weak_type: bool
  sharding: Any    # a jax.Array's or ShapeDtypeStruct's sharding, else None

  @classmethod
  def of(cls, x: Any) -> "_LeafSpec":
    aval = jax.typeof(x)
    return cls(tuple(aval.shape), aval.dtype, bool(aval.weak_type),
               getattr(x, "sharding", None))

  def to_json(self) -> list:
    return [list(self.shape), str(self.dtype), self.weak_type, _stable_repr(self.sharding)]

  def abstract(self, with_sharding: bool) -> jax.ShapeDtypeStruct:
    sharding = self.sharding if with_sharding else None
    return jax.ShapeDtypeStruct(self.shape, self.dtype, weak_type=self.weak_type,
                                sharding=sharding)


# ------------------------------------------------------------------------------------------------
# Entries
# ------------------------------------------------------------------------------------------------

def _atomic_write(path: str, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file in its folder (created if needed) and a
  rename: a concurrent reader sees the old file or the whole new one, never half of it."""
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _write_entry(path: str, header: dict, payload: bytes) -> None:
  head = json.dumps(header, sort_keys=True).encode()
  _atomic_write(path, _MAGIC + len(head).to_bytes(8, "big") + head + payload)


# Custom-call targets whose host runtime only an import sets up, with that import. A program read
# from the cache never traced the code that would have imported it. Mosaic GPU's custom call
# finds its runtime library (TMA descriptors, ...) through MOSAIC_GPU_RUNTIME_LIB_PATH, which
# `jax.experimental.mosaic.gpu` sets on import: without it a warm launch on the H200 failed with
# "Failed to lookup host symbol: ... ragged_dot_sm90_mosaic_gpu" (RESULTS.md, run 12).
KERNEL_RUNTIMES = (("mosaic_gpu", "jax.experimental.mosaic.gpu"),)


def load_kernel_runtimes(targets: Sequence[str]) -> list[str]:
  """Imports the runtime module of every custom-call target in `targets` (`KERNEL_RUNTIMES`, by
  name prefix); returns the modules imported (already imported ones included)."""
  modules = [module for prefix, module in KERNEL_RUNTIMES
             if any(t.startswith(prefix) for t in targets)]
  for module in modules:
    importlib.import_module(module)
  return modules


def _split_entry(data: bytes) -> tuple[dict, bytes]:
  """(header, payload) of an entry's bytes; raises ValueError for anything else."""
  if not data.startswith(_MAGIC):
    raise ValueError(f"not a {FORMAT} entry")
  start = len(_MAGIC) + 8
  head_len = int.from_bytes(data[len(_MAGIC):start], "big")
  if start + head_len > len(data):
    raise ValueError("truncated header")
  return json.loads(data[start:start + head_len]), data[start + head_len:]


def read_header(path: str) -> dict:
  """The header of the entry at `path` (its key JSON, function, custom-call targets, export
  time, creation time) without reading the program; raises ValueError for another file."""
  with open(path, "rb") as f:
    head = f.read(len(_MAGIC) + 8)
    if not head.startswith(_MAGIC) or len(head) < len(_MAGIC) + 8:
      raise ValueError(f"{path} is not a {FORMAT} entry")
    head_len = int.from_bytes(head[len(_MAGIC):], "big")
    return _split_entry(head + f.read(head_len))[0]


def _read_entry(path: str, key_json: str) -> tuple[Any, jax.tree_util.PyTreeDef]:
  """(Exported, output treedef) of the entry at `path`, with the runtimes of its kernels loaded
  (`load_kernel_runtimes`); raises on anything wrong with it."""
  with open(path, "rb") as f:
    header, payload = _split_entry(f.read())
  if header.get("key") != key_json:
    raise ValueError("the stored key differs from this call's (a hash collision?)")
  if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
    raise ValueError("the serialized program's checksum does not match")
  exported = jax.export.deserialize(bytearray(payload))
  out_tree = treedef_from_json(header["out_tree"])
  if out_tree.num_leaves != len(exported.out_avals):
    raise ValueError(f"output tree of {out_tree.num_leaves} leaves for "
                     f"{len(exported.out_avals)} outputs")
  load_kernel_runtimes(header.get("custom_call_targets", []))
  return exported, out_tree


def _custom_call_targets(exported) -> list[str]:
  text = exported.mlir_module()
  names = set(re.findall(r"stablehlo\.custom_call @([^\s(]+)", text))
  names |= set(re.findall(r'call_target_name = "([^"]+)"', text))
  return sorted(names)


def _broadcast_prefix(prefix: Any, tree: Any) -> list:
  """One entry of `prefix` per leaf of `tree` (a None in `prefix` covers its whole subtree)."""
  out = []
  jax.tree.map(lambda p, sub: out.extend([p] * len(jax.tree.leaves(sub))), prefix, tree,
               is_leaf=lambda x: x is None)
  return out


# ------------------------------------------------------------------------------------------------
# The cached function
# ------------------------------------------------------------------------------------------------

class LoweredCachedFunction:
  """`jit(fun)` whose traced and lowered programs live in `cache_dir` (module docstring).

  Call it like the jitted function (positional arguments only): `f(*args)`, `f.lower(*args)`,
  `f.trace(*args)`; `lower`/`trace` give those of the wrapper `jit` (its `.compile()` gives a
  Compiled called with the same pytrees). Arguments may be arrays or `jax.ShapeDtypeStruct`s.
  One program per distinct argument signature (pytree structure, shapes, dtypes, shardings).

  hits / misses / rebuilt: counts of the programs found in the cache, exported anew, and exported
  anew because the entry was unreadable (also counted in misses).
  """

  def __init__(self, fun: Callable, cache_dir: str, description: str, jit_kwargs: dict,
               context_modules: tuple = CONTEXT_REGISTERING_MODULES):
    self._fun = fun
    self._context_modules = tuple(context_modules)
    self._cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    self._description = description
    self._jit_kwargs = jit_kwargs
    self._name = getattr(fun, "__name__", "fun")
    self._programs: dict = {}
    self.hits = self.misses = self.rebuilt = 0

  def __call__(self, *args, **kwargs):
    return self._program(args, kwargs)(*args)

  def lower(self, *args, **kwargs):
    """The wrapper jit's Lowered; keyword arguments are `Traced.lower`'s (e.g. lowering_platforms
    is not supported: the entry holds a program for this backend)."""
    return self._program(args, {}).trace(*args).lower(**kwargs)

  def trace(self, *args, **kwargs):
    return self._program(args, kwargs).trace(*args)

  def _program(self, args: tuple, kwargs: dict) -> Callable:
    if kwargs:
      raise TypeError(f"{self._name} with the lowered cache takes positional arguments only, got "
                      f"keyword arguments {sorted(kwargs)}")
    leaves, in_tree = jax.tree.flatten(args)
    specs = tuple(_LeafSpec.of(x) for x in leaves)
    # Before reading the trace context: the first key's imports would change it under the next
    # call's signature otherwise.
    _import_modules(self._context_modules)
    signature = (in_tree, specs, tuple(jax_config.trace_context()))
    program = self._programs.get(signature)
    if program is None:
      program = self._programs[signature] = self._build(args, in_tree, specs)
    return program

  def _key_json(self, in_tree, specs) -> str:
    jit_options = {k: _stable_repr(v) for k, v in sorted(self._jit_kwargs.items())
                   if k != "compiler_options"}  # compile options do not change the lowering
    parts = {"format": FORMAT, "environment": _environment(),
             "function": f"{getattr(self._fun, '__module__', '')}.{self._name}",
             "description": self._description, "jit": jit_options,
             "trace_context": _trace_context(self._context_modules), "in_tree": str(in_tree),
             "args": [s.to_json() for s in specs]}
    return json.dumps(parts, sort_keys=True)

  def _build(self, args: tuple, in_tree, specs) -> Callable:
    key_json = self._key_json(in_tree, specs)
    key = hashlib.sha256(key_json.encode()).hexdigest()
    path = os.path.join(self._cache_dir, key + ENTRY_SUFFIX)
    entry = None
    if os.path.exists(path):
      t0 = time.perf_counter()
      try:
        entry = _read_entry(path, key_json)
      except Exception as e:  # whatever is wrong with the file, the program is rebuilt
        text = str(e).strip().splitlines()
        _log.warning("lowered cache: entry %s is unreadable (%s: %s); rebuilding it", path,
                     type(e).__name__, text[0] if text else "")
        self.rebuilt += 1
      else:
        self.hits += 1
        _log.info("lowered cache: %s read from %s in %.2f s", self._name, path,
                  time.perf_counter() - t0)
    if entry is None:
      self.misses += 1
      entry = self._export(args, in_tree, specs, path, key_json)
    exported, out_tree = entry
    return self._wrap(exported, out_tree)

  def _export(self, args, in_tree, specs, path, key_json):
    """Traces and lowers `fun` over flat leaves, writes the entry; (Exported, output treedef)."""
    t0 = time.perf_counter()
    out_trees = []
    fun = self._fun
    out_shardings = self._jit_kwargs.get("out_shardings")

    def flat_fun(*flat_args):
      out = fun(*jax.tree.unflatten(in_tree, flat_args))
      if out_shardings is not None:
        # The wrapper applies out_shardings to the results; the exported body carries them as
        # constraints so that its partitioning is that of `jit(fun, out_shardings=...)`.
        per_leaf = _broadcast_prefix(out_shardings, out)
        leaves, tree = jax.tree.flatten(out)
        leaves = [x if s is None else jax.lax.with_sharding_constraint(x, s)
                  for x, s in zip(leaves, per_leaf)]
        out = jax.tree.unflatten(tree, leaves)
      flat_out, out_tree = jax.tree.flatten(out)
      out_trees.append(out_tree)
      return flat_out

    flat_fun.__name__ = self._name
    export_kwargs = {}
    in_shardings = self._jit_kwargs.get("in_shardings")
    if in_shardings is not None:
      export_kwargs["in_shardings"] = tuple(_broadcast_prefix(in_shardings, args))
    # Without in_shardings, arguments on several devices keep theirs (as jit does for committed
    # arrays); a single-device placement is left to the wrapper's jit.
    multi = lambda s: s is not None and len(getattr(s, "device_set", ())) > 1
    abstract = [s.abstract(with_sharding=in_shardings is None and multi(s.sharding))
                for s in specs]
    exported = jax.export.export(jax.jit(flat_fun, **export_kwargs),
                                 disabled_checks=[_ALL_CUSTOM_CALLS])(*abstract)
    payload = bytes(exported.serialize())
    out_tree = out_trees[-1]
    export_s = time.perf_counter() - t0
    try:
      out_json = treedef_to_json(out_tree)
      if treedef_from_json(out_json) != out_tree:
        raise UndescribableTreeError(f"the output tree {out_tree} does not survive its JSON form")
    except (UndescribableTreeError, ImportError, AttributeError) as e:
      _log.warning("lowered cache: %s not cached: its output tree cannot be stored (%s)",
                   self._name, e)
    else:
      header = {"key": key_json, "out_tree": out_json, "function": self._name,
                "custom_call_targets": _custom_call_targets(exported),
                "payload_sha256": hashlib.sha256(payload).hexdigest(),
                "export_s": round(export_s, 3), "created": time.time()}
      try:
        _write_entry(path, header, payload)
      except OSError as e:
        _log.warning("lowered cache: cannot write %s (%s); %s runs uncached", path, e, self._name)
      else:
        _log.info("lowered cache: %s traced and lowered in %.2f s, written to %s", self._name,
                  export_s, path)
    # The program that runs is the deserialized one on a miss too: the same module as a hit's.
    return jax.export.deserialize(bytearray(payload)), out_tree

  def _wrap(self, exported, out_tree) -> Callable:
    def call(*args):
      return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(args)))

    # The module is named after `fun` (jit_<name>), as with the plain jit: XLA dumps and
    # profiles keep their names.
    call.__name__ = call.__qualname__ = self._name
    return compiler.jit(call, **self._jit_kwargs)


def cached_jit(fun: Callable, *, cache_dir: str, description: str,
               donate_argnums: Sequence[int] = (), in_shardings: Any = None,
               out_shardings: Any = None,
               context_modules: tuple = CONTEXT_REGISTERING_MODULES) -> Callable:
  """`compiler.jit(fun, donate_argnums=..., in_shardings=..., out_shardings=...)`, with its
  traced and lowered programs kept in `cache_dir` (a `LoweredCachedFunction`).

  cache_dir: the folder of entries ('~' expanded, created on the first write); '' turns the cache
    off: the plain jit is returned.
  description: names everything `fun` closes over that the k3jax sources do not determine (e.g.
    repr of the Config and static options); part of the key. Required (non-empty) with a cache.
  in_shardings / out_shardings: as for jax.jit (pytree prefixes of the arguments / results);
    None leaves placement to JAX.
  context_modules: the modules imported before a key is computed (CONTEXT_REGISTERING_MODULES);
    () where `fun` cannot import them while it is traced.
  """
  if not isinstance(cache_dir, str):
    raise TypeError(f"cache_dir must be a str (empty: no cache), got {type(cache_dir).__name__}")
  jit_kwargs: dict = {"donate_argnums": tuple(donate_argnums)}
  if in_shardings is not None:
    jit_kwargs["in_shardings"] = tuple(in_shardings) if isinstance(in_shardings, list) \
        else in_shardings
  if out_shardings is not None:
    jit_kwargs["out_shardings"] = out_shardings
  if not cache_dir:
    return compiler.jit(fun, **jit_kwargs)
  if not isinstance(description, str) or not description:
    raise ValueError("description must be a non-empty str naming what the function closes over "
                     f"(e.g. repr of the Config), got {description!r}")
  return LoweredCachedFunction(fun, cache_dir, description, jit_kwargs, context_modules)


# ------------------------------------------------------------------------------------------------
# Abstract values (shapes, dtypes, logical axis names) of a traced function
# ------------------------------------------------------------------------------------------------

ABSTRACT_FORMAT = "k3jax-abstract-1"
ABSTRACT_SUFFIX = ".abstract.json"


def _abstract_to_json(tree: Any) -> Any:
  """Nested dicts of ShapeDtypeStructs, optionally boxed in flax's LogicallyPartitioned (no mesh,
  no rules) -> JSON; raises UndescribableTreeError on anything else."""
  import flax.linen as nn
  if isinstance(tree, Mapping):
    if not all(isinstance(k, str) for k in tree):
      raise UndescribableTreeError(f"non-string keys {sorted(map(repr, tree))}")
    return {"dict": {k: _abstract_to_json(v) for k, v in tree.items()}}
  names = None
  if isinstance(tree, nn.LogicallyPartitioned):
    if tree.mesh is not None or tree.rules is not None:
      raise UndescribableTreeError("a LogicallyPartitioned with a mesh or rules")
    names, tree = list(tree.names), tree.value
  if type(tree) is not jax.ShapeDtypeStruct or tree.sharding is not None:
    raise UndescribableTreeError(f"a leaf of type {type(tree).__name__}")
  return {"leaf": [list(tree.shape), str(tree.dtype), bool(tree.weak_type), names]}


def _abstract_from_json(value: Any) -> Any:
  import flax.linen as nn
  if "dict" in value:
    return {k: _abstract_from_json(v) for k, v in value["dict"].items()}
  shape, dtype, weak_type, names = value["leaf"]
  leaf = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), weak_type=weak_type)
  return leaf if names is None else nn.LogicallyPartitioned(leaf, tuple(names))


def cached_abstract(cache_dir: str, description: str, compute: Callable[[], Any],
                    context_modules: tuple = CONTEXT_REGISTERING_MODULES) -> Any:
  """`compute()` (an abstract tree, e.g. `jax.eval_shape` of a model's initialisation), kept in
  `cache_dir` as JSON so that a warm launch does not trace the model for it.

  The tree: nested dicts with string keys whose leaves are ShapeDtypeStructs without sharding,
  bare or in flax's `LogicallyPartitioned` (names only). Key: as for `cached_jit` (versions,
  backend, devices, every k3jax and pallas_kernels source, the trace context) plus
  `description`, which must name what `compute` depends on (e.g. the model config's repr and the
  sequence length). cache_dir '' computes without a cache. An entry that cannot be read or does
  not match its key is reported in one warning and rebuilt; a tree of another kind is returned
  uncached, with one warning. context_modules: as for `cached_jit`.
  """
  if not cache_dir:
    return compute()
  if not isinstance(description, str) or not description:
    raise ValueError(f"description must be a non-empty str, got {description!r}")
  key_json = json.dumps({"format": ABSTRACT_FORMAT, "environment": _environment(),
                         "description": description,
                         "trace_context": _trace_context(tuple(context_modules))},
                        sort_keys=True)
  folder = os.path.expanduser(cache_dir)
  path = os.path.join(folder, hashlib.sha256(key_json.encode()).hexdigest() + ABSTRACT_SUFFIX)
  if os.path.exists(path):
    try:
      with open(path) as f:
        entry = json.load(f)
      if entry.get("key") != key_json:
        raise ValueError("the stored key differs from this call's")
      return _abstract_from_json(entry["tree"])
    except Exception as e:  # pylint: disable=broad-except
      _log.warning("lowered cache: entry %s is unreadable (%s: %s); rebuilding it", path,
                   type(e).__name__, e)
  tree = compute()
  try:
    text = json.dumps({"key": key_json, "tree": _abstract_to_json(tree)})
  except UndescribableTreeError as e:
    _log.warning("lowered cache: %s not cached: %s", description[:80], e)
    return tree
  try:
    _atomic_write(path, text.encode())
  except OSError as e:
    _log.warning("lowered cache: cannot write %s (%s)", path, e)
  return tree
