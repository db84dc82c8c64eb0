r"""Device time of a training step by model scope and by kind of module, from a profile and the
optimised HLO of the step (train_bench.py --profile --memory_report).

Each kernel of a GPU trace carries the HLO instruction that launched it ('hlo_op'); the optimised
HLO gives that instruction's op_name, the JAX path of the operation it computes, e.g.
'jit(train_step)/transpose(jvp(K3Model))/scanned_period_4/layer_2/moe/...'. `attribute` sums the
time by scope (`hlo_memory.scope_of`, 'bwd:' for the backward pass) and by module kind: the first
path part that names one of the decoder's modules ('moe', 'kda', 'mla', the dense 'ffn', AttnRes's
depth mixes, the norms); a loop body's ops outside them are the decoder scan's own (SCAN_KIND);
'optimizer/loss/other' for the rest. Kernels without an
instruction are classified by name (tokamax's ragged_* kernels and k3jax's situ_glu_* and
grouped_weight_grad are the MoE's, kda_* the KDA kernels, memcpy the copies).
"""
from __future__ import annotations

import collections
import re
from typing import Mapping

import hlo_memory

# Module names of k3jax.model / k3jax.layers, in the order a path part is looked up.
MODULE_KINDS = {"moe": "moe", "kda": "kda", "mla": "mla", "ffn": "ffn (dense)",
                "attn_mix": "attnres", "ffn_mix": "attnres", "final_mix": "attnres",
                "attn_norm": "norm", "ffn_norm": "norm", "final_norm": "norm"}
# tokamax's attention backward runs as 'batched_body_mosaic_gpu_kernel' (its jax function's name);
# cuBLAS's GEMMs ('nvjet_*', 'sm90_xmma_*', 'cutlass_*') are shared by every module.
# k3jax's own MoE kernels: 'situ_glu_fwd' / 'situ_glu_bwd' and 'grouped_weight_grad'.
_BY_KERNEL_NAME = ((re.compile(r"ragged|^situ_glu_|^grouped_weight_grad"), "moe"),
                   (re.compile(r"^kda_"), "kda"),
                   (re.compile(r"flash|attention|mha|^batched_body"), "mla"),
                   (re.compile(r"(?i)memcpy|memset"), "copies"),
                   (re.compile(r"^nvjet|xmma|cutlass|gemm"), "gemm (module unknown)"))


# Ops of a `while` body (the decoder's scan) that no module owns: the scan's own work, chiefly the
# writes of each iteration's saved activations into their stacked buffers (dynamic_update_slice)
# and the backward's reads of them.
SCAN_KIND = "decoder scan (saved activations)"


def module_kind(op_name: str) -> str:
  """The decoder module an op_name belongs to (MODULE_KINDS' values); SCAN_KIND for a loop body's
  op outside every module; else 'optimizer/loss/other'."""
  parts = re.split(r"[/()]", op_name.split(";")[0])
  for part in parts:
    if part in MODULE_KINDS:
      return MODULE_KINDS[part]
  if "while" in parts:
    return SCAN_KIND
  return "optimizer/loss/other"


def kind_of_kernel_name(name: str) -> str:
  for pattern, kind in _BY_KERNEL_NAME:
    if pattern.search(name):
      return kind
  return "unattributed kernels"


def instruction_of(op: str, known) -> str | None:
  """The HLO instruction of `known` (a mapping or set of instruction names) that trace name `op`
  stands for: itself, or XLA's kernel name for it (a fusion 'loop_add_fusion.3' runs as
  'loop_add_fusion_3'); None if neither is known."""
  if op in known:
    return op
  dotted = re.sub(r"_(\d+)$", r".\1", op)
  return dotted if dotted in known else None


def attribute(op_ns: Mapping[str, int], info: Mapping[str, tuple], depth: int = 4
              ) -> tuple[collections.Counter, collections.Counter]:
  """(ns by scope, ns by module kind) of `op_ns` (HLO instruction or kernel name -> ns), with
  `info` = hlo_memory.instruction_info of the optimised HLO. Names that are not instructions of
  `info` are tried as XLA's kernel names (a fusion 'loop_add_fusion.3' runs as
  'loop_add_fusion_3'), then classified by name."""
  by_scope, by_kind = collections.Counter(), collections.Counter()
  for op, ns in op_ns.items():
    key = instruction_of(op, info)
    entry = info[key] if key is not None else None
    if entry is None or not entry[1]:
      kind = kind_of_kernel_name(op)
      by_scope[f"({kind}) {op[:48]}"] += ns
      by_kind[kind] += ns
      continue
    op_name = entry[1]
    bwd = "transpose(" in op_name
    by_scope[("bwd:" if bwd else "") + hlo_memory.scope_of(op_name, depth)] += ns
    by_kind[module_kind(op_name)] += ns
  return by_scope, by_kind
