"""README.md's examples run as written.

Every shell block of the README that contains a k3jax command is run here, command by command, in
README order, or is marked as an illustration (`<!-- illustration: why -->` on the line before the
block: one that needs GPUs or a cluster). Only what the commands point at is substituted: run
directories go under a temporary folder, `/data/...` inputs are fixtures made here (a folder of
text files, a JSON Lines file, an .npy of token ids, a SentencePiece model), training stops after
one step (`--max_steps=1`), and the commands use the suite's compilation cache (conftest.py). The
SentencePiece example's `ModelConfig.vocab_size` becomes the fixture model's size, tiny.gin's 257
(a real model's is the README's 32,000), so that its programs are the main job's: compiling them
for a 32,000-token vocabulary at this scale costs ~30 s of CPU and tests nothing the 257-token
ones do not (the tokenizer's check against the vocabulary runs either way). The
set-up commands and the test command are what CI itself runs (`.ci/run`). The Python block that
trains runs in a subprocess with the same substitutions.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")

BLOCK = re.compile(r"(?:<!-- illustration: (?P<why>.*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.S)
# Commands that CI runs itself (.ci/run: the set-up, then the test command).
CI_COMMANDS = (["python3.12", "-m", "venv"], ["pip", "install"], ["python", "-m", "pytest"])
MAX_STEPS = 1
# The SentencePiece fixture's vocabulary: tiny.gin's ModelConfig.vocab_size.
SENTENCEPIECE_VOCAB = 257
VOCAB_BINDING = re.compile(r"^(--gin_bindings=ModelConfig\.vocab_size = )\d+$")


def blocks(text: str) -> list[dict]:
  """The README's fenced blocks in order: {'lang', 'body', 'why' (None unless an illustration),
  'line' (1-based line of the fence)}."""
  out = []
  for m in BLOCK.finditer(text):
    out.append({"lang": m["lang"], "body": m["body"], "why": m["why"],
                "line": text.count("\n", 0, m.start("lang")) + 1})
  return out


def shell_commands(body: str) -> list[list[str]]:
  """The commands of a shell block as argument lists: continuation lines joined, comments and
  `&&` chains split."""
  joined = re.sub(r"\\\n", " ", body)
  commands = []
  for line in joined.splitlines():
    for part in line.split("&&"):
      argv = shlex.split(part, comments=True)
      if argv:
        commands.append(argv)
  return commands


def is_k3jax(argv: list[str]) -> bool:
  return "k3jax" in argv or any(a.startswith("k3jax.") for a in argv[:3])


def test_parser_finds_the_commands_and_the_markers():
  """The parser itself, on a README-like text: a failing check here would make the test below
  run nothing."""
  text = ("x\n```bash\nk3jax train --a=1 \\\n  --b='c d'   # note\npip install -e .\n```\n"
          "<!-- illustration: needs 8 GPUs -->\n```bash\nsrun -N 2 k3jax train\n```\n")
  found = blocks(text)
  assert [b["why"] for b in found] == [None, "needs 8 GPUs"]
  assert shell_commands(found[0]["body"]) == [["k3jax", "train", "--a=1", "--b=c d"],
                                              ["pip", "install", "-e", "."]]
  assert is_k3jax(["srun", "-N", "2", "k3jax", "train"])
  assert is_k3jax(["python", "-m", "k3jax.train"]) and not is_k3jax(["pip", "install"])


def _make_fixtures(root: str) -> dict[str, str]:
  """The README's `/data/...` inputs, made from the standard library's sources (about 1 MB)."""
  sources = []
  stdlib = os.path.dirname(os.__file__)
  for name in sorted(os.listdir(stdlib)):
    if name.endswith(".py"):
      with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
        sources.append(f.read())
    if sum(map(len, sources)) > 1_000_000:
      break
  texts = os.path.join(root, "my_texts")
  os.makedirs(os.path.join(texts, "sub"))
  for i, doc in enumerate(sources):
    with open(os.path.join(texts, "sub" if i % 2 else "", f"doc{i}.txt"), "w",
              encoding="utf-8") as f:
      f.write(doc)
  jsonl = os.path.join(root, "corpus.jsonl")
  with open(jsonl, "w", encoding="utf-8") as f:
    for doc in sources:
      f.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
  ids = os.path.join(root, "ids.npy")  # byte ids, documents separated by the BOS id 256
  np.save(ids, np.concatenate([np.concatenate([[256], np.frombuffer(d.encode(), np.uint8)])
                               for d in sources]).astype(np.int32))
  import sentencepiece as spm  # a test dependency (setup.cfg's [test] extra)
  spm.SentencePieceTrainer.train(input=os.path.join(texts, "doc0.txt"),
                                 model_prefix=os.path.join(root, "sp"),
                                 vocab_size=SENTENCEPIECE_VOCAB,
                                 minloglevel=2)
  return {"/data/my_texts": texts, "/data/corpus.jsonl": jsonl, "/data/ids.npy": ids,
          "/data/sp.model": os.path.join(root, "sp.model")}


def _substitute(arg: str, fixtures: dict[str, str], runs: str) -> str:
  rest = arg
  for placeholder, path in fixtures.items():
    arg, rest = arg.replace(placeholder, path), rest.replace(placeholder, "")
  assert "/data/" not in rest, f"{rest!r}: a /data input the test has no fixture for"
  return re.sub(r"(^|=|'|\")runs/", lambda m: m[1] + runs + "/", arg)


def _k3jax_argv(argv: list[str], fixtures: dict[str, str], runs: str) -> list[str]:
  """The command as the test runs it: the installed `k3jax` script, substituted paths, one
  training step, and with the SentencePiece fixture its vocabulary size."""
  assert argv[0] == "k3jax", f"{argv}: the README's k3jax commands start with k3jax"
  script = os.path.join(os.path.dirname(sys.executable), "k3jax")
  out = [script] + [_substitute(a, fixtures, runs) for a in argv[1:]
                    if not a.startswith("--max_steps=")]
  if any("/data/sp.model" in a for a in argv):
    out = [VOCAB_BINDING.sub(rf"\g<1>{SENTENCEPIECE_VOCAB}", a) for a in out]
  if argv[1] == "train":
    out.append(f"--max_steps={MAX_STEPS}")
  return out


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
  with open(README, encoding="utf-8") as f:
    found = blocks(f.read())
  fixtures = _make_fixtures(str(tmp_path / "data"))
  runs = str(tmp_path / "runs")
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  ran = []
  for block in found:
    where = f"README.md:{block['line']}"
    if block["lang"] in ("bash", "sh", "shell"):
      commands = shell_commands(block["body"])
      if not any(is_k3jax(argv) for argv in commands):
        continue
      if block["why"] is not None:
        assert block["why"].strip(), f"{where}: an illustration marker says why it is not run"
        continue
      for argv in commands:
        if any(argv[:len(c)] == c for c in CI_COMMANDS):
          continue
        assert is_k3jax(argv), (f"{where}: {shlex.join(argv)!r} is neither a k3jax command nor "
                                "one CI runs: run it here or mark the block as an illustration")
        cmd = _k3jax_argv(argv, fixtures, runs)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (where, shlex.join(cmd), proc.stdout[-3000:],
                                      proc.stderr[-3000:])
        if argv[1] == "train":
          assert f"stopped at step {MAX_STEPS} of" in proc.stdout, (where, proc.stdout[-2000:])
        ran.append(argv[1])
    elif block["lang"] == "python" and "k3jax" in block["body"] and block["why"] is None:
      code = _substitute(block["body"], fixtures, runs)
      code = re.sub(r"max_steps=\d+", f"max_steps={MAX_STEPS}", code)
      proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=900)
      assert proc.returncode == 0, (where, code, proc.stderr[-3000:])
      ran.append("python")
  # The main job, its evaluate and generate, the four data examples, the Python example: a README
  # that lost them (or a parser that stopped finding them) fails here.
  assert ran.count("train") >= 5 and "evaluate" in ran and "generate" in ran \
      and "python" in ran, ran
  shutil.rmtree(runs)
