r"""Evaluation: validation loss and bits per byte, loss by position inside the document, passkey
retrieval by length, per-layer MaxVio.

Every evaluation runs the model with `return_hidden=True` and takes the LM head and the loss over
chunks of `ImplConfig.position_chunk_tokens` positions (`loss.chunked_loss_by_position`, as the
training step does), so it never holds [B, T, vocab] logits: at K3's vocabulary those of one
1M-token row would be 655 GB. Passkey retrieval computes the logits of the answer positions only.

Loss by position (`val_loss_by_pos/<lo>-<hi>`, nats/token over the validation tokens whose position
inside their document lies in [lo, hi), with `val_tokens_by_pos/<lo>-<hi>` their count; the edges
are `EvalConfig.position_bucket_edges` of the run's stages: by default 0 and every stage's length
but the last) is the long-context signal that scales to the 1M stage: does the model use distant
context on real text? The loss of tokens deep inside long documents should fall as the stages
extend the length. It comes from the validation forward pass at no extra cost and needs no
synthetic task. Buckets that start at or beyond the evaluated length are left out (no token can be
there); a bucket that could hold tokens but got none has loss None.

Passkey retrieval runs at train length x EvalConfig.passkey_multipliers up to
EvalConfig.passkey_max_len: at the long stages (8M tokens a sample at 8 x 1M) it is neither
affordable nor informative for a small model. Lengths above the limit are listed under
`passkey_skipped_lengths`; `passkey/<len>` = None still means "shorter than the task needs".

MQAR recall (`mqar/<len>`: the fraction of queried values whose argmax prediction is exact,
`synthetic.mqar_accuracy`) runs at stage ends, at the stage's length and
DataConfig.mqar_num_kv_pairs, on EvalConfig.mqar_samples fresh rows, in runs whose
DataConfig.source is 'mqar'. `evaluate_mqar`
measures it for any model at any length and number of pairs (a study's sweep).

`Evaluator(cfg, model, data)` evaluates given params/moe_state at a training length; the
training loop calls it at each stage end. `evaluate_workdir` restores a run's checkpoint (params and
moe_state only) and evaluates it: the `evaluate` command (`k3jax/evaluate.py`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from k3jax import config as config_lib
from k3jax import runtime as runtime_lib
from k3jax.data import synthetic
from k3jax.model import K3Model
from k3jax.model.stats import max_violation, moe_stats_by_layer
from k3jax.training import checkpoint as checkpoint_lib
from k3jax.training.loss import chunked_loss_by_position, document_positions
from k3jax.training.run_data import make_data

PyTree = Any
# MQAR evaluation rows come from rng streams [seed, _MQAR_EVAL_STREAM, seq_len, pairs]: disjoint
# from the training steps' [seed, step] and the validation batches' (k3jax.training.run_data).
_MQAR_EVAL_STREAM = 1 << 41


def passkey_min_len(tokenizer, digits: int = 5) -> int:
  """The shortest seq_len `synthetic.passkey_batch` accepts for `digits`-digit keys."""
  needle = tokenizer.encode(synthetic.PASSKEY_NEEDLE.format(key="1" * digits)).size
  question = tokenizer.encode(synthetic.PASSKEY_QUESTION).size
  answer = tokenizer.encode("1" * digits).size
  return needle + question + answer


def bucket_names(edges) -> list[str]:
  """'<lo>-<hi>' for each bucket of the strictly increasing edges; the last one is '<lo>-inf'."""
  return [f"{lo}-{hi}" for lo, hi in zip(edges, list(edges[1:]) + ["inf"])]


def answer_window(loss_mask: np.ndarray) -> tuple[int, int]:
  """[first, T): the shortest tail of the positions that holds every loss_mask > 0 entry of every
  row (the passkey answers); loss_mask: [B, T]. A mask with no entry raises ValueError."""
  marked = np.asarray(loss_mask) > 0
  if not marked.any():
    raise ValueError("answer_window: loss_mask marks no answer token")
  return int(np.argmax(marked.any(axis=0))), marked.shape[1]


def answer_logits_fn(model):
  """answer_logits(params, moe_state, batch, first) -> fp32 logits [B, T - first, V] of the
  positions [first, T) only (first: static), jitted; `model` is a K3Model (its apply with
  return_hidden gives the final hidden states and the LM head). What the passkey and MQAR
  evaluations score; a study that scores checkpoints of one config builds it once and reuses
  its compiled programs (experiments/studies/context_extension.py)."""
  def answer_logits(params, moe_state, batch, first):
    (h, head), _ = model.apply({"params": params, "moe_state": moe_state}, batch["inputs"],
                               batch["segment_ids"], return_hidden=True, mutable=["moe_stats"])
    return jnp.dot(h[:, first:], head.astype(h.dtype), preferred_element_type=jnp.float32)
  return runtime_lib.jit(answer_logits, static_argnums=3)


def _mqar_accuracy(answer_logits, params, moe_state, vocab_size: int, seq_len: int,
                   num_kv_pairs: int, samples: int, seed: int) -> float:
  """`synthetic.mqar_accuracy` over `samples` fresh MQAR rows of `seq_len` tokens, one batch,
  with the logits of the positions from the first query on."""
  rng = np.random.default_rng([seed, _MQAR_EVAL_STREAM, seq_len, num_kv_pairs])
  batch = synthetic.mqar_batch(rng, samples, seq_len, vocab_size, num_kv_pairs)
  first, _ = answer_window(batch["loss_mask"])
  logits = answer_logits(params, moe_state, _device_batch(batch), first)
  return synthetic.mqar_accuracy(logits, {k: batch[k][:, first:] for k in ("targets", "loss_mask")})


def evaluate_mqar(model, params, moe_state, seq_len: int, num_kv_pairs: int, *,
                  samples: int = 64, seed: int = 0, vocab_size: Optional[int] = None) -> float:
  """MQAR recall of a trained model: the fraction of queried values it predicts exactly (argmax)
  on `samples` rows of `seq_len` tokens with `num_kv_pairs` key-value pairs each.

  Args:
    model: the `K3Model` (e.g. `K3Model(cfg.model, cfg.impl)` of a run restored with
      `checkpoint.restore_run`).
    params, moe_state: its variables.
    seq_len, num_kv_pairs: the task's shape (`synthetic.mqar_batch`; seq_len >= 3·num_kv_pairs).
    samples: rows, run as one batch.
    seed: picks the rows (streams disjoint from any run's training and validation rows).
    vocab_size: the ids the task draws from; default the model's vocabulary (what training with
      DataConfig.source = 'mqar' uses).

  Returns:
    the accuracy in [0, 1].
  """
  if not (isinstance(samples, int) and samples > 0):
    raise ValueError(f"evaluate_mqar: samples={samples!r} must be a positive integer")
  vocab = model.config.vocab_size if vocab_size is None else vocab_size
  return _mqar_accuracy(answer_logits_fn(model), params, moe_state, vocab, seq_len,
                        num_kv_pairs, samples, seed)


class Evaluator:
  """Evaluates a model (params + moe_state) on the validation stream and on passkey retrieval.

  Args:
    cfg: the run config (eval settings; tokens_per_step sets the validation batch size).
    model: the `K3Model` (its impl's position_chunk_tokens chunks the head and the loss).
    data: the run's `k3jax.training.run_data.Data` (validation batches, tokenizer, passkey filler,
      bytes/token).
  """

  def __init__(self, cfg: config_lib.Config, model, data):
    self.cfg = cfg
    self.model = model
    self.data = data

    edges = cfg.eval.position_bucket_edges(cfg.stages.stages)
    chunk_tokens = model.impl.position_chunk_tokens

    def hidden(params, moe_state, batch):
      (h, head), mutated = model.apply({"params": params, "moe_state": moe_state},
                                       batch["inputs"], batch["segment_ids"], return_hidden=True,
                                       mutable=["moe_stats"])
      return h, head, mutated.get("moe_stats", {})

    def loss_and_stats(params, moe_state, batch):
      """((ce_sum [nb], count [nb]) by position bucket, moe_stats)."""
      h, head, stats = hidden(params, moe_state, batch)
      sums = chunked_loss_by_position(h, head, batch["targets"], batch["loss_mask"],
                                      document_positions(batch["segment_ids"]), edges,
                                      chunk_tokens)
      return sums, stats

    self._loss_and_stats = runtime_lib.jit(loss_and_stats)
    self._answer_logits = answer_logits_fn(model)

  def validation_batch_size(self, seq_len: int) -> int:
    return max(1, self.cfg.stages.tokens_per_step // seq_len)

  def lower_validation(self, params, moe_state, seq_len: int):
    """The validation program at seq_len, lowered for these params and moe_state (arrays or
    ShapeDtypeStructs) and the uncommitted batches that `validation` passes (the runtime's
    precompiler compiles it)."""
    batch = runtime_lib.batch_shapes(self.validation_batch_size(seq_len), seq_len)
    return self._loss_and_stats.lower(params, moe_state, batch)

  def validation(self, params, moe_state, seq_len: int) -> dict:
    """Validation loss (nats/token), bits per byte, loss by position inside the document (buckets
    that start below seq_len), and per-layer MaxVio of the summed loads."""
    batch_size = self.validation_batch_size(seq_len)
    edges = self.cfg.eval.position_bucket_edges(self.cfg.stages.stages)
    totals, counts = np.zeros(len(edges)), np.zeros(len(edges))
    loads: dict[str, np.ndarray] = {}
    for batch in self.data.validation_batches(seq_len, batch_size, self.cfg.eval.num_batches):
      (s, n), stats = self._loss_and_stats(params, moe_state, _device_batch(batch))
      totals += np.asarray(s, np.float64)
      counts += np.asarray(n, np.float64)
      for name, layer in moe_stats_by_layer(stats).items():
        if "load" in layer:
          loads[name] = loads.get(name, 0.0) + np.asarray(layer["load"], np.float64)
    count = float(counts.sum())
    loss = float(totals.sum()) / max(count, 1.0)
    out = {"val_loss": loss, "val_bpb": loss / math.log(2) / self.data.bytes_per_token,
           "val_tokens": int(count)}
    for name, lo, total, n in zip(bucket_names(edges), edges, totals, counts):
      if lo < seq_len:   # positions are < seq_len: later buckets cannot hold a token
        out[f"val_loss_by_pos/{name}"] = float(total / n) if n > 0 else None
        out[f"val_tokens_by_pos/{name}"] = int(n)
    for name, load in loads.items():
      out[f"val_max_vio/{name}"] = max_violation(load)
    return out

  def passkey(self, params, moe_state, train_len: int, seed: int = 0) -> dict:
    """Passkey accuracy at train_len x every cfg.eval.passkey_multipliers up to
    cfg.eval.passkey_max_len; lengths shorter than the task needs are reported as None, lengths
    above the limit are not run and listed under 'passkey_skipped_lengths'."""
    out, skipped = {}, []
    min_len = passkey_min_len(self.data.tokenizer)
    for m in self.cfg.eval.passkey_multipliers:
      length = int(train_len * m)
      if length > self.cfg.eval.passkey_max_len:
        skipped.append(length)
        continue
      if length < min_len:
        out[f"passkey/{length}"] = None
        continue
      batch = synthetic.passkey_batch(np.random.default_rng([seed, length]),
                                      self.cfg.eval.passkey_samples, length,
                                      self.data.tokenizer, filler_tokens=self.data.filler_tokens)
      first, _ = answer_window(batch["loss_mask"])
      logits = self._answer_logits(params, moe_state, _device_batch(batch), first)
      answers = {k: batch[k][:, first:] for k in ("targets", "loss_mask")}
      out[f"passkey/{length}"] = float(np.mean(synthetic.passkey_accuracy(logits, answers)))
    if skipped:
      out["passkey_skipped_lengths"] = skipped
    return out

  def mqar(self, params, moe_state, seq_len: int, num_kv_pairs: Optional[int] = None,
           seed: int = 0) -> float:
    """MQAR accuracy at seq_len (`evaluate_mqar`) on cfg.eval.mqar_samples rows with
    num_kv_pairs pairs (default DataConfig.mqar_num_kv_pairs) over the model's vocabulary."""
    pairs = self.cfg.data.mqar_num_kv_pairs if num_kv_pairs is None else num_kv_pairs
    return _mqar_accuracy(self._answer_logits, params, moe_state, self.cfg.model.vocab_size,
                          seq_len, pairs, self.cfg.eval.mqar_samples, seed)

  def __call__(self, params, moe_state, train_len: int, seed: int = 0, passkey: bool = True
               ) -> dict:
    """Validation at train_len, and unless passkey=False passkey retrieval at its multiples and,
    for a run on DataConfig.source = 'mqar', MQAR accuracy at train_len (`mqar/<len>`)."""
    out = {"seq_len": int(train_len)}
    out.update(self.validation(params, moe_state, train_len))
    if passkey:
      out.update(self.passkey(params, moe_state, train_len, seed))
      if self.cfg.data.source == "mqar":
        out[f"mqar/{int(train_len)}"] = self.mqar(params, moe_state, train_len, seed=seed)
    return out


def _device_batch(batch: Mapping[str, np.ndarray]) -> dict:
  return {k: jnp.asarray(batch[k]) for k in ("inputs", "targets", "segment_ids", "loss_mask")}


def format_eval(results: Mapping[str, Any]) -> str:
  """One readable line per result; the loss by position on one line, 'lo-hi: loss (tokens)' per
  bucket."""
  lines, by_pos = [], []
  for k, v in results.items():
    if k.startswith("val_tokens_by_pos/"):
      continue
    if k.startswith("val_loss_by_pos/"):
      name = k.split("/", 1)[1]
      loss = "-" if v is None else f"{v:.4f}"
      by_pos.append(f"{name}: {loss} ({results.get(f'val_tokens_by_pos/{name}', '?')})")
      if len(by_pos) == 1:
        lines.append(None)   # the line's place: where its first bucket is
      continue
    lines.append(f"  {k:<28s} {v:.4f}" if isinstance(v, float) else f"  {k:<28s} {v}")
  line = f"  {'val_loss_by_pos':<28s} " + " | ".join(by_pos)
  return "\n".join(line if l is None else l for l in lines)


def evaluate_workdir(workdir: str, step: Optional[int] = None, seq_len: Optional[int] = None
                     ) -> dict:
  """Restores params + moe_state of `step` (default: latest) from a run directory and evaluates
  them at `seq_len` (default: the training length of the checkpoint's stage)."""
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"seq_len={seq_len} is not allowed: a length >= 1, or None for the "
                     "checkpoint's training length")
  cfg, params, moe_state, meta = checkpoint_lib.restore_run(workdir, step)
  evaluator = Evaluator(cfg, K3Model(cfg.model, cfg.impl), make_data(cfg))
  length = int(meta["seq_len"]) if seq_len is None else seq_len
  results = {"step": int(meta["step"]), "stage": int(meta["stage"])}
  results.update(evaluator(params, moe_state, length, seed=cfg.seed))
  return results
