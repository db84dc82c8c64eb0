r"""The step's matmuls one by one: FLOPs, device time and TFLOP/s of each, from a profile and the
optimised HLO (train_bench.py --profile --memory_report: its `gemms` line).

Each matmul kernel of the GPU trace carries the HLO instruction that launched it ('hlo_op'): a
cuBLAS custom call (`__cublas$gemm`, `__cublas$lt$matmul`), a fusion whose computation holds a
`dot` (XLA's Triton GEMMs, 'gemm_fusion_dot_*'), or a plain `dot`. Its FLOPs are 2 · |output| · K,
with K the product of the left operand's contracting dimensions (batch dimensions are in the
output). Launched from a command buffer a kernel carries the buffer's name instead, so run the
profile with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (command buffers off) for a full table.

    rows = gemm_rates(op_ns, hlo_text, steps)   # op_ns: trace_times.stream_hlo_op_times(logdir)
    python experiments/benchmarks/gemm_rates.py --hlo=DUMP/...after_optimizations.txt \
        --op_times=op_times.json --steps=3         # op_times.json: {instruction: ns}
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import re
from typing import Mapping

import hlo_memory
import kernel_scopes

# bf16 matmul 8192^3 through jax.jit on one H200 (docs/performance.md): the MFU denominator.
PEAK_TFLOPS_H200 = 869.0
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_ARRAY = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_OPERANDS = re.compile(r"\b(?:custom-call|fusion|dot)\((.*?)\)(?:,|$)")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_GEMM_TARGET = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"')
_HLO_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_JSON_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(shape: str) -> list[int]:
  """[d0, d1, ...] of an array shape 'bf16[32768,1536]{1,0}'; of a tuple's first element."""
  m = _ARRAY.match(shape.lstrip("("))
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def parse_computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines} of an HLO module's text."""
  comps, name = {}, None
  for line in hlo_text.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m:
        name, comps[m.group(1)] = m.group(1), []
    elif line.startswith("}"):
      name = None
    else:
      comps[name].append(line)
  return comps


def _contracting(line: str) -> list[int]:
  m = _HLO_CONTRACTING.search(line) or _JSON_CONTRACTING.search(line)
  return [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')] if m else []


def _operands(line: str) -> list[str]:
  """The operand names of a custom-call, fusion or dot instruction line."""
  ops = _OPERANDS.search(line)
  return _OPERAND_NAME.findall(ops.group(1)) if ops else []


def _dot(line: str, out_shape: str, shapes: Mapping[str, str]) -> tuple[int, str]:
  """(2 · |out| · K, 'lhs shape x rhs shape') of a dot or GEMM instruction line; 0 FLOPs if its
  operands cannot be read."""
  names = _operands(line)
  sig = " x ".join(shapes.get(o, "?").split("{")[0] for o in names[:2])
  if not names or names[0] not in shapes:
    return 0, sig
  lhs = _dims(shapes[names[0]])
  k = math.prod(lhs[d] for d in _contracting(line) if d < len(lhs))
  return 2 * math.prod(_dims(out_shape)) * k, sig


def matmul_flops(hlo_text: str) -> dict[str, tuple[int, str, str]]:
  """{instruction: (FLOPs, op_name, operand shapes)} for each matmul instruction of the module: a
  cuBLAS custom call, a fusion that calls a computation with a dot (its dots summed), or a dot."""
  comps = parse_computations(hlo_text)
  shapes = {}
  for lines in comps.values():
    for line in lines:
      m = hlo_memory._INSTRUCTION.match(line)  # pylint: disable=protected-access
      if m:
        shapes[m.group(1)] = m.group(2)

  def dots_of(comp: str) -> tuple[int, str]:
    total, sig = 0, ""
    for line in comps.get(comp, []):
      m = hlo_memory._INSTRUCTION.match(line)  # pylint: disable=protected-access
      if m and " dot(" in line:
        flops, sig = _dot(line, m.group(2), shapes)
        total += flops
    return total, sig

  out = {}
  for lines in comps.values():
    for line in lines:
      m = hlo_memory._INSTRUCTION.match(line)  # pylint: disable=protected-access
      if not m:
        continue
      name, shape = m.group(1), m.group(2)
      op = hlo_memory.OP_NAME.search(line)
      op_name = op.group(1) if op else ""
      if _GEMM_TARGET.search(line) or " dot(" in line:
        flops, sig = _dot(line, shape, shapes)
        out[name] = (flops, op_name, sig)
      elif " fusion(" in line and (calls := _CALLS.search(line)):
        flops, sig = dots_of(calls.group(1))
        if flops:
          out[name] = (flops, op_name, sig)
  return out


def gemm_rates(op_ns: Mapping[str, int], hlo_text: str, steps: int,
               peak_tflops: float = PEAK_TFLOPS_H200,
               top: int = 40) -> dict:
  """{'matmul_ms', 'matmul_tflop', 'tflops', 'unmatched_gemm_ms', 'rows': [...]}: the matmuls of
  `op_ns` (instruction or kernel name -> ns over `steps` runs of the program whose HLO
  `hlo_text` is; a step of n micro-batches runs the micro-batch program n times) with their
  FLOPs from the HLO. rows (the `top` by time): [instruction, module kind, scope, operand
  shapes, ms per run, TFLOP per run, TFLOP/s, share of peak_tflops]. unmatched_gemm_ms: time of
  kernels named like cuBLAS GEMMs that no instruction claims (command buffers on)."""
  flops = matmul_flops(hlo_text)
  rows, total_ns, total_flops, unmatched = [], 0, 0, 0
  for op, ns in op_ns.items():
    key = kernel_scopes.instruction_of(op, flops)
    if key is None:
      if kernel_scopes.kind_of_kernel_name(op) == "gemm (module unknown)":
        unmatched += ns
      continue
    f, op_name, sig = flops[key]
    total_ns, total_flops = total_ns + ns, total_flops + f * steps
    tflops = f * steps / ns / 1e3 if ns else 0.0
    rows.append([key, kernel_scopes.module_kind(op_name), hlo_memory.scope_of(op_name, 4), sig,
                 round(ns / steps / 1e6, 3), round(f / 1e12, 4), round(tflops, 1),
                 round(tflops / peak_tflops, 3)])
  rows.sort(key=lambda r: -r[4])
  by_kind = collections.defaultdict(lambda: [0.0, 0.0])
  for r in rows:
    by_kind[r[1]][0] += r[4]
    by_kind[r[1]][1] += r[5]
  return {"matmul_ms": round(total_ns / steps / 1e6, 3),
          "matmul_tflop": round(total_flops / steps / 1e12, 3),
          "tflops": round(total_flops / total_ns / 1e3, 1) if total_ns else 0.0,
          "unmatched_gemm_ms": round(unmatched / steps / 1e6, 3),
          "by_kind": {k: [round(ms, 3), round(tf, 3), round(tf / ms * 1e3, 1) if ms else 0.0]
                      for k, (ms, tf) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
          "rows": rows[:top]}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hlo", required=True, help="the step's *after_optimizations.txt")
  p.add_argument("--op_times", required=True, help="JSON {instruction or kernel: ns}")
  p.add_argument("--steps", type=int, required=True, help="profiled steps in op_times")
  p.add_argument("--top", type=int, default=40)
  args = p.parse_args(argv)
  with open(args.hlo) as f:
    text = f.read()
  with open(args.op_times) as f:
    op_ns = json.load(f)
  print(json.dumps(gemm_rates(op_ns, text, args.steps, top=args.top)))


if __name__ == "__main__":
  main()
