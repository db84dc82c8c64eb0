r"""What a compiled training step carries from its forward pass to its backward pass, read from the
optimised HLO (XLA's `*after_optimizations.txt` dump, or `jax.jit(...).lower(...).compile().as_text()`).

An instruction of the entry computation is the forward's when its op_name has no `transpose(` (JAX
names the backward's operations `.../transpose(jvp(...))/...`); `forward_to_backward` lists every
forward instruction whose value a backward instruction reads, directly or through
get-tuple-element, bitcast and tuple, with the bytes of its floating-point outputs by dtype. Those
arrays are written by the forward and read by the backward: the step's saved activations as XLA
compiled them, which is not always what the custom VJPs keep. When a VJP's backward recomputes
an expression that the forward also computes, XLA's common-subexpression elimination merges the
two and the forward's fp32 intermediate becomes a residual (RESULTS.md run 16: situ_glu's tanh,
12.2 GiB a step on small.gin). `jax.lax.optimization_barrier` on the backward's residuals stops it.

  python experiments/benchmarks/hlo_fwd_bwd.py DUMP/module_XXXX.jit_train_step...after_optimizations.txt
      [--dtype=f32] [--top=30] [--depth=3]

prints JSON lines: the GiB of the chosen dtype carried from forward to backward ('total'), then
by scope ('scope': hlo_memory.scope_of plus the op's primitive, layer numbers folded into
'layer_*' unless --per_layer), then the largest instructions ('row': GiB, instruction, shape,
op_name, first backward reader).
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import hlo_memory

_ENTRY = re.compile(r"^ENTRY [^\n]*\{\n(.*?)\n\}", re.M | re.S)
# name, result shape (an array or a tuple), opcode, operand list.
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*?)\)(?:, |$)")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_PASS_THROUGH = ("get-tuple-element", "bitcast", "tuple")


def bytes_by_dtype(shape: str) -> collections.Counter:
  """{dtype: bytes} of an HLO result shape (an array or a tuple of arrays)."""
  out = collections.Counter()
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    out[dtype] += n * _BYTES[dtype]
  return out


def _entry_instructions(hlo_text: str) -> dict[str, tuple[str, str, list[str], str]]:
  match = _ENTRY.search(hlo_text)
  if match is None:
    raise ValueError("no ENTRY computation in the HLO text")
  out = {}
  for line in match.group(1).splitlines():
    m = _LINE.match(line)
    if m is None:
      continue
    name, shape, opcode, operands = m.groups()
    op_name = hlo_memory.OP_NAME.search(line)
    out[name] = (shape, opcode, re.findall(r"%([\w.\-]+)", operands),
                 op_name.group(1) if op_name else "")
  return out


def _is_backward(op_name: str) -> bool:
  return "transpose(" in op_name


def forward_to_backward(hlo_text: str) -> list[dict]:
  """One dict per forward instruction of the entry computation that the backward reads: 'name',
  'shape', 'op_name', 'bytes' ({dtype: bytes} of its result), 'readers' (backward instructions),
  largest first by floating-point bytes."""
  insts = _entry_instructions(hlo_text)
  users = collections.defaultdict(list)
  for name, (_, _, operands, _) in insts.items():
    for operand in operands:
      users[operand].append(name)
  rows = []
  for name, (shape, opcode, _, op_name) in insts.items():
    if not op_name or _is_backward(op_name) or opcode in ("parameter", "constant") + _PASS_THROUGH:
      continue
    readers, frontier, seen = set(), [name], {name}
    while frontier:
      for user in users[frontier.pop()]:
        if user in seen:
          continue
        seen.add(user)
        _, user_opcode, _, user_op_name = insts[user]
        if user_opcode in _PASS_THROUGH:
          frontier.append(user)
        elif _is_backward(user_op_name):
          readers.add(user)
    if readers:
      rows.append(dict(name=name, shape=shape, op_name=op_name, bytes=dict(bytes_by_dtype(shape)),
                       readers=sorted(readers)))
  floating = lambda r: sum(v for k, v in r["bytes"].items() if k.startswith(("f", "bf")))
  return sorted(rows, key=lambda r: -floating(r))


def report(hlo_text: str, dtype: str = "f32", top: int = 30, depth: int = 3,
           per_layer: bool = False) -> dict:
  """{'total_gib', 'scopes': [[GiB, scope], ...], 'rows': [[GiB, name, shape, op_name, reader]]}
  of the forward outputs of `dtype` that the backward reads (see the module docstring)."""
  gib = lambda n: round(n / 2**30, 3)
  rows = [r for r in forward_to_backward(hlo_text) if r["bytes"].get(dtype)]
  rows.sort(key=lambda r: -r["bytes"][dtype])
  scopes = collections.Counter()
  for r in rows:
    primitive = r["op_name"].split(";")[0].rstrip("/").split("/")[-1]
    scope = hlo_memory.scope_of(r["op_name"], depth)
    if not per_layer:
      scope = re.sub(r"\blayer_\d+\b", "layer_*", scope)
    scopes[f"{scope}/{primitive}"] += r["bytes"][dtype]
  return {"dtype": dtype, "total_gib": gib(sum(r["bytes"][dtype] for r in rows)),
          "scopes": [[gib(b), s] for s, b in scopes.most_common(top)],
          "rows": [[gib(r["bytes"][dtype]), r["name"], r["shape"][:120], r["op_name"][-160:],
                    r["readers"][0]] for r in rows[:top]]}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("hlo_file", help="an optimised HLO text file (*after_optimizations.txt)")
  p.add_argument("--dtype", default="f32")
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--depth", type=int, default=3)
  p.add_argument("--per_layer", action="store_true", help="one scope per layer")
  args = p.parse_args(argv)
  with open(args.hlo_file) as f:
    result = report(f.read(), args.dtype, args.top, args.depth, args.per_layer)
  print(json.dumps({"total": result["total_gib"], "dtype": result["dtype"]}))
  for gib, scope in result["scopes"]:
    print(json.dumps({"scope": scope, "gib": gib}))
  for row in result["rows"]:
    print(json.dumps({"row": row}))


if __name__ == "__main__":
  main()
