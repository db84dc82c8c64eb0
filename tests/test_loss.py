"""chunked_cross_entropy and chunked_loss_by_position against the logits-based loss, document
positions, and K3Model's return_hidden."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ModelConfig
from k3jax.training.loss import token_cross_entropy
from k3jax.data.packing import make_batch
from k3jax.training.loss import chunked_cross_entropy, chunked_loss_by_position, document_positions
from k3jax.model import K3Model
from testlib import tiny_variables


def _inputs(seed=0, b=2, t=11, d=8, v=13):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) > 0.2, jnp.float32)
  return h, head, targets, mask


@pytest.mark.parametrize("chunk", [0, 6, 4, 1])
def test_equals_dense_loss_and_gradient(chunk):
  h, head, targets, mask = _inputs()

  def dense(h, head):
    logits = jnp.dot(h, head, preferred_element_type=jnp.float32)
    return token_cross_entropy(logits, targets, mask)

  def chunked(h, head):
    return chunked_cross_entropy(h, head, targets, mask, chunk)

  want = dense(h, head)
  got = chunked(h, head)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  # Closed form of the count; the loss sum from numpy.
  logits = np.asarray(h, np.float64) @ np.asarray(head, np.float64)
  logz = np.log(np.exp(logits).sum(-1))
  ce = logz - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(got[0]), float((ce * np.asarray(mask)).sum()), rtol=1e-5)
  assert float(got[1]) == float(np.asarray(mask).sum())
  g_want = jax.grad(lambda h, w: dense(h, w)[0], argnums=(0, 1))(h, head)
  g_got = jax.jit(jax.grad(lambda h, w: chunked(h, w)[0], argnums=(0, 1)))(h, head)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_never_holds_the_logits():
  """The chunked gradient's program has no value with the whole [B, T] positions and the vocab."""
  from tests.ops.test_chunking import all_shapes
  h, head, targets, mask = _inputs(t=12, v=97)
  f = lambda h, w: chunked_cross_entropy(h, w, targets, mask, 6)[0]  # noqa: E731
  shapes = all_shapes(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, head))
  assert not [s for s in shapes if len(s) >= 3 and s[-1] == 97 and np.prod(s[:-1]) > 6], shapes
  f0 = lambda h, w: chunked_cross_entropy(h, w, targets, mask, 0)[0]  # noqa: E731
  assert (2, 12, 97) in all_shapes(jax.make_jaxpr(jax.grad(f0, argnums=(0, 1)))(h, head))


def test_rejects_bad_shapes():
  h, head, targets, mask = _inputs()
  with pytest.raises(ValueError, match="head must be"):
    chunked_cross_entropy(h, head.T, targets, mask, 4)
  with pytest.raises(ValueError, match="loss_mask must be"):
    chunked_cross_entropy(h, head, targets, mask[:, :5], 4)
  with pytest.raises(ValueError, match="h must be"):
    chunked_cross_entropy(h[0], head, targets, mask, 4)


def test_model_return_hidden_gives_the_logits():
  cfg = dataclasses.replace(ModelConfig(), d_model=16, num_layers=2, mla_every=2, vocab_size=19,
                            kda_num_heads=1, kda_head_dim=16, kda_value_dim=16, mla_num_heads=1,
                            mla_kv_lora_rank=8, mla_qk_nope_dim=8, mla_qk_rope_dim=4, mla_v_dim=8,
                            dense_ffn_dim=16, moe_num_experts=4, moe_latent_dim=8,
                            moe_expert_dim=8, moe_shared_dim=8, attnres_block_size=1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 19, size=(2, 16)), jnp.int32)
  variables = tiny_variables(cfg)
  apply = jax.jit(K3Model(cfg).apply, static_argnames="return_hidden")
  logits = apply(variables, tokens)
  h, head = apply(variables, tokens, return_hidden=True)
  assert h.shape == (2, 16, 16) and head.shape == (16, 19)
  np.testing.assert_allclose(np.asarray(jnp.dot(h, head, preferred_element_type=jnp.float32)),
                             np.asarray(logits), rtol=1e-6, atol=1e-6)


def _naive_positions(segment_ids: np.ndarray) -> np.ndarray:
  """Position inside the document by a loop: reset wherever the segment id changes."""
  out = np.zeros(segment_ids.shape, np.int64)
  for b in range(segment_ids.shape[0]):
    for t in range(1, segment_ids.shape[1]):
      same = segment_ids[b, t] == segment_ids[b, t - 1]
      out[b, t] = out[b, t - 1] + 1 if same else 0
  return out


def test_document_positions_restart_at_each_document():
  bos = 0
  # Documents of 3, 5, 1, 4 and 8 tokens in a stream; rows of 7 start mid-document.
  stream = np.array([bos, 5, 6, bos, 7, 8, 9, 10, bos, bos, 1, 2, 3, bos, 4, 4, 4, 4, 4, 4, 4, 4])
  batch = make_batch(stream[:22], 7, bos)
  got = np.asarray(document_positions(jnp.asarray(batch["segment_ids"])))
  np.testing.assert_array_equal(got, _naive_positions(batch["segment_ids"]))
  np.testing.assert_array_equal(got[0], [0, 1, 2, 0, 1, 2, 3])    # row 0: BOS at 0 and 3
  # Row 1 starts mid-document: counted from the row start (the context the model has there).
  np.testing.assert_array_equal(got[1], [0, 0, 0, 1, 2, 3, 0])
  # Padding (segment 0) between documents is a segment of its own.
  seg = jnp.asarray([[1, 1, 0, 0, 2, 2, 2]])
  np.testing.assert_array_equal(np.asarray(document_positions(seg))[0], [0, 1, 0, 1, 0, 1, 2])


def _naive_loss_by_position(h, head, targets, mask, positions, edges):
  logits = np.asarray(h, np.float64) @ np.asarray(head, np.float64)
  logz = np.log(np.exp(logits).sum(-1))
  ce = logz - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
  sums, counts = np.zeros(len(edges)), np.zeros(len(edges))
  for (b, t), p in np.ndenumerate(np.asarray(positions)):
    k = max(i for i, e in enumerate(edges) if e <= p)
    sums[k] += ce[b, t] * float(mask[b, t])
    counts[k] += float(mask[b, t])
  return sums, counts


@pytest.mark.parametrize("chunk", [0, 6, 4, 1])
def test_loss_by_position_matches_dense(chunk):
  h, head, targets, mask = _inputs(t=13)
  # Documents restart positions; segment 0 is padding, its loss_mask 0.
  seg = np.array([[1] * 11 + [2] * 2, [1] * 2 + [2] * 7 + [0] * 4])
  mask = mask * jnp.asarray(seg > 0, jnp.float32)
  positions = document_positions(jnp.asarray(seg))
  edges = (0, 2, 5, 8)
  got = jax.jit(lambda h, w: chunked_loss_by_position(h, w, targets, mask, positions, edges,
                                                      chunk))(h, head)
  want_sums, want_counts = _naive_loss_by_position(h, head, targets, mask, _naive_positions(seg),
                                                   edges)
  assert np.all(want_counts > 0)      # every bucket has tokens: the test compares something
  np.testing.assert_allclose(np.asarray(got[0]), want_sums, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got[1]), want_counts)
  # Chunked = unchunked, and the buckets add up to chunked_cross_entropy's sums.
  plain = chunked_loss_by_position(h, head, targets, mask, positions, edges, 0)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(plain[0]), rtol=1e-6)
  total = chunked_cross_entropy(h, head, targets, mask, chunk)
  np.testing.assert_allclose(float(jnp.sum(got[0])), float(total[0]), rtol=1e-6)
  assert float(jnp.sum(got[1])) == float(total[1])


def test_loss_by_position_never_holds_the_logits():
  from tests.ops.test_chunking import all_shapes
  h, head, targets, mask = _inputs(t=12, v=97)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  f = lambda h, w: chunked_loss_by_position(h, w, targets, mask, positions, (0, 4), 6)  # noqa: E731
  shapes = all_shapes(jax.make_jaxpr(f)(h, head))
  assert not [s for s in shapes if len(s) >= 3 and s[-1] == 97 and np.prod(s[:-1]) > 6], shapes


def test_loss_by_position_rejects_bad_edges_and_shapes():
  h, head, targets, mask = _inputs()
  positions = jnp.zeros(targets.shape, jnp.int32)
  for edges in [(1, 4), (0, 4, 4), (0, 8, 4), (), (0, 2.5)]:
    with pytest.raises(ValueError, match="bucket_edges .* strictly increasing ints starting at 0"):
      chunked_loss_by_position(h, head, targets, mask, positions, edges, 4)
  with pytest.raises(ValueError, match="positions must be"):
    chunked_loss_by_position(h, head, targets, mask, positions[:, :3], (0, 4), 4)
  with pytest.raises(ValueError, match="head must be"):
    chunked_loss_by_position(h, head.T, targets, mask, positions, (0, 4), 4)
