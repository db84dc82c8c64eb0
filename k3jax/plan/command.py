r"""The `plan` command: each curriculum stage's memory on one device of a mesh, before renting it.

  python -m k3jax.plan --gin_file=gin_configs/k3.gin --mesh=data:8,expert:8 --fsdp \
      --device_memory_gib=141 [--gin_bindings=...] [--backend=gpu|cpu] [--smallest_mesh]

(or `k3jax plan ...`). Per stage (StagesConfig.stages, its micro-batch, its remat policy from
ImplConfig.stage_remat): the parameters, optimizer state and gradients (exact, from the abstract
variables and their shardings), the activations the backward keeps and the peak's transient arrays
(an analytic model per layer: `k3jax/plan/activations.py`), their sum, whether it fits
--device_memory_gib, and for a stage that does not, the smallest change that makes it fit.
--mesh takes 'data', 'context' and 'expert' ('context' splits each row into contiguous slices);
a stage that MeshConfig.stage_axes gives a mesh of its own is planned on that one, as a run
places it, and the table then has a mesh column.
--smallest_mesh also prints, per stage, the fewest devices (a power of two, FSDP on) that fit and
their layout. Nothing is compiled or allocated. Exit codes: 0 (whether or not the stages fit), 2
for a bad flag or setting (one line naming it). docs/memory_plan.md says what is modelled.
"""

from __future__ import annotations

from typing import Sequence

from absl import flags

from k3jax import cli
from k3jax import config as config_lib
from k3jax.model import count_params
from k3jax.plan import (GIB, MAX_DEVICES, StagePlan, parse_mesh, plan_stages, smallest_mesh,
                        stage_meshes)
from k3jax.plan.activations import resolve_kernels

BACKENDS = ("gpu", "cpu")


def define_flags() -> None:
  cli.define_config_flags()
  flags.DEFINE_string("mesh", "", "The planned mesh: comma-separated 'axis:size' with axis in "
                      "('data', 'context', 'expert'), e.g. 'data:8,context:2,expert:8'; empty: one "
                      "device.")
  flags.DEFINE_float("device_memory_gib", 141.0, "Memory of one device in GiB (an H200: 141).")
  flags.DEFINE_boolean("fsdp", False, "Split the parameters and optimizer state over the batch "
                       "axes (the FSDP rules of k3jax.parallel.sharding.logical_axis_rules).")
  flags.DEFINE_boolean("fsdp_context", False, "With --smallest_mesh: also search meshes whose "
                       "context axis splits the FSDP-split state too (a what-if: the rule table "
                       "splits it over data x expert only).")
  flags.DEFINE_enum("backend", "gpu", BACKENDS, "The kernels ImplConfig's 'auto' choices resolve "
                    "to: the GPU's (Pallas KDA, tokamax grouped matmuls) or the CPU's (XLA).")
  flags.DEFINE_boolean("smallest_mesh", False, "Also print each stage's fewest devices (a power of "
                       "two, FSDP on) that fit, their layout and micro-batch (the largest "
                       "halving of the stage's StagesConfig.microbatch_tokens that fits).")
  cli.define_flags()
  for module in cli.SHARED_FLAG_MODULES:
    flags.adopt_module_key_flags(module)


def _gib(n: float) -> str:
  return f"{n / GIB:.2f}"


def _count(n: int) -> str:
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:.2f}{unit}"
  return str(n)


def table(plans: Sequence[StagePlan], meshes: Sequence[str] = ()) -> tuple[str, list[str]]:
  """(the unit, the per-stage table's lines): bytes per device in GiB, or MiB when every stage
  is under 1 GiB. meshes: each stage's mesh, a column after the stage's number (none when
  empty)."""
  totals = [p.memory.total for p in plans if p.memory is not None]
  unit, size = ("GiB", GIB) if max(totals) >= GIB else ("MiB", 2.0**20)
  num = lambda n: f"{n / size:.2f}"  # noqa: E731
  head = ("stage", "seq_len", "micro-batch", "remat", "params", "opt", "grads", "acts", "temps",
          "total", "fits")
  rows = [head]
  for plan in plans:
    m = plan.memory
    if m is None:
      rows.append((str(plan.stage),) + ("-",) * (len(head) - 2) + ("NO",))
      continue
    rows.append((str(m.stage), str(m.seq_len), f"{m.micro_rows}/{m.rows} rows", m.remat,
                 num(m.params), num(m.opt_state), num(m.grads), num(m.activations),
                 num(m.temporaries + m.batch + m.other), num(m.total),
                 "yes" if plan.fits else "NO"))
  first_number = 4
  if meshes:
    rows = [r[:1] + (mesh or "one device",) + r[1:] for r, mesh in zip(rows, ["mesh", *meshes])]
    first_number += 1
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return unit, ["  ".join(c.rjust(w) if first_number <= i < len(r) - 1 else c.ljust(w)
                          for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def report(cfg: config_lib.Config, mesh_flag: str, device_gib: float, fsdp: bool, backend: str,
           with_smallest: bool = False, fsdp_context: bool = False) -> list[str]:
  """The command's output lines. Raises ValueError naming the flag for a bad --mesh or
  --device_memory_gib."""
  if not device_gib > 0:
    raise ValueError(f"--device_memory_gib={device_gib} is not allowed: a positive number of GiB")
  mesh = parse_mesh(mesh_flag)
  plans = plan_stages(cfg, mesh, device_gib, fsdp, backend)
  total, _ = count_params(cfg.model)
  kernels = resolve_kernels(cfg.impl, backend, cfg.model)
  meshes = stage_meshes(cfg, mesh)
  if len({m for m, _ in meshes}) > 1:
    where = "each stage on its own mesh (MeshConfig.stage_axes, '' for --mesh)"
    unit, rows = table(plans, [m.spec() for m, _ in meshes])
  else:
    only = meshes[0][0]
    setting = "--mesh" if all(s == "--mesh" for _, s in meshes) else "MeshConfig.stage_axes"
    where = (f"{setting}={only.spec()} ({only.devices} devices)" if only.devices > 1
             else "one device")
    unit, rows = table(plans)
  lines = [f"memory plan: {where}, {'FSDP' if fsdp else 'no FSDP'}, {device_gib:g} GiB a device, "
           f"{backend} kernels (KDA {kernels.kda}, grouped matmul {kernels.grouped_matmul})",
           f"model: {_count(total)} parameters ({cfg.model.param_dtype}), activations "
           f"{cfg.model.dtype}, optimizer {cfg.optimizer.name}",
           f"{unit} per device. micro-batch: rows per micro-batch / per step; acts: what the "
           "backward keeps; temps: the peak's transient arrays, the batch and the balance state",
           ""] + rows
  for plan in plans:
    m = plan.memory
    if plan.fits:
      continue
    if m is None:
      over = plan.problem.split(": ", 1)[1] + ". "       # without the flag's name
    else:
      over = f"stage {m.stage} does not fit: {_gib(m.total)} GiB > {device_gib:g} GiB. "
    if plan.advice is None:
      lines.append(over + f"Nothing up to {MAX_DEVICES} devices fits it.")
    else:
      lines.append(over + f"The smallest change that fits: {plan.advice.what} "
                   f"({_gib(plan.advice.memory.total)} GiB).")
  if with_smallest:
    lines.append("")
    for what_if in (False, True) if fsdp_context else (False,):
      how = "FSDP also over context (what-if)" if what_if else "FSDP"
      for stage in range(len(cfg.stages.stages)):
        best = smallest_mesh(cfg, stage, device_gib, True, backend, fsdp_context=what_if,
                             microbatches=True)
        if best is None:
          lines.append(f"stage {stage}, {how}: nothing up to {MAX_DEVICES} devices fits")
        else:
          lines.append(f"stage {stage}, {how}: smallest mesh that fits: "
                       f"--mesh={best.mesh.spec() or 'one device'} ({best.mesh.devices} devices), "
                       f"micro-batches of {best.micro_rows} row{'s' * (best.micro_rows > 1)} "
                       f"({best.micro_rows * best.seq_len} "
                       f"tokens), {_gib(best.total)} GiB")
  return lines


def main(argv: Sequence[str]) -> None:
  FLAGS = flags.FLAGS
  cli.start(argv)

  def run() -> int:
    cfg = cli.config_from_flags(FLAGS.gin_file, FLAGS.gin_bindings)
    print("\n".join(report(cfg, FLAGS.mesh, FLAGS.device_memory_gib, FLAGS.fsdp, FLAGS.backend,
                           FLAGS.smallest_mesh, FLAGS.fsdp_context)))
    return 0

  cli.finish(run, usage_errors=(ValueError,))
