"""SiTU-GLU's activation math: h = SiTU(gate) ⊙ softcap(up), in fp32, with a lean backward.

    SiTU(a)    = β1 · tanh(a / β1) · sigmoid(a)          (Sigmoid-Tanh Unit; |SiTU| < β1)
    softcap(b) = β2 · tanh(b / β2)                        (|softcap| < β2)

Both bounds None give SwiGLU, h = silu(gate) ⊙ up, the limit as β1, β2 → ∞ (Kimi-Linear's and
most MoE models' activation; `ModelConfig.ffn_activation` chooses, `ModelConfig.glu_bounds`
gives the bounds).

The dense FFN and the shared experts (`k3jax.layers.ffn`) and the routed experts
(`k3jax.ops.moe.grouped_situ_glu`) share it.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import situ_glu as situ_glu_kernels
from pallas_kernels.situ_glu.kernels import bounded_silu, softcap as bounded_identity


def situ(a: jax.Array, beta1: Optional[float] = 4.0) -> jax.Array:
  """SiTU(a) = β1·tanh(a/β1)·sigmoid(a) (β1 None: silu(a)), computed in fp32; returns fp32 with
  a's shape."""
  return bounded_silu(a.astype(jnp.float32), beta1)[0]


def softcap(b: jax.Array, beta2: Optional[float] = 25.0) -> jax.Array:
  """softcap(b) = β2·tanh(b/β2) (β2 None: b), computed in fp32; returns fp32 with b's shape."""
  return bounded_identity(b.astype(jnp.float32), beta2)


def situ_glu(gate: jax.Array, up: jax.Array, beta1: Optional[float] = 4.0,
             beta2: Optional[float] = 25.0) -> jax.Array:
  """The SiTU-GLU hidden activation h = SiTU(gate) ⊙ softcap(up) (SwiGLU's silu(gate) ⊙ up when
  both bounds are None).

  Args:
    gate: [..., m] pre-activation W_gate x, any float dtype.
    up: [..., m] pre-activation W_up x, same shape as gate, any float dtype.
    beta1: SiTU bound (> 0), a Python number (not differentiated), or None with beta2 None.
    beta2: softcap bound (> 0), a Python number (not differentiated), or None with beta1 None.
  Returns:
    h [..., m] in the promoted dtype of (gate, up); the math runs in fp32, forward and backward.
    The backward keeps only gate and up, in their own dtypes, and recomputes the rest
    (`_situ_glu_bwd`).
  """
  if gate.shape != up.shape:
    raise ValueError(f"situ_glu: gate shape {gate.shape} and up shape {up.shape} must be equal")
  for name, x in (("gate", gate), ("up", up)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"situ_glu: {name} must have a floating dtype, got {x.dtype}")
  situ_glu_kernels.check_bounds("situ_glu", beta1, beta2)
  as_float = lambda beta: None if beta is None else float(beta)  # noqa: E731
  return _situ_glu(gate, up, as_float(beta1), as_float(beta2))


# Autodiff of the fp32 expression saves seven fp32 [..., m] intermediates (tanh, sigmoid and
# products) for the backward, whatever the input dtype; in the routed experts they were among the
# largest buffers at a training step's memory peak. The custom VJP saves only (gate, up) as given
# (bf16 inputs: no fp32 residual; fp32 inputs, as grouped_situ_glu's ragged_dot outputs: two
# instead of seven) and recomputes the cheap elementwise math in the backward, where it fuses with
# the multiply by dh.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _situ_glu(gate: jax.Array, up: jax.Array, beta1: Optional[float],
              beta2: Optional[float]) -> jax.Array:
  out_dtype = jnp.result_type(gate.dtype, up.dtype)
  return situ_glu_kernels.situ_glu_value(gate.astype(jnp.float32), up.astype(jnp.float32), beta1,
                                         beta2).astype(out_dtype)


def _situ_glu_fwd(gate, up, beta1, beta2):
  return _situ_glu(gate, up, beta1, beta2), (gate, up)


def _situ_glu_bwd(beta1, beta2, residuals, dh):
  """dgate = dh·sc(b)·SiTU'(a), dup = dh·SiTU(a)·sc'(b) in fp32 (`situ_glu_kernels.situ_glu_grads`,
  the same math as the Pallas backward kernel's), cast to gate's and up's dtypes."""
  # The barrier keeps XLA from merging this recomputation with the forward's own tanh and sigmoid
  # (common-subexpression elimination): merged, the forward wrote its fp32 intermediates out for
  # the backward (small.gin on the GPU: 12.2 GiB of them a step, the routed experts' in a transposed
  # layout; the step's peak memory fell by 10.4 GiB without them, RESULTS.md run 16).
  gate, up = jax.lax.optimization_barrier(residuals)
  dgate, dup = situ_glu_kernels.situ_glu_grads(gate.astype(jnp.float32), up.astype(jnp.float32),
                                               dh.astype(jnp.float32), beta1, beta2)
  return dgate.astype(gate.dtype), dup.astype(up.dtype)


_situ_glu.defvjp(_situ_glu_fwd, _situ_glu_bwd)
