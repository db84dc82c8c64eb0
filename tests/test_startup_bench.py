"""experiments/benchmarks/startup_bench.py: lowering the GPU program on the CPU host."""

from k3jax import train as train_lib
from k3jax.ops import kda as kda_ops
from testlib import TINY_RUN_BINDINGS, load_benchmark


def test_lowering_for_cuda_on_a_cpu_host():
  """For CUDA the compiled (not interpreted) Pallas KDA kernels lower to Triton on this host;
  nothing compiles. (The compile branch runs on the GPU: RESULTS.md.)"""
  bench = load_benchmark("startup_bench")
  cfg = train_lib.config_from_flags([], TINY_RUN_BINDINGS)
  load = kda_ops._load_pallas_chunk_kda
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
  assert [init["phase"], step["phase"]] == ["init", "step"]
  assert "compile_s" not in init and "compile_s" not in step and step["lower_s"] > 0
  assert kda_ops._load_pallas_chunk_kda is load        # the override is undone
