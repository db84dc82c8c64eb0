"""SiTU-GLU: the bounded gated FFN used by K3's dense layer, shared experts and routed experts.

    SiTU(a)    = β1 · tanh(a / β1) · sigmoid(a)          (Sigmoid-Tanh Unit; |SiTU| < β1)
    softcap(b) = β2 · tanh(b / β2)                        (|softcap| < β2)
    h          = SiTU(W_gate x) ⊙ softcap(W_up x)         (|h| < β1·β2 = 100 for K3's β1=4, β2=25)
    y          = W_out h

For |a| ≪ β1 and |b| ≪ β2 this is SwiGLU (silu(a)·b); everywhere it is smooth and bounded, which is
what K3 uses instead of rotations to keep activation outliers in check for low-precision training.
`ModelConfig.ffn_activation = 'swiglu'` drops both bounds (Kimi-Linear's FFN). The activation math
always runs in fp32 (`k3jax.ops.situ_glu`; docs/architecture.md).

With `chunk_tokens` > 0 (ImplConfig.position_chunk_tokens) the layer runs over [B, T, d] inputs in
rematerialised sequence chunks (`k3jax.ops.chunking`): its [B·T, m] hidden activations are never
alive whole.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers import common
from k3jax.ops.chunking import map_position_chunks
from k3jax.ops.situ_glu import situ_glu

__all__ = ["situ_glu_ffn", "SiTUGLU", "SiTUGLUWeights"]


class Kernel(nn.Module):
  """One weight matrix stored as `<name>/kernel`, exactly where `common.Dense` keeps its own (same
  path, initialiser and logical axes, hence the same values and checkpoints), returned as the raw
  array so that a pure function can use it inside a `lax.map` over chunks.

  Attributes: shape (d_in, d_out); axes their logical names; init_std; param_dtype.
  """
  shape: tuple
  axes: tuple
  init_std: float
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self) -> jax.Array:
    return common.logical_param(self, "kernel", self.shape, self.axes,
                                common.normal_init(self.init_std), self.param_dtype)


def glu_kernels(cfg: ModelConfig, width: int, hidden_dim: int, in_axis: str, hidden_axis: str
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Declares, in the flax module whose compact method calls this, the submodules 'gate', 'up'
  ([width, hidden_dim]) and 'out' ([hidden_dim, width]); returns their kernels in param_dtype."""
  if hidden_dim <= 0:
    raise ValueError(f"SiTUGLU.hidden_dim = {hidden_dim}: must be a positive integer")
  param_dtype = common.to_dtype(cfg.param_dtype)
  kernel = lambda shape, axes, name: Kernel(shape, axes, cfg.init_std, param_dtype,  # noqa: E731
                                            name=name)()
  return (kernel((width, hidden_dim), (in_axis, hidden_axis), "gate"),
          kernel((width, hidden_dim), (in_axis, hidden_axis), "up"),
          kernel((hidden_dim, width), (hidden_axis, in_axis), "out"))


def situ_glu_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array, *,
                 dtype, beta1: Optional[float], beta2: Optional[float]) -> jax.Array:
  """y = W_out(SiTU(W_gate x) ⊙ softcap(W_up x)), a pure function (SwiGLU when beta1 and beta2
  are None).

  x [..., d] any float dtype; w_gate, w_up [d, m]; w_out [m, d] (any float dtype). The matmuls run
  in `dtype` (inputs and weights cast to it), the activation math in fp32; returns [..., d] in
  `dtype`.
  """
  x = x.astype(dtype)
  gate = jnp.dot(x, w_gate.astype(dtype))
  up = jnp.dot(x, w_up.astype(dtype))
  h = situ_glu(gate, up, beta1, beta2).astype(dtype)
  return jnp.dot(h, w_out.astype(dtype))


class SiTUGLUWeights(nn.Module):
  """The parameters of a `SiTUGLU` (same names and shapes) without the computation: call with the
  width d to get (w_gate [d, m], w_up [d, m], w_out [m, d]) for `situ_glu_ffn`. Used where the GLU
  runs inside another layer's chunk loop (the MoE's shared experts)."""
  config: ModelConfig
  hidden_dim: int
  in_axis: str = "embed"
  hidden_axis: str = "mlp"

  @nn.compact
  def __call__(self, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return glu_kernels(self.config, width, self.hidden_dim, self.in_axis, self.hidden_axis)


class SiTUGLU(nn.Module):
  """y = W_out(SiTU(W_gate x) ⊙ softcap(W_up x)); the output width equals the input width.

  Attributes:
    config: model config (dtype, param_dtype, init_std, ffn_activation, situ_beta1, situ_beta2).
    hidden_dim: the GLU's hidden width m.
    in_axis: logical axis name of the input/output width (params 'gate'/'up' are
      (in_axis, hidden_axis), 'out' is (hidden_axis, in_axis)).
    hidden_axis: logical axis name of the hidden width.
    chunk_tokens: tokens per sequence chunk for [B, T, d] inputs (ImplConfig.
      position_chunk_tokens); 0: never chunked.
  Input x [..., d] any float dtype; output [..., d] in config.dtype. Only 3-d inputs [B, T, d] are
  chunked.
  """
  config: ModelConfig
  hidden_dim: int
  in_axis: str = "embed"
  hidden_axis: str = "mlp"
  chunk_tokens: int = 0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    w_gate, w_up, w_out = glu_kernels(cfg, x.shape[-1], self.hidden_dim, self.in_axis,
                                      self.hidden_axis)
    dtype = common.to_dtype(cfg.dtype)
    beta1, beta2 = cfg.glu_bounds()

    def ffn(v):
      return situ_glu_ffn(v, w_gate, w_up, w_out, dtype=dtype, beta1=beta1, beta2=beta2)

    if x.ndim != 3 or self.chunk_tokens <= 0:
      return ffn(x)
    y, _ = map_position_chunks(lambda v: (ffn(v), ()), [x], self.chunk_tokens)
    return y
