"""Training: the loop over the stages, the step, the state, and what a run writes.

  loop        train(cfg, workdir): set-up, restore, the loop, the report
  step        make_train_step: the loss, its gradients, the optimizer update (the math)
  accumulate  gradient accumulation over a step's micro-batches
  state       TrainState and its initialisation
  loss        the token cross-entropy, chunked over positions
  optim       AdamW / Muon, the schedule, QK-Clip
  evaluation  validation loss, loss by position, passkey retrieval, MQAR accuracy
  run_data    the run's data (training batches, validation batches, tokenizer)
  checkpoint  orbax checkpoints: save, restore, integrity, layout conversion
  run_dir     the run directory's config
  metrics     metrics.jsonl, TensorBoard, throughput, the progress bar
  plots       the end-of-run plots
"""

from k3jax.training.loop import (NonFiniteLossError, StageOutOfMemoryError, TrainResult, train,
                                 write_report)
from k3jax.training.run_dir import RunLockedError, RunWriteError
from k3jax.training.state import (TrainState, init_train_state, placed_train_state_shapes,
                                  train_state_shapes)
from k3jax.training.step import make_train_step

__all__ = ["NonFiniteLossError", "RunLockedError", "RunWriteError", "StageOutOfMemoryError",
           "TrainResult", "TrainState",
           "init_train_state", "make_train_step", "placed_train_state_shapes", "train",
           "train_state_shapes", "write_report"]
