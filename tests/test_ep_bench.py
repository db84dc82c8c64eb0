"""experiments/benchmarks/ep_bench.py: how profile events are classified as collectives."""

from testlib import load_benchmark

ep = load_benchmark("ep_bench")


def test_hlo_op_names():
  assert ep.collective_kind("all-to-all.3") == "all-to-all"
  assert ep.collective_kind("all-to-all-start.12") == "all-to-all"
  assert ep.collective_kind("all-reduce-done") == "all-reduce"
  assert ep.collective_kind("ragged-all-to-all.1") == "ragged-all-to-all"
  assert ep.collective_kind("reduce-scatter.7") == "reduce-scatter"
  assert ep.collective_kind("fusion.2") is None
  assert ep.collective_kind("all-to-all-fusion.1") is None


def test_nccl_kernel_names():
  assert ep._nccl_kind("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long)") == "all-to-all"
  assert ep._nccl_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all-reduce"
  assert ep._nccl_kind("ncclDevKernel_AllGather_RING_LL") == "all-gather"
  assert ep._nccl_kind("ncclDevKernel_Broadcast_RING_LL") == "nccl-other"
  assert ep._nccl_kind("triton_gemm_dot_1") is None
