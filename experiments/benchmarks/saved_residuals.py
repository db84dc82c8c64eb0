r"""What a config's forward pass saves for its backward pass, per token, by producing op.

The training step writes every saved activation (residual) once in the forward pass and reads it
once in the backward: on an H200 these writes alone were ~37 ms of medium.gin's 577 ms step
(RESULTS.md, run 14), and they set the step's memory peak. This lists them for one training row of
`--seq_len` tokens, from `jax.ad_checkpoint.saved_residuals` of the model's loss with the decoder
unrolled (`ImplConfig.scan_layers = False`, so that each residual keeps the source line that
produced it; the scanned decoder saves the same ones, stacked per iteration), grouped by source
line, dtype and shape without the token axes; bytes per token are summed over the layers.

The GPU's kernels are used where their residuals differ from the CPU paths: the Pallas KDA kernels
(traced, not run) and tokamax's grouped matmul (`ImplConfig.moe_grouped_matmul = 'tokamax'`, our
custom VJP, tokamax's XLA implementation on CPU). Attention takes the CPU path (the GPU's tokamax
and cuDNN kernels save q, k, v, the output and the log-sum-exp, as the blockwise path does).

  PYTHONPATH=. python experiments/benchmarks/saved_residuals.py --gin_file=gin_configs/medium.gin
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp


def _residual_bytes(mcfg, impl, seq_len: int) -> dict:
  """{(dtype, producing op and source line): [bytes, count]} of the residuals of one row of
  `K3Model(mcfg, impl)`."""
  from jax._src import ad_checkpoint
  import pallas_kernels.kda as pallas_kda
  from k3jax.training.loss import token_cross_entropy
  from k3jax.model import K3Model, init_variables
  from k3jax.ops import kda as kda_ops

  model = K3Model(mcfg, impl)
  variables = jax.eval_shape(lambda: init_variables(mcfg, jax.random.PRNGKey(0), 1, seq_len,
                                                    impl=impl))
  moe_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables["moe_state"])
  shape = (1, seq_len)

  def loss(params):
    targets = jnp.zeros(shape, jnp.int32)
    logits, _ = model.apply({"params": params, "moe_state": moe_state}, jnp.zeros(shape, jnp.int32),
                            jnp.ones(shape, jnp.int32), update_balance=True,
                            mutable=["moe_stats", "moe_balance", "attn_stats"])
    ce, n = token_cross_entropy(logits, targets, jnp.ones(shape, jnp.float32))
    return ce / n

  load = kda_ops._load_pallas_chunk_kda
  kda_ops._load_pallas_chunk_kda = lambda: functools.partial(pallas_kda.chunk_kda, interpret=False)
  try:   # abstract parameters: make_jaxpr traces, nothing is allocated
    residuals = ad_checkpoint.saved_residuals(loss, variables["params"])
  finally:
    kda_ops._load_pallas_chunk_kda = load
  rows = collections.defaultdict(lambda: [0, 0])
  for aval, where in residuals:
    if "from the argument" in where or not hasattr(aval, "shape"):
      continue      # the parameters themselves: alive anyway
    src = re.sub(r"\s+", " ", where)
    src = re.sub(r"/\S*?/(k3jax|pallas_kernels)/", r"\1/", src)[:150]
    rows[(str(aval.dtype), src)][0] += aval.size * aval.dtype.itemsize
    rows[(str(aval.dtype), src)][1] += 1
  return rows


def residual_table(cfg, seq_len: int, top: int) -> dict:
  """{'bytes_per_token', 'rows': [[bytes/token, count, dtype, source], ...]} for `cfg`: the
  residuals of a row of 2·seq_len tokens minus those of seq_len, per token (what does not grow
  with the row, the weights' bf16 copies, drops out)."""
  impl = dataclasses.replace(cfg.impl, scan_layers=False, moe_grouped_matmul="tokamax",
                             kda_backend="pallas", position_chunk_tokens=0)
  short = _residual_bytes(cfg.model, impl, seq_len)
  long = _residual_bytes(cfg.model, impl, 2 * seq_len)
  table = []
  for key in set(short) | set(long):
    per_token = (long.get(key, [0, 0])[0] - short.get(key, [0, 0])[0]) / seq_len
    if per_token >= 1:
      table.append([round(per_token, 1), long.get(key, [0, 0])[1], *key])
  table.sort(reverse=True)
  return {"bytes_per_token": round(sum(r[0] for r in table), 1), "rows": table[:top]}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gin_file", default="gin_configs/small.gin")
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--seq_len", type=int, default=1024,
                 help="tokens of the one row traced (the per-token bytes barely depend on it "
                      "outside attention)")
  p.add_argument("--top", type=int, default=40)
  args = p.parse_args(argv)
  from k3jax import cli
  cfg = cli.config_from_flags([args.gin_file], args.gin_bindings)
  out = residual_table(cfg, args.seq_len, args.top)
  print(json.dumps({"gin_file": args.gin_file, "seq_len": args.seq_len,
                    "bytes_per_token": out["bytes_per_token"]}))
  for row in out["rows"]:
    print(json.dumps(row))


if __name__ == "__main__":
  main()
