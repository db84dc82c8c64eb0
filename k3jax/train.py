r"""The `train` command: train (or resume) a run in a working directory.

  python -m k3jax.train --gin_file=gin_configs/tiny.gin --workdir=DIR \
      [--gin_bindings='ModelConfig.d_model = 64'] [--max_steps=N] [--mesh=data:2,expert:4] [--peak_tflops=989]
      [--init_from=RUN]

(or `k3jax train ...`). Running the same command again resumes from the latest checkpoint; one
training process at a time may use a --workdir (its lock). Exit codes: 0 done (or stopped at
--max_steps), 2 a bad setting or a --workdir in use (one line naming it), 1 a failed run (a
non-finite loss, out of device memory), 3 the filesystem refused a write (no space left, no
permission; the last complete checkpoint is untouched), 128 + N stopped by signal N after saving.
The library function is `k3jax.training.train`.
"""

from __future__ import annotations

from typing import Sequence

from absl import app, flags

from k3jax import cli
from k3jax import config as config_lib
from k3jax.parallel import distributed
from k3jax.runtime import Runtime
from k3jax.training import run_dir


def define_flags() -> None:
  cli.define_config_flags()
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, plots).",
                      required=True)
  flags.DEFINE_integer("max_steps", None, "Stop after this global step (with a checkpoint).")
  flags.DEFINE_string("mesh", "", "Device mesh, e.g. 'data:2,expert:4' (sets MeshConfig.axes).")
  flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0 (else from "
                      "JAX_COORDINATOR_ADDRESS / SLURM / Open MPI; see README).")
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
  flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per device for the MFU estimate "
                     "(0: a default by backend).")
  flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
  flags.DEFINE_bool("tensorboard", True, "Write TensorBoard events to DIR/tb.")
  flags.DEFINE_string("init_from", None, "Start a new run from the newest checkpoint of this run "
                      "directory (a training run, or a model imported by `k3jax convert "
                      "--from_hf`): its parameters, a new optimizer state.")
  flags.DEFINE_bool("take_over_lock", False, "Take the run directory's lock from a run on "
                    "another host that is known to be gone (a dead run on this host is detected "
                    "by itself).")
  cli.define_flags()
  for module in cli.SHARED_FLAG_MODULES:
    flags.adopt_module_key_flags(module)


def main(argv: Sequence[str]) -> None:
  from k3jax import training  # pylint: disable=import-outside-toplevel
  FLAGS = flags.FLAGS
  cache_folder = cli.start(argv)
  run_dir.quiet_refused_writes()
  distributed.maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)

  def run() -> int:
    cfg = cli.config_from_flags(FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.mesh)
    if FLAGS.max_steps is not None and FLAGS.max_steps < 0:
      raise config_lib.ConfigError(f"--max_steps = {FLAGS.max_steps} is not allowed: an integer "
                                   ">= 0")
    runtime = Runtime.for_run(cfg, cache_folder)
    result = training.train(cfg, FLAGS.workdir, max_steps=FLAGS.max_steps,
                            peak_tflops=FLAGS.peak_tflops, progress=FLAGS.progress,
                            tensorboard=FLAGS.tensorboard, runtime=runtime,
                            take_over_lock=FLAGS.take_over_lock, init_from=FLAGS.init_from)
    return 0 if result.stopped_by_signal is None else 128 + result.stopped_by_signal

  cli.finish(run, failures=(training.NonFiniteLossError, training.StageOutOfMemoryError),
             write_errors=(training.RunWriteError,))


if __name__ == "__main__":
  define_flags()
  app.run(main)
