"""experiments/benchmarks/gpu_gaps.py on a synthetic trace (an XSpace written as the profiler
would): busy time as the union of overlapping streams, idle time per program and the gaps'
sources."""

import pytest

from testlib import load_benchmark, write_xspace

gpu_gaps = load_benchmark("gpu_gaps")

# Two streams (times in µs, written in ps): A runs k1 [0, 2), k2 [10, 15), k3 [40, 50); B runs
# k4 [1, 4) (overlapping k1) and k5 [15, 20) (starting as k2 ends). Busy: [0, 4), [10, 20),
# [40, 50); gaps of 6 µs (k4 -> k2) and 20 µs (k5 -> k3). Programs: prog_a [0, 20), prog_b [30, 50).
XSPACE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 10000000 duration_ps: 5000000 }
    events { metadata_id: 3 offset_ps: 40000000 duration_ps: 10000000 } }
  lines { id: 2 name: "Stream #14(compute)"
    events { metadata_id: 4 offset_ps: 1000000 duration_ps: 3000000 }
    events { metadata_id: 5 offset_ps: 15000000 duration_ps: 5000000 } }
  lines { id: 3 name: "XLA Modules"
    events { metadata_id: 6 offset_ps: 0 duration_ps: 20000000 }
    events { metadata_id: 7 offset_ps: 30000000 duration_ps: 20000000 } }
  event_metadata { key: 1 value { id: 1 name: "k1" } }
  event_metadata { key: 2 value { id: 2 name: "k2" } }
  event_metadata { key: 3 value { id: 3 name: "void cub::SortKernel<int, float>(int*)" } }
  event_metadata { key: 4 value { id: 4 name: "k4" } }
  event_metadata { key: 5 value { id: 5 name: "k5" } }
  event_metadata { key: 6 value { id: 6 name: "jit_prog_a(12)" } }
  event_metadata { key: 7 value { id: 7 name: "jit_prog_b(13)" } }
}
"""


@pytest.fixture
def trace_dir(tmp_path):
  return write_xspace(tmp_path, XSPACE)


def test_busy_idle_and_programs(trace_dir):
  out = gpu_gaps.gpu_gaps(trace_dir, min_gap_us=5.0)
  assert out["kernels"] == 5
  assert out["span_ms"] == pytest.approx(0.050)
  assert out["busy_ms"] == pytest.approx(0.024)
  assert out["idle_ms"] == pytest.approx(0.026)
  assert out["programs"] == {
      "jit_prog_a": {"runs": 1, "wall_ms": 0.02, "busy_ms": 0.014, "idle_ms": 0.006},
      "jit_prog_b": {"runs": 1, "wall_ms": 0.02, "busy_ms": 0.01, "idle_ms": 0.01}}
  assert out["outside_programs_ms"] == pytest.approx(0.010)
  assert out["programs_from"] == "XLA Modules line"
  assert out["largest_gaps"] == [["k5 -> void cub::SortKernel", 0.02, 1], ["k4 -> k2", 0.006, 1]]
  assert out["gaps_over_5us_ms"] == pytest.approx(0.026)


def test_min_gap_filters_short_gaps(trace_dir):
  out = gpu_gaps.gpu_gaps(trace_dir, min_gap_us=10.0)
  assert out["largest_gaps"] == [["k5 -> void cub::SortKernel", 0.02, 1]]
  assert out["gaps_over_10us_ms"] == pytest.approx(0.020)


def test_no_gpu_plane(tmp_path):
  trace = write_xspace(tmp_path, 'planes { id: 1 name: "/host:CPU" }')
  assert "note" in gpu_gaps.gpu_gaps(trace)


def test_a_trace_without_program_spans_names_its_other_lines(tmp_path):
  trace = write_xspace(tmp_path, """
  planes { id: 1 name: "/device:GPU:0"
    lines { id: 1 name: "Stream #13(compute)"
      events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 } }
    lines { id: 2 name: "XLA Ops"
      events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 } }
    event_metadata { key: 1 value { id: 1 name: "k1" } }
  }""")
  out = gpu_gaps.gpu_gaps(trace)
  assert out["programs"] == {} and out["other_lines"] == ["XLA Ops"]
  assert out["programs_from"] is None
  assert out["busy_ms"] == pytest.approx(0.002) and out["idle_ms"] == 0


def test_programs_from_kernel_stats_without_a_modules_line(tmp_path):
  """No 'XLA Modules' line (the H200 traces): each program's runs are the maximal sequences of its
  kernels ('hlo_module' stat) in time order. Kernels (µs): a [0, 2), a [3, 5), b [10, 14) on one
  stream and a [4, 6) on another, then a [20, 22): runs a [0, 6), b [10, 14), a [20, 22); a kernel
  without the stat joins no run. a's first run is idle in [2, 3)."""
  trace = write_xspace(tmp_path, """
  planes { id: 1 name: "/device:GPU:0"
    lines { id: 1 name: "Stream #13(compute)"
      events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 stats { metadata_id: 10 str_value: "jit_a" } }
      events { metadata_id: 1 offset_ps: 3000000 duration_ps: 2000000 stats { metadata_id: 10 str_value: "jit_a" } }
      events { metadata_id: 2 offset_ps: 10000000 duration_ps: 4000000 stats { metadata_id: 10 str_value: "jit_b" } }
      events { metadata_id: 3 offset_ps: 16000000 duration_ps: 1000000 }
      events { metadata_id: 1 offset_ps: 20000000 duration_ps: 2000000 stats { metadata_id: 10 str_value: "jit_a" } } }
    lines { id: 2 name: "Stream #14(compute)"
      events { metadata_id: 1 offset_ps: 4000000 duration_ps: 2000000 stats { metadata_id: 10 str_value: "jit_a" } } }
    event_metadata { key: 1 value { id: 1 name: "ka" } }
    event_metadata { key: 2 value { id: 2 name: "kb" } }
    event_metadata { key: 3 value { id: 3 name: "memcpy" } }
    stat_metadata { key: 10 value { id: 10 name: "hlo_module" } }
  }""")
  out = gpu_gaps.gpu_gaps(trace)
  assert out["programs_from"] == "kernels' hlo_module stats"
  assert out["programs"] == {
      "jit_a": {"runs": 2, "wall_ms": 0.008, "busy_ms": 0.007, "idle_ms": 0.001},
      "jit_b": {"runs": 1, "wall_ms": 0.004, "busy_ms": 0.004, "idle_ms": 0.0}}
  assert out["outside_programs_ms"] == pytest.approx(0.010)   # span 22 µs, runs 12 µs
  assert "other_lines" not in out
