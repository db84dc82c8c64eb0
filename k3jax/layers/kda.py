"""The KDA layer: projections, short convs, gates, the KDA op, gated per-head RMSNorm, output.

docs/architecture.md §1. For the normed layer input x [B, T, d]:

  q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   per head [H, K] / [H, V]
  g       = kda_gate(x W_f, A_log, dt_bias, lower_bound)              log decay [B, T, H, K] fp32
            (W_f full rank d -> H*K, or low rank d -> kda_gate_rank -> H*K)
  beta    = sigmoid(x W_b)                                           [B, T, H]
  o       = chunk_kda(q, k, v, g, beta, use_qk_l2norm=True)            [B, T, H, V]
  y       = (RMSNorm_per_head(o) * w) * sigmoid(x W_g)  then  y W_o    [B, T, d]
            (W_g full rank d -> H*V, or low rank d -> kda_output_gate_rank -> H*V)

Variants (`ModelConfig.kda_variant`, docs/architecture.md §1.9), every other step as above:
  'gdn'  W_f: d -> H (or d -> kda_gate_rank -> H), dt_bias [H]; g = gdn_gate(...) [B, T, H], one
         decay per head, broadcast over K into the KDA op (`chunk_gdn`; both backends)
  'gla'  no W_b and no β; o = chunk_gla(q, k, v, g, use_qk_l2norm=True): S ← diag(e^g) S + k vᵀ
         (XLA only: an explicit Pallas kda_backend raises ValueError)

Packed rows: segment ids reset the KDA state and isolate the convs per document; padding tokens
output zeros.

Decode (`decode=True`). The 'cache' collection holds, per layer:
  q_conv/conv_state, k_conv/conv_state [B, W-1, H*K], v_conv/conv_state [B, W-1, H*V] (cfg.dtype)
  kda_state [B, H, K, V] float32
all created (zeros) by the init call, sized by its batch. A call with T > 1 runs the chunked op from the
cached state (prefill, or a later chunk of it); T == 1 steps the recurrence. Each call continues the
row's one document: in decode mode segment ids only mark padding (0), which leaves every state as is.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import KDA_VARIANTS, ImplConfig, ModelConfig
from k3jax.layers.common import config_weight, gated_rms_norm, logical_param, to_dtype
from k3jax.layers.conv import ShortConv
from k3jax.ops.kda import chunk_kda, recurrent_kda
from k3jax.ops.kda_inputs import kda_gate, l2_normalize
from k3jax.ops.kda_variants import chunk_gdn, chunk_gla, gdn_gate, recurrent_gdn, recurrent_gla

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


def a_log_init(cfg: ModelConfig):
  """A_log [H] by `ModelConfig.kda_a_log_init`: 0 (exp(A_log) = 1) for 'zero', and for 'auto'
  with the bounded gate; else log U(1, 16) (fla's init, and the K3 and Kimi-Linear releases')."""
  zero = cfg.kda_a_log_init == "zero" or (cfg.kda_a_log_init == "auto"
                                          and cfg.kda_gate_lower_bound is not None)

  def init(key, shape, dtype=jnp.float32):
    if zero:
      return jnp.zeros(shape, dtype)
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
  return init


def dt_bias_init(key, shape, dtype=jnp.float32):
  """dt_bias [H*K] = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba-style, floored at 1e-4)."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
  dt = jnp.maximum(dt, DT_FLOOR)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDALayer(nn.Module):
  """Kimi Delta Attention layer. Call: x [B, T, d] (normed), segment_ids [B, T] | None -> [B, T, d].

  The decay gate g is sown into 'intermediates' as `gate` for diagnostics: fp32 [B, T, H, K], or
  [B, T, H] for the per-head gate of `kda_variant = 'gdn'`.
  """
  config: ModelConfig
  impl: ImplConfig = ImplConfig()   # kda_backend, kda_conv_kernel

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False) -> jax.Array:
    cfg, impl = self.config, self.impl
    dtype, param_dtype = to_dtype(cfg.dtype), to_dtype(cfg.param_dtype)
    b, t, d = x.shape
    if d != cfg.d_model:
      raise ValueError(f"x last dim {d} differs from d_model={cfg.d_model}")
    if segment_ids is not None and segment_ids.shape != (b, t):
      raise ValueError(f"segment_ids must have shape {(b, t)}, got {segment_ids.shape}")
    h, dk, dv = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim
    variant = cfg.kda_variant
    if variant not in KDA_VARIANTS:
      raise ValueError(f"ModelConfig.kda_variant = {variant!r}: expected one of {KDA_VARIANTS}")
    if variant == "gla" and impl.kda_backend == "pallas":
      # An explicit choice is refused, not replaced: 'auto' runs GLA on XLA.
      raise ValueError("ImplConfig.kda_backend = 'pallas' cannot run ModelConfig.kda_variant = "
                       "'gla': the Pallas KDA kernels always apply the delta rule; use 'auto' or "
                       "'xla'")
    x = x.astype(dtype)
    initializing = self.is_initializing()
    stepping = decode and not initializing

    def conv(name, y):
      return ShortConv(width=cfg.kda_conv_size, channel_axis="heads", dtype=dtype,
                       param_dtype=param_dtype, kernel_choice=impl.kda_conv_kernel,
                       name=name)(y, segment_ids, decode=decode)

    q = jnp.einsum("btd,dhk->bthk", x,
                   config_weight(self, "q_proj", (d, h, dk), ("embed", "heads", "head_dim")))
    k = jnp.einsum("btd,dhk->bthk", x,
                   config_weight(self, "k_proj", (d, h, dk), ("embed", "heads", "head_dim")))
    v = jnp.einsum("btd,dhv->bthv", x,
                   config_weight(self, "v_proj", (d, h, dv), ("embed", "heads", "head_dim")))
    q = conv("q_conv", q.reshape(b, t, h * dk)).reshape(b, t, h, dk)
    k = conv("k_conv", k.reshape(b, t, h * dk)).reshape(b, t, h, dk)
    v = conv("v_conv", v.reshape(b, t, h * dv)).reshape(b, t, h, dv)

    # The decay gate's pre-activation; chunk_kda forms g = kda_gate(gate_x, ...) from it.
    if variant == "gdn":
      # One decay per head: [B, T, H], broadcast over K inside chunk_gdn / recurrent_gdn.
      if cfg.kda_gate_rank > 0:
        f_a = config_weight(self, "f_a_proj", (d, cfg.kda_gate_rank), ("embed", None))
        f_b = config_weight(self, "f_b_proj", (cfg.kda_gate_rank, h), (None, "heads"))
        gate_x = (x @ f_a) @ f_b
      else:
        gate_x = x @ config_weight(self, "f_proj", (d, h), ("embed", "heads"))
    elif cfg.kda_gate_rank > 0:
      f_a = config_weight(self, "f_a_proj", (d, cfg.kda_gate_rank), ("embed", None))
      f_b = config_weight(self, "f_b_proj", (cfg.kda_gate_rank, h, dk), (None, "heads", "head_dim"))
      gate_x = jnp.einsum("btr,rhk->bthk", x @ f_a, f_b)
    else:
      gate_x = jnp.einsum("btd,dhk->bthk", x,
                          config_weight(self, "f_proj", (d, h, dk), ("embed", "heads", "head_dim")))
    gate_channels = h if variant == "gdn" else h * dk
    gate_fn = gdn_gate if variant == "gdn" else kda_gate
    a_log = logical_param(self, "A_log", (h,), ("heads",), a_log_init(cfg), jnp.float32)
    dt_bias = logical_param(self, "dt_bias", (gate_channels,), ("heads",), dt_bias_init,
                            jnp.float32)
    gate_params = dict(A_log=a_log, dt_bias=dt_bias, lower_bound=cfg.kda_gate_lower_bound)
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "gate", gate_fn(gate_x, **gate_params))

    beta = None
    if variant != "gla":   # GLA writes k vᵀ unscaled: it has no β
      beta = jax.nn.sigmoid(
          jnp.einsum("btd,dh->bth", x, config_weight(self, "b_proj", (d, h), ("embed", "heads")))
          .astype(jnp.float32))

    def chunked(g, segment_ids, **options):
      """The variant's chunked op on (q, k, v, g[, beta]); g is the fused gate's raw input
      when options hold its parameters."""
      options.update(use_qk_l2norm=True, segment_ids=segment_ids, chunk_size=cfg.kda_chunk_size,
                     backend=impl.kda_backend)
      if variant == "gla":
        return chunk_gla(q, k, v, g, **options)
      return (chunk_gdn if variant == "gdn" else chunk_kda)(q, k, v, g, beta, **options)

    if not decode:
      # The gate fused into the chunked kernels: g = kda_gate(gate_x, ...) is formed inside them
      # (on the Pallas path, one static kernel variant for the bounded gate and no fp32 decay
      # written, read back or saved for the backward; the XLA path computes kda_gate first).
      # The short convolutions give q, k, v = 0 at padding (segment id 0), and their backward
      # ignores the gradients there: chunk_kda need not mask them again (0.8 % of medium.gin's
      # step on an H200, RESULTS.md run 30).
      o, _ = chunked(gate_x, segment_ids, qkv_zero_at_padding=True, **gate_params)
    else:
      g = gate_fn(gate_x, **gate_params)
      state = self.variable("cache", "kda_state", jnp.zeros, (b, h, dk, dv), jnp.float32)
      if not stepping:  # init: size the cache, leave it empty, run the plain forward.
        o, _ = chunked(g, segment_ids)
      else:
        if state.value.shape[0] != b:
          raise ValueError(f"decode batch {b} differs from the cache batch {state.value.shape[0]}")
        # One continuing document per row: ids only separate real tokens (1) from padding (0).
        doc = None if segment_ids is None else (segment_ids != 0).astype(jnp.int32)
        carry = dict(initial_state=state.value, output_final_state=True, segment_ids=doc)
        if t == 1:
          qn, kn = l2_normalize(q), l2_normalize(k)
          if variant == "gla":
            o, new_state = recurrent_gla(qn, kn, v, g, **carry)
          else:
            o, new_state = (recurrent_gdn if variant == "gdn" else recurrent_kda)(
                qn, kn, v, g, beta, **carry)
        else:
          o, new_state = chunked(g, doc, initial_state=state.value, output_final_state=True)
        state.value = new_state.astype(jnp.float32)

    # Gated per-head RMSNorm (fla's FusedRMSNormGated with a sigmoid gate), fp32.
    norm_w = logical_param(self, "o_norm", (dv,), ("norm",), nn.initializers.ones, param_dtype)
    if cfg.kda_output_gate_rank > 0:
      g_a = config_weight(self, "g_a_proj", (d, cfg.kda_output_gate_rank), ("embed", None))
      g_b = config_weight(self, "g_b_proj", (cfg.kda_output_gate_rank, h, dv),
                          (None, "heads", "head_dim"))
      out_gate = jnp.einsum("btr,rhv->bthv", x @ g_a, g_b)
    else:
      out_gate = jnp.einsum("btd,dhv->bthv", x, config_weight(self, "g_proj", (d, h, dv),
                                                              ("embed", "heads", "head_dim")))
    o = gated_rms_norm(o, out_gate, cfg.norm_eps, norm_w)
    w_o = config_weight(self, "o_proj", (h, dv, d), ("heads", "head_dim", "embed"))
    return jnp.einsum("bthv,hvd->btd", o.astype(dtype), w_o)
