"""kernel_scopes: kernel time attributed to model scopes and module kinds through the HLO."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
import hlo_memory  # noqa: E402
import kernel_scopes  # noqa: E402

HLO = """
ENTRY %main {
  %fusion.3 = bf16[4,8]{1,0} fusion(%p), kind=kLoop, metadata={op_name="jit(train_step)/jvp(K3Model)/layer_0/attn_mix/mul"}
  %custom-call.7 = bf16[4,8]{1,0} custom-call(%a), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/transpose(jvp(K3Model))/scanned_period_4/while/body/layer_2/moe/shared/dot_general"}
  %loop_add_fusion.12 = f32[8]{0} fusion(%g), kind=kLoop, metadata={op_name="jit(train_step)/add"}
  ROOT %custom-call.9 = bf16[4,8]{1,0} custom-call(%b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(K3Model)/layer_1/kda/pallas_call"}
}
"""


def test_module_kind_reads_the_first_module_in_the_path():
  assert kernel_scopes.module_kind("jit(s)/transpose(jvp(K3Model))/layer_3/moe/shared/dot") == "moe"
  assert kernel_scopes.module_kind("jit(s)/jvp(K3Model)/layer_0/ffn_mix/mul") == "attnres"
  assert kernel_scopes.module_kind("jit(s)/jvp(K3Model)/layer_0/ffn/dot") == "ffn (dense)"
  assert kernel_scopes.module_kind("jit(s)/jvp(K3Model)/layer_0/attn_norm/rsqrt") == "norm"
  assert kernel_scopes.module_kind("jit(s)/adam/mul") == "optimizer/loss/other"


def test_module_kind_gives_the_scans_own_ops_their_kind():
  """The writes of a scan iteration's saved activations carry no module in their path: they are
  the decoder scan's, not the optimizer's (run 14 counted them as 'optimizer/loss/other')."""
  dus = ("jit(train_step)/call_exported/jit(train_step)/jvp(K3Model)/while/body/"
         "jit(dynamic_update_index_in_dim)/dynamic_update_slice")
  assert kernel_scopes.module_kind(dus) == kernel_scopes.SCAN_KIND
  inside = "jit(s)/transpose(jvp(K3Model))/while/body/scanned_period_4/layer_2/kda/dot"
  assert kernel_scopes.module_kind(inside) == "kda"


def test_attribute_sums_by_scope_and_kind():
  info = hlo_memory.instruction_info(HLO)
  ops = {"fusion.3": 10, "custom-call.7": 20, "loop_add_fusion_12": 5, "custom-call.9": 7,
         "ragged_dot_sm90_mosaic_gpu_kernel": 30, "MemcpyD2D": 4, "nvjet_tst_128x128": 3}
  by_scope, by_kind = kernel_scopes.attribute(ops, info, depth=4)
  assert sum(by_scope.values()) == sum(by_kind.values()) == sum(ops.values())
  assert by_kind == {"attnres": 10, "moe": 50, "optimizer/loss/other": 5, "kda": 7, "copies": 4,
                     "gemm (module unknown)": 3}
  assert by_scope["bwd:K3Model/scanned_period_4/layer_2/moe"] == 20
  assert by_scope["K3Model/layer_0/attn_mix"] == 10


@pytest.mark.parametrize("name, kind", [("kda_dense_bwd", "kda"), ("memcpy128", "copies"),
                                        ("flash_attention_sm90_mosaic_gpu_kernel", "mla"),
                                        ("ragged_contracting_dim_dot_sm90", "moe"),
                                        ("grouped_weight_grad", "moe"), ("situ_glu_bwd", "moe"),
                                        ("batched_body_mosaic_gpu_kernel", "mla"),
                                        ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT",
                                         "gemm (module unknown)"),
                                        ("input_reduce_fusion_361", "unattributed kernels")])
def test_kernel_names_without_an_instruction(name, kind):
  assert kernel_scopes.kind_of_kernel_name(name) == kind


def test_scope_of_drops_control_flow_and_repeated_scan_names():
  op = ("jit(train_step)/call_exported/jit(train_step)/transpose(jvp(K3Model))/while/body/"
        "eval_jaxpr/scanned_period_4/scanned_period_4/checkpoint/layer_2/kda/cond")
  assert hlo_memory.scope_of(op, 5) == "K3Model/scanned_period_4/layer_2/kda"
  assert hlo_memory.scope_of("jit(f)/jvp(K3Model)/layer_0/moe/dot_general", 3) == "K3Model/layer_0/moe"
