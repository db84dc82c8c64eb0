"""SiTU-GLU: the bounded gated FFN used by K3's dense layer, shared experts and routed experts.

    SiTU(a)    = β1 · tanh(a / β1) · sigmoid(a)          (Sigmoid-Tanh Unit; |SiTU| < β1)
    softcap(b) = β2 · tanh(b / β2)                        (|softcap| < β2)
    h          = SiTU(W_gate x) ⊙ softcap(W_up x)         (|h| < β1·β2 = 100 for K3's β1=4, β2=25)
    y          = W_out h

For |a| ≪ β1 and |b| ≪ β2 this is SwiGLU (silu(a)·b); everywhere it is smooth and bounded, which is
what K3 uses instead of rotations to keep activation outliers in check for low-precision training.
The activation math always runs in fp32 (ARCHITECTURE.md §4).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from k3jax.config import ModelConfig
from k3jax.layers import common
# The activation math lives in ops (ops may not import layers); this module is its public home.
from k3jax.ops.moe import situ, situ_glu, softcap  # noqa: F401

__all__ = ["situ", "softcap", "situ_glu", "SiTUGLU"]


class SiTUGLU(nn.Module):
  """y = W_out(SiTU(W_gate x) ⊙ softcap(W_up x)); the output width equals the input width.

  Attributes:
    config: model config (dtype, param_dtype, init_std, situ_beta1, situ_beta2).
    hidden_dim: the GLU's hidden width m.
    in_axis: logical axis name of the input/output width (params 'gate'/'up' are
      (in_axis, hidden_axis), 'out' is (hidden_axis, in_axis)).
    hidden_axis: logical axis name of the hidden width.
  Input x [..., d] any float dtype; output [..., d] in config.dtype.
  """
  config: ModelConfig
  hidden_dim: int
  in_axis: str = "embed"
  hidden_axis: str = "mlp"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    if self.hidden_dim <= 0:
      raise ValueError(f"SiTUGLU.hidden_dim = {self.hidden_dim}: must be a positive integer")
    dtype = common.to_dtype(cfg.dtype)
    param_dtype = common.to_dtype(cfg.param_dtype)
    dense = lambda features, axes, name: common.Dense(  # noqa: E731
        features, axes=axes, dtype=dtype, param_dtype=param_dtype, init_std=cfg.init_std,
        name=name)
    gate = dense(self.hidden_dim, (self.in_axis, self.hidden_axis), "gate")(x)
    up = dense(self.hidden_dim, (self.in_axis, self.hidden_axis), "up")(x)
    h = situ_glu(gate, up, cfg.situ_beta1, cfg.situ_beta2).astype(dtype)
    return dense(x.shape[-1], (self.hidden_axis, self.in_axis), "out")(h)
