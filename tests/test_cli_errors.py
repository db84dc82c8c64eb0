"""Every user error of the CLIs is one line on stderr and exit code 2 (no traceback), and the
CLIs print no orbax INFO lines nor false warnings. Each case runs the real command in a process of
its own: the configuration errors and the tool's usage in one forked from a server that imported
the commands once (`testlib.run_command_forked`); the rest in a fresh interpreter, among them
usage errors through both `python -m k3jax.<command>` and `python -m k3jax`
(test_changed_model_in_existing_workdir_is_one_line, test_tool_runs_the_commands_usage_errors), so
that what a fresh launch prints before its error stays checked.

Cases that fail at configuration time need no training; those that need a trained run directory
share one tiny run (`trained`, made once per module through the CLI with --max_steps).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from testlib import TINY_RUN_BINDINGS, run_command_forked

# absl's INFO line prefix: 'I1201 22:09:30.981569 140708937063296 file.py:596] ...'.
ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d", re.MULTILINE)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [f"--gin_bindings={b}" for b in TINY_RUN_BINDINGS + [
    "EvalConfig.num_batches = 1", "EvalConfig.passkey_multipliers = ()",
    "EvalConfig.passkey_samples = 1", "EvalConfig.every_steps = 0"]]


def run(module: str, *args: str, timeout: int = 600,
        forked: bool = False) -> subprocess.CompletedProcess:
  """`python -m k3jax.MODULE ARGS`; forked: from the command server (module docstring)."""
  return _launch(f"k3jax.{module}", args, timeout, forked)


def run_tool(*args: str, timeout: int = 600, forked: bool = False) -> subprocess.CompletedProcess:
  """`python -m k3jax ARGS`: the `k3jax` tool (k3jax.cli.main)."""
  return _launch("k3jax", args, timeout, forked)


def _launch(module: str, args, timeout: int, forked: bool) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  if forked:
    return run_command_forked(module, args, env, REPO, timeout=timeout)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess, message: str) -> None:
  """Exit code 2 and stderr exactly one line, 'error: ...' containing `message`."""
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  assert message in lines[0], (message, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  (root / "bad.gin").write_text("ModelConfig.num_layers = 2\nModelConfig.d_model = \n")
  (root / "a_file").write_text("not a directory")
  (root / "small_corpus").mkdir()
  (root / "small_corpus" / "a.txt").write_text("hello world\n")   # 12 bytes
  return root


# (module, arguments with {root} for the files above, the message's distinctive part)
CONFIG_TIME_CASES = [
    ("train", ["--gin_bindings=ModelConfig.d_model = ", "--workdir={root}/w"],
     "gin binding 'ModelConfig.d_model =': Unable to parse value"),
    ("train", ["--gin_file={root}/bad.gin", "--workdir={root}/w"],
     "gin file {root}/bad.gin, line 2: Unable to parse value"),
    ("train", ["--gin_file={root}/missing.gin", "--workdir={root}/w"],
     "gin file '{root}/missing.gin' does not exist"),
    ("train", ["--workdir={root}/a_file"], "--workdir={root}/a_file is a file"),
    ("train", ["--workdir={root}/a_file/run"], "--workdir={root}/a_file/run cannot be created"),
    ("train", ["--max_steps=-1", "--workdir={root}/w"], "--max_steps = -1 is not allowed"),
    ("train", ["--gin_bindings=DataConfig.source = 'text'",
               "--gin_bindings=DataConfig.path = '{root}/small_corpus'", "--workdir={root}/w"],
     "the train split of DataConfig.source = 'text', path = '{root}/small_corpus' has 12 tokens"),
    ("generate", ["--gin_file=gin_configs/tiny.gin", "--max_new_tokens=-3"],
     "--max_new_tokens=-3 is not allowed"),
    ("generate", ["--gin_file=gin_configs/tiny.gin", "--temperature=-1"],
     "--temperature=-1.0 is not allowed"),
    ("generate", ["--gin_file=gin_configs/tiny.gin", "--workdir={root}/w"],
     "pass one or the other"),
    ("generate", ["--gin_file=gin_configs/tiny.gin", "--step=3"], "--step needs --workdir"),
    ("evaluate", ["--workdir={root}/w", "--seq_len=0"], "--seq_len=0 is not allowed"),
    ("evaluate", ["--workdir={root}/nothing"], "has no config.gin"),
    ("train", ["--device_memory_fraction=1.5", "--workdir={root}/w"],
     "--device_memory_fraction=1.5 is not allowed: a fraction in (0, 1]"),
    ("evaluate", ["--workdir={root}/w", "--device_memory_fraction=0"],
     "--device_memory_fraction=0.0 is not allowed"),
    ("generate", ["--gin_file=gin_configs/tiny.gin", "--device_memory_fraction=-1"],
     "--device_memory_fraction=-1.0 is not allowed"),
    ("train", ["--gin_bindings=ModelConfig.scan_layers = False", "--workdir={root}/w"],
     "ModelConfig.scan_layers has moved: set ImplConfig.scan_layers instead"),
    ("generate", ["--gin_file=gin_configs/tiny.gin",
                  "--gin_bindings=StagesConfig.microbatch_loop = 'host'"],
     "StagesConfig.microbatch_loop has moved: set RuntimeConfig.microbatch_loop instead"),
    ("plan", ["--gin_file=gin_configs/tiny.gin", "--mesh=data:2,model:4"],
     "--mesh='data:2,model:4': bad entry 'model:4'"),
    ("plan", ["--gin_file=gin_configs/tiny.gin", "--mesh=data:3"],
     "--mesh='data:3': stage 0 (seq_len 16) runs micro-batches of 256 rows"),
    ("plan", ["--gin_file=gin_configs/tiny.gin", "--device_memory_gib=-1"],
     "--device_memory_gib=-1.0 is not allowed: a positive number of GiB"),
    ("compare", ["--out={root}/out"], "no run directories given: expected one or more"),
    ("compare", ["{root}/small_corpus", "--out={root}/out"],
     "{root}/small_corpus has no metrics.jsonl: expected a run directory written by `k3jax "
     "train`"),
    ("compare", ["{root}/small_corpus", "{root}/w", "--labels=one", "--out={root}/out"],
     "--labels has 1 label for 2 run directories"),
    ("compare", ["{root}/small_corpus", "--out={root}/a_file"],
     "--out={root}/a_file is a file, not a directory"),
]


@pytest.mark.parametrize("module, args, message", CONFIG_TIME_CASES,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CONFIG_TIME_CASES)])
def test_config_time_error(files, module, args, message):
  fill = lambda s: s.replace("{root}", str(files))
  assert_user_error(run(module, *map(fill, args), forked=True), fill(message))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny run stopped by --max_steps=2, through the CLI."""
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  proc = run("train", *TINY, f"--workdir={workdir}", "--max_steps=2", "--noprogress")
  assert proc.returncode == 0, (proc.stdout, proc.stderr)
  return workdir, proc


@pytest.mark.slow
def test_max_steps_stop_writes_eval_and_plots_and_rerun_says_finished(trained):
  workdir, proc = trained
  assert "stopped at step 2 of 6 (--max_steps); eval.json and plots/ written" in proc.stdout
  with open(os.path.join(workdir, "eval.json")) as f:
    assert json.load(f)["final"]["step"] == 2
  assert os.path.getsize(os.path.join(workdir, "plots", "loss.png")) > 1000
  again = run("train", *TINY, f"--workdir={workdir}", "--max_steps=2", "--noprogress")
  assert again.returncode == 0, again.stderr
  assert "already at step 2 (--max_steps=2); to continue, re-run with a larger --max_steps" \
      in again.stdout


@pytest.mark.slow
def test_changed_model_in_existing_workdir_is_one_line(trained):
  workdir, _ = trained
  proc = run("train", *TINY, "--gin_bindings=ModelConfig.d_model = 48", f"--workdir={workdir}",
             "--noprogress")
  assert_user_error(proc, "holds a run whose checkpoints do not fit this config")
  assert "params/embedding: stored float32[257, 32], expected float32[257, 48]" in proc.stderr
  assert "Changed settings: ModelConfig.d_model: 32 -> 48" in proc.stderr
  assert "Use a new --workdir" in proc.stderr


@pytest.mark.slow
def test_restoring_commands_are_quiet(trained):
  """No orbax INFO lines and no 'Given directory is read only' (the reader writes nothing, but
  orbax's read_only option said so); --verbosity=0 brings INFO back."""
  workdir, _ = trained
  gen = run("generate", f"--workdir={workdir}", "--max_new_tokens=2")
  assert gen.returncode == 0, gen.stderr
  assert not ABSL_INFO.search(gen.stderr) and "read only" not in gen.stderr, gen.stderr
  assert "checkpoint step 2 of" in gen.stdout
  ev = run("evaluate", f"--workdir={workdir}")
  assert ev.returncode == 0, ev.stderr
  assert not ABSL_INFO.search(ev.stderr) and "read only" not in ev.stderr, ev.stderr
  verbose = run("generate", f"--workdir={workdir}", "--max_new_tokens=2", "--verbosity=0")
  assert ABSL_INFO.search(verbose.stderr), verbose.stderr


COMMANDS = ("train", "evaluate", "generate", "convert", "plan", "compare")


def test_tool_help_lists_the_commands():
  proc = run_tool("--help", forked=True)
  assert proc.returncode == 0, (proc.stdout, proc.stderr)
  listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
  assert listed == list(COMMANDS), proc.stdout
  # Without a command: the same list, as a usage error.
  bare = run_tool(forked=True)
  assert bare.returncode == 2 and bare.stdout == proc.stdout, (bare.returncode, bare.stdout)


def test_tool_unknown_command_is_a_usage_error():
  proc = run_tool("nope", "--workdir=x", forked=True)
  assert_user_error(proc, "unknown command 'nope': one of train, evaluate, generate")


def test_tool_command_help_lists_the_command_flags():
  """The tool's usage says so: `k3jax <command> --help` lists a command's flags, its own and the
  shared ones, as `python -m k3jax.<command> --help` does."""
  module = run("generate", "--help", forked=True)
  proc = run_tool("generate", "--help", forked=True)
  assert proc.returncode == 0, (proc.stdout, proc.stderr)
  for flag in ("--max_new_tokens", "--gin_file", "--compilation_cache_dir",
               "--device_memory_fraction"):
    assert flag in module.stdout, module.stdout
    assert flag in proc.stdout, proc.stdout


def test_tool_runs_the_commands_usage_errors():
  """Errors of the command the tool runs are the command's own: one line, exit code 2."""
  assert_user_error(run_tool("generate", "--gin_file=gin_configs/tiny.gin", "--max_new_tokens=-3"),
                    "--max_new_tokens=-3 is not allowed")
  assert_user_error(run_tool("evaluate", "--workdir=/nonexistent/run"), "has no config.gin")
  # compare's run directories are positional arguments, passed on by the tool.
  assert_user_error(run_tool("compare", "/nonexistent/run"), "--out is missing")


@pytest.mark.slow
def test_tool_generate_runs_like_the_module():
  """`python -m k3jax generate ...` runs the generate command (a fresh tiny model, one token;
  `python -m k3jax.generate` itself runs in test_compiler)."""
  args = ["--gin_file=gin_configs/tiny.gin", *[f"--gin_bindings={b}" for b in TINY_RUN_BINDINGS],
          "--max_new_tokens=1"]
  # A long prompt over several lines: shown by its two ends, as text, not echoed whole.
  prompt = "first line\n" + "x" * 1200 + "\nlast line"
  tool = run_tool("generate", *args, f"--prompt={prompt}")
  assert tool.returncode == 0, (tool.stdout, tool.stderr)
  assert "weights: a randomly initialised model" in tool.stdout
  assert "prompt (1,221 characters; the first and last 200 shown" in tool.stdout
  assert "\nfirst line\n" in tool.stdout and tool.stdout.count("x") < 500, tool.stdout
  assert "sample (1 token," in tool.stdout
