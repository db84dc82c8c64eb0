"""Grouped matmuls for the routed experts: `jax.lax.ragged_dot`'s contract, several implementations.

out[rows of group g] = lhs[rows of g] @ rhs[g] for rows sorted by group, with `group_sizes` [G]
rows per group (rows past Σ group_sizes are outside every group). `default_ragged_dot(kind)` picks
one for ImplConfig.moe_grouped_matmul:

  'tokamax'     tokamax's grouped matmul: its Mosaic GPU kernels for bf16/f16 on compute
                capability 9.x (with the weight gradient from k3jax's Pallas kernel,
                `pallas_kernels.grouped_matmul.grouped_weight_grad`), its XLA implementation
                elsewhere;
  'tiled'       `tiled_ragged_dot`: dense per-tile matmuls (the CPU's, and a GPU's without
                Mosaic GPU);
  'ragged_dot'  `jax.lax.ragged_dot` (the TPU's);
  'auto'        'tokamax' with Mosaic GPU where it runs, 'tiled' elsewhere on GPU and CPU,
                'ragged_dot' on TPU.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from k3jax.config import GROUPED_MATMULS
from k3jax.ops.moe_rows import _common_varying, zero_rows
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
# contracted). These are the dimension numbers tokamax's own VJP uses
# (tokamax/_src/ops/ragged_dot/base.py); its Mosaic GPU op runs the first as its sm90 `ragged_dot_kernel` (after transposing rhs) and the
# second as `ragged_contracting_dim_dot_kernel`, which k3jax does not use on the GPU (wrong sums
# on an H200; `pallas_kernels.grouped_matmul.grouped_weight_grad` instead).
_DLHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_DRHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])

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
# 0.0.17 picks 64 x 64 x 128 with two stages on sm90; 128 x 128 x 64 with three stages ran 1.15-1.9x
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
        f"ImplConfig.moe_grouped_matmul = 'tokamax': tokamax's {implementation!r} ragged_dot "
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
  ImplConfig.moe_grouped_matmul.
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
  """The grouped matmul for ImplConfig.moe_grouped_matmul.

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
  (experiments/benchmarks/moe_bench.py measures both).
  """
  if kind not in GROUPED_MATMULS:
    raise ValueError(f"ImplConfig.moe_grouped_matmul = {kind!r}: expected one of "
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
