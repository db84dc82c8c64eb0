"""The LM head and the token cross-entropy over sequence chunks, without [B, T, vocab] logits.

At 1M tokens the fp32 logits are T·V·4 bytes: 1 GiB at the byte vocabulary (257), 655 GB at K3's
163840. `chunked_cross_entropy` computes the head matmul, the log-softmax and the masked sum one
chunk of positions at a time (`k3jax.ops.chunking.map_position_chunks`: a `lax.map`, each chunk
under `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of keeping them).
It takes what `K3Model(..., return_hidden=True)` returns. `chunked_loss_by_position` is the same
computation with the sums split by each token's position inside its document (the evaluation's
loss by position, `k3jax.training.evaluation`). `token_cross_entropy` is the plain computation from
the logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k3jax.ops.chunking import map_position_chunks


def token_cross_entropy(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
  """(sum of masked token cross-entropies, sum of the mask), both fp32 scalars.

  logits [B,T,V] (cast to fp32), targets [B,T] int32, loss_mask [B,T] float32.
  """
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  mask = loss_mask.astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


def chunked_cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                          chunk_tokens: int) -> tuple[jax.Array, jax.Array]:
  """(sum of masked token cross-entropies, sum of the mask), fp32 scalars, as
  `token_cross_entropy` gives them from the logits h @ head.

  Args:
    h: [B, T, d] final normed hidden states; the head matmul runs in h.dtype with fp32 output, as
      in `K3Model`.
    head: [d, V] the LM head (cast to h.dtype).
    targets: [B, T] int token ids in [0, V).
    loss_mask: [B, T] float or bool weights.
    chunk_tokens: the most tokens (B·positions) whose logits exist at once; <= 0 or B·T at most
      this: one chunk, i.e. the plain computation.
  """
  _check_loss_inputs("chunked_cross_entropy", h, head, targets, loss_mask)
  head = head.astype(h.dtype)

  def chunk(h_c, targets_c, mask_c):
    logits = jnp.dot(h_c, head, preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets_c)
    mask = mask_c.astype(jnp.float32)
    return (), (jnp.sum(ce * mask), jnp.sum(mask))

  _, (ce_sum, count) = map_position_chunks(chunk, [h, targets, loss_mask], chunk_tokens)
  return ce_sum, count


def _check_loss_inputs(fn: str, h, head, targets, loss_mask) -> None:
  if h.ndim != 3:
    raise ValueError(f"{fn}: h must be [B, T, d], got shape {h.shape}")
  if head.ndim != 2 or head.shape[0] != h.shape[-1]:
    raise ValueError(f"{fn}: head must be [d={h.shape[-1]}, V], got shape {head.shape}")
  for name, a in (("targets", targets), ("loss_mask", loss_mask)):
    if a.shape != h.shape[:2]:
      raise ValueError(f"{fn}: {name} must be [B, T] = {h.shape[:2]}, got shape {a.shape}")


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's position inside its document: int32 [B, T], 0 where a segment starts.

  segment_ids: [B, T] int, constant along a document (`k3jax.data.packing.make_batch`: a new id at
  each BOS). Position 0 of a row always starts a segment; a row that begins mid-document counts
  from the row start, which is the context the model has for it.
  """
  if segment_ids.ndim != 2:
    raise ValueError(f"document_positions: segment_ids must be [B, T], got shape "
                     f"{segment_ids.shape}")
  index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def check_bucket_edges(bucket_edges, name: str = "bucket_edges") -> tuple[int, ...]:
  """bucket_edges as a tuple of ints; ValueError naming `name` unless they are strictly
  increasing ints that start at 0."""
  edges = tuple(bucket_edges)
  if (not edges or not all(isinstance(e, int) and not isinstance(e, bool) for e in edges)
      or edges[0] != 0 or any(a >= b for a, b in zip(edges, edges[1:]))):
    raise ValueError(f"{name} = {bucket_edges!r} is not allowed: strictly increasing ints starting "
                     "at 0, e.g. (0, 1024, 8192)")
  return edges


def chunked_loss_by_position(h: jax.Array, head: jax.Array, targets: jax.Array,
                             loss_mask: jax.Array, positions: jax.Array,
                             bucket_edges, chunk_tokens: int) -> tuple[jax.Array, jax.Array]:
  """Masked token cross-entropy summed by position bucket, without [B, T, vocab] logits.

  Bucket k holds the tokens with bucket_edges[k] <= position < bucket_edges[k + 1] (the last
  bucket is unbounded). Summed over the buckets, the two outputs are `chunked_cross_entropy`'s.

  Args:
    h, head, targets, loss_mask, chunk_tokens: as in `chunked_cross_entropy`.
    positions: [B, T] int, each token's position inside its document (`document_positions`).
    bucket_edges: strictly increasing Python ints starting at 0 (static), nb = len(bucket_edges).
  Returns:
    (ce_sum [nb] fp32, count [nb] fp32): per bucket, the sum of masked cross-entropies and of the
    mask.
  """
  edges = check_bucket_edges(bucket_edges)
  _check_loss_inputs("chunked_loss_by_position", h, head, targets, loss_mask)
  if positions.shape != h.shape[:2]:
    raise ValueError(f"chunked_loss_by_position: positions must be [B, T] = {h.shape[:2]}, got "
                     f"shape {positions.shape}")
  head = head.astype(h.dtype)
  upper = jnp.asarray(edges[1:], jnp.int32)
  buckets = jnp.arange(len(edges), dtype=jnp.int32)

  def chunk(h_c, targets_c, mask_c, positions_c):
    logits = jnp.dot(h_c, head, preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets_c)
    mask = mask_c.astype(jnp.float32)
    bucket = jnp.sum(positions_c[..., None] >= upper, axis=-1, dtype=jnp.int32)   # [B, c]
    # A select-and-sum per bucket, not a one-hot matmul (TF32 on GPU) or a scatter-add (atomics:
    # run-to-run differences): exact fp32 sums in a fixed order.
    in_bucket = bucket[..., None] == buckets                                        # [B, c, nb]
    ce_sum = jnp.sum(jnp.where(in_bucket, (ce * mask)[..., None], 0.0), axis=(0, 1))
    count = jnp.sum(jnp.where(in_bucket, mask[..., None], 0.0), axis=(0, 1))
    return (), (ce_sum, count)

  _, (ce_sum, count) = map_position_chunks(chunk, [h, targets, loss_mask, positions],
                                           chunk_tokens)
  return ce_sum, count
