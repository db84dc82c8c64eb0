"""The command line: the commands' shared prologue and the `k3jax` tool.

    k3jax train --gin_file=gin_configs/tiny.gin --workdir=runs/tiny
    k3jax evaluate --workdir=runs/tiny [--step=N] [--seq_len=T]
    k3jax generate --workdir=runs/tiny --prompt="def "
    k3jax convert --from_hf=DIR --workdir=runs/kimi_linear
    k3jax plan --gin_file=gin_configs/k3.gin --mesh=data:8,expert:8 --device_memory_gib=141
    k3jax compare runs/a runs/b --out=runs/compare

`k3jax <command> ...` is `python -m k3jax.<command> ...` (k3jax/train.py, evaluate.py,
generate.py). Every command that runs the model starts the same way (`start`): extra arguments
are refused, orbax's INFO logging is quietened, the GPU allocator's share is set
(--device_memory_fraction) before anything touches a device, and JAX's persistent compilation
cache is turned on (--compilation_cache_dir); `compare` reads files only, and its arguments are
run directories. Every command ends the same way (`finish`): exit code 0, 2 for a bad
setting or input (one line on stderr naming it), 1 for a failed run, 3 when the filesystem
refused a write (no space left, no permission: one line naming the path), 128 + N after signal N.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Callable, NoReturn, Sequence

from absl import flags, logging

from k3jax import config as config_lib
from k3jax.runtime import compiler, device_memory, precompile

COMMANDS = {"train": "train a model through the staged curriculum (k3jax/train.py)",
            "evaluate": "evaluate a run's checkpoint (k3jax/evaluate.py)",
            "generate": "sample text from a run's checkpoint or a fresh model (k3jax/generate.py)",
            "convert": "a Hugging Face model folder to a run directory and back "
                       "(k3jax/convert/command.py)",
            "plan": "each curriculum stage's memory on one device of a mesh "
                    "(k3jax/plan/command.py)",
            "compare": "several runs overlaid in one figure and one summary table "
                       "(k3jax/compare/command.py)"}
# The module of each command (`define_flags`, `main`), when not k3jax.<command>.
COMMAND_MODULES = {"convert": "k3jax.convert.command", "plan": "k3jax.plan.command",
                   "compare": "k3jax.compare.command"}
# Where the commands' shared flags are defined.
SHARED_FLAG_MODULES = (sys.modules[__name__], compiler, device_memory)
# Exit codes.
USAGE_ERROR = 2
RUN_FAILED = 1
WRITE_REFUSED = 3


def define_flags() -> None:
  """The flags every command has: --compilation_cache_dir and --device_memory_fraction. The
  command's `define_flags` then adopts the flags of SHARED_FLAG_MODULES, so that its --help lists
  them (absl lists the key flags of the module that runs)."""
  compiler.define_compilation_cache_flag()
  device_memory.define_flag()


def define_config_flags(fresh_model_help: str = "") -> None:
  """--gin_file and --gin_bindings (train; generate's fresh model)."""
  flags.DEFINE_multi_string("gin_file", [], "Gin config files, applied in order." +
                            fresh_model_help)
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings applied after the files, e.g. "
                            "'ModelConfig.d_model = 128'.")


def start(argv: Sequence[str]) -> str:
  """The commands' prologue (module docstring). Returns the compilation cache folder ('' when
  the cache is off). Exits with USAGE_ERROR, one line on stderr, for stray arguments or a bad
  --device_memory_fraction."""
  if len(argv) > 1:
    _usage_error(f"unexpected arguments {list(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    # orbax logs every save and restore at INFO; absl's --verbosity / -v asks for more.
    logging.set_verbosity(logging.WARNING)
  try:
    device_memory.apply_flag()
  except ValueError as e:
    _usage_error(str(e))
  return compiler.enable_compilation_cache(flags.FLAGS.compilation_cache_dir)


def config_from_flags(gin_files: Sequence[str], gin_bindings: Sequence[str], mesh: str = ""
                      ) -> config_lib.Config:
  """`config.from_gin` over the files and bindings; a --mesh becomes `MeshConfig.axes`."""
  bindings = list(gin_bindings)
  if mesh:
    bindings.append(f"MeshConfig.axes = {mesh!r}")
  return config_lib.from_gin(gin_files, bindings)


def finish(body: Callable[[], int], usage_errors: tuple = (), failures: tuple = (),
           write_errors: tuple = ()) -> NoReturn:
  """Runs the command's `body` and exits with its code; `usage_errors` (and ConfigError) exit
  with USAGE_ERROR, `failures` with RUN_FAILED and `write_errors` (the filesystem refused a
  write) with WRITE_REFUSED, each as one line on stderr. Any other error is raised as a
  traceback, or printed and exited with RUN_FAILED while a background compile is inside XLA (the
  interpreter must not be finalised under it: `precompile.exit_process`)."""
  try:
    code = body()
  except (config_lib.ConfigError,) + tuple(usage_errors) as e:
    print(f"error: {e}", file=sys.stderr)
    precompile.exit_process(USAGE_ERROR)
  except tuple(failures) as e:
    print(f"error: {e}", file=sys.stderr)
    precompile.exit_process(RUN_FAILED)
  except tuple(write_errors) as e:
    print(f"error: {e}", file=sys.stderr)
    # At once: orbax's and TensorBoard's threads would report the same refused writes again
    # while the interpreter shuts down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(WRITE_REFUSED)
  except Exception:  # pylint: disable=broad-except
    if not precompile.background_work_running():
      raise
    traceback.print_exc()
    precompile.exit_process(RUN_FAILED)
  precompile.exit_process(code)


def _usage_error(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def main(argv: Sequence[str] | None = None) -> None:
  """The `k3jax` console script: `k3jax <command> [flags]`."""
  argv = list(sys.argv if argv is None else argv)
  usage = "usage: k3jax <command> [--flags]; commands:\n" + "\n".join(
      f"  {name:<9} {text}" for name, text in COMMANDS.items()) + \
      "\n`k3jax <command> --help` lists a command's flags."
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage)
    sys.exit(0 if len(argv) >= 2 else USAGE_ERROR)
  name = argv[1]
  if name not in COMMANDS:
    _usage_error(f"unknown command {name!r}: one of {', '.join(COMMANDS)} (k3jax --help)")
  from absl import app  # pylint: disable=import-outside-toplevel
  command = importlib.import_module(COMMAND_MODULES.get(name, f"k3jax.{name}"))
  command.define_flags()
  if any(arg in ("-h", "--help", "-?", "--helpshort") for arg in argv[2:]):
    # absl's --help lists the flags of the __main__ module, and the command's are not there.
    modules = [command.__name__, __name__, compiler.__name__, device_memory.__name__]
    defined = flags.FLAGS.flags_by_module_dict()
    print((command.__doc__ or "").strip() + "\n\nflags:\n" + "\n".join(
        flags.FLAGS.module_help(m) for m in modules if m in defined))
    sys.exit(0)
  app.run(command.main, argv=[f"k3jax {name}"] + argv[2:])
