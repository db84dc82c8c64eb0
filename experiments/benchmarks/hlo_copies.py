r"""The copies a compiled program makes at run time, read from XLA's optimised HLO dump (GPU).

Three kinds of HLO become device-to-device memcpys on GPU (`MemcpyD2D` in a profile, or memcpy
nodes of a CUDA graph, e.g. the `memcpy128` kernel):

  copy            a `copy` (or `copy-start`) outside any fusion. XLA's copy insertion adds them
                  where a buffer cannot be shared: a while loop's initial value that another user
                  still needs (e.g. one zero broadcast, CSE'd, that initialises several loops'
                  stacked outputs), a carry read after the body overwrote it, a parameter that is
                  not donated. In the entry computation XLA's CopyFusion pass folds copies of a
                  fusion's result into that fusion (they become extra outputs, no memcpy); inside
                  while bodies it does not, so they stay memcpys there.
  dynamic-memcpy  a fusion that only dynamic-slices a contiguous slice out of a parameter, or
                  dynamic-update-slices a parameter into one in place (XLA's DynamicMemcpyFusion:
                  a scan reading its stacked weights or residuals, writing its stacked outputs).
                  XLA runs them on a side stream: `async-start` of such a fusion; a fusion that
                  qualifies by shape but is not wrapped is listed as `dynamic-memcpy?` (whether its
                  offsets are functions of a loop counter is only known to XLA).
  memcpy-fusion   a fusion whose every root is copy(parameter) with the same layout.

`copies_report` lists them with the bytes each moves per run of the program: its bytes (the
copied or sliced shape) times the trip counts of the while loops around it (the known_trip_count
XLA writes into each while's backend_config), and names the JAX source that makes it. A `copy`
carries no op_name of its own, so a row gives the op_names around it: of the instruction it copies
(`src_op`) and of its users (`user_op`); when it copies a loop-carried value (a parameter of a
while body), `carry` says which while and tuple index, and `src_op` is the op_name of what the
body writes back to that index. A memcpy reads and writes its bytes: its memory traffic is twice
`bytes_per_step`.

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python my_script.py
  python experiments/benchmarks/hlo_copies.py /tmp/dump --module=train_step --top=40

prints one JSON line per copy, largest `bytes_per_step` first, then a summary line (`"summary":
true`) with the totals by kind and by source.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import math
import os
import re

import hlo_memory

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION_HEAD = re.compile(r"^\s+(ROOT )?%?([\w.\-]+) = ")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_LAYOUT = re.compile(r"\]\{([\d,]*)")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|f8e4m3|"
                    r"f8e4m3fnuz|f8e5m2fnuz|f8e3m4|f8e8m0fnu|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128}


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: `operands` are (instruction name, tuple index or None) pairs; `called`
  are (role, computation name) pairs: role one of calls, body, condition, to_apply, branch."""
  name: str
  shape: str
  opcode: str
  operands: list
  called: list
  op_name: str
  trip_count: int | None
  is_root: bool


@dataclasses.dataclass
class Computation:
  name: str
  is_entry: bool
  instructions: dict  # name -> Instruction, in text order

  @property
  def root(self) -> Instruction | None:
    return next((i for i in self.instructions.values() if i.is_root), None)


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape text, tuples summed: 'bf16[2,3]{1,0}' -> 12; 'f32[]' -> 4."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    total += math.prod(int(d) for d in dims.split(",") if d) * _BITS.get(dtype, 8) // 8
  return total


def array_dims(shape: str) -> tuple[list[int], list[int]]:
  """(dimensions, minor_to_major layout) of an array shape text; 'f32[2,3]{0,1}' -> ([2, 3],
  [0, 1]); without a printed layout the default (row-major) one."""
  m = _ARRAY.search(shape)
  if m is None:
    raise ValueError(f"not an array shape: {shape!r}")
  dims = [int(d) for d in m.group(2).split(",") if d]
  layout = _LAYOUT.search(shape[m.start():])
  minor_to_major = ([int(d) for d in layout.group(1).split(",") if d] if layout
                    else list(range(len(dims)))[::-1])
  return dims, minor_to_major


def is_contiguous_slice(full: str, part: str) -> bool:
  """Whether slice shape `part` of array shape `full` is one contiguous block of memory: from the
  most minor dimension up, full dimensions, then at most one partial one, then only size 1."""
  dims, minor_to_major = array_dims(full)
  sizes, _ = array_dims(part)
  if len(dims) != len(sizes):
    raise ValueError(f"slice {part!r} and array {full!r} differ in rank")
  partial = False
  for d in minor_to_major:
    if partial and sizes[d] != 1:
      return False
    partial = partial or sizes[d] != dims[d]
  return True


def _split_shape(rest: str) -> tuple[str, str]:
  """(shape text, the text after it) of an instruction's right-hand side."""
  if rest.startswith("("):
    shape, after = _balanced(rest)
    return f"({shape})", after
  shape, _, after = rest.partition(" ")
  return shape, " " + after


def _balanced(text: str) -> tuple[str, str]:
  """(inside the parentheses `text` starts with, the text after the closing one)."""
  depth = 0
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return text[1:i], text[i + 1:]
  raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def parse_instruction(line: str) -> Instruction | None:
  """The Instruction of one line of HLO text, None for lines that are not instructions."""
  head = _INSTRUCTION_HEAD.match(line)
  if not head:
    return None
  text = _COMMENT.sub("", line[head.end():])
  shape, rest = _split_shape(text)
  opcode = _OPCODE.match(rest)
  if not opcode:
    return None
  inside, attrs = _balanced(rest[opcode.end() - 1:])
  operands = [(m.group(1), int(m.group(2)) if m.group(2) else None)
              for m in _OPERAND.finditer(inside)]
  called = _CALLED.findall(attrs)
  for branches in _BRANCHES.findall(attrs):
    called += [("branch", b.strip().lstrip("%")) for b in branches.split(",") if b.strip()]
  op_name = hlo_memory.OP_NAME.search(attrs)
  trip = _TRIP_COUNT.search(attrs)
  return Instruction(head.group(2), shape, opcode.group(1), operands, called,
                     op_name.group(1) if op_name else "", int(trip.group(1)) if trip else None,
                     bool(head.group(1)))


def parse_module(hlo_text: str) -> dict[str, Computation]:
  """{computation name: Computation} of an HLO module's text."""
  computations, current = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = Computation(header.group(2), bool(header.group(1)), {})
      computations[current.name] = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      inst = parse_instruction(line)
      if inst is not None:
        current.instructions[inst.name] = inst
  if not any(c.is_entry for c in computations.values()):
    raise ValueError("no ENTRY computation in the HLO text (is it an HLO module dump?)")
  return computations


def execution_counts(computations: dict[str, Computation]) -> tuple[dict, dict, set, set]:
  """({computation: executions per run of the entry}, {computation: ['while_name xN', ...], the
  while loops around it, outermost first}, {computations called by fusions}, {computations called
  by async-start}).

  A while body runs N times per execution of its while (N: its known_trip_count), its condition
  N + 1 times; a while without known_trip_count raises (the bytes would be a guess). Conditional
  branches count as if each ran (an upper bound).
  """
  entry = next(c.name for c in computations.values() if c.is_entry)
  counts, loops, fused, async_bodies = {entry: 1}, {entry: []}, set(), set()
  order = [entry]
  for name in order:  # callers before callees; a computation called twice sums its counts
    for inst in computations[name].instructions.values():
      for role, callee in inst.called:
        if callee not in computations:
          raise ValueError(f"{inst.name} calls {callee!r}, which is not in the module text")
        if inst.opcode == "fusion":
          fused.add(callee)
        if inst.opcode == "async-start":
          async_bodies.add(callee)
        times, around = counts[name], loops[name]
        if inst.opcode == "while":
          if inst.trip_count is None:
            raise ValueError(f"while {inst.name} in {name} has no known_trip_count: its copies' "
                             "bytes per step cannot be counted")
          times *= inst.trip_count + (role == "condition")
          around = around + [f"{inst.name} x{inst.trip_count}"]
        if callee not in counts:
          order.append(callee)
          counts[callee], loops[callee] = 0, around
        counts[callee] += times
  return counts, loops, fused, async_bodies


def shape_of(comp: Computation, name: str, index: int | None) -> str:
  """The shape text of value `name`(#index) in `comp` (a tuple element's when index is given)."""
  inst = comp.instructions.get(name)
  if inst is None:
    raise ValueError(f"{name} is not an instruction of {comp.name}")
  if index is None or not inst.shape.startswith("("):
    return inst.shape
  depth, start, element = 0, 1, 0
  for i, ch in enumerate(inst.shape):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
      if element == index:
        return inst.shape[start:i].strip()
      element, start = element + 1, i + 1
  raise ValueError(f"{name} has no tuple element {index}: {inst.shape[:200]}")


def _skip_bitcast(comp: Computation, inst: Instruction) -> Instruction:
  while inst.opcode == "bitcast" and inst.operands:
    inst = comp.instructions[inst.operands[0][0]]
  return inst


def fusion_memcpy(fusion: Instruction, computations: dict[str, Computation]
                  ) -> tuple[str, int] | None:
  """('dynamic-memcpy' or 'memcpy-fusion', bytes copied) when XLA emits `fusion` as a memcpy
  (see the module docstring), else None."""
  fused = computations[dict(fusion.called)["calls"]]
  root = fused.root
  if root is None:
    return None
  roots = ([fused.instructions[n] for n, _ in root.operands] if root.opcode == "tuple"
           else [root])
  if all(r.opcode == "copy" and fused.instructions[r.operands[0][0]].opcode == "parameter"
         and array_dims(r.shape) == array_dims(fused.instructions[r.operands[0][0]].shape)
         for r in roots):
    return "memcpy-fusion", sum(shape_bytes(r.shape) for r in roots)
  if len(roots) != 1:
    return None
  slice_ = _skip_bitcast(fused, roots[0])
  if slice_.opcode not in ("dynamic-slice", "dynamic-update-slice"):
    return None
  sliced = 1 if slice_.opcode == "dynamic-slice" else 2  # operands before the offsets
  if any(_skip_bitcast(fused, fused.instructions[n]).opcode != "parameter"
         for n, _ in slice_.operands[:sliced]):
    return None
  full = fused.instructions[slice_.operands[0][0]].shape
  part = (slice_.shape if slice_.opcode == "dynamic-slice"
          else fused.instructions[slice_.operands[1][0]].shape)
  if not is_contiguous_slice(full, part):
    return None
  return "dynamic-memcpy", shape_bytes(part)


def _while_of_body(computations: dict[str, Computation]) -> dict[str, Instruction]:
  return {callee: inst for c in computations.values() for inst in c.instructions.values()
          if inst.opcode == "while" for role, callee in inst.called if role == "body"}


def _producer_op_name(comp: Computation, name: str, index: int | None, depth: int = 6) -> str:
  """The op_name of what makes value `name`(#index), looking through tuples, bitcasts, copies."""
  inst = comp.instructions.get(name)
  while inst is not None and depth > 0:
    depth -= 1
    if inst.opcode == "tuple" and index is not None and index < len(inst.operands):
      name, index = inst.operands[index]
    elif inst.opcode in ("bitcast", "copy", "get-tuple-element") and inst.operands:
      name, index = inst.operands[0]
    else:
      return inst.op_name
    inst = comp.instructions.get(name)
  return ""


def find_copies(hlo_text: str) -> list[dict]:
  """One dict per run-time copy of the module (see the module docstring), largest bytes_per_step
  first: name, kind (copy, copy-start, dynamic-memcpy, dynamic-memcpy?, memcpy-fusion),
  computation, shape, bytes (one execution), trips (executions per run of the program),
  bytes_per_step, loops (the whiles around it, outermost first), src (the copied value and its
  opcode), src_op, user_op, carry."""
  computations = parse_module(hlo_text)
  counts, loops, fused, async_bodies = execution_counts(computations)
  body_while = _while_of_body(computations)
  rows = []
  for comp in computations.values():
    if comp.name in fused or comp.name not in counts:
      continue
    users = collections.defaultdict(list)
    for inst in comp.instructions.values():
      for operand, _ in inst.operands:
        users[operand].append(inst)
    for inst in comp.instructions.values():
      if inst.opcode in ("copy", "copy-start"):
        kind = inst.opcode
        src_name, src_index = inst.operands[0]
        size = shape_bytes(shape_of(comp, src_name, src_index))
      elif inst.opcode == "fusion":
        memcpy = fusion_memcpy(inst, computations)
        if memcpy is None:
          continue
        kind, size = memcpy
        if kind == "dynamic-memcpy" and comp.name not in async_bodies:
          kind = "dynamic-memcpy?"  # XLA wraps the ones it emits as memcpys in async-start
        src_name, src_index = inst.name, None
      else:
        continue
      src = comp.instructions.get(src_name)
      carry, src_op = "", _producer_op_name(comp, src_name, src_index)
      if (inst.opcode != "fusion" and src is not None and src.opcode == "parameter"
          and comp.name in body_while):
        carry = f"{body_while[comp.name].name}#{src_index}"
        root = comp.root
        if root is not None and root.opcode == "tuple" and src_index is not None:
          src_op = _producer_op_name(comp, *root.operands[src_index]) or src_op
      # A copy into a while's initial tuple: the while is the user that names the source.
      direct = users.get(inst.name, [])
      around = direct + [u2 for u in direct if u.opcode == "tuple" for u2 in users.get(u.name, [])]
      user_ops = sorted({u.op_name for u in around if u.op_name})
      rows.append({
          "name": inst.name, "kind": kind, "computation": comp.name, "shape": inst.shape,
          "bytes": size, "trips": counts[comp.name], "bytes_per_step": size * counts[comp.name],
          "loops": loops[comp.name],
          "src": f"{src_name}{'' if src_index is None else f'#{src_index}'}"
                 f" ({src.opcode if src is not None else '?'})",
          "src_op": src_op, "user_op": user_ops[0] if user_ops else "", "carry": carry})
  return sorted(rows, key=lambda r: (-r["bytes_per_step"], r["name"]))


def _strip_wrappers(op_name: str) -> str:
  return "/".join(p for p in op_name.split("/") if p and not p.startswith("jit(")
                  and p not in ("call_exported", "eval_jaxpr"))


def source_of(row: dict) -> str:
  """A short source key of a copy row: the op_name of what it copies without the `jit(...)`,
  `call_exported` and `eval_jaxpr` wrappers; when that names no operation (a broadcast that JAX's
  export left with the bare wrapper), 'init of ' the op_name of its user (e.g. the while loop
  whose initial value it is)."""
  own = _strip_wrappers(row["src_op"])
  if own:
    return own
  user = _strip_wrappers(row["user_op"])
  return f"init of {user}" if user else (row["src_op"] or "(no op_name)")


def copies_report(hlo_text: str, top: int = 40) -> tuple[list[dict], dict]:
  """(the `top` largest copies, a summary: their count and bytes per step, and [GiB, key] lists,
  largest first, by kind, by place ('kind in' the loops around it) and by source.)"""
  rows = find_copies(hlo_text)
  gib = lambda n: round(n / 2**30, 3)
  by = {key: collections.Counter() for key in ("kind", "place", "source")}
  for row in rows:
    by["kind"][row["kind"]] += row["bytes_per_step"]
    place = " > ".join(row["loops"]) or "no loop"
    by["place"][f"{row['kind']} in {place}"] += row["bytes_per_step"]
    by["source"][source_of(row)] += row["bytes_per_step"]
  total = sum(r["bytes_per_step"] for r in rows)
  summary = {"summary": True, "copies": len(rows), "bytes_per_step": total,
             "gib_per_step": gib(total)}
  for key, counter in by.items():  # every kind (a handful); the `top` places and sources
    most = counter.most_common(None if key == "kind" else top)
    summary[f"by_{key}"] = [[gib(b), k] for k, b in most]
  return rows[:top], summary


def hlo_file(path: str, module: str) -> str:
  """`path` itself when it is a file, else the largest `*after_optimizations.txt` in the folder
  whose name has `module`."""
  if os.path.isfile(path):
    return path
  files = [f for f in glob.glob(os.path.join(path, "*after_optimizations.txt"))
           if module in os.path.basename(f)]
  if not files:
    raise FileNotFoundError(f"no *after_optimizations.txt for a module named like {module!r} in "
                            f"{path} (was XLA_FLAGS='--xla_dump_hlo_as_text' set?)")
  return max(files, key=os.path.getsize)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dump", help="an XLA dump folder or one *after_optimizations.txt file")
  p.add_argument("--module", default="train_step")
  p.add_argument("--top", type=int, default=40)
  args = p.parse_args(argv)
  with open(hlo_file(args.dump, args.module)) as f:
    rows, summary = copies_report(f.read(), args.top)
  for row in rows:
    print(json.dumps(row))
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
