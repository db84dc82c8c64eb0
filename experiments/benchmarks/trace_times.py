"""Device time per event name from a `jax.profiler.trace` directory (ep_bench, kda_profile).

On GPU the device plane '/device:GPU:i' of the written XSpace has an 'XLA Ops' line (one event per
executed HLO op) and 'Stream #...' lines (the CUDA kernels, Pallas / Triton ones under their
kernel names).
"""
from __future__ import annotations

import collections
import glob
import os


def _newest_planes(logdir: str):
  """The planes of the newest .xplane.pb under `logdir`; FileNotFoundError when there is none."""
  from jax.profiler import ProfileData
  paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {logdir}")
  return ProfileData.from_file(sorted(paths)[-1]).planes


def gpu_plane(logdir: str, device_index: int = 0):
  """The plane '/device:GPU:<device_index>' of the newest trace under `logdir`, or None when the
  trace has none (on CPU ops run on host threads). Raises FileNotFoundError when `logdir` holds
  no trace."""
  for plane in _newest_planes(logdir):
    if plane.name == f"/device:GPU:{device_index}":
      return plane
  return None


def device_line_times(logdir: str, device_index: int = 0):
  """{line name: Counter(event name -> total ns)} of `gpu_plane`; None without one."""
  plane = gpu_plane(logdir, device_index)
  if plane is None:
    return None
  lines = {}
  for line in plane.lines:
    times = lines.setdefault(line.name, collections.Counter())
    for event in line.events:
      times[event.name] += event.duration_ns
  return lines


def stream_kernel_times(lines) -> collections.Counter:
  """Kernel name -> total ns over the stream lines of `device_line_times`' result."""
  total = collections.Counter()
  for name, times in (lines or {}).items():
    if name.startswith("Stream"):
      total.update(times)
  return total


def host_event_times(logdir: str) -> collections.Counter:
  """Event name -> total ns over every host ('/host:CPU') line of the newest trace under `logdir`:
  the compiler's own phases (XLA marks its passes, LLVM and PTX compilation, autotuning) when the
  trace covered a compile. Nested events are each counted, so totals overlap."""
  total = collections.Counter()
  for plane in _newest_planes(logdir):
    if plane.name.startswith("/host:"):
      for line in plane.lines:
        for event in line.events:
          total[event.name] += event.duration_ns
  return total


def stat_value(event, name: str):
  """The value of stat `name` of a trace event, or None (stats are (name, value) pairs)."""
  for item in event.stats:
    key, value = item if isinstance(item, tuple) else (getattr(item, "name", None),
                                                      getattr(item, "value", None))
    if key == name:
      return value
  return None


def stream_hlo_op_times(logdir: str, device_index: int = 0,
                        module: str | None = None) -> collections.Counter:
  """HLO instruction -> total ns of the kernels it launched, over the stream lines of the plane
  '/device:GPU:<device_index>' (the 'hlo_op' stat XLA attaches to each kernel; a kernel without
  one is counted under its own name). Kernels that XLA launched from a command buffer (a CUDA
  graph of many HLO instructions) carry the thunk's name, 'command_buffer_<n>', as hlo_op: those
  are counted under their kernel names too, which for XLA's fusions are the instructions' names
  ('loop_add_fusion.3' runs as 'loop_add_fusion_3'). Empty when the trace has no such plane.

  module: count only the kernels whose 'hlo_module' stat is this program's name (e.g.
  'jit_train_step_microbatch'): instruction names repeat across programs (the update program's
  optimizer fusion 'loop_add_fusion.43' is another kernel than the micro-batch program's
  gradient accumulation of that name), so a step of several programs mixes them otherwise. When
  no kernel of the trace carries an 'hlo_module' stat, all are counted."""
  total, kept = collections.Counter(), collections.Counter()
  tagged = False
  plane = gpu_plane(logdir, device_index)
  for line in plane.lines if plane is not None else ():
    if line.name.startswith("Stream"):
      for event in line.events:
        op = stat_value(event, "hlo_op")
        use_op = op and not str(op).startswith("command_buffer")
        key = str(op) if use_op else event.name
        total[key] += event.duration_ns
        if module is not None:
          owner = stat_value(event, "hlo_module")
          tagged |= owner is not None
          if owner is not None and str(owner) == module:
            kept[key] += event.duration_ns
  return kept if module is not None and tagged else total
