"""The repository's own rules: the package's layers import only downwards and in no circle, the
docs and docstrings name only files that exist, and no file speaks of how the work was organised.

Read from the sources (ast and text), nothing is imported or run.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "k3jax")
# What may not import what: the model and its layers and ops know nothing of training, of the
# runtime machinery or of the command line.
FORBIDDEN = {
    "k3jax.model": ("k3jax.training", "k3jax.runtime", "k3jax.cli", "k3jax.train",
                    "k3jax.evaluate", "k3jax.generate"),
    "k3jax.layers": ("k3jax.training", "k3jax.runtime", "k3jax.cli", "k3jax.train",
                     "k3jax.evaluate", "k3jax.generate", "k3jax.model"),
    "k3jax.ops": ("k3jax.training", "k3jax.runtime", "k3jax.cli", "k3jax.train", "k3jax.evaluate",
                  "k3jax.generate", "k3jax.model", "k3jax.layers"),
    "k3jax.runtime": ("k3jax.training", "k3jax.model", "k3jax.layers", "k3jax.cli",
                      "k3jax.train", "k3jax.evaluate", "k3jax.generate"),
    "k3jax.parallel": ("k3jax.training", "k3jax.model", "k3jax.layers", "k3jax.ops",
                       "k3jax.runtime", "k3jax.cli"),
    "k3jax.data": ("k3jax.training", "k3jax.model", "k3jax.runtime", "k3jax.cli"),
}


def _modules(root: str = PACKAGE) -> dict[str, str]:
  """{dotted module name: path} of every .py file of the package."""
  out = {}
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
        out[dotted.removesuffix(".__init__")] = path
  return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
  """The k3jax modules `path` imports (anywhere in the file, function bodies included): for
  `from pkg import name`, the submodule pkg.name when it is one, else pkg itself."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if not node.module.startswith("k3jax"):
        continue
      subs = [f"{node.module}.{alias.name}" for alias in node.names]
      found.update(s for s in subs if s in modules)
      if not all(s in modules for s in subs):
        found.add(node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names if alias.name.startswith("k3jax"))
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    deps = _imports(path, modules) - {name}
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first (except its own packages).
    for dep in list(deps):
      parts = dep.split(".")
      for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in modules and not name.startswith(parent + ".") and parent != name:
          deps.add(parent)
    graph[name] = deps
  return graph


def test_layers_import_only_downwards():
  bad = []
  for name, deps in _graph().items():
    for layer, forbidden in FORBIDDEN.items():
      if name == layer or name.startswith(layer + "."):
        bad += [f"{name} imports {dep}" for dep in sorted(deps)
                if any(dep == f or dep.startswith(f + ".") for f in forbidden)]
  assert not bad, "\n".join(bad)


def test_no_import_circle():
  graph, state, circles = _graph(), {}, []

  def visit(node, path):
    state[node] = "open"
    path.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "open":
        circles.append(" -> ".join(path[path.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, path)
    path.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
  assert not circles, "\n".join(circles)


def test_the_checks_see_a_forbidden_import_and_a_circle(tmp_path):
  """The two checks above on a made-up package: a layer that imports upwards, and a circle."""
  pkg = tmp_path / "k3jax"
  for sub in ("ops", "training"):
    (pkg / sub).mkdir(parents=True)
    (pkg / sub / "__init__.py").write_text("")
  (pkg / "__init__.py").write_text("")
  (pkg / "ops" / "a.py").write_text("from k3jax.training import b\n")
  (pkg / "training" / "b.py").write_text("def f():\n  from k3jax.ops import a\n")
  modules = _modules(str(pkg))
  assert _imports(str(pkg / "ops" / "a.py"), modules) == {"k3jax.training.b"}
  assert _imports(str(pkg / "training" / "b.py"), modules) == {"k3jax.ops.a"}


# ------------------------------------------------------------------------------------------------
# Files named in the docs and the code
# ------------------------------------------------------------------------------------------------

def _tracked_files() -> list[str]:
  out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                       cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
  return [f for f in out if os.path.exists(os.path.join(REPO, f))]


# Where a path may point outside this repository: other projects' sources, and the files a run or
# a benchmark writes (placeholders such as DIR/ or <case> are skipped by the pattern).
EXTERNAL_ROOTS = ("tokamax", "jax", "jaxlib", "flax", "optax", "orbax", "fla", "transformers",
                  "torchtitan", "maxtext", "MaxText", "vllm", "sglang", "triton", "tensorflow",
                  "xla", "torch", "nanodo", "big_vision", "runs", "checkpoints", "plots", "tb",
                  "tmp", "site-packages", "Lib", "lib", "usr", "megatron", "Megatron-LM")
_PATH = re.compile(r"(?<![\w/.$<{-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|gin|sh|ipynb|cfg|toml)|"
                   r"[\w.-]+\.md)(?![\w/])")


def _named_paths(text: str) -> list[str]:
  return [m.group(1) for m in _PATH.finditer(text)]


def _exists(named: str, where: str, files: set[str], basenames: set[str]) -> bool:
  if "/" not in named:                                   # a bare Markdown file name
    return named in basenames
  first = named.split("/")[0]
  if first.isupper():                                    # a placeholder: DIR/config.gin
    return True
  if first in EXTERNAL_ROOTS or first.startswith("."):
    return first != "." or os.path.normpath(os.path.join(os.path.dirname(where), named)) in files
  candidates = [named, os.path.normpath(os.path.join(os.path.dirname(where), named))]
  candidates += [f"{root}/{named}" for root in ("k3jax", "pallas_kernels", "experiments")]
  return any(c in files for c in candidates)


def test_docs_and_docstrings_name_only_files_that_exist():
  files = set(_tracked_files())
  basenames = {os.path.basename(f) for f in files}
  missing = []
  for f in sorted(files):
    # The tests' own sources make up paths of temporary files; RESULTS.md is a record of runs,
    # each naming the files of its commit.
    if not f.endswith((".py", ".md", ".gin", ".sh", ".cfg", ".ipynb")) or (
        f.startswith("tests/") and f.endswith(".py")) or f.endswith("RESULTS.md"):
      continue
    text = open(os.path.join(REPO, f), encoding="utf-8").read()
    for named in _named_paths(text):
      if not _exists(named, f, files, basenames):
        missing.append(f"{f}: {named}")
  assert not missing, "names of files that are not in the repository:\n" + "\n".join(missing)


def test_the_file_check_sees_a_missing_file():
  files = {"k3jax/model/decoder.py", "docs/architecture.md", "README.md"}
  basenames = {os.path.basename(f) for f in files}
  text = ("see docs/architecture.md §3, ARCHITECTURE.md, notes/kda.md, k3jax/model.py, "
          "model/decoder.py, tokamax/_src/ops/x.py, DIR/config.gin and README.md")
  found = [n for n in _named_paths(text) if not _exists(n, "k3jax/x.py", files, basenames)]
  assert found == ["ARCHITECTURE.md", "notes/kda.md", "k3jax/model.py"]


# ------------------------------------------------------------------------------------------------
# The project's voice
# ------------------------------------------------------------------------------------------------

_WORK_PERIODS = re.compile(r"\bsessions? \d|\bsession's\b|\bthis session\b|\bissue \d|"
                           r"\bissues \d+ and \d|\bpre-issue\b|\bissue-\d", re.IGNORECASE)
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_no_file_names_a_numbered_period_of_work():
  hits = []
  for f in _tracked_files():
    if f.endswith((".py", ".md", ".gin", ".sh", ".cfg", ".ipynb", ".toml", ".txt")):
      for number, line in enumerate(open(os.path.join(REPO, f), encoding="utf-8"), 1):
        if f != "tests/test_repository.py" and _WORK_PERIODS.search(line):
          hits.append(f"{f}:{number}: {line.strip()[:100]}")
  assert not hits, "\n".join(hits)


def test_the_readme_has_no_dated_timing():
  text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  assert not _DATE.findall(text), _DATE.findall(text)
  assert len(text.splitlines()) <= 260


@pytest.mark.parametrize("line,bad", [("as in session 17's code", True),
                                      ("(issue 15; calls 2, 4)", True),
                                      ("the pre-issue-15 path", True),
                                      ("RESULTS.md, run 17", False),
                                      ("an XLA issue that crashed", False),
                                      ("(issues 15 and 17)", True),
                                      ("an SM issues 128 a cycle", False)])
def test_the_voice_check(line, bad):
  assert bool(_WORK_PERIODS.search(line)) == bad
