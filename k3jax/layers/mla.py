"""Gated Multi-head Latent Attention (DeepSeek MLA, NoPE, with K3's sigmoid output gate).

docs/architecture.md §2. Per head h, for the normed layer input x [B, T, d]:

  c_kv   = RMSNorm(x W_dkv)                       [B, T, kv_lora]      (eps 1e-6, like the LoRA norms)
  k_nope = c_kv W_uk[h],  v = c_kv W_uv[h]         [B, T, H, nope], [B, T, H, v_dim]
  k_rope = x W_kr                                  [B, T, rope], shared by all heads, never rotated
  q      = RMSNorm(x W_dq) W_uq  (q_lora > 0)  or  x W_q        [B, T, H, nope + rope]
  o      = softmax((q . [k_nope; k_rope]) / sqrt(nope + rope)) v
  o      = o * sigmoid(x W_g)   (cfg.mla_output_gate; elementwise over the flattened heads)
  y      = o W_o

Projection weights keep the head axis separate ([d, H, dh], [H, dh, d]) so that per-head optimizers
(Per-Head Muon, QK-Clip) can address heads directly.

Decode (`decode=True`). The 'cache' collection holds only the latent:
  cached_ckv   [B, max_len, kv_lora]  normed c_kv, in cfg.dtype
  cached_krope [B, max_len, rope]     shared rope key, in cfg.dtype (absent when rope == 0)
  cached_valid [B, max_len] int32     1 where a real (non-padding) token was written
  cache_index  [] int32               number of positions written so far (same for all rows)
max_len is the T of the init call. A call with T tokens writes positions [index, index + T) (the caller
keeps index + T <= max_len) and attends over the cache with W_uk absorbed into the query and W_uv
applied after attention (MQA over the latent: one shared key [c_kv; k_rope] and value c_kv). In decode
mode segment ids only mark padding (0); all nonzero tokens of a row form one continuing document.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers.common import RMSNorm, config_weight, sigmoid_gate, to_dtype
from k3jax.ops.attention import (DEFAULT_KV_BLOCK, DEFAULT_Q_BLOCK, attention,
                                 max_attention_logits)
from k3jax.ops.attention_blockwise import blockwise_max_logits
from k3jax.parallel import context

# DeepSeek / Kimi use eps 1e-6 on the q_a / kv_a LoRA norms (docs/architecture.md §2).
LORA_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
  """Gated MLA layer. Call: x [B, T, d] (already normed), segment_ids [B, T] or None -> [B, T, d]."""
  config: ModelConfig
  impl: ImplConfig = ImplConfig()   # attention_impl

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False) -> jax.Array:
    cfg = self.config
    dtype = to_dtype(cfg.dtype)
    b, t, d = x.shape
    if d != cfg.d_model:
      raise ValueError(f"x last dim {d} differs from d_model={cfg.d_model}")
    if segment_ids is not None and segment_ids.shape != (b, t):
      raise ValueError(f"segment_ids must have shape {(b, t)}, got {segment_ids.shape}")
    h, nope, rope = cfg.mla_num_heads, cfg.mla_qk_nope_dim, cfg.mla_qk_rope_dim
    dqk, dv, r_kv = nope + rope, cfg.mla_v_dim, cfg.mla_kv_lora_rank
    scale = dqk ** -0.5
    x = x.astype(dtype)

    # Queries.
    if cfg.mla_q_lora_rank > 0:
      w_dq = config_weight(self, "wq_a", (d, cfg.mla_q_lora_rank), ("embed", "q_lora"))
      c_q = RMSNorm(eps=LORA_NORM_EPS, dtype=dtype, param_dtype=to_dtype(cfg.param_dtype),
                    name="q_norm")(x @ w_dq)
      w_uq = config_weight(self, "wq_b", (cfg.mla_q_lora_rank, h, dqk),
                           ("q_lora", "heads", "head_dim"))
      q = jnp.einsum("btr,rhk->bthk", c_q, w_uq)
    else:
      w_q = config_weight(self, "wq", (d, h, dqk), ("embed", "heads", "head_dim"))
      q = jnp.einsum("btd,dhk->bthk", x, w_q)
    q_nope, q_rope = q[..., :nope], q[..., nope:]

    # Latent keys/values.
    w_dkv = config_weight(self, "wkv_a", (d, r_kv), ("embed", "kv_lora"))
    c_kv = RMSNorm(eps=LORA_NORM_EPS, dtype=dtype, param_dtype=to_dtype(cfg.param_dtype),
                   name="kv_norm")(x @ w_dkv)
    k_rope = None
    if rope > 0:
      w_kr = config_weight(self, "wk_rope", (d, rope), ("embed", "head_dim"))
      k_rope = x @ w_kr
    w_uk = config_weight(self, "wk_b", (r_kv, h, nope), ("kv_lora", "heads", "head_dim"))
    w_uv = config_weight(self, "wv_b", (r_kv, h, dv), ("kv_lora", "heads", "head_dim"))

    if decode and not self.is_initializing():
      o = self._decode_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, segment_ids, scale)
    else:
      if decode:  # init: size the cache (max_len = T) and run the plain forward.
        self._cache_vars(b, t, dtype)
      o = self._full_attention(q, c_kv, k_rope, w_uk, w_uv, segment_ids, scale)

    if cfg.mla_output_gate:
      w_g = config_weight(self, "w_gate", (d, h, dv), ("embed", "heads", "head_dim"))
      o = sigmoid_gate(o, jnp.einsum("btd,dhv->bthv", x, w_g)).astype(dtype)
    w_o = config_weight(self, "wo", (h, dv, d), ("heads", "head_dim", "embed"))
    return jnp.einsum("bthv,hvd->btd", o.astype(dtype), w_o)

  def _full_attention(self, q, c_kv, k_rope, w_uk, w_uv, segment_ids, scale):
    """Materialised per-head K/V (training and the reference for decode). Returns [B, T, H, v].

    Under a mesh with a context axis, each slice of the row all-gathers the latent c_kv / k_rope
    of the whole row (never the expanded keys and values), expands it and attends its queries to
    it (`k3jax.parallel.context.mla_attention_over_slices`)."""
    if context.context_slices() > 1:
      return self._attention_over_slices(q, c_kv, k_rope, w_uk, w_uv, segment_ids, scale)
    k, v = _expand(c_kv, k_rope, w_uk, w_uv)
    if self.is_mutable_collection("attn_stats"):
      # QK-Clip reads the per-head max logit; computed only when the trainer asks for it.
      self.sow("attn_stats", "max_logits",
               max_attention_logits(q, k, segment_ids=segment_ids, scale=scale))
    return attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, causal=True,
                     scale=scale, implementation=self.impl.attention_impl)

  def _attention_over_slices(self, q, c_kv, k_rope, w_uk, w_uv, segment_ids, scale):
    implementation = self.impl.attention_impl
    if implementation not in ("auto", "xla"):
      raise ValueError(f"ImplConfig.attention_impl = {implementation!r} attends within one row on "
                       "one device; under context parallelism (a mesh with a context axis) MLA "
                       "runs the 'xla' attention over the gathered latent: set 'auto' or 'xla'")
    want_stats = self.is_mutable_collection("attn_stats")

    def attend(w_uk, w_uv, q, c_row, rope_row, q_seg, kv_seg, q_pos, kv_pos):
      k, v = _expand(c_row, rope_row, w_uk, w_uv)
      b = q.shape[0]
      q_pos, kv_pos = (jnp.broadcast_to(p, (b, p.shape[0])) for p in (q_pos, kv_pos))
      o = attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                    kv_positions=kv_pos, causal=True, scale=scale, implementation="xla")
      if not want_stats:
        return o
      # Per device: the max over its rows and slice, [1, 1, H]; the max over devices follows.
      stats = blockwise_max_logits(q, k, q_seg, q_pos, kv_seg, kv_pos, scale=float(scale),
                                   causal=True, q_block=DEFAULT_Q_BLOCK, kv_block=DEFAULT_KV_BLOCK)
      return o, stats[None, None]

    out = context.mla_attention_over_slices(attend, q, c_kv, k_rope, segment_ids,
                                            shared=(w_uk, w_uv))
    if not want_stats:
      return out
    o, stats = out
    self.sow("attn_stats", "max_logits", jax.lax.stop_gradient(jnp.max(stats, axis=(0, 1))))
    return o

  def _cache_vars(self, b, max_len, dtype):
    cfg = self.config
    ckv = self.variable("cache", "cached_ckv", jnp.zeros, (b, max_len, cfg.mla_kv_lora_rank), dtype)
    krope = None
    if cfg.mla_qk_rope_dim > 0:
      krope = self.variable("cache", "cached_krope", jnp.zeros, (b, max_len, cfg.mla_qk_rope_dim),
                            dtype)
    valid = self.variable("cache", "cached_valid", jnp.zeros, (b, max_len), jnp.int32)
    index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    return ckv, krope, valid, index

  def _decode_attention(self, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, segment_ids, scale):
    """Appends this call's latents to the cache and attends over it (absorbed form)."""
    b, t = c_kv.shape[:2]
    if not self.has_variable("cache", "cached_ckv"):
      raise ValueError("decode=True needs a cache: init the model with decode=True first")
    ckv, krope, valid, index = self._cache_vars(b, 0, c_kv.dtype)
    if ckv.value.shape[0] != b:
      raise ValueError(f"decode batch {b} differs from the cache batch {ckv.value.shape[0]}")
    max_len = ckv.value.shape[1]
    if t > max_len:
      raise ValueError(f"{t} tokens do not fit a cache of max_len {max_len}")
    idx = index.value
    ckv.value = jax.lax.dynamic_update_slice(ckv.value, c_kv.astype(ckv.value.dtype), (0, idx, 0))
    if krope is not None:
      krope.value = jax.lax.dynamic_update_slice(krope.value, k_rope.astype(krope.value.dtype),
                                                 (0, idx, 0))
    q_valid = (jnp.ones((b, t), jnp.int32) if segment_ids is None
               else (segment_ids != 0).astype(jnp.int32))
    valid.value = jax.lax.dynamic_update_slice(valid.value, q_valid, (0, idx))
    index.value = idx + t

    # W_uk absorbed: q_nope . (W_uk c) = (W_uk^T q_nope) . c, so every head shares one latent key.
    q_lat = jnp.einsum("bthk,rhk->bthr", q_nope, w_uk)
    keys = ckv.value
    if krope is not None:
      q_lat = jnp.concatenate([q_lat, q_rope], axis=-1)
      keys = jnp.concatenate([keys, krope.value], axis=-1)
    # cuDNN caps head dims at 256 and kv_lora + rope exceeds that at real sizes: XLA here.
    o_lat = attention(q_lat, keys[:, :, None, :], ckv.value[:, :, None, :],
                      q_segment_ids=q_valid, kv_segment_ids=valid.value,
                      q_positions=idx + jnp.arange(t, dtype=jnp.int32),
                      kv_positions=jnp.arange(max_len, dtype=jnp.int32),
                      causal=True, scale=scale, implementation="xla")
    return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)


def _expand(c_kv: jax.Array, k_rope: Optional[jax.Array], w_uk: jax.Array,
            w_uv: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-head keys [B, S, H, nope + rope] and values [B, S, H, v] from the latent c_kv [B, S, R]
  and the shared rope key k_rope [B, S, rope] (or None)."""
  k = jnp.einsum("btr,rhk->bthk", c_kv, w_uk)
  if k_rope is not None:
    kr = jnp.broadcast_to(k_rope[:, :, None, :], k.shape[:3] + (k_rope.shape[-1],))
    k = jnp.concatenate([k, kr], axis=-1)
  return k, jnp.einsum("btr,rhv->bthv", c_kv, w_uv)
