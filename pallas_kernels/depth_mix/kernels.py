"""Block AttnRes's depth mix, forward and backward, as Pallas kernels (Triton).

Over S sources s_i [N, d] (any leading axes flattened to N rows; one float dtype), a query
q [d] and an optional [S] bool mask, per row, all in fp32:

  r_i = (mean_d s_i² + eps)^-½,  c_i = <s_i, q>,  α = softmax_i(r_i c_i)  (−inf where masked),
  h = Σ_i α_i s_i                                        (in the sources' dtype)

and the backward of `k3jax.layers.attnres._depth_mix_bwd` (whose docstring derives it), from the
same residuals: the sources, q, and α and r (S arrays [N] fp32 here).

Why kernels: XLA computes the mix as separate fusions per source, so the forward reads every
source from HBM about twice (once for its r and c, once for h) and the backward about twice as
well, plus dh once per source. Here one program owns a tile of rows across all S sources and the
whole width: pass 1 reads its tiles for the per-row sums, the softmax runs on [rows] vectors,
and pass 2 reads the same tiles again (from L2, just read) to write h (forward) or each ds_i and
the tile's partial dq (backward). Each source is read from HBM once per direction.

Measured on one H200 (experiments/benchmarks/RESULTS.md, run 22): alone, 0.82 against XLA's
0.94 ms forward + backward for five bf16 [32768, 1536] sources, but 0.40 against 0.36 ms for two
(about twice the bandwidth floor: the second read of a tile does not always hit L2); in
medium.gin's training step (33 mixes of 2-5 sources), 381.3 against 395.9 ms. 128-column chunks
and 16 rows a program were among the fastest tiles; keeping the tiles live in registers for the
second pass instead of reading them again took 1.05-6.58 ms (RESULTS.md, run 22).

Triton wants power-of-two arrays inside a kernel, and d (768, 1536) is not one. Each [N, d] array
is one (block_rows, d) block; the kernel loops over its width in chunks of Dc columns (the largest
power of two dividing d, capped at block_d), so every load and store is [block_rows, Dc]. The
Triton lowering checks only the shapes loaded and stored, not the blocks'. (Outputs could not be
split per chunk anyway: a pallas_call output takes one BlockSpec.)

One H200, medium.gin's mixes (bf16 [32768, 1536] sources, `depth_mix_bench.py --d=1536`), forward /
forward+backward in ms: S = 5: XLA 0.357 / 0.944, these kernels (block_rows 16, 4 warps, Dc 128)
0.315 / 0.822; S = 2: XLA 0.153 / 0.366, kernels 0.149 / 0.405. The floor at 4.3 TB/s is about
0.14 / 0.40 (S = 5): the second reads do not all hit L2 while many programs are in flight
(each holds S·block_rows·d·2 bytes between its passes), and Dc = 512 with 4 warps spilled
(S = 5: 0.65 / 1.95).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import (check_powers_of_two, column_chunk, kernel_entry_point,
                                   result_like)


@dataclasses.dataclass(frozen=True)
class DepthMixConfig:
  """Tiles and Triton launch; the interpreter (CPU tests) ignores the launch.

  Attributes:
    block_rows: rows per program (power of two; capped at N rounded up to a power of two).
    block_d: cap on the channel chunk Dc (power of two; Dc also divides d).
    num_warps, num_stages: the Triton launch. interpret: run in the Pallas interpreter.
  """
  block_rows: int = 16
  block_d: int = 128
  num_warps: int = 4
  num_stages: int = 1
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_rows", "block_d", "num_warps")


def _columns(c, chunk: int):
  return pl.ds(c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk), chunk)


def _chunk_loop(num_chunks: int, body, carry):
  """body(c, carry) over the chunks: a fori_loop (a loop in Triton: the second pass reads each
  tile again, an L2 hit, and the loads can be pipelined)."""
  return jax.lax.fori_loop(0, num_chunks, body, carry)


def _loader(chunk: int):
  """load(ref, c) -> ref's chunk c as fp32 [bn, Dc]."""
  def load(ref, c):
    return ref[:, _columns(c, chunk)].astype(jnp.float32)
  return load


def _fwd_kernel(*refs, num_sources: int, width: int, chunk: int, eps: float, masked: bool):
  """refs: S source blocks [bn, d], q [1, d], (bias [S_pad] if masked), then h [bn, d],
  S alpha blocks [bn] and S r blocks [bn] (fp32)."""
  s_refs, q_ref = refs[:num_sources], refs[num_sources]
  bias_ref = refs[num_sources + 1] if masked else None
  h_ref, *stats = refs[num_sources + 1 + masked:]
  alpha_refs, r_refs = stats[:num_sources], stats[num_sources:]
  num_chunks, load = width // chunk, _loader(chunk)

  def sums(c, carry):
    squares, dots = carry
    col = _columns(c, chunk)
    q = q_ref[:, col].astype(jnp.float32)                                   # [1, Dc]
    tiles = [load(ref, c) for ref in s_refs]                                # S x [bn, Dc]
    return (tuple(acc + jnp.sum(s * s, axis=1) for acc, s in zip(squares, tiles)),
            tuple(acc + jnp.sum(s * q, axis=1) for acc, s in zip(dots, tiles)))

  zeros = (jnp.zeros(alpha_refs[0].shape, jnp.float32),) * num_sources
  squares, dots = _chunk_loop(num_chunks, sums, (zeros, zeros))

  r = [jax.lax.rsqrt(sq / width + eps) for sq in squares]
  logits = [r_i * c_i for r_i, c_i in zip(r, dots)]
  if masked:  # 0 or −inf: a traced mask (the scanned decoder's unwritten slots)
    logits = [l_i + bias_ref[i] for i, l_i in enumerate(logits)]
  top = functools.reduce(jnp.maximum, logits)
  exps = [jnp.exp(l_i - top) for l_i in logits]
  total = functools.reduce(jnp.add, exps)
  alpha = [e / total for e in exps]
  for i in range(num_sources):
    alpha_refs[i][...] = alpha[i]
    r_refs[i][...] = r[i]

  def mix(c, carry):  # the second read of each tile: L2 hits
    h = alpha[0][:, None] * load(s_refs[0], c)
    for a, ref in zip(alpha[1:], s_refs[1:]):
      h = h + a[:, None] * load(ref, c)
    h_ref[:, _columns(c, chunk)] = h.astype(h_ref.dtype)
    return carry

  _chunk_loop(num_chunks, mix, 0)


def _bwd_kernel(*refs, num_sources: int, width: int, chunk: int):
  """refs: S source blocks [bn, d], q [1, d], dh [bn, d], S alpha and S r blocks [bn], then
  S ds blocks [bn, d] and this program's dq partial sums [d] (fp32)."""
  n = num_sources
  s_refs, q_ref, dh_ref = refs[:n], refs[n], refs[n + 1]
  alpha_refs, r_refs = refs[n + 2:2 * n + 2], refs[2 * n + 2:3 * n + 2]
  ds_refs, dq_ref = refs[3 * n + 2:4 * n + 2], refs[4 * n + 2]
  num_chunks, load = width // chunk, _loader(chunk)

  def sums(c, carry):
    dots, d_alpha = carry
    col = _columns(c, chunk)
    q = q_ref[:, col].astype(jnp.float32)
    dh = load(dh_ref, c)
    tiles = [load(ref, c) for ref in s_refs]
    return (tuple(acc + jnp.sum(s * q, axis=1) for acc, s in zip(dots, tiles)),
            tuple(acc + jnp.sum(dh * s, axis=1) for acc, s in zip(d_alpha, tiles)))

  zeros = (jnp.zeros(alpha_refs[0].shape, jnp.float32),) * n
  dots, d_alpha = _chunk_loop(num_chunks, sums, (zeros, zeros))

  alpha = [ref[...] for ref in alpha_refs]
  r = [ref[...] for ref in r_refs]
  mean_d_alpha = functools.reduce(jnp.add, [a * da for a, da in zip(alpha, d_alpha)])
  d_logit = [a * (da - mean_d_alpha) for a, da in zip(alpha, d_alpha)]
  d_key = [dl * r_i for dl, r_i in zip(d_logit, r)]
  d_self = [dl * c * (r_i * r_i * r_i) / width for dl, c, r_i in zip(d_logit, dots, r)]

  def grads(c, carry):  # the second read of each tile: L2 hits
    col = _columns(c, chunk)
    q = q_ref[:, col].astype(jnp.float32)
    dh = load(dh_ref, c)
    dq = None
    for i in range(n):
      s = load(s_refs[i], c)
      ds = alpha[i][:, None] * dh + d_key[i][:, None] * q - d_self[i][:, None] * s
      ds_refs[i][:, col] = ds.astype(ds_refs[i].dtype)
      dq = d_key[i][:, None] * s if dq is None else dq + d_key[i][:, None] * s
    dq_ref[col] = jnp.sum(dq, axis=0)
    return carry

  _chunk_loop(num_chunks, grads, 0)


def _tiles(n: int, d: int, config: DepthMixConfig) -> tuple[int, int, int]:
  """(block_rows, channel chunk Dc, N padded to whole row tiles)."""
  bn = min(config.block_rows, pl.next_power_of_2(n))
  chunk = column_chunk(d, config.block_d)
  return bn, chunk, pl.cdiv(n, bn) * bn


def _launch(config: DepthMixConfig) -> dict:
  if config.interpret:
    return dict(interpret=True)
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=config.num_warps,
                                                       num_stages=config.num_stages))


def _rows(x: jax.Array, n_pad: int) -> jax.Array:
  """[..., d] -> [N_pad, d]: a free reshape, plus zero rows (a copy) only when N % block_rows."""
  x = x.reshape(-1, x.shape[-1])
  return x if x.shape[0] == n_pad else jnp.pad(x, ((0, n_pad - x.shape[0]), (0, 0)))


@kernel_entry_point("eps", "config")
def _forward(sources: tuple, query: jax.Array, valid: Optional[jax.Array], eps: float,
             config: DepthMixConfig) -> tuple[jax.Array, tuple, tuple]:
  """(h [..., d], alpha and r: S arrays [N_pad] fp32 each)."""
  shape, num_sources = sources[0].shape, len(sources)
  d = shape[-1]
  n = sources[0].size // d
  bn, chunk, n_pad = _tiles(n, d, config)
  inputs = [_rows(s, n_pad) for s in sources] + [query.reshape(1, d)]
  in_specs = [pl.BlockSpec((bn, d), lambda i: (i, 0))] * num_sources
  in_specs.append(pl.BlockSpec((1, d), lambda i: (0, 0)))
  if valid is not None:
    s_pad = pl.next_power_of_2(num_sources)
    bias = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
    inputs.append(jnp.pad(bias, (0, s_pad - num_sources)))
    in_specs.append(pl.BlockSpec((s_pad,), lambda i: (0,)))
  x = sources[0]
  h, *stats = pl.pallas_call(
      functools.partial(_fwd_kernel, num_sources=num_sources, width=d, chunk=chunk, eps=eps,
                        masked=valid is not None),
      grid=(n_pad // bn,),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((bn, d), lambda i: (i, 0))]
                + [pl.BlockSpec((bn,), lambda i: (i,))] * (2 * num_sources),
      out_shape=[result_like(x, (n_pad, d), x.dtype)]
                + [result_like(x, (n_pad,), jnp.float32)] * (2 * num_sources),
      name="depth_mix_fwd",
      **_launch(config),
  )(*inputs)
  return h[:n].reshape(shape), tuple(stats[:num_sources]), tuple(stats[num_sources:])


@kernel_entry_point("config")
def _backward(sources: tuple, query: jax.Array, alpha: tuple, r: tuple, dh: jax.Array,
              config: DepthMixConfig) -> tuple[tuple, jax.Array]:
  """(d_sources in the sources' dtype, d_query in the query's dtype)."""
  shape, num_sources = sources[0].shape, len(sources)
  d = shape[-1]
  n = sources[0].size // d
  bn, chunk, n_pad = _tiles(n, d, config)
  programs = n_pad // bn
  row_spec = pl.BlockSpec((bn, d), lambda i: (i, 0))
  stat_spec = pl.BlockSpec((bn,), lambda i: (i,))
  x = sources[0]
  *d_sources, dq_partial = pl.pallas_call(
      functools.partial(_bwd_kernel, num_sources=num_sources, width=d, chunk=chunk),
      grid=(programs,),
      in_specs=[row_spec] * num_sources + [pl.BlockSpec((1, d), lambda i: (0, 0)), row_spec]
               + [stat_spec] * (2 * num_sources),
      out_specs=[row_spec] * num_sources + [pl.BlockSpec((None, d), lambda i: (i, 0))],
      out_shape=[result_like(x, (n_pad, d), x.dtype)] * num_sources
                + [result_like(x, (programs, d), jnp.float32)],
      name="depth_mix_bwd",
      **_launch(config),
  )(*[_rows(s, n_pad) for s in sources], query.reshape(1, d), _rows(dh, n_pad), *alpha, *r)
  d_sources = tuple(ds[:n].reshape(shape) for ds in d_sources)
  return d_sources, jnp.sum(dq_partial, axis=0).astype(query.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _depth_mix_fused(sources, query, valid, eps, config):
  return _forward(sources, query, valid, eps, config)[0]


def _depth_mix_fused_fwd(sources, query, valid, eps, config):
  h, alpha, r = _forward(sources, query, valid, eps, config)
  return h, (sources, query, alpha, r)


def _depth_mix_fused_bwd(eps, config, residuals, dh):
  del eps   # inside the saved r
  sources, query, alpha, r = residuals
  d_sources, d_query = _backward(sources, query, alpha, r, dh.astype(sources[0].dtype), config)
  return d_sources, d_query, None


_depth_mix_fused.defvjp(_depth_mix_fused_fwd, _depth_mix_fused_bwd)


def depth_mix_fused(sources: Sequence[jax.Array], query: jax.Array, valid: Optional[jax.Array],
                    eps: float, config: DepthMixConfig = DepthMixConfig()) -> jax.Array:
  """h = Σ_i softmax_i(<RMSNorm(s_i), q>) s_i, differentiable, as `k3jax.layers.attnres.
  depth_mix` computes it (that function validates; this one only checks what the kernels need).

  Args:
    sources: non-empty sequence of [..., d] arrays of one shape and float dtype.
    query: [d], any float dtype. valid: None or [S] bool (False: left out of the softmax).
    eps: the RMS epsilon, inside the square root. config: tiles, launch, interpret.
  Returns:
    h [..., d] in the sources' dtype; gradients in the sources' and the query's dtypes.
  """
  sources = tuple(sources)
  if not sources or any(s.shape != sources[0].shape or s.dtype != sources[0].dtype
                        for s in sources):
    raise ValueError("depth_mix_fused: sources must be a non-empty sequence of arrays of one "
                     f"shape and dtype, got {[(s.shape, str(s.dtype)) for s in sources]}")
  if query.shape != sources[0].shape[-1:]:
    raise ValueError(f"depth_mix_fused: query must have shape {sources[0].shape[-1:]}, got "
                     f"{query.shape}")
  if valid is not None and valid.shape != (len(sources),):
    raise ValueError(f"depth_mix_fused: valid must have shape ({len(sources)},), got "
                     f"{valid.shape}")
  return _depth_mix_fused(sources, query, valid, float(eps), config)
