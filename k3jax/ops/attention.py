"""Softmax attention core with causal, segment and position masking; cuDNN / XLA dispatch.

One entry point, `attention`, used by the MLA layer in training (full K/V per head) and in decode
(the absorbed MQA form over the latent cache). The softmax is always taken in fp32.

Masking rules (query t, key s of the same batch row):
  * segments: t sees s only when `q_segment_ids[t] == kv_segment_ids[s]` and `q_segment_ids[t] != 0`
    (0 is padding). Queries that see no key at all (padding) return zeros.
  * causal: t sees s only when `kv_positions[s] <= q_positions[t]`. Without positions, queries and keys
    are the same tokens (T == S) and position = index.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "cudnn")

# The XLA path materialises [B, H, Tq, S] fp32 logits; above this many elements it walks over query
# blocks (each recomputed in the backward pass) so that memory stays bounded.
_XLA_MAX_LOGITS = 1 << 27
_XLA_MIN_Q_BLOCK = 128


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


def _build_mask(q_seg, kv_seg, q_pos, kv_pos, causal: bool) -> Optional[jax.Array]:
  """Boolean [B, Tq, S] mask (True = attend), or None when nothing is masked."""
  mask = None
  if q_seg is not None:
    mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal and q_pos is not None:
    c = kv_pos[:, None, :] <= q_pos[:, :, None]
    mask = c if mask is None else mask & c
  return mask


def _xla_block(q, k, v, mask, *, causal_square: bool, q_offset, scale: float):
  """Attention for one block of queries. q [B,t,H,D], k [B,S,Hk,D], v [B,S,Hk,Dv], mask [B,t,S]|None."""
  b, t, h, d = q.shape
  hk = k.shape[2]
  group = h // hk
  qg = q.reshape(b, t, hk, group, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  s = k.shape[1]
  if causal_square:
    qi = q_offset + jnp.arange(t)[:, None]
    causal = jnp.arange(s)[None, :] <= qi
    mask = causal[None] if mask is None else mask & causal[None]
  if mask is not None:
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if mask is not None:
    # A query with no visible key (padding) gets zeros rather than a uniform average.
    probs = probs * jnp.any(mask, axis=-1)[:, None, None, :, None]
  out = jnp.einsum("bkgts,bskv->btkgv", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, v.shape[-1])


def _attention_xla(q, k, v, mask, *, causal_square: bool, scale: float, q_block: Optional[int]):
  b, t, h, _ = q.shape
  s, hk = k.shape[1], k.shape[2]
  if q_block is None:
    q_block = t
    if b * h * t * s > _XLA_MAX_LOGITS:
      q_block = max(_XLA_MIN_Q_BLOCK, _XLA_MAX_LOGITS // max(1, b * h * s))
  if q_block >= t:
    return _xla_block(q, k, v, mask, causal_square=causal_square, q_offset=0, scale=scale)
  n = -(-t // q_block)
  pad = n * q_block - t
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  qs = qp.reshape(b, n, q_block, h, q.shape[-1]).swapaxes(0, 1)
  if mask is not None:
    mp = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
    ms = mp.reshape(b, n, q_block, s).swapaxes(0, 1)
  else:
    ms = jnp.zeros((n,), jnp.bool_)  # placeholder to scan over
  offsets = jnp.arange(n) * q_block

  @jax.checkpoint
  def one(args):
    qb, mb, off = args
    return _xla_block(qb, k, v, mb if mask is not None else None, causal_square=causal_square,
                      q_offset=off, scale=scale)

  out = jax.lax.map(one, (qs, ms, offsets))
  out = out.swapaxes(0, 1).reshape(b, n * q_block, h, v.shape[-1])
  return out[:, :t]


def cudnn_unusable_reason(q: jax.Array, k: jax.Array, v: jax.Array) -> Optional[str]:
  """Why cuDNN flash attention cannot run these inputs here, or None when it can."""
  try:
    backend = jax.default_backend()
  except RuntimeError as e:  # pragma: no cover
    return f"no JAX backend ({e})"
  if backend != "gpu":
    return f"the default JAX backend is {backend!r}, not 'gpu'"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN flash attention needs bfloat16 or float16 inputs, got {q.dtype}"
  d = q.shape[-1]
  dv = v.shape[-1]
  try:
    cc = tuple(int(x) for x in jax.devices("gpu")[0].compute_capability.split("."))
  except Exception:  # pragma: no cover - non-CUDA GPU backends
    return "the GPU has no CUDA compute capability (not an NVIDIA GPU?)"
  d_max = 256 if cc >= (9, 0) else 128
  if d % 8 != 0 or d > d_max:
    return f"head dim {d} must be a multiple of 8 and <= {d_max} on compute capability {cc}"
  if dv > d:
    return f"value head dim {dv} larger than the query/key head dim {d}"
  return None


def _attention_cudnn(q, k, v, mask, *, causal_square: bool, scale: float):
  d, dv = q.shape[-1], v.shape[-1]
  if dv < d:
    # jax.nn.dot_product_attention wants V shaped like K; zero columns add nothing to the output.
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
  out = jax.nn.dot_product_attention(
      q, k, v, mask=None if mask is None else mask[:, None], scale=scale,
      is_causal=causal_square, implementation="cudnn")
  out = out[..., :dv]
  if mask is not None:
    out = out * jnp.any(mask, axis=-1)[:, :, None, None].astype(out.dtype)
  return out


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
              q_segment_ids: Optional[jax.Array] = None,
              kv_segment_ids: Optional[jax.Array] = None,
              q_positions: Optional[jax.Array] = None,
              kv_positions: Optional[jax.Array] = None,
              causal: bool = True,
              scale: Optional[float] = None,
              implementation: str = "auto",
              q_block: Optional[int] = None) -> jax.Array:
  """Multi-head softmax attention (MHA, or GQA/MQA when k/v have fewer heads).

  Args:
    q: [B, T, H, D] queries.
    k: [B, S, Hk, D] keys, H % Hk == 0 (Hk == 1 is MQA).
    v: [B, S, Hk, Dv] values.
    q_segment_ids / kv_segment_ids: [B, T] / [B, S] int, 0 = padding; give both or neither.
    q_positions / kv_positions: [T] or [B, T] / [S] or [B, S] int positions for the causal mask; give
      both or neither. Needed for causal attention when T != S (e.g. decode against a cache).
    causal: apply the causal mask.
    scale: logit scale; default D**-0.5.
    implementation: 'xla' (plain jnp), 'cudnn' (jax.nn.dot_product_attention on cuDNN; bf16/fp16 on
      an NVIDIA GPU) or 'auto' (cuDNN when usable, else XLA).
    q_block: XLA path only: queries per block (None: whole T unless the logits get large).

  Returns:
    [B, T, H, Dv] in q.dtype. Queries that see no key (padding) give zeros.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
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
  if q_block is not None and q_block <= 0:
    raise ValueError(f"q_block must be a positive integer or None, got {q_block}")
  scale = float(d ** -0.5) if scale is None else float(scale)

  q_seg = _segments(q_segment_ids, b, t, "q_segment_ids")
  kv_seg = _segments(kv_segment_ids, b, s, "kv_segment_ids")
  q_pos = _positions(q_positions, b, t, "q_positions")
  kv_pos = _positions(kv_positions, b, s, "kv_positions")
  mask = _build_mask(q_seg, kv_seg, q_pos, kv_pos, causal)
  # Plain causal over the same tokens is left to the implementation's own (cheaper) causal mask.
  causal_square = causal and q_pos is None

  impl = implementation
  if impl != "xla":
    reason = cudnn_unusable_reason(q, k, v)
    if impl == "cudnn" and reason is not None:
      raise ValueError(f"implementation='cudnn' is not usable: {reason}; use 'xla' or 'auto'")
    impl = "cudnn" if reason is None else "xla"

  if impl == "cudnn":
    out = _attention_cudnn(q, k, v, mask, causal_square=causal_square, scale=scale)
  else:
    out = _attention_xla(q, k, v, mask, causal_square=causal_square, scale=scale, q_block=q_block)
  return out.astype(q.dtype)


def max_attention_logits(q: jax.Array, k: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                         scale: Optional[float] = None, q_block: int = 512) -> jax.Array:
  """Per-head max of the causal, same-document attention logits (QK-Clip's S_max), no gradient.

  q [B,T,H,D], k [B,T,H,D] (self-attention), segment_ids [B,T] (0 = padding) or None.
  Returns [H] float32. Queries are processed in blocks of `q_block` so memory stays O(B·q_block·T·H).
  """
  if q.shape != k.shape:
    raise ValueError(f"q and k must have the same shape [B,T,H,D], got {q.shape} and {k.shape}")
  b, t, h, d = q.shape
  scale = d ** -0.5 if scale is None else scale
  q = jax.lax.stop_gradient(q).astype(jnp.float32) * scale
  k = jax.lax.stop_gradient(k).astype(jnp.float32)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
  q_block = min(q_block, t)
  n = -(-t // q_block)
  pad = n * q_block - t
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, q_block, h, d).swapaxes(0, 1)
  sp = jnp.pad(seg, ((0, 0), (0, pad))).reshape(b, n, q_block).swapaxes(0, 1)
  kv_pos = jnp.arange(t)

  def one(args):
    qb, sb, start = args
    logits = jnp.einsum("bqhd,bshd->bhqs", qb, k, precision=jax.lax.Precision.HIGHEST)
    q_pos = start + jnp.arange(q_block)
    ok = (kv_pos[None, None, :] <= q_pos[None, :, None]) & (sb[:, :, None] == seg[:, None, :]) & \
        (sb[:, :, None] != 0)
    return jnp.max(jnp.where(ok[:, None], logits, -jnp.inf), axis=(0, 2, 3))

  per_block = jax.lax.map(one, (qp, sp, jnp.arange(n) * q_block))
  return jnp.max(per_block, axis=0)
