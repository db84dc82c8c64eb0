"""Where a KDA call's GPU time goes, kernel by kernel: k3jax Pallas (jax.profiler) and fla 0.6.0
(torch.profiler), same inputs as kda_bench.

kda_bench times whole calls, and each Pallas kernel alone on inputs prepared outside; this traces
the whole call and sums the device time of every kernel it launches (the XLA fusions between the
Pallas kernels included), averaged over the traced calls. One JSON line per
(impl, mode, kernel), then one per (impl, mode) with the total and the number of kernels.

Run (GPU): PYTHONPATH=. python experiments/benchmarks/kda_profile.py --shape 8,4096,16,128
  [--impls pallas,fla] [--modes fwd,fwdbwd] [--iters 10]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_bench as kb  # noqa: E402  (sets the allocator flag before jax starts)
import trace_times  # noqa: E402

import jax  # noqa: E402


def profile_pallas(B, T, H, D, modes, iters):
  args, bwd_args = kb.jax_args(B, T, H, D)
  fwd, fwdbwd = kb.jax_fns("pallas")
  for mode in modes:
    fn, a = (fwd, args) if mode == "fwd" else (fwdbwd, bwd_args)
    kb.time_jax(fn, a, reps=5, batches=1)  # compile and warm the clocks
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        for _ in range(iters):
          out = fn(*a)
        jax.block_until_ready(out)
      lines = trace_times.device_line_times(d)
    totals = trace_times.stream_kernel_times(lines)
    if not totals:
      raise RuntimeError(f"no GPU kernels in the trace; device 0's lines: {list(lines or {})}")
    _emit_totals("pallas", mode, B, T, H, D, totals, iters)


def profile_fla(B, T, H, D, modes, iters):
  import torch
  calls = dict(zip(("fwd", "fwdbwd"), kb.fla_calls(B, T, H, D)))
  for mode in modes:
    fn = calls[mode]
    for _ in range(3):  # autotuning happens here
      fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(iters):
        fn()
      torch.cuda.synchronize()
    totals = collections.Counter()
    for ev in prof.events():
      if str(getattr(ev, "device_type", "")).endswith("CUDA"):
        us = getattr(ev, "device_time", None)
        if us is None:
          us = ev.cuda_time
        totals[ev.name] += int(us * 1e3)
    _emit_totals("fla", mode, B, T, H, D, totals, iters)


def _emit_totals(impl, mode, B, T, H, D, totals, iters):
  for name, ns in totals.most_common():
    kb.emit(kind="kernel", impl=impl, mode=mode, B=B, T=T, H=H, D=D, kernel=name[:120],
            ms=round(ns / iters / 1e6, 4))
  kb.emit(kind="profile_total", impl=impl, mode=mode, B=B, T=T, H=H, D=D, kernels=len(totals),
          ms=round(sum(totals.values()) / iters / 1e6, 4))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D")
  p.add_argument("--impls", default="pallas", help="comma list of pallas, fla")
  p.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
  p.add_argument("--iters", type=int, default=10)
  a = p.parse_args()
  shape = tuple(int(s) for s in a.shape.split(","))
  if len(shape) != 4:
    p.error(f"--shape must be B,T,H,D; got {a.shape!r}")
  modes = a.modes.split(",")
  for m in modes:
    if m not in ("fwd", "fwdbwd"):
      p.error(f"--modes: unknown mode {m!r} (allowed: fwd, fwdbwd)")
  for impl in a.impls.split(","):
    if impl == "pallas":
      profile_pallas(*shape, modes, a.iters)
    elif impl == "fla":
      profile_fla(*shape, modes, a.iters)
    else:
      p.error(f"--impls: unknown impl {impl!r} (allowed: pallas, fla)")


if __name__ == "__main__":
  main()
