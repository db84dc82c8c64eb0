r"""The stage-end evaluation (`k3jax.training.evaluation.Evaluator`) of a gin config on one
device: time and peak memory of the validation pass (loss by position, no [B, T, vocab] logits)
and of passkey.

Initialised params (the cost does not depend on their values) and random packed rows (documents of
geometric length, mean --doc_len, as train_bench.py builds them) stand in for a run's checkpoint and
validation split, so no corpus is needed. One JSON line per seq_len:

  result  seq_len, batch (tokens_per_step // seq_len rows), validation_s (first call: compile +
          run), validation_warm_s (second call), val_loss, val_loss_by_pos (bucket: loss),
          passkey_lengths (those run: <= EvalConfig.passkey_max_len), passkey_skipped, passkey_s
          (every passkey length, compile included), peak_gib (the allocator's peak_bytes_in_use;
          None on CPU);
  error   the first line of the error of that seq_len; the next one still runs.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/benchmarks/eval_bench.py \
      --seq_lens=8192,65536,262144,1048576

--smoke: tiny.gin at 128 and 256 tokens, head and loss in chunks of 1024 tokens, passkey up to 512
tokens (CPU).
"""
from __future__ import annotations

import argparse
import sys
import time

from train_bench import emit, first_line, random_rows, _peak_gib


def run_length(cfg, model, params, moe_state, seq_len: int, doc_len: int) -> dict:
  from k3jax.training import evaluation as evaluate_lib
  from k3jax.training.run_data import Data
  from k3jax.data.tokenizers import ByteTokenizer
  batch_size = max(1, cfg.stages.tokens_per_step // seq_len)
  rows = [random_rows(batch_size, seq_len, "packed", cfg.model.vocab_size, 0, doc_len, seed=i)
          for i in range(cfg.eval.num_batches)]
  data = Data(None, lambda *_: rows, ByteTokenizer(), None, 1.0)
  evaluator = evaluate_lib.Evaluator(cfg, model, data)
  times = []
  for _ in range(2):
    start = time.perf_counter()
    out = evaluator.validation(params, moe_state, seq_len)
    times.append(time.perf_counter() - start)
  start = time.perf_counter()
  passkey = evaluator.passkey(params, moe_state, seq_len)
  passkey_s = time.perf_counter() - start
  prefix = "val_loss_by_pos/"
  return dict(seq_len=seq_len, batch=batch_size, validation_s=round(times[0], 3),
              validation_warm_s=round(times[1], 3), val_loss=round(out["val_loss"], 4),
              val_loss_by_pos={k[len(prefix):]: v for k, v in out.items()
                               if k.startswith(prefix)},
              passkey_lengths=[int(k.split("/")[1]) for k in passkey if k.startswith("passkey/")],
              passkey_skipped=passkey.get("passkey_skipped_lengths", []),
              passkey_s=round(passkey_s, 3), peak_gib=_peak_gib())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gin_file", action="append", default=None,
                 help="gin config(s) (default gin_configs/small.gin)")
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--seq_lens", type=lambda text: [int(x) for x in text.split(",")],
                 default=[8192, 65536, 262144, 1048576])
  p.add_argument("--num_batches", type=int, default=1, help="EvalConfig.num_batches")
  p.add_argument("--doc_len", type=int, default=8192, help="mean document length of the rows")
  p.add_argument("--smoke", action="store_true", help="tiny.gin at 128 and 256 tokens (CPU)")
  args = p.parse_args(argv)
  if args.num_batches < 1 or args.doc_len < 1:
    p.error(f"--num_batches={args.num_batches} and --doc_len={args.doc_len} must be positive")

  import jax
  from k3jax import config as config_lib
  from k3jax import training as train_lib
  from k3jax.data.tokenizers import ByteTokenizer
  from k3jax.model import K3Model

  gin_files = ["gin_configs/tiny.gin"] if args.smoke else (args.gin_file
                                                           or ["gin_configs/small.gin"])
  seq_lens = [128, 256] if args.smoke else args.seq_lens
  doc_len = 100 if args.smoke else args.doc_len
  smoke = ["EvalConfig.passkey_max_len = 512", "EvalConfig.position_buckets = (0, 64, 128)",
           "ImplConfig.position_chunk_tokens = 1024"] if args.smoke else []
  cfg = config_lib.from_gin(gin_files, list(args.gin_bindings) + smoke
                            + [f"EvalConfig.num_batches = {args.num_batches}"])
  if cfg.model.vocab_size < ByteTokenizer().vocab_size:
    p.error(f"ModelConfig.vocab_size = {cfg.model.vocab_size}: the passkey needs the byte "
            "tokenizer's 257 ids")
  state, _, _ = train_lib.init_train_state(cfg, cfg.stages.total_steps)
  model = K3Model(cfg.model, cfg.impl)
  emit(event="config", gin_files=gin_files, bindings=args.gin_bindings,
       device=str(jax.devices()[0]), position_chunk_tokens=cfg.impl.position_chunk_tokens,
       passkey_max_len=cfg.eval.passkey_max_len, position_buckets=list(cfg.eval.position_buckets))
  failed = 0
  for seq_len in seq_lens:
    try:
      emit(event="result", **run_length(cfg, model, state.params, state.moe_state, seq_len,
                                        doc_len))
    except Exception as e:  # noqa: BLE001 - reported; the next length still runs
      failed += 1
      emit(event="error", seq_len=seq_len, error=first_line(e))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
