"""The routed experts' SiTU-GLU activation alone on one device: XLA's fusions (`situ_glu`, what
ImplConfig.moe_situ_glu = 'xla' runs) against the Pallas kernels (pallas_kernels/situ_glu,
'pallas'), forward and forward + backward, and their agreement.

Shapes: the grouped matmul's output [M, 2f] for small.gin's and medium.gin's 4 × 8192-token
micro-batch (M = 32768 tokens × top-4; f = 512, 768), bf16 in and out, fp32 math.
Timed: jitted h = act(gate_up) and jitted (h, d gate_up) = vjp of act; ms per call, median of 5
batches of `reps` calls after a warm-up. In the training step the difference is larger than here:
there XLA's layout assignment ran its fusions in a transposed layout (pallas_kernels/situ_glu).

Run (one GPU): PYTHONPATH=. python experiments/benchmarks/situ_glu_bench.py;  --smoke: tiny, CPU.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from conv_bench import time_ms   # the same timing loop (this folder is on sys.path)
from k3jax.ops.situ_glu import situ_glu
from pallas_kernels.situ_glu import SituGluConfig, situ_glu_fused

B1, B2 = 4.0, 25.0
_DEFAULT = SituGluConfig()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="131072x512,131072x768", help="MxF,... (gate_up is [M, 2F])")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--configs", default=":".join(str(v) for v in (
                     _DEFAULT.block_m, _DEFAULT.block_f, *_DEFAULT.launch)),
                 help="the kernels' block_m:block_f:num_warps:num_stages, comma-separated "
                      "(default: SituGluConfig's defaults)")
  p.add_argument("--smoke", action="store_true", help="64 x 16 on CPU (interpreter), 2 reps")
  args = p.parse_args()
  interpret = jax.default_backend() == "cpu"
  if args.smoke:
    args.shapes, args.reps, args.configs = "64x16", 2, "16:8:4:1"
  print(json.dumps(dict(kind="setup", backend=jax.default_backend(),
                        device=str(jax.devices()[0].device_kind))), flush=True)
  for shape in args.shapes.split(","):
    m, f = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    gate_up = (3.0 * jax.random.normal(keys[0], (m, 2 * f), jnp.float32)).astype(jnp.bfloat16)
    dh = jax.random.normal(keys[1], (m, f), jnp.float32).astype(jnp.bfloat16)
    variants = {"xla": lambda x: situ_glu(x[:, :f], x[:, f:], B1, B2)}
    for text in args.configs.split(","):
      bm, bf, warps, stages = (int(v) for v in text.split(":"))
      cfg = SituGluConfig(block_m=bm, block_f=bf, launch=(warps, stages), interpret=interpret)
      variants[f"pallas {text}"] = lambda x, cfg=cfg: situ_glu_fused(x, B1, B2, config=cfg)
    outs = {}
    for name, act in variants.items():
      fwd = jax.jit(act)

      def fwd_bwd(x, d, act=act):
        h, vjp = jax.vjp(act, x)
        return h, vjp(d)[0]
      both = jax.jit(fwd_bwd)
      try:
        row = dict(kind="time", variant=name, M=m, F=f,
                   fwd_ms=round(time_ms(fwd, (gate_up,), args.reps), 4),
                   fwd_bwd_ms=round(time_ms(both, (gate_up, dh), args.reps), 4))
        outs[name] = both(gate_up, dh)
      except Exception as e:  # a config that does not lower is reported, the others still run
        row = dict(kind="time", variant=name, M=m, F=f, error=f"{type(e).__name__}: {str(e)[:300]}")
      print(json.dumps(row), flush=True)
    for name, (h, d) in outs.items():
      if name == "xla":
        continue
      diff = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
              for a, b in ((h, outs["xla"][0]), (d, outs["xla"][1]))]
      print(json.dumps(dict(kind="numerics", variant=name, shape=shape,
                            max_abs_diff_vs_xla_h=diff[0], max_abs_diff_vs_xla_grad=diff[1])),
            flush=True)


if __name__ == "__main__":
  main()
