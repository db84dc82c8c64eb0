"""The attention backward as Mosaic GPU kernels (sm90: wgmma, TMA, warp specialisation).

Query t sees keys [k_lo[t], k_hi[t]), and each program walks only the blocks its tile's ranges
touch (a row of many documents costs the sum of its documents' blocks, not a whole causal pass).
Here every block step is a warpgroup matrix multiply on tiles that a separate memory warpgroup
streams into shared memory (`plgpu.emit_pipeline_warp_specialized`), and `compute_wgs` warpgroups
share one stream: in the dq kernel each takes `block_q_dq` of the tile's queries against the same
key blocks, in the dk/dv kernel each takes `block_k_dkv` of the tile's keys against the same query
blocks.

Every kernel recomputes the logits:
  dq kernel    S = Q Kᵀ, dP = dO Vᵀ, dQ += dS K,  with dS = P ∘ (dP − δ), P = exp(S·scale − lse);
  dV kernel    Sᵀ = K Qᵀ, dV += Pᵀ dO;
  dK kernel    Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dK += dSᵀ Q.
dK and dV come from two kernels, each warpgroup holding one accumulator ([64, Dv] or [64, D]), at
the cost of computing S twice: on the H200 (RESULTS.md, run 31) at 4 × 8192 tokens, 12 heads, dV
1.07 + dK 1.50 ms against 3.38 for one kernel with both accumulators and 3.17 for a Triton dk/dv
kernel; the dq kernel 1.26 ms against a Triton one's 2.25.
The element masks come from k_lo / k_hi and are applied only on block pairs that straddle a range
edge (the per-block scalars of `_block_ranges` tell which); the loops' bounds come from per-tile
block spans computed in XLA before the launch (`_block_spans`).

Layouts: q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv], dout [B, T, H, Dv], lse / delta
[B, H, T] fp32 (lse = +inf where a query sees nothing), k_lo / k_hi [B, T], q_lo / q_hi [B, S]
int32; H = Hk · G. T and S must be multiples of the tiles and D, Dv multiples of 64 (`ops.py` pads).
Runs on sm90 GPUs, or on the CPU in Mosaic GPU's interpreter (`interpret=True`), which needs the
P / dS matmul operands in shared memory (`register_operands=False`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
_ROWS = plgpu.Layout.WGMMA.reduce(1)   # a vector along a wgmma tile's rows
_COLS = plgpu.Layout.WGMMA.reduce(0)   # ... along its columns
_TILE_ROWS = 8
# A kernel's grid axes, and its warpgroup axis (the compute warpgroups and the memory one).
_GRID = ("batch", "heads", "tiles")
_WG = "wg"


@dataclasses.dataclass(frozen=True)
class MosaicBwdConfig:
  """Tiles and launch of the Mosaic GPU backward.

  The defaults were measured on an H200 at MLA's head dims (q/k 192, v 128), 4 rows of 8192 tokens
  with three documents, 12 heads (RESULTS.md, run 31): three stages were 1-2 % slower than two,
  P and dS through shared memory 2.5 %. 64-row blocks keep a step's tiles in shared memory at two
  stages (128-key blocks in the dq kernel would need 240 KB of the 227), and 32-row blocks do not
  lower (the dQ and dV matmuls' contraction must be whole 64-element swizzle groups).

  Attributes:
    block_q_dq / block_k_dq: the dq kernel's queries per warpgroup and keys per step.
    block_q_dkv / block_k_dkv: the dk/dv kernel's queries per step and keys per warpgroup.
    num_stages: key (dq) or query (dk/dv) blocks in flight in shared memory.
    compute_wgs: compute warpgroups per program (a program's tile is compute_wgs blocks).
    register_operands: P and dS enter their matmuls from registers (False: through shared memory,
      what the interpreter supports; slower on a GPU).
    interpret: run in Mosaic GPU's interpreter on the CPU (tests).
  """
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  num_stages: int = 2
  compute_wgs: int = 2
  register_operands: bool = True
  interpret: bool = False

  def __post_init__(self):
    # A warpgroup's matmuls are 64 rows (its queries in dq, its keys in dk/dv) tall, and the
    # other side's block is the contraction of dQ += dS K and dV += Pᵀ dO: whole 128-byte
    # swizzle groups of bf16, 64 (32-row blocks fail to lower: "K must be a multiple of 64").
    for name in ("block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv"):
      value = getattr(self, name)
      if value <= 0 or value % 64:
        raise ValueError(f"MosaicBwdConfig.{name} must be a positive multiple of 64, got {value}")
    for name in ("num_stages", "compute_wgs"):
      if getattr(self, name) < 1:
        raise ValueError(f"MosaicBwdConfig.{name} must be >= 1, got {getattr(self, name)}")

  @property
  def tile_q(self) -> int:
    """Queries per dq program."""
    return self.compute_wgs * self.block_q_dq

  @property
  def tile_k(self) -> int:
    """Keys per dk/dv program."""
    return self.compute_wgs * self.block_k_dkv


def _swizzled(shape, dtype) -> tuple:
  """Tiling and swizzle transforms for a bf16/fp16 tile whose rows are `shape[-1]` elements."""
  bits = jnp.finfo(dtype).bits
  swizzle = plgpu.find_swizzle(shape[-1] * bits)
  return (plgpu.TilingTransform((_TILE_ROWS, 8 * swizzle // bits)),
          plgpu.SwizzleTransform(swizzle))


def _smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=_swizzled(shape, dtype))


def _block_spec(shape, dtype, index_map):
  return plgpu.BlockSpec(shape, index_map, transforms=_swizzled(shape, dtype))


def _block_spans(lo, hi, tile: int, block: int, num_blocks: int):
  """Per tile of `tile` rows, the blocks of `block` columns that rows' ranges [lo, hi) touch.

  lo, hi [B, N] int32 -> (first, last) [B, N // tile] int32 with first < last: a tile that sees
  nothing (padding) still walks one block, where every element is masked.
  """
  b, n = lo.shape
  first = jnp.min(lo.reshape(b, n // tile, tile), axis=-1) // block
  last = -(-jnp.max(hi.reshape(b, n // tile, tile), axis=-1) // block)
  first = jnp.clip(first, 0, num_blocks - 1)
  return first.astype(jnp.int32), jnp.maximum(last, first + 1).astype(jnp.int32)


def _block_ranges(k_lo, k_hi, block: int):
  """Per block of `block` queries, max(k_lo) and min(k_hi): a key block inside [max, min) needs
  no element mask for any of the block's queries. [B, T // block] int32 each."""
  b, t = k_lo.shape
  return (jnp.max(k_lo.reshape(b, t // block, block), axis=-1).astype(jnp.int32),
          jnp.min(k_hi.reshape(b, t // block, block), axis=-1).astype(jnp.int32))


def _program_index():
  """(batch row, head, tile, warpgroup) of the running program and warpgroup."""
  return tuple(lax.axis_index(name) for name in _GRID + (_WG,))


def _warp_specialized(step, cfg: MosaicBwdConfig, *, grid, compute_context, in_specs):
  """Both kernels' pipeline: a memory warpgroup streams the `in_specs` blocks `cfg.num_stages`
  ahead into shared memory; each of the `cfg.compute_wgs` compute warpgroups runs `step` on them
  and releases each block itself once its matmuls have read it."""
  return plgpu.emit_pipeline_warp_specialized(
      step,
      grid=grid,
      max_concurrent_steps=cfg.num_stages,
      num_compute_wgs=cfg.compute_wgs,
      memory_registers=40,
      wg_axis=_WG,
      manual_consumed_barriers=True,
      compute_context=compute_context,
      in_specs=in_specs,
  )


def _mask_where_straddling(s, key0: int, block_k: int, inner_lo, inner_hi, key_axis: int,
                           ranges):
  """The logits `s` of a block of keys key0.. (along `key_axis`) and queries (the other axis),
  with -inf where a key is outside its query's [k_lo, k_hi); `ranges()` gives those two query
  vectors. Masks only when the key block is not inside every query's range ([inner_lo,
  inner_hi): `_block_ranges`)."""

  def masked():
    lo, hi = ranges()
    key = key0 + plgpu.broadcasted_iota(jnp.int32, s.shape, key_axis, layout=plgpu.Layout.WGMMA)
    query_axis = [1 - key_axis]
    seen = (key >= lax.broadcast_in_dim(lo, s.shape, query_axis)) & (
        key < lax.broadcast_in_dim(hi, s.shape, query_axis))
    return jnp.where(seen, s, -jnp.inf)

  return lax.cond((key0 < inner_lo) | (key0 + block_k > inner_hi), masked, lambda: s)


def _dq_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, klo_gmem, khi_gmem,
               first_gmem, last_gmem, inner_lo_gmem, inner_hi_gmem, dq_gmem,
               q_smems, do_smems, ds_smems, barriers, *, cfg: MosaicBwdConfig, scale: float,
               groups: int):
  bi, hi, ti, wg = _program_index()
  bq, bk = cfg.block_q_dq, cfg.block_k_dq
  dtype = q_gmem.dtype
  qb = ti * cfg.compute_wgs + wg            # this warpgroup's query block
  rows = pl.ds(qb * bq, bq)
  first, last = first_gmem[bi, ti], last_gmem[bi, ti]
  k_rows = k_gmem.at[bi, :, hi // groups]
  v_rows = v_gmem.at[bi, :, hi // groups]
  q_smem, do_smem, barrier = q_smems.at[wg], do_smems.at[wg], barriers.at[wg]
  ds_smem = None if ds_smems is None else ds_smems.at[wg]

  def compute_thread(pipeline):
    plgpu.copy_gmem_to_smem(q_gmem.at[bi, rows, hi], q_smem, barrier)
    plgpu.copy_gmem_to_smem(do_gmem.at[bi, rows, hi], do_smem, barrier)
    lse = plgpu.load(lse_gmem.at[bi, hi, rows], layout=_ROWS, optimized=False) * _LOG2E
    delta = plgpu.load(delta_gmem.at[bi, hi, rows], layout=_ROWS, optimized=False)
    klo = plgpu.load(klo_gmem.at[bi, rows], layout=_ROWS, optimized=False)
    khi = plgpu.load(khi_gmem.at[bi, rows], layout=_ROWS, optimized=False)
    inner = (inner_lo_gmem[bi, qb], inner_hi_gmem[bi, qb])
    plgpu.barrier_wait(barrier)

    def accumulate(dq_acc):
      pipeline((dq_acc, lse, delta, klo, khi, inner))
      return dq_acc[...]

    dq = pl.run_scoped(accumulate, plgpu.ACC((bq, q_smem.shape[-1]), jnp.float32))
    q_smem[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_gmem.at[bi, rows, hi])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def step(index, v_smem, k_smem, v_consumed, k_consumed, carry):
    dq_acc, lse, delta, klo, khi, (inner_lo, inner_hi) = carry
    key0 = (first + index[0]) * bk

    def logits_and_dp(s_acc, dp_acc):
      plgpu.wgmma(dp_acc, do_smem, v_smem.T)
      plgpu.wgmma(s_acc, q_smem, k_smem.T)
      plgpu.wgmma_wait(1)
      plgpu.barrier_arrive(v_consumed)
      return s_acc[...], dp_acc[...]

    acc = plgpu.ACC((bq, bk), jnp.float32)
    s, dp = pl.run_scoped(logits_and_dp, acc, acc)

    s = _mask_where_straddling(s, key0, bk, inner_lo, inner_hi, 1, lambda: (klo, khi))
    p = jnp.exp2(s * (scale * _LOG2E) - lax.broadcast_in_dim(lse, s.shape, [0]))
    ds = (p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))).astype(dtype)
    if ds_smem is None:
      plgpu.wgmma(dq_acc, ds, k_smem)
    else:
      ds_smem[...] = ds
      plgpu.commit_smem()
      plgpu.wgmma(dq_acc, ds_smem, k_smem)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(k_consumed)
    return carry

  d, dv = k_gmem.shape[-1], v_gmem.shape[-1]
  _warp_specialized(
      step, cfg, grid=(last - first,), compute_context=compute_thread,
      in_specs=[_block_spec((bk, dv), v_gmem.dtype, lambda i: (first + i, 0)),
                _block_spec((bk, d), k_gmem.dtype, lambda i: (first + i, 0))],
  )(v_rows, k_rows)


def _dkv_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, klo_gmem, khi_gmem,
                first_gmem, last_gmem, inner_lo_gmem, inner_hi_gmem, *refs, cfg: MosaicBwdConfig,
                scale: float, groups: int, parts: tuple):
  """dK and / or dV (`parts`) of a tile of keys; refs = the outputs in `parts` order, then the k
  and v tiles' shared memory, P's (None: from registers) and the barriers."""
  outs = dict(zip(parts, refs[:len(parts)]))
  k_smems, v_smems, p_smems, barriers = refs[len(parts):]
  bi, hk, ti, wg = _program_index()
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  dtype = k_gmem.dtype
  key0 = (ti * cfg.compute_wgs + wg) * bk
  keys = pl.ds(key0, bk)
  first, last = first_gmem[bi, ti], last_gmem[bi, ti]
  k_smem, v_smem, barrier = k_smems.at[wg], v_smems.at[wg], barriers.at[wg]
  p_smem = None if p_smems is None else p_smems.at[wg]
  # Each output's accumulator and the shared memory that stages it for the store.
  stage = {"dk": k_smem, "dv": v_smem}

  def compute_thread(pipeline):
    plgpu.copy_gmem_to_smem(k_gmem.at[bi, keys, hk], k_smem, barrier)
    plgpu.copy_gmem_to_smem(v_gmem.at[bi, keys, hk], v_smem, barrier)
    plgpu.barrier_wait(barrier)

    def accumulate(*accs):
      pipeline(accs)
      return tuple(acc[...] for acc in accs)

    sums = pl.run_scoped(accumulate, *(plgpu.ACC(stage[part].shape, jnp.float32)
                                       for part in parts))
    for part, total in zip(parts, sums):
      stage[part][...] = (total * scale if part == "dk" else total).astype(dtype)
    plgpu.commit_smem()
    for part in parts:
      plgpu.copy_smem_to_gmem(stage[part], outs[part].at[bi, keys, hk], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def step(index, q_smem, do_smem, lse_smem, delta_smem, q_consumed, do_consumed, lse_consumed,
           delta_consumed, carry):
    accs = dict(zip(parts, carry))
    qb = first + index[0]
    queries = pl.ds(qb * bq, bq)

    def logits(acc):
      plgpu.wgmma(acc, k_smem, q_smem.T)
      lse = plgpu.load(lse_smem, layout=_COLS) * _LOG2E
      delta = plgpu.load(delta_smem, layout=_COLS)
      plgpu.barrier_arrive(lse_consumed)
      plgpu.barrier_arrive(delta_consumed)
      return acc[...], lse, delta

    acc = plgpu.ACC((bk, bq), jnp.float32)
    s, lse, delta = pl.run_scoped(logits, acc)

    def ranges():  # the block's queries' key ranges, read only where a mask is needed
      return (plgpu.load(klo_gmem.at[bi, queries], layout=_COLS, optimized=False),
              plgpu.load(khi_gmem.at[bi, queries], layout=_COLS, optimized=False))

    s = _mask_where_straddling(s, key0, bk, inner_lo_gmem[bi, qb], inner_hi_gmem[bi, qb], 0,
                               ranges)
    p32 = jnp.exp2(s * (scale * _LOG2E) - lax.broadcast_in_dim(lse, s.shape, [1]))
    p = p32.astype(dtype)

    def accumulate(acc_ref, lhs, rhs):
      """acc_ref += lhs · rhs with lhs (Pᵀ or dSᵀ) from registers, or staged through p_smem once
      the matmul that last read it is done."""
      if p_smem is None:
        plgpu.wgmma(acc_ref, lhs, rhs)
      else:
        plgpu.wgmma_wait(0)
        p_smem[...] = lhs
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, p_smem, rhs)

    if "dk" not in parts:  # dV alone: Pᵀ dO, no dP
      accumulate(accs["dv"], p, do_smem)
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(do_consumed)
      plgpu.barrier_arrive(q_consumed)
      return carry

    def dp_then_dv(dp_acc):
      plgpu.wgmma(dp_acc, v_smem, do_smem.T)
      if "dv" in parts:
        accumulate(accs["dv"], p, do_smem)
      return plgpu.wgmma_accumulator_load(dp_acc, wait_n=1 if "dv" in parts else 0)

    dp = pl.run_scoped(dp_then_dv, acc)
    ds = (p32 * (dp - lax.broadcast_in_dim(delta, s.shape, [1]))).astype(dtype)
    accumulate(accs["dk"], ds, q_smem)
    plgpu.wgmma_wait(1)
    plgpu.barrier_arrive(do_consumed)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(q_consumed)
    return carry

  d, dv = q_gmem.shape[-1], do_gmem.shape[-1]

  def query_block(index_map):
    return lambda i, g: index_map(first + i, hk * groups + g)

  q_rows, do_rows = q_gmem.at[bi], do_gmem.at[bi]
  _warp_specialized(
      step, cfg, grid=(last - first, groups), compute_context=compute_thread,
      in_specs=[
          _block_spec((bq, None, d), q_gmem.dtype, query_block(lambda qb, h: (qb, h, 0))),
          _block_spec((bq, None, dv), do_gmem.dtype, query_block(lambda qb, h: (qb, h, 0))),
          plgpu.BlockSpec((None, bq), query_block(lambda qb, h: (h, qb))),
          plgpu.BlockSpec((None, bq), query_block(lambda qb, h: (h, qb))),
      ],
  )(q_rows, do_rows, lse_gmem.at[bi], delta_gmem.at[bi])


def _shapes(q, k, v, cfg: MosaicBwdConfig) -> tuple[int, ...]:
  """(B, T, H, D, S, Hk, Dv) of padded inputs, after checking them against the tiles."""
  b, t, h, d = q.shape
  s, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
  if t % cfg.tile_q or t % cfg.block_q_dkv or s % cfg.tile_k or s % cfg.block_k_dq:
    raise ValueError(f"T={t} and S={s} must be multiples of the tiles of {cfg}")
  if d % 64 or dv % 64:
    raise ValueError(f"head dims must be multiples of 64, got D={d}, Dv={dv}")
  return b, t, h, d, s, hk, dv


def _launch(cfg: MosaicBwdConfig) -> dict:
  return dict(compiler_params=plgpu.CompilerParams(approx_math=True),
              num_threads=cfg.compute_wgs + 1, thread_name=_WG,
              interpret=plgpu.InterpretGPUParams() if cfg.interpret else None)


def mosaic_flash_dq(q, k, v, dout, lse, delta, k_lo, k_hi, *, scale: float,
                    cfg: MosaicBwdConfig):
  """Padded inputs (module docstring) -> dq [B, T, H, D] in q.dtype."""
  b, t, h, d, s, hk, dv = _shapes(q, k, v, cfg)
  wgs = cfg.compute_wgs
  first, last = _block_spans(k_lo, k_hi, cfg.tile_q, cfg.block_k_dq, s // cfg.block_k_dq)
  inner_lo, inner_hi = _block_ranges(k_lo, k_hi, cfg.block_q_dq)
  bq, bk = cfg.block_q_dq, cfg.block_k_dq
  ds_scratch = None if cfg.register_operands else _smem((wgs, bq, bk), q.dtype)
  return plgpu.kernel(
      functools.partial(_dq_kernel, cfg=cfg, scale=scale, groups=h // hk),
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_types=[_smem((wgs, bq, d), q.dtype), _smem((wgs, bq, dv), dout.dtype), ds_scratch,
                     plgpu.Barrier(num_barriers=wgs, num_arrivals=2)],
      grid=(b, h, t // cfg.tile_q), grid_names=_GRID,
      kernel_name="flash_ranges_dq_mosaic", **_launch(cfg),
  )(q, k, v, dout, lse, delta, k_lo, k_hi, first, last, inner_lo, inner_hi)


def mosaic_flash_dkv(q, k, v, dout, lse, delta, k_lo, k_hi, q_lo, q_hi, *, scale: float,
                     cfg: MosaicBwdConfig):
  """Padded inputs (module docstring) -> dk [B, S, Hk, D], dv [B, S, Hk, Dv] in k's dtype, from
  the dV kernel and the dK kernel."""
  b, t, h, d, s, hk, dv = _shapes(q, k, v, cfg)
  wgs = cfg.compute_wgs
  first, last = _block_spans(q_lo, q_hi, cfg.tile_k, cfg.block_q_dkv, t // cfg.block_q_dkv)
  inner_lo, inner_hi = _block_ranges(k_lo, k_hi, cfg.block_q_dkv)
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  p_scratch = None if cfg.register_operands else _smem((wgs, bk, bq), q.dtype)
  shapes = {"dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
            "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}

  def run(parts):
    return plgpu.kernel(
        functools.partial(_dkv_kernel, cfg=cfg, scale=scale, groups=h // hk, parts=parts),
        out_type=tuple(shapes[part] for part in parts),
        scratch_types=[_smem((wgs, bk, d), k.dtype), _smem((wgs, bk, dv), v.dtype), p_scratch,
                       plgpu.Barrier(num_barriers=wgs, num_arrivals=2)],
        grid=(b, hk, s // cfg.tile_k), grid_names=_GRID,
        kernel_name=f"flash_ranges_{''.join(parts)}_mosaic", **_launch(cfg),
    )(q, k, v, dout, lse, delta, k_lo, k_hi, first, last, inner_lo, inner_hi)

  (dv_,) = run(("dv",))
  (dk,) = run(("dk",))
  return dk, dv_
