"""Autoregressive decoding: prefill, one-token steps, sampling (the `generate` command's library).

The decode cache (collection 'cache') holds, per KDA layer, the recurrent state [B,H,K,V] fp32 and
the short-conv states; per MLA layer, the latent `c_kv` and the shared `k_rope` for every position (the
only per-token memory of the model) and the write index. AttnRes needs no cache: it mixes over depth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.config import ImplConfig, ModelConfig
from k3jax.model.decoder import K3Model
from k3jax.model.params import init_variables


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int,
               impl: ImplConfig = ImplConfig()) -> dict:
  """A zero decode cache for `batch_size` rows and up to `max_len` positions (no params built), in
  the layout of `impl.scan_layers`."""
  shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), batch_size, max_len,
                                                 impl=impl, decode=True))
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def decode_forward(cfg: ModelConfig, impl: ImplConfig, variables: dict, cache: dict,
                   tokens: jax.Array) -> tuple[jax.Array, dict]:
  """Runs `tokens` [B,T] (T>1: prefill, T=1: step) against the cache.

  Returns (logits [B,T,vocab] fp32, the updated cache).
  """
  logits, mutated = K3Model(cfg, impl).apply({**variables, "cache": cache}, tokens, decode=True,
                                             mutable=["cache"])
  return logits, mutated["cache"]


def sample_token(rng: jax.Array, logits: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """logits [B,vocab] -> token ids [B] int32; temperature 0 is greedy."""
  if temperature <= 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(cfg: ModelConfig, variables: dict, prompt: jax.Array, max_new_tokens: int,
             rng: jax.Array, *, impl: ImplConfig = ImplConfig(), temperature: float = 1.0,
             top_k: int = 0) -> jax.Array:
  """Samples `max_new_tokens` after `prompt` [B,P] int32; returns [B, P+max_new_tokens] int32.

  `variables` holds 'params' and 'moe_state' (the QB bias is frozen at inference), in the layout
  of `impl.scan_layers`.
  """
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must have shape [B, P] with P >= 1, got {prompt.shape}")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
  batch, plen = prompt.shape
  variables = {k: v for k, v in variables.items() if k != "cache"}
  cache = init_cache(cfg, batch, plen + max_new_tokens, impl)
  logits, cache = decode_forward(cfg, impl, variables, cache, prompt)
  out = [prompt]
  next_logits = logits[:, -1]
  for _ in range(max_new_tokens):
    rng, sub = jax.random.split(rng)
    token = sample_token(sub, next_logits, temperature, top_k)
    out.append(token[:, None])
    logits, cache = decode_forward(cfg, impl, variables, cache, token[:, None])
    next_logits = logits[:, -1]
  return jnp.concatenate(out, axis=1)
