r"""Training-step throughput of a K3 config on one device vs an expert-parallel mesh, same global batch.

For each layout in --layouts ('single' = one device, no mesh; otherwise a mesh spec such as
'expert:2' or 'data:2,expert:4'), the script builds the real training step of `k3jax.training`
(`init_train_state` + `make_train_step`, with the state and batch shardings of
`k3jax.parallel.sharding` and the MoE's all_to_all expert-parallel path inside the mesh), runs it
on random tokens of shape [--batch, --seq_len] (the global batch, identical for every layout),
and prints one JSON line:

  lower_s, compile_s, temp_gib
                 tracing and XLA compilation times of the step, and the compiled step's
                 temporary memory (`memory_analysis`), also printed as a 'progress' line as soon
                 as they are known, followed by one with the first step's time;
  tokens_per_s   global tokens / median step time (after --warmup steps, over --steps steps);
  step_ms        median step time;
  comm           per-step device time of collective ops, from a profile of --profile_steps steps
                 (jax.profiler trace read back with jax.profiler.ProfileData): 'all-to-all' (the
                 MoE's token exchange), 'all-reduce' (gradients, QB histograms), others; summed
                 over the ops of the first device and divided by the measured step time, which
                 gives the share of step time spent in each (collectives that overlap compute
                 count fully, so this is an upper bound on what removing them would save);
  loss           first and last losses of the timed steps (the run trains: the loss must fall).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/benchmarks/ep_bench.py \
      --gin_file=gin_configs/small.gin --layouts=single,expert:2,data:2 --seq_len=8192 --batch=8

Random tokens are enough for timing (the shapes and the routing work are the same as on text;
QB keeps the expert loads balanced either way).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import cli  # noqa: E402
from k3jax import training as train_lib  # noqa: E402
from k3jax.parallel import sharding as sharding_lib  # noqa: E402
from k3jax.model import K3Model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_times  # noqa: E402  (experiments/benchmarks is not a package)

# HLO op names of collectives, as they appear in profiles ('all-to-all.3', 'all-reduce-start.1').
_COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter",
                "collective-permute")


def emit(**row):
  print(json.dumps(row), flush=True)


def collective_kind(op_name: str):
  """'all-to-all' for 'all-to-all.12' / 'all-to-all-start.3', None for non-collective ops."""
  base = op_name.split(".")[0]
  base = re.sub(r"-(start|done)$", "", base)
  return base if base in _COLLECTIVES else None


def _nccl_kind(kernel_name: str):
  """Collective kind of an NCCL kernel name ('ncclDevKernel_AllReduce_Sum_f32_RING_LL' ->
  'all-reduce'); NCCL runs all-to-all as grouped send/receive ('SendRecv')."""
  name = kernel_name.lower()
  if "nccl" not in name:
    return None
  for key, kind in (("alltoall", "all-to-all"), ("sendrecv", "all-to-all"),
                    ("allreduce", "all-reduce"), ("allgather", "all-gather"),
                    ("reducescatter", "reduce-scatter")):
    if key in name:
      return kind
  return "nccl-other"


def collective_time_from_profile(logdir: str, device_index: int = 0) -> dict:
  """Total device time (ms) per collective kind in one trace directory, for one device.

  Reads the XSpace written by `jax.profiler.trace`. On GPU the device plane ('/device:GPU:i')
  has an 'XLA Ops' line with one event per executed HLO op ('all-to-all.3', 'all-reduce-start.1';
  for async collectives the '-start' and '-done' events are both summed), and stream lines with
  the CUDA kernels. Kinds come from the 'XLA Ops' line when it has collectives, else from the
  NCCL kernels on the stream lines ('source' says which). Returns {} when there is no device
  plane (e.g. on CPU, where ops run on host threads).
  """
  lines = trace_times.device_line_times(logdir, device_index)
  if lines is None:
    return {}
  by_op: dict = collections.defaultdict(float)
  by_kernel: dict = collections.defaultdict(float)
  for name, ns in lines.get("XLA Ops", {}).items():
    kind = collective_kind(name)
    if kind is not None:
      by_op[kind] += ns / 1e6
  for name, ns in trace_times.stream_kernel_times(lines).items():
    kind = _nccl_kind(name)
    if kind is not None:
      by_kernel[kind] += ns / 1e6
  if by_op:
    return dict(by_op, source="XLA Ops")
  return dict(by_kernel, source="NCCL kernels")


def run_layout(cfg, layout: str, batch: int, seq_len: int, steps: int, warmup: int,
               profile_steps: int, seed: int = 0) -> dict:
  model = K3Model(cfg.model, cfg.impl)
  mesh = None if layout == "single" else sharding_lib.make_mesh(layout)
  state, optimizer, schedule = train_lib.init_train_state(cfg, total_steps=10_000, mesh=mesh)
  rng = np.random.default_rng(seed)
  host_batches = []
  for _ in range(4):
    tokens = rng.integers(0, cfg.model.vocab_size, size=(batch, seq_len + 1), dtype=np.int32)
    host_batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                         "segment_ids": np.ones((batch, seq_len), np.int32),
                         "loss_mask": np.ones((batch, seq_len), np.float32)})
  if mesh is None:
    step_fn = train_lib.make_train_step(cfg, model, optimizer, schedule)
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in host_batches]
  else:
    step_fn = train_lib.make_train_step(cfg, model, optimizer, schedule,
                                        state_shardings=jax.tree.map(lambda x: x.sharding, state),
                                        batch_shardings=sharding_lib.batch_sharding(mesh))
    batches = [sharding_lib.shard_batch(b, mesh) for b in host_batches]

  # Trace and compile ahead of time, timed apart: a progress line says where start-up time goes
  # even when the layout then runs out of time or memory.
  t0 = time.perf_counter()
  with contextlib.nullcontext() if mesh is None else sharding_lib.with_mesh(mesh):
    lowered = step_fn.lower(state, batches[0])
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  memory = compiled.memory_analysis()
  temp_gib = None if memory is None else round(memory.temp_size_in_bytes / 2**30, 2)
  emit(event="progress", layout=layout, lower_s=round(lower_s, 1), compile_s=round(compile_s, 1),
       temp_gib=temp_gib)

  def one(state, i):
    return compiled(state, batches[i % len(batches)])

  t0 = time.perf_counter()
  state, m = one(state, 0)
  jax.block_until_ready(m)
  emit(event="progress", layout=layout, first_step_s=round(time.perf_counter() - t0, 2))
  for i in range(1, warmup):
    state, m = one(state, i)
  jax.block_until_ready(m)
  times, losses = [], []
  for i in range(steps):
    t0 = time.perf_counter()
    state, m = one(state, i)
    loss = float(m["loss"])  # blocks on the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
  step_s = statistics.median(times)
  comm = {}
  if profile_steps:
    logdir = tempfile.mkdtemp(prefix="ep_bench_trace_")
    with jax.profiler.trace(logdir):
      for i in range(profile_steps):
        state, m = one(state, i)
      jax.block_until_ready(m)
    found = collective_time_from_profile(logdir)
    source = found.pop("source", None)
    comm = {k: {"ms_per_step": round(v / profile_steps, 3),
                "share": round(v / profile_steps / (step_s * 1e3), 4)}
            for k, v in sorted(found.items())}
    if source:
      comm["source"] = source
  n_dev = 1 if mesh is None else mesh.devices.size
  micro = batch // cfg.stages.microbatch_rows(seq_len, batch)
  return dict(layout=layout, devices=n_dev, batch=batch, seq_len=seq_len, microbatches=micro,
              tokens_per_step=batch * seq_len, lower_s=round(lower_s, 1),
              compile_s=round(compile_s, 1), temp_gib=temp_gib,
              step_ms=round(step_s * 1e3, 2), tokens_per_s=round(batch * seq_len / step_s),
              tokens_per_s_per_device=round(batch * seq_len / step_s / n_dev),
              comm=comm, loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
              peak_gib=_peak_gib())


def _peak_gib():
  try:
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    return [round(s.get("peak_bytes_in_use", 0) / 2**30, 2) for s in stats]
  except Exception:  # CPU devices have no allocator stats
    return None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--layouts", default="single,expert:2",
                 help="comma-separated; 'single' or mesh specs joined by ';' e.g. "
                      "'single;data:2,expert:4' (use ';' when a spec has commas)")
  p.add_argument("--seq_len", type=int, default=8192)
  p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--profile_steps", type=int, default=3)
  p.add_argument("--layout_timeout", type=int, default=300,
                 help="seconds per layout; each layout runs in its own process, so that an "
                      "out-of-memory or a stuck collective in one cannot take the others down")
  p.add_argument("--in_process", action="store_true",
                 help="run the layouts in this process (used for the per-layout children)")
  args = p.parse_args(argv)
  gin_files = args.gin_file or ["gin_configs/small.gin"]
  layouts = args.layouts.split(";") if ";" in args.layouts else args.layouts.split(",")
  if not args.in_process:
    return _run_children(argv if argv is not None else sys.argv[1:], layouts, args.layout_timeout)
  cfg = cli.config_from_flags(gin_files, args.gin_bindings)
  emit(event="start", backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
       jax=jax.__version__, gin_files=gin_files, bindings=args.gin_bindings)
  for layout in layouts:
    try:
      emit(event="result", **run_layout(cfg, layout, args.batch, args.seq_len, args.steps,
                                        args.warmup, args.profile_steps))
    except Exception as e:  # one layout failing (e.g. OOM) should not hide the others
      emit(event="error", layout=layout, error=f"{type(e).__name__}: {str(e)[:2000]}")
  return 0


def _run_children(argv, layouts, timeout_s: int) -> int:
  """One child process per layout (same arguments, that layout only). Their JSON lines pass
  through as they come (progress lines included, so a layout that runs out of time still shows
  how far it got); a child that dies or times out is reported as an error line."""
  base = [a for a in argv if not a.startswith("--layouts")]
  failed = 0
  for layout in layouts:
    cmd = [sys.executable, os.path.abspath(__file__), *base, f"--layouts={layout}", "--in_process"]
    with tempfile.TemporaryFile(mode="w+") as err:
      proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
      timer = threading.Timer(timeout_s, proc.kill)
      timer.start()
      finished = False
      for line in proc.stdout:
        if line.startswith("{"):
          print(line, end="", flush=True)
          finished |= '"result"' in line or '"error"' in line
      returncode = proc.wait()
      timed_out = not timer.is_alive()
      timer.cancel()
      if timed_out:
        failed += 1
        emit(event="error", layout=layout, error=f"timed out after {timeout_s} s")
      elif returncode != 0 or not finished:
        failed += 1
        err.seek(0)
        emit(event="error", layout=layout, error=f"exit {returncode}: {err.read()[-1500:]}")
  return 1 if failed == len(layouts) else 0

if __name__ == "__main__":
  sys.exit(main())
