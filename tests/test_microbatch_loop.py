"""RuntimeConfig.microbatch_loop = 'host' (k3jax.runtime.host_loop.HostLoopStep) against
'scan'."""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax import training as train_lib
from k3jax.model import K3Model
from k3jax.parallel import sharding as sharding_lib
from k3jax.runtime import host_loop as microbatch_lib
from testlib import TINY_RUN_BINDINGS, mesh_train_step

METRICS = ("loss", "total_loss", "aux_loss", "grad_norm", "lr")


def _batches(cfg: config_lib.Config, num: int) -> list[dict]:
  """`num` stage-0 batches of random tokens with a loss mask of unequal counts per row."""
  rng = np.random.default_rng(0)
  rows, seq_len = cfg.stages.batch_size(0), cfg.stages.stages[0][0]
  out = []
  for _ in range(num):
    tokens = rng.integers(1, cfg.model.vocab_size, (rows, seq_len + 1)).astype(np.int32)
    segments = np.ones((rows, seq_len), np.int32)
    segments[::2, seq_len // 2:] = 2   # packed rows in every other row
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
                "loss_mask": (rng.random((rows, seq_len)) > 0.3).astype(np.float32)})
  return out


def _run(loop: str, bindings: list[str], steps: int = 2, mesh_axes: str = "",
         compiled: bool = False, cast_once: bool = True):
  """`steps` training steps with RuntimeConfig.microbatch_loop = `loop`: (final state, per-step
  metrics), on host. compiled: the steps run through one `step.lower(...).compile()` of the first
  step's arguments (train_bench's way; the batches share their shapes) instead of the step itself.
  cast_once: the host loop's (`HostLoopStep`)."""
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS + bindings + [
      f"RuntimeConfig.microbatch_loop = {loop!r}", f"MeshConfig.axes = {mesh_axes!r}"])
  mesh = sharding_lib.make_run_mesh(cfg)
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10, mesh=mesh)
  initial_shardings = jax.tree.map(lambda x: x.sharding, state)
  step = mesh_train_step(cfg, state, optimizer, schedule, mesh)
  assert isinstance(step, microbatch_lib.HostLoopStep) == (loop == "host")
  if not cast_once:
    step._cast_once = False   # pylint: disable=protected-access
  place = (lambda b: jax.tree.map(jnp.asarray, b)) if mesh is None else \
      (lambda b: sharding_lib.shard_batch(b, mesh))
  metrics, fn = [], None
  with sharding_lib.with_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for batch in _batches(cfg, steps):
      batch = place(batch)
      if fn is None:
        fn = step.lower(state, batch).compile() if compiled else step
      state, m = fn(state, batch)
      metrics.append(jax.device_get(m))
  if mesh is not None:
    assert jax.tree.map(lambda x: x.sharding, state) == initial_shardings
  return jax.device_get(state), metrics


def _assert_close(actual, expected, what: str, rtol: float = 1e-6):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(b))), 1e-30) if b.size else 1.0
    assert a.shape == b.shape and float(np.max(np.abs(a - b), initial=0.0)) <= rtol * scale, \
        f"{what}{jax.tree_util.keystr(path)}"


def _assert_same_training(host, scan):
  (state_h, metrics_h), (state_s, metrics_s) = host, scan
  assert len(metrics_h) == len(metrics_s)
  for m_h, m_s in zip(metrics_h, metrics_s):
    for key in METRICS:
      _assert_close(m_h[key], m_s[key], key)
    assert jax.tree.structure(m_h["moe_stats"]) == jax.tree.structure(m_s["moe_stats"])
    _assert_close(m_h["moe_stats"], m_s["moe_stats"], "moe_stats")
  assert int(state_h.step) == int(state_s.step) == len(metrics_s)
  for name in ("params", "opt_state", "moe_state", "rng"):
    assert jax.tree.structure(getattr(state_h, name)) == jax.tree.structure(getattr(state_s, name))
    _assert_close(getattr(state_h, name), getattr(state_s, name), name)


@pytest.mark.parametrize("bindings", [
    # One micro-batch: the gradients' program, then the update's (QK-Clip's max logits and the
    # balance state pass between them).
    ["OptimizerConfig.qk_clip_tau = 2.0"],
    # Quantile Balancing pools its statistics over the 2 micro-batches (16 tokens a row, 4 rows).
    ["StagesConfig.microbatch_tokens = 32"],
    # ... or, with the 'microbatch' cadence, threads its biases through them (exact quantile).
    ["StagesConfig.microbatch_tokens = 32", "ModelConfig.moe_qb_cadence = 'microbatch'",
     "ModelConfig.moe_qb_histogram_bins = 0"],
    # 4 micro-batches of one row; aux losses and QK-Clip's max logits accumulate.
    ["StagesConfig.microbatch_tokens = 16", "ModelConfig.moe_balance = 'aux_loss'",
     "OptimizerConfig.qk_clip_tau = 2.0"],
], ids=["1_micro_qkclip", "2_micro_qb", "2_micro_qb_chained", "4_micro_aux_qkclip"])
def test_host_loop_equals_scan(bindings):
  """Two fp32 steps of tiny.gin's model: the host loop of programs gives the scan's losses, grad
  norms, MoE stats, parameters, optimizer and balance state (<= 1e-6 relative)."""
  scan = _run("scan", bindings)
  host = _run("host", bindings)
  _assert_same_training(host, scan)
  if any("aux_loss" in b for b in bindings):   # the aux sums are compared, not zeros
    assert all(float(m["aux_loss"]) > 0 for m in host[1])


@pytest.mark.parametrize("bindings, programs", [
    (["StagesConfig.microbatch_tokens = 32"],
     ["train_step_microbatch", "train_step_prepare", "train_step_update"]),
    ([], ["train_step_grads", "train_step_update"]),
], ids=["2_micro", "1_micro"])
def test_host_loop_lowered_and_compiled_equals_its_call(bindings, programs):
  """`lower(state, batch).compile()` (what train_bench times) runs the same programs, named for
  the 'train_step' dump filter, with the call's results: a step of each from the same state."""
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS + bindings + [
      "RuntimeConfig.microbatch_loop = 'host'"])
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10)
  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule)
  assert isinstance(step, microbatch_lib.HostLoopStep)
  batch = jax.tree.map(jnp.asarray, _batches(cfg, 1)[0])
  compiled = step.lower(state, batch).compile()
  assert sorted(compiled.programs) == programs
  assert all(c.memory_analysis() is not None for c in compiled.programs.values())
  # Each run donates its own copy of the initial state, placed as `init_train_state` places it.
  initial = jax.device_get(state)
  runs = [jax.device_get(fn(jax.device_put(initial, jax.devices()[0]), batch))
          for fn in (compiled, step)]
  _assert_same_training(*[(new_state, [metrics]) for new_state, metrics in runs])


def test_host_loop_casts_the_weights_once_with_the_same_training():
  """A bf16 model with a scanned decoder (dense first layer, a scanned group of two periods, the
  last MLA layer): the prepare program casts the fp32 weights that the loss reads only as bf16
  (most of them, the stacked ones too), the micro-batch programs read those copies, and two
  compiled steps of 2 micro-batches give bit for bit the state and metrics of casting in every
  micro-batch. (That the call gives the compiled programs' results:
  test_host_loop_lowered_and_compiled_equals_its_call.)"""
  from k3jax.runtime import param_casts
  bindings = ["StagesConfig.microbatch_tokens = 32", "ModelConfig.dtype = 'bfloat16'",
              "ModelConfig.num_layers = 6", "ImplConfig.scan_layers = True"]
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS + bindings + [
      "RuntimeConfig.microbatch_loop = 'host'"])
  # The cast dtypes depend on the shapes alone: the state's shapes, not its values (whose
  # initialisation `_run` compiles).
  state, optimizer, schedule = train_lib.train_state_shapes(cfg, total_steps=10)
  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule)
  batch = jax.tree.map(jnp.asarray, _batches(cfg, 1)[0])
  dtypes, _ = step._info(state.params, state.moe_state, batch, 2)  # pylint: disable=W0212
  sizes = [x.size for x in jax.tree.leaves(state.params)]
  cast = sum(n for n, d in zip(sizes, dtypes) if d is not None)
  assert set(dtypes) == {None, jnp.dtype(jnp.bfloat16)} and cast > 0.7 * sum(sizes)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
  by_name = lambda word: {d for p, d in zip(paths, dtypes) if word in p}
  assert by_name("w_gate") == by_name("q_proj") == {jnp.dtype(jnp.bfloat16)}
  assert by_name("scanned") >= {jnp.dtype(jnp.bfloat16)}
  # Read in fp32: the router's weight (as bf16 pieces, not a cast), the embedding, norm scales.
  assert by_name("router") == by_name("embedding") == by_name("scale") == {None}
  copies = jax.eval_shape(lambda p: param_casts.narrow_copies(p, list(dtypes)), state.params)
  assert {x.dtype for x in jax.tree.leaves(copies)} == {jnp.dtype(jnp.bfloat16)}
  once = _run("host", bindings, compiled=True)
  every = _run("host", bindings, compiled=True, cast_once=False)
  _assert_close(once, every, "cast once against every micro-batch: ", rtol=0.0)


def test_one_microbatch_runs_as_gradients_then_update():
  """With 'host' and a batch of one micro-batch, the step lowers to two programs, the gradients'
  and the update's."""
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS + ["RuntimeConfig.microbatch_loop = 'host'"])
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10)
  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule)
  lowered = step.lower(state, jax.tree.map(jnp.asarray, _batches(cfg, 1)[0]))
  assert isinstance(lowered, microbatch_lib.HostLoopLowered)
  assert list(lowered.programs) == ["train_step_grads", "train_step_update"]
  assert "train_step_grads" in lowered.programs["train_step_grads"].as_text()[:2000]


def test_host_loop_programs_compile_at_once_and_a_failure_is_raised():
  """`HostLoopLowered.compile` runs the programs' compiles concurrently (each of these waits until
  all three have started: one after the other, the barrier would time out) and raises a
  program's compile error."""
  barrier = threading.Barrier(3, timeout=30)

  class Program:
    def __init__(self, fail=False):
      self.fail = fail

    def compile(self):
      barrier.wait()
      if self.fail:
        raise RuntimeError("no compile for you")
      return threading.current_thread().name

  names = ("train_step_prepare", "train_step_microbatch", "train_step_update")
  compiled = microbatch_lib.HostLoopLowered({n: Program() for n in names}).compile()
  assert list(compiled.programs) == list(names)
  assert len(set(compiled.programs.values())) == 3   # three threads
  barrier.reset()
  with pytest.raises(RuntimeError, match="no compile for you"):
    microbatch_lib.HostLoopLowered({n: Program(fail=n == names[2]) for n in names}).compile()


def test_deferred_program_lowers_while_the_others_compile():
  """`HostLoopLowered.compile` starts the lowered programs' compiles before it lowers a deferred
  program (the update's tracing then overlaps the gradients' compile); `programs` lowers it too,
  once."""
  compiling, lowered_b = threading.Event(), threading.Event()
  lowerings = []

  class Program:
    def __init__(self, name):
      self.name = name

    def compile(self):
      if self.name == "a":
        compiling.set()
        assert lowered_b.wait(30), "b was not lowered while a compiled"
      return self.name

  def lower_b():
    assert compiling.wait(30), "b was lowered before a's compile started"
    lowerings.append("b")
    lowered_b.set()
    return Program("b")

  compiled = microbatch_lib.HostLoopLowered({"a": Program("a")}, {"b": lower_b}).compile()
  assert compiled.programs == {"a": "a", "b": "b"} and lowerings == ["b"]
  lowered = microbatch_lib.HostLoopLowered({"a": Program("a")}, {"b": lambda: Program("b")})
  assert list(lowered.programs) == ["a", "b"] and lowered.programs["b"].name == "b"


@pytest.mark.slow
def test_host_loop_equals_scan_on_the_expert_mesh():
  """On a data:2 x expert:4 mesh of 8 CPU devices (16 rows, 2 micro-batches of 8): the same
  training as 'scan', and the state keeps its shardings."""
  bindings = ["StagesConfig.tokens_per_step = 256", "StagesConfig.stages = ((16, 10),)",
              "StagesConfig.microbatch_tokens = 128"]
  _assert_same_training(_run("host", bindings, mesh_axes="data:2,expert:4"),
                        _run("scan", bindings, mesh_axes="data:2,expert:4"))


def test_microbatch_loop_config_error():
  with pytest.raises(config_lib.ConfigError,
                     match=r"RuntimeConfig.microbatch_loop = 'python' is not allowed: one of "
                           r"\('scan', 'host'\)"):
    config_lib.from_gin([], TINY_RUN_BINDINGS + ["RuntimeConfig.microbatch_loop = 'python'"])
