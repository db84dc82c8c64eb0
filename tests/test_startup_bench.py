"""experiments/benchmarks/startup_bench.py: lowering the GPU program on the CPU host."""

from k3jax import train as train_lib
from testlib import TINY_RUN_BINDINGS, load_benchmark


def test_lowering_for_cuda_on_a_cpu_host():
  """For CUDA on a CPU host: the initialisation and the step are traced and lowered (with the CPU
  machine's kernel choices, see the benchmark's docstring), nothing compiles. (The compile branch
  runs on the GPU: RESULTS.md.)"""
  bench = load_benchmark("startup_bench")
  cfg = train_lib.config_from_flags([], TINY_RUN_BINDINGS)
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
  assert [init["phase"], step["phase"]] == ["init", "step"]
  assert "compile_s" not in init and "compile_s" not in step and step["lower_s"] > 0
