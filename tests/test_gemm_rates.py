"""gemm_rates: each matmul's FLOPs read from the optimised HLO (hand-counted here, and a dot that
XLA:CPU compiles), its time from a trace's per-instruction table, and the TFLOP/s."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
import gemm_rates  # noqa: E402

# A cuBLAS GEMM [1024, 512] x [512, 2048] (2·1024·2048·512 FLOPs), a Triton GEMM fusion holding a
# batched dot [4, 64, 32] x [4, 32, 16] (2·4·64·16·32), and an elementwise fusion (no FLOPs).
HLO = """HloModule m

%gemm_fusion_dot.3_computation (p0: bf16[4,64,32], p1: bf16[4,32,16]) -> bf16[4,64,16] {
  %p0 = bf16[4,64,32]{2,1,0} parameter(0)
  %p1 = bf16[4,32,16]{2,1,0} parameter(1)
  ROOT %dot.1 = bf16[4,64,16]{2,1,0} dot(bf16[4,64,32]{2,1,0} %p0, bf16[4,32,16]{2,1,0} %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[1024,512], b: bf16[512,2048], c: bf16[4,64,32], d: bf16[4,32,16]) -> bf16[1024,2048] {
  %a = bf16[1024,512]{1,0} parameter(0)
  %b = bf16[512,2048]{1,0} parameter(1)
  %c = bf16[4,64,32]{2,1,0} parameter(2)
  %d = bf16[4,32,16]{2,1,0} parameter(3)
  %custom-call.5 = (bf16[1024,2048]{1,0}, s8[4194304]{0}) custom-call(bf16[1024,512]{1,0} %a, bf16[512,2048]{1,0} %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp(K3Model)/layer_0/kda/q_proj/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gemm_fusion_dot.3 = bf16[4,64,16]{2,1,0} fusion(bf16[4,64,32]{2,1,0} %c, bf16[4,32,16]{2,1,0} %d), kind=kCustom, calls=%gemm_fusion_dot.3_computation, metadata={op_name="jit(train_step)/transpose(jvp(K3Model))/layer_1/moe/dot_general"}
  %loop_add_fusion.1 = bf16[4,64,16]{2,1,0} fusion(%gemm_fusion_dot.3), kind=kLoop, calls=%x
  ROOT %gte = bf16[1024,2048]{1,0} get-tuple-element(%custom-call.5), index=0
}
"""


def test_flops_of_a_cublas_gemm_and_a_gemm_fusion():
  flops = gemm_rates.matmul_flops(HLO)
  assert flops["custom-call.5"][0] == 2 * 1024 * 2048 * 512
  assert flops["gemm_fusion_dot.3"][0] == 2 * 4 * 64 * 16 * 32
  assert flops["gemm_fusion_dot.3"][2] == "bf16[4,64,32] x bf16[4,32,16]"
  assert "loop_add_fusion.1" not in flops


def test_rates_match_the_trace_and_leave_unmatched_gemms_out():
  # Two steps: the GEMM took 2 µs in all (1 µs a step), the fusion's kernel runs under its kernel
  # name ('gemm_fusion_dot_3'); a cuBLAS kernel from a command buffer has no instruction.
  op_ns = {"custom-call.5": 2_000, "gemm_fusion_dot_3": 1_000, "loop_add_fusion.1": 5_000,
           "nvjet_sm90_tst_128x160": 3_000_000}
  report = gemm_rates.gemm_rates(op_ns, HLO, steps=2, peak_tflops=1000.0)
  first = report["rows"][0]
  assert first[:3] == ["custom-call.5", "kda", "K3Model/layer_0/kda/q_proj"]
  assert first[4] == 0.001                                       # ms per step
  assert first[6] == pytest.approx(2 * 1024 * 2048 * 512 / 1e-6 / 1e12, rel=1e-3)   # TFLOP/s
  assert report["rows"][1][0] == "gemm_fusion_dot.3" and report["rows"][1][1] == "moe"
  assert report["unmatched_gemm_ms"] == 1.5
  assert set(report["by_kind"]) == {"kda", "moe"}


def test_flops_of_a_dot_xla_compiles(tmp_path):
  """The CPU's optimised HLO of a real matmul, read back: its dot carries 2·M·N·K."""
  f = jax.jit(lambda a, b: jnp.tanh(a @ b))
  text = f.lower(jnp.ones((64, 48)), jnp.ones((48, 40))).compile().as_text()
  counted = [v[0] for v in gemm_rates.matmul_flops(text).values()]
  assert 2 * 64 * 40 * 48 in counted
