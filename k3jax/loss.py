"""The LM head and the token cross-entropy over sequence chunks, without [B, T, vocab] logits.

At 1M tokens the fp32 logits are T·V·4 bytes: 1 GiB at the byte vocabulary (257), 655 GB at K3's
163840. `chunked_cross_entropy` computes the head matmul, the log-softmax and the masked sum one
chunk of positions at a time (`k3jax.ops.chunking.map_position_chunks`: a `lax.map`, each chunk
under `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of keeping them).
It takes what `K3Model(..., return_hidden=True)` returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k3jax.ops.chunking import map_position_chunks


def chunked_cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                          chunk_tokens: int) -> tuple[jax.Array, jax.Array]:
  """(sum of masked token cross-entropies, sum of the mask), fp32 scalars, as
  `k3jax.evaluate.token_cross_entropy` gives them from the logits h @ head.

  Args:
    h: [B, T, d] final normed hidden states; the head matmul runs in h.dtype with fp32 output, as
      in `K3Model`.
    head: [d, V] the LM head (cast to h.dtype).
    targets: [B, T] int token ids in [0, V).
    loss_mask: [B, T] float or bool weights.
    chunk_tokens: the most tokens (B·positions) whose logits exist at once; <= 0 or B·T at most
      this: one chunk, i.e. the plain computation.
  """
  if h.ndim != 3:
    raise ValueError(f"chunked_cross_entropy: h must be [B, T, d], got shape {h.shape}")
  if head.ndim != 2 or head.shape[0] != h.shape[-1]:
    raise ValueError(f"chunked_cross_entropy: head must be [d={h.shape[-1]}, V], got shape "
                     f"{head.shape}")
  for name, a in (("targets", targets), ("loss_mask", loss_mask)):
    if a.shape != h.shape[:2]:
      raise ValueError(f"chunked_cross_entropy: {name} must be [B, T] = {h.shape[:2]}, got shape "
                       f"{a.shape}")
  head = head.astype(h.dtype)

  def chunk(h_c, targets_c, mask_c):
    logits = jnp.dot(h_c, head, preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets_c)
    mask = mask_c.astype(jnp.float32)
    return (), (jnp.sum(ce * mask), jnp.sum(mask))

  _, (ce_sum, count) = map_position_chunks(chunk, [h, targets, loss_mask], chunk_tokens)
  return ce_sum, count
