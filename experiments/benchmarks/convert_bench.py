r"""Import speed and host memory of `k3jax.convert` on a synthetic Kimi-Linear checkpoint.

  python experiments/benchmarks/convert_bench.py --folder=/tmp/kl_synthetic [--gigabytes=4]

Writes (once; reused when present) a Kimi-Linear-shaped checkpoint of about `--gigabytes` GB in
bfloat16 (random weights, the release's names, 5 GB shards with an index), then in a child
process per measurement:
  * `read`: every tensor read once by k3jax's reader (`CheckpointReader.get`) and by the
    `safetensors` library (`safe_open(..., framework="flax")`), GB/s each;
  * `import`: `k3jax convert --from_hf` in full (read, transform, place, write the orbax step 0),
    with `load_hf` and the checkpoint write timed apart, and the process's peak resident memory
    against the model's size in the parameter dtype and the largest tensor and leaf.
On a CPU the parameters live in host memory, so the peak is compared with the model's bytes plus
the largest leaf: what the converter holds beyond the model it builds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_string("folder", "/tmp/kl_synthetic", "Where the synthetic checkpoint is written.")
flags.DEFINE_float("gigabytes", 4.0, "Approximate size of the synthetic checkpoint (bf16).")
flags.DEFINE_string("measure", "", "Internal: the measurement a child process runs.")
FLAGS = flags.FLAGS


def model_config(gigabytes: float):
  """A Kimi-Linear-shaped ModelConfig of about `gigabytes` GB in bf16 (experts scaled to fit)."""
  from k3jax.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from k3jax.model import count_params  # pylint: disable=import-outside-toplevel
  base = ModelConfig(
      vocab_size=32000, d_model=2048, num_layers=8, mla_every=4, dtype="bfloat16",
      kda_num_heads=16, kda_head_dim=128, kda_value_dim=128, kda_gate_rank=128,
      kda_gate_lower_bound=None, kda_a_log_init="log_uniform", kda_output_gate_rank=128,
      mla_num_heads=16, mla_kv_lora_rank=512, mla_qk_nope_dim=128, mla_qk_rope_dim=64,
      mla_v_dim=128, mla_output_gate=False, ffn_activation="swiglu", dense_ffn_dim=8192,
      first_k_dense=1, moe_num_experts=8, moe_top_k=4, moe_latent_dim=0, moe_latent_norm=False,
      moe_expert_dim=1024, moe_num_shared=1, moe_shared_dim=1024, moe_routed_scale=2.446,
      attnres=False)
  per_expert = count_params(dataclasses.replace(base, moe_num_experts=9))[0] - \
      count_params(base)[0]
  experts = 8 + max(0, int((gigabytes * 1e9 / 2 - count_params(base)[0]) / per_expert))
  return dataclasses.replace(base, moe_num_experts=experts)


def write_synthetic(folder: str, gigabytes: float) -> None:
  """Every tensor the release's spelling names, at its shape, as random bfloat16 bit patterns of
  magnitudes 2^-7..2^-1 with random signs (drawn as integers: casting billions of floats to
  bfloat16 one by one would take longer than the benchmark)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from k3jax.convert import kimi_linear  # pylint: disable=import-outside-toplevel
  from k3jax.convert.safetensors_io import ShardedWriter  # pylint: disable=import-outside-toplevel
  cfg = model_config(gigabytes)
  imports, _ = kimi_linear.tensor_rules(cfg, "release")
  rng = np.random.default_rng(0)
  staged = folder + ".partial"
  shutil.rmtree(staged, ignore_errors=True)
  writer = ShardedWriter(staged)
  written = set()
  for rule in imports:
    source = rule.sources[0]   # the release's names
    for name, shape in zip(source.names, source.shapes):
      if name in written:
        continue
      written.add(name)
      bits = rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16)
      bits |= (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)
      writer.add(name, bits.view(ml_dtypes.bfloat16))
  writer.close()
  with open(os.path.join(staged, "config.json"), "w") as f:
    json.dump(kimi_linear.config_to_hf(cfg, "bfloat16", "release"), f)
  os.replace(staged, folder)


def measure_read(folder: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  from k3jax.convert.safetensors_io import CheckpointReader  # pylint: disable=import-outside-toplevel
  reader = CheckpointReader(folder)
  total = reader.total_bytes()
  start = time.perf_counter()
  largest = 0
  for name in reader.names():
    largest = max(largest, reader.get(name).nbytes)
  ours = time.perf_counter() - start
  start = time.perf_counter()
  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    with safe_open(os.path.join(folder, file), framework="flax") as f:
      for name in f.keys():
        jax.block_until_ready(f.get_tensor(name))
  theirs = time.perf_counter() - start
  return {"bytes": total, "largest_tensor_bytes": largest, "k3jax_reader_s": ours,
          "k3jax_reader_GBps": total / ours / 1e9, "safetensors_flax_s": theirs,
          "safetensors_flax_GBps": total / theirs / 1e9}


def measure_import(folder: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from k3jax.convert import command, load_hf  # pylint: disable=import-outside-toplevel
  from k3jax.convert.safetensors_io import CheckpointReader  # pylint: disable=import-outside-toplevel
  total = CheckpointReader(folder).total_bytes()
  start = time.perf_counter()
  cfg, variables = load_hf(folder)
  jax.block_until_ready(variables)
  load_s = time.perf_counter() - start
  leaves = jax.tree.leaves(variables)
  model_bytes = sum(x.nbytes for x in leaves)
  largest_leaf = max(x.nbytes for x in leaves)
  peak_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  del variables, leaves
  run = tempfile.mkdtemp(prefix="convert_bench_run_")
  shutil.rmtree(run)
  start = time.perf_counter()
  command.import_folder(folder, run)
  import_s = time.perf_counter() - start
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run) for f in fs)
  shutil.rmtree(run)
  del np, cfg
  return {"bytes": total, "load_hf_s": load_s, "load_hf_GBps": total / load_s / 1e9,
          "import_folder_s": import_s, "import_folder_GBps": total / import_s / 1e9,
          "run_dir_bytes": written, "model_bytes": model_bytes,
          "largest_leaf_bytes": largest_leaf, "peak_rss_after_load_hf": peak_after_load,
          "peak_rss": peak, "peak_beyond_model": peak_after_load - model_bytes}


def main(argv) -> None:
  del argv
  if FLAGS.measure:
    result = {"read": measure_read, "import": measure_import}[FLAGS.measure](FLAGS.folder)
    print("RESULT " + json.dumps(result))
    return
  if not os.path.isdir(FLAGS.folder):
    start = time.perf_counter()
    write_synthetic(FLAGS.folder, FLAGS.gigabytes)
    print(f"wrote {FLAGS.folder} in {time.perf_counter() - start:.1f} s")
  for what in ("read", "import"):
    proc = subprocess.run([sys.executable, __file__, f"--folder={FLAGS.folder}",
                           f"--measure={what}"], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
      raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    print(what, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                            for k, v in result.items()}, indent=1))


if __name__ == "__main__":
  app.run(main)
