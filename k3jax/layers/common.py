"""Small pieces every layer uses: dtypes, parameters with logical axis names, RMSNorm.

Logical axis names (mapped to mesh axes by the one rule table in `k3jax/parallel/sharding.py`):
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

from k3jax.parallel import sharding
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
  kernel = pallas_or_xla(kernel, "ImplConfig.norm_kernel")
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


def bf16_pieces(a: jax.Array, count: int) -> list[jax.Array]:
  """fp32 a -> `count` bf16 arrays shaped like a, whose sum in exact arithmetic approximates a.

  Piece i is what pieces 0..i-1 leave of a, truncated to its top 8 significant bits (bf16's
  significand), taken from the bits rather than by a convert: XLA may drop an f32 -> bf16 -> f32
  round trip where it allows excess precision, which would make every later piece zero. Each
  remainder a - (pieces so far) is exact in fp32, and fp32 has 24 significant bits, so three
  pieces sum to a exactly (unless a remainder falls below fp32's smallest normal, 2^-126, where a
  GPU flushes it to zero); two leave less than 2^-14 of |a|.
  """
  rest = a.astype(jnp.float32)
  pieces = []
  for i in range(count):
    bits = jax.lax.bitcast_convert_type(rest, jnp.uint32)
    pieces.append(jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16))
    if i + 1 < count:
      top = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
      rest = rest - top
  return pieces


def _sum_thirds(y: jax.Array) -> jax.Array:
  """[..., 3n] -> [..., n]: (first + second) + third third."""
  n = y.shape[-1] // 3
  return (y[..., :n] + y[..., n:2 * n]) + y[..., 2 * n:]


def _bf16_dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """a · b over a's axis contract[0] and b's axis contract[1], bf16 operands, fp32 products and
  accumulation."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


@jax.custom_vjp
def dot_in_fp32(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., d] @ w [d, n] in fp32 arithmetic: the MoE router's logits; returns [..., n] fp32.

  x in bf16 (the bf16 models): w is split into three bf16 pieces that sum to it exactly
  (`bf16_pieces`), and x · w = Σ x · piece runs as ONE bf16 matmul against [d, 3n], with fp32
  products (a bf16 × bf16 product is exact in fp32) and fp32 accumulation: the same arithmetic as
  an fp32 matmul up to the order of the sums, on tensor cores. On an H200 the fp32 matmul and its
  two gradients took 0.55 ms a layer at medium.gin's 32K tokens (RESULTS.md, run 27).
  Any other x dtype: both upcast to fp32 and multiplied at HIGHEST precision.

  The backward keeps x in its own dtype (its fp32 upcast is exact) and returns fp32 gradients
  cast to x's and w's dtypes. For bf16 x: dw = xᵀ · dy with dy in three exact pieces (fp32
  arithmetic again); dx, rounded to bf16 at the end, from two pieces of dy and of w without the
  small terms (error < 2^-12 of Σ|dy||w|, under bf16's rounding of 2^-8).
  """
  if x.dtype == jnp.bfloat16:
    w_pieces = jnp.concatenate(bf16_pieces(w, 3), axis=-1)
    return _sum_thirds(_bf16_dot(x, w_pieces, (x.ndim - 1, 0)))
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _dot_in_fp32_fwd(x, w):
  return dot_in_fp32(x, w), (x, w)


def _dot_in_fp32_bwd(residuals, dy):
  x, w = residuals
  dy32 = dy.astype(jnp.float32)
  d = x.shape[-1]
  if x.dtype == jnp.bfloat16:
    dy_hi, dy_mid, dy_lo = bf16_pieces(dy32, 3)
    w_hi, w_mid = bf16_pieces(w, 2)
    # dx = dy_hi·w_hiᵀ + dy_hi·w_midᵀ + dy_mid·w_hiᵀ, one matmul over a 3n-long contraction.
    lhs = jnp.concatenate([dy_hi, dy_hi, dy_mid], axis=-1)
    rhs = jnp.concatenate([w_hi, w_mid, w_hi], axis=-1)
    dx = _bf16_dot(lhs, rhs, (lhs.ndim - 1, 1))
    dy_pieces = jnp.concatenate([dy_hi, dy_mid, dy_lo], axis=-1).reshape(-1, 3 * w.shape[-1])
    dw = _sum_thirds(_bf16_dot(x.reshape(-1, d), dy_pieces, (0, 0)))
    return dx.astype(x.dtype), dw.astype(w.dtype)
  hi = jax.lax.Precision.HIGHEST
  x32 = x.astype(jnp.float32)
  dx = jnp.dot(dy32, w.astype(jnp.float32).T, precision=hi)
  dw = jnp.dot(x32.reshape(-1, d).T, dy32.reshape(-1, dy.shape[-1]), precision=hi)
  return dx.astype(x.dtype), dw.astype(w.dtype)


dot_in_fp32.defvjp(_dot_in_fp32_fwd, _dot_in_fp32_bwd)
