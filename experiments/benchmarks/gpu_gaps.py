r"""Where the GPU waits: idle time between kernels in a `jax.profiler.trace` directory, per XLA
program run and by the kernels on either side of each gap.

A step's wall time exceeds the sum of its kernels by the time the GPU had nothing to run: the host
launching too slowly (many short kernels outside a command buffer), a host synchronisation, or a
gap between two jitted programs of a host loop. `gpu_gaps` merges the kernels of every stream line
of '/device:GPU:<i>' (streams may overlap) into busy intervals and reports:

  * each XLA program's runs: wall, busy and idle ms, summed by program name. The runs come from
    the plane's 'XLA Modules' line; a trace without one (the H200 traces of runs 29-30) gives them
    from the kernels' 'hlo_module' stats instead, a run being a maximal sequence of kernels of one
    program in time order, from its first kernel's start to its last kernel's end (so a run's
    launch latency before its first kernel counts as outside the programs);
  * the idle time inside and between programs;
  * the largest gap sources: idle ns summed by (kernel before, kernel after), with counts.

    python experiments/benchmarks/gpu_gaps.py /tmp/prof/medium_packed_8x8192_run1 --min_gap_us=5

`train_bench.py --profile=... --gaps` prints the same summary as a 'gaps' line.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_times  # noqa: E402  (experiments/benchmarks is not a package)


def _runs_from_kernel_stats(tagged) -> list:
  """[(start_ns, end_ns, program)] from [(start_ns, end_ns, program)] of the kernels that carry an
  'hlo_module' stat, sorted: one run per maximal sequence of one program's kernels."""
  runs = []
  for start, end, program in tagged:
    if runs and runs[-1][2] == program:
      runs[-1][1] = max(runs[-1][1], end)
    else:
      runs.append([start, end, program])
  return [tuple(run) for run in runs]


def _kernels_and_modules(logdir: str, device_index: int = 0):
  """([(start_ns, end_ns, kernel name)] sorted, [(start_ns, end_ns, program name)] sorted, the
  plane's other line names, where the programs' runs came from) of `trace_times.gpu_plane`."""
  kernels, modules, tagged, others = [], [], [], set()
  plane = trace_times.gpu_plane(logdir, device_index)
  for line in plane.lines if plane is not None else ():
    if not line.name.startswith("Stream") and line.name != "XLA Modules":
      others.add(line.name)
    if line.name.startswith("Stream"):
      for e in line.events:
        kernels.append((e.start_ns, e.start_ns + e.duration_ns, e.name))
        program = trace_times.stat_value(e, "hlo_module")
        if program is not None:
          tagged.append((e.start_ns, e.start_ns + e.duration_ns, str(program)))
    elif line.name == "XLA Modules":
      for e in line.events:
        # 'jit_train_step_microbatch(1234)' -> 'jit_train_step_microbatch'
        modules.append((e.start_ns, e.start_ns + e.duration_ns, re.sub(r"\(\d+\)$", "", e.name)))
  kernels.sort()
  modules.sort()
  source = "XLA Modules line"
  if not modules and tagged:
    modules, source = _runs_from_kernel_stats(sorted(tagged)), "kernels' hlo_module stats"
  return kernels, modules, sorted(others), source if modules else None


def _short(name: str) -> str:
  """A kernel name without its template arguments or parameter list (cub's, cuBLAS's)."""
  return name.split("<")[0].split("(")[0][:80]


def gpu_gaps(logdir: str, min_gap_us: float = 5.0, top: int = 25, device_index: int = 0) -> dict:
  """The summary described in the module docstring; times in ms (over the whole trace)."""
  kernels, modules, other_lines, source = _kernels_and_modules(logdir, device_index)
  if not kernels:
    return {"note": f"no kernels on /device:GPU:{device_index}"}
  # Busy intervals: the union of the kernels' [start, end).
  busy = []
  for start, end, name in kernels:
    if busy and start <= busy[-1][1]:
      if end > busy[-1][1]:
        busy[-1][1], busy[-1][3] = end, name
    else:
      busy.append([start, end, name, name])      # start, end, first kernel, last kernel
  gaps = [(busy[i + 1][0] - busy[i][1], busy[i][3], busy[i + 1][2], busy[i][1])
          for i in range(len(busy) - 1)]
  min_gap_ns = min_gap_us * 1e3
  by_pair = collections.Counter()
  count = collections.Counter()
  for ns, before, after, _ in gaps:
    if ns >= min_gap_ns:
      key = f"{_short(before)} -> {_short(after)}"
      by_pair[key] += ns
      count[key] += 1

  def busy_in(lo: int, hi: int) -> int:
    total = 0
    for start, end, _, _ in busy:          # linear: traces hold ~10^5 intervals
      if end <= lo or start >= hi:
        continue
      total += min(end, hi) - max(start, lo)
    return total

  per_module = collections.defaultdict(lambda: [0, 0.0, 0.0])  # runs, wall ns, busy ns
  for start, end, name in modules:
    entry = per_module[name]
    entry[0] += 1
    entry[1] += end - start
    entry[2] += busy_in(start, end)
  span = busy[-1][1] - busy[0][0]
  busy_ns = sum(end - start for start, end, _, _ in busy)
  inside = sum(w for _, w, _ in per_module.values())
  ms = lambda ns: round(ns / 1e6, 3)
  out = {
      "span_ms": ms(span), "busy_ms": ms(busy_ns), "idle_ms": ms(span - busy_ns),
      "kernels": len(kernels),
      "programs": {name: {"runs": runs, "wall_ms": ms(wall), "busy_ms": ms(b),
                          "idle_ms": ms(wall - b)}
                   for name, (runs, wall, b) in sorted(per_module.items(),
                                                        key=lambda kv: -kv[1][1])},
      "programs_from": source,
      "outside_programs_ms": ms(max(span - inside, 0)),
      f"gaps_over_{min_gap_us:g}us_ms": ms(sum(by_pair.values())),
      "largest_gaps": [[k, ms(ns), count[k]] for k, ns in by_pair.most_common(top)],
  }
  if not modules:
    # Neither an 'XLA Modules' line nor kernels' program stats: the lines there are, to look for
    # the programs' spans under another.
    out["other_lines"] = other_lines
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("logdir")
  p.add_argument("--min_gap_us", type=float, default=5.0)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--device", type=int, default=0)
  args = p.parse_args(argv)
  print(json.dumps(gpu_gaps(args.logdir, args.min_gap_us, args.top, args.device), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
