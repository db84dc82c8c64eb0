r"""Where a training run's start-up goes: initialisation and training step, traced, lowered, compiled.

For a config (gin files + bindings) and a batch shape, prints one JSON line per phase:

  init   total_s: `training.init_train_state` on this machine's backend (trace, compile and run of
         the state: parameters, optimizer state, balance biases); then its main part,
         `model.init_variables`, phase by phase: trace_s, lower_s, compile_s, fusions
         (top-level fusions of the optimised HLO, a proxy for the code the backend generates);
  step   the training step of `training.make_train_step`: trace_s (Python tracing to a jaxpr),
         lower_s (jaxpr -> StableHLO, where the Pallas kernels become Triton IR), compile_s, and
         temp_gib from the compiled step's memory analysis; for a host-loop step
         (RuntimeConfig.microbatch_loop = 'host', small.gin's and medium.gin's) trace_lower_s,
         its programs traced and lowered together.

--platform=cuda on a machine without a GPU lowers for CUDA and stops there (compile times need the
target device), but with the CPU machine's kernel choices: 'auto' picks the XLA KDA, the XLA
attention and the tiled grouped matmul there, because the GPU's Pallas (Triton) and Mosaic kernels
need a GPU device to lower ('No supported GPU devices found' with
ImplConfig.kda_backend = 'pallas'). Its trace and lower times are the host work of that program,
not of the GPU's (run 14: small.gin's step 4.3 s traced + 1.8 s lowered on a CPU machine, 15-20 s
on the GPU machine, of which ~4 s lowering Mosaic kernels). The start line gives the decoder's
layer plan (`k3jax.model.layer_plan`: scanned groups, period, unrolled layers); compare the scan
with the unrolled loop through --gin_bindings='ImplConfig.scan_layers = True' (or False).

  PYTHONPATH=. python experiments/benchmarks/startup_bench.py --gin_file=gin_configs/small.gin \
      --seq_len=2048 --batch=16 [--platform=cuda]
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

from k3jax import cli
from k3jax import training as train_lib
from k3jax.model import K3Model, init_variables, layer_plan


def emit(**row):
  print(json.dumps(row), flush=True)


def _fusions(compiled) -> int:
  return len(re.findall(r"^\s*\S+ = \S+ fusion\(", compiled.as_text(), re.M))


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, round(time.perf_counter() - t0, 2)


def measure(cfg, batch: int, seq_len: int, platform: str) -> list[dict]:
  """The rows described in the module docstring, for `cfg` at [batch, seq_len] tokens."""
  compile_here = platform == jax.default_backend() or (platform == "cuda" and
                                                       jax.default_backend() == "gpu")
  lowering = {} if compile_here else {"lowering_platforms": (platform,)}
  return _measure(cfg, batch, seq_len, compile_here, lowering)


def _measure(cfg, batch, seq_len, compile_here, lowering):
  rows = []
  (state, optimizer, schedule), total_s = _timed(
      lambda: jax.block_until_ready(train_lib.init_train_state(cfg, 100)))
  # Its main part, the parameter initialisation, again through the AOT path, phase by phase.
  init_jit = jax.jit(init_variables, static_argnums=(0, 2, 3), static_argnames=("impl",))
  traced, trace_s = _timed(lambda: init_jit.trace(cfg.model, jax.random.PRNGKey(0), 1,
                                                  cfg.stages.stages[0][0], impl=cfg.impl))
  lowered, lower_s = _timed(lambda: traced.lower(**lowering))
  row = dict(phase="init", total_s=total_s, trace_s=trace_s, lower_s=lower_s)
  if compile_here:
    compiled, row["compile_s"] = _timed(lowered.compile)
    row["fusions"] = _fusions(compiled)
  rows.append(row)

  step = train_lib.make_train_step(cfg, K3Model(cfg.model, cfg.impl), optimizer, schedule)
  spec = lambda dtype: jax.ShapeDtypeStruct((batch, seq_len), dtype)
  batch_spec = {"inputs": spec(jnp.int32), "targets": spec(jnp.int32),
                "segment_ids": spec(jnp.int32), "loss_mask": spec(jnp.float32)}
  row = dict(phase="step", batch=batch, seq_len=seq_len)
  if hasattr(step, "trace"):
    traced, row["trace_s"] = _timed(lambda: step.trace(state, batch_spec))
    lowered, row["lower_s"] = _timed(lambda: traced.lower(**lowering))
  else:
    # RuntimeConfig.microbatch_loop = 'host' (`k3jax.runtime.host_loop.HostLoopStep`): its
    # programs are traced and lowered together, for the default backend only.
    if lowering:
      raise SystemExit("startup_bench: --platform needs RuntimeConfig.microbatch_loop = 'scan' "
                       "(the host loop's step lowers for the default backend only)")
    lowered, row["trace_lower_s"] = _timed(lambda: step.lower(state, batch_spec))
  if compile_here:
    compiled, row["compile_s"] = _timed(lowered.compile)
    memory = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else None
    row["temp_gib"] = None if memory is None else round(memory.temp_size_in_bytes / 2**30, 2)
  rows.append(row)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--platform", default=None,
                 help="lower for this platform ('cpu', 'cuda'); default: the default backend")
  args = p.parse_args(argv)
  cfg = cli.config_from_flags(args.gin_file or ["gin_configs/small.gin"], args.gin_bindings)
  platform = args.platform or jax.default_backend()
  plan = layer_plan(cfg.model, cfg.impl.scan_layers)
  emit(event="start", backend=jax.default_backend(), platform=platform, jax=jax.__version__,
       gin_files=args.gin_file, bindings=args.gin_bindings, num_layers=cfg.model.num_layers,
       scan_groups=plan.num_groups, scan_period=plan.period,
       unrolled_layers=len(plan.prefix) + len(plan.suffix))
  for row in measure(cfg, args.batch, args.seq_len, platform):
    emit(event="result", **row)


if __name__ == "__main__":
  main()
