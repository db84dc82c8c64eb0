"""Small pieces every layer uses: dtypes, parameters with logical axis names, RMSNorm.

Logical axis names (mapped to mesh axes by the one rule table in `k3jax/sharding.py`):
  parameters:  'vocab', 'embed', 'heads', 'head_dim', 'mlp', 'expert', 'latent', 'kv_lora',
               'q_lora', 'conv', 'norm'
  activations: 'activation_batch', 'activation_length', 'activation_embed', 'activation_heads',
               'activation_exp'
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax import sharding
from k3jax.ops.kernel_choice import pallas_or_xla
from pallas_kernels.rms_norm import RmsNormConfig, rms_norm_bwd

DTYPE_MAP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def to_dtype(name: str):
  return DTYPE_MAP[name]


def normal_init(std: float) -> Callable:
  return nn.initializers.normal(stddev=std)


def logical_param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[Optional[str]],
                  init: Callable, dtype=jnp.float32) -> jax.Array:
  """Declares a parameter annotated with logical axis names (one per dim); returns the raw array."""
  if len(axes) != len(shape):
    raise ValueError(f"parameter {name!r}: {len(axes)} axis names for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def config_weight(module: nn.Module, name: str, shape: Sequence[int],
                  axes: Sequence[Optional[str]]) -> jax.Array:
  """A weight of a layer that has a `config` (ModelConfig): normal(init_std) in param_dtype,
  with logical axis names, returned cast to the compute dtype."""
  cfg = module.config
  return logical_param(module, name, shape, axes, normal_init(cfg.init_std),
                       to_dtype(cfg.param_dtype)).astype(to_dtype(cfg.dtype))


class Dense(nn.Module):
  """y = x @ W (+ b) over the last axis, with logical axis names on W.

  Attributes:
    features: output width.
    axes: logical names of W, (in_axis, out_axis).
  Input x [..., d_in] in any float dtype; output [..., features] in `dtype`.
  """
  features: int
  axes: tuple = ("embed", "mlp")
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  init_std: float = 0.02

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = logical_param(self, "kernel", (x.shape[-1], self.features), self.axes,
                      normal_init(self.init_std), self.param_dtype)
    y = jnp.dot(x.astype(self.dtype), w.astype(self.dtype))
    if self.use_bias:
      b = logical_param(self, "bias", (self.features,), (self.axes[1],), nn.initializers.zeros,
                        self.param_dtype)
      y = y + b.astype(self.dtype)
    return y


def rms_norm(x: jax.Array, eps: float, weight: Optional[jax.Array] = None, *,
             out_dtype=jnp.float32, kernel: str = "xla") -> jax.Array:
  """RMS-normalises the last axis in fp32; returns `out_dtype` (fp32 by default). weight (if
  given) scales the result.

  x [..., d] any float dtype; weight [d] or None. y = x · r · weight, r = (mean_d x² + eps)^-½.
  The backward pass keeps x in its own dtype and r [..., 1] fp32 (a hand-written VJP): autodiff
  of the fp32 formula would keep an fp32 copy of x, a [B, T, d] fp32 array per norm (3 GiB per
  norm of a 1M-token row at d = 768). Rounding to out_dtype inside the VJP hands its backward the
  cotangent in out_dtype (no fp32 copy for a kernel to read).
  kernel: the backward, 'xla' (XLA's fusions), 'pallas' (`pallas_kernels.rms_norm.rms_norm_bwd`:
    one kernel; interpreted on CPU; each device's rows under a mesh) or 'auto'
    (`k3jax.ops.kernel_choice.pallas_or_xla`): the same math.
  """
  if weight is None:
    weight = jnp.ones((x.shape[-1],), jnp.float32)
  kernel = pallas_or_xla(kernel, "ModelConfig.norm_kernel")
  return _rms_norm(x, weight, float(eps), jnp.dtype(out_dtype), kernel)


def _rms_scale(x: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _normed(x: jax.Array, r: jax.Array, weight: jax.Array) -> jax.Array:
  """x · r · weight in fp32 (the RMSNorm's output, from its scale r)."""
  return x.astype(jnp.float32) * r * weight.astype(jnp.float32)


def _rms_norm_fwd(x, weight, eps, out_dtype, kernel):
  del kernel
  r = _rms_scale(x, eps)
  return _normed(x, r, weight).astype(out_dtype), (x, weight, r)


def _rms_norm_bwd(eps, out_dtype, kernel, residuals, dy):
  """u = w·dy; dx = r·u − x·r³·mean_d(x·u); dw = Σ over the leading axes of dy·x·r."""
  del eps, out_dtype
  x, weight, r = residuals
  if kernel == "pallas":
    dx, dw = _pallas_rms_norm_bwd(x, weight, r, dy)
    return dx, dw.astype(weight.dtype)
  x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
  u = dy32 * weight.astype(jnp.float32)
  dx = r * u - x32 * r**3 * jnp.mean(x32 * u, axis=-1, keepdims=True)
  dw = jnp.sum((dy32 * x32 * r).reshape(-1, x.shape[-1]), axis=0)
  return dx.astype(x.dtype), dw.astype(weight.dtype)


def _pallas_rms_norm_bwd(x, weight, r, dy):
  """`_rms_norm_bwd`'s math as one Pallas kernel. The kernel is opaque to XLA's partitioner
  (under a mesh it would gather every row onto every device): each device runs its own rows and
  dw is the sum of the devices' parts. One row (no batch axis): the kernel alone."""
  config = RmsNormConfig(interpret=jax.default_backend() == "cpu")
  if x.ndim < 2:
    return rms_norm_bwd(x, weight, r, dy, config)

  def local(weight, x, r, dy):
    dx, dw = rms_norm_bwd(x, weight, r, dy, config)
    return dx, dw[None]

  dx, dw_parts = sharding.map_over_batch_shards(local, x, r, dy, shared=(weight,))
  return dx, jnp.sum(dw_parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, out_dtype, kernel: str) -> jax.Array:
  return _rms_norm_fwd(x, weight, eps, out_dtype, kernel)[0]


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned scale (init 1). Computes in fp32, returns `dtype`.
  kernel: its backward, 'xla', 'pallas' or 'auto' (`rms_norm`)."""
  eps: float = 1e-5
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel: str = "xla"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = logical_param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones,
                      self.param_dtype)
    return rms_norm(x, self.eps, w, out_dtype=self.dtype, kernel=self.kernel)


def gated_rms_norm(x: jax.Array, gate: jax.Array, eps: float, weight: jax.Array) -> jax.Array:
  """y = rms_norm(x, eps, weight) · sigmoid(gate), in fp32 (fla's FusedRMSNormGated with a sigmoid).

  x, gate [..., d] any float dtypes; weight [d]. Returns fp32. The backward keeps x and gate in
  their own dtypes and r [..., 1] fp32, and recomputes the sigmoid and the norm: autodiff of the
  product would keep both fp32 factors, two [..., d] fp32 arrays per layer (KDA's output gate:
  6 KB a token per small.gin layer, `experiments/benchmarks/saved_residuals.py`).
  """
  return _gated_rms_norm(x, gate, weight, float(eps))


def _gated_rms_norm_fwd(x, gate, weight, eps):
  n, (_, _, r) = _rms_norm_fwd(x, weight, eps, jnp.float32, "xla")
  return sigmoid_gate(n, gate), (x, gate, weight, r)


def _gated_rms_norm_bwd(eps, residuals, dy):
  """The sigmoid gate's VJP at the recomputed n = x·r·w, then the norm's."""
  x, gate, weight, r = residuals
  n = _normed(x, r, weight)
  dn, dgate = _sigmoid_gate_bwd((n, gate), dy)
  dx, dw = _rms_norm_bwd(eps, jnp.float32, "xla", (x, weight, r), dn)
  return dx, dgate, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gated_rms_norm(x, gate, weight, eps):
  return _gated_rms_norm_fwd(x, gate, weight, eps)[0]


_gated_rms_norm.defvjp(_gated_rms_norm_fwd, _gated_rms_norm_bwd)


@jax.custom_vjp
def sigmoid_gate(x: jax.Array, gate: jax.Array) -> jax.Array:
  """y = x · sigmoid(gate) in fp32 (MLA's output gate). x, gate [...] any float dtypes; returns
  fp32. The backward keeps x and gate in their own dtypes and recomputes the sigmoid (autodiff
  would keep the fp32 x and sigmoid(gate))."""
  return x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def _sigmoid_gate_fwd(x, gate):
  return sigmoid_gate(x, gate), (x, gate)


def _sigmoid_gate_bwd(residuals, dy):
  x, gate = residuals
  s = jax.nn.sigmoid(gate.astype(jnp.float32))
  dy32 = dy.astype(jnp.float32)
  return ((dy32 * s).astype(x.dtype),
          (dy32 * x.astype(jnp.float32) * s * (1.0 - s)).astype(gate.dtype))


sigmoid_gate.defvjp(_sigmoid_gate_fwd, _sigmoid_gate_bwd)


@jax.custom_vjp
def dot_in_fp32(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., d] @ w [d, n] with both upcast to fp32 (HIGHEST precision): the MoE router's logits.

  The backward keeps x in its own dtype: its fp32 upcast is exact, so the gradients are those of
  autodiff, which would keep the fp32 copy of x ([..., d] fp32 a layer).
  """
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _dot_in_fp32_fwd(x, w):
  return dot_in_fp32(x, w), (x, w)


def _dot_in_fp32_bwd(residuals, dy):
  x, w = residuals
  hi = jax.lax.Precision.HIGHEST
  dy32, x32 = dy.astype(jnp.float32), x.astype(jnp.float32)
  dx = jnp.dot(dy32, w.astype(jnp.float32).T, precision=hi)
  dw = jnp.dot(x32.reshape(-1, x.shape[-1]).T, dy32.reshape(-1, dy.shape[-1]), precision=hi)
  return dx.astype(x.dtype), dw.astype(w.dtype)


dot_in_fp32.defvjp(_dot_in_fp32_fwd, _dot_in_fp32_bwd)
