"""The KDA layer's short convolution + SiLU, forward and backward, as Pallas kernels (Triton lowering).

Forward: y[t, c] = Σ_j w[W-1-j, c] · m_j[t] · x[t-j, c], out = silu(y), m_j[t] = 1 when t is a token
(segment id ≠ 0) and x[t-j] lies in its segment. Backward, with dy[t] = dout[t] · silu'(y[t]) and
silu'(y) = σ(y)(1 + y(1 − σ(y))):

  dw[W-1-i]    = Σ_{b,t} m_i[t] · dy[t] · x[t-i]
  dx[t]        = Σ_i w[W-1-i] · m_i[t+i] · dy[t+i],   m_i[t+i] = (seg[t+i] ≠ 0) · (seg[t] = seg[t+i])

Each program owns `block_c` channels of `chunk_t` consecutive tokens of one row and sweeps them one
token row ([block_c] vector) at a time, keeping the W-1 neighbouring rows it needs in registers:
every element of x and dout is loaded once (plus W-1 rows at a chunk's edge), y and its sigmoid
are computed once, and no row is ever shifted, so no scratch memory or barrier is needed.

  forward   walks t upwards, carrying x[t-1] .. x[t-W+1] and their segment ids.
  backward  walks t downwards, carrying x[t] .. x[t-W+2] (the x rows that y[t-1] .. needs next)
            and dy[t+1] .. dy[t+W-1] with their segment ids: each step loads x[t-W+1], dout[t] and
            one segment id, then writes dx[t]. A prologue of W-1 steps computes dy for the rows just
            above the chunk (they belong to the next program, which computes them again) without
            writing dx. The program's partial sums of dw stay in registers and are written once.

A row whose taps (and, in the backward, the rows whose dy reaches it) all lie in its own document
takes a branch without the masks' selects: all but a document's first and last W-1 rows; the
branch is uniform across the program, which handles one row at a time (H200, RESULTS.md run 29:
the backward 0.171 against 0.185 ms with every row masked).

Rows outside [0, T) read segment id 0: they never reach a token (m = 0), and the loads of x and
dout at them are clamped to the row, so the same code runs compiled and in the interpreter, with no
padded copy of any [B, T, C] array. Padding tokens (id 0) output 0 and get dy = 0, so no gradient
flows to or from them.

These replace (RESULTS.md, run 28) tiled kernels that loaded each [block_t, block_c] tile of x at
the W shifts, recomputed dy for a halo of W-1 rows and round-tripped dy through a scratch slot
between two barriers: bound by their instruction count, ≈ 6× the byte floor in the backward. On
the H200 at [4 × 8192, 1536] bf16 the backward takes 0.17–0.18 ms against their 0.40 (XLA's
0.51), the forward 0.09–0.10 against 0.10–0.13.
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
class ConvConfig:
  """Tiles (powers of two) and the Triton launch of both kernels.

  Attributes:
    chunk_t: tokens a program walks (the last program of a row may run past its end).
    block_c: channels a program owns (each step loads one [block_c] row).
    launch: (num_warps, num_stages); the interpreter ignores it.
    interpret: run in the Pallas interpreter (CPU).
  """
  chunk_t: int = 128
  block_c: int = 256
  launch: tuple = (1, 1)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "chunk_t", "block_c")


def _sigmoid(y, fast: bool):
  """1 / (1 + e^-y); `fast` (compiled): the reciprocal as one `rcp.approx` instruction (≤ 1 ulp
  from the rounded quotient) instead of Triton's IEEE division."""
  d = 1.0 + jnp.exp(-y)
  if not fast:
    return 1.0 / d
  return pl_triton.elementwise_inline_asm(
      "rcp.approx.ftz.f32 $0, $1;", args=[d], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])[0]


def _row(ref, t, t_len: int):
  """ref[t] as fp32 [1, bc], t clamped into [0, T) (callers mask what lies outside)."""
  return ref[pl.ds(jnp.clip(t, 0, t_len - 1), 1), :].astype(jnp.float32)


def _seg(ref, t, t_len: int):
  """The segment id of row t as int32 [1]; 0 outside [0, T)."""
  inside = (t >= 0) & (t < t_len)
  return jnp.where(inside, ref[pl.ds(jnp.clip(t, 0, t_len - 1), 1)], 0)


def _y(w, xs, segs, masked: bool = True):
  """y of one row ([1, bc] fp32) from xs[j] = x[t-j] and segs[j] = seg[t-j], j < W; `masked`
  False when every tap lies in t's segment (no selects)."""
  here = segs[0]
  y = None
  for j, xj in enumerate(xs):
    if masked:
      m = (here != 0) if j == 0 else (here != 0) & (segs[j] == here)
      xj = jnp.where(m[:, None], xj, 0.0)
    term = w[len(xs) - 1 - j] * xj
    y = term if y is None else y + term
  return y


def _one_segment(here, others):
  """Scalar bool: row t is a token (`here` ≠ 0) and every row of `others` lies in its segment.
  Rows far from a document's edge take the branch without masks; their masks are all ones."""
  ok = here != 0
  for s in others:
    ok = ok & (s == here)
  return jnp.sum(ok.astype(jnp.int32)) > 0    # [1] -> scalar (Triton lowers no reduce_and)


def _fwd_kernel(x_ref, seg_ref, w_ref, o_ref, *, width: int, chunk: int, t_len: int,
                fast: bool):
  """x_ref [T, bc], seg_ref [T] int32, w_ref [Wp, bc]; o_ref [chunk, bc], this program's rows."""
  w = [w_ref[pl.ds(k, 1), :].astype(jnp.float32) for k in range(width)]
  t0 = pl.program_id(1) * chunk
  # xs[j-1], segs[j-1]: x[t-j] and its segment id for the next row t, j = 1 .. W-1.
  history = tuple(_row(x_ref, t0 - j, t_len) for j in range(1, width))
  history_seg = tuple(_seg(seg_ref, t0 - j, t_len) for j in range(1, width))

  def step(i, carry):
    xs, segs = carry
    t = t0 + i
    x_t, seg_t = _row(x_ref, t, t_len), _seg(seg_ref, t, t_len)
    xs_all, segs_all = (x_t,) + xs, (seg_t,) + segs
    y = jax.lax.cond(_one_segment(seg_t, segs), lambda: _y(w, xs_all, segs_all, masked=False),
                     lambda: _y(w, xs_all, segs_all))
    o_ref[pl.ds(i, 1), :] = (y * _sigmoid(y, fast)).astype(o_ref.dtype)
    return ((x_t,) + xs)[:width - 1], ((seg_t,) + segs)[:width - 1]

  jax.lax.fori_loop(0, chunk, step, (history, history_seg))


def _bwd_kernel(x_ref, seg_ref, dout_ref, w_ref, dx_ref, dw_ref, *, width: int, chunk: int,
                t_len: int, fast: bool):
  """x_ref, dout_ref [T, bc], seg_ref [T] int32, w_ref [Wp, bc]; dx_ref [chunk, bc] (this
  program's rows); dw_ref [Wp, bc] fp32, this program's partial sums of the kernel's gradient."""
  w = [w_ref[pl.ds(k, 1), :].astype(jnp.float32) for k in range(width)]
  t0 = pl.program_id(1) * chunk
  top = t0 + chunk + width - 2          # the highest row whose dy the chunk's dx needs

  def step(t, carry, emit):
    """Row t: y, dy (0 at padding), dx[t] from dy[t .. t+W-1]; dw's partial sums when `emit`."""
    xs, segs, dys, dy_segs, dw = carry      # xs: x[t] .. x[t-W+2]; dys: dy[t+1] .. dy[t+W-1]
    x_low, seg_low = _row(x_ref, t - width + 1, t_len), _seg(seg_ref, t - width + 1, t_len)
    xs_all, segs_all = xs + (x_low,), segs + (seg_low,)
    here = segs_all[0]
    dout = _row(dout_ref, t, t_len)

    def rows(masked: bool):
      """(dy, dx, dw) of row t; `masked` False: every row from t-W+1 to t+W-1 in t's segment."""
      y = _y(w, xs_all, segs_all, masked)
      sig = _sigmoid(y, fast)
      dy = dout * sig * (1.0 + y * (1.0 - sig))
      if masked:
        dy = jnp.where((here != 0)[:, None], dy, 0.0)
      if not emit:
        return dy, None, dw
      dx = w[width - 1] * dy
      for i in range(1, width):             # dy[t+i] reaches dx[t] within t's segment
        dyi = dys[i - 1]
        if masked:
          dyi = jnp.where((dy_segs[i - 1] == here)[:, None], dyi, 0.0)
        dx = dx + w[width - 1 - i] * dyi
      new_dw = []
      for j in range(width):
        g = dy * xs_all[j]
        if masked:
          g = jnp.where((segs_all[j] == here)[:, None], g, 0.0)
        new_dw.append(dw[j] + g)
      return dy, dx, tuple(new_dw)

    if not emit:
      dy, _, _ = rows(True)
    else:
      dy, dx, dw = jax.lax.cond(_one_segment(here, segs_all[1:] + dy_segs),
                                lambda: rows(False), lambda: rows(True))
      dx_ref[pl.ds(t - t0, 1), :] = dx.astype(dx_ref.dtype)
    return (xs_all[1:], segs_all[1:], ((dy,) + dys)[:width - 1],
            ((here,) + dy_segs)[:width - 1], dw)

  zero_row = jnp.zeros((1, w_ref.shape[1]), jnp.float32)
  zero_seg = jnp.zeros((1,), jnp.int32)
  carry = (tuple(_row(x_ref, top - j, t_len) for j in range(width - 1)),
           tuple(_seg(seg_ref, top - j, t_len) for j in range(width - 1)),
           (zero_row,) * (width - 1), (zero_seg,) * (width - 1), (zero_row,) * width)
  for k in range(width - 1):                # rows above the chunk: their dy only
    carry = step(top - k, carry, emit=False)
  carry = jax.lax.fori_loop(0, chunk, lambda i, c: step(t0 + chunk - 1 - i, c, emit=True), carry)
  dw = carry[-1]
  for j in range(width):                    # tap j weighs w[W-1-j]
    dw_ref[pl.ds(width - 1 - j, 1), :] = dw[j]
  for k in range(width, dw_ref.shape[0]):
    dw_ref[pl.ds(k, 1), :] = zero_row


@dataclasses.dataclass(frozen=True)
class _Layout:
  """One call's programs: chunk × bc each, `programs` along T, Cp // bc along C; tp / cp / wp:
  T, C and W padded to whole chunks, channel blocks and a power of two."""
  chunk: int
  bc: int
  programs: int
  tp: int
  cp: int
  wp: int

  def grid(self, b: int):
    return (b, self.programs, self.cp // self.bc)

  def rows_spec(self, t: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, t, self.bc), lambda bi, ti, ci: (bi, 0, ci))

  def seg_spec(self, t: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, t), lambda bi, ti, ci: (bi, 0))

  def kernel_spec(self) -> pl.BlockSpec:
    return pl.BlockSpec((self.wp, self.bc), lambda bi, ti, ci: (0, ci))

  def chunk_spec(self) -> pl.BlockSpec:
    return pl.BlockSpec((None, self.chunk, self.bc), lambda bi, ti, ci: (bi, ti, ci))


def _layout(t: int, c: int, width: int, config: ConvConfig) -> _Layout:
  chunk = min(config.chunk_t, pl.next_power_of_2(t))
  bc = min(config.block_c, pl.next_power_of_2(c))
  programs = pl.cdiv(t, chunk)
  return _Layout(chunk=chunk, bc=bc, programs=programs, tp=programs * chunk,
                 cp=pl.cdiv(c, bc) * bc, wp=pl.next_power_of_2(width))


def _params(config: ConvConfig) -> dict:
  if config.interpret:
    return {}
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=config.launch[0],
                                                       num_stages=config.launch[1]))


def _padded(lay: _Layout, kernel, *arrays):
  """The kernel padded to [Wp, Cp] and each [B, T, C] array to Cp channels."""
  pad_c = lay.cp - kernel.shape[1]
  w = jnp.pad(kernel, ((0, lay.wp - kernel.shape[0]), (0, pad_c)))
  return (w,) + tuple(a if not pad_c else jnp.pad(a, ((0, 0), (0, 0), (0, pad_c)))
                      for a in arrays)


def _check(name, x, kernel, segment_ids, dout=None):
  """The segment ids as int32 [B, T] (ones without them); ValueError naming `name` when x, kernel,
  segment_ids (and dout) do not fit."""
  b, t, c = x.shape
  width = kernel.shape[0]
  if kernel.shape != (width, c) or (dout is not None and dout.shape != x.shape):
    given, wanted = [f"x {x.shape}", f"kernel {kernel.shape}"], ["[B, T, C]", "[W, C]"]
    if dout is not None:
      given, wanted = given + [f"dout {dout.shape}"], wanted + ["[B, T, C]"]
    raise ValueError(f"{name}: {', '.join(given)} do not fit ({', '.join(wanted)})")
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  if segment_ids.shape != (b, t):
    raise ValueError(f"{name}: segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}")
  return segment_ids.astype(jnp.int32)


@kernel_entry_point("out_dtype", "config")
def conv_silu_fwd(x: jax.Array, kernel: jax.Array, segment_ids, out_dtype,
                  config: ConvConfig = ConvConfig()) -> jax.Array:
  """silu(causal depthwise conv(x, kernel)) (module docstring) in `out_dtype`, the math in fp32.

  x [B, T, C]; kernel [W, C] (kernel[W-1] weighs the current token); segment_ids [B, T] int
  (0 = padding) or None (one document a row). Returns [B, T, C].
  """
  seg = _check("conv_silu_fwd", x, kernel, segment_ids)
  b, t, c = x.shape
  width = kernel.shape[0]
  lay = _layout(t, c, width, config)
  w, xs = _padded(lay, kernel, x)
  out = pl.pallas_call(
      functools.partial(_fwd_kernel, width=width, chunk=lay.chunk, t_len=t,
                        fast=not config.interpret),
      grid=lay.grid(b),
      in_specs=[lay.rows_spec(t), lay.seg_spec(t), lay.kernel_spec()],
      out_specs=lay.chunk_spec(),
      out_shape=result_like(x, (b, lay.tp, lay.cp), out_dtype),
      interpret=config.interpret, name="short_conv_silu_fwd", **_params(config),
  )(xs, seg, w)
  return out[:, :t, :c]


@kernel_entry_point("config")
def conv_silu_bwd(x: jax.Array, kernel: jax.Array, segment_ids, dout: jax.Array,
                  config: ConvConfig = ConvConfig()) -> tuple[jax.Array, jax.Array]:
  """(dx, dkernel) of out = silu(causal depthwise conv(x, kernel)) (module docstring).

  x [B, T, C]; kernel [W, C] (kernel[W-1] weighs the current token); segment_ids [B, T] int
  (0 = padding) or None (one document a row); dout [B, T, C]. Returns dx [B, T, C] in x.dtype and
  dkernel [W, C] in kernel.dtype (the sum of the programs' partial sums); the math in fp32.
  """
  seg = _check("conv_silu_bwd", x, kernel, segment_ids, dout)
  b, t, c = x.shape
  width = kernel.shape[0]
  lay = _layout(t, c, width, config)
  w, xs, douts = _padded(lay, kernel, x, dout)
  dx, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, width=width, chunk=lay.chunk, t_len=t,
                        fast=not config.interpret),
      grid=lay.grid(b),
      in_specs=[lay.rows_spec(t), lay.seg_spec(t), lay.rows_spec(t), lay.kernel_spec()],
      out_specs=[lay.chunk_spec(),
                 pl.BlockSpec((None, None, lay.wp, lay.bc), lambda bi, ti, ci: (bi, ti, 0, ci))],
      out_shape=[result_like(x, (b, lay.tp, lay.cp), x.dtype),
                 result_like(x, (b, lay.programs, lay.wp, lay.cp), jnp.float32)],
      interpret=config.interpret, name="short_conv_silu_bwd", **_params(config),
  )(xs, seg, douts, w)
  dkernel = jnp.sum(dw, axis=(0, 1))[:width, :c]
  return dx[:, :t, :c], dkernel.astype(kernel.dtype)
