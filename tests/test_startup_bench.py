"""experiments/benchmarks/startup_bench.py: lowering the GPU program on the CPU host."""

import importlib.util
import os

from k3jax import train as train_lib
from k3jax.ops import kda as kda_ops
from testlib import TINY_RUN_BINDINGS

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                     "benchmarks", "startup_bench.py")


def _load():
  spec = importlib.util.spec_from_file_location("startup_bench", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_lowering_for_cuda_on_a_cpu_host():
  """For CUDA the compiled (not interpreted) Pallas KDA kernels lower to Triton on this host;
  nothing compiles. (The compile branch runs on the GPU: RESULTS.md.)"""
  bench = _load()
  cfg = train_lib.config_from_flags([], TINY_RUN_BINDINGS)
  load = kda_ops._load_pallas_chunk_kda
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
  assert [init["phase"], step["phase"]] == ["init", "step"]
  assert "compile_s" not in init and "compile_s" not in step and step["lower_s"] > 0
  assert kda_ops._load_pallas_chunk_kda is load        # the override is undone
