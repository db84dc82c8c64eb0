"""SiTU-GLU on a grouped matmul's [M, 2f] output, forward and backward, as Pallas kernels (Triton).

h = SiTU(a) · softcap(b) with [a | b] = gate_up (the routed experts' one grouped matmul against
[W_gate | W_up]); SiTU(a) = β1·tanh(a/β1)·σ(a), softcap(b) = β2·tanh(b/β2). The math runs in fp32,
as `k3jax.ops.moe.situ_glu`'s (which documents it); the backward recomputes it from gate_up, so
the forward keeps nothing else.

Why kernels and not XLA's fusions: tokamax's weight-gradient kernel for the experts' output
projection reads h transposed ([f, M]). XLA's layout assignment carried that transpose up
through the elementwise SiTU-GLU, forward and backward, so that both ran in a transposed layout
and transposed back for the other kernels (about 15 ms of small.gin's step on an H200). A kernel's
operands and results have fixed row-major layouts: the activation then reads and writes each array
once, and XLA transposes only the finished h. One H200 (RESULTS.md run 17): small.gin's step
163.6 -> 152.8 ms, medium.gin's 498.5 -> 456.0 ms. The tiles matter: 64 x 256 with 4 warps took
4.5x as long as the default 64 x 128 with 8 warps at small.gin's shape.

`num_rows`: the rows at and past it give h = 0 and d gate_up = 0 whatever gate_up holds there
(selects, so NaN or Inf there stays out). The routed experts pass Σ group_sizes: tokamax's
grouped matmul leaves the rows past the groups unwritten, and the select it would otherwise need
is a pass over [M, 2f] of its own (3.6 ms of medium.gin's step, RESULTS.md run 24 (e)); here it
costs a compare per element of a kernel that reads and writes those bytes anyway.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two, kernel_entry_point, result_like


@dataclasses.dataclass(frozen=True)
class SituGluConfig:
  """Tile sizes (powers of two; block_f is capped at the largest power of two dividing f) and
  the Triton launch (num_warps, num_stages); the interpreter (CPU tests) ignores the launch."""
  block_m: int = 64
  block_f: int = 128
  launch: tuple = (8, 1)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_m", "block_f")


def bounded_silu(a: jax.Array, beta1: float | None) -> tuple[jax.Array, jax.Array]:
  """(SiTU(a), tanh(a/β1)) in fp32 for fp32 a: SiTU(a) = β1·tanh(a/β1)·σ(a). β1 = None: the
  unbounded limit silu(a) = a·σ(a) (SwiGLU's gate), returned with None for the tanh."""
  if beta1 is None:
    return a * jax.nn.sigmoid(a), None
  tanh_a = jnp.tanh(a / beta1)
  return beta1 * tanh_a * jax.nn.sigmoid(a), tanh_a


def softcap(b: jax.Array, beta2: float | None) -> jax.Array:
  """β2·tanh(b/β2) in fp32 for fp32 b; β2 = None: b itself (SwiGLU's linear branch)."""
  return b if beta2 is None else beta2 * jnp.tanh(b / beta2)


def situ_glu_value(a: jax.Array, b: jax.Array, beta1: float | None, beta2: float | None
                   ) -> jax.Array:
  """h = SiTU(a)·softcap(b), fp32 and elementwise; with β1 = β2 = None it is SwiGLU's
  silu(a)·b, the limit of SiTU-GLU as both bounds grow."""
  return bounded_silu(a, beta1)[0] * softcap(b, beta2)


def situ_glu_grads(a: jax.Array, b: jax.Array, dh: jax.Array, beta1: float | None,
                   beta2: float | None):
  """(dgate, dup) of h = SiTU(a)·softcap(b) for the cotangent dh, all fp32 and elementwise:
  dgate = dh·sc(b)·SiTU'(a), dup = dh·SiTU(a)·sc'(b), with SiTU'(a) = (1 − tanh²(a/β1))·σ(a) +
  β1·tanh(a/β1)·σ(a)·(1 − σ(a)) and sc'(b) = 1 − tanh²(b/β2); a None bound takes the unbounded
  limit (tanh(a/β1)·β1 → a, sc'(b) → 1), which is SwiGLU's gradient. The backward kernel's math,
  and `k3jax.ops.moe.situ_glu`'s backward (XLA) too. Both tend to 0 where tanh or σ saturate."""
  sig_a = jax.nn.sigmoid(a)     # Triton lowers it as 1 / (1 + exp(-a))
  situ_a, tanh_a = bounded_silu(a, beta1)
  slope = 1.0 if tanh_a is None else 1.0 - tanh_a * tanh_a
  dsitu_da = slope * sig_a + situ_a * (1.0 - sig_a)
  if beta2 is None:
    return dh * b * dsitu_da, dh * situ_a
  tanh_b = jnp.tanh(b / beta2)
  return dh * (beta2 * tanh_b) * dsitu_da, dh * situ_a * (1.0 - tanh_b * tanh_b)


def check_bounds(fn: str, beta1, beta2) -> None:
  """Both bounds positive numbers (SiTU-GLU) or both None (SwiGLU); else ValueError."""
  if beta1 is None and beta2 is None:
    return
  if beta1 is None or beta2 is None or beta1 <= 0 or beta2 <= 0:
    raise ValueError(f"{fn}: beta1={beta1} and beta2={beta2} must both be > 0 (SiTU-GLU) or both "
                     f"None (SwiGLU)")


def _rows_kept(num_rows_ref, block_m: int) -> jax.Array:
  """[bm, 1] bool: this row tile's rows that lie before num_rows_ref[0]."""
  rows = pl.program_id(0) * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  return rows < num_rows_ref[0]


def _fwd_kernel(num_rows_ref, gu_ref, h_ref, *, beta1: float | None, beta2: float | None):
  """num_rows_ref [1] int32; gu_ref [bm, 2, bf] (gate, up); h_ref [bm, bf]."""
  a = gu_ref[:, 0, :].astype(jnp.float32)
  b = gu_ref[:, 1, :].astype(jnp.float32)
  h = situ_glu_value(a, b, beta1, beta2)
  h = jnp.where(_rows_kept(num_rows_ref, h.shape[0]), h, 0.0)
  h_ref[...] = h.astype(h_ref.dtype)


def _bwd_kernel(num_rows_ref, gu_ref, dh_ref, dgu_ref, *, beta1: float | None,
                beta2: float | None):
  """num_rows_ref [1] int32; gu_ref [bm, 2, bf]; dh_ref [bm, bf]; dgu_ref [bm, 2, bf]
  (dgate, dup)."""
  a = gu_ref[:, 0, :].astype(jnp.float32)
  b = gu_ref[:, 1, :].astype(jnp.float32)
  dgate, dup = situ_glu_grads(a, b, dh_ref[...].astype(jnp.float32), beta1, beta2)
  keep = _rows_kept(num_rows_ref, a.shape[0])
  dgu_ref[:, 0, :] = jnp.where(keep, dgate, 0.0).astype(dgu_ref.dtype)
  dgu_ref[:, 1, :] = jnp.where(keep, dup, 0.0).astype(dgu_ref.dtype)


def _tiles(m: int, f: int, config: SituGluConfig) -> tuple[int, int, int]:
  """(block_m, block_f, M padded to whole row tiles)."""
  bf = min(config.block_f, f & -f)   # f & -f: the largest power of two dividing f
  bm = min(config.block_m, pl.next_power_of_2(m))
  return bm, bf, pl.cdiv(m, bm) * bm


def _launch(config: SituGluConfig) -> dict:
  if config.interpret:
    return dict(interpret=True)
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=config.launch[0],
                                                       num_stages=config.launch[1]))


def _split(gate_up: jax.Array, mp: int) -> jax.Array:
  """[M, 2f] -> [Mp, 2, f] (a free reshape when M = Mp; zero rows appended otherwise)."""
  m, two_f = gate_up.shape
  if mp != m:
    gate_up = jnp.pad(gate_up, ((0, mp - m), (0, 0)))
  return gate_up.reshape(mp, 2, two_f // 2)


_ONE = pl.BlockSpec((1,), lambda i, j: (0,))


@kernel_entry_point("beta1", "beta2", "out_dtype", "config")
def situ_glu_fwd_kernel(gate_up: jax.Array, num_rows: jax.Array, beta1, beta2,
                        out_dtype, config: SituGluConfig) -> jax.Array:
  """h [M, f] in out_dtype from gate_up [M, 2f] (gate columns first); num_rows [1] int32: rows
  from it on give zeros."""
  m, two_f = gate_up.shape
  f = two_f // 2
  bm, bf, mp = _tiles(m, f, config)
  h = pl.pallas_call(
      functools.partial(_fwd_kernel, beta1=beta1, beta2=beta2),
      grid=(mp // bm, f // bf),
      in_specs=[_ONE, pl.BlockSpec((bm, 2, bf), lambda i, j: (i, 0, j))],
      out_specs=pl.BlockSpec((bm, bf), lambda i, j: (i, j)),
      out_shape=result_like(gate_up, (mp, f), out_dtype),
      name="situ_glu_fwd",
      **_launch(config),
  )(num_rows, _split(gate_up, mp))
  return h[:m]


@kernel_entry_point("beta1", "beta2", "config")
def situ_glu_bwd_kernel(gate_up: jax.Array, num_rows: jax.Array, dh: jax.Array, beta1: float,
                        beta2: float, config: SituGluConfig) -> jax.Array:
  """d gate_up [M, 2f] in gate_up.dtype from gate_up [M, 2f] and dh [M, f]; num_rows [1] int32:
  rows from it on give zeros."""
  m, two_f = gate_up.shape
  f = two_f // 2
  bm, bf, mp = _tiles(m, f, config)
  if mp != m:
    dh = jnp.pad(dh, ((0, mp - m), (0, 0)))
  dgu = pl.pallas_call(
      functools.partial(_bwd_kernel, beta1=beta1, beta2=beta2),
      grid=(mp // bm, f // bf),
      in_specs=[_ONE, pl.BlockSpec((bm, 2, bf), lambda i, j: (i, 0, j)),
                pl.BlockSpec((bm, bf), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((bm, 2, bf), lambda i, j: (i, 0, j)),
      out_shape=result_like(gate_up, (mp, 2, f), gate_up.dtype),
      name="situ_glu_bwd",
      **_launch(config),
  )(num_rows, _split(gate_up, mp), dh)
  return dgu.reshape(mp, two_f)[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _situ_glu_fused(gate_up, num_rows, beta1, beta2, out_dtype, config):
  return situ_glu_fwd_kernel(gate_up, num_rows, beta1, beta2, out_dtype, config)


def _situ_glu_fused_fwd(gate_up, num_rows, beta1, beta2, out_dtype, config):
  return (situ_glu_fwd_kernel(gate_up, num_rows, beta1, beta2, out_dtype, config),
          (gate_up, num_rows))


def _situ_glu_fused_bwd(beta1, beta2, out_dtype, config, residuals, dh):
  del out_dtype
  gate_up, num_rows = residuals
  return situ_glu_bwd_kernel(gate_up, num_rows, dh, beta1, beta2, config), None


_situ_glu_fused.defvjp(_situ_glu_fused_fwd, _situ_glu_fused_bwd)


def situ_glu_fused(gate_up: jax.Array, beta1: float | None, beta2: float | None, out_dtype=None,
                   config: SituGluConfig = SituGluConfig(),
                   num_rows: jax.Array | int | None = None) -> jax.Array:
  """SiTU-GLU of gate_up [M, 2f] (gate columns, then up columns; any float dtype) -> h [M, f] in
  out_dtype (default gate_up's), differentiable (the backward is the second kernel; the
  gradient comes back in gate_up's dtype). beta1, beta2 > 0: the SiTU and softcap bounds; both
  None: SwiGLU (silu(gate)·up).
  num_rows: an int or int scalar array (traced is fine); rows r >= num_rows give h[r] = 0 and a
  zero gradient, whatever gate_up[r] holds (NaN included). None: every row is computed."""
  if gate_up.ndim != 2 or gate_up.shape[1] % 2:
    raise ValueError(f"situ_glu_fused: gate_up must be [M, 2f], got shape {gate_up.shape}")
  if not jnp.issubdtype(gate_up.dtype, jnp.floating):
    raise ValueError(f"situ_glu_fused: gate_up must have a floating dtype, got {gate_up.dtype}")
  check_bounds("situ_glu_fused", beta1, beta2)
  out_dtype = jnp.dtype(gate_up.dtype if out_dtype is None else out_dtype)
  if num_rows is None:
    num_rows = gate_up.shape[0]
  num_rows = jnp.asarray(num_rows)
  if num_rows.shape != () or not jnp.issubdtype(num_rows.dtype, jnp.integer):
    raise ValueError(f"situ_glu_fused: num_rows must be an int scalar, got {num_rows.dtype}"
                     f"{list(num_rows.shape)}")
  as_float = lambda beta: None if beta is None else float(beta)  # noqa: E731
  return _situ_glu_fused(gate_up, num_rows.astype(jnp.int32).reshape(1), as_float(beta1),
                         as_float(beta2), out_dtype, config)
