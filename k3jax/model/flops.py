"""Model FLOPs per token: the matmul work of one training token, for MFU.

`flops_per_token(cfg, seq_len)` is the training cost of one token of a row of `seq_len` tokens:
forward + backward, counted as 3 × the forward (the backward does two matmuls per forward matmul:
one for the input's gradient, one for the weight's). `forward_flops_breakdown` gives the forward
per term. A matmul [m, n] @ [n, p] counts 2·m·n·p FLOPs (a multiply and an add per term).

Counted, per token of the forward (d = d_model, V = vocab_size; one FLOP count per named term):

  lm_head          2·d·V (the embedding lookup is a gather, not a matmul)
  KDA layers (H heads, key dim K, value dim Vh, conv width W, chunk C):
    kda_qkv        2·d·H·(2K + Vh)
    kda_gate       2·d·H·K, or 2·(d·r + r·H·K) with the low-rank gate (r = kda_gate_rank > 0);
                   K = 1 for kda_variant 'gdn' (one decay per head)
    kda_beta       2·d·H (0 for kda_variant 'gla', which has no β)
    kda_out_gate   2·d·H·Vh, or 2·(d·r + r·H·Vh) with the low-rank output gate
                   (r = kda_output_gate_rank > 0)
    kda_out        2·H·Vh·d
    kda_conv       2·W·H·(2K + Vh): the depthwise short convs of q, k and v, W multiply-adds per
                   channel (not a matmul, but counted: it is a weight product like one)
    kda_chunk      H·(6·K·Vh + 3·C·(K + Vh)/2 + C²): the chunk algorithm by eq. 13 of the Kimi
                   Linear paper (per head 6·T·d² + 3·T·C·d + T·C² for T tokens, K = Vh = d; its d²
                   terms are the state products, K·Vh here, and its C·d terms average K and Vh).
                   It is the count experiments/benchmarks/kda_bench.py reports TFLOP/s with
                   (`kda_chunk_flops`). kda_variant 'gdn' counts the same (it runs the KDA op).
                   'gla' counts H·(4·K·Vh + C·(K + Vh)) (`gla_chunk_flops`), eq. 13 less the
                   delta rule's terms: two state products instead of three (the queries reading
                   S_0 and the chunk's writes), two causal C×C products instead of three (the
                   scores P and P·V; no key-key matrix) and no C² inverse.
  MLA layers (H heads, q/k dim dqk = nope + rope, value dim dv, latent r_kv, query latent r_q):
    mla_q          2·d·H·dqk, or 2·(d·r_q + r_q·H·dqk) with query compression (r_q > 0)
    mla_kv_down    2·d·r_kv
    mla_k_rope     2·d·rope
    mla_kv_up      2·r_kv·H·(nope + dv) (W_uk and W_uv)
    mla_out_gate   2·d·H·dv (when mla_output_gate)
    mla_out        2·H·dv·d
    mla_attention  H·(dqk + dv)·(seq_len + 1): causal softmax attention. The query at 1-based
                   position i meets i keys: QKᵀ costs H·dqk multiply-adds per pair and PV H·dv, so a
                   row costs Σ_{i=1..T} i·H·(dqk + dv) = T(T+1)/2·H·(dqk + dv) multiply-adds, i.e.
                   per token (T+1)/2·H·(dqk + dv) multiply-adds = (T+1)·H·(dqk + dv) FLOPs. One
                   document per row: with packed rows the useful attention is less, and kernels that
                   compute the masked-out half (or whole blocks across documents) do more.
  FFN / MoE layers:
    ffn            2·3·d·m for the dense GLU of width m = dense_ffn_dim (gate, up, out)
    moe_router     2·d·E (E = moe_num_experts)
    moe_latent     2·2·d·ℓ: the down (d → ℓ) and up (ℓ → d) projections (ℓ = moe_latent_dim > 0)
    moe_routed     top_k·2·3·ℓ'·m_e: the top_k active experts, SiTU-GLUs of width m_e =
                   moe_expert_dim at ℓ' = ℓ (or d without the latent projection)
    moe_shared     2·3·d·(moe_num_shared·moe_shared_dim)
  attnres_mix      4·S·d per Block AttnRes DepthMix over S sources (the S logits w·key_s and the
                   weighted sum of S values), summed over the 2 mixes per layer and the final one.

Not counted: elementwise work (activations, gates' sigmoids, SiTU, residual adds), RMSNorms, softmax
exponentials and the attention's masking, the KDA gate's softplus and the L2 norms of q and k,
the loss, and the optimizer update. Nor is anything an implementation computes beyond the count:
padding rows of grouped matmuls, masked-out attention blocks, recomputation under remat, the
masked block slots that the scanned decoder's DepthMixes run over (ImplConfig.scan_layers).
"""

from __future__ import annotations

from typing import Union

from k3jax.config import Config, ModelConfig

# Forward + backward = 3 × forward (a forward matmul costs two in the backward).
TRAINING_MULTIPLIER = 3.0


def kda_chunk_flops(batch: int, seq_len: int, heads: int, head_dim: int, chunk_size: int = 64,
                    value_dim: int | None = None) -> float:
  """Forward FLOPs of the chunked KDA algorithm on [batch, seq_len, heads, head_dim] inputs.

  Eq. 13 of the Kimi Linear paper, per head: 6·T·d² + 3·T·C·d + T·C² with d = head_dim = value_dim
  and C = chunk_size. With value_dim ≠ head_dim the d² (state-product) terms become K·V and the
  C·d terms use (K + V)/2; value_dim None means value_dim = head_dim (eq. 13 itself).
  """
  for name, value in (("batch", batch), ("seq_len", seq_len), ("heads", heads),
                      ("head_dim", head_dim), ("chunk_size", chunk_size)):
    if not (isinstance(value, int) and value > 0):
      raise ValueError(f"kda_chunk_flops: {name} = {value!r} must be a positive integer")
  v = head_dim if value_dim is None else value_dim
  if not (isinstance(v, int) and v > 0):
    raise ValueError(f"kda_chunk_flops: value_dim = {value_dim!r} must be a positive integer "
                     "or None")
  k, c = head_dim, chunk_size
  per_token_head = 6 * k * v + 3 * c * (k + v) / 2 + c * c
  return float(batch * heads * seq_len * per_token_head)


def gla_chunk_flops(batch: int, seq_len: int, heads: int, head_dim: int, chunk_size: int = 64,
                    value_dim: int | None = None) -> float:
  """Forward FLOPs of chunked gated linear attention (`k3jax.ops.kda_variants.chunk_gla`)
  on [batch, seq_len, heads, head_dim] inputs: per token and head 4·K·V + C·(K + V) (module
  docstring), K = head_dim, V = value_dim (None: head_dim), C = chunk_size."""
  # Validated by kda_chunk_flops, whose count this one shares its conventions with.
  kda_chunk_flops(batch, seq_len, heads, head_dim, chunk_size, value_dim)
  k, v, c = head_dim, head_dim if value_dim is None else value_dim, chunk_size
  return float(batch * heads * seq_len * (4 * k * v + c * (k + v)))


def attnres_mix_sources(cfg: ModelConfig) -> list[int]:
  """The number of sources of every DepthMix of the decoder, in call order (two per layer, then
  the final mix); empty when cfg.attnres is off. Mirrors k3jax.model.decoder.DecoderLayer's
  wiring: at a block boundary the partial sum is frozen and the next attention mix sees the frozen blocks only.
  """
  if not cfg.attnres:
    return []
  sources, blocks, partial = [], 0, True   # the embedding enters as the partial sum
  for i in range(cfg.num_layers):
    if i % cfg.attnres_block_size == 0:
      blocks, partial = blocks + 1, False
    sources.append(blocks + int(partial))  # attention mix
    partial = True
    sources.append(blocks + 1)             # FFN mix
  sources.append(blocks + 1)               # final mix
  return sources


def _model_config(cfg: Union[ModelConfig, Config]) -> ModelConfig:
  if isinstance(cfg, Config):
    return cfg.model
  if isinstance(cfg, ModelConfig):
    return cfg
  raise TypeError(f"cfg must be a k3jax.config.ModelConfig or Config, got {type(cfg).__name__}")


def forward_flops_breakdown(cfg: Union[ModelConfig, Config], seq_len: int) -> dict[str, float]:
  """Forward FLOPs per token by term (the module docstring's terms, summed over layers), for a
  row of `seq_len` tokens. Terms of parts the config does not have are 0."""
  m = _model_config(cfg)
  if not (isinstance(seq_len, int) and seq_len > 0):
    raise ValueError(f"seq_len = {seq_len!r} must be a positive integer")
  d = m.d_model
  kinds = [m.layer_kind(i) for i in range(m.num_layers)]
  n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
  n_moe = sum(m.layer_uses_moe(i) for i in range(m.num_layers))
  n_dense = m.num_layers - n_moe
  out = {}
  out["lm_head"] = 2.0 * d * m.vocab_size

  h, k, v = m.kda_num_heads, m.kda_head_dim, m.kda_value_dim
  r = m.kda_gate_rank
  gate_k = 1 if m.kda_variant == "gdn" else k    # the decay gate's channels per head
  out["kda_qkv"] = n_kda * 2.0 * d * h * (2 * k + v)
  out["kda_gate"] = n_kda * 2.0 * ((d * r + r * h * gate_k) if r > 0 else d * h * gate_k)
  out["kda_beta"] = 0.0 if m.kda_variant == "gla" else n_kda * 2.0 * d * h
  r_out = m.kda_output_gate_rank
  out["kda_out_gate"] = n_kda * 2.0 * ((d * r_out + r_out * h * v) if r_out > 0 else d * h * v)
  out["kda_out"] = n_kda * 2.0 * h * v * d
  out["kda_conv"] = n_kda * 2.0 * m.kda_conv_size * h * (2 * k + v)
  chunk_flops = gla_chunk_flops if m.kda_variant == "gla" else kda_chunk_flops
  out["kda_chunk"] = n_kda * chunk_flops(1, 1, h, k, m.kda_chunk_size, v)

  h, nope, rope, dv = m.mla_num_heads, m.mla_qk_nope_dim, m.mla_qk_rope_dim, m.mla_v_dim
  dqk, rq, rkv = nope + rope, m.mla_q_lora_rank, m.mla_kv_lora_rank
  out["mla_q"] = n_mla * 2.0 * ((d * rq + rq * h * dqk) if rq > 0 else d * h * dqk)
  out["mla_kv_down"] = n_mla * 2.0 * d * rkv
  out["mla_k_rope"] = n_mla * 2.0 * d * rope
  out["mla_kv_up"] = n_mla * 2.0 * rkv * h * (nope + dv)
  out["mla_out_gate"] = n_mla * 2.0 * d * h * dv if m.mla_output_gate else 0.0
  out["mla_out"] = n_mla * 2.0 * h * dv * d
  out["mla_attention"] = n_mla * float(h * (dqk + dv) * (seq_len + 1))

  out["ffn"] = n_dense * 2.0 * 3 * d * m.dense_ffn_dim
  latent = m.moe_latent_dim if m.moe_latent_dim > 0 else d
  out["moe_router"] = n_moe * 2.0 * d * m.moe_num_experts
  out["moe_latent"] = n_moe * 2.0 * 2 * d * m.moe_latent_dim
  out["moe_routed"] = n_moe * m.moe_top_k * 2.0 * 3 * latent * m.moe_expert_dim
  out["moe_shared"] = n_moe * 2.0 * 3 * d * m.moe_num_shared * m.moe_shared_dim
  out["attnres_mix"] = float(sum(4 * s * d for s in attnres_mix_sources(m)))
  return out


def forward_flops_per_token(cfg: Union[ModelConfig, Config], seq_len: int) -> float:
  """The forward's FLOPs per token: the sum of `forward_flops_breakdown`."""
  return float(sum(forward_flops_breakdown(cfg, seq_len).values()))


def flops_per_token(cfg: Union[ModelConfig, Config], seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3 × forward) at row length `seq_len`.

  cfg: a ModelConfig, or the Config of `k3jax.config.from_gin` (its model is used). What is
  counted and what is not: this module's docstring. Use the current stage's seq_len: the causal
  attention term grows linearly with it.
  """
  return TRAINING_MULTIPLIER * forward_flops_per_token(cfg, seq_len)
