"""Configuration of the chunked KDA kernels: the static `KernelConfig` that every kernel takes, its
launch parameters `Tuning`, and `default_tuning`, the launches measured best on an H200.

A chunk of C tokens (a multiple of 16) is split into NS = C / BC sub-tiles of BC = 16 rows, the
smallest tensor-core dot; the intra-chunk kernels (`intra_chunk.intra_fwd`, `backward.intra_bwd`)
work on these sub-tiles. `pallas_kernels.kda` lists the stages and their call order.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

BC = 16  # sub-tile rows: the smallest tensor-core dot


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Launch parameters and block sizes of the kernels (the interpreter ignores the launches).

  Each `*_launch` is (num_warps, num_stages); `bv_*` is the V block of the sequential scans (more
  blocks = more programs in parallel, each re-reading the chunk's K-side operands).
  `gate_fwd_bk` / `intra_fwd_bk` / `intra_bwd_bk` are the K blocks of the loops of `gate_fwd`,
  `intra_fwd` and `intra_bwd`; they apply in the interpreter too.
  `dense_bwd_bv` / `dense_bwd_bk`: the V and K blocks of `dense_bwd`'s loops.
  """
  intra_fwd_launch: tuple = (4, 1)
  wy_fwd_launch: tuple = (4, 1)
  scan_fwd_launch: tuple = (4, 1)
  out_fwd_launch: tuple = (4, 1)
  scan_bwd_launch: tuple = (4, 1)
  dense_bwd_launch: tuple = (4, 1)
  intra_bwd_launch: tuple = (4, 1)
  bv_fwd: int = 64
  bv_bwd: int = 64
  intra_fwd_bk: int = 64
  intra_bwd_bk: int = 64
  dense_bwd_bv: int = 128
  dense_bwd_bk: int = 128
  gate_bwd_launch: tuple = (4, 1)
  gate_fwd_launch: tuple = (4, 1)
  gate_fwd_bk: int = 64


def default_tuning(rows_heads: int, K: int, V: int) -> Tuning:
  """Launch parameters and blocks measured best on an H200 (RESULTS.md, runs 4 to 7) for B·H =
  rows_heads and head dims K, V.

  With few rows × heads the scans run on few programs: smaller V blocks (more programs) and a
  3-stage software pipeline over the chunk loop pay (measured at 16); from 48 on (medium.gin's
  4 rows × 12 heads, run 26: the KDA op's forward+backward 7.02 → 6.51 ms) 64-wide blocks do.
  gate_fwd (which holds the q/k norm) runs best on 4 warps over 64-column K blocks
  after a first pass for the norms, intra_fwd on one warp over 16-column K blocks, dense_bwd on 8
  warps over 64 × 64 (V, K) blocks, intra_bwd on 2 warps per 64-column K block. (A head dim that
  the block does not divide, possible in the interpreter, is one block.)
  """
  if rows_heads >= 48:   # scan_fwd 0.39 against 0.58 ms (16-wide) at 4 x 8192 x 12 (run 26)
    bv_fwd, bv_bwd, scan_bwd = 64, 64, (8, 3)
  else:  # 16-wide forward blocks: scan_fwd 0.87 vs 1.03 ms for 32 at 1 x 32768 x 16 (run 6)
    bv_fwd, bv_bwd, scan_bwd = 16, 16, (4, 3)
  fit = lambda block, width: block if width % block == 0 else width
  return Tuning(gate_fwd_launch=(4, 1), gate_fwd_bk=fit(64, K), intra_fwd_launch=(1, 1),
                intra_fwd_bk=fit(16, K), scan_fwd_launch=(4, 3),
                scan_bwd_launch=scan_bwd, dense_bwd_launch=(8, 1), dense_bwd_bv=fit(64, V),
                dense_bwd_bk=fit(64, K), intra_bwd_launch=(2, 1), intra_bwd_bk=fit(64, K),
                bv_fwd=min(bv_fwd, V), bv_bwd=min(bv_bwd, V))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static configuration shared by the kernels.

  Attributes:
    chunk: chunk length C (multiple of 16).
    scale: query scale s.
    mm_dtype: operand dtype of the large dots (bf16 for bf16 inputs, fp32 otherwise).
    exact_diag: exact pairwise decays on the diagonal sub-tiles (any gate) instead of factored dots.
    gate: 'none' (g is the log decay), 'bounded' (lower_bound·sigmoid(exp(A_log)·(g + dt_bias))) or
      'softplus' (-exp(A_log)·softplus(g + dt_bias)).
    lower_bound: bound of the 'bounded' gate.
    interpret: run in the Pallas interpreter.
    state_dtype: dtype of the saved per-chunk states and of W, U, Vn, kg.
    segmented: the kernels take `dseg` (documents within chunks, see the module docstring).
    qk_l2norm: gate_fwd and intra_fwd take raw q, k and normalise them (module docstring);
      dense_bwd and intra_bwd require False.
    tuning: launch parameters.
  """
  chunk: int
  scale: float
  mm_dtype: object
  exact_diag: bool
  gate: str
  lower_bound: float
  interpret: bool
  state_dtype: object = jnp.float32
  segmented: bool = False
  qk_l2norm: bool = False
  tuning: Tuning = Tuning()

  @property
  def ns(self) -> int:
    return self.chunk // BC
