"""experiments/benchmarks/startup_bench.py: phases measured on CPU, and lowering for CUDA here."""

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


def test_phases_on_cpu_and_lowering_for_cuda():
  bench = _load()
  cfg = train_lib.config_from_flags([], TINY_RUN_BINDINGS)
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cpu")
  assert init["phase"] == "init" and init["compile_s"] > 0 and init["fusions"] > 0
  assert step["phase"] == "step" and step["compile_s"] > 0 and step["temp_gib"] is not None
  # For CUDA the compiled Pallas KDA kernels lower to Triton on this host; nothing compiles.
  load = kda_ops._load_pallas_chunk_kda
  init, step = bench.measure(cfg, batch=2, seq_len=32, platform="cuda")
  assert "compile_s" not in init and "compile_s" not in step and step["lower_s"] > 0
  assert kda_ops._load_pallas_chunk_kda is load        # the override is undone
