"""Autoregressive decoding: prefill, one-token steps, sampling, and a small CLI.

The decode cache (collection 'cache') holds, per KDA layer, the recurrent state [B,H,K,V] fp32 and the
short-conv states; per MLA layer, the latent `c_kv` and the shared `k_rope` for every position (the
only per-token memory of the model) and the write index. AttnRes needs no cache: it mixes over depth.

  python -m k3jax.generate --gin_file=gin_configs/tiny.gin --prompt="def "      # fresh init
  python -m k3jax.generate --workdir=DIR --prompt="def "                        # from a checkpoint
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import compiler
from k3jax import config as config_lib
from k3jax import device_memory
from k3jax.data import make_tokenizer
from k3jax.model import K3Model, init_variables


def init_cache(cfg: config_lib.ModelConfig, batch_size: int, max_len: int) -> dict:
  """A zero decode cache for `batch_size` rows and up to `max_len` positions (no params built)."""
  shapes = jax.eval_shape(
      lambda: init_variables(cfg, jax.random.PRNGKey(0), batch_size, max_len, decode=True))
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def decode_forward(cfg: config_lib.ModelConfig, variables: dict, cache: dict,
                   tokens: jax.Array) -> tuple[jax.Array, dict]:
  """Runs `tokens` [B,T] (T>1: prefill, T=1: step) against the cache.

  Returns (logits [B,T,vocab] fp32, the updated cache).
  """
  logits, mutated = K3Model(cfg).apply({**variables, "cache": cache}, tokens, decode=True,
                                       mutable=["cache"])
  return logits, mutated["cache"]


decode_forward = compiler.lazy_jit(decode_forward, static_argnums=0)


def sample_token(rng: jax.Array, logits: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """logits [B,vocab] -> token ids [B] int32; temperature 0 is greedy."""
  if temperature <= 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(cfg: config_lib.ModelConfig, variables: dict, prompt: jax.Array, max_new_tokens: int,
             rng: jax.Array, *, temperature: float = 1.0, top_k: int = 0) -> jax.Array:
  """Samples `max_new_tokens` after `prompt` [B,P] int32; returns [B, P+max_new_tokens] int32.

  `variables` holds 'params' and 'moe_state' (the QB bias is frozen at inference).
  """
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must have shape [B, P] with P >= 1, got {prompt.shape}")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
  batch, plen = prompt.shape
  variables = {k: v for k, v in variables.items() if k != "cache"}
  cache = init_cache(cfg, batch, plen + max_new_tokens)
  logits, cache = decode_forward(cfg, variables, cache, prompt)
  out = [prompt]
  next_logits = logits[:, -1]
  for _ in range(max_new_tokens):
    rng, sub = jax.random.split(rng)
    token = sample_token(sub, next_logits, temperature, top_k)
    out.append(token[:, None])
    logits, cache = decode_forward(cfg, variables, cache, token[:, None])
    next_logits = logits[:, -1]
  return jnp.concatenate(out, axis=1)


FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "gin config files (fresh, randomly initialised model).")
flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, e.g. 'ModelConfig.d_model=128'.")
flags.DEFINE_string("workdir", None, "a training run's directory: restore its latest checkpoint.")
flags.DEFINE_integer("step", None, "checkpoint step to restore (default: latest).")
flags.DEFINE_string("prompt", "def fibonacci(n):", "the prompt text.")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to sample.")
flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "sample among the top-k tokens (0: all).")
flags.DEFINE_integer("seed", 0, "sampling seed.")
compiler.define_compilation_cache_flag()
device_memory.define_flag()


def restore_for_inference(workdir: str, step: Optional[int] = None
                          ) -> tuple[config_lib.Config, dict, int]:
  """(config, {'params', 'moe_state'}, step) of a k3jax.train run directory (params only)."""
  from k3jax import checkpoint as checkpoint_lib
  cfg, params, moe_state, meta = checkpoint_lib.restore_run(workdir, step)
  return cfg, {"params": params, "moe_state": moe_state}, int(meta["step"])


def _check_flags(argv_flags) -> None:
  """ConfigError naming the flag for values that would otherwise be replaced or ignored."""
  if argv_flags.workdir and (argv_flags.gin_file or argv_flags.gin_bindings):
    raise config_lib.ConfigError(
        "--workdir restores a run with its own config.gin; --gin_file/--gin_bindings would be "
        "ignored: pass one or the other")
  if argv_flags.step is not None and not argv_flags.workdir:
    raise config_lib.ConfigError("--step needs --workdir (a fresh model has no steps)")
  if argv_flags.max_new_tokens < 1:
    raise config_lib.ConfigError(
        f"--max_new_tokens={argv_flags.max_new_tokens} is not allowed: an integer >= 1")
  if not argv_flags.temperature >= 0:
    raise config_lib.ConfigError(
        f"--temperature={argv_flags.temperature} is not allowed: >= 0 (0 is greedy)")
  if argv_flags.top_k < 0:
    raise config_lib.ConfigError(f"--top_k={argv_flags.top_k} is not allowed: >= 0 (0: all)")


def _load(argv_flags) -> tuple[config_lib.Config, dict, str]:
  _check_flags(argv_flags)
  if argv_flags.workdir:
    cfg, variables, step = restore_for_inference(argv_flags.workdir, argv_flags.step)
    return cfg, variables, f"checkpoint step {step} of {argv_flags.workdir}"
  if not argv_flags.gin_file:
    raise config_lib.ConfigError("pass --gin_file=... (fresh model) or --workdir=... (checkpoint)")
  cfg = config_lib.from_gin(argv_flags.gin_file, argv_flags.gin_bindings)
  # One compiled program: eagerly, every initialiser is dispatched (and compiled) on its own.
  init = jax.jit(lambda rng: init_variables(cfg.model, rng, 1, 8))
  variables = init(jax.random.PRNGKey(cfg.seed))
  return cfg, variables, "a randomly initialised model (train one with k3jax.train)"


def main(argv):
  del argv
  from k3jax import checkpoint as checkpoint_lib
  checkpoint_lib.quiet_logging()
  try:
    device_memory.apply_flag()   # before anything touches a device
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  compiler.enable_compilation_cache(FLAGS.compilation_cache_dir)
  try:
    cfg, variables, source = _load(FLAGS)
  except (config_lib.ConfigError, FileNotFoundError, ValueError,
          checkpoint_lib.CorruptCheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  tokenizer = make_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
  import flax.linen as nn
  variables = nn.meta.unbox(variables)
  from k3jax.model import count_params
  total, active = count_params(cfg.model)
  print(f"weights: {source}")
  print(f"k3jax model: {total:,} parameters ({active:,} active per token), "
        f"{cfg.model.num_layers} layers: " +
        " ".join(cfg.model.layer_kind(i) for i in range(cfg.model.num_layers)))
  ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(FLAGS.prompt)]).astype(np.int32)
  prompt = jnp.asarray(ids)[None, :]
  t0 = time.perf_counter()
  out = generate(cfg.model, variables, prompt, FLAGS.max_new_tokens, jax.random.PRNGKey(FLAGS.seed),
                 temperature=FLAGS.temperature, top_k=FLAGS.top_k)
  out = np.asarray(jax.device_get(out))
  dt = time.perf_counter() - t0
  text = tokenizer.decode(out[0, len(ids):])
  print(f"prompt: {FLAGS.prompt!r}")
  print(f"sample: {text!r}")
  print(f"{FLAGS.max_new_tokens} tokens in {dt:.2f}s (including compilation)")


if __name__ == "__main__":
  app.run(main)
