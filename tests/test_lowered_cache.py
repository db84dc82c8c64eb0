"""k3jax.runtime.lowered_cache: a miss writes an entry, a hit runs it without tracing, both equal
the plain jit bit for bit; what changes a program misses; a damaged entry is rebuilt; donation and
shardings are kept; the training step and its initialisation through the cache."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import config as config_lib
from k3jax import training as train_lib
from k3jax.model import K3Model
from k3jax.runtime import Runtime, context_modules_for, lowered_cache
from k3jax.training import step as train_step_lib
from testlib import TINY_RUN_BINDINGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@struct.dataclass
class ToyState:
  step: jax.Array
  params: dict


def toy_state():
  return ToyState(step=jnp.zeros([], jnp.int32),
                  params={"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.linspace(-1, 1, 4)})


class CountingStep:
  """A train-step-like function (state, batch) -> (state, metrics) that counts its traces."""

  def __init__(self):
    self.traces = 0
    self.__name__ = "toy_step"

  def __call__(self, state, batch):
    self.traces += 1
    y = jnp.tanh(batch["x"] @ state.params["w"] + state.params["b"])
    loss = jnp.mean(y ** 2)
    params = jax.tree.map(lambda p: p * 0.9 + 0.01 * loss, state.params)
    return state.replace(step=state.step + 1, params=params), {"loss": loss, "pair": (y, None)}


def toy_batch(rows=2, seed=0):
  return {"x": jnp.asarray(np.random.default_rng(seed).normal(size=(rows, 3)), jnp.float32)}


def run_steps(fn, state, batches):
  outs = []
  for batch in batches:
    state, metrics = fn(state, batch)
    outs.append(metrics)
  return jax.device_get((state, outs))


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def entries(folder):
  return sorted(n for n in os.listdir(folder) if n.endswith(lowered_cache.ENTRY_SUFFIX))


def entry_header(path) -> dict:
  with open(path, "rb") as f:
    data = f.read()
  start = len(lowered_cache._MAGIC) + 8
  size = int.from_bytes(data[len(lowered_cache._MAGIC):start], "big")
  return json.loads(data[start:start + size])


def test_miss_writes_an_entry_and_a_hit_runs_it_without_tracing(tmp_path):
  batches = [toy_batch(seed=0), toy_batch(seed=1)]
  fun = CountingStep()
  expected = run_steps(jax.jit(fun, donate_argnums=(0,)), toy_state(), batches)

  miss = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy",
                                  donate_argnums=(0,))
  fun.traces = 0
  got_miss = run_steps(miss, toy_state(), batches)
  assert (fun.traces, miss.misses, miss.hits) == (1, 1, 0)
  assert len(entries(tmp_path)) == 1

  jax.clear_caches()
  hit = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy",
                                 donate_argnums=(0,))
  fun.traces = 0
  got_hit = run_steps(hit, toy_state(), batches)
  assert (fun.traces, hit.misses, hit.hits) == (0, 0, 1)
  assert_bitwise_equal(got_miss, expected)
  assert_bitwise_equal(got_hit, expected)
  assert isinstance(got_hit[0], ToyState) and got_hit[1][0]["pair"][1] is None
  # The same wrapper on both paths: the same module for XLA (and its persistent cache).
  text = lambda f: f.lower(toy_state(), batches[0]).as_text(debug_info=False)
  assert text(miss) == text(hit)
  assert "module @jit_toy_step" in text(hit)


def test_description_shape_and_dtype_changes_miss(tmp_path):
  fun = CountingStep()
  make = lambda description: lowered_cache.cached_jit(fun, cache_dir=str(tmp_path),
                                                      description=description)
  make("toy a")(toy_state(), toy_batch(rows=2))
  make("toy b")(toy_state(), toy_batch(rows=2))
  make("toy a")(toy_state(), toy_batch(rows=5))
  make("toy a")(toy_state(), {"x": toy_batch(rows=2)["x"].astype(jnp.bfloat16)})
  assert len(entries(tmp_path)) == 4
  again = make("toy a")
  again(toy_state(), toy_batch(rows=5))
  assert (again.hits, again.misses, len(entries(tmp_path))) == (1, 0, 4)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "payload_bit"])
def test_damaged_entry_is_reported_and_rebuilt(tmp_path, caplog, damage):
  fun = CountingStep()
  args = (toy_state(), toy_batch())
  expected = jax.device_get(jax.jit(fun)(*args))
  lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy")(*args)
  (name,) = entries(tmp_path)
  path = tmp_path / name
  data = bytearray(path.read_bytes())
  if damage == "truncate":
    data = data[:len(data) // 2]
  elif damage == "garbage":
    data = bytearray(b"not an entry at all")
  else:
    data[-100] ^= 0x10
  path.write_bytes(bytes(data))

  jax.clear_caches()
  fun.traces = 0
  cached = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy")
  with caplog.at_level(logging.WARNING, logger=lowered_cache.__name__):
    got = jax.device_get(cached(*args))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "is unreadable" in warnings[0] and name in warnings[0]
  assert (cached.rebuilt, cached.misses, fun.traces) == (1, 1, 1)
  assert_bitwise_equal(got, expected)
  # Rebuilt: the next launch hits it.
  jax.clear_caches()
  fresh = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy")
  assert_bitwise_equal(jax.device_get(fresh(*args)), expected)
  assert fresh.hits == 1


def test_donation_is_kept(tmp_path):
  """XLA:CPU honours donation (the donated arrays are deleted after the call): the cached step
  donates the state exactly like the plain jit, and not the batch."""
  fun = CountingStep()
  state, batch = toy_state(), toy_batch()
  jax.jit(fun, donate_argnums=(0,))(state, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(state))
  for _ in range(2):  # the miss, then a hit
    jax.clear_caches()
    cached = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy",
                                      donate_argnums=(0,))
    state, batch = toy_state(), toy_batch()
    cached(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    assert not batch["x"].is_deleted()
  assert cached.hits == 1


def test_shardings_on_a_mesh_are_kept(tmp_path):
  """Given shardings are kept. Not bitwise: where out_shardings leave a result unspecified (None),
  XLA's partitioner may place the exported body's values otherwise than in the plain jit (here
  it keeps the [8, 4] activations sharded instead of gathering the rows), and the loss's sum then
  adds the rows in another order."""
  mesh = jax.make_mesh((8,), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  state_sh = jax.tree.map(lambda _: replicated, toy_state())
  kwargs = dict(donate_argnums=(0,), in_shardings=(state_sh, rows), out_shardings=(state_sh, None))
  fun = CountingStep()
  batches = [toy_batch(rows=8, seed=i) for i in range(2)]
  place = lambda: jax.device_put(toy_state(), state_sh)
  plain = jax.jit(fun, **kwargs)
  expected = run_steps(plain, place(), batches)
  for _ in range(2):  # the miss, then a hit
    jax.clear_caches()
    cached = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy", **kwargs)
    got = run_steps(cached, place(), batches)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), got, expected)
    state, _ = cached(place(), batches[0])
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(state_sh)):
      assert x.sharding.is_equivalent_to(s, x.ndim)
  assert cached.hits == 1 and len(entries(tmp_path)) == 1


def test_custom_call_targets_outside_exports_stable_list_are_allowed(tmp_path):
  """A custom call export would refuse (like the Pallas/Triton and Mosaic GPU kernels on a GPU) is
  stored, and listed in the entry's header; lowering only: the target does not exist."""
  def with_kernel(x):
    out = jax.ffi.ffi_call("k3jax_test_not_a_stable_target", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return out(x) + 1

  with pytest.raises(ValueError, match="Cannot serialize code with custom calls"):
    jax.export.export(jax.jit(with_kernel))(jax.ShapeDtypeStruct((4,), jnp.float32))
  cached = lowered_cache.cached_jit(with_kernel, cache_dir=str(tmp_path), description="kernel")
  text = cached.lower(jax.ShapeDtypeStruct((4,), jnp.float32)).as_text()
  assert "k3jax_test_not_a_stable_target" in text
  (name,) = entries(tmp_path)
  assert "k3jax_test_not_a_stable_target" in entry_header(tmp_path / name)["custom_call_targets"]


def test_a_hit_loads_the_runtime_of_its_kernels(tmp_path, monkeypatch):
  """A program read from the cache imports the module that sets up its custom calls' runtime (a
  warm launch traces nothing that would import it: Mosaic GPU's failed on the H200 without it);
  a miss traced the kernel code, and a program without such targets imports nothing."""
  def with_kernel(x):
    out = jax.ffi.ffi_call("mosaic_gpu_v2_k3jax_test", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return out(x) + 1

  imported = []
  real_import = lowered_cache.importlib.import_module
  monkeypatch.setattr(lowered_cache.importlib, "import_module",
                      lambda name: imported.append(name) or real_import("json"))
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  lowered_cache.cached_jit(with_kernel, cache_dir=str(tmp_path), description="kernel").lower(x)
  assert imported == []
  lowered_cache.cached_jit(with_kernel, cache_dir=str(tmp_path), description="kernel").lower(x)
  assert imported == ["jax.experimental.mosaic.gpu"]
  assert lowered_cache.load_kernel_runtimes(["cu_threefry2x32", "triton_kernel_call"]) == []


def test_output_tree_that_cannot_be_described_runs_uncached_with_a_warning(tmp_path, caplog):
  @struct.dataclass
  class LocalOut:  # defined in a function: cannot be imported by name on a later launch
    y: jax.Array

  fun = lambda x: LocalOut(y=x * 2)
  cached = lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="local")
  with caplog.at_level(logging.WARNING, logger=lowered_cache.__name__):
    out = cached(jnp.ones(3))
  np.testing.assert_array_equal(out.y, 2 * np.ones(3))
  assert entries(tmp_path) == []
  assert any("output tree cannot be stored" in r.getMessage() for r in caplog.records)


def test_treedef_json_round_trip():
  state = train_lib.TrainState(step=0, params={"a": [1, (2, None)]}, opt_state=(), moe_state={},
                               rng=3)
  tree = jax.tree.structure((state, {"m": 1.0}))
  assert lowered_cache.treedef_from_json(
      json.loads(json.dumps(lowered_cache.treedef_to_json(tree)))) == tree


def test_off_and_bad_arguments():
  fun = CountingStep()
  plain = lowered_cache.cached_jit(fun, cache_dir="", description="")
  assert not isinstance(plain, lowered_cache.LoweredCachedFunction)
  assert hasattr(plain, "lower")
  with pytest.raises(ValueError, match="description must be a non-empty str"):
    lowered_cache.cached_jit(fun, cache_dir="/tmp/x", description="")
  with pytest.raises(TypeError, match="cache_dir must be a str"):
    lowered_cache.cached_jit(fun, cache_dir=None, description="toy")


_LAUNCH = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from k3jax.runtime import lowered_cache
    traces = []
    def toy(state, x):
      traces.append(1)
      return {"w": state["w"] * x.sum()}, x.mean()
    f = lowered_cache.cached_jit(toy, cache_dir=sys.argv[1], description="launch",
                                 donate_argnums=(0,))
    out = f({"w": jnp.arange(4.0)}, jnp.ones((2, 3)))
    print(json.dumps({"traces": len(traces), "hits": f.hits,
                      "out": [v.tolist() for v in jax.tree.leaves(out)]}))
""")


def test_a_second_launch_hits(tmp_path):
  """Two processes: the key is stable across launches (no addresses, no per-process state)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  runs = [json.loads(subprocess.run(
      [sys.executable, "-c", _LAUNCH, str(tmp_path)], env=env, capture_output=True, text=True,
      check=True, timeout=300).stdout.strip().splitlines()[-1]) for _ in range(2)]
  assert [(r["traces"], r["hits"]) for r in runs] == [(1, 0), (0, 1)]
  assert runs[0]["out"] == runs[1]["out"]


@pytest.mark.slow
def test_train_step_and_init_through_the_cache(tmp_path, monkeypatch):
  """tiny model: init + 2 steps through the cache (a miss, then a hit after jax.clear_caches())
  equal the plain path bit for bit, and the hit never runs the step's Python (its loss). Its two
  layers are MLA (a dense one and a MoE one): the cache's machinery is the point, and an MLA
  layer compiles faster than a KDA one (test_a_warm_launch_hits_... exports the KDA model's
  step)."""
  cfg = config_lib.from_gin(["gin_configs/tiny.gin"],
                            TINY_RUN_BINDINGS + ["ModelConfig.mla_every = 1"])
  losses = []
  real_loss = train_step_lib.token_cross_entropy
  monkeypatch.setattr(train_step_lib, "token_cross_entropy",
                      lambda *a: losses.append(1) or real_loss(*a))
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(2):
    tokens = rng.integers(0, 256, size=(4, 17)).astype(np.int32)
    batches.append({"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
                    "segment_ids": jnp.ones((4, 16), jnp.int32),
                    "loss_mask": jnp.ones((4, 16), jnp.float32)})

  def run(cache_dir):
    runtime = Runtime(cfg.runtime, cache_dir)
    state, optimizer, schedule = train_lib.init_train_state(cfg, 10, runtime=runtime)
    init = jax.device_get(state)
    step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule,
                                     runtime, total_steps=10)
    return init, run_steps(step, state, batches), step

  expected_init, expected, _ = run("")
  cache = str(tmp_path / "lowered")
  for attempt in ("miss", "hit"):
    jax.clear_caches()
    losses.clear()
    init, got, step = run(cache)
    assert_bitwise_equal(init, expected_init)
    assert_bitwise_equal(got, expected)
    assert (step.hits, step.misses) == ((1, 0) if attempt == "hit" else (0, 1))
    assert len(losses) == (0 if attempt == "hit" else 1)
  assert len(entries(cache)) == 2   # the initialisation and the step
  with pytest.raises(ValueError, match="a runtime with a lowered-program cache needs total_steps"):
    train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), None, None,
                              runtime=Runtime(cfg.runtime, cache))


def _abstract_model_vars():
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS)
  from k3jax.model import init_variables
  return jax.eval_shape(lambda: init_variables(cfg.model, jax.random.PRNGKey(0), 1, 16,
                                               impl=cfg.impl))


def test_cached_abstract_hit_equals_the_traced_tree_without_tracing(tmp_path):
  import flax.linen as nn
  traced = _abstract_model_vars()
  first = lowered_cache.cached_abstract(str(tmp_path), "tiny 16", lambda: traced)
  assert first is traced                                        # a miss returns compute()'s tree
  assert len(list(tmp_path.glob("*" + lowered_cache.ABSTRACT_SUFFIX))) == 1

  def must_not_trace():
    raise AssertionError("a hit computed the tree again")
  hit = lowered_cache.cached_abstract(str(tmp_path), "tiny 16", must_not_trace)
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  a, ta = jax.tree.flatten(traced, is_leaf=is_box)
  b, tb = jax.tree.flatten(hit, is_leaf=is_box)
  assert ta == tb and len(a) > 40
  for x, y in zip(a, b):
    assert type(x) is type(y)
    if is_box(x):
      assert x.names == y.names
      x, y = x.value, y.value
    assert (x.shape, x.dtype, x.weak_type) == (y.shape, y.dtype, y.weak_type)
  # Another description is another entry; no cache folder computes every time.
  assert lowered_cache.cached_abstract(str(tmp_path), "tiny 32", lambda: 7) == 7
  assert lowered_cache.cached_abstract("", "tiny 16", lambda: 8) == 8


def test_cached_abstract_damaged_entry_is_rebuilt_and_other_trees_run_uncached(tmp_path, caplog):
  traced = _abstract_model_vars()
  lowered_cache.cached_abstract(str(tmp_path), "tiny", lambda: traced)
  (entry,) = tmp_path.glob("*" + lowered_cache.ABSTRACT_SUFFIX)
  entry.write_text(entry.read_text()[:100])
  with caplog.at_level(logging.WARNING, logger=lowered_cache.__name__):
    again = lowered_cache.cached_abstract(str(tmp_path), "tiny", lambda: traced)
  assert again is traced and "unreadable" in caplog.text
  assert lowered_cache.cached_abstract(str(tmp_path), "tiny", lambda: None) is not None  # rebuilt
  with caplog.at_level(logging.WARNING, logger=lowered_cache.__name__):
    odd = lowered_cache.cached_abstract(str(tmp_path), "odd", lambda: {"x": np.zeros(3)})
  assert isinstance(odd["x"], np.ndarray) and "not cached" in caplog.text


def test_lowered_cache_keys_names_what_made_a_second_entry(tmp_path):
  """The diagnosis tool lists a function's entries and, for the second, the key fields that
  differ from the first: here the description and the batch's leading dimension."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
  import lowered_cache_keys
  fun = CountingStep()
  lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy a")(
      toy_state(), toy_batch(rows=2))
  lowered_cache.cached_jit(fun, cache_dir=str(tmp_path), description="toy b")(
      toy_state(), toy_batch(rows=5))
  found = lowered_cache_keys.report(str(tmp_path))
  [(function, rows)] = found.items()
  assert len(rows) == 2 and rows[0][2] == []
  diffs = rows[1][2]
  assert any(d.startswith('/description: "toy a" -> "toy b"') for d in diffs), diffs
  # The batch leaf's leading dimension (the rest of its spec and the state's leaves are equal).
  assert [d for d in diffs if d.startswith("/args[")] == [
      d for d in diffs if d.startswith("/args[") and d.endswith("[0][0]: 2 -> 5")] != [], diffs
  header = lowered_cache.read_header(os.path.join(str(tmp_path), rows[0][0]))
  assert header["function"] == function and json.loads(header["key"])["description"] == "toy a"
  with pytest.raises(ValueError, match="not a"):
    (tmp_path / "other.jaxexport").write_bytes(b"something else entirely")
    lowered_cache.read_header(str(tmp_path / "other.jaxexport"))


def test_key_context_does_not_depend_on_what_was_imported_before():
  """tokamax registers JAX user contexts when imported: the key's trace context is the same in a
  process that imported it before computing a key and in one that had not (a warm launch that
  read its shapes from the cache had not, and missed every entry of the cold launch)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
  contexts = []
  for first in ("", "import tokamax"):
    script = textwrap.dedent(f"""
        import json
        {first}
        from k3jax.runtime import lowered_cache
        print(json.dumps(lowered_cache._trace_context()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    contexts.append(json.loads(out.stdout.strip().splitlines()[-1]))
  assert contexts[0] == contexts[1]
  assert sum(name == "user_context" for name, _ in contexts[0]) >= 2   # tokamax's are there


_WARM_LAUNCH = textwrap.dedent("""
    import json, sys
    from k3jax import config as config_lib, training as train_lib
    from k3jax.model import K3Model
    from k3jax.runtime import Runtime, precompile
    from testlib import TINY_RUN_BINDINGS
    cfg = config_lib.from_gin(["gin_configs/tiny.gin"], TINY_RUN_BINDINGS + [
        f"ImplConfig.moe_grouped_matmul = '{sys.argv[2]}'"])
    # As `k3jax train` starts: the state's shapes (cached: only the cold launch traces the model,
    # which imports tokamax for its grouped matmul), then the step lowered against them.
    runtime = Runtime.for_run(cfg, sys.argv[1])
    shapes, opt, sched = train_lib.placed_train_state_shapes(cfg, 10, runtime=runtime)
    step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), opt, sched, runtime,
                                     total_steps=10)
    step.lower(shapes, precompile.batch_shapes(cfg.stages.batch_size(0), cfg.stages.stages[0][0]))
    print(json.dumps({"hits": step.hits, "misses": step.misses,
                      "tokamax": "tokamax" in sys.modules}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("grouped_matmul", ["tokamax", "auto"])
def test_a_warm_launch_hits_whether_or_not_the_run_imports_tokamax(tmp_path, grouped_matmul):
  """With tokamax's grouped matmul, both launches import tokamax before their first key (else
  the cold one would import it while tracing the state's shapes, and the warm one, which reads
  the shapes from the cache and never traces the model, would not): the warm step finds the cold
  launch's entry (tokamax's JAX user contexts are in both keys). With 'auto' on CPU, neither
  launch imports tokamax at all (about 1.4 s of CPU a launch), and the warm one hits too."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
  runs = [json.loads(subprocess.run(
      [sys.executable, "-c", _WARM_LAUNCH, str(tmp_path), grouped_matmul], env=env,
      capture_output=True, text=True, check=True, timeout=600, cwd=REPO
  ).stdout.strip().splitlines()[-1]) for _ in range(2)]
  assert [(r["hits"], r["misses"]) for r in runs] == [(0, 1), (1, 0)], runs
  assert [r["tokamax"] for r in runs] == [grouped_matmul == "tokamax"] * 2, runs


def test_context_modules_follow_the_backend_and_the_kernel_settings():
  """tokamax is imported before the keys wherever a program may trace it: on an accelerator, or
  where a setting names its kernels; on CPU 'auto' never picks them."""
  impl = config_lib.ImplConfig()
  tokamax = lowered_cache.CONTEXT_REGISTERING_MODULES
  assert tokamax == ("tokamax",)
  assert context_modules_for(impl, "cpu") == ()
  assert context_modules_for(impl, "gpu") == context_modules_for(impl, "tpu") == tokamax
  for field, value in (("moe_grouped_matmul", "tokamax"), ("attention_impl", "tokamax"),
                       ("attention_impl", "tokamax_mosaic_bwd")):
    assert context_modules_for(dataclasses.replace(impl, **{field: value}), "cpu") == tokamax
  assert Runtime().context_modules == tokamax   # a library caller's default: always safe
  # What `k3jax train` builds: the lowered programs beside the compiled ones, the rule above.
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS)
  run = Runtime.for_run(cfg, "/cache")
  assert (run.lowered_cache_dir, run.context_modules) == ("/cache/lowered", ())
  assert Runtime.for_run(cfg, "").lowered_cache_dir == ""
