"""Study: does KDA recall better than its relatives at the same state size? (The Kimi Linear
paper's synthetic MQAR task.)

    python experiments/studies/mqar_recall.py [--seeds=0,1] [--steps=300]

Trains a 2-layer model on MQAR (DataConfig.source = 'mqar') for each recurrence
(ModelConfig.kda_variant = 'kda', 'gdn', 'gla': the same heads and head dims, so the same state
H·K·V) and a full-attention reference (mla_every = 1), then measures MQAR accuracy of each final
checkpoint at several numbers of key-value pairs (`evaluate_mqar`, fresh rows) and writes the
study's section of RESULTS.md and plots/mqar_recall.png.

The code always makes the last layer MLA (`ModelConfig.layer_kind`), so the linear variants' models
are [linear, MLA]. That MLA could solve the recall by itself, so its latent is cut to one channel
(mla_kv_lora_rank = 1, normed to ±1: each key and value is one sign) and it has no rope key
(mla_qk_rope_dim = 0): it cannot match a query to one of many keys, and the recall has to go
through the linear layer's state.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import common
import recall
from common import Setting

STUDY = "mqar_recall"
ROOT = "runs/studies"
GIN_FILES = ["gin_configs/tiny.gin"]
SEQ_LEN = 64
TRAIN_PAIRS = 16
EVAL_PAIRS = (4, 8, 12, 16, 20)   # SEQ_LEN >= 3 * pairs
EVAL_SAMPLES = 256
HEADS, HEAD_DIM = 2, 16           # state H·K·V = 2·16·16 per linear layer
WIN_MARGIN = 0.02


def base_bindings(steps: int) -> tuple:
  return ("ModelConfig.vocab_size = 65",          # 32 keys, 32 values
          "ModelConfig.num_layers = 2",
          "ModelConfig.moe_num_experts = 0",
          "ModelConfig.dense_ffn_dim = 128",
          f"ModelConfig.kda_num_heads = {HEADS}",
          f"ModelConfig.kda_head_dim = {HEAD_DIM}",
          f"ModelConfig.kda_value_dim = {HEAD_DIM}",
          f"StagesConfig.stages = (({SEQ_LEN}, {steps}),)",
          "StagesConfig.tokens_per_step = 4096",
          "OptimizerConfig.learning_rate = 1e-2",
          "DataConfig.source = 'mqar'",
          f"DataConfig.mqar_num_kv_pairs = {TRAIN_PAIRS}",
          "EvalConfig.every_steps = 0",
          "EvalConfig.num_batches = 1",
          "EvalConfig.passkey_multipliers = ()",
          "EvalConfig.mqar_samples = 256",
          f"CheckpointConfig.every_steps = {steps}")


LINEAR = ("ModelConfig.mla_every = 2", "ModelConfig.mla_kv_lora_rank = 1",
          "ModelConfig.mla_qk_rope_dim = 0")


def settings(steps: int) -> list[Setting]:
  base = base_bindings(steps)
  return [Setting(v, base + LINEAR + (f"ModelConfig.kda_variant = '{v}'",))
          for v in ("kda", "gdn", "gla")] + [Setting("mla", base + ("ModelConfig.mla_every = 1",))]


DESCRIPTION = """\
**Claim** (Kimi Linear paper, synthetic tasks): KDA recalls better than its relatives, Gated
DeltaNet (one decay per head) and gated linear attention (no delta rule), at the same state size.

**Protocol.** `python experiments/studies/mqar_recall.py --steps={steps} --seeds={seeds}`:
2-layer models, d_model 64, dense FFN (no MoE), vocabulary 65 (32 keys, 32 values), trained on
MQAR rows of {SEQ_LEN} tokens with {TRAIN_PAIRS} key-value pairs (DataConfig.source = 'mqar';
AdamW, lr 1e-2, {steps} steps of 4096 tokens). kda / gdn / gla: layer 1 is the linear layer with {HEADS} heads of K = V = {HEAD_DIM} (state H·K·V = {STATE} floats,
the same for all three); layer 2 is the MLA layer the code always puts last, reduced to a
one-channel latent (each key and value a sign; no rope key) so that it cannot do the recall
itself. mla: full softmax attention (NoPE gated MLA, tiny.gin's dims) in both layers, the
reference. Accuracy: `evaluate_mqar` on the final checkpoint, {EVAL_SAMPLES} fresh rows of
{SEQ_LEN} tokens per number of pairs (20 is more than the training rows held), the fraction of
queried values predicted exactly (argmax). Wall times: the machine's 2 cores were shared with
other training jobs and two of these runs at a time (a run alone took about 4 minutes).
"""


def section(records, accs, steps, seeds) -> str:
  grid = recall.accuracy_grid([(r.setting, r.seed, p, accs[(r.setting, r.seed)].get(p))
                               for r in records for p in EVAL_PAIRS])
  cols = " | ".join(f"{p} pairs" for p in EVAL_PAIRS)
  text = DESCRIPTION.format(
      steps=steps, seeds=",".join(str(s) for s in seeds), SEQ_LEN=SEQ_LEN, TRAIN_PAIRS=TRAIN_PAIRS,
      HEADS=HEADS, HEAD_DIM=HEAD_DIM, STATE=HEADS * HEAD_DIM ** 2, EVAL_SAMPLES=EVAL_SAMPLES)
  lines = [f"## {STUDY}", "", text.strip(), "",
           f"| setting | {cols} | final train loss | seeds | tokens | wall time per run | command |",
           "|---|" + "---|" * len(EVAL_PAIRS) + "---|---|---|---|---|"]
  for name, by_pairs in grid.items():
    mine = [r for r in records if r.setting == name]
    walls = common.mean_min_max([r.wall_s for r in mine])
    cmd = common.train_command(GIN_FILES, list(mine[0].bindings) + common.seed_bindings("SEED"),
                               common.workdir_of(ROOT, STUDY, name, "SEED"), python="python")
    lines.append("| " + " | ".join(
        [name] + [by_pairs[p].format(3) for p in EVAL_PAIRS]
        + [common.mean_min_max([final_train_loss(r.workdir) for r in mine]).format(3),
           ", ".join(str(r.seed) for r in mine), f"{steps * 4096:,}",
           common._duration(walls.mean) if walls.n else "-",  # pylint: disable=protected-access
           "`" + shlex.join(cmd).replace("|", "\\|") + "`"]) + " |")
  lines += ["", "MQAR accuracy: mean [min, max] over the seeds (one value: one seed). Final train "
            "loss: the mean of the last 5 logged training losses (nats per query; chance is "
            "ln 32 = 3.47). The command "
            "trains one seed from the repository's root, with SEED replaced by it; the accuracies "
            "come from `recall.mqar_accuracies` on its final checkpoint.", "",
            f"![{STUDY}](plots/{STUDY}.png)", "",
            verdict(grid, seeds, {name: common.mean_min_max([final_train_loss(r.workdir)
                                                            for r in records if r.setting == name])
                                  for name in grid})]
  return "\n".join(lines)


def verdict(grid, seeds, train_loss=None) -> str:
  """KDA 'wins' at a number of pairs when its mean accuracy beats both GDN's and GLA's by more than
  WIN_MARGIN; counts where all three are already at >= 0.99 are left out (nothing to separate)."""
  kda, gdn, gla = grid["kda"], grid["gdn"], grid["gla"]
  contested = [p for p in EVAL_PAIRS if min(kda[p].mean, gdn[p].mean, gla[p].mean) < 0.99]
  wins = [p for p in contested if kda[p].mean > max(gdn[p].mean, gla[p].mean) + WIN_MARGIN]
  losses = [p for p in contested if kda[p].mean < max(gdn[p].mean, gla[p].mean) - WIN_MARGIN]
  nums = "; ".join(f"{p} pairs: kda {kda[p].mean:.3f}, gdn {gdn[p].mean:.3f}, "
                   f"gla {gla[p].mean:.3f}, mla {grid['mla'][p].mean:.3f}" for p in EVAL_PAIRS)
  unconverged = {n: s.mean for n, s in (train_loss or {}).items() if s.n and s.mean > 0.3}
  caveat = ("" if not unconverged else " Training had not converged (final train loss "
            + ", ".join(f"{n} {v:.2f}" for n, v in unconverged.items())
            + " nats per query): the accuracies rank how fast each learns the task as much as "
            "what its state can hold.")
  if contested and len(wins) == len(contested):
    word = "reproduced"
  elif wins:
    word = "partly reproduced"
  else:
    word = "not reproduced"
  return (f"**Verdict: {word}** at this scale ({len(seeds)} seed{'s' * (len(seeds) > 1)}): KDA "
          f"beats both GDN and GLA by more than {WIN_MARGIN} in mean accuracy at "
          f"{len(wins)} of the {len(contested)} numbers of pairs where they are not all at "
          f">= 0.99, and trails the better of the two by more than that at {len(losses)}. "
          f"{nums}.{caveat} A proper test needs the paper's protocol: several state sizes, a mixture "
          "of pair counts and lengths in training, a learning-rate sweep per variant (the paper "
          "reports the best), more steps and seeds, and pure linear stacks (here the last layer is "
          "always a crippled MLA).")


def final_train_loss(workdir: str) -> float:
  losses = common.compare.load_run(workdir).train_loss
  return float(losses[-5:].mean())


def cached_accuracies(workdir: str) -> dict[int, float]:
  """`recall.mqar_accuracies` of the run at EVAL_PAIRS, kept in DIR/mqar_accuracy.json (measured
  again when the pairs, the length or the samples differ; `common.cached_measurement`)."""
  key = {"seq_len": SEQ_LEN, "samples": EVAL_SAMPLES, "pairs": list(EVAL_PAIRS)}
  return common.cached_measurement(
      os.path.join(workdir, "mqar_accuracy.json"), key,
      lambda: recall.mqar_accuracies(workdir, SEQ_LEN, EVAL_PAIRS, EVAL_SAMPLES))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", default="0", help="comma-separated seeds")
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  records = common.run_settings(STUDY, settings(args.steps), seeds, ROOT, GIN_FILES)
  accs = {}
  for r in records:
    accs[(r.setting, r.seed)] = cached_accuracies(r.workdir)
    print(f"{r.setting} seed {r.seed}: {accs[(r.setting, r.seed)]}", flush=True)
  body = section(records, accs, args.steps, seeds)
  grid = recall.accuracy_grid([(r.setting, r.seed, p, accs[(r.setting, r.seed)][p])
                               for r in records for p in EVAL_PAIRS])
  common.compare.save_figure(
      recall.spread_figure(grid, "key-value pairs", "MQAR accuracy",
                           f"MQAR recall, T = {SEQ_LEN}, trained at {TRAIN_PAIRS} pairs",
                           ylim=(-0.02, 1.02)),
      os.path.join(common.PLOTS, f"{STUDY}.png"))
  common.write_section(STUDY, body)
  print(body)


if __name__ == "__main__":
  sys.exit(main())
