"""Helpers shared by the tests (tests/ is on sys.path through setup.cfg's pytest `pythonpath`)."""

import functools
import importlib.util
import os
import sys

import numpy as np

# A very small K3 (one KDA + one MLA layer, 4 experts) in two short stages of 64 tokens a step, on
# 200 kB of the builtin corpus: what the training, evaluation and run-directory tests train.
TINY_RUN_BINDINGS = [
    "ModelConfig.vocab_size = 257", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
    "ModelConfig.mla_every = 2", "ModelConfig.kda_num_heads = 2", "ModelConfig.kda_head_dim = 16",
    "ModelConfig.kda_value_dim = 16", "ModelConfig.kda_chunk_size = 16",
    "ModelConfig.mla_num_heads = 2", "ModelConfig.mla_kv_lora_rank = 16",
    "ModelConfig.mla_qk_nope_dim = 16", "ModelConfig.mla_qk_rope_dim = 8",
    "ModelConfig.mla_v_dim = 16", "ModelConfig.dense_ffn_dim = 32",
    "ModelConfig.moe_num_experts = 4", "ModelConfig.moe_top_k = 2", "ModelConfig.moe_latent_dim = 16",
    "ModelConfig.moe_expert_dim = 16", "ModelConfig.moe_shared_dim = 16",
    "StagesConfig.stages = ((16, 3), (32, 3))", "StagesConfig.tokens_per_step = 64",
    "DataConfig.max_bytes = 200000",
]


@functools.lru_cache(maxsize=None)
def tiny_variables(cfg, impl=None) -> dict:
  """Unboxed variables of K3Model(cfg, impl) (a ModelConfig and an ImplConfig, default
  ImplConfig(); its scan_layers decides the layout) from PRNGKey(0), compiled once per config:
  the values of `model.init` (test_model's test_init_variables_equals_model_init; they do not
  depend on the token shape). Eagerly, every initialiser would be compiled on its own (a six-layer
  tiny model: 14.8 s against 3.2 s). Shared between callers: do not mutate."""
  # Imported here: the tests' subprocess scripts import this module for its bindings alone.
  import flax.linen as nn
  import jax
  from k3jax.config import ImplConfig
  from k3jax.model import init_variables
  init = jax.jit(functools.partial(init_variables, impl=ImplConfig() if impl is None else impl),
                 static_argnums=(0, 2, 3))
  return nn.meta.unbox(init(cfg, jax.random.PRNGKey(0), 1, 8))


def random_variables(cfg, impl, seed: int) -> dict:
  """Random values, drawn in numpy, for every variable of K3Model(cfg, impl): the distributions
  of the initialisers (weights N(0, init_std²), KDA's A_log = log U(1, 16), dt_bias from
  dt log-uniform in [1e-3, 1e-1], the convolutions' U(-1/2, 1/2)), except that the norm gains are
  1 + N(0, 0.1²) and the zero-initialised DepthMix queries and QB biases N(0, 0.3²) (so that the
  mixes are not uniform and routing depends on the bias). Compiling the initialisers instead
  (`tiny_variables`) costs as much CPU as a forward pass of the tests' decoders."""
  import flax.linen as nn
  import jax
  from k3jax.model import init_variables
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: nn.meta.unbox(init_variables(cfg, jax.random.PRNGKey(0),
                                                               impl=impl)))

  def value(path, x):
    name = jax.tree_util.keystr(path)
    if name.endswith("['query']") or name.endswith("['bias']"):
      v = 0.3 * rng.standard_normal(x.shape)
    elif name.endswith("['scale']") or name.endswith("['o_norm']"):
      v = 1 + 0.1 * rng.standard_normal(x.shape)
    elif name.endswith("['A_log']"):
      v = np.log(rng.uniform(1, 16, x.shape))
    elif name.endswith("['dt_bias']"):
      dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), x.shape))
      v = dt + np.log(-np.expm1(-dt))
    elif name.endswith("_conv']['kernel']"):
      v = rng.uniform(-0.5, 0.5, x.shape)
    else:
      v = cfg.init_std * rng.standard_normal(x.shape)
    return np.asarray(v, x.dtype)
  return jax.tree_util.tree_map_with_path(value, shapes)


def random_like(shapes, seed: int, scale: float = 1.0):
  """Numpy arrays of random values with the shapes and dtypes of the pytree `shapes` (arrays or
  ShapeDtypeStructs), drawn leaf by leaf in tree order: floating leaves scale·N(0, 1), integer
  ones uniform in [1, 1000). For tests that need a state of the right shapes whose leaves all
  differ, without compiling an initialiser."""
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)

  def value(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return (scale * rng.standard_normal(x.shape)).astype(x.dtype)
    return rng.integers(1, 1000, size=x.shape).astype(x.dtype)
  return jax.tree.map(value, shapes)


def error_ratio(a, b) -> float:
  """RMS(a − b) / RMS(b) in float64 (fla's metric); NaN or inf anywhere fails."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
  denom = np.sqrt(np.mean(b * b))
  num = np.sqrt(np.mean((a - b) ** 2))
  return float(num / denom) if denom > 0 else float(num)


def load_benchmark(name: str):
  """The module experiments/benchmarks/<name>.py (benchmarks are scripts, not a package)."""
  return load_experiment("benchmarks", name)


def load_experiment(folder: str, name: str):
  """The module experiments/<folder>/<name>.py (the experiments are scripts, not packages), as
  sys.modules['experiments.<folder>.<name>']: dataclasses look their module up there while the
  class is made."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                      folder, f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"experiments.{folder}.{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def write_xspace(folder, text_proto: str) -> str:
  """A profiler trace folder under `folder` (a pathlib.Path) holding the XSpace `text_proto`, laid
  out as jax.profiler writes it (plugins/profile/<run>/<host>.xplane.pb); returns the folder."""
  from jax.profiler import ProfileData
  run = folder / "plugins" / "profile" / "run1"
  run.mkdir(parents=True)
  (run / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(text_proto))
  return str(folder)


def segment_attention(q, k, v, segment_ids, *, causal: bool, scale: float,
                      zero_padding: bool = False):
  """Dense fp32 attention whose mask is built from the segment ids alone, by comparison (never
  from `attention_gpu.key_ranges` / `document_bounds`, which the kernels are given): query t sees
  key s iff seg[t] == seg[s] and (not causal or s <= t).

  q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv] (GQA: query head i reads key head
  i // (H / Hk)), segment_ids [B, T] int -> [B, T, H, Dv] fp32. Every query sees at least itself.
  zero_padding: zero the outputs of the padding queries (segment 0), as
  `attention_gpu.mosaic_backward_attention` does (through `jnp.where`, so their gradients are zero too);
  without it a padding run is attended as a document of its own, as the kernel-level
  `flash_attention` does with the ranges of `key_ranges`. With each id in one run per row (the
  tests' inputs), this equals attention over maximal runs of equal ids.
  """
  import jax
  import jax.numpy as jnp
  h, hk = q.shape[2], k.shape[2]
  assert h % hk == 0, (h, hk)
  f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
  seg = jnp.asarray(segment_ids)
  kh = jnp.repeat(f32(k), h // hk, axis=2)
  vh = jnp.repeat(f32(v), h // hk, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", f32(q), kh,
                      precision=jax.lax.Precision.HIGHEST) * scale
  seen = seg[:, :, None] == seg[:, None, :]                                  # [B, T, S]
  if causal:
    t = seg.shape[1]
    seen = seen & (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :])
  logits = jnp.where(seen[:, None], logits, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))       # finite: s = t
  p = jnp.exp(logits - m)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bhts,bshv->bthv", p, vh, precision=jax.lax.Precision.HIGHEST)
  if zero_padding:
    out = jnp.where((seg != 0)[:, :, None, None], out, 0.0)
  return out


# Quantile Balancing in numpy: independent references for the QB statistics and updates.


def np_qb_bars(biased, k, cutoff):
  """Bars of fp32 biased scores [m, E] (sorted in numpy): the (k+1)-th largest per row, and for
  cutoff 'per_expert' the k-th largest for the experts outside the row's top-k."""
  top = -np.sort(-biased, axis=1)
  bar = top[:, k:k + 1]
  if cutoff == "per_expert":
    kth = top[:, k - 1:k]
    bar = np.where(biased >= kth, bar, kth)
  return bar


def np_qb_histogram(scores, bias, k, mask, bins, cutoff):
  """K3's statistic in numpy: deficits r = bar − s of the valid tokens, binned per expert over
  [min b − 1, max b + 1] (fp32, the same elementwise operations as the JAX code, so that every
  deficit lands in the same bin). Returns (int64 counts [E, bins], lo, width)."""
  s, b = np.asarray(scores, np.float32), np.asarray(bias, np.float32)
  deficit = (np_qb_bars(s + b, k, cutoff) - s)[np.asarray(mask, bool)]
  lo = np.float32(b.min() - np.float32(1))
  width = np.float32((np.float32(b.max() + np.float32(1)) - lo) / np.float32(bins))
  index = np.clip(np.floor((deficit - lo) / width), 0, bins - 1).astype(np.int64)
  counts = np.zeros((s.shape[1], bins), np.int64)
  for j in range(s.shape[1]):
    np.add.at(counts[j], index[:, j], 1)
  return counts, float(lo), float(width)


def np_qb_bias_from_histogram(counts, tokens, bias, k, lo, width, rate=1.0):
  """The new bias in float64: per expert the value below which q = m·k/E deficits lie (uniform
  inside the bin that passes q), b ← (1 − rate)·b + rate·v, centred."""
  experts = counts.shape[0]
  q = tokens * k / experts
  target = np.empty(experts)
  for j in range(experts):
    upto = np.cumsum(counts[j])
    beta = int(np.searchsorted(upto, q, side="right"))    # first bin whose count from below > q
    below = upto[beta] - counts[j, beta]
    target[j] = lo + (beta + (q - below) / counts[j, beta]) * width
  new = (1 - rate) * np.asarray(bias, np.float64) + rate * target
  return new - new.mean()


def np_qb_margins(scores, bias, k, cutoff):
  """fp32 QB margins M = (s + b) − bar [m, E] in numpy."""
  biased = np.asarray(scores, np.float32) + np.asarray(bias, np.float32)
  return biased - np_qb_bars(biased, k, cutoff)


def np_qb_exact_bias(scores, bias, k, mask, cutoff, rate=1.0):
  """The exact QB update in numpy (float64 after the fp32 margins): per expert the (q+1)-th
  largest margin t of the valid tokens (q = m·k/E, fractional ranks interpolated), b − rate·t,
  centred. Returns (new bias [E], the margins sorted descending per expert [m, E])."""
  margins = np_qb_margins(scores, bias, k, cutoff)[np.asarray(mask, bool)]
  m, experts = margins.shape
  desc = -np.sort(-margins, axis=0)
  q = m * k / experts
  lo = min(int(np.floor(q)), m - 1)
  hi = min(lo + 1, m - 1)
  t = desc[lo].astype(np.float64) + (q - np.floor(q)) * (desc[hi].astype(np.float64) - desc[lo])
  new = np.asarray(bias, np.float64) - rate * t
  return new - new.mean(), desc


def mesh_train_step(cfg, state, optimizer, schedule, mesh, impl=None, **kwargs):
  """`make_train_step` for K3Model(cfg.model, impl or cfg.impl), jitted with the placed `state`'s
  shardings and the mesh's batch sharding (plain, for one device, when `mesh` is None)."""
  import jax
  from k3jax import training as train_lib
  from k3jax.model import K3Model
  from k3jax.parallel import sharding
  if mesh is not None:
    kwargs.update(state_shardings=jax.tree.map(lambda x: x.sharding, state),
                  batch_shardings=sharding.batch_sharding(mesh))
  return train_lib.make_train_step(cfg, K3Model(cfg.model, impl or cfg.impl), optimizer,
                                   schedule, **kwargs)


# What the command server imports once: every command's module and what it imports (the command
# modules themselves run afresh as __main__ in each child, so their flags are defined there).
COMMAND_SERVER_PRELOAD = ("k3jax.cli", "k3jax.training", "k3jax.train", "k3jax.evaluate",
                          "k3jax.generate", "k3jax.plan.command", "k3jax.compare.command",
                          "k3jax.convert.command")


@functools.lru_cache(maxsize=None)
def _command_server():
  import multiprocessing  # pylint: disable=import-outside-toplevel
  context = multiprocessing.get_context("forkserver")
  context.set_forkserver_preload(["testlib", *COMMAND_SERVER_PRELOAD])
  return context


def _command_child(module: str, args: list, env: dict, cwd: str, stdout: str,
                   stderr: str) -> None:
  """In the forked child: `python -m module args` as __main__, its output into the two files."""
  import runpy  # pylint: disable=import-outside-toplevel
  os.chdir(cwd)
  server_env = dict(os.environ)
  os.environ.clear()
  os.environ.update(env)
  sys.stdout.flush()
  sys.stderr.flush()
  for fd, path in ((1, stdout), (2, stderr)):
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(handle, fd)
    os.close(handle)
  if "jax" in sys.modules:
    # JAX read its JAX_* settings from the server's environment when the server imported it:
    # JAX_PLATFORMS is set here; a change to any other would be ignored, so it is refused.
    changed = sorted(k for k in set(env) | set(server_env) if k.startswith("JAX_")
                     and k != "JAX_PLATFORMS" and env.get(k) != server_env.get(k))
    if changed:
      raise ValueError(f"run_command_forked: {changed} differ from the command server's "
                       "environment: run this command in a fresh process")
    if env.get("JAX_PLATFORMS"):
      sys.modules["jax"].config.update("jax_platforms", env["JAX_PLATFORMS"])
  sys.argv = [module, *args]
  # As `python -m` does, the module runs once, as __main__ (the server imported it as itself).
  sys.modules.pop(module, None)
  runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_command_forked(module: str, args, env: dict, cwd: str, timeout: float = 300):
  """`python -m MODULE ARGS` with the environment `env` in the folder `cwd`, as
  `subprocess.run(..., capture_output=True, text=True)` returns it (a CompletedProcess), but
  forked from a server process that imported the commands' modules once (multiprocessing's
  forkserver, one per test process) instead of started afresh: the command's module runs as
  __main__ with these arguments, environment and folder, without ~1.7 s of imports. What differs
  from a fresh interpreter is that the imports happened earlier, under the test process's
  environment: for commands that stop before they use a device (configuration errors), while
  the tests of what a launch prints at start-up run real processes."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as folder:
    out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
    child = _command_server().Process(target=_command_child,
                                      args=(module, list(args), dict(env), cwd, out, err))
    child.start()
    child.join(timeout)
    argv = [sys.executable, "-m", module, *args]
    if child.exitcode is None:
      child.kill()
      child.join()
      raise subprocess.TimeoutExpired(argv, timeout)
    with open(out, encoding="utf-8", errors="replace") as f_out, \
        open(err, encoding="utf-8", errors="replace") as f_err:
      return subprocess.CompletedProcess(argv, child.exitcode, f_out.read(), f_err.read())
