r"""What a compiled program holds at its memory peak, read from XLA's dump files.

With `XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`, XLA writes for each compiled module a
`*after_optimizations-live-range.txt` (the scheduled buffers' live ranges, the buffers alive at the
peak and a breakdown of the peak by op_name) and `*after_optimizations.txt` (the optimised HLO, whose
instructions carry the op_name of the JAX operation they come from). `peak_report(DIR, 'train_step')`
turns them into the largest buffers at the peak, each with its shape and op_name, and the peak summed
by model scope (the Flax module path in the op_name, e.g. `scanned_period_0/layer_2/moe`).

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python my_script.py
  python experiments/benchmarks/hlo_memory.py /tmp/dump --module=train_step
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_PEAK_LINE = re.compile(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?(?:\[[^\]]*\])?(?:\{[^}]*\})?|\([^=]*?\)) ")
# The JAX source of an HLO instruction (its metadata); hlo_copies.py reads it the same way.
OP_NAME = re.compile(r'op_name="([^"]*)"')
# Wrappers JAX puts around an op's name under transformations: jvp(...), transpose(...), etc.
_TRANSFORM = re.compile(r"\b(?:jvp|transpose|vmap|checkpoint|remat|custom_jvp_call|"
                        r"custom_vjp_call|closed_call|core_call)\(([^()]*)\)")
# Path parts that are control flow or nested jits, not model scopes.
_SKIP_PART = re.compile(r"^(?:jit\(.*\)|while|body|cond|scan|checkpoint|rematted_computation|"
                        r"call_exported|eval_jaxpr)$")


def module_files(dump_dir: str, module: str) -> tuple[str, str]:
  """(live-range file, optimised HLO file) of the largest dumped module whose name has `module`."""
  ranges = [f for f in glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt"))
            if module in os.path.basename(f)]
  if not ranges:
    raise FileNotFoundError(f"no *after_optimizations-live-range.txt for a module named like "
                            f"{module!r} in {dump_dir} (was XLA_FLAGS set before jax started?)")
  live_range = max(ranges, key=os.path.getsize)
  hlo = live_range.replace("-live-range.txt", ".txt")
  return live_range, hlo


def peak_buffers(live_range_text: str) -> list[tuple[str, int]]:
  """[(buffer name, bytes)] of the 'Live ranges at N (peak)' section, largest first."""
  out, inside = [], False
  for line in live_range_text.splitlines():
    if _PEAK_HEADER.match(line):
      inside = True
      continue
    if inside:
      m = _PEAK_LINE.match(line)
      if not m:
        break
      out.append((m.group(1), int(m.group(2))))
  return sorted(out, key=lambda x: -x[1])


def instruction_info(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (shape, op_name)} of the optimised HLO text."""
  info = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      op = OP_NAME.search(line)
      info[m.group(1)] = (m.group(2), op.group(1) if op else "")
  return info


def scope_of(op_name: str, depth: int = 3) -> str:
  """The model scope of an op_name: transformation wrappers unwrapped, the `jit(...)` prefix and
  the primitive's name dropped, at most `depth` path parts from the first module name.

  'jit(train_step)/transpose(jvp(K3Model))/scanned_period_0/layer_2/moe/dot_general'
  -> 'K3Model/scanned_period_0/layer_2' (depth 3).
  """
  text = op_name.split(";")[0]
  for _ in range(8):
    new = _TRANSFORM.sub(r"\1", text)
    if new == text:
      break
    text = new
  parts = [p for p in text.split("/") if p]
  parts = parts[:-1] if len(parts) > 1 else parts  # the last part is the primitive
  kept = []
  for part in parts:  # nn.scan repeats its module's name: keep one
    if not _SKIP_PART.match(part) and (not kept or kept[-1] != part):
      kept.append(part)
  return "/".join(kept[:depth]) or "(no op_name)"


def peak_report(dump_dir: str, module: str = "train_step", top: int = 25, depth: int = 3) -> dict:
  """{'peak_gib', 'buffers': [[gib, name, shape, op_name], ...] (top), 'scopes': [[gib, scope],
  ...]} of the largest module named like `module` in `dump_dir` (see the module docstring)."""
  live_range, hlo = module_files(dump_dir, module)
  with open(live_range) as f:
    peak = peak_buffers(f.read())
  info = {}
  if os.path.exists(hlo):
    with open(hlo) as f:
      info = instruction_info(f.read())
  gib = lambda n: round(n / 2**30, 3)
  scopes = collections.Counter()
  rows = []
  for name, size in peak:
    shape, op_name = info.get(name, ("?", ""))
    scopes[scope_of(op_name, depth)] += size
    rows.append([gib(size), name, shape, op_name[:200]])
  return {"module": os.path.basename(live_range), "peak_gib": gib(sum(s for _, s in peak)),
          "buffers": rows[:top], "scopes": [[gib(s), k] for k, s in scopes.most_common(top)]}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dump_dir")
  p.add_argument("--module", default="train_step")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--depth", type=int, default=3)
  args = p.parse_args(argv)
  print(json.dumps(peak_report(args.dump_dir, args.module, args.top, args.depth), indent=1))


if __name__ == "__main__":
  main()
