"""The run's configuration: plain frozen dataclasses, bound by gin, validated once.

One `Config` object describes a whole run. Its parts keep three kinds of setting apart:

  what is computed   ModelConfig (the K3 decoder's shapes and options), DataConfig,
                     OptimizerConfig, StagesConfig (the staged context extension), EvalConfig
  how it is computed ImplConfig: kernels and implementations, activation memory and compile-time
                     trade-offs; none of them changes the parameters or the math (only roundings)
  how it runs        RuntimeConfig (the micro-batch loop's programs, background compiles),
                     MeshConfig, CheckpointConfig

Every dataclass below is gin-configurable under its class name, so a gin file says e.g.

    ModelConfig.d_model = 256
    ImplConfig.remat = 'full'
    StagesConfig.stages = ((512, 100), (4096, 50))

`from_gin(gin_files, bindings)` parses the files and bindings, builds the `Config`, and validates it:
every bad field raises `ConfigError` naming the field and what is allowed; a setting that names a
field which has moved (`MOVED_FIELDS`) names its new place. After `from_gin` returns the config is
plain data; nothing else reads gin. `to_gin(cfg)` writes the bindings that rebuild it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Sequence

import gin


class ConfigError(ValueError):
  """A config field has a value that is not allowed. The message names the field."""


def _check(cond: bool, field: str, allowed: str, value: Any) -> None:
  if not cond:
    raise ConfigError(f"{field} = {value!r} is not allowed: {allowed}")


DTYPES = ("float32", "bfloat16")
BALANCE_METHODS = ("quantile", "loss_free", "aux_loss", "none")
FFN_ACTIVATIONS = ("situ_glu", "swiglu")
A_LOG_INITS = ("auto", "zero", "log_uniform")
QB_CADENCES = ("step", "microbatch")
MESH_AXES = ("data", "context", "expert")   # k3jax.parallel.sharding.MESH_AXES
KDA_BACKENDS = ("auto", "xla", "pallas")
# ModelConfig.kda_variant: KDA, Gated DeltaNet (one decay per head), gated linear attention (no
# delta rule); docs/architecture.md §1.9.
KDA_VARIANTS = ("kda", "gdn", "gla")
# The kernel settings (moe_situ_glu, attnres_kernel, kda_conv_backward, norm_kernel):
# k3jax.ops.kernel_choice.
KERNEL_CHOICES = ("auto", "xla", "pallas")
# ImplConfig.attention_impl's names (`k3jax.ops.attention.attention` takes these).
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "tokamax", "tokamax_mosaic_bwd")
GROUPED_MATMULS = ("auto", "tokamax", "ragged_dot", "tiled")
REMAT_POLICIES = ("none", "full", "dots")
PRECOMPILE_MODES = ("auto", "on", "off")
MICROBATCH_LOOPS = ("scan", "host")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of the K3 decoder: what it computes and which parameters it has.

  Layer i (1-based) is MLA when `i % mla_every == 0` or `i == num_layers`; otherwise KDA. Layers
  1..first_k_dense use the dense SiTU-GLU FFN, the rest the LatentMoE (when moe_num_experts > 0).
  How the decoder is computed (kernels, remat, the scan over layers) is `ImplConfig`.
  """
  vocab_size: int = 257           # byte tokenizer: 256 bytes + BOS
  d_model: int = 64
  num_layers: int = 4
  mla_every: int = 4
  norm_eps: float = 1e-5
  dtype: str = "float32"          # activations / matmul inputs
  param_dtype: str = "float32"
  tie_embeddings: bool = False
  init_std: float = 0.02

  # KDA (Kimi Delta Attention)
  kda_num_heads: int = 2
  kda_head_dim: int = 32          # K
  kda_value_dim: int = 32         # V per head
  kda_conv_size: int = 4
  kda_gate_rank: int = 0          # 0: full-rank decay-gate projection; >0: low-rank through this width
  kda_gate_lower_bound: Optional[float] = -5.0   # None: the unbounded softplus gate (ablation)
  # A_log's initial values: 'zero' (exp(A_log) = 1), 'log_uniform' (log U(1, 16), fla's and the
  # K3 and Kimi-Linear releases'), 'auto' ('zero' with the bounded gate, else 'log_uniform').
  kda_a_log_init: str = "auto"
  # The output gate sigmoid(x W_g) before o_proj: 0 gives K3's full-rank W_g [d, H·V]; r > 0 gives
  # Kimi-Linear's low-rank W_g = g_a [d, r] · g_b [r, H·V].
  kda_output_gate_rank: int = 0
  # The chunked algorithm's chunk: part of what the model computes in FLOPs (`k3jax.model.flops`),
  # while every chunk size gives the same outputs up to rounding.
  kda_chunk_size: int = 64
  # The linear-attention layers' recurrence, for ablations (docs/architecture.md §1.9): 'kda'
  # (per-channel decay and the delta rule), 'gdn' (Gated DeltaNet: one decay per head, the gate
  # projection [.., H] and dt_bias [H]) or 'gla' (gated linear attention: per-channel decay, no
  # delta rule and no β projection; XLA only). A full-attention reference is mla_every = 1.
  kda_variant: str = "kda"

  # Gated MLA
  mla_num_heads: int = 2
  mla_q_lora_rank: int = 0        # 0: no query compression
  mla_kv_lora_rank: int = 32
  mla_qk_nope_dim: int = 32
  mla_qk_rope_dim: int = 16       # never rotated (NoPE); kept for shape fidelity
  mla_v_dim: int = 32
  mla_output_gate: bool = True

  # FFN and MoE: the dense FFN, the shared and the routed experts all use `ffn_activation`:
  # 'situ_glu' (K3: SiTU(gate)·softcap(up), bounded by situ_beta1, situ_beta2) or 'swiglu'
  # (Kimi-Linear: silu(gate)·up, SiTU-GLU's limit as both bounds grow).
  ffn_activation: str = "situ_glu"
  situ_beta1: float = 4.0
  situ_beta2: float = 25.0
  dense_ffn_dim: int = 128
  first_k_dense: int = 1
  moe_num_experts: int = 8        # 0: dense FFN in every layer
  moe_top_k: int = 2
  moe_latent_dim: int = 32        # 0: no latent projection (experts at d_model)
  moe_latent_norm: bool = True    # RMSNorm before the up projection (Stable LatentMoE)
  moe_expert_dim: int = 64
  moe_num_shared: int = 1
  moe_shared_dim: int = 64
  moe_routed_scale: float = 1.0
  moe_balance: str = "quantile"   # quantile | loss_free | aux_loss | none
  moe_qb_rate: float = 1.0        # rho in b <- b - rho * t
  # 'per_expert': each expert's bar is the score it must beat to enter the token's top-k (k-th
  # largest for outsiders, (k+1)-th for chosen); 'token': K3's single (k+1)-th-largest cutoff.
  moe_qb_cutoff: str = "per_expert"
  # > 0: the quantile from per-expert histograms of this many bins over [min b - 1, max b + 1]
  # (K3's; int32 counts that add exactly over micro-batches and devices); 0: the exact quantile
  # from each expert's ~m*k/E largest margins, pooled by merging (memory ~ step tokens * k).
  moe_qb_histogram_bins: int = 1000
  moe_qb_interval: int = 1        # update the QB bias every N steps
  # 'step': one QB update per optimizer step from the statistics of all its micro-batches and
  # devices, every micro-batch routed with the step's bias. 'microbatch': micro-batch i routes with
  # the bias computed from micro-batch i-1 alone and the step keeps the last (fresher within a step,
  # each update from fewer tokens, and the result depends on the micro-batching); see
  # docs/architecture.md §4.4. Both are the same without micro-batches.
  moe_qb_cadence: str = "step"
  moe_loss_free_rate: float = 1e-3
  moe_aux_loss_coef: float = 1e-2
  moe_capacity_factor: float = 0.0  # 0: dropless; >0: per-expert capacity = factor * balanced load

  # Block Attention Residuals
  attnres: bool = True
  attnres_block_size: int = 2     # layers per block
  # A learned gain on each mix's key RMSNorm beside its query, as K3's release parameterises the
  # mix (the function class is the same: the scores use gain ⊙ query). False: the query alone.
  attnres_key_norm_gain: bool = False

  def glu_bounds(self) -> tuple[Optional[float], Optional[float]]:
    """The GLU activation's bounds (β1, β2) for `k3jax.ops.situ_glu.situ_glu`: the SiTU-GLU
    betas, or (None, None) for SwiGLU."""
    if self.ffn_activation == "swiglu":
      return None, None
    return self.situ_beta1, self.situ_beta2

  def layer_kind(self, i: int) -> str:
    """'mla' or 'kda' for 0-based layer index i."""
    n = i + 1
    return "mla" if (n % self.mla_every == 0 or n == self.num_layers) else "kda"

  def layer_uses_moe(self, i: int) -> bool:
    return self.moe_num_experts > 0 and i >= self.first_k_dense

  def validate(self) -> None:
    p = "ModelConfig."
    for name in ("vocab_size", "d_model", "num_layers", "mla_every", "kda_num_heads", "kda_head_dim",
                 "kda_value_dim", "kda_conv_size", "kda_chunk_size", "mla_num_heads",
                 "mla_kv_lora_rank", "mla_qk_nope_dim", "mla_v_dim", "dense_ffn_dim",
                 "attnres_block_size", "moe_qb_interval"):
      v = getattr(self, name)
      _check(isinstance(v, int) and v > 0, p + name, "a positive integer", v)
    for name in ("kda_gate_rank", "kda_output_gate_rank", "mla_q_lora_rank", "mla_qk_rope_dim", "first_k_dense",
                 "moe_num_experts", "moe_latent_dim", "moe_num_shared"):
      v = getattr(self, name)
      _check(isinstance(v, int) and v >= 0, p + name, "an integer >= 0", v)
    _check(self.dtype in DTYPES, p + "dtype", f"one of {DTYPES}", self.dtype)
    _check(self.param_dtype in DTYPES, p + "param_dtype", f"one of {DTYPES}", self.param_dtype)
    _check(self.kda_chunk_size % 16 == 0, p + "kda_chunk_size", "a multiple of 16 (16, 32, 64, ...)",
           self.kda_chunk_size)
    lb = self.kda_gate_lower_bound
    _check(lb is None or (isinstance(lb, (int, float)) and -5.0 <= lb < 0.0),
           p + "kda_gate_lower_bound",
           "None (unbounded softplus gate) or a float in [-5, 0); below -5 a 16-token tile's decay "
           "span leaves fp32's exp range", lb)
    _check(self.kda_a_log_init in A_LOG_INITS, p + "kda_a_log_init", f"one of {A_LOG_INITS}",
           self.kda_a_log_init)
    _check(self.kda_variant in KDA_VARIANTS, p + "kda_variant",
           f"one of {KDA_VARIANTS} (KDA, Gated DeltaNet, gated linear attention)", self.kda_variant)
    _check(self.norm_eps > 0, p + "norm_eps", "a positive float", self.norm_eps)
    _check(self.ffn_activation in FFN_ACTIVATIONS, p + "ffn_activation",
           f"one of {FFN_ACTIVATIONS}", self.ffn_activation)
    _check(self.situ_beta1 > 0 and self.situ_beta2 > 0, p + "situ_beta1/situ_beta2",
           "positive floats", (self.situ_beta1, self.situ_beta2))
    _check(self.moe_balance in BALANCE_METHODS, p + "moe_balance", f"one of {BALANCE_METHODS}",
           self.moe_balance)
    if self.moe_num_experts > 0:
      _check(isinstance(self.moe_top_k, int) and 1 <= self.moe_top_k < self.moe_num_experts,
             p + "moe_top_k", f"an integer in [1, moe_num_experts={self.moe_num_experts})",
             self.moe_top_k)
      _check(self.moe_expert_dim > 0, p + "moe_expert_dim", "a positive integer",
             self.moe_expert_dim)
      _check(self.moe_num_shared == 0 or self.moe_shared_dim > 0, p + "moe_shared_dim",
             "a positive integer when moe_num_shared > 0", self.moe_shared_dim)
      _check(0.0 < self.moe_qb_rate <= 1.0, p + "moe_qb_rate", "a float in (0, 1]",
             self.moe_qb_rate)
      _check(self.moe_qb_cutoff in ("per_expert", "token"), p + "moe_qb_cutoff",
             "one of ('per_expert', 'token')", self.moe_qb_cutoff)
      _check(isinstance(self.moe_qb_histogram_bins, int)
             and (self.moe_qb_histogram_bins == 0 or self.moe_qb_histogram_bins >= 2),
             p + "moe_qb_histogram_bins", "0 (exact) or an integer >= 2", self.moe_qb_histogram_bins)
      _check(self.moe_qb_cadence in QB_CADENCES, p + "moe_qb_cadence", f"one of {QB_CADENCES}",
             self.moe_qb_cadence)
      _check(self.moe_capacity_factor == 0.0 or self.moe_capacity_factor >= 1.0,
             p + "moe_capacity_factor", "0 (dropless) or a float >= 1", self.moe_capacity_factor)
      _check(self.first_k_dense < self.num_layers, p + "first_k_dense",
             f"smaller than num_layers={self.num_layers} when experts are used", self.first_k_dense)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ImplConfig:
  """How the decoder is computed: kernels, implementations, activation memory, compile time.

  None of these settings changes the parameters or what the model computes, only roundings, speed,
  memory and compile time: a checkpoint trained with one restores with any other. Each kernel
  choice is 'xla' (XLA's fusions), 'pallas' (Pallas kernels, interpreted on CPU) or 'auto' ('pallas'
  on a GPU, 'xla' elsewhere; `k3jax.ops.kernel_choice`). docs/performance.md gives the figures
  behind each default.
  """
  # KDA's chunked attention: 'pallas' (pallas_kernels/kda), 'xla' or 'auto'.
  kda_backend: str = "auto"
  # The short convolutions before KDA, forward and backward (pallas_kernels/short_conv; under a
  # mesh each device runs them on its own rows).
  kda_conv_kernel: str = "auto"
  # One of ATTENTION_IMPLS (k3jax/ops/attention.py). 'auto': cuDNN for rows without segment ids;
  # for packed rows on sm90+, tokamax's Mosaic GPU forward with its backward up to 4096 tokens a
  # row and our Mosaic GPU backward above; 'xla' (blockwise) elsewhere.
  attention_impl: str = "auto"
  # The routed experts' grouped matmul, one of GROUPED_MATMULS (k3jax.ops.grouped_matmul.default_ragged_dot).
  # 'auto': tokamax's Mosaic GPU kernels for bf16/f16 on compute capability 9.x, else 'tiled', on
  # a GPU; 'tiled' on CPU; ragged_dot on TPU.
  moe_grouped_matmul: str = "auto"
  # The routed experts' SiTU-GLU activation (pallas_kernels/situ_glu: one kernel forward, one
  # backward; not inside the expert-parallel shard_map on CPU).
  moe_situ_glu: str = "auto"
  # AttnRes's depth mix (pallas_kernels/depth_mix).
  attnres_kernel: str = "auto"
  # The decoder's RMSNorms' backward (pallas_kernels/rms_norm). 'xla' by default: the kernel was
  # not faster in a training step.
  norm_kernel: str = "xla"

  # Activation memory: what the backward pass of each decoder layer keeps from its forward.
  #   'none': everything autodiff saves; 'full': only the layer's inputs (the layer's forward runs
  #   again in the backward pass, once the gradient of its output exists: one layer recomputed at
  #   a time, k3jax/layers/remat.py); 'dots': also the outputs of matmuls without batch dimensions
  #   (jax.checkpoint_policies.dots_with_no_batch_dims_saveable, through nn.remat).
  remat: str = "none"
  # `remat` per curriculum stage, one entry per StagesConfig.stages entry (e.g. ('none', 'full',
  # 'full', 'full'): long rows keep only each layer's inputs); empty: `remat` in every stage.
  stage_remat: tuple = ()
  # Run the repeated middle of the decoder as one `nn.scan` over groups of layers (compile time
  # independent of depth; parameters stacked on a leading 'layers' axis). False: a Python loop over
  # the layers, each with its own parameters.
  scan_layers: bool = True
  # Position-wise parts in sequence chunks (k3jax/ops/chunking.py): > 0 runs the dense FFN, the
  # MoE's latent projections, routed experts and shared experts, and (in training) the LM head
  # with the loss over chunks of at most this many tokens (B rows x T/n positions), each chunk
  # rematerialised, so that no [B*T, wide] intermediate is alive whole; the router and the
  # balancing statistics still see the whole batch. 0: off.
  position_chunk_tokens: int = 0

  def validate(self) -> None:
    p = "ImplConfig."
    _check(self.kda_backend in KDA_BACKENDS, p + "kda_backend", f"one of {KDA_BACKENDS}",
           self.kda_backend)
    for name in ("kda_conv_kernel", "moe_situ_glu", "attnres_kernel", "norm_kernel"):
      _check(getattr(self, name) in KERNEL_CHOICES, p + name, f"one of {KERNEL_CHOICES}",
             getattr(self, name))
    _check(self.attention_impl in ATTENTION_IMPLS, p + "attention_impl",
           f"one of {ATTENTION_IMPLS}", self.attention_impl)
    _check(self.moe_grouped_matmul in GROUPED_MATMULS, p + "moe_grouped_matmul",
           f"one of {GROUPED_MATMULS}", self.moe_grouped_matmul)
    _check(self.remat in REMAT_POLICIES, p + "remat", f"one of {REMAT_POLICIES}", self.remat)
    _check(isinstance(self.stage_remat, (tuple, list))
           and all(r in REMAT_POLICIES for r in self.stage_remat), p + "stage_remat",
           f"empty (remat in every stage) or one of {REMAT_POLICIES} per stage", self.stage_remat)
    _check(isinstance(self.scan_layers, bool), p + "scan_layers", "True or False",
           self.scan_layers)
    _check(isinstance(self.position_chunk_tokens, int) and self.position_chunk_tokens >= 0,
           p + "position_chunk_tokens", "an integer >= 0 (0: no chunking)",
           self.position_chunk_tokens)

  def for_stage(self, stage: int, num_stages: int) -> "ImplConfig":
    """The settings that stage `stage` (0-based, of `num_stages`) trains with: `remat` replaced by
    `stage_remat[stage]` when stage_remat is given, else this config itself."""
    if not 0 <= stage < num_stages:
      raise ValueError(f"ImplConfig.for_stage: stage={stage} is not in [0, {num_stages}) "
                       "(StagesConfig.stages)")
    if not self.stage_remat:
      return self
    return dataclasses.replace(self, remat=self.stage_remat[stage])


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where tokens come from.

  source: 'builtin' (the Python standard library's own .py/.txt files, no download), 'text' (a file
  or folder of text files), 'jsonl' (a field of each JSON line), 'tokens' (a .npy array of token ids),
  'mqar' or 'passkey' (synthetic tasks).
  """
  source: str = "builtin"
  path: str = ""
  jsonl_field: str = "text"
  tokenizer: str = "byte"         # byte | sentencepiece | tiktoken | kimi
  tokenizer_path: str = ""
  validation_fraction: float = 0.05
  max_bytes: int = 4_000_000      # cap on the builtin corpus size (deterministic subset)
  mqar_num_kv_pairs: int = 8      # key-value pairs per MQAR sequence (source='mqar')
  reshuffle_each_epoch: bool = True
  seed: int = 0

  def validate(self) -> None:
    p = "DataConfig."
    sources = ("builtin", "text", "jsonl", "tokens", "mqar", "passkey")
    _check(self.source in sources, p + "source", f"one of {sources}", self.source)
    tokenizers = ("byte", "sentencepiece", "tiktoken", "kimi")
    _check(self.tokenizer in tokenizers, p + "tokenizer", f"one of {tokenizers}", self.tokenizer)
    if self.source in ("text", "jsonl", "tokens"):
      _check(bool(self.path), p + "path", f"a file or folder path when source={self.source!r}",
             self.path)
      _check(os.path.exists(self.path), p + "path", "an existing file or folder", self.path)
    if self.tokenizer != "byte":
      _check(bool(self.tokenizer_path) and os.path.isfile(self.tokenizer_path),
             p + "tokenizer_path", f"an existing model file for tokenizer={self.tokenizer!r}",
             self.tokenizer_path)
    _check(0.0 < self.validation_fraction < 0.5, p + "validation_fraction", "a float in (0, 0.5)",
           self.validation_fraction)
    _check(self.max_bytes > 0, p + "max_bytes", "a positive integer", self.max_bytes)
    _check(self.mqar_num_kv_pairs > 0, p + "mqar_num_kv_pairs", "a positive integer",
           self.mqar_num_kv_pairs)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = "adamw"             # adamw | muon
  learning_rate: float = 3e-3
  warmup_fraction: float = 0.01
  end_lr_fraction: float = 0.1    # cosine decays to this fraction of the peak
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip_norm: float = 1.0     # 0 disables clipping
  qk_clip_tau: float = 0.0        # 0 disables QK-Clip; K2 uses 100

  def validate(self) -> None:
    p = "OptimizerConfig."
    _check(self.name in ("adamw", "muon"), p + "name", "one of ('adamw', 'muon')", self.name)
    _check(self.learning_rate > 0, p + "learning_rate", "a positive float", self.learning_rate)
    _check(0.0 <= self.warmup_fraction < 1.0, p + "warmup_fraction", "a float in [0, 1)",
           self.warmup_fraction)
    _check(0.0 <= self.end_lr_fraction <= 1.0, p + "end_lr_fraction", "a float in [0, 1]",
           self.end_lr_fraction)
    _check(self.weight_decay >= 0, p + "weight_decay", "a float >= 0", self.weight_decay)
    _check(self.grad_clip_norm >= 0, p + "grad_clip_norm", "a float >= 0", self.grad_clip_norm)
    _check(self.qk_clip_tau >= 0, p + "qk_clip_tau", "a float >= 0 (0 disables)", self.qk_clip_tau)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class StagesConfig:
  """Staged context extension: `stages` is a sequence of (seq_len, steps).

  Tokens per step stay constant: batch size of a stage = tokens_per_step // seq_len.
  """
  stages: tuple = ((64, 40), (512, 20), (2048, 10), (8192, 5))
  tokens_per_step: int = 8192
  # Gradient accumulation: each step runs as micro-batches of this many tokens (at least one
  # sequence each) whose gradients are summed before one optimizer update. 0: the whole step.
  microbatch_tokens: int = 0

  def validate(self) -> None:
    p = "StagesConfig."
    _check(self.microbatch_tokens >= 0 and (self.microbatch_tokens == 0 or
                                            self.tokens_per_step % self.microbatch_tokens == 0),
           p + "microbatch_tokens", f"0 or a divisor of tokens_per_step={self.tokens_per_step}",
           self.microbatch_tokens)
    _check(len(self.stages) > 0, p + "stages", "a non-empty sequence of (seq_len, steps)", self.stages)
    for s in self.stages:
      _check(len(s) == 2 and all(isinstance(x, int) and x > 0 for x in s), p + "stages",
             "pairs (seq_len, steps) of positive integers", s)
      _check(self.tokens_per_step % s[0] == 0, p + "tokens_per_step",
             f"a multiple of every stage's seq_len (stage seq_len {s[0]})", self.tokens_per_step)
    lens = [s[0] for s in self.stages]
    _check(lens == sorted(lens), p + "stages", "non-decreasing sequence lengths", self.stages)
    if self.microbatch_tokens:
      for seq_len, _ in self.stages:
        rows = self.microbatch_rows(seq_len, self.tokens_per_step // seq_len)
        _check((self.tokens_per_step // seq_len) % rows == 0, p + "microbatch_tokens",
               f"a size whose rows per micro-batch ({rows} at seq_len {seq_len}) divide that "
               f"stage's batch ({self.tokens_per_step // seq_len})", self.microbatch_tokens)

  @property
  def total_steps(self) -> int:
    return sum(s[1] for s in self.stages)

  def stage_at(self, step: int) -> int:
    """Index of the stage that global step `step` (0-based) belongs to."""
    acc = 0
    for i, (_, n) in enumerate(self.stages):
      acc += n
      if step < acc:
        return i
    return len(self.stages) - 1

  def batch_size(self, stage: int) -> int:
    return self.tokens_per_step // self.stages[stage][0]

  def microbatch_rows(self, seq_len: int, batch_rows: int) -> int:
    """Rows per micro-batch for a batch of `batch_rows` sequences of `seq_len`: all of them
    without micro-batching, else max(1, microbatch_tokens // seq_len) (at most batch_rows)."""
    if not self.microbatch_tokens:
      return batch_rows
    return min(batch_rows, max(1, self.microbatch_tokens // seq_len))

  def num_microbatches(self, stage: int) -> int:
    """Micro-batches per step in `stage`."""
    seq_len, batch = self.stages[stage][0], self.batch_size(stage)
    return batch // self.microbatch_rows(seq_len, batch)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  """How a run's programs are compiled and run (`k3jax.runtime`); none changes a result."""
  # How a step's micro-batches run: 'scan', a lax.scan inside the step's one program; 'host', a
  # Python loop over jitted programs (one per micro-batch, then the update), so that the model's
  # decoder scans sit at the top level of a program, where XLA turns the zero initialisations of
  # their stacked buffers into fills instead of per-micro-batch copies (medium.gin's step on an
  # H200: 616.7 ms against 638.1, RESULTS.md run 12). With 'host' a step of one micro-batch runs
  # as two programs (gradients, update) compiled at once, which start faster than one (RESULTS.md
  # run 29). small.gin and medium.gin set 'host'.
  microbatch_loop: str = "scan"
  # 'on': compile the stages' training steps and validation programs in background threads from
  # the start of the run, in the order they are needed, instead of each when the loop reaches it
  # (`k3jax.runtime.precompile`; needs the persistent compilation cache, on by default in the
  # CLIs). 'auto': 'on' where the steps run on an accelerator, 'off' on CPU (there the compiles
  # would take the cores the steps run on: tiny.gin's run took 266 s instead of 198 s on 2 cores).
  precompile: str = "auto"
  # Compile threads (a long stage's compile takes GiBs of host memory).
  precompile_workers: int = 2

  def validate(self) -> None:
    p = "RuntimeConfig."
    _check(self.microbatch_loop in MICROBATCH_LOOPS, p + "microbatch_loop",
           f"one of {MICROBATCH_LOOPS}", self.microbatch_loop)
    _check(self.precompile in PRECOMPILE_MODES, p + "precompile", f"one of {PRECOMPILE_MODES}",
           self.precompile)
    _check(isinstance(self.precompile_workers, int) and not isinstance(self.precompile_workers, bool)
           and self.precompile_workers >= 1, p + "precompile_workers", "an integer >= 1",
           self.precompile_workers)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh: `axes` like 'data:2,context:4' (sizes multiply to the device count).

  Empty: a single-device run (no mesh). `data` splits the batch; `context` splits each row into
  contiguous slices (k3jax.parallel.context); `expert` splits the routed experts, and outside the
  MoE it splits the batch too.
  """
  axes: str = ""
  # The mesh per curriculum stage, one entry per StagesConfig.stages entry (e.g. ('', '',
  # 'data:2,context:4', 'context:8'): short rows split the batch, long ones the rows); '' is
  # `axes`. Every mesh spans all devices. At a stage whose mesh differs from the previous one the
  # loop moves the state onto the new mesh; each stage's steps compile for its own. Empty: `axes`
  # in every stage.
  stage_axes: tuple = ()

  def validate(self) -> None:
    _check(isinstance(self.stage_axes, (tuple, list))
           and all(isinstance(a, str) for a in self.stage_axes), "MeshConfig.stage_axes",
           "empty (MeshConfig.axes in every stage) or one mesh string per stage ('' for axes)",
           self.stage_axes)
    for field, axes in [("MeshConfig.axes", self.axes)] + [
        (f"MeshConfig.stage_axes[{i}]", a) for i, a in enumerate(self.stage_axes)]:
      for part in axes.split(",") if axes else ():
        name, _, size = part.partition(":")
        _check(name in MESH_AXES and size.isdigit() and int(size) > 0, field,
               f"comma-separated 'name:size' with name in {MESH_AXES}, e.g. 'data:2,context:4'",
               axes)

  def for_stage(self, stage: int) -> str:
    """The mesh string of stage `stage` (0-based): `stage_axes[stage]` when given and not '',
    else `axes`."""
    if self.stage_axes and self.stage_axes[stage]:
      return self.stage_axes[stage]
    return self.axes


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 50
  keep_last: int = 2
  async_save: bool = True

  def validate(self) -> None:
    _check(self.every_steps > 0, "CheckpointConfig.every_steps", "a positive integer",
           self.every_steps)
    _check(self.keep_last > 0, "CheckpointConfig.keep_last", "a positive integer", self.keep_last)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int = 0            # validation loss every N steps too, and at step 0 of a fresh
                                  # run (0: only at stage ends); passkey runs at stage ends only
  num_batches: int = 4
  passkey_multipliers: tuple = (1, 2, 4, 8)
  passkey_samples: int = 8
  # MQAR accuracy's rows at each stage end of a run whose DataConfig.source is 'mqar'.
  mqar_samples: int = 64
  log_every_steps: int = 5
  # True: each logged training record of metrics.jsonl (every log_every_steps steps) also carries
  # 'load/<layer>' for each MoE layer, that step's routed assignments per expert (a list of E
  # ints, summed over the step's micro-batches and devices; docs/architecture.md §4.6). Refused
  # with ModelConfig.moe_num_experts = 0 (no MoE layers, no loads).
  log_expert_loads: bool = False
  # Passkey lengths (train length x multiplier) above this are not run: at the long stages they
  # would cost more than the stage's training steps and say little about a small model.
  passkey_max_len: int = 65536
  # Validation loss by position inside the document: buckets [e_i, e_{i+1}), the last unbounded.
  # (): derived from StagesConfig.stages (`position_bucket_edges`), so that the buckets follow the
  # run's lengths.
  position_buckets: tuple = ()

  def validate(self) -> None:
    _check(self.every_steps >= 0, "EvalConfig.every_steps", "an integer >= 0", self.every_steps)
    _check(self.num_batches > 0, "EvalConfig.num_batches", "a positive integer", self.num_batches)
    _check(isinstance(self.mqar_samples, int) and not isinstance(self.mqar_samples, bool)
           and self.mqar_samples > 0, "EvalConfig.mqar_samples", "a positive integer",
           self.mqar_samples)
    _check(self.log_every_steps > 0, "EvalConfig.log_every_steps", "a positive integer",
           self.log_every_steps)
    _check(isinstance(self.log_expert_loads, bool), "EvalConfig.log_expert_loads",
           "True or False", self.log_expert_loads)
    _check(isinstance(self.passkey_max_len, int) and not isinstance(self.passkey_max_len, bool)
           and self.passkey_max_len > 0, "EvalConfig.passkey_max_len", "a positive integer",
           self.passkey_max_len)
    edges = self.position_buckets
    _check(isinstance(edges, tuple)
           and all(isinstance(e, int) and not isinstance(e, bool) for e in edges)
           and (not edges or edges[0] == 0) and all(a < b for a, b in zip(edges, edges[1:])),
           "EvalConfig.position_buckets", "() (derived from StagesConfig.stages) or a tuple of "
           "strictly increasing ints starting at 0, e.g. (0, 1024, 8192)", edges)

  def position_bucket_edges(self, stages) -> tuple[int, ...]:
    """The edges of the loss-by-position buckets for a run of `stages` ((seq_len, steps), ...,
    as StagesConfig.stages): `position_buckets` when set; otherwise 0 and every distinct stage
    length but the longest, so that each stage's evaluation adds the bucket of the positions only
    its length reaches (tiny.gin's 16/128/512/2048: (0, 16, 128, 512); small.gin's 8K to 1M:
    (0, 8192, 65536, 262144)). A run of one length L gets (0, L // 8, L // 2): the start, the
    middle and the second half of its rows (edges that collapse at L < 8 are dropped)."""
    if self.position_buckets:
      return self.position_buckets
    lengths = sorted({int(seq_len) for seq_len, _ in stages})
    if not lengths:
      raise ConfigError(f"StagesConfig.stages = {tuple(stages)!r} is not allowed: a non-empty "
                        "sequence of (seq_len, steps)")
    inner = lengths[:-1] if len(lengths) > 1 else [lengths[0] // 8, lengths[0] // 2]
    edges = [0]
    for edge in inner:
      if edge > edges[-1]:
        edges.append(edge)
    return tuple(edges)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run needs. Sub-configs are built from gin when not passed."""
  model: ModelConfig = None
  impl: ImplConfig = None
  data: DataConfig = None
  optimizer: OptimizerConfig = None
  stages: StagesConfig = None
  runtime: RuntimeConfig = None
  mesh: MeshConfig = None
  checkpoint: CheckpointConfig = None
  eval: EvalConfig = None
  seed: int = 0

  def __post_init__(self):
    for name, cls in _PARTS.items():
      if getattr(self, name) is None:
        object.__setattr__(self, name, cls())

  def validate(self) -> "Config":
    for name in _PARTS:
      getattr(self, name).validate()
    # Settings whose allowed values depend on another part.
    stage_remat = self.impl.stage_remat
    _check(len(stage_remat) in (0, len(self.stages.stages)), "ImplConfig.stage_remat",
           f"empty or one entry per stage ({len(self.stages.stages)} in StagesConfig.stages)",
           stage_remat)
    _check(len(self.mesh.stage_axes) in (0, len(self.stages.stages)), "MeshConfig.stage_axes",
           f"empty or one entry per stage ({len(self.stages.stages)} in StagesConfig.stages)",
           self.mesh.stage_axes)
    _check(self.impl.position_chunk_tokens == 0 or self.model.moe_capacity_factor == 0.0,
           "ModelConfig.moe_capacity_factor",
           "0 (dropless) when ImplConfig.position_chunk_tokens > 0 (expert capacities would be "
           "per chunk)", self.model.moe_capacity_factor)
    _check(self.model.kda_variant != "gla" or self.impl.kda_backend != "pallas",
           "ImplConfig.kda_backend",
           "'auto' or 'xla' when ModelConfig.kda_variant = 'gla' (the Pallas KDA kernels always "
           "apply the delta rule; gated linear attention runs on XLA)", self.impl.kda_backend)
    # ModelConfig refuses first_k_dense >= num_layers with experts: experts mean MoE layers.
    _check(not self.eval.log_expert_loads or self.model.moe_num_experts > 0,
           "EvalConfig.log_expert_loads",
           "False when ModelConfig.moe_num_experts = 0 (a model without MoE layers has no expert "
           "loads to log)", self.eval.log_expert_loads)
    return self

  def stage_impl(self, stage: int) -> ImplConfig:
    """The implementation settings of stage `stage` (0-based): `ImplConfig.for_stage`."""
    return self.impl.for_stage(stage, len(self.stages.stages))


# Config's parts, by field name, in the order of the dataclass.
_PARTS = {"model": ModelConfig, "impl": ImplConfig, "data": DataConfig,
          "optimizer": OptimizerConfig, "stages": StagesConfig, "runtime": RuntimeConfig,
          "mesh": MeshConfig, "checkpoint": CheckpointConfig, "eval": EvalConfig}

# Settings that moved to another configurable: old 'Configurable.field' -> new one. A gin file or
# binding that names an old one is refused with its new place; a run directory's stored config.gin
# is read with them renamed (`read_run_config`).
MOVED_FIELDS = {
    "ModelConfig.kda_backend": "ImplConfig.kda_backend",
    "ModelConfig.kda_conv_backward": "ImplConfig.kda_conv_kernel",
    "ModelConfig.attention_impl": "ImplConfig.attention_impl",
    "ModelConfig.moe_grouped_matmul": "ImplConfig.moe_grouped_matmul",
    "ModelConfig.moe_situ_glu": "ImplConfig.moe_situ_glu",
    "ModelConfig.attnres_kernel": "ImplConfig.attnres_kernel",
    "ModelConfig.norm_kernel": "ImplConfig.norm_kernel",
    "ModelConfig.remat": "ImplConfig.remat",
    "ModelConfig.scan_layers": "ImplConfig.scan_layers",
    "ModelConfig.position_chunk_tokens": "ImplConfig.position_chunk_tokens",
    "StagesConfig.remat": "ImplConfig.stage_remat",
    "StagesConfig.microbatch_loop": "RuntimeConfig.microbatch_loop",
    "StagesConfig.precompile": "RuntimeConfig.precompile",
    "StagesConfig.precompile_workers": "RuntimeConfig.precompile_workers",
}
# Values that are no longer allowed, and what to use instead (old run directories may hold them).
REPLACED_VALUES = {
    ("ImplConfig.attention_impl", "auto_mosaic_bwd"): "auto",
    ("ImplConfig.attention_impl", "tokamax_pallas_bwd"): "tokamax_mosaic_bwd",
    ("ImplConfig.attention_impl", "pallas"): "tokamax_mosaic_bwd",
}
# Settings added after run directories were first written whose default computes something else
# than the code before them: 'Configurable.field' -> the value that computes what that code did. A
# stored config.gin that lacks one is read with this value (`run_dir.read_config`), so that a resumed
# run names the change. Fields whose default keeps the old computation are not listed.
ADDED_FIELDS = {
    "ModelConfig.moe_qb_cadence": "microbatch",
}
_SETTING = re.compile(r"^(\s*)([A-Za-z_]\w*\.[A-Za-z_]\w*)(\s*=)", re.MULTILINE)


def _moved_settings(text: str) -> list[str]:
  """The old names of moved settings that `text` (gin bindings) assigns."""
  return [m.group(2) for m in _SETTING.finditer(text) if m.group(2) in MOVED_FIELDS]


def _check_not_moved(gin_files: Sequence[str], bindings: Sequence[str]) -> None:
  for where, text in [(f"gin file {f}", open(f).read()) for f in gin_files] + [
      (f"gin binding {b!r}", b) for b in bindings]:
    moved = _moved_settings(text)
    if moved:
      raise ConfigError(f"{where}: {moved[0]} has moved: set {MOVED_FIELDS[moved[0]]} instead")


def renamed_settings(text: str) -> tuple[str, list[str]]:
  """(`text` with every moved setting renamed to its new place and every replaced value
  replaced, the changes as 'old -> new' lines). For configs that k3jax wrote itself (a run
  directory's config.gin); a user's gin files get `from_gin`'s error instead."""
  notes = []

  def rename(m):
    new = MOVED_FIELDS.get(m.group(2))
    if new is None:
      return m.group(0)
    notes.append(f"{m.group(2)} -> {new}")
    return f"{m.group(1)}{new}{m.group(3)}"

  lines = []
  for line in _SETTING.sub(rename, text).splitlines():
    name, _, value = line.partition("=")
    for (field, old), new in REPLACED_VALUES.items():
      if name.strip() == field and value.strip() in (repr(old), f'"{old}"'):
        notes.append(f"{field} = {old!r} -> {new!r}")
        line = f"{name}= {new!r}"
    lines.append(line)
  return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), notes


def from_gin(gin_files: Sequence[str] = (), bindings: Sequence[str] = ()) -> Config:
  """Parses gin files and bindings into a validated `Config`.

  Unknown configurables or parameters, settings that have moved (`MOVED_FIELDS`), and invalid
  values raise `ConfigError` naming the setting.
  """
  for name, value in (("gin_files", gin_files), ("bindings", bindings)):
    if isinstance(value, str):  # a lone string would be read one character at a time
      raise ConfigError(f"from_gin: {name} must be a list of strings, not the string {value!r}")
  for f in gin_files:
    if not os.path.isfile(f):
      raise ConfigError(f"gin file {f!r} does not exist")
  _check_not_moved(gin_files, bindings)
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(bindings), finalize_config=False)
    cfg = Config()
  except SyntaxError as e:
    text = (e.text or "").strip()
    if e.filename:
      raise ConfigError(f"gin file {e.filename}, line {e.lineno}: {e.msg} ({text!r})") from e
    raise ConfigError(f"gin binding {text!r}: {e.msg}") from e
  except (ValueError, KeyError, TypeError) as e:
    known = ", ".join(["Config"] + [cls.__name__ for cls in _PARTS.values()])
    raise ConfigError(f"bad gin setting: {e}. Configurables are: {known}; see k3jax/config.py "
                      "for their fields.") from e
  finally:
    gin.clear_config()
  return cfg.validate()


def to_gin(cfg: Config) -> str:
  """Gin bindings that rebuild `cfg` exactly (every field of every part): `from_gin` of them
  returns an equal Config."""
  lines = []
  for field in dataclasses.fields(cfg):
    value = getattr(cfg, field.name)
    if dataclasses.is_dataclass(value):
      lines.append(f"# {field.name}")
      cls = type(value).__name__
      lines += [f"{cls}.{f.name} = {getattr(value, f.name)!r}" for f in dataclasses.fields(value)]
    else:
      lines.append(f"Config.{field.name} = {value!r}")
  return "\n".join(lines) + "\n"
