"""Memory plans: what one device holds in each curriculum stage, before renting the devices.

    from k3jax.plan import MeshShape, plan_stages, parse_mesh, smallest_mesh
    cfg = config.from_gin(["gin_configs/k3.gin"])
    for stage in plan_stages(cfg, parse_mesh("data:8,expert:8"), device_gib=141, fsdp=True):
      print(stage.memory.total / 2**30, stage.fits, stage.advice)

Per stage and device: the parameters, the optimizer state and the gradients (exact, from the
abstract variables and their shardings: `k3jax.plan.state`), the activations the backward pass
keeps and the peak's transient arrays (an analytic model per layer kind and remat policy:
`k3jax.plan.activations`, composed along the backward pass in `k3jax.plan.estimate`), their sum,
whether it fits, and when it does not, the smallest change that makes it fit (`advise`). The
command line is `k3jax plan` (`k3jax.plan.command`); docs/memory_plan.md says what is modelled
and how it compared with compiled programs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

from k3jax import config as config_lib
from k3jax.plan.estimate import (MESH_AXES, MeshShape, StageMemory, check_mesh, parse_mesh,
                                 stage_memory)
from k3jax.plan.state import StateBytes, state_bytes

__all__ = ["MESH_AXES", "MeshShape", "StageMemory", "StagePlan", "Change", "advise",
           "check_mesh", "parse_mesh", "plan_stages", "smallest_mesh", "stage_meshes",
           "stage_memory", "state_bytes", "StateBytes"]

GIB = float(1 << 30)
# The most tokens a chunk that `advise` proposes for ImplConfig.position_chunk_tokens has
# (small.gin's), and the most bytes its fp32 logits, softmax and their gradient may take.
CHUNK_TOKENS = 65536
CHUNK_LOGIT_BYTES = 8 * GIB
# The most devices `smallest_mesh` tries.
MAX_DEVICES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Change:
  """A change that makes a stage fit: `what` says it in settings and flags (one line), `memory`
  is the stage's plan with it."""
  what: str
  memory: StageMemory
  mesh: MeshShape
  fsdp: bool


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One stage's plan: its memory (None when the mesh does not divide the stage: `problem` says
  why), whether it fits the device, and if not the smallest change that makes it fit (None when
  it fits, or when nothing up to MAX_DEVICES devices does)."""
  stage: int
  memory: Optional[StageMemory]
  fits: bool
  advice: Optional[Change]
  problem: str = ""


def _with_stage_remat(cfg: config_lib.Config, stage: int, remat: str) -> config_lib.Config:
  n = len(cfg.stages.stages)
  policies = list(cfg.impl.stage_remat or (cfg.impl.remat,) * n)
  policies[stage] = remat
  return dataclasses.replace(cfg, impl=dataclasses.replace(cfg.impl, stage_remat=tuple(policies)))


def chunk_tokens(cfg: config_lib.Config) -> int:
  """The ImplConfig.position_chunk_tokens that `advise` proposes: CHUNK_TOKENS, or the largest
  power of two whose chunk's fp32 logits, softmax and gradient take CHUNK_LOGIT_BYTES at most
  (4096 at K3's vocabulary of 163840)."""
  fit = CHUNK_LOGIT_BYTES / (3 * 4 * cfg.model.vocab_size)
  return int(min(CHUNK_TOKENS, 2 ** max(0, math.floor(math.log2(fit)))))


def _with_chunks(cfg: config_lib.Config) -> config_lib.Config:
  impl = dataclasses.replace(cfg.impl, position_chunk_tokens=chunk_tokens(cfg))
  return dataclasses.replace(cfg, impl=impl)


def _with_microbatch(cfg: config_lib.Config, tokens: int) -> config_lib.Config:
  return dataclasses.replace(cfg, stages=dataclasses.replace(cfg.stages, microbatch_tokens=tokens))


def _fits(memory: StageMemory, limit: float) -> bool:
  return memory.total <= limit


def _try(cfg, stage, mesh, fsdp, backend, limit, fsdp_context=False) -> Optional[StageMemory]:
  """The stage's plan when the mesh divides it and it fits, else None."""
  try:
    memory = stage_memory(cfg, stage, mesh, fsdp, backend, fsdp_context=fsdp_context)
  except ValueError:
    return None
  return memory if _fits(memory, limit) else None


def _microbatch_choices(cfg: config_lib.Config, stage: int, mesh: MeshShape) -> Iterator[int]:
  """Smaller StagesConfig.microbatch_tokens, largest first: halvings of the stage's micro-batch
  that divide the step and keep whole rows on every batch shard."""
  scfg = cfg.stages
  seq_len = scfg.stages[stage][0]
  tokens = scfg.microbatch_rows(seq_len, scfg.batch_size(stage)) * seq_len
  while tokens % 2 == 0 and tokens // 2 >= seq_len * mesh.batch_shards:
    tokens //= 2
    if scfg.tokens_per_step % tokens == 0:
      yield tokens


def _layouts(devices: int, cfg: config_lib.Config, stage: int) -> Iterator[MeshShape]:
  """Every data x context x expert layout of `devices` (powers of two) that the stage's
  micro-batch, row length and experts divide."""
  experts = cfg.model.moe_num_experts or 1
  e = 1
  while e <= devices:
    if experts % e == 0:
      c = 1
      while e * c <= devices:
        mesh = MeshShape(data=devices // (e * c), context=c, expert=e)
        try:
          check_mesh(cfg, mesh, stages=[stage])
        except ValueError:
          pass
        else:
          yield mesh
        c *= 2
    e *= 2


def smallest_mesh(cfg: config_lib.Config, stage: int, device_gib: float, fsdp: bool = True,
                  backend: str = "gpu", min_devices: int = 1,
                  max_devices: int = MAX_DEVICES, fsdp_context: bool = False,
                  microbatches: bool = False) -> Optional[StageMemory]:
  """The plan of `stage` on the smallest power-of-two number of devices (from `min_devices`)
  for which some data x context x expert layout fits `device_gib`; of that number's layouts, the
  one with the least memory. With `microbatches`, a layout that does not fit may take the largest
  smaller StagesConfig.microbatch_tokens that fits (the plan's micro_rows says which). None when
  nothing up to `max_devices` fits. The layout is the returned plan's `mesh`."""
  limit = device_gib * GIB
  devices = 1 << max(0, math.ceil(math.log2(max(1, min_devices))))
  while devices <= max_devices:
    best = None
    for mesh in _layouts(devices, cfg, stage):
      use_fsdp = fsdp and devices > 1
      memory = _try(cfg, stage, mesh, use_fsdp, backend, limit, fsdp_context)
      if memory is None and microbatches:
        for tokens in _microbatch_choices(cfg, stage, mesh):
          memory = _try(_with_microbatch(cfg, tokens), stage, mesh, use_fsdp, backend, limit,
                        fsdp_context)
          if memory is not None:
            break
      if memory is not None and (best is None or memory.total < best.total):
        best = memory
    if best is not None:
      return best
    devices *= 2
  return None


def advise(cfg: config_lib.Config, stage: int, mesh: MeshShape, device_gib: float,
           fsdp: bool = False, backend: str = "gpu") -> Optional[Change]:
  """The smallest change that makes `stage` fit `device_gib` on `mesh`, trying, in order: one
  setting on the same devices (ImplConfig.position_chunk_tokens, remat 'full' for the stage, FSDP,
  then the largest smaller StagesConfig.microbatch_tokens that fits); all of those together; and
  then the fewest devices (powers of two) in any data x context x expert layout, with FSDP and the
  settings that were needed. None when nothing up to MAX_DEVICES devices fits."""
  limit = device_gib * GIB
  impl = cfg.stage_impl(stage)
  singles = []
  if impl.position_chunk_tokens == 0:
    singles.append((_with_chunks(cfg), fsdp,
                    f"ImplConfig.position_chunk_tokens = {chunk_tokens(cfg)}"))
  if impl.remat != "full":
    singles.append((_with_stage_remat(cfg, stage, "full"), fsdp,
                    f"remat 'full' in stage {stage} (ImplConfig.stage_remat)"))
  if not fsdp and mesh.devices > 1:
    singles.append((cfg, True, "--fsdp (parameters and optimizer state split over data x expert)"))
  for candidate, with_fsdp, what in singles:
    memory = _try(candidate, stage, mesh, with_fsdp, backend, limit)
    if memory is not None:
      return Change(what, memory, mesh, with_fsdp)
  for tokens in _microbatch_choices(cfg, stage, mesh):
    memory = _try(_with_microbatch(cfg, tokens), stage, mesh, fsdp, backend, limit)
    if memory is not None:
      return Change(f"StagesConfig.microbatch_tokens = {tokens}", memory, mesh, fsdp)
  # Several settings at once on the same devices (with the largest micro-batch that fits), then
  # more devices: of the settings, only those the fit needs are kept.
  settings = []
  if impl.position_chunk_tokens == 0:
    settings.append((f"ImplConfig.position_chunk_tokens = {chunk_tokens(cfg)}", _with_chunks))
  if impl.remat != "full":
    settings.append((f"remat 'full' in stage {stage}",
                     lambda c: _with_stage_remat(c, stage, "full")))

  def apply(names, micro=None):
    out = cfg if micro is None else _with_microbatch(cfg, micro)
    for name, change in settings:
      if name in names:
        out = change(out)
    return out

  every = [name for name, _ in settings]
  with_fsdp = fsdp or mesh.devices > 1
  grown, micro = mesh, None
  memory = _try(apply(every), stage, mesh, with_fsdp, backend, limit)
  for tokens in [] if memory is not None else _microbatch_choices(cfg, stage, mesh):
    memory = _try(apply(every, tokens), stage, mesh, with_fsdp, backend, limit)
    if memory is not None:
      micro = tokens
      break
  if memory is None:
    memory = smallest_mesh(apply(every), stage, device_gib, True, backend,
                           min_devices=2 * mesh.devices, microbatches=True)
    if memory is None:
      return None
    grown, with_fsdp = memory.mesh, memory.fsdp
    if memory.micro_rows != cfg.stages.microbatch_rows(memory.seq_len, memory.rows):
      micro = memory.micro_rows * memory.seq_len
  needed = list(every)
  for name in every:
    trial = [n for n in needed if n != name]
    smaller = _try(apply(trial, micro), stage, grown, with_fsdp, backend, limit)
    if smaller is not None:
      needed, memory = trial, smaller
  what = needed + ([f"StagesConfig.microbatch_tokens = {micro}"] if micro else [])
  what += ["--fsdp"] if with_fsdp and not fsdp else []
  if grown != mesh:
    what = [f"--mesh={grown.spec()} ({grown.devices} devices)"] + what
  return Change(" and ".join(what), memory, grown, with_fsdp)


def stage_meshes(cfg: config_lib.Config, mesh: MeshShape) -> list[tuple[MeshShape, str]]:
  """Each stage's planned mesh and the setting that names it, as a run places the stages:
  `MeshConfig.stage_axes[i]` where it is given and not '', else `mesh` (--mesh). Raises
  ValueError naming MeshConfig.stage_axes[i] for an entry that is not a mesh."""
  out = []
  for stage in range(len(cfg.stages.stages)):
    own = cfg.mesh.stage_axes[stage] if cfg.mesh.stage_axes else ""
    setting = f"MeshConfig.stage_axes[{stage}]"
    out.append((parse_mesh(own, setting), setting) if own else (mesh, "--mesh"))
  return out


def plan_stages(cfg: config_lib.Config, mesh: MeshShape, device_gib: float, fsdp: bool = False,
                backend: str = "gpu") -> list[StagePlan]:
  """Every stage's plan on its mesh: `mesh` (--mesh), or the stage's own where
  MeshConfig.stage_axes gives one (`stage_meshes`). A stage that its mesh does not divide (its
  micro-batch's rows over data x expert, its rows over context) gets no memory, its `problem`,
  and as advice the smallest mesh that fits it. Raises ValueError naming the mesh's setting
  (--mesh or MeshConfig.stage_axes[i]) when the meshes divide no stage, or when one does not
  divide the experts or a parameter's sharded dimension."""
  meshes = stage_meshes(cfg, mesh)
  for stage_mesh, setting in dict.fromkeys(meshes):
    check_mesh(cfg, stage_mesh, setting, stages=[])
  problems = {}
  for stage, (stage_mesh, setting) in enumerate(meshes):
    try:
      check_mesh(cfg, stage_mesh, setting, stages=[stage])
    except ValueError as e:
      problems[stage] = str(e)
  if len(problems) == len(cfg.stages.stages):
    raise ValueError(problems[0])
  states = {}   # the state's bytes per distinct mesh of a stage it divides
  limit = device_gib * GIB
  out = []
  for stage, (stage_mesh, setting) in enumerate(meshes):
    if stage in problems:
      best = smallest_mesh(cfg, stage, device_gib, True, backend)
      advice = None if best is None else Change(
          f"--mesh={best.mesh.spec()} ({best.mesh.devices} devices) and --fsdp", best,
          best.mesh, True)
      out.append(StagePlan(stage, None, False, advice, problems[stage]))
      continue
    if stage_mesh not in states:
      try:
        states[stage_mesh] = state_bytes(cfg, stage_mesh.sizes(), fsdp)
      except ValueError as e:
        raise ValueError(f"{setting}={stage_mesh.spec()!r}: {e}") from e
    memory = stage_memory(cfg, stage, stage_mesh, fsdp, backend, state=states[stage_mesh])
    fits = _fits(memory, limit)
    out.append(StagePlan(stage, memory, fits, None if fits else
                         advise(cfg, stage, stage_mesh, device_gib, fsdp, backend)))
  return out
