"""experiments/benchmarks/trace_times.py on a synthetic trace (an XSpace written as the profiler
would), and ep_bench's collective classification on top of it."""

import pytest

from testlib import load_benchmark, write_xspace

trace_times = load_benchmark("trace_times")
ep = load_benchmark("ep_bench")

# Two GPU planes: on GPU 0 a stream line (one kernel twice, an NCCL kernel once) and the 'XLA Ops'
# line, on GPU 1 a stream line only; durations in picoseconds.
XSPACE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 4000000 duration_ps: 1500000 }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 3000000 } }
  lines { id: 2 name: "XLA Ops"
    events { metadata_id: 3 offset_ps: 0 duration_ps: 4000000 }
    events { metadata_id: 4 offset_ps: 5000000 duration_ps: 500000 } }
  event_metadata { key: 1 value { id: 1 name: "kda_gate_fwd" } }
  event_metadata { key: 2 value { id: 2 name: "ncclDevKernel_SendRecv" } }
  event_metadata { key: 3 value { id: 3 name: "all-to-all.1" } }
  event_metadata { key: 4 value { id: 4 name: "fusion.2" } }
}
planes { id: 2 name: "/device:GPU:1"
  lines { id: 1 name: "Stream #7(compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 7000000 }
    events { metadata_id: 2 offset_ps: 8000000 duration_ps: 1000000 } }
  event_metadata { key: 1 value { id: 1 name: "kda_gate_fwd" } }
  event_metadata { key: 2 value { id: 2 name: "ncclDevKernel_AllReduce_Sum_f32_RING_LL" } }
}
"""


@pytest.fixture
def trace_dir(tmp_path):
  return write_xspace(tmp_path, XSPACE)


def test_device_line_times_sums_per_line_and_name(trace_dir):
  lines = trace_times.device_line_times(trace_dir)
  assert set(lines) == {"Stream #13(compute)", "XLA Ops"}
  assert dict(lines["Stream #13(compute)"]) == {"kda_gate_fwd": 5000.0,
                                                "ncclDevKernel_SendRecv": 1500.0}
  assert dict(lines["XLA Ops"]) == {"all-to-all.1": 4000.0, "fusion.2": 500.0}
  assert dict(trace_times.stream_kernel_times(lines)) == dict(lines["Stream #13(compute)"])
  assert dict(trace_times.device_line_times(trace_dir, 1)["Stream #7(compute)"]) == {
      "kda_gate_fwd": 7000.0, "ncclDevKernel_AllReduce_Sum_f32_RING_LL": 1000.0}
  assert trace_times.device_line_times(trace_dir, 2) is None  # no such device plane
  assert trace_times.stream_kernel_times(None) == {}


def test_missing_trace_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match="xplane"):
    trace_times.device_line_times(str(tmp_path))


def test_ep_bench_collective_time(trace_dir):
  # The 'XLA Ops' line has a collective: it is the source (ms), fusions are left out.
  assert ep.collective_time_from_profile(trace_dir) == {"all-to-all": 0.004, "source": "XLA Ops"}
  # Device 1 has no 'XLA Ops' line: its NCCL kernels are.
  assert ep.collective_time_from_profile(trace_dir, 1) == {"all-reduce": 0.001,
                                                           "source": "NCCL kernels"}
  assert ep.collective_time_from_profile(trace_dir, 2) == {}


# Kernels with an 'hlo_op' stat: one launched by its own instruction, two from a command buffer
# (a CUDA graph: the stat names the thunk), one without the stat.
XSPACE_HLO_OPS = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 stats { metadata_id: 9 str_value: "fusion.7" } }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 1000000 stats { metadata_id: 9 str_value: "command_buffer_12" } }
    events { metadata_id: 3 offset_ps: 5000000 duration_ps: 4000000 stats { metadata_id: 9 str_value: "command_buffer_12" } }
    events { metadata_id: 4 offset_ps: 9000000 duration_ps: 500000 } }
  event_metadata { key: 1 value { id: 1 name: "loop_fusion_7" } }
  event_metadata { key: 2 value { id: 2 name: "loop_add_fusion_3" } }
  event_metadata { key: 3 value { id: 3 name: "nvjet_sm90_tst" } }
  event_metadata { key: 4 value { id: 4 name: "memcpy128" } }
  stat_metadata { key: 9 value { id: 9 name: "hlo_op" } }
}
"""


def test_stream_hlo_op_times_keys_command_buffer_kernels_by_name(tmp_path):
  assert dict(trace_times.stream_hlo_op_times(write_xspace(tmp_path, XSPACE_HLO_OPS))) == {
      "fusion.7": 2000.0, "loop_add_fusion_3": 1000.0, "nvjet_sm90_tst": 4000.0,
      "memcpy128": 500.0}


# The same instruction name in two programs (stat 10: 'hlo_module'); one kernel without the stat.
XSPACE_TWO_PROGRAMS = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 stats { metadata_id: 9 str_value: "loop_add_fusion.43" } stats { metadata_id: 10 str_value: "jit_train_step_microbatch" } }
    events { metadata_id: 1 offset_ps: 3000000 duration_ps: 5000000 stats { metadata_id: 9 str_value: "loop_add_fusion.43" } stats { metadata_id: 10 str_value: "jit_train_step_update" } }
    events { metadata_id: 2 offset_ps: 9000000 duration_ps: 1000000 stats { metadata_id: 9 str_value: "fusion.2" } stats { metadata_id: 10 str_value: "jit_train_step_microbatch" } }
    events { metadata_id: 3 offset_ps: 11000000 duration_ps: 500000 } }
  event_metadata { key: 1 value { id: 1 name: "loop_add_fusion_43" } }
  event_metadata { key: 2 value { id: 2 name: "loop_fusion_2" } }
  event_metadata { key: 3 value { id: 3 name: "memcpy128" } }
  stat_metadata { key: 9 value { id: 9 name: "hlo_op" } }
  stat_metadata { key: 10 value { id: 10 name: "hlo_module" } }
}
"""


def test_stream_hlo_op_times_of_one_program(tmp_path):
  """Instruction names repeat across a step's programs: `module` keeps one program's kernels
  (by the 'hlo_module' stat); without it the two programs' same-named kernels add up."""
  trace = write_xspace(tmp_path, XSPACE_TWO_PROGRAMS)
  assert dict(trace_times.stream_hlo_op_times(trace, module="jit_train_step_microbatch")) == {
      "loop_add_fusion.43": 2000.0, "fusion.2": 1000.0}
  assert dict(trace_times.stream_hlo_op_times(trace, module="jit_train_step_update")) == {
      "loop_add_fusion.43": 5000.0}
  assert not trace_times.stream_hlo_op_times(trace, module="jit_train_step")   # names, not parts
  assert dict(trace_times.stream_hlo_op_times(trace)) == {
      "loop_add_fusion.43": 7000.0, "fusion.2": 1000.0, "memcpy128": 500.0}


def test_stream_hlo_op_times_without_module_stats_counts_all(tmp_path):
  """A trace whose kernels carry no 'hlo_module' stat: `module` cannot select, all are counted."""
  trace = write_xspace(tmp_path, XSPACE_HLO_OPS)
  assert (trace_times.stream_hlo_op_times(trace, module="jit_train_step_microbatch")
          == trace_times.stream_hlo_op_times(trace))
