"""experiments/benchmarks/startup_bench.py: lowering the GPU program on the CPU host."""

import pytest

from k3jax.cli import config_from_flags
from testlib import TINY_RUN_BINDINGS, load_benchmark


def test_lowering_for_cuda_on_a_cpu_host():
  """For CUDA on a CPU host: the initialisation and the step are traced and lowered (with the CPU
  machine's kernel choices, see the benchmark's docstring), nothing compiles. (The compile branch
  runs on the GPU: RESULTS.md.)"""
  bench = load_benchmark("startup_bench")
  cfg = config_from_flags([], TINY_RUN_BINDINGS)
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
  assert [init["phase"], step["phase"]] == ["init", "step"]
  assert "compile_s" not in init and "compile_s" not in step and step["lower_s"] > 0


def test_a_host_loop_step_is_lowered_and_compiled_as_one():
  """RuntimeConfig.microbatch_loop = 'host' (small.gin's and medium.gin's): the step's programs are
  traced and lowered together (trace_lower_s) and compiled on this host; --platform=cuda is
  refused with the setting named."""
  bench = load_benchmark("startup_bench")
  cfg = config_from_flags([], TINY_RUN_BINDINGS + ["RuntimeConfig.microbatch_loop = 'host'"])
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cpu")
  assert step["trace_lower_s"] > 0 and step["compile_s"] > 0 and "trace_s" not in step
  with pytest.raises(SystemExit, match="microbatch_loop"):
    bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
