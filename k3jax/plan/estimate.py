"""One stage's memory on one device: the exact state plus the analytic activations
(`k3jax.plan.activations`), composed along the backward pass.

The backward keeps, per layer, its residuals (remat 'none'), its inputs ('full') or its matmul
outputs ('dots'); a scanned decoder also keeps the AttnRes block stack once per group. The step's
peak is the largest of: the backward's start at the LM head (everything kept, plus the head's
fp32 logits' gradient, or one position chunk's logits), and each layer's backward (what the layers
below keep, its own residuals, recomputed under 'full', a scanned group's residuals sliced out of
their stacked buffers, and the backward's transient gradients). Counted throughout: the gradients
(param_dtype, placed like the parameters; twice with micro-batches, the running sum and the
micro-batch's), the step's batch, and with FSDP one layer's gathered weights and their unreduced
gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax.numpy as jnp

from k3jax import config as config_lib
from k3jax.layers.common import to_dtype
from k3jax.model.flops import attnres_mix_sources
from k3jax.model.layer_plan import layer_plan
from k3jax.plan import activations as acts
from k3jax.plan.state import StateBytes, state_bytes

MESH_AXES = ("data", "context", "expert")
# Bytes per token of a step's batch: inputs, targets, segment ids (int32) and the loss mask (fp32).
BATCH_BYTES_PER_TOKEN = 16


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """Axis sizes of a planned mesh ('data', 'context', 'expert'); absent axes are 1."""
  data: int = 1
  context: int = 1
  expert: int = 1

  @property
  def devices(self) -> int:
    return self.data * self.context * self.expert

  @property
  def batch_shards(self) -> int:
    return self.data * self.expert

  def sizes(self) -> dict[str, int]:
    return {"data": self.data, "context": self.context, "expert": self.expert}

  def spec(self) -> str:
    """'data:8,expert:8' (axes of size 1 left out; '' for one device)."""
    return ",".join(f"{a}:{n}" for a, n in self.sizes().items() if n > 1)

  def __str__(self) -> str:
    return self.spec() or "1 device"


def parse_mesh(spec: str, flag: str = "--mesh") -> MeshShape:
  """'data:2,context:4,expert:8' -> MeshShape; '' is one device.

  Raises ValueError naming `flag` for an unknown axis, a repeated one or a size that is not a
  positive integer.
  """
  sizes: dict[str, int] = {}
  for part in [p.strip() for p in spec.split(",")] if spec.strip() else []:
    name, sep, size = part.partition(":")
    if name not in MESH_AXES or not sep or not size.isdigit() or int(size) <= 0:
      raise ValueError(f"{flag}={spec!r}: bad entry {part!r}; expected comma-separated "
                       f"'name:size' with name in {MESH_AXES} and size a positive integer, "
                       "e.g. 'data:8,context:2,expert:8'")
    if name in sizes:
      raise ValueError(f"{flag}={spec!r}: axis {name!r} given twice")
    sizes[name] = int(size)
  return MeshShape(**sizes)


def check_mesh(cfg: config_lib.Config, mesh: MeshShape, flag: str = "--mesh",
               stages: Optional[Sequence[int]] = None) -> None:
  """Raises ValueError naming `flag` when the mesh does not divide the micro-batches or the rows'
  lengths of `stages` (default: every stage) or the experts (what `sharding.make_run_mesh` checks
  when a run starts)."""
  scfg = cfg.stages
  for i in range(len(scfg.stages)) if stages is None else stages:
    seq_len = scfg.stages[i][0]
    rows = scfg.microbatch_rows(seq_len, scfg.batch_size(i))
    if rows % mesh.batch_shards:
      raise ValueError(f"{flag}={mesh.spec()!r}: stage {i} (seq_len {seq_len}) runs micro-batches "
                       f"of {rows} rows, which its {mesh.batch_shards} batch shards (data x "
                       "expert) do not divide; use fewer batch shards or a context axis, or "
                       "more rows per micro-batch (StagesConfig.microbatch_tokens)")
    if seq_len % mesh.context:
      raise ValueError(f"{flag}={mesh.spec()!r}: stage {i}'s seq_len {seq_len} does not split "
                       f"into {mesh.context} equal context slices")
  if cfg.model.moe_num_experts and cfg.model.moe_num_experts % mesh.expert:
    raise ValueError(f"{flag}={mesh.spec()!r}: ModelConfig.moe_num_experts = "
                     f"{cfg.model.moe_num_experts} is not divisible by the expert axis "
                     f"({mesh.expert})")


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """One stage's bytes on one device of `mesh` (`fsdp`: the state split by the FSDP rules).

  rows, micro_rows: the step's rows and a micro-batch's; tokens: a micro-batch's tokens on one
  device. params, opt_state, other: the state (exact); grads: the gradients (and their running
  sum with micro-batches); batch: the step's input arrays; activations: what the backward keeps of
  the forward at its start; temporaries: the transient arrays at the step's peak beyond those (the
  LM head's logits, a layer's recomputation and backward, FSDP's gathered weights); total: their
  sum, the planned peak."""
  stage: int
  mesh: MeshShape
  fsdp: bool
  seq_len: int
  rows: int
  micro_rows: int
  tokens: int           # tokens of one micro-batch on one device
  remat: str
  params: int
  opt_state: int
  other: int
  grads: int
  batch: int
  activations: int
  temporaries: int

  @property
  def persistent(self) -> int:
    return self.params + self.opt_state + self.other

  @property
  def total(self) -> int:
    return self.persistent + self.grads + self.batch + self.activations + self.temporaries


def chunk_fraction(impl: config_lib.ImplConfig, tokens: int) -> float:
  """The share of a micro-batch's tokens in one position chunk (ImplConfig.position_chunk_tokens;
  1 without chunks)."""
  if impl.position_chunk_tokens <= 0 or tokens <= impl.position_chunk_tokens:
    return 1.0
  return impl.position_chunk_tokens / tokens


def _layer_bytes(cfg: config_lib.Config, impl: config_lib.ImplConfig, kernels: acts.Kernels,
                 mesh: MeshShape, seq_len: int, tokens: int, dispatch_tokens: int,
                 backend: str) -> list[acts.LayerBytes]:
  m = cfg.model
  a, d = jnp.dtype(to_dtype(m.dtype)).itemsize, m.d_model
  sources = attnres_mix_sources(m) or [1] * (2 * m.num_layers + 1)
  chunk = chunk_fraction(impl, tokens)
  out = []
  for i in range(m.num_layers):
    if m.layer_kind(i) == "mla":
      attn, attn_dots = acts.mla_bytes(m, mesh.context)
      # Under context parallelism MLA runs XLA's blockwise attention on every backend.
      attn_work = acts.mla_work(m, "cpu" if mesh.context > 1 else backend, seq_len)
    else:
      attn, attn_dots = acts.kda_bytes(m, kernels.kda, mesh.context)
      attn_work = acts.kda_work(m)
    if m.layer_uses_moe(i):
      ffn, ffn_dots = acts.moe_bytes(m, kernels, mesh.expert, tokens, dispatch_tokens, backend)
      ffn_work = acts.moe_work(m, kernels, mesh.expert, tokens, dispatch_tokens)
      kept_whole = acts.F32 * (m.moe_num_experts + 2 * m.moe_top_k)   # the router's
    else:
      ffn = acts.glu_bytes(m, m.dense_ffn_dim, backend)
      ffn_dots = 2 * a * m.dense_ffn_dim
      ffn_work = acts.glu_work(m, m.dense_ffn_dim)
      kept_whole = 0.0
    if chunk < 1.0:
      # Chunked (`k3jax.ops.chunking`): the map keeps its inputs and outputs stacked by chunk
      # and the joined output; one chunk's residuals exist at a time, in the backward's
      # recomputation.
      ffn_work = (ffn - kept_whole + ffn_work) * chunk
      ffn, ffn_dots = kept_whole + 3 * a * d, kept_whole + 3 * a * d
    inputs = [acts.sublayer_input(m, sources[2 * i], backend),
              acts.sublayer_input(m, sources[2 * i + 1], backend)]
    saved = inputs[0] + attn + inputs[1] + ffn
    keep = a * d                                     # the partial sum (or the stream) it receives
    dots = keep + attn_dots + ffn_dots + 2 * a * d
    work = max(attn_work, ffn_work) + 2 * a * d      # + the stream's gradients
    out.append(acts.LayerBytes(kind=m.layer_kind(i), saved=saved, dots=dots, inputs=keep,
                               work=work))
  return out


def stage_memory(cfg: config_lib.Config, stage: int, mesh: MeshShape, fsdp: bool = False,
                 backend: str = "gpu", state: Optional[StateBytes] = None,
                 fsdp_context: bool = False) -> StageMemory:
  """The planned memory of `stage` (0-based) on one device of `mesh`; `state` (from
  `state_bytes`) saves recomputing it for several stages; `fsdp_context`: FSDP's what-if over
  the context axis too (`k3jax.plan.state.fsdp_rules`)."""
  check_mesh(cfg, mesh, stages=[stage])
  scfg, m = cfg.stages, cfg.model
  impl = cfg.stage_impl(stage)
  kernels = acts.resolve_kernels(impl, backend, cfg.model)
  seq_len, rows = scfg.stages[stage][0], scfg.batch_size(stage)
  micro_rows = scfg.microbatch_rows(seq_len, rows)
  num_micro = rows // micro_rows
  local_rows, local_len = micro_rows // mesh.batch_shards, seq_len // mesh.context
  tokens = local_rows * local_len
  # Expert axis 1: the dispatch's sort gathers the micro-batch's assignments from every device.
  dispatch_tokens = tokens if mesh.expert > 1 else tokens * mesh.data * mesh.context
  state = state or state_bytes(cfg, mesh.sizes(), fsdp, fsdp_context)
  a, d, f = jnp.dtype(to_dtype(m.dtype)).itemsize, m.d_model, acts.F32

  layers = _layer_bytes(cfg, impl, kernels, mesh, seq_len, tokens, dispatch_tokens, backend)
  keep = [{"none": layer.saved, "full": layer.inputs, "dots": layer.dots}[impl.remat]
          for layer in layers]
  plan = layer_plan(m, impl.scan_layers)
  stack = 0.0
  if m.attnres and plan.num_groups:
    # The block stack [groups·boundaries, B, T, d] is each scan step's carry: kept once a group.
    per_group = sum(1 for i in plan.group_layers if i % m.attnres_block_size == 0)
    stack = plan.num_groups * plan.num_groups * per_group * a * d
  blocks = (len(range(0, m.num_layers, m.attnres_block_size)) if m.attnres else 0) * a * d
  # The head: the final mix and norm; the fp32 logits and, at the backward's start, their
  # gradient and softmax; chunked, one chunk's logits, softmax and gradient.
  final_sources = (attnres_mix_sources(m) or [1])[-1]
  head_saved = acts.sublayer_input(m, final_sources, backend) - a * d
  if chunk_fraction(impl, tokens) < 1.0:
    head_saved += a * d                              # the chunks' stacked inputs
    head_work = 3 * f * m.vocab_size * chunk_fraction(impl, tokens)
  else:
    head_saved += f * m.vocab_size
    head_work = 2 * f * m.vocab_size
  kept = sum(keep) + stack + blocks + head_saved
  peak = kept + head_work
  below = 0.0
  scanned = set(plan.scanned_layers)
  for i, layer in enumerate(layers):
    recompute = 0.0 if impl.remat == "none" else layer.saved - keep[i]
    sliced = 0.0
    if i in scanned and impl.remat != "full":
      # The scan's backward slices a group's kept arrays out of their stacked buffers.
      first = plan.start + (i - plan.start) // plan.period * plan.period
      sliced = sum(keep[first:first + plan.period])
    peak = max(peak, below + stack + blocks + keep[i] + recompute + sliced + layer.work)
    below += keep[i]
  fsdp_gather = 2 * state.gathered_layer if fsdp else 0
  grads = state.params * (2 if num_micro > 1 else 1)
  return StageMemory(
      stage=stage, mesh=mesh, fsdp=fsdp, seq_len=seq_len, rows=rows, micro_rows=micro_rows,
      tokens=tokens, remat=impl.remat, params=state.params, opt_state=state.opt_state,
      other=state.other,
      grads=grads, batch=BATCH_BYTES_PER_TOKEN * (rows // mesh.batch_shards) * local_len,
      activations=int(kept * tokens), temporaries=int((peak - kept) * tokens) + fsdp_gather)
