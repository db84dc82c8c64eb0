"""Block Attention Residuals (AttnRes): softmax attention over depth instead of a residual sum.

The mixer (ARCHITECTURE.md §3), one per sublayer, each with its own pseudo-query w ∈ R^d:

    h = Σ_i α_i s_i,   α = softmax_i( w · RMSNorm(s_i) )

over the sources s_i ∈ {b_0, …, b_{n−1}, p}: keys are RMS-normalised without a learned scale, values
are the raw sources, there is no 1/√d, and the mix runs in fp32. w starts at zero, so at step 0 the
mix is the uniform mean of the sources.

How the decoder wires it (k3jax/model.py). `block_size` counts layers; each layer has two sublayers
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
  residual network's norm(x) up to the norm's epsilon: at initialisation AttnRes *is* a PreNorm network.
* K3: 93 layers, block_size 12 → boundaries 0, 12, …, 84 (8 frozen blocks); the final mix sees
  those 8 plus the 9-layer tail's partial.
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers import common


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


class DepthMix(nn.Module):
  """h = Σ_i softmax_i(w · RMSNorm(s_i)) s_i over a list of same-shaped sources.

  Attributes:
    config: model config (d_model via the sources' width, norm_eps, param_dtype).
  Parameter: 'query' [d] ('norm',), initialised to zero.
  Call: sources, a non-empty sequence of [B, T, d] arrays of one dtype → h [B, T, d] in that dtype;
  valid (optional), [len(sources)] bool: False leaves a source out of the softmax (the decoder's
  scan keeps frozen blocks in fixed slots, some not yet written). At least one must be valid.
  The scores and the weighted sum are computed in fp32.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, sources: Sequence[jax.Array], valid: Optional[jax.Array] = None
               ) -> jax.Array:
    if len(sources) == 0:
      raise ValueError("DepthMix: sources must be a non-empty sequence of [B, T, d] arrays")
    shape, dtype = sources[0].shape, sources[0].dtype
    for i, s in enumerate(sources):
      if s.shape != shape or s.dtype != dtype:
        raise ValueError(f"DepthMix: source {i} is {s.shape} {s.dtype}, but source 0 is "
                         f"{shape} {dtype}; all sources must match")
    query = common.logical_param(self, "query", (shape[-1],), ("norm",), nn.initializers.zeros,
                                 common.to_dtype(self.config.param_dtype))
    values = jnp.stack([s.astype(jnp.float32) for s in sources], axis=0)   # [S, ..., d]
    keys = common.rms_norm(values, self.config.norm_eps)
    logits = jnp.einsum("s...d,d->s...", keys, query.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    if valid is not None:
      if valid.shape != (len(sources),):
        raise ValueError(f"DepthMix: valid must have shape [{len(sources)}], got {valid.shape}")
      logits = jnp.where(valid.reshape((-1,) + (1,) * (logits.ndim - 1)), logits, -jnp.inf)
    alpha = jax.nn.softmax(logits, axis=0)
    return jnp.einsum("s...,s...d->...d", alpha, values,
                      precision=jax.lax.Precision.HIGHEST).astype(dtype)
