"""Routed-expert compute on one device: dispatch by expert, grouped SiTU-GLU, combine.

This module also holds the SiTU-GLU activation math (`situ`, `softcap`, `situ_glu`), because ops may
not import layers; `k3jax.layers.ffn` re-exports and documents it.

Every token i has k assignments (expert_idx[i, j], expert_weight[i, j]). Assignment a = i·k + j is
the row of the flattened [N·k] arrays. The routed output is

    y_i = Σ_j expert_weight[i, j] · E_{expert_idx[i, j]}(z_i),
    E_e(z) = W_out[e] · SiTU-GLU(z W_gate[e], z W_up[e])

Two ways to compute it, both pure and with static shapes:

* dropless (capacity_factor == 0): stable-sort the assignments by expert, gather their rows of z and
  run three grouped matmuls with the per-expert group sizes (`default_ragged_dot`: tokamax's Mosaic
  GPU kernels on the GPU, with the weight gradient from k3jax's Pallas kernel; `tiled_ragged_dot`
  on CPU, `jax.lax.ragged_dot` on TPU). Nothing is dropped.
* capacity (capacity_factor > 0): each expert gets a fixed buffer of C = ceil(capacity_factor·N·k/E)
  rows ([E, C, ℓ], batched einsum). The sort is stable, so within an expert the assignments are
  ordered by token index (then by slot j) and the first C are kept: the *latest* tokens of the batch
  overflow. Dropped assignments contribute zero; the other assignments keep their weights (no
  renormalisation), as in GShard/Switch.

Assignments of invalid tokens (`valid` False, e.g. padding) are never computed and never counted:
they sort after every expert's group, their output rows are zero, and they take no capacity.

Gradients flow to z, the expert weights and expert_weight (the router); the integer routing is
non-differentiable by construction. Every row movement (dispatch, capacity buffers) is a
`gather_rows` and the unsort with the weighted sum one `weighted_combine`; their VJPs are gathers
with the inverse index map, and the group sizes and inverse permutation come from comparisons and
a second sort: neither pass has a scatter. (Those row movements live in `k3jax.ops.moe_rows`.)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from k3jax.ops.moe_rows import (_common_varying, gather_rows, permute_rows,  # noqa: F401
                                sort_with_inverse, sorted_group_sizes, weighted_combine,
                                zero_rows)
from pallas_kernels import situ_glu as situ_glu_kernels
from pallas_kernels.grouped_matmul import grouped_weight_grad

# A grouped matmul with `jax.lax.ragged_dot`'s signature. One that also takes a keyword
# `zero_outside` (False: the rows past Σ group_sizes of its output and of its lhs gradient may be
# left unwritten) says so with an attribute `takes_zero_outside = True` (`takes_zero_outside`).
RaggedDotFn = Callable[..., jax.Array]


def tiled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                     preferred_element_type=None, *, tile: int = 128,
                     tiles_per_step: int = 64) -> jax.Array:
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` as dense matmuls over row tiles.

  lhs [M, ℓ]: rows contiguous by group (group e owns the next group_sizes[e] rows; rows past
  Σ group_sizes give zeros); rhs [E, ℓ, f]; group_sizes [E] int. Returns [M, f] in
  preferred_element_type (default lhs.dtype).

  Why: XLA:GPU (jax 0.11) lowers ragged_dot densely, every row against every group, which for a
  MoE layer costs E× the FLOPs and memory (small.gin at 64K tokens/step asked one H200 for
  ~190 GiB). Here each group is padded to a multiple of `tile` rows, so every tile of the padded
  buffer belongs to one group; a `lax.scan` over steps of `tiles_per_step` tiles gathers those
  tiles' weights and runs one batched matmul ('tml,tlf->tmf'). The step is rematerialised, so
  neither pass keeps gathered weights beyond one step ([tiles_per_step, ℓ, f]); the weight
  gradient accumulates in the scan carry. FLOPs: the real rows plus at most E·tile padding rows
  and the unused tiles of the last used step; steps past the used tiles are skipped. Static
  shapes: tiles = ceil(M/tile) + E, rounded up to a multiple of tiles_per_step.
  """
  M, L = lhs.shape
  E, L2, F = rhs.shape
  if L2 != L or group_sizes.shape != (E,):
    raise ValueError(f"tiled_ragged_dot: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} do not fit ([M, l], [E, l, f], [E])")
  out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type
  num_tiles = -(-M // tile) + E
  per_step = max(1, min(tiles_per_step, num_tiles))
  steps = -(-num_tiles // per_step)
  num_tiles = steps * per_step
  sizes = group_sizes.astype(jnp.int32)
  padded = (sizes + tile - 1) // tile * tile
  ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
  starts, padded_starts = ends - sizes, padded_ends - padded
  row = jnp.arange(M, dtype=jnp.int32)
  group = jnp.searchsorted(ends, row, side="right")                    # E for rows past the groups
  real = group < E
  g = jnp.minimum(group, E - 1)
  dest = jnp.where(real, padded_starts[g] + row - starts[g], num_tiles * tile)  # out of range: drop
  buf = jnp.zeros((num_tiles * tile, L), lhs.dtype).at[dest].set(lhs, mode="drop")
  tile_group = jnp.searchsorted(padded_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile,
                                side="right")
  tile_group = jnp.minimum(tile_group, E - 1).reshape(steps, per_step)  # unused tiles: zero rows
  used_rows = padded_ends[-1]

  @jax.checkpoint
  def step(carry, xs):
    x, tg, first_row = xs                                              # [per_step, tile, ℓ]
    # Steps wholly past the used tiles (e.g. the empty half of a dropless expert-parallel receive
    # buffer) skip the matmul.
    y = jax.lax.cond(
        first_row < used_rows,
        lambda: jnp.einsum("tml,tlf->tmf", x, rhs[tg], preferred_element_type=out_dtype),
        # (zeros shaped from x, so that inside shard_map they carry x's varying mesh axes)
        lambda: jnp.broadcast_to(jnp.zeros_like(x[..., :1], out_dtype), (per_step, tile, F)))
    return carry, y

  first_rows = jnp.arange(steps, dtype=jnp.int32) * (per_step * tile)
  _, out = jax.lax.scan(step, None,
                        (buf.reshape(steps, per_step, tile, L), tile_group, first_rows))
  y = out.reshape(num_tiles * tile, F).at[dest].get(mode="fill", fill_value=0)
  return zero_rows(y, real).astype(out_dtype)


# The backward of a grouped matmul out = lhs @ rhs[group]: dlhs = dout @ rhs[group]^T (rhs's last
# dimension contracted) and drhs[g] = lhs[rows of g]^T @ dout[rows of g] (the ragged dimension
# contracted). These are the dimension numbers tokamax's own VJP uses (ragged_dot/base.py); its
# Mosaic GPU op runs the first as its sm90 `ragged_dot_kernel` (after transposing rhs) and the
# second as `ragged_contracting_dim_dot_kernel`, which k3jax does not use on the GPU (wrong sums
# on an H200; `pallas_kernels.grouped_matmul.grouped_weight_grad` instead).
_DLHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_DRHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])

GROUPED_MATMULS = ("auto", "tokamax", "ragged_dot", "tiled")
TOKAMAX_IMPLEMENTATIONS = ("mosaic", "xla")
# Input dtypes of tokamax's Mosaic GPU kernel (pallas_mosaic_gpu_common.check_bf16xbf16_or_f16xf16).
_MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)


def _tokamax():
  """The tokamax module, imported on first use: importing it takes ~1.6 s, and a launch whose
  programs come from the lowered cache never traces a grouped matmul."""
  import tokamax  # pylint: disable=import-outside-toplevel
  return tokamax


# Tiles (block_m, block_n, block_k, pipeline stages) of tokamax's sm90 grouped-matmul kernels, for
# the forward and dlhs; None keeps tokamax's choice. Without an autotuning-cache entry tokamax
# 0.0.17 picks 64 x 64 x 128 with two stages on sm90; 128 x 128 x 64 with three stages ran 1.15-2.0x
# faster at small.gin's and medium.gin's shapes on an H200, with the same results
# (experiments/benchmarks/ragged_dot_tiles.py; RESULTS.md run 18).
SM90_TILES = {"fwd": (128, 128, 64, 3), "dlhs": (128, 128, 64, 3)}


def _mosaic_implementation(kernel: str):
  """tokamax's `implementation` argument for one of the grouped matmul's kernels ('fwd', 'dlhs')
  on the Mosaic GPU path: the op with SM90_TILES[kernel] on compute capability 9.x,
  'mosaic' (tokamax's own choice of tiles) elsewhere or where SM90_TILES has None."""
  tiles = SM90_TILES.get(kernel)
  if tiles is None or not 9.0 <= _gpu_compute_capability() < 10.0:
    return "mosaic"
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu  # pylint: disable=import-outside-toplevel
  return (pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=sm90_config(*tiles)),)


def sm90_config(block_m: int, block_n: int, block_k: int, stages: int, persistent: bool = False):
  """tokamax's sm90 ragged-dot Config with these tiles (one k-split, M-major grid order)."""
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common  # pylint: disable=import-outside-toplevel
  return common.Config(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=stages,
                       split_k=1, persistent=persistent, grid_minor_dim=common.MatmulDimension.M,
                       grid_tile_width=1)


def _call_tokamax(fn, *args, implementation: str, kernel: str, **kwargs) -> jax.Array:
  """`fn(*args, implementation=..., **kwargs)` for one of the grouped matmul's kernels ('fwd',
  'dlhs', 'drhs'; 'mosaic' takes `_mosaic_implementation`'s tiles), its NotImplementedError
  (tokamax's way of saying that its kernel lacks a dtype or shape) turned into an error naming
  the config field."""
  impl = _mosaic_implementation(kernel) if implementation == "mosaic" else implementation
  try:
    return fn(*args, implementation=impl, **kwargs)
  except NotImplementedError as e:
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in args if hasattr(a, "shape"))
    raise ValueError(
        f"ModelConfig.moe_grouped_matmul = 'tokamax': tokamax's {implementation!r} ragged_dot "
        f"cannot run on {shapes} ({e}); choose 'tiled' or 'ragged_dot' for this model") from e


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tokamax_grouped(lhs, rhs, group_sizes, out_dtype, implementation, zero_outside):
  """tokamax.ragged_dot with rows past Σ group_sizes zeroed in the output and in dlhs where
  zero_outside (else left as the kernels leave them)."""
  out = _call_tokamax(_tokamax().ragged_dot, lhs, rhs, group_sizes, preferred_element_type=out_dtype,
                      implementation=implementation, kernel="fwd")
  if not zero_outside:
    return out
  return zero_rows(out, _rows_in_groups(lhs.shape[0], group_sizes))


def _tokamax_grouped_fwd(lhs, rhs, group_sizes, out_dtype, implementation, zero_outside):
  out = _tokamax_grouped(lhs, rhs, group_sizes, out_dtype, implementation, zero_outside)
  return out, (lhs, rhs, group_sizes)


def _tokamax_grouped_bwd(out_dtype, implementation, zero_outside, residuals, dout):
  lhs, rhs, group_sizes = residuals
  # Mosaic multiplies bf16 by bf16 (or f16 by f16) only: the fp32 cotangent of an fp32-accumulated
  # output is rounded to the input dtype, as a bf16 matmul's backward would read it anyway.
  dout = dout.astype(lhs.dtype)
  dlhs = _call_tokamax(_tokamax().ragged_dot_general, dout, rhs, group_sizes, _DLHS_DIMS,
                       preferred_element_type=lhs.dtype, implementation=implementation,
                       kernel="dlhs")
  if implementation == "mosaic":
    # Not tokamax's sm90 ragged-contracting kernel: it returned wrong, run-to-run different weight
    # gradients on an H200 (pallas_kernels/grouped_matmul says more).
    drhs = grouped_weight_grad(lhs, dout, group_sizes, rhs.dtype)
  else:
    drhs = _call_tokamax(_tokamax().ragged_dot_general, lhs, dout, group_sizes, _DRHS_DIMS,
                         preferred_element_type=rhs.dtype, implementation=implementation,
                         kernel="drhs")
  # The kernels never write the rows past the groups (uninitialised memory on the GPU).
  if zero_outside:
    dlhs = zero_rows(dlhs, _rows_in_groups(lhs.shape[0], group_sizes))
  return dlhs, drhs, None


_tokamax_grouped.defvjp(_tokamax_grouped_fwd, _tokamax_grouped_bwd)


def _rows_in_groups(num_rows: int, group_sizes: jax.Array) -> jax.Array:
  """[num_rows] bool: row r belongs to a group (r < Σ group_sizes)."""
  return jnp.arange(num_rows, dtype=jnp.int32) < jnp.sum(group_sizes)


def tokamax_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                       preferred_element_type=None, *, implementation: str,
                       zero_outside: bool = True) -> jax.Array:
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on tokamax's grouped matmul, forward and backward.

  lhs [M, ℓ] rows contiguous by group; rhs [E, ℓ, f] (cast to lhs.dtype: Mosaic multiplies equal
  dtypes; the cast's transpose returns the weight gradient in rhs's dtype); group_sizes [E] int.
  Returns [M, f] in preferred_element_type (default lhs.dtype), zero on rows past Σ group_sizes,
  and so is the gradient of lhs. With zero_outside=False those rows of both are left as the
  kernels leave them (uninitialised memory on the GPU), which saves a select over each: for
  callers whose consumers never read those rows, or only through selects (`grouped_situ_glu`
  with the Pallas SiTU-GLU given `num_rows`; `gather_rows`' backward).
  implementation: 'mosaic' (tokamax's Pallas Mosaic GPU kernels: bf16/f16 inputs, NVIDIA compute
  capability >= 9.0 for the dlhs and drhs kernels) or 'xla' (tokamax's reference, which is
  `jax.lax.ragged_dot_general`: any backend and dtype). dlhs runs on the same implementation (a
  grouped matmul against rhs transposed); drhs on tokamax's ragged-contracting op for 'xla' and on
  k3jax's Pallas kernel for 'mosaic' (`pallas_kernels.grouped_matmul`: tokamax 0.0.17's sm90
  kernel returned wrong sums, RESULTS.md run 18). The cotangent is rounded to lhs.dtype first.
  A kernel that cannot take these dtypes or shapes raises ValueError naming
  ModelConfig.moe_grouped_matmul.
  """
  if implementation not in TOKAMAX_IMPLEMENTATIONS:
    raise ValueError(f"tokamax_ragged_dot: implementation={implementation!r}: expected one of "
                     f"{TOKAMAX_IMPLEMENTATIONS}")
  M, L = lhs.shape
  E, L2, _ = rhs.shape
  if L2 != L or group_sizes.shape != (E,):
    raise ValueError(f"tokamax_ragged_dot: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} do not fit ([M, l], [E, l, f], [E])")
  out_dtype = jnp.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  lhs, rhs = _common_varying(lhs, rhs.astype(lhs.dtype))
  return _tokamax_grouped_shared(lhs, rhs, group_sizes.astype(jnp.int32), out_dtype,
                                 implementation, bool(zero_outside))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _tokamax_grouped_shared(lhs, rhs, group_sizes, out_dtype, implementation, zero_outside):
  """`_tokamax_grouped` as one jitted function: its call sites of equal shapes (the MoE layers of
  the scanned group and of the unrolled suffix) share one traced jaxpr, so JAX lowers each kernel
  (forward, dlhs, drhs) once per shape instead of once per layer. Lowering a Mosaic GPU kernel
  is Python work of about a second; XLA inlines the calls, the compiled step is the same."""
  return _tokamax_grouped(lhs, rhs, group_sizes, out_dtype, implementation, zero_outside)


def _gpu_compute_capability() -> float:
  """The default device's CUDA compute capability; 0 when it is not an NVIDIA GPU."""
  device = jax.devices()[0]
  if device.platform != "gpu" or "NVIDIA" not in device.device_kind:
    return 0.0
  return float(getattr(device, "compute_capability", 0.0))


def _mosaic_gpu_available() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability >= 9.0 ('tokamax' then
  runs tokamax's Mosaic GPU kernels)."""
  return _gpu_compute_capability() >= 9.0


def _auto_gpu_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                         preferred_element_type=None, *, zero_outside: bool = True) -> jax.Array:
  """'auto' on a GPU: tokamax's Mosaic kernels where all three run (bf16/f16 activations on
  compute capability 9.x: tokamax 0.0.17's sm100 path has no ragged-contracting kernel for the
  weight gradient), `tiled_ragged_dot` otherwise (fp32 activations; other GPUs, where XLA's dense
  ragged_dot lowering would cost E× the memory). zero_outside as in `tokamax_ragged_dot` (the
  tiled path's rows past the groups are zero either way)."""
  if jnp.dtype(lhs.dtype) in _MOSAIC_DTYPES and 9.0 <= _gpu_compute_capability() < 10.0:
    return tokamax_ragged_dot(lhs, rhs, group_sizes, preferred_element_type,
                              implementation="mosaic", zero_outside=zero_outside)
  return tiled_ragged_dot(lhs, rhs, group_sizes, preferred_element_type)


def takes_zero_outside(fn: RaggedDotFn) -> bool:
  """Whether the grouped matmul fn (a functools.partial of one included) declares that it takes
  `zero_outside` (`RaggedDotFn`): `tokamax_ragged_dot` and 'auto' on a GPU do; hooks with
  jax.lax.ragged_dot's signature alone do not."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "takes_zero_outside", False) is True


tokamax_ragged_dot.takes_zero_outside = True
_auto_gpu_ragged_dot.takes_zero_outside = True


def default_ragged_dot(kind: str = "auto") -> RaggedDotFn:
  """The grouped matmul for ModelConfig.moe_grouped_matmul.

  * 'tokamax': `tokamax_ragged_dot`, its Mosaic GPU kernels on an NVIDIA GPU of compute
    capability >= 9.0, its 'xla' implementation elsewhere (CPU: the same call sites as on the GPU).
  * 'ragged_dot': `jax.lax.ragged_dot`.
  * 'tiled': `tiled_ragged_dot`.
  * 'auto': 'ragged_dot' on TPU (a grouped-matmul lowering of its own, not measured here); on a
    GPU, tokamax ('mosaic') for bf16/f16 activations on compute capability 9.x and 'tiled'
    otherwise (`_auto_gpu_ragged_dot`); 'tiled' on CPU. tokamax's 'xla' implementation is
    `jax.lax.ragged_dot`, which XLA:CPU computes densely: at tiny.gin's MoE shapes (4096 tokens,
    top-2 of 8 experts, 32 -> 64 -> 32, fp32) routed_experts' forward+backward takes 125 ms and
    88 MB of temporaries with it against 55 ms and 44 MB tiled (2-core CPU), about +30 % on the
    main job's step (three MoE layers). The tokamax call sites run on CPU in the tests, with
    'tokamax' chosen explicitly.

  XLA:GPU and XLA:CPU lower `jax.lax.ragged_dot` with memory for every row against every expert:
  the compiled training step of a 4-layer small.gin at 16K tokens asks XLA:CPU for 55.6 GiB of
  temporaries with ragged_dot and 22.5 GiB tiled. On one H200 tokamax's Mosaic kernel takes
  1.07 ms forward+backward at 131072 rows × 384 → 32 experts × 1024 where 'tiled' takes 11.7 ms
  (spec/PERFORMANCE.md; experiments/benchmarks/moe_bench.py measures both).
  """
  if kind not in GROUPED_MATMULS:
    raise ValueError(f"ModelConfig.moe_grouped_matmul = {kind!r}: expected one of "
                     f"{GROUPED_MATMULS}")
  platform = jax.default_backend()
  if kind == "auto":
    if platform == "tpu":
      return jax.lax.ragged_dot
    if platform == "gpu":
      return _auto_gpu_ragged_dot
    kind = "tiled"
  if kind == "tokamax":
    implementation = "mosaic" if _mosaic_gpu_available() else "xla"
    return functools.partial(tokamax_ragged_dot, implementation=implementation)
  if kind == "tiled":
    return tiled_ragged_dot
  return jax.lax.ragged_dot


# SiTU-GLU math (re-exported by k3jax.layers.ffn, which documents it).

def situ(a: jax.Array, beta1: float = 4.0) -> jax.Array:
  """SiTU(a) = β1·tanh(a/β1)·sigmoid(a), computed in fp32; returns fp32 with a's shape."""
  a32 = a.astype(jnp.float32)
  return beta1 * jnp.tanh(a32 / beta1) * jax.nn.sigmoid(a32)


def softcap(b: jax.Array, beta2: float = 25.0) -> jax.Array:
  """softcap(b) = β2·tanh(b/β2), computed in fp32; returns fp32 with b's shape."""
  b32 = b.astype(jnp.float32)
  return beta2 * jnp.tanh(b32 / beta2)


def situ_glu(gate: jax.Array, up: jax.Array, beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
  """The SiTU-GLU hidden activation h = SiTU(gate) ⊙ softcap(up).

  Args:
    gate: [..., m] pre-activation W_gate x, any float dtype.
    up: [..., m] pre-activation W_up x, same shape as gate, any float dtype.
    beta1: SiTU bound (> 0), a Python number (not differentiated).
    beta2: softcap bound (> 0), a Python number (not differentiated).
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
  if beta1 <= 0 or beta2 <= 0:
    raise ValueError(f"situ_glu: beta1={beta1} and beta2={beta2} must both be > 0")
  return _situ_glu(gate, up, float(beta1), float(beta2))


# Autodiff of the fp32 expression saves seven fp32 [..., m] intermediates (tanh, sigmoid and
# products) for the backward, whatever the input dtype; in the routed experts they were among the
# largest buffers at a training step's memory peak. The custom VJP saves only (gate, up) as given
# (bf16 inputs: no fp32 residual; fp32 inputs, as grouped_situ_glu's ragged_dot outputs: two
# instead of seven) and recomputes the cheap elementwise math in the backward, where it fuses with
# the multiply by dh.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _situ_glu(gate: jax.Array, up: jax.Array, beta1: float, beta2: float) -> jax.Array:
  out_dtype = jnp.result_type(gate.dtype, up.dtype)
  return (situ(gate, beta1) * softcap(up, beta2)).astype(out_dtype)


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


def _check_shapes(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid) -> None:
  if z.ndim != 2:
    raise ValueError(f"routed_experts: z must be [N, latent], got shape {z.shape}")
  n, latent = z.shape
  if expert_idx.ndim != 2 or expert_idx.shape[0] != n:
    raise ValueError(f"routed_experts: expert_idx must be [N={n}, k], got shape {expert_idx.shape}")
  if expert_weight.shape != expert_idx.shape:
    raise ValueError(f"routed_experts: expert_weight shape {expert_weight.shape} must equal "
                     f"expert_idx shape {expert_idx.shape}")
  if not jnp.issubdtype(expert_idx.dtype, jnp.integer):
    raise ValueError(f"routed_experts: expert_idx must be an integer array, got {expert_idx.dtype}")
  if w_gate.ndim != 3 or w_gate.shape[1] != latent:
    raise ValueError(f"routed_experts: w_gate must be [E, latent={latent}, m], got {w_gate.shape}")
  num_experts, _, hidden = w_gate.shape
  if w_up.shape != w_gate.shape:
    raise ValueError(f"routed_experts: w_up shape {w_up.shape} must equal w_gate shape "
                     f"{w_gate.shape}")
  if w_out.shape != (num_experts, hidden, latent):
    raise ValueError(f"routed_experts: w_out must be [E={num_experts}, m={hidden}, "
                     f"latent={latent}], got {w_out.shape}")
  if valid is not None and valid.shape != (n,):
    raise ValueError(f"routed_experts: valid must be [N={n}] bool, got shape {valid.shape}")


def grouped_situ_glu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array,
                     group_sizes: jax.Array, in_group: jax.Array, *, beta1: float, beta2: float,
                     ragged_dot_fn: RaggedDotFn, activation: str = "xla") -> jax.Array:
  """SiTU-GLU experts over rows sorted by expert: W_out[e]·SiTU-GLU(x W_gate[e], x W_up[e]).

  x [M, ℓ] (the matmuls run in x.dtype, accumulating in fp32; gate and up are rounded to x.dtype
  before the fp32 activation math, as in `situ_glu_ffn`); w_gate, w_up [E, ℓ, f];
  w_out [E, f, ℓ] (already in x.dtype); group_sizes [E]; in_group [M] bool, False for the rows
  past the last group. Returns [M, ℓ] in x.dtype (accumulated in fp32 inside the matmul), zero on
  rows outside the groups (which ragged_dot leaves undefined on some backends). The gradient of x
  on those rows is zero too, except with activation 'pallas' on a grouped matmul that takes
  `zero_outside` (tokamax's): then it is undefined, and the callers (`routed_experts`, the
  expert-parallel body) read it only through `gather_rows`' selects.
  activation: 'xla' (`situ_glu`, XLA's fusions) or 'pallas' (`pallas_kernels.situ_glu.
    situ_glu_fused`: one kernel forward and one backward; interpreted on CPU): the same math.
  """
  # gate and up leave the matmul in x.dtype (fp32 accumulation inside), as in the dense SiTU-GLU:
  # situ_glu's backward then keeps two bf16 [M, f] arrays, not fp32 ones. They are one grouped
  # matmul against [E, ℓ, 2f]: one kernel (and one backward pair) instead of two, twice as wide.
  f = w_gate.shape[-1]
  # The Pallas activation gives h = 0 and d gate_up = 0 on the rows past the groups whatever
  # gate_up and dh hold there, so the grouped matmuls that can leave those rows unwritten skip
  # their selects: over gate_up [M, 2f] (3.6 ms of medium.gin's step on an H200, RESULTS.md run
  # 24 (e)) and dh [M, f]. The other rows they leave: dx's, which the dispatch's backward reads
  # through selects only (`gather_rows`); y's, zeroed below.
  skip_zeroing = activation == "pallas" and takes_zero_outside(ragged_dot_fn)
  unzeroed = {"zero_outside": False} if skip_zeroing else {}
  gate_up = ragged_dot_fn(x, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes,
                          preferred_element_type=x.dtype, **unzeroed)
  if activation == "pallas":
    interpret = jax.default_backend() == "cpu"
    if interpret and jax.typeof(gate_up).manual_axis_type.varying:
      # JAX's Pallas interpreter slices with unvarying indices, which shard_map's varying-axes
      # check refuses; the compiled kernel (GPU) has no such slices.
      raise ValueError("ModelConfig.moe_situ_glu = 'pallas' on CPU runs the Pallas interpreter, "
                       "which cannot run inside the expert-parallel shard_map (a mesh with "
                       "'expert' > 1); use 'auto' or 'xla' on CPU")
    config = situ_glu_kernels.SituGluConfig(interpret=interpret)
    h = situ_glu_kernels.situ_glu_fused(gate_up, beta1, beta2, x.dtype, config,
                                        num_rows=jnp.sum(group_sizes))
  elif activation == "xla":
    h = situ_glu(gate_up[:, :f], gate_up[:, f:], beta1, beta2).astype(x.dtype)
  else:
    raise ValueError(f"grouped_situ_glu: activation={activation!r}: expected 'xla' or 'pallas'")
  # The expert outputs leave the matmul in x.dtype too: the combine sums them in fp32, but an fp32
  # [M, ℓ] output doubled the kernel's writes and what the backward keeps (the expert-parallel path
  # always sent them in x.dtype).
  y = ragged_dot_fn(h, w_out, group_sizes, preferred_element_type=x.dtype, **unzeroed)
  return zero_rows(y, in_group)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """Per-expert buffer rows C = ceil(capacity_factor · num_tokens · top_k / num_experts)."""
  if capacity_factor <= 0:
    raise ValueError(f"expert_capacity: capacity_factor={capacity_factor} must be > 0")
  return int(math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def routed_experts(
    z: jax.Array,
    expert_idx: jax.Array,
    expert_weight: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_out: jax.Array,
    *,
    beta1: float,
    beta2: float,
    capacity_factor: float = 0.0,
    valid: Optional[jax.Array] = None,
    ragged_dot_fn: RaggedDotFn = jax.lax.ragged_dot,
    activation: str = "xla",
) -> tuple[jax.Array, dict]:
  """Weighted sum of each token's k SiTU-GLU experts.

  Args:
    z: [N, ℓ] token activations (the matmul inputs run in z.dtype).
    expert_idx: [N, k] int, expert ids in [0, E).
    expert_weight: [N, k] float, combine weights (usually the renormalised router scores).
    w_gate: [E, ℓ, m] gate projections.
    w_up: [E, ℓ, m] up projections.
    w_out: [E, m, ℓ] output projections. Weights are cast to z.dtype.
    beta1, beta2: SiTU-GLU bounds.
    capacity_factor: 0 for dropless; > 0 for fixed per-expert buffers of
      ceil(capacity_factor·N·k/E) rows (N is the static row count, padding included).
    valid: optional [N] bool; False rows (padding) are not routed, not computed and not counted.
    ragged_dot_fn: grouped matmul with `jax.lax.ragged_dot`'s signature (a hook for a faster GPU
      kernel); used only in dropless mode.
    activation: the dropless experts' SiTU-GLU, 'xla' or 'pallas' (`grouped_situ_glu`).
  Returns:
    y: [N, ℓ] in z.dtype (combine done in fp32).
    stats: {'load': [E] fp32, assignments routed to each expert (valid tokens, before any drop);
            'dropped': int32 scalar, assignments of valid tokens dropped by capacity (0 if
            dropless)}.
  """
  _check_shapes(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid)
  if capacity_factor < 0:
    raise ValueError(f"routed_experts: capacity_factor={capacity_factor} must be >= 0 "
                     "(0 = dropless)")
  n, latent = z.shape
  k = expert_idx.shape[1]
  num_experts = w_gate.shape[0]
  num_assign = n * k
  dtype = z.dtype
  w_gate, w_up, w_out = (w.astype(dtype) for w in (w_gate, w_up, w_out))

  flat_expert = expert_idx.reshape(num_assign).astype(jnp.int32)
  token_of = jnp.arange(num_assign, dtype=jnp.int32) // k
  if valid is None:
    valid_assign = jnp.ones((num_assign,), bool)
  else:
    valid_assign = jnp.repeat(valid.astype(bool), k)
  # Invalid assignments get the sentinel expert id E, so they sort after every real group.
  sort_key = jnp.where(valid_assign, flat_expert, num_experts)
  order, inverse = sort_with_inverse(sort_key)
  sorted_expert = sort_key[order]
  routed = sorted_expert < num_experts
  group_sizes = sorted_group_sizes(sorted_expert, num_experts)
  # Every permutation below is a `gather_rows` whose backward is a gather (with the inverse map):
  # autodiff's transpose of a gather is a scatter-add, slow on the GPU.
  # Row a of the sorted assignments reads token token_of[order[a]]; token i's k rows are
  # inverse[i·k:(i+1)·k] (invalid assignments are zero rows that nothing reads back).
  token_rows = inverse.reshape(n, k)
  token_rows_ok = valid_assign.reshape(n, k)
  x_sorted = gather_rows(z, token_of[order], routed, token_rows, token_rows_ok)   # [N·k, ℓ]

  if capacity_factor == 0:
    y_sorted = grouped_situ_glu(x_sorted, w_gate, w_up, w_out, group_sizes, routed, beta1=beta1,
                                beta2=beta2, ragged_dot_fn=ragged_dot_fn, activation=activation)
    dropped = jnp.zeros((), jnp.int32)
  else:
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    starts = jnp.cumsum(group_sizes) - group_sizes                      # [E]
    starts_ext = jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])
    rank = jnp.arange(num_assign, dtype=jnp.int32) - starts_ext[sorted_expert]
    kept = routed & (rank < capacity)
    # Buffer row e·C + c holds sorted assignment starts[e] + c when that slot is filled; kept
    # assignment a sits in buffer row e_a·C + rank_a. Both directions are gathers.
    slot = jnp.arange(capacity, dtype=jnp.int32)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, num_assign - 1).reshape(-1)   # [E·C]
    filled = (slot[None, :] < jnp.minimum(group_sizes, capacity)[:, None]).reshape(-1)
    e_safe = jnp.minimum(sorted_expert, num_experts - 1)
    buf_row = (e_safe * capacity + jnp.clip(rank, 0, capacity - 1))[:, None]     # [N·k, 1]
    buf = gather_rows(x_sorted, src, filled, buf_row, kept[:, None])
    buf = buf.reshape(num_experts, capacity, latent)                    # [E, C, ℓ]
    gate = jnp.einsum("ecl,elm->ecm", buf, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("ecl,elm->ecm", buf, w_up, preferred_element_type=jnp.float32)
    h = situ_glu(gate, up, beta1, beta2).astype(dtype)
    y_buf = jnp.einsum("ecm,eml->ecl", h, w_out, preferred_element_type=jnp.float32)
    y_sorted = gather_rows(y_buf.reshape(num_experts * capacity, latent), buf_row[:, 0], kept,
                           src[:, None], filled[:, None])
    dropped = jnp.sum(routed & ~kept).astype(jnp.int32)

  # Token i's k outputs sit in rows inverse[i·k:(i+1)·k]; row r belongs to assignment order[r].
  y = weighted_combine(y_sorted, token_rows, token_rows_ok, expert_weight, order, routed, dtype)
  stats = {"load": group_sizes.astype(jnp.float32), "dropped": dropped}
  return y, stats


QB_CUTOFFS = ("per_expert", "token")


def qb_margins(biased: jax.Array, top_k: int, cutoff: str) -> jax.Array:
  """Quantile Balancing margins M_ij = (s_ij + b_j) − bar_ij for biased scores [tokens, experts].

  cutoff='token' (the spec's wording): bar_ij = the token's (k+1)-th largest biased score for every
  expert. cutoff='per_expert': that bar for the experts the token chose, and its k-th largest for
  the others, i.e. exactly the score each expert must beat to enter the token's top-k (an outsider
  must displace the weakest chosen expert). Returns fp32 [tokens, experts].
  """
  if cutoff not in QB_CUTOFFS:
    raise ValueError(f"cutoff={cutoff!r} must be one of {QB_CUTOFFS}")
  # Masked reductions instead of slicing columns k-1 and k: XLA:CPU turns a sliced top_k into a full
  # sort (20x slower).
  top = jax.lax.top_k(biased, top_k + 1)[0]                             # [tokens, k+1] descending
  bar = jnp.min(top, axis=-1, keepdims=True)                            # (k+1)-th largest
  if cutoff == "per_expert":
    kth = jnp.min(jnp.where(jnp.arange(top_k + 1) < top_k, top, jnp.inf), axis=-1, keepdims=True)
    bar = jnp.where(biased >= kth, bar, kth)
  return biased - bar
