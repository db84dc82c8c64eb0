r"""Why did a launch trace again? The lowered cache's entries of each function and how their keys
differ (`k3jax.runtime.lowered_cache`).

A warm launch that traces a program again (a slow `trace_lower_s` in train_bench, a long
"lowered in" in the training log) wrote a second entry for the same function. For every function
with several entries in the folder this lists them by creation time and, for each one after the
first, the key fields in which it differs from the one before (e.g. `environment/sources`: a
source file changed; `args[12]`: that argument's shape, dtype, weak type or sharding;
`trace_context`: a JAX config flag or context manager).

  python experiments/benchmarks/lowered_cache_keys.py <--compilation_cache_dir>/lowered
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from k3jax.runtime import lowered_cache  # noqa: E402


def key_differences(a, b, path: str = "") -> list[str]:
  """The paths at which two parsed keys differ, with both values (shortened) for the leaves."""
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for k in sorted(set(a) | set(b)):
      if a.get(k) != b.get(k):
        out += key_differences(a.get(k), b.get(k), f"{path}/{k}")
    return out
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
      if x != y:
        out += key_differences(x, y, f"{path}[{i}]")
    return out
  return [f"{path}: {json.dumps(a)[:200]} -> {json.dumps(b)[:200]}"]


def report(folder: str) -> dict[str, list]:
  """{function: [(entry file, creation time, differences from the previous entry)]} for the
  functions with more than one entry."""
  entries = collections.defaultdict(list)
  for name in sorted(os.listdir(folder)):
    if not name.endswith(lowered_cache.ENTRY_SUFFIX):
      continue
    header = lowered_cache.read_header(os.path.join(folder, name))
    entries[header["function"]].append((header.get("created", 0.0), name,
                                        json.loads(header["key"])))
  out = {}
  for function, items in entries.items():
    if len(items) < 2:
      continue
    items.sort()
    rows, previous = [], None
    for created, name, key in items:
      rows.append((name, created, [] if previous is None else key_differences(previous, key)))
      previous = key
    out[function] = rows
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("folder", help="the lowered cache folder (<compilation cache>/lowered)")
  args = p.parse_args(argv)
  found = report(args.folder)
  if not found:
    print(f"no function has more than one entry in {args.folder}")
  for function, rows in found.items():
    print(f"{function}: {len(rows)} entries")
    for name, created, diffs in rows:
      print(f"  {name[:16]}  created {created:.0f}" + ("" if diffs else "  (first)"))
      for line in diffs:
        print(f"    {line}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
