"""The KDA layer's short convolution + SiLU, forward and backward, as Pallas kernels (Triton lowering).

Forward: y[t, c] = Σ_j w[W-1-j, c] · m_j[t] · x[t-j, c], out = silu(y), m_j[t] = 1 when t is a token
(segment id ≠ 0) and x[t-j] lies in its segment. Backward, with dy[t] = dout[t] · silu'(y[t]) and
silu'(y) = σ(y)(1 + y(1 − σ(y))):

  dw[W-1-i]    = Σ_{b,t} m_i[t] · dy[t] · x[t-i]
  dx[t]        = Σ_i w[W-1-i] · m_i[t+i] · dy[t+i],   m_i[t+i] = (seg[t+i] ≠ 0) · (seg[t] = seg[t+i])

Both kernels read x, the segment ids and dout where they lie: the W-1 rows before a tile and the
rows past the row's end are masked loads (positions outside [0, T) read as padding), so no padded
copy of any [B, T, C] array is made. Each program walks `tiles_per_program` tiles of block_t
tokens × block_c channels.

The backward is one kernel. dx[t] needs dy at t .. t+W-1, and Triton cannot shift rows of a value
held in registers, so each tile computes dy for its block_t rows and for the W-1 rows after them
(a second, small tile: those rows' dy is computed twice, by this tile and the next), writes both
into the program's own scratch rows (global memory that stays in L1/L2: one [block_t + Wp, block_c]
fp32 slot a program, reused by its tiles), and reads them back at the W shifts after a barrier.
dy never makes a round trip through memory at full size (the two-kernel version it replaces wrote
dy in fp32 and read it back: ≈ 3× the bytes of x, dout and dx), and y's sigmoid is computed once
per element (plus the W-1 extra rows a tile). The program's partial sums of dw stay in registers
over its tiles (a [block_t, block_c] fp32 tile per tap, summed over rows at the end; [Wp, block_c]
a program, which the caller adds).

In the Pallas interpreter (CPU) the inputs are padded instead (the interpreter clamps a slice
that starts before an array), and the barriers are left out (its programs run one at a time).
The kernel's W rows are padded to a power of two (Triton's blocks are powers of two), the extra
rows zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two, result_like


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """Tile sizes (powers of two) and the Triton launch; the interpreter ignores the launch.

  Attributes:
    block_t: tokens per tile (raised to the next power of two >= W when smaller).
    block_c: channels per tile.
    tiles_per_program: tiles of block_t tokens per program (the backward's partial sums of dw and
      its scratch slot are the program's: fewer of both with more tiles).
    launch: (num_warps, num_stages) of both kernels. interpret: run in the Pallas interpreter (CPU).
  """
  block_t: int = 32
  block_c: int = 64
  tiles_per_program: int = 8
  launch: tuple = (4, 1)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_t", "block_c", "tiles_per_program")


def _sigmoid(y, fast: bool):
  """1 / (1 + e^-y); `fast` (compiled): the reciprocal as one `rcp.approx` instruction (≤ 1 ulp
  from the rounded quotient) instead of Triton's IEEE division."""
  d = 1.0 + jnp.exp(-y)
  if not fast:
    return 1.0 / d
  return pl_triton.elementwise_inline_asm(
      "rcp.approx.ftz.f32 $0, $1;", args=[d], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])[0]


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Where a program's rows lie in its refs. t_len: the row's tokens T; off: the zero rows before
  x and the segment ids in their refs (W-1 in the interpreter, else 0); masked: load with masks
  (compiled) rather than from padded arrays (interpreter)."""
  t_len: int
  off: int
  masked: bool


def _load_rows(ref, start, n, rows: _Rows, off: int, fill):
  """ref[off + start + r] for r < n (rows of a [T, ...] ref); positions outside [0, T) read as
  `fill` (their values are never used unmasked)."""
  pos = start + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
  ok = (pos >= 0) & (pos < rows.t_len)
  if not rows.masked:
    value = ref[pl.ds(off + start, n)]
    return jnp.where(ok.reshape((n,) + (1,) * (value.ndim - 1)), value, fill)
  block = ref.at[pl.ds(off + start, n)]
  mask = ok if len(block.shape) == 1 else ok[:, None]
  if len(block.shape) > 1:
    mask = jnp.broadcast_to(mask, block.shape)
  return pl_triton.load(block, mask=mask, other=fill)


def _conv_rows(x_ref, seg_ref, w, start, n, width, rows: _Rows):
  """y for the n tokens from `start` (fp32 [n, bc]), with what the backward reuses: the shifted
  inputs xs[j] = x[t-j] (fp32), masks[j] = m_j[t] ([n, 1] bool) and the tokens' segment ids
  ([n] int32)."""
  here = _load_rows(seg_ref, start, n, rows, rows.off, 0)
  valid = here != 0
  xs, masks, y = [], [], None
  for j in range(width):   # j = how many tokens back
    m = valid if j == 0 else valid & (
        _load_rows(seg_ref, start - j, n, rows, rows.off, 0) == here)
    xj = _load_rows(x_ref, start - j, n, rows, rows.off, 0.0).astype(jnp.float32)
    term = w[width - 1 - j] * jnp.where(m[:, None], xj, 0.0)
    y = term if y is None else y + term
    xs.append(xj)
    masks.append(m[:, None])
  return y, xs, masks, here


def _fwd_kernel(x_ref, seg_ref, w_ref, o_ref, *, width: int, block_t: int, tiles: int,
                rows: _Rows):
  """x_ref [off + T (+ pad), bc], seg_ref [off + T (+ pad)] int32, w_ref [Wp, bc];
  o_ref [tiles · block_t, bc], this program's tokens."""
  w = [w_ref[k, :].astype(jnp.float32)[None, :] for k in range(width)]
  base = pl.program_id(1) * tiles * block_t

  def tile(s, carry):
    y, _, _, _ = _conv_rows(x_ref, seg_ref, w, base + s * block_t, block_t, width, rows)
    o_ref[pl.ds(s * block_t, block_t), :] = (y * _sigmoid(y, rows.masked)).astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, tiles, tile, 0)


def _dy_rows(x_ref, seg_ref, dout_ref, w, start, n, width, rows: _Rows):
  """dy for the n tokens from `start` ([n, bc] fp32) and `_conv_rows`' xs, masks, segment ids."""
  y, xs, masks, seg = _conv_rows(x_ref, seg_ref, w, start, n, width, rows)
  sig = _sigmoid(y, rows.masked)
  dout = _load_rows(dout_ref, start, n, rows, 0, 0.0).astype(jnp.float32)
  return dout * sig * (1.0 + y * (1.0 - sig)), xs, masks, seg


def _bwd_kernel(x_ref, seg_ref, dout_ref, w_ref, dx_ref, dw_ref, scratch_ref, *, width: int,
                block_t: int, halo_t: int, tiles: int, rows: _Rows):
  """x_ref [off + T (+ pad), bc], seg_ref [off + T (+ pad)] int32, dout_ref [T (+ pad), bc],
  w_ref [Wp, bc]; dx_ref [tiles · block_t, bc] (this program's tokens); dw_ref [Wp, bc] fp32, this
  program's partial sums; scratch_ref [block_t + halo_t, bc] fp32, this program's slot."""
  barrier = (lambda: None) if not rows.masked else pl_triton.debug_barrier
  w = [w_ref[k, :].astype(jnp.float32)[None, :] for k in range(width)]
  base = pl.program_id(1) * tiles * block_t

  def tile(s, dw):
    t0 = base + s * block_t
    dy, xs, masks, here = _dy_rows(x_ref, seg_ref, dout_ref, w, t0, block_t, width, rows)
    dy_next, _, _, _ = _dy_rows(x_ref, seg_ref, dout_ref, w, t0 + block_t, halo_t, width, rows)
    barrier()   # the previous tile's reads of the slot are done
    scratch_ref[pl.ds(0, block_t), :] = dy
    scratch_ref[pl.ds(block_t, halo_t), :] = dy_next
    barrier()   # the slot holds dy for rows t0 .. t0 + block_t + halo_t - 1
    dx = None
    for i in range(width):   # the tile's own segment ids (i = 0) are dy's; the others, shifted
      ahead = here if i == 0 else _load_rows(seg_ref, t0 + i, block_t, rows, rows.off, 0)
      m = (ahead != 0) & (ahead == here)
      term = w[width - 1 - i] * jnp.where(m[:, None], scratch_ref[pl.ds(i, block_t), :], 0.0)
      dx = term if dx is None else dx + term
    dx_ref[pl.ds(s * block_t, block_t), :] = dx.astype(dx_ref.dtype)
    # Summed over the tile's rows once, after the last tile: a column sum of a register tile is a
    # reduction across warps.
    return tuple(dw[j] + jnp.where(masks[j], dy * xs[j], 0.0) for j in range(width))

  acc = jnp.zeros((block_t, dw_ref.shape[1]), jnp.float32)
  dw = jax.lax.fori_loop(0, tiles, tile, (acc,) * width)
  for j in range(width):   # tap j weighs w[W-1-j]
    dw_ref[width - 1 - j, :] = jnp.sum(dw[j], axis=0)
  for k in range(width, dw_ref.shape[0]):
    dw_ref[k, :] = jnp.zeros((dw_ref.shape[1],), jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The tiling of one call: bt × bc tiles, `tiles` a program, `programs` programs along T;
  tp / cp / wp: T, C and W padded to whole programs, tiles and a power of two."""
  bt: int
  bc: int
  tiles: int
  programs: int
  tp: int
  cp: int
  wp: int
  halo_t: int

  def grid(self, b: int) -> tuple[int, int, int]:
    return (b, self.programs, self.cp // self.bc)

  def rows_spec(self, n: int) -> pl.BlockSpec:
    """A [B, n, C] operand: each program reads its row's n rows whole, one channel block."""
    return pl.BlockSpec((None, n, self.bc), lambda bi, ti, ci: (bi, 0, ci))

  def seg_spec(self, n: int) -> pl.BlockSpec:
    """The [B, n] segment ids, each program its row's."""
    return pl.BlockSpec((None, n), lambda bi, ti, ci: (bi, 0))

  def kernel_spec(self) -> pl.BlockSpec:
    """The [Wp, Cp] kernel, one channel block."""
    return pl.BlockSpec((self.wp, self.bc), lambda bi, ti, ci: (0, ci))

  def tokens_spec(self) -> pl.BlockSpec:
    """A [B, Tp, Cp] result: each program writes its tokens, one channel block."""
    return pl.BlockSpec((None, self.tiles * self.bt, self.bc), lambda bi, ti, ci: (bi, ti, ci))


def _layout(t: int, c: int, width: int, config: ConvConfig) -> _Layout:
  bt = max(min(config.block_t, pl.next_power_of_2(t)), pl.next_power_of_2(width))
  bc = min(config.block_c, pl.next_power_of_2(c))
  tiles = min(config.tiles_per_program, pl.cdiv(t, bt))
  programs = pl.cdiv(t, tiles * bt)
  return _Layout(bt=bt, bc=bc, tiles=tiles, programs=programs, tp=programs * tiles * bt,
                 cp=pl.cdiv(c, bc) * bc, wp=pl.next_power_of_2(width),
                 halo_t=pl.next_power_of_2(max(width - 1, 1)))


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


def _operands(x, kernel, seg, lay: _Layout, interpret: bool, dout=None):
  """(x, seg, dout, kernel, rows) as the kernels read them: padded in the interpreter (W-1 rows
  before, whole programs and a halo tile after), only the channels and W padded when compiled."""
  b, t, c = x.shape
  width = kernel.shape[0]
  halo = width - 1
  pad_c = lay.cp - c
  w = jnp.pad(kernel, ((0, lay.wp - width), (0, pad_c)))
  if interpret:
    after = lay.tp + lay.halo_t - t
    x = jnp.pad(x, ((0, 0), (halo, after), (0, pad_c)))
    seg = jnp.pad(seg, ((0, 0), (halo, after)))
    dout = None if dout is None else jnp.pad(dout, ((0, 0), (0, after), (0, pad_c)))
    return x, seg, dout, w, _Rows(t_len=t, off=halo, masked=False)
  if pad_c:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad_c)))
    dout = None if dout is None else jnp.pad(dout, ((0, 0), (0, 0), (0, pad_c)))
  return x, seg, dout, w, _Rows(t_len=t, off=0, masked=True)


def _params(config: ConvConfig) -> dict:
  if config.interpret:
    return {}
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=config.launch[0],
                                                       num_stages=config.launch[1]))


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
  xs, seg, _, w, rows = _operands(x, kernel, seg, lay, config.interpret)
  out = pl.pallas_call(
      functools.partial(_fwd_kernel, width=width, block_t=lay.bt, tiles=lay.tiles, rows=rows),
      grid=lay.grid(b),
      in_specs=[lay.rows_spec(xs.shape[1]), lay.seg_spec(seg.shape[1]), lay.kernel_spec()],
      out_specs=lay.tokens_spec(),
      out_shape=result_like(x, (b, lay.tp, lay.cp), out_dtype),
      interpret=config.interpret, name="short_conv_silu_fwd", **_params(config),
  )(xs, seg, w)
  return out[:, :t, :c]


def conv_silu_bwd(x: jax.Array, kernel: jax.Array, segment_ids, dout: jax.Array,
                  config: ConvConfig = ConvConfig()) -> tuple[jax.Array, jax.Array]:
  """(dx, dkernel) of out = silu(causal depthwise conv(x, kernel)) (module docstring).

  x [B, T, C]; kernel [W, C] (kernel[W-1] weighs the current token); segment_ids [B, T] int
  (0 = padding) or None (one document a row); dout [B, T, C]. Returns dx [B, T, C] in x.dtype and
  dkernel [W, C] in kernel.dtype; the math in fp32.
  """
  seg = _check("conv_silu_bwd", x, kernel, segment_ids, dout)
  b, t, c = x.shape
  width = kernel.shape[0]
  lay = _layout(t, c, width, config)
  xs, seg, douts, w, rows = _operands(x, kernel, seg, lay, config.interpret, dout)
  slot = lay.bt + lay.halo_t
  dx, dw, _ = pl.pallas_call(
      functools.partial(_bwd_kernel, width=width, block_t=lay.bt, halo_t=lay.halo_t,
                        tiles=lay.tiles, rows=rows),
      grid=lay.grid(b),
      in_specs=[lay.rows_spec(xs.shape[1]), lay.seg_spec(seg.shape[1]),
                lay.rows_spec(douts.shape[1]), lay.kernel_spec()],
      out_specs=[lay.tokens_spec(),
                 pl.BlockSpec((None, None, lay.wp, lay.bc), lambda bi, ti, ci: (bi, ti, 0, ci)),
                 pl.BlockSpec((None, None, slot, lay.bc), lambda bi, ti, ci: (bi, ti, 0, ci))],
      out_shape=[result_like(x, (b, lay.tp, lay.cp), x.dtype),
                 result_like(x, (b, lay.programs, lay.wp, lay.cp), jnp.float32),
                 result_like(x, (b, lay.programs, slot, lay.cp), jnp.float32)],
      interpret=config.interpret, name="short_conv_silu_bwd", **_params(config),
  )(xs, seg, douts, w)
  dkernel = jnp.sum(dw, axis=(0, 1))[:width, :c]
  return dx[:, :t, :c], dkernel.astype(kernel.dtype)
