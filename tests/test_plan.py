"""The memory plan (`k3jax.plan`) against the compiled training step's own memory analysis, and its
command line.

The reference is XLA's: `jax.jit(train_step).lower(state, batch).compile().memory_analysis()` of
the step that `k3jax.training.step.make_train_step` builds, with the state placed as
`k3jax.training.state` places it (`sharding.state_shardings`, FSDP's rule table where the case
says so) on the 8 virtual CPU devices of tests/conftest.py. Two quantities are compared:

  persistent  the plan's state (parameters, optimizer state, balance biases, step, PRNG key) plus
              the step's batch, against `argument_size_in_bytes` (the step's arguments are exactly
              those): equal to the byte.
  peak        the plan's total (state, gradients, batch, kept activations, the peak's transient
              arrays) against argument + output − alias + temp: within 10 %.

The cases are tiny K3 variants on the CPU kernels (`backend='cpu'`: XLA's blockwise attention,
the XLA depth mix): MLA layers only (ModelConfig.mla_every = 1), since XLA:CPU's chunked KDA and
tiled grouped matmul keep zero-filled buffers that its scheduler allocates early, which the plan
does not model (docs/memory_plan.md gives those figures); with expert-parallel MoE the same holds.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import pytest

from k3jax import config as config_lib
from k3jax.model import K3Model, init_variables
from k3jax.parallel import sharding
from k3jax.plan import (MeshShape, advise, parse_mesh, plan_stages, smallest_mesh, stage_memory,
                        stage_meshes, state_bytes)
from k3jax.plan import activations as acts
from k3jax.runtime import batch_shapes
from k3jax.training.state import train_state_shapes
from k3jax.training.step import make_train_step
from testlib import run_command_forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLA = ["ModelConfig.mla_every = 1", "ImplConfig.scan_layers = False"]
DENSE = MLA + ["ModelConfig.moe_num_experts = 0"]

# (name, bindings on tiny.gin, mesh, fsdp, stage): stage 1 is 32 rows of 128 tokens.
CASES = [
    ("one_device", DENSE, "", False, 1),
    ("data8", DENSE, "data:8", False, 1),
    ("data8_fsdp", DENSE, "data:8", True, 1),
    ("one_device_remat_full", DENSE + ["ImplConfig.remat = 'full'"], "", False, 1),
    ("data8_moe_capacity", MLA + ["ModelConfig.moe_capacity_factor = 1.25"], "data:8", False, 1),
]


def _config(bindings) -> config_lib.Config:
  return config_lib.from_gin([os.path.join(REPO, "gin_configs/tiny.gin")], list(bindings))


def compiled_memory(cfg: config_lib.Config, stage: int, mesh_spec: str, fsdp: bool):
  """The compiled step's `memory_analysis()` for `stage` on a mesh of the CPU devices ('' : one
  device, no mesh)."""
  impl = cfg.stage_impl(stage)
  stage_cfg = dataclasses.replace(cfg, impl=impl)
  seq_len, rows = cfg.stages.stages[stage][0], cfg.stages.batch_size(stage)
  total = cfg.stages.total_steps
  shapes, optimizer, schedule = train_state_shapes(cfg, total)
  model = K3Model(cfg.model, impl)
  if not mesh_spec:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device,
                                                         weak_type=x.weak_type), shapes)
    step = make_train_step(stage_cfg, model, optimizer, schedule, total_steps=total)
    return step.lower(placed, batch_shapes(rows, seq_len, device)).compile().memory_analysis()
  mesh = sharding.make_mesh(mesh_spec, jax.devices()[:parse_mesh(mesh_spec).devices])
  rules = sharding.logical_axis_rules(fsdp)
  boxed = jax.eval_shape(lambda: init_variables(cfg.model, jax.random.PRNGKey(0), 1, 1,
                                                 impl=cfg.impl))
  shardings = sharding.state_shardings(shapes, boxed, mesh, rules)
  placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s,
                                                          weak_type=x.weak_type), shapes, shardings)
  step = make_train_step(stage_cfg, model, optimizer, schedule, state_shardings=shardings,
                         batch_shardings=sharding.batch_sharding(mesh), total_steps=total)
  with sharding.with_mesh(mesh, rules):
    lowered = step.lower(placed, batch_shapes(rows, seq_len, sharding.batch_sharding(mesh)))
  return lowered.compile().memory_analysis()


@pytest.mark.parametrize("name, bindings, mesh, fsdp, stage", CASES, ids=[c[0] for c in CASES])
def test_plan_agrees_with_the_compiled_step(name, bindings, mesh, fsdp, stage):
  cfg = _config(bindings)
  plan = stage_memory(cfg, stage, parse_mesh(mesh), fsdp, backend="cpu")
  compiled = compiled_memory(cfg, stage, mesh, fsdp)
  assert plan.persistent + plan.batch == compiled.argument_size_in_bytes, name
  peak = (compiled.argument_size_in_bytes + compiled.output_size_in_bytes
          - compiled.alias_size_in_bytes + compiled.temp_size_in_bytes)
  ratio = plan.total / peak
  assert 0.9 <= ratio <= 1.1, (name, plan, peak, ratio)


def test_state_bytes_follow_the_shardings():
  """FSDP splits the state over data x expert; the expert axis splits the routed experts alone;
  the context axis splits no state."""
  cfg = _config([])
  one = state_bytes(cfg, {})
  assert one.params == one.params_global
  assert state_bytes(cfg, {"data": 8}).persistent == one.persistent
  assert state_bytes(cfg, {"context": 4}).persistent == one.persistent
  expert = state_bytes(cfg, {"expert": 4})
  assert one.params / 4 < expert.params < one.params
  fsdp = state_bytes(cfg, {"data": 8}, fsdp=True)
  assert fsdp.params < one.params / 4 and fsdp.gathered_layer > 0
  assert state_bytes(cfg, {"data": 2, "context": 4}, True, fsdp_context=True).params < \
      state_bytes(cfg, {"data": 2, "context": 4}, True).params


def test_context_axis_divides_activations_and_gathers_the_mla_latent():
  """A context axis of c splits every row: the tokens on a device fall c-fold, while each MLA
  layer keeps its whole row's latent, keys and values."""
  cfg = _config(MLA + ["ModelConfig.moe_num_experts = 0"])
  one = stage_memory(cfg, 3, MeshShape(), backend="gpu")
  split = stage_memory(cfg, 3, MeshShape(context=4), backend="gpu")
  assert split.tokens * 4 == one.tokens
  assert split.activations < one.activations
  mla_one, _ = acts.mla_bytes(cfg.model, 1)
  mla_four, _ = acts.mla_bytes(cfg.model, 4)
  h, dqk = cfg.model.mla_num_heads, cfg.model.mla_qk_nope_dim + cfg.model.mla_qk_rope_dim
  assert mla_four - mla_one > 3 * 4 * h * (dqk + cfg.model.mla_v_dim)   # fp32 k, v: 4 x the row


def test_parse_mesh_takes_context_and_names_the_flag():
  assert parse_mesh("data:2,context:4,expert:8") == MeshShape(2, 4, 8)
  assert parse_mesh("") == MeshShape()
  for bad in ("model:2", "data:0", "data:2,data:2", "data"):
    with pytest.raises(ValueError, match="--mesh="):
      parse_mesh(bad)


def test_advice_makes_the_stage_fit():
  cfg = _config([])
  gib = 0.12
  plans = plan_stages(cfg, parse_mesh("data:2"), gib, backend="cpu")
  assert not plans[0].fits
  change = plans[0].advice
  assert change is not None and change.memory.total <= gib * 2**30
  assert "remat 'full'" in change.what
  best = smallest_mesh(cfg, 0, 0.05, backend="cpu")
  assert best is not None and best.total <= 0.05 * 2**30 and best.mesh.devices > 1
  assert advise(cfg, 0, MeshShape(), 1e-6, backend="cpu") is None    # nothing is that small


STAGE_AXES = "MeshConfig.stage_axes = ('data:8', '', 'data:2,context:4', 'context:8')"


def test_stage_axes_plan_each_stage_on_its_own_mesh():
  """With MeshConfig.stage_axes each stage's plan is the one its mesh alone gives ('' : --mesh);
  a stage that its own mesh does not divide gets no memory and a problem that names the entry."""
  cfg = _config([STAGE_AXES])
  assert [m.spec() for m, _ in stage_meshes(cfg, parse_mesh("data:2"))] == \
      ["data:8", "data:2", "data:2,context:4", "context:8"]
  plans = plan_stages(cfg, parse_mesh("data:2"), 1.0, backend="cpu")
  for stage, spec in enumerate(["data:8", "data:2", "data:2,context:4", "context:8"]):
    alone = plan_stages(_config([]), parse_mesh(spec), 1.0, backend="cpu")[stage]
    assert plans[stage].memory == alone.memory, (stage, spec)
  odd = plan_stages(_config(["MeshConfig.stage_axes = ('', 'data:3', '', '')"]), MeshShape(),
                    1.0, backend="cpu")
  assert [p.memory is None for p in odd] == [False, True, False, False]
  assert odd[1].problem.startswith("MeshConfig.stage_axes[1]='data:3': stage 1 (seq_len 128)")


def run_plan(*args: str, forked: bool = False) -> subprocess.CompletedProcess:
  """`python -m k3jax.plan ARGS`; forked: from the tests' command server (configuration errors,
  `testlib.run_command_forked`)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  if forked:
    return run_command_forked("k3jax.plan", args, env, REPO)
  return subprocess.run([sys.executable, "-m", "k3jax.plan", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_command_prints_a_row_per_stage():
  proc = run_plan("--gin_file=gin_configs/tiny.gin", "--mesh=data:2", "--device_memory_gib=0.12",
                  "--backend=cpu")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("memory plan: --mesh=data:2 (2 devices), no FSDP, 0.12 GiB")
  head = next(i for i, line in enumerate(lines) if line.startswith("stage  seq_len"))
  assert "params" in lines[head] and "total" in lines[head] and "fits" in lines[head]
  rows = [line.split() for line in lines[head + 1:head + 5]]
  assert [r[0] for r in rows] == ["0", "1", "2", "3"] and [r[1] for r in rows] == \
      ["16", "128", "512", "2048"]
  assert all(r[-1] == "NO" for r in rows)
  assert "stage 0 does not fit" in proc.stdout and "The smallest change that fits" in proc.stdout


def test_command_shows_each_stage_mesh():
  proc = run_plan("--gin_file=gin_configs/tiny.gin", "--mesh=data:2", "--device_memory_gib=1",
                  "--backend=cpu", f"--gin_bindings={STAGE_AXES}")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("memory plan: each stage on its own mesh (MeshConfig.stage_axes")
  head = next(i for i, line in enumerate(lines) if line.startswith("stage  mesh"))
  assert [line.split()[:3] for line in lines[head + 1:head + 5]] == [
      ["0", "data:8", "16"], ["1", "data:2", "128"], ["2", "data:2,context:4", "512"],
      ["3", "context:8", "2048"]]


@pytest.mark.parametrize("flag, message", [
    ("--mesh=model:2", "--mesh='model:2': bad entry 'model:2'"),
    ("--mesh=data:3", "--mesh='data:3': stage 0 (seq_len 16) runs micro-batches of 256 rows"),
    ("--mesh=expert:3", "--mesh='expert:3': ModelConfig.moe_num_experts = 8 is not divisible"),
    ("--device_memory_gib=0", "--device_memory_gib=0.0 is not allowed"),
])
def test_command_bad_flags_are_one_line(flag, message):
  proc = run_plan("--gin_file=gin_configs/tiny.gin", flag, forked=True)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
