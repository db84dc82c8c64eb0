"""Softmax attention core with causal, segment and position masking; implementation dispatch.

One entry point, `attention`, used by the MLA layer in training (full K/V per head) and in decode
(the absorbed MQA form over the latent cache), and `max_attention_logits` (QK-Clip's statistic).
The softmax is always taken in fp32. No path builds an array of [T, S] size, forward or backward:
masks come from per-token vectors (segment ids, positions, document bounds), block by block.

Masking rules (query t, key s of the same batch row):
  * segments: t sees s only when `q_segment_ids[t] == kv_segment_ids[s]` and `q_segment_ids[t] != 0`
    (0 is padding). Queries that see no key at all (padding) return zeros.
  * causal: t sees s only when `kv_positions[s] <= q_positions[t]`. Without positions, queries and keys
    are the same tokens (T == S) and position = index.
The GPU document kernels ('tokamax', 'tokamax_mosaic_bwd') take each run of equal segment ids as
one document (`attention_gpu.document_bounds`); that is the same mask when every document of a row
is one contiguous run, as in packed rows.

Implementations (ImplConfig.attention_impl):
  'xla'                 blockwise flash attention in XLA (`attention_blockwise`), any inputs.
  'cudnn'               cuDNN, rows without segment ids only (plain causal or no mask).
  'tokamax'             tokamax Mosaic GPU (sm90+) forward, its stock backward.
  'tokamax_mosaic_bwd'  tokamax Mosaic GPU forward, `pallas_kernels.flash_attention`'s Mosaic GPU
                        (wgmma) backward, which skips the blocks outside the documents (sm90+).
  'auto'                on an NVIDIA GPU with bf16/fp16 self-attention: 'cudnn' without segment
                        ids; with them on sm90+, 'tokamax' up to AUTO_TOKAMAX_MAX_T tokens per row
                        and 'tokamax_mosaic_bwd' above; 'xla' otherwise (CPU, positions, fp32).
Measured on an H200 at MLA's head dims, forward+backward (RESULTS.md, runs 9, 16, 31): T = 8192
with one document, tokamax 5.06 ms against 7.06 with a block-skipping backward (tokamax's causal
pass wastes little on one document); 4 rows of 8192 with three documents each and 12 heads,
tokamax + the Mosaic backward 4.97 ms against tokamax's own backward's 9.00 (run 19); at T = 65536
with 8 documents and 6 heads, a block-skipping backward 18.6 ms against tokamax's 62.7, whose
backward pays a whole causal pass (run 9).
docs/performance.md has the alternatives that were measured and not kept.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from k3jax.parallel import sharding
from k3jax.config import ATTENTION_IMPLS
from k3jax.ops import attention_gpu
from k3jax.ops.attention_blockwise import blockwise_attention, blockwise_max_logits

# XLA path: tokens per query / key block. A block step holds B·H·Q_BLOCK·KV_BLOCK fp32 logits.
DEFAULT_Q_BLOCK = 512
DEFAULT_KV_BLOCK = 512
# 'auto' on packed rows: tokamax's stock backward up to this row length (rows of about one document,
# where its causal pass wastes little and runs faster), the block-skipping backward above. At
# 8192-token rows of several documents the block-skipping backward already wins (H200, B 4, H 6,
# documents of 5218/1749/1225 tokens: 3.73 ms forward+backward against 4.61), and loses only on
# rows of a single document (7.06 against 5.06 ms); RESULTS.md, run 16.
AUTO_TOKAMAX_MAX_T = 4096


def _positions(pos: Optional[jax.Array], batch: int, length: int, name: str) -> Optional[jax.Array]:
  if pos is None:
    return None
  pos = jnp.asarray(pos)
  if pos.ndim == 1:
    pos = jnp.broadcast_to(pos[None], (batch, pos.shape[0]))
  if pos.shape != (batch, length):
    raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got {pos.shape}")
  if not jnp.issubdtype(pos.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {pos.dtype}")
  return pos.astype(jnp.int32)


def _segments(seg: Optional[jax.Array], batch: int, length: int, name: str) -> Optional[jax.Array]:
  if seg is None:
    return None
  seg = jnp.asarray(seg)
  if seg.shape != (batch, length):
    raise ValueError(f"{name} must have shape [{batch}, {length}], got {seg.shape}")
  if not jnp.issubdtype(seg.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {seg.dtype}")
  return seg.astype(jnp.int32)


def _gpu_unusable_reason(q: jax.Array, v: jax.Array, min_cc: tuple[int, int]) -> Optional[str]:
  """Why the GPU kernels cannot run these inputs here, or None when they can."""
  cc = attention_gpu.compute_capability()
  if cc is None:
    return f"the default JAX backend is {jax.default_backend()!r}, not an NVIDIA 'gpu'"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"the GPU kernels need bfloat16 or float16 inputs, got {q.dtype}"
  if cc < min_cc:
    return f"compute capability {cc} is below {min_cc}"
  d, dv = q.shape[-1], v.shape[-1]
  d_max = 256 if cc >= (9, 0) else 128
  if d % 8 != 0 or d > d_max:
    return f"head dim {d} must be a multiple of 8 and <= {d_max} on compute capability {cc}"
  if dv > d:
    return f"value head dim {dv} larger than the query/key head dim {d}"
  return None


def cudnn_unusable_reason(q: jax.Array, k: jax.Array, v: jax.Array) -> Optional[str]:
  """Why cuDNN flash attention cannot run these inputs here, or None when it can."""
  del k
  return _gpu_unusable_reason(q, v, (8, 0))


def _resolve(implementation: str, q, v, *, has_segments: bool, has_positions: bool) -> str:
  """The concrete implementation for 'auto', after checking that a named one can run."""
  if implementation == "xla":
    return "xla"
  if implementation == "auto":
    if has_positions:
      return "xla"
    if has_segments:
      if _gpu_unusable_reason(q, v, (9, 0)) is not None:
        return "xla"
      return "tokamax" if q.shape[1] <= AUTO_TOKAMAX_MAX_T else "tokamax_mosaic_bwd"
    return "cudnn" if _gpu_unusable_reason(q, v, (8, 0)) is None else "xla"
  if has_positions:
    raise ValueError(f"implementation={implementation!r} takes no q_positions/kv_positions "
                     "(self-attention over packed rows only); use 'xla' or 'auto'")
  if implementation == "cudnn" and has_segments:
    raise ValueError("implementation='cudnn' runs rows without segment ids only: cuDNN's packed "
                     "layout gave wrong outputs on an H200 (RESULTS.md, run 9); use "
                     "'tokamax_mosaic_bwd', 'tokamax' or 'auto' for packed rows")
  if implementation == "tokamax_mosaic_bwd" and not has_segments:
    raise ValueError(f"implementation={implementation!r} needs segment ids; rows without them "
                     "run on 'cudnn', 'tokamax' or 'xla'")
  min_cc = (8, 0) if implementation == "cudnn" else (9, 0)
  reason = _gpu_unusable_reason(q, v, min_cc)
  if reason is not None:
    raise ValueError(f"implementation={implementation!r} is not usable: {reason}; use 'xla' or "
                     "'auto'")
  return implementation


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
              q_segment_ids: Optional[jax.Array] = None,
              kv_segment_ids: Optional[jax.Array] = None,
              q_positions: Optional[jax.Array] = None,
              kv_positions: Optional[jax.Array] = None,
              causal: bool = True,
              scale: Optional[float] = None,
              implementation: str = "auto",
              q_block: Optional[int] = None,
              kv_block: Optional[int] = None) -> jax.Array:
  """Multi-head softmax attention (MHA, or GQA/MQA when k/v have fewer heads).

  Args:
    q: [B, T, H, D] queries.
    k: [B, S, Hk, D] keys, H % Hk == 0 (Hk == 1 is MQA).
    v: [B, S, Hk, Dv] values.
    q_segment_ids / kv_segment_ids: [B, T] / [B, S] int, 0 = padding; give both or neither. The
      GPU document implementations need them to be the same array (self-attention, T == S).
    q_positions / kv_positions: [T] or [B, T] / [S] or [B, S] int positions for the causal mask; give
      both or neither. Needed for causal attention when T != S (e.g. decode against a cache).
    causal: apply the causal mask.
    scale: logit scale; default D**-0.5.
    implementation: one of ATTENTION_IMPLS (module docstring).
    q_block / kv_block: XLA path only: tokens per query / key block (default 512 each).

  Returns:
    [B, T, H, Dv] in q.dtype. Queries that see no key (padding) give zeros.
  """
  if implementation not in ATTENTION_IMPLS:
    raise ValueError(f"implementation must be one of {ATTENTION_IMPLS}, got {implementation!r}")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be 4-D [B, T, H, D]; got shapes {q.shape}, {k.shape}, {v.shape}")
  b, t, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"k must have shape [B={b}, S, Hk, D={d}], got {k.shape}")
  s, hk = k.shape[1], k.shape[2]
  if v.shape[:3] != (b, s, hk):
    raise ValueError(f"v must have shape [{b}, {s}, {hk}, Dv] like k, got {v.shape}")
  if h % hk != 0:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk})")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together (or neither)")
  if (q_positions is None) != (kv_positions is None):
    raise ValueError("q_positions and kv_positions must be given together (or neither)")
  if causal and q_positions is None and t != s:
    raise ValueError(f"causal attention with T={t} != S={s} needs q_positions and kv_positions "
                     "to say which keys each query may see")
  for name, block in (("q_block", q_block), ("kv_block", kv_block)):
    if block is not None and block <= 0:
      raise ValueError(f"{name} must be a positive integer or None, got {block}")
  scale = float(d ** -0.5) if scale is None else float(scale)

  q_seg = _segments(q_segment_ids, b, t, "q_segment_ids")
  kv_seg = _segments(kv_segment_ids, b, s, "kv_segment_ids")
  q_pos = _positions(q_positions, b, t, "q_positions")
  kv_pos = _positions(kv_positions, b, s, "kv_positions")
  impl = _resolve(implementation, q, v, has_segments=q_seg is not None,
                  has_positions=q_pos is not None)

  if impl != "xla" and q_seg is not None:
    if t != s or q_segment_ids is not kv_segment_ids:
      raise ValueError(f"implementation={impl!r} attends within documents of one row: "
                       "q_segment_ids and kv_segment_ids must be the same array (T == S)")

  if impl == "xla":
    if q_seg is None:
      q_seg, kv_seg = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
    if q_pos is None:
      q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    out = blockwise_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos, scale=scale, causal=causal,
                              q_block=q_block or DEFAULT_Q_BLOCK,
                              kv_block=kv_block or DEFAULT_KV_BLOCK)
  elif impl == "cudnn" and q_seg is None:
    out = attention_gpu.cudnn_causal_attention(q, k, v, scale=scale, causal=causal)
  else:
    kernel = (attention_gpu.tokamax_attention if impl == "tokamax"
              else attention_gpu.mosaic_backward_attention)
    # The kernels are opaque custom calls that XLA cannot split along a sharded batch (it would
    # gather every row onto every device): each device runs them on its own rows.
    out = sharding.map_over_batch_shards(
        lambda q, k, v, seg: kernel(q, k, v, seg, scale=scale, causal=causal), q, k, v, q_seg)
  return out.astype(q.dtype)


def max_attention_logits(q: jax.Array, k: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                         scale: Optional[float] = None, q_block: int = DEFAULT_Q_BLOCK,
                         kv_block: int = DEFAULT_KV_BLOCK) -> jax.Array:
  """Per-head max of the causal, same-document attention logits (QK-Clip's S_max), no gradient.

  q [B,T,H,D], k [B,T,H,D] (self-attention), segment_ids [B,T] (0 = padding) or None.
  Returns [H] float32 (-inf for a head of rows that are all padding). Blockwise over queries and
  keys, skipping blocks that see nothing: memory O(B·H·q_block·kv_block).
  """
  if q.shape != k.shape:
    raise ValueError(f"q and k must have the same shape [B,T,H,D], got {q.shape} and {k.shape}")
  b, t, _, d = q.shape
  scale = d ** -0.5 if scale is None else scale
  seg = (jnp.ones((b, t), jnp.int32) if segment_ids is None
         else _segments(segment_ids, b, t, "segment_ids"))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return blockwise_max_logits(q, k, seg, pos, seg, pos, scale=float(scale), causal=True,
                              q_block=q_block, kv_block=kv_block)
