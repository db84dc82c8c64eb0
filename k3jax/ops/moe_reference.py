"""The routed experts as a dense computation: the reference the grouped-matmul path is tested
against (`tests/ops/test_moe.py`) and checked against on the GPU's kernels
(`experiments/benchmarks/moe_rows_check.py`). Every expert runs on every token; nothing is sorted,
gathered or grouped, so it shares no code with `k3jax.ops.moe.routed_experts`."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def dense_routed_experts(z: jax.Array, expert_idx: jax.Array, expert_weight: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array, valid: jax.Array,
                         beta1: Optional[float] = 4.0, beta2: Optional[float] = 25.0
                         ) -> jax.Array:
  """y[n] = Σ_j expert_weight[n, j] · E_{expert_idx[n, j]}(z[n]) for valid tokens, 0 elsewhere,
  with E_e(z) = W_out[e] (SiTU(z W_gate[e]) ⊙ softcap(z W_up[e])), or with beta1 = beta2 = None
  SwiGLU's W_out[e] (silu(z W_gate[e]) ⊙ z W_up[e]).

  z [N, ℓ]; expert_idx [N, k] int; expert_weight [N, k]; w_gate, w_up [E, ℓ, m]; w_out [E, m, ℓ];
  valid [N] bool. Computed in the inputs' promoted dtype at HIGHEST matmul precision (fp32
  inputs: fp32); returns [N, ℓ]. Memory: [E, N, m] and [N, E, ℓ] intermediates (test sizes).
  """
  hi = jax.lax.Precision.HIGHEST
  gate = jnp.einsum("nl,elm->enm", z, w_gate, precision=hi)
  up = jnp.einsum("nl,elm->enm", z, w_up, precision=hi)
  if beta1 is None and beta2 is None:
    h = jax.nn.silu(gate) * up
  else:
    h = beta1 * jnp.tanh(gate / beta1) * jax.nn.sigmoid(gate) * beta2 * jnp.tanh(up / beta2)
  out = jnp.einsum("enm,eml->nel", h, w_out, precision=hi)                # [N, E, ℓ]
  picked = jnp.take_along_axis(out, expert_idx[:, :, None], axis=1)      # [N, k, ℓ]
  y = jnp.einsum("nkl,nk->nl", picked, expert_weight, precision=hi)
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))
