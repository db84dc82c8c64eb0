"""Context parallelism: the sequence-mixing ops over a row split into contiguous slices.

With a mesh whose `context` axis has C > 1 devices, every [B, T, ...] activation is split along T
into C contiguous slices of T / C tokens (`sharding.LOGICAL_AXIS_RULES`: 'activation_length' ->
'context'); device r of the axis holds tokens [r·T/C, (r+1)·T/C). Position-wise layers (FFN, MoE,
AttnRes, norms, the LM head and loss) run on their slice as XLA's SPMD partitioner splits them.
Three ops read other slices' tokens, and run here inside one `jax.shard_map` over the batch axes and
`context` each:

- `conv_over_slices`: the short causal convolution of width W needs the W-1 tokens before the
  slice. One `ppermute` passes each slice's last W-1 inputs (and their segment ids) to the next;
  slice 0 gets padding. The backward is the reverse `ppermute` (autodiff's transpose).
- `kda_over_slices`: KDA's state after a slice is an affine map of the state entering it,
  `S_out = M·S_in + S_ext` (fp32, M [H, K, K], S_ext [H, K, V], for the slice's last document; M = 0
  when a document starts inside the slice). Both come from one pass of the chunked kernel with the
  values widened by K zero columns and the initial state [0 | I]: its final state is [S_ext | M],
  and its output is [o_0 | q·P_t], o_0 the output from a zero initial state and P_t the transition
  from the slice start to t (zero past the slice's first document). One `all_gather` of every
  slice's (M, S_ext) and a merge in slice order give each slice its S_in, and the output is
  o = o_0 + (q·P_t)·S_in. The backward is autodiff's: the gather's transpose is a reduce-scatter
  of the gradients of (M, S_ext), and the kernels' backward takes the gradient of their final
  state. Communication: one gather of C·B·H·K·(K+V) fp32 numbers per layer and direction. The
  same holds for every `ModelConfig.kda_variant`: Gated DeltaNet is the KDA op, and gated linear
  attention (`k3jax.ops.kda_variants.chunk_gla`, no β) has S_out = diag(e^G)·S_in + S_ext.
- `mla_attention_over_slices`: each slice all-gathers the compressed latent of the whole row
  (kv_lora_rank + rope dims per token), not the expanded keys and values, expands it locally and
  attends its queries to every earlier key of their document. The latent's gradient is
  reduce-scattered (the gather's transpose).

Documents are identified by segment ids (0 = padding): a slice's first document continues the
previous slice's last one when the ids at the boundary agree. Rows without segment ids are one
document.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.parallel import sharding


def context_slices() -> int:
  """How many slices the current mesh cuts each row into (1 without a mesh, or inside a
  shard_map over the context axis already)."""
  if not sharding.split_axes((sharding.CONTEXT_AXIS,)):
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[sharding.CONTEXT_AXIS])


def map_over_slices(fn: Callable, *arrays, shared: Sequence = ()):
  """`fn(*shared, *arrays)` on each device's rows and slice: arrays are [B, T, ...] (None passes
  through), split over the batch axes on B and over `context` on T; fn returns arrays of the same
  layout and may use collectives over `sharding.CONTEXT_AXIS`. `shared` arrays are given whole to
  every device, and their gradient is the sum over devices (`sharding.map_over_batch_shards`).

  Raises ValueError when a dimension does not divide over its mesh axes.
  """
  batch = sharding.split_axes(sharding.BATCH_AXES)
  spec = P(batch or None, sharding.CONTEXT_AXIS)
  return sharding.map_over_shards(fn, arrays, tuple(shared), spec, "context parallelism")


def _slice_index():
  return jax.lax.axis_index(sharding.CONTEXT_AXIS)


def _from_previous_slice(x: jax.Array, slices: int) -> jax.Array:
  """Slice r receives slice r-1's x (slice 0 receives zeros)."""
  return jax.lax.ppermute(x, sharding.CONTEXT_AXIS, [(r, r + 1) for r in range(slices - 1)])


# ------------------------------------------------------------------------------------------------
# Short convolution


def conv_over_slices(conv: Callable, x: jax.Array, kernel: jax.Array,
                     segment_ids: Optional[jax.Array]) -> jax.Array:
  """`conv(x, kernel, segment_ids)` (a causal depthwise conv: x [B, T, C], kernel [W, C],
  segment_ids [B, T] int or None, -> [B, T, C]) over the current mesh's context slices, each slice
  seeing the W-1 inputs before it."""
  slices = context_slices()
  width = kernel.shape[0]
  if slices == 1 or width == 1:
    return conv(x, kernel, segment_ids)
  if segment_ids is None:
    segment_ids = jnp.ones(x.shape[:2], jnp.int32)
  halo = width - 1

  def local(kernel, x, seg):
    if x.shape[1] < halo:
      raise ValueError(f"context parallelism: a slice of {x.shape[1]} tokens is shorter than the "
                       f"convolution's history of {halo}; use fewer context slices")
    x_prev = _from_previous_slice(x[:, -halo:], slices)
    seg_prev = _from_previous_slice(seg[:, -halo:], slices)   # zeros (padding) before slice 0
    y = conv(jnp.concatenate([x_prev, x], axis=1), kernel,
             jnp.concatenate([seg_prev, seg], axis=1))
    return y[:, halo:]

  return map_over_slices(local, x, segment_ids, shared=(kernel,))


# ------------------------------------------------------------------------------------------------
# KDA


def _merge_states(m_all: jax.Array, s_all: jax.Array, continues: jax.Array) -> jax.Array:
  """The state entering each slice.

  m_all [C, B, H, K, K], s_all [C, B, H, K, V] fp32: slice r's transition S ↦ m_all[r]·S + s_all[r];
  continues [C, B] bool: slice r's first token continues slice r-1's last document.
  Returns [C, B, H, K, V] fp32: S_in[0] = 0, S_in[r] = continues[r] · (m_all[r-1]·S_in[r-1] +
  s_all[r-1]).
  """
  states = [jnp.zeros_like(s_all[0])]
  for r in range(1, m_all.shape[0]):   # C is a handful: unrolled
    nxt = jnp.einsum("bhij,bhjv->bhiv", m_all[r - 1], states[-1],
                     precision=jax.lax.Precision.HIGHEST) + s_all[r - 1]
    states.append(jnp.where(continues[r][:, None, None, None], nxt, 0.0))
  return jnp.stack(states)


def kda_over_slices(chunk_kda: Callable, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                    beta: jax.Array, segment_ids: Optional[jax.Array],
                    shared: Sequence[Optional[jax.Array]] = ()) -> jax.Array:
  """Chunked KDA over the current mesh's context slices (module docstring).

  chunk_kda(*shared, q, k, v, g, beta, initial_state, segment_ids) -> (o, final_state): the
    single-device op (`k3jax.ops.kda.chunk_kda` or `k3jax.ops.kda_variants.chunk_gla` with its
    options bound), run on each slice.
  q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H], or None for gated linear attention;
  segment_ids [B, T] int or None.
  shared: arrays every slice uses whole (the fused gate's A_log and dt_bias).

  Returns o [B, T, H, V] in v.dtype, as the single-device op computes it.
  """
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  n_shared = len(shared)

  def local(*args):
    params, (q, k, v, g, beta, seg) = args[:n_shared], args[n_shared:]
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    v_wide = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (dk,), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
    h0 = jnp.concatenate([jnp.zeros((b, h, dk, dv), jnp.float32), eye], axis=-1)
    o_wide, s_out = chunk_kda(*params, q, k, v_wide, g, beta, h0, seg)
    s_ext, m = s_out[..., :dv], s_out[..., dv:]
    # Boundary segment ids: slice r continues r-1's last document when the ids agree (not padding).
    first, last = seg[:, 0], seg[:, -1]
    m_all, s_all, first_all, last_all = jax.lax.all_gather(
        (m.astype(jnp.float32), s_ext.astype(jnp.float32), first, last), sharding.CONTEXT_AXIS)
    continues = (first_all[1:] == last_all[:-1]) & (first_all[1:] != 0)
    continues = jnp.concatenate([jnp.zeros_like(continues[:1]), continues])
    s_in = _merge_states(m_all, s_all, continues)[_slice_index()]
    carried = jnp.einsum("bthk,bhkv->bthv", o_wide[..., dv:].astype(jnp.float32), s_in,
                         precision=jax.lax.Precision.HIGHEST)
    return (o_wide[..., :dv].astype(jnp.float32) + carried).astype(v.dtype)

  return map_over_slices(local, q, k, v, g, beta, segment_ids, shared=shared)


# ------------------------------------------------------------------------------------------------
# MLA


def mla_attention_over_slices(attend: Callable, q: jax.Array, c_kv: jax.Array,
                              k_rope: Optional[jax.Array], segment_ids: Optional[jax.Array],
                              shared: Sequence[jax.Array]) -> jax.Array:
  """MLA's causal attention over the current mesh's context slices (module docstring).

  attend(*shared, q, c_kv_row, k_rope_row, q_segment_ids, kv_segment_ids, q_positions,
    kv_positions) -> o [b, t, H, Dv]: expands the whole row's latent into keys and values and
    attends the slice's queries q [b, t, H, Dqk] to them.
  c_kv [B, T, R] and k_rope [B, T, Dr] (or None): the compressed latent; segment_ids [B, T] or None.
  shared: the expansion's weights.

  Returns o [B, T, H, Dv].
  """
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  n_shared = len(shared)

  def local(*args):
    params, (q, c_kv, k_rope, seg) = args[:n_shared], args[n_shared:]
    t = q.shape[1]
    gather = lambda x: jax.lax.all_gather(x, sharding.CONTEXT_AXIS, axis=1, tiled=True)
    c_row, seg_row = gather(c_kv), gather(seg)
    rope_row = None if k_rope is None else gather(k_rope)
    q_pos = _slice_index() * t + jnp.arange(t, dtype=jnp.int32)
    kv_pos = jnp.arange(seg_row.shape[1], dtype=jnp.int32)
    return attend(*params, q, c_row, rope_row, seg, seg_row, q_pos, kv_pos)

  return map_over_slices(local, q, c_kv, k_rope, segment_ids, shared=shared)


__all__ = ["context_slices", "map_over_slices", "conv_over_slices", "kda_over_slices",
           "mla_attention_over_slices"]
