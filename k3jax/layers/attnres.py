"""Block Attention Residuals (AttnRes): softmax attention over depth instead of a residual sum.

The mixer (docs/architecture.md §3), one per sublayer, each with its own pseudo-query w ∈ R^d:

    h = Σ_i α_i s_i,   α = softmax_i( w · RMSNorm(s_i) )

over the sources s_i ∈ {b_0, …, b_{n−1}, p}: keys are RMS-normalised without a learned scale, values
are the raw sources, there is no 1/√d, and the mix runs in fp32. w starts at zero, so at step 0 the
mix is the uniform mean of the sources.

How the decoder wires it (k3jax/model/decoder.py). `block_size` counts layers; each layer has two sublayers
(attention, then FFN/MoE), each with its own DepthMix:

    blocks  = []                 # frozen block representations b_0, b_1, …
    partial = embedding          # the running sum of the current block
    for layer i in 0 … L−1:
      if i in attnres_block_boundaries(L, block_size):      # i = 0, bs, 2·bs, …
        blocks.append(partial); partial = None               # freeze; the new block starts EMPTY
      for sublayer f in (attention_i, ffn_i):
        h = DepthMix_f(blocks + ([partial] if partial is not None else []))
        out = f(norm_f(h))                                   # the sublayer reads norm(h)
        partial = out if partial is None else partial + out  # outputs go to the partial, not to h
    h = DepthMix_final(blocks + [partial]); logits = head(final_norm(h))

Notes on that wiring:
* The embedding is b_0: it is frozen at layer 0 (the first boundary), exactly like K3's released
  code, which starts with no slots and freezes the embedding as slot 0 at layer 0.
* "Restarted at zero" means restarted *empty*: right after a boundary the partial is not a source (a
  zero source would still take softmax weight and dilute the mix). So the first sublayer of a block
  mixes only the frozen blocks, and the mix at layer 0's attention is the embedding itself.
* With all queries zero, h is the mean of the sources, i.e. (embedding + every sublayer output so
  far) divided by the number of sources. RMSNorm ignores the scale, so norm(h) equals the PreNorm
  residual network's norm(x) up to the norm's epsilon: at initialisation AttnRes *is* a PreNorm
  network.
* K3: 93 layers, block_size 12 → boundaries 0, 12, …, 84 (8 frozen blocks); the final mix sees
  those 8 plus the 9-layer tail's partial.

Memory: `depth_mix` carries a hand-written VJP whose residuals are the sources themselves (alive
anyway, in their own dtype) plus the [S, B, T] fp32 weights α and RMS scales r. Plain autodiff of
the stacked formulation would instead save fp32 [S, B, T, d] copies of the values and keys at every
mix, which dominated the training step's memory peak.

Kernels (ImplConfig.attnres_kernel): 'xla' runs that VJP as XLA's fusions,
which read each source from HBM about twice per direction; 'pallas' runs the same math as one
Pallas kernel forward and one backward (pallas_kernels/depth_mix) that read each source once.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.parallel import sharding
from k3jax.config import ImplConfig, ModelConfig
from k3jax.layers import common
from k3jax.ops.kernel_choice import pallas_or_xla
from pallas_kernels.depth_mix import DepthMixConfig, depth_mix_fused


def attnres_block_boundaries(num_layers: int, block_size: int) -> tuple[int, ...]:
  """0-based layer indices at which the partial sum is frozen into a new block: 0, bs, 2·bs, …

  Layer 0's boundary freezes the embedding as b_0. The number of frozen blocks is
  len(result) = ceil(num_layers / block_size); the final mix has one more source (the last partial).
  """
  if not (isinstance(num_layers, int) and num_layers > 0):
    raise ValueError(f"attnres_block_boundaries: num_layers={num_layers!r} must be a positive int")
  if not (isinstance(block_size, int) and block_size > 0):
    raise ValueError(f"attnres_block_boundaries: block_size={block_size!r} must be a positive int")
  return tuple(range(0, num_layers, block_size))


def _check_sources(sources: Sequence[jax.Array], valid: Optional[jax.Array], who: str) -> None:
  """Raises ValueError (prefixed with `who`) unless the sources are non-empty, of one shape and
  dtype, and `valid` is None or a [len(sources)] bool array."""
  if len(sources) == 0:
    raise ValueError(f"{who}: sources must be a non-empty sequence of [B, T, d] arrays")
  shape, dtype = sources[0].shape, sources[0].dtype
  for i, s in enumerate(sources):
    if s.shape != shape or s.dtype != dtype:
      raise ValueError(f"{who}: source {i} is {s.shape} {s.dtype}, but source 0 is "
                       f"{shape} {dtype}; all sources must match")
  if valid is not None:
    if valid.shape != (len(sources),):
      raise ValueError(f"{who}: valid must have shape [{len(sources)}], got {valid.shape}")
    if valid.dtype != jnp.bool_:
      raise ValueError(f"{who}: valid must be a bool array, got {valid.dtype}")


def _lead(x: jax.Array, ndim: int) -> jax.Array:
  """x [...] → x [..., 1, …] with ndim − x.ndim trailing unit axes (broadcast over d)."""
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _scales_and_dots(sources: tuple, q32: jax.Array, eps: float
                     ) -> tuple[jax.Array, jax.Array]:
  """Per source, r_i = 1/sqrt(mean_d s_i² + eps) and c_i = <s_i, q>, both fp32 [S, B, T].

  One source at a time: the fp32 upcast of s_i lives only inside the fused reductions.
  """
  r, c = [], []
  for s in sources:
    s32 = s.astype(jnp.float32)
    r.append(jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1) + eps))
    c.append(jnp.sum(s32 * q32, axis=-1))
  return jnp.stack(r), jnp.stack(c)


def _depth_mix_fwd(sources: tuple, query: jax.Array, valid: Optional[jax.Array], eps: float
                   ) -> tuple[jax.Array, tuple]:
  r, c = _scales_and_dots(sources, query.astype(jnp.float32), eps)
  logits = r * c                                                          # = <RMSNorm(s_i), q>
  if valid is not None:
    logits = jnp.where(_lead(valid, logits.ndim), logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)                                  # [S, B, T] fp32
  ndim = sources[0].ndim
  h = sum(_lead(alpha[i], ndim) * s.astype(jnp.float32) for i, s in enumerate(sources))
  return h.astype(sources[0].dtype), (sources, query, alpha, r)


def _depth_mix_bwd(eps: float, residuals: tuple, dh: jax.Array) -> tuple:
  """The VJP of h = Σ_i α_i s_i, α = softmax_i(l_i), l_i = r_i c_i, r_i = (mean_d s_i² + eps)^-½,
  c_i = <s_i, q> (d = width):

    dα_i = <dh, s_i>;   dl_i = α_i (dα_i − Σ_j α_j dα_j)      (softmax's VJP)
    ∂r_i/∂s_i = −r_i³ s_i / d                                    (eps inside the sqrt, mean over d)
    ds_i = α_i dh + dl_i (r_i q − c_i r_i³ s_i / d);   dq = Σ_{i,b,t} dl_i r_i s_i.

  A masked source has α_i = 0, hence dl_i = 0 and ds_i = 0, as under the stacked formulation.
  """
  sources, query, alpha, r = residuals
  q32 = query.astype(jnp.float32)
  dh32 = dh.astype(jnp.float32)
  ndim, width = sources[0].ndim, sources[0].shape[-1]
  d_alpha, c = [], []
  for s in sources:
    s32 = s.astype(jnp.float32)
    d_alpha.append(jnp.sum(dh32 * s32, axis=-1))
    c.append(jnp.sum(s32 * q32, axis=-1))
  d_alpha, c = jnp.stack(d_alpha), jnp.stack(c)                           # [S, B, T] fp32
  d_logit = alpha * (d_alpha - jnp.sum(alpha * d_alpha, axis=0))
  d_key = d_logit * r                                                     # dl_i ∂l_i/∂(r_i s_i)
  d_self = d_logit * c * r**3 / width                                     # dl_i c_i r_i³ / d
  d_sources = tuple(
      (_lead(alpha[i], ndim) * dh32 + _lead(d_key[i], ndim) * q32
       - _lead(d_self[i], ndim) * s.astype(jnp.float32)).astype(s.dtype)
      for i, s in enumerate(sources))
  batch_axes = tuple(range(ndim - 1))
  d_query = sum(jnp.sum(_lead(d_key[i], ndim) * s.astype(jnp.float32), axis=batch_axes)
                for i, s in enumerate(sources))
  return d_sources, d_query.astype(query.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _depth_mix(sources: tuple, query: jax.Array, valid: Optional[jax.Array], eps: float
               ) -> jax.Array:
  return _depth_mix_fwd(sources, query, valid, eps)[0]


_depth_mix.defvjp(_depth_mix_fwd, _depth_mix_bwd)


def _pallas_depth_mix(sources: tuple, query: jax.Array, valid: Optional[jax.Array], eps: float
                      ) -> jax.Array:
  config = DepthMixConfig(interpret=jax.default_backend() == "cpu")
  if sources[0].ndim < 2:   # one row: no batch axis to split
    return depth_mix_fused(sources, query, valid, eps, config)
  # The kernels are opaque to XLA's partitioner (under a mesh it would gather every row onto every
  # device): each device mixes its own rows, the query's gradient summed over devices.
  def local(query, valid, *sources):
    return depth_mix_fused(sources, query, valid, eps, config)
  return sharding.map_over_batch_shards(local, *sources, shared=(query, valid))


def depth_mix(sources: Sequence[jax.Array], query: jax.Array, valid: Optional[jax.Array],
              eps: float, kernel: str = "xla") -> jax.Array:
  """h = Σ_i softmax_i(<RMSNorm(s_i), q>) s_i, in fp32, with a memory-lean hand-written VJP.

  Args:
    sources: non-empty sequence of [B, T, d] arrays (any leading axes) of one shape and dtype.
    query: [d] pseudo-query, any float dtype (upcast to fp32).
    valid: None, or [len(sources)] bool: False leaves a source out of the softmax (logit −inf).
      At least one source must be valid (else h is NaN, as softmax over nothing).
    eps: RMSNorm epsilon, inside the square root (k3jax.layers.common.rms_norm).
    kernel: 'xla' (the custom VJP above, XLA's fusions), 'pallas' (`pallas_kernels.depth_mix.
      depth_mix_fused`: one kernel forward and one backward; interpreted on CPU) or 'auto'
      (`k3jax.ops.kernel_choice.pallas_or_xla`): the same math and dtypes, and residuals of the
      same size.
  Returns:
    h [B, T, d] in the sources' dtype. Gradients: sources in their dtype, query in its dtype;
    valid gets none. The backward keeps only the sources, α and r ([S, B, T] fp32) from the forward.
  """
  _check_sources(sources, valid, "depth_mix")
  if query.shape != (sources[0].shape[-1],):
    raise ValueError(f"depth_mix: query must have shape [{sources[0].shape[-1]}] (the sources' "
                     f"width), got {query.shape}")
  if pallas_or_xla(kernel, "ImplConfig.attnres_kernel") == "pallas":
    return _pallas_depth_mix(tuple(sources), query, valid, float(eps))
  return _depth_mix(tuple(sources), query, valid, float(eps))


class DepthMix(nn.Module):
  """h = Σ_i softmax_i(w · RMSNorm(s_i)) s_i over a list of same-shaped sources.

  Attributes:
    config: model config (d_model via the sources' width, norm_eps, param_dtype).
    impl: ImplConfig (attnres_kernel).
  Parameters: 'query' [d] ('norm',), initialised to zero; with `attnres_key_norm_gain`, also
  'key_norm_gain' [d] ('norm',), initialised to one: the keys' RMSNorm gain g, as K3's release
  stores it (`*_res_norm.weight` beside the query `*_res_proj.weight`). The scores are then
  <g ⊙ RMSNorm(s_i), q> = <RMSNorm(s_i), g ⊙ q>: the same function class with a product
  parameterisation, whose training dynamics differ; the mix runs with the folded query g ⊙ q.
  Call: sources, a non-empty sequence of [B, T, d] arrays of one dtype → h [B, T, d] in that dtype;
  valid (optional), [len(sources)] bool: False leaves a source out of the softmax (the decoder's
  scan keeps frozen blocks in fixed slots, some not yet written). At least one must be valid.
  The scores and the weighted sum are computed in fp32 (by `depth_mix`).
  """
  config: ModelConfig
  impl: ImplConfig = ImplConfig()

  @nn.compact
  def __call__(self, sources: Sequence[jax.Array], valid: Optional[jax.Array] = None
               ) -> jax.Array:
    _check_sources(sources, valid, "DepthMix")
    width = sources[0].shape[-1]
    param_dtype = common.to_dtype(self.config.param_dtype)
    query = common.logical_param(self, "query", (width,), ("norm",), nn.initializers.zeros,
                                 param_dtype)
    if self.config.attnres_key_norm_gain:
      gain = common.logical_param(self, "key_norm_gain", (width,), ("norm",),
                                  nn.initializers.ones, param_dtype)
      query = query.astype(jnp.float32) * gain.astype(jnp.float32)
    return depth_mix(sources, query, valid, self.config.norm_eps,
                     kernel=self.impl.attnres_kernel)
