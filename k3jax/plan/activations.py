"""What a training step's backward pass keeps, per token and layer: the plan's analytic model.

Every figure is bytes per token of one device's share of a micro-batch (its rows over the batch
axes, its slice of each row over `context`), from what each layer's forward hands its backward:
the custom VJPs' residuals and autodiff's saved operands (`k3jax/layers/*`, `k3jax/ops/*`,
`pallas_kernels/*`). a = the activations' dtype size (ModelConfig.dtype), f = 4, d = d_model;
H heads, K and V head dims, C the KDA chunk, m a GLU's width.

  before each sublayer: the depth mix over S sources keeps α and r ([S] fp32: 2·S·f; XLA's mix on
    the CPU also its exponentials, S·f + f), the norm keeps its input h (a·d) and r (f), the
    sublayer's matmuls its normed output (a·d), the next mix (or norm) the sublayer's output
    added to the stream (a·d). Without AttnRes the norm's input is the stream itself.
  KDA (Pallas kernels): pre-conv q, k, v (a·H·(2K+V)) and the conv outputs (a·H·(2K+V)), the
    gate's low-rank input and pre-activation (a·(r + H·K)), β (f·H); the kernel's residuals
    (`pallas_kernels/kda/ops.py`): normalised q, k (a·2HK) and their norms (f·2H), G (f·HK),
    X and M (f·2HC), P (a·HC), W, kg, qg (a·3HK), the pseudo-values (a·HV) and the chunk-start
    states (a·HKV/C); o (a·HV), the output gate (a·(HV + r)), the gated norm's r (f·H) and the
    gated output (a·HV). Under context parallelism the kernel runs with K extra value columns (the
    slice's transition, `k3jax/parallel/context.py`): V → V + K where the kernel sees V.
  KDA (XLA, CPU): the fp32 chunked algorithm of `k3jax/ops/kda_chunk_xla.py`, dominated by the
    decays of its 16-token sub-tiles (16·K a token and head).
  KDA variants (ModelConfig.kda_variant): 'gdn' has a gate pre-activation of a·(r + H) and the
    KDA kernels' residuals (its decay is broadcast over K before them); 'gla' has no β and always
    runs the XLA path (`resolve_kernels`), which keeps no key-key matrix, inverse or WY factors.
  MLA: the query latent before and after its norm (a·2r_q, f), q (a·H·dqk), the kv latent before
    and after its norm (a·2r_kv, f), k (a·H·dqk), v, o and the gate's pre-activation (a·H·dv
    each; XLA recomputes the gated output in the backward), the log-sum-exp (f·H). Under context
    parallelism each device gathers the whole row's latent (a·(r_kv + rope)) and expands k and v
    for the whole row: those terms count context × the local tokens.
  dense FFN: gate, up and the activation (a·3m); on the CPU, XLA computes the activation's
    backward factors (three fp32 arrays) right after the forward and keeps those and the
    activation instead.
  MoE (top-k of E): the router's scores and weights (f·(E + 2k)); for each of the R dispatch rows
    a token has, the sorted input (a·ℓ), gate and up (a·2F), the activation (a·F), the expert
    output (a·ℓ) and four int32 maps; the combined output before and after its norm (a·2ℓ, f);
    the shared experts (a GLU). R is `moe_dispatch_rows` over the tokens; the tiled grouped
    matmul (CPU) also keeps its inputs padded to 128-row tiles.

`k3jax.plan.estimate` composes these along the backward pass (remat, scans, the LM head, the
peak). Left out: XLA's layout copies and its own scheduling, collectives' buffers beyond the MLA
gather, the balance statistics (per expert, not per token).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from k3jax import config as config_lib
from k3jax.layers.common import to_dtype

F32 = 4
INT32 = 4
# tiled_ragged_dot's tile rows and tiles per scan step (`k3jax/ops/grouped_matmul.py`).
TILE_ROWS = 128
TILES_PER_STEP = 64
XLA_KDA_SUBTILE = 16


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The implementations `ImplConfig`'s 'auto' choices resolve to on the planned backend."""
  kda: str            # 'pallas' | 'xla'
  grouped_matmul: str  # 'tiled' | 'tokamax' | 'ragged_dot'


def resolve_kernels(impl: config_lib.ImplConfig, backend: str,
                    model: config_lib.ModelConfig | None = None) -> Kernels:
  """backend: 'gpu' (the GPU kernels, what a run on GPUs compiles) or 'cpu'; model: the run's
  ModelConfig, whose kda_variant 'gla' runs on XLA whatever the backend (None: KDA)."""
  if backend not in ("gpu", "cpu"):
    raise ValueError(f"backend must be 'gpu' or 'cpu', got {backend!r}")
  kda = impl.kda_backend
  if model is not None and model.kda_variant == "gla":
    kda = "xla"
  elif kda == "auto":
    kda = "pallas" if backend == "gpu" else "xla"
  gmm = impl.moe_grouped_matmul
  if gmm == "auto":
    gmm = "tokamax" if backend == "gpu" else "tiled"
  return Kernels(kda=kda, grouped_matmul=gmm)


@dataclasses.dataclass(frozen=True)
class LayerBytes:
  """One decoder layer's bytes per local token.

  saved: what the backward keeps of its forward with remat 'none' (its inputs excluded).
  dots: what it keeps with remat 'dots' (the outputs of matmuls without batch dimensions).
  inputs: what it keeps with remat 'full' (its inputs that no other layer keeps).
  work: the largest set of transient arrays its backward holds at once beyond `saved`.
  """
  kind: str
  saved: float
  dots: float
  inputs: float
  work: float


def _act(cfg: config_lib.ModelConfig) -> int:
  return jnp.dtype(to_dtype(cfg.dtype)).itemsize


def sublayer_input(cfg: config_lib.ModelConfig, sources: int, backend: str) -> float:
  """The mix over `sources` AttnRes sources and the norm before a sublayer, its normed input, and
  the sublayer's output added to the stream (the next mix's source, or the next norm's input).
  XLA's depth mix (CPU) also keeps its exponentials and their sum."""
  a, d = _act(cfg), cfg.d_model
  if not cfg.attnres:
    return a * d + F32 + a * d
  mix = (2 * sources * F32) if backend == "gpu" else (3 * sources * F32 + F32)
  return mix + a * d + F32 + a * d + a * d


def kda_bytes(cfg: config_lib.ModelConfig, kda: str, context: int) -> tuple[float, float]:
  """(saved, of which matmul outputs) of one KDA sublayer, its normed input excluded."""
  a = _act(cfg)
  h, k, v, c = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_chunk_size
  vk = v + k if context > 1 else v
  proj = a * h * (2 * k + v)                               # pre-conv q, k, v (matmul outputs)
  gate_k = 1 if cfg.kda_variant == "gdn" else k            # the decay gate's channels per head
  gate_in = a * cfg.kda_gate_rank + a * h * gate_k         # low-rank input, pre-activation
  out_gate = a * h * v + a * cfg.kda_output_gate_rank
  dots = proj + gate_in + out_gate + a * h * v             # + the gated output before o_proj
  beta = 0 if cfg.kda_variant == "gla" else F32 * h
  saved = dots + a * h * (k + k + vk) + beta               # conv outputs, beta
  if kda == "pallas":
    saved += (a * 2 * h * k + F32 * 2 * h + F32 * h * k + F32 * 2 * h * c + a * h * c
              + a * 3 * h * k + a * h * vk + a * h * k * vk / c)
    if context > 1:
      saved += a * h * k                                   # q·P_t of the slice merge
  else:
    saved += xla_kda_bytes(cfg)
  saved += a * h * vk + F32 * h                            # o, the gated norm's r
  return saved, dots


def xla_kda_bytes(cfg: config_lib.ModelConfig) -> float:
  """`k3jax.ops.kda_chunk_xla._chunk_kda_xla`'s fp32 residuals per token: the intra-chunk
  decays of its 16-token sub-tiles (16·K and their keys per head), the chunk matrices and the WY
  factors (kda_variant 'gla': the query-key scores alone, no WY factors)."""
  h, k, v, c = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_chunk_size
  s = XLA_KDA_SUBTILE
  tiles = c // s
  if cfg.kda_variant == "gla":
    per_head = (2 * s * k + 2 * tiles * k  # the sub-tiles' decays and key factors, as KDA's
                + 5 * k + v                # q, k, g, cumulative g, qg; v
                + c)                       # a_qk
  else:
    per_head = (2 * s * k              # diagonal-tile decays and their masked exponents
                + 2 * tiles * k        # off-diagonal key factors
                + 6 * k + 3 * v        # q, k, g, cumulative g, w, qg; v, u, v_new
                + 4 * c)               # a_qk, a_kk, the inverse and the lower factor
  return F32 * h * per_head + F32 * h * k * v / c   # + the state entering each chunk


def mla_bytes(cfg: config_lib.ModelConfig, context: int) -> tuple[float, float]:
  """(saved, of which matmul outputs) of one MLA sublayer, its normed input excluded."""
  a = _act(cfg)
  h, rq, rkv = cfg.mla_num_heads, cfg.mla_q_lora_rank, cfg.mla_kv_lora_rank
  dqk, dv, rope = cfg.mla_qk_nope_dim + cfg.mla_qk_rope_dim, cfg.mla_v_dim, cfg.mla_qk_rope_dim
  q_path = (2 * a * rq + F32 if rq > 0 else 0) + a * h * dqk
  kv_local = a * rkv + F32                                 # the latent before its norm, r
  if context > 1:
    # Each device gathers the row's latent (kept by the expansion) and expands keys and values
    # for the whole row (kept by the attention): context × as many tokens.
    kv_row = context * (a * (rkv + rope) + a * h * (dqk + dv))
  else:
    kv_row = a * rkv + a * h * (dqk + dv)                  # the normed latent, k, v
  gate = a * h * dv if cfg.mla_output_gate else 0          # the gate's pre-activation
  saved = q_path + kv_local + kv_row + a * h * dv + F32 * h + gate   # + o and its log-sum-exp
  dots = (a * rq if rq > 0 else 0) + a * h * dqk + a * rkv + a * rope + gate
  return saved, dots


def glu_bytes(cfg: config_lib.ModelConfig, width: int, backend: str) -> float:
  """A SiTU-GLU (or SwiGLU) of hidden width `width`: gate, up and the activation (GPU); on CPU
  XLA computes the activation's backward factors (three fp32 arrays) right after the forward and
  keeps those with the activation instead of gate and up."""
  a = _act(cfg)
  return 3 * a * width if backend == "gpu" else a * width + 3 * F32 * width


def moe_dispatch_rows(cfg: config_lib.ModelConfig, expert: int, tokens: int) -> int:
  """Rows the routed experts' dispatch holds for `tokens` tokens on one device: k a token on one
  device (`k3jax/ops/moe.py`); with an expert axis of n devices, n·min(k, E/n) a token, the
  all-to-all buffers `k3jax/ops/moe_ep.py` sizes for the worst case (dropless), or n·ceil(c·
  tokens·k/n) with ModelConfig.moe_capacity_factor c > 0; on one expert group with c > 0, E
  buffers of ceil(c·tokens·k/E) rows."""
  k, e = cfg.moe_top_k, cfg.moe_num_experts
  local = e // expert
  if expert > 1:
    capacity = tokens * min(k, local)
    if cfg.moe_capacity_factor > 0:
      capacity = min(capacity, math.ceil(cfg.moe_capacity_factor * tokens * k / expert))
    return expert * capacity
  if cfg.moe_capacity_factor > 0:
    return e * math.ceil(cfg.moe_capacity_factor * tokens * k / e)
  return tokens * k


def tiled_rows(rows: int, groups: int) -> int:
  """The padded rows of `tiled_ragged_dot`'s buffers for `rows` rows in `groups` groups."""
  tiles = math.ceil(rows / TILE_ROWS) + groups
  per_step = max(1, min(TILES_PER_STEP, tiles))
  return math.ceil(tiles / per_step) * per_step * TILE_ROWS


def moe_bytes(cfg: config_lib.ModelConfig, kernels: Kernels, expert: int, tokens: int,
              dispatch_tokens: int, backend: str) -> tuple[float, float]:
  """(saved, of which matmul outputs) of one MoE sublayer per local token (`tokens` of them),
  its normed input excluded; `dispatch_tokens`: the tokens whose assignments one device's
  dispatch holds (`tokens`, or the whole micro-batch's when XLA gathers them)."""
  a = _act(cfg)
  k, e = cfg.moe_top_k, cfg.moe_num_experts
  lat = cfg.moe_latent_dim if cfg.moe_latent_dim > 0 else cfg.d_model
  ff = cfg.moe_expert_dim
  rows = moe_dispatch_rows(cfg, expert, dispatch_tokens)
  # Per row: the sorted input, gate and up, the activation, the expert output; four int32 maps.
  dispatch = rows * (a * (2 * lat + 3 * ff) + 4 * INT32)
  if kernels.grouped_matmul == "tiled" and (cfg.moe_capacity_factor == 0 or expert > 1):
    # The tiled grouped matmul keeps its padded copies of both matmuls' inputs.
    dispatch += tiled_rows(rows, e // expert) * a * (lat + ff)
  router = F32 * (e + 2 * k)
  combine = a * 2 * lat + F32 if cfg.moe_latent_norm else a * lat
  shared = (glu_bytes(cfg, cfg.moe_num_shared * cfg.moe_shared_dim, backend)
            if cfg.moe_num_shared else 0)
  saved = router + dispatch / tokens + combine + shared
  dots = (rows * a * (2 * ff + lat) / tokens + (a * lat if cfg.moe_latent_dim else 0)
          + 2 * a * cfg.moe_num_shared * cfg.moe_shared_dim)
  return saved, dots


# XLA's blockwise attention (`k3jax/ops/attention_blockwise.py`): key tokens per block.
XLA_KV_BLOCK = 512


def mla_work(cfg: config_lib.ModelConfig, backend: str, row_tokens: int) -> float:
  """The MLA backward's transient bytes per local token: the gradients of q, k, v and, with XLA's
  blockwise attention (backend 'cpu'), its fp32 logits, probabilities and their gradient for one
  block of keys ([H, min(row, 512)] each per query)."""
  a, h = _act(cfg), cfg.mla_num_heads
  dqk, dv = cfg.mla_qk_nope_dim + cfg.mla_qk_rope_dim, cfg.mla_v_dim
  grads = a * h * (2 * dqk + dv)
  if backend == "cpu":
    return grads + 3 * F32 * h * min(row_tokens, XLA_KV_BLOCK)
  return grads + F32 * h * dqk                             # the kernels' fp32 dq accumulator


def kda_work(cfg: config_lib.ModelConfig) -> float:
  """The KDA backward's transient bytes per local token: the gradients of q, k, v and the gate
  and the kernels' fp32 chunk-matrix gradients."""
  a, h = _act(cfg), cfg.kda_num_heads
  k, v, c = cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_chunk_size
  return a * h * (3 * k + v) + F32 * h * (2 * c + k)


def glu_work(cfg: config_lib.ModelConfig, width: int) -> float:
  """A GLU's backward: the gradients of gate and up."""
  return 2 * _act(cfg) * width


def moe_work(cfg: config_lib.ModelConfig, kernels: Kernels, expert: int, tokens: int,
             dispatch_tokens: int) -> float:
  """The routed experts' backward per local token: the gradients of gate and up and of the
  sorted input for every dispatch row; the tiled grouped matmul (CPU) holds three zeroed
  [padded rows, 2·F] buffers for its gradients' scatters instead."""
  a, ff = _act(cfg), cfg.moe_expert_dim
  lat = cfg.moe_latent_dim if cfg.moe_latent_dim > 0 else cfg.d_model
  rows = moe_dispatch_rows(cfg, expert, dispatch_tokens)
  if kernels.grouped_matmul == "tiled" and (cfg.moe_capacity_factor == 0 or expert > 1):
    return 3 * tiled_rows(rows, cfg.moe_num_experts // expert) * a * 2 * ff / tokens
  return rows * a * (2 * ff + lat) / tokens
