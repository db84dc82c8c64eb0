r"""The `evaluate` command: evaluate a run's checkpoint (params and balance biases only).

  python -m k3jax.evaluate --workdir=DIR [--step=N] [--seq_len=T]

(or `k3jax evaluate ...`). Prints the results and writes them to DIR/eval_step<N>_len<T>.json: one
file per checkpoint step and length, so an evaluation at another length keeps the others. The
run's config is read from DIR/config.gin (written by the train command). The library is
`k3jax.training.evaluation` (`evaluate_workdir`, `Evaluator`).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from absl import app, flags

from k3jax import cli
from k3jax import config as config_lib


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Run directory written by the train command.",
                      required=True)
  flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest).")
  flags.DEFINE_integer("seq_len", None,
                       "Training length for the evaluation (default: the checkpoint's stage).")
  cli.define_flags()
  for module in cli.SHARED_FLAG_MODULES:
    flags.adopt_module_key_flags(module)


def main(argv: Sequence[str]) -> None:
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  from k3jax.training import evaluation  # pylint: disable=import-outside-toplevel
  FLAGS = flags.FLAGS
  cli.start(argv)

  def run() -> int:
    for name in ("step", "seq_len"):
      value = FLAGS[name].value
      if value is not None and value < (0 if name == "step" else 1):
        raise config_lib.ConfigError(f"--{name}={value} is not allowed: an integer >= "
                                     f"{0 if name == 'step' else 1}, or leave it out")
    results = evaluation.evaluate_workdir(FLAGS.workdir, FLAGS.step, FLAGS.seq_len)
    print(f"evaluation of {FLAGS.workdir} at step {results['step']}:")
    print(evaluation.format_eval(results))
    path = os.path.join(FLAGS.workdir,
                        f"eval_step{results['step']}_len{results['seq_len']}.json")
    with open(path, "w") as f:
      json.dump(results, f, indent=2)
    print(f"written to {path}")
    return 0

  cli.finish(run, usage_errors=(FileNotFoundError, ValueError,
                                checkpoint_lib.CorruptCheckpointError))


if __name__ == "__main__":
  define_flags()
  app.run(main)
