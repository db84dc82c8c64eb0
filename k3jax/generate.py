r"""The `generate` command: sample text from a run's checkpoint, or from a fresh model.

  python -m k3jax.generate --workdir=DIR --prompt="def "                          # a checkpoint
  python -m k3jax.generate --gin_file=gin_configs/tiny.gin --prompt="def "        # fresh init

(or `k3jax generate ...`). The decoding library is `k3jax.model.decode`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from absl import app, flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import cli
from k3jax import config as config_lib


# A prompt longer than this is shown by its two ends: a long document given as the prompt would
# otherwise bury the sample.
PROMPT_SHOWN_CHARS = 400


def describe_prompt(prompt: str, echo: bool = False, shown: int = PROMPT_SHOWN_CHARS) -> str:
  """The prompt as printed: a header line, then the text as text (not a repr). Longer than
  `shown` characters and not `echo`: only its first and last shown // 2 characters, with the
  number of characters left out between them."""
  if echo or len(prompt) <= shown:
    return f"prompt:\n{prompt}"
  half = shown // 2
  return (f"prompt ({len(prompt):,} characters; the first and last {half} shown, --echo_prompt "
          f"prints it whole):\n{prompt[:half]}\n[... {len(prompt) - 2 * half:,} characters "
          f"...]\n{prompt[-half:]}")


def define_flags() -> None:
  cli.define_config_flags(" For a fresh, randomly initialised model (without --workdir).")
  flags.DEFINE_string("workdir", None, "A training run's directory: restore its latest checkpoint.")
  flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
  flags.DEFINE_string("prompt", "def fibonacci(n):", "The prompt text.")
  flags.DEFINE_boolean("echo_prompt", False,
                       f"Print the whole prompt; by default a prompt longer than "
                       f"{PROMPT_SHOWN_CHARS} characters is shown by its first and last "
                       f"{PROMPT_SHOWN_CHARS // 2}.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to sample.")
  flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
  flags.DEFINE_integer("top_k", 0, "Sample among the top-k tokens (0: all).")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  cli.define_flags()
  for module in cli.SHARED_FLAG_MODULES:
    flags.adopt_module_key_flags(module)


def restore_for_inference(workdir: str, step: Optional[int] = None
                          ) -> tuple[config_lib.Config, dict, int]:
  """(config, {'params', 'moe_state'}, step) of a training run directory (params only)."""
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  cfg, params, moe_state, meta = checkpoint_lib.restore_run(workdir, step)
  return cfg, {"params": params, "moe_state": moe_state}, int(meta["step"])


def check_flags(values) -> None:
  """ConfigError naming the flag for values that would otherwise be replaced or ignored."""
  if values.workdir and (values.gin_file or values.gin_bindings):
    raise config_lib.ConfigError(
        "--workdir restores a run with its own config.gin; --gin_file/--gin_bindings would be "
        "ignored: pass one or the other")
  if values.step is not None and not values.workdir:
    raise config_lib.ConfigError("--step needs --workdir (a fresh model has no steps)")
  if values.max_new_tokens < 1:
    raise config_lib.ConfigError(
        f"--max_new_tokens={values.max_new_tokens} is not allowed: an integer >= 1")
  if not values.temperature >= 0:
    raise config_lib.ConfigError(
        f"--temperature={values.temperature} is not allowed: >= 0 (0 is greedy)")
  if values.top_k < 0:
    raise config_lib.ConfigError(f"--top_k={values.top_k} is not allowed: >= 0 (0: all)")


def load(values) -> tuple[config_lib.Config, dict, str]:
  """(config, variables, where they come from) for the flag values."""
  from k3jax.model import init_variables  # pylint: disable=import-outside-toplevel
  check_flags(values)
  if values.workdir:
    cfg, variables, step = restore_for_inference(values.workdir, values.step)
    return cfg, variables, f"checkpoint step {step} of {values.workdir}"
  if not values.gin_file:
    raise config_lib.ConfigError("pass --gin_file=... (fresh model) or --workdir=... (checkpoint)")
  cfg = config_lib.from_gin(values.gin_file, values.gin_bindings)
  # One compiled program: eagerly, every initialiser is dispatched (and compiled) on its own.
  init = jax.jit(lambda rng: init_variables(cfg.model, rng, 1, 8, impl=cfg.impl))
  variables = init(jax.random.PRNGKey(cfg.seed))
  return cfg, variables, "a randomly initialised model (train one with the train command)"


def main(argv: Sequence[str]) -> None:
  from k3jax.data import make_tokenizer  # pylint: disable=import-outside-toplevel
  from k3jax.model import count_params  # pylint: disable=import-outside-toplevel
  from k3jax.model.decode import generate  # pylint: disable=import-outside-toplevel
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  FLAGS = flags.FLAGS
  cli.start(argv)

  def run() -> int:
    cfg, variables, source = load(FLAGS)
    tokenizer = make_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    variables = nn.meta.unbox(variables)
    total, active = count_params(cfg.model)
    print(f"weights: {source}")
    print(f"k3jax model: {total:,} parameters ({active:,} active per token), "
          f"{cfg.model.num_layers} layers: " +
          " ".join(cfg.model.layer_kind(i) for i in range(cfg.model.num_layers)))
    ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(FLAGS.prompt)]).astype(np.int32)
    prompt = jnp.asarray(ids)[None, :]
    t0 = time.perf_counter()
    out = generate(cfg.model, variables, prompt, FLAGS.max_new_tokens,
                   jax.random.PRNGKey(FLAGS.seed), impl=cfg.impl,
                   temperature=FLAGS.temperature, top_k=FLAGS.top_k)
    out = np.asarray(jax.device_get(out))
    dt = time.perf_counter() - t0
    text = tokenizer.decode(out[0, len(ids):])
    print(describe_prompt(FLAGS.prompt, FLAGS.echo_prompt))
    unit = "token" if FLAGS.max_new_tokens == 1 else "tokens"
    print(f"sample ({FLAGS.max_new_tokens} {unit}, {dt:.2f}s including compilation):")
    print(text)
    return 0

  cli.finish(run, usage_errors=(FileNotFoundError, ValueError,
                                checkpoint_lib.CorruptCheckpointError))


if __name__ == "__main__":
  define_flags()
  app.run(main)
