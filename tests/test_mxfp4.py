"""k3jax.convert.mxfp4 against values worked out by hand from the OCP MX v1.0 spec, an independent
per-element reference for the off-grid conversion, bit-exact round trips and the input checks."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from k3jax.convert import mxfp4

BF16 = ml_dtypes.bfloat16
# The 16 E2M1 codes 0b0000 .. 0b1111, written out from the spec (s e1 e0 m).
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# 16 bytes = one block of 32 elements; element 2i is byte i's LOW nibble.
BLOCK_BYTES = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,
               0x07, 0x70, 0x8F, 0xF8, 0x00, 0x11, 0x2A, 0xA2]
# Those 32 elements before scaling, byte by byte (low, high).
BLOCK_ELEMENTS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
                  6.0, 0.0, 0.0, 6.0, -6.0, -0.0, -0.0, -6.0,
                  0.0, 0.0, 0.5, 0.5, -1.0, 1.0, 1.0, -1.0]


def _bits(a: np.ndarray) -> np.ndarray:
  """The raw bits of a float32 or bfloat16 array (so -0.0 != 0.0 and NaN == NaN)."""
  return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def _pack(codes: np.ndarray) -> np.ndarray:
  """Independent packer: low nibble = even element."""
  return (codes[..., 0::2] + 16 * codes[..., 1::2]).astype(np.uint8)


# ------------------------------------------------------------------------------------------------
# Decoding, by hand
# ------------------------------------------------------------------------------------------------

def test_one_byte_low_nibble_first():
  assert mxfp4.unpack_e2m1(np.array([0x21], np.uint8)).tolist() == [1, 2]
  out = mxfp4.dequantize(np.full((1, 16), 0x21, np.uint8), np.array([[127]], np.uint8))
  assert out[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]


def test_e8m0_scales():
  got = mxfp4.decode_e8m0(np.array([127, 128, 125, 0, 1, 254, 255], np.uint8))
  assert got.dtype == np.float32
  assert got[:6].tolist() == [1.0, 2.0, 0.25, 2.0**-127, 2.0**-126, 2.0**127]
  assert np.isnan(got[6])
  e8m0 = np.array([127, 130], np.uint8).view(ml_dtypes.float8_e8m0fnu)
  assert mxfp4.decode_e8m0(e8m0).tolist() == [1.0, 8.0]


def test_all_16_codes():
  assert mxfp4.E2M1_VALUES.dtype == np.float32
  assert mxfp4.E2M1_VALUES.tolist() == SPEC_E2M1
  assert np.signbit(mxfp4.E2M1_VALUES).tolist() == [False] * 8 + [True] * 8
  # The same table from the bit fields: s e1 e0 m, exponent bias 1, e = 0 subnormal.
  for code in range(16):
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    magnitude = m * 0.5 if e == 0 else 2.0**(e - 1) * (1 + m / 2)
    assert math.copysign(magnitude, -1.0 if s else 1.0) == SPEC_E2M1[code]
  packed = np.array([BLOCK_BYTES[:8] * 2], np.uint8)          # codes 0..15, twice
  for dtype in (np.float32, BF16):
    out = mxfp4.dequantize(packed, np.array([[127]], np.uint8), dtype=dtype)
    assert out.dtype == dtype
    assert out.shape == (1, 32) and out[0].astype(np.float32).tolist() == SPEC_E2M1 * 2
    assert np.signbit(out[0].astype(np.float32)).tolist() == ([False] * 8 + [True] * 8) * 2


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_blocks_with_known_scales(dtype):
  packed = np.array([BLOCK_BYTES * 2, BLOCK_BYTES * 2], np.uint8)       # [2, 64]: 2 x 2 blocks
  scales = np.array([[126, 130], [125, 0]], np.uint8)                   # x0.5, x8 / x0.25, x2^-127
  out = mxfp4.dequantize(packed, scales, dtype=dtype).astype(np.float32)
  assert out.shape == (2, 64)
  assert out[0, :32].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                                  -0.0, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0,
                                  3.0, 0.0, 0.0, 3.0, -3.0, -0.0, -0.0, -3.0,
                                  0.0, 0.0, 0.25, 0.25, -0.5, 0.5, 0.5, -0.5]
  assert out[0, 32:].tolist() == [0.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0,
                                  -0.0, -4.0, -8.0, -12.0, -16.0, -24.0, -32.0, -48.0,
                                  48.0, 0.0, 0.0, 48.0, -48.0, -0.0, -0.0, -48.0,
                                  0.0, 0.0, 4.0, 4.0, -8.0, 8.0, 8.0, -8.0]
  assert out[1, :32].tolist() == [v * 0.25 for v in BLOCK_ELEMENTS]
  assert out[1, 32:].tolist() == [v * 2.0**-127 for v in BLOCK_ELEMENTS]   # down to 2^-128
  assert np.signbit(out[1, 32:]).tolist() == np.signbit(BLOCK_ELEMENTS).tolist()


def test_leading_dims():
  codes = np.arange(3 * 2 * 64).reshape(3, 2, 64) % 16
  scales = (np.arange(3 * 2 * 2).reshape(3, 2, 2) + 120).astype(np.uint8)
  out = mxfp4.dequantize(_pack(codes), scales)
  want = np.array(SPEC_E2M1)[codes] * 2.0**(np.repeat(scales, 32, -1).astype(int) - 127)
  assert out.shape == (3, 2, 64) and _bits(out).tolist() == _bits(want.astype(np.float32)).tolist()


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_on_grid_round_trip_is_bit_exact(dtype):
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, (4, 3, 256)).astype(np.uint8)
  scales = rng.integers(100, 155, (4, 3, 8)).astype(np.uint8)
  scales[0, 0, :2] = (0, 252)                                           # the extreme scales
  codes[1, 1, :32] = rng.integers(0, 4, 32) | 8 * rng.integers(0, 2, 32)  # a block below 2
  codes[1, 2, :32] = 0                                                  # an all-zero block
  values = mxfp4.dequantize(_pack(codes), scales, dtype=dtype)
  packed, new_scales = mxfp4.quantize(values)
  assert packed.dtype == new_scales.dtype == np.uint8
  assert packed.shape == (4, 3, 128) and new_scales.shape == (4, 3, 8)
  again = mxfp4.dequantize(packed, new_scales, dtype=dtype)
  assert again.dtype == dtype and _bits(again).tolist() == _bits(values).tolist()
  # Exactness: bf16 and float32 decodings are the same numbers.
  f32 = mxfp4.dequantize(_pack(codes), scales)
  assert _bits(mxfp4.dequantize(_pack(codes), scales, dtype=BF16).astype(np.float32)).tolist() \
      == _bits(f32).tolist()


def test_canonical_blocks_round_trip_byte_exact():
  """A block whose largest magnitude is code 6 or 7 (4 or 6 x scale) gets back its own bytes."""
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, (5, 128)).astype(np.uint8)
  codes[:, ::32] = rng.choice([6, 7, 14, 15], (5, 4))
  scales = rng.integers(1, 250, (5, 4)).astype(np.uint8)
  packed = _pack(codes)
  got_packed, got_scales = mxfp4.quantize(mxfp4.dequantize(packed, scales))
  assert got_packed.tolist() == packed.tolist() and got_scales.tolist() == scales.tolist()
  assert mxfp4.pack_e2m1(codes).tolist() == packed.tolist()
  assert mxfp4.unpack_e2m1(packed).tolist() == codes.tolist()


# ------------------------------------------------------------------------------------------------
# Off-grid quantisation
# ------------------------------------------------------------------------------------------------

def _reference(block: list[float]) -> tuple[list[int], int]:
  """Straightforward OCP MX conversion of one block: codes and scale byte."""
  amax = max(abs(v) for v in block)
  if amax == 0:
    x = 0
  else:
    x = max(math.floor(math.log2(amax)) - 2, -127)
  codes = []
  for v in block:
    w = abs(v) / 2.0**x
    # nearest magnitude; on a tie the even code (mantissa bit 0); above 6 the nearest is 6
    best = min(range(8), key=lambda c: (abs(w - abs(SPEC_E2M1[c])), c % 2))
    codes.append(best + (8 if math.copysign(1.0, v) < 0 else 0))
  return codes, x + 127


def _check_against_reference(values: np.ndarray):
  packed, scales = mxfp4.quantize(values)
  codes = mxfp4.unpack_e2m1(packed)
  for row in range(values.shape[0]):
    for b in range(values.shape[1] // 32):
      want_codes, want_scale = _reference(values[row, 32 * b:32 * (b + 1)].astype(float).tolist())
      assert codes[row, 32 * b:32 * (b + 1)].tolist() == want_codes, (row, b)
      assert scales[row, b] == want_scale, (row, b)
  return packed, scales


def test_off_grid_against_reference():
  rng = np.random.default_rng(2)
  values = rng.standard_normal((6, 64)) * np.array([1e-3, 1, 7, 300, 1e20, 2.0**-140])[:, None]
  values[0, :32] = 0.0                                                  # all-zero block
  values[0, 33] = -0.0
  _check_against_reference(values.astype(np.float32))
  _check_against_reference(values.astype(BF16))
  _check_against_reference(values.astype(np.float64))


def test_ties_saturation_and_zero_block_by_hand():
  # Block 0: max 6 -> X = 0; ties go to the even mantissa, sub-0.25 magnitudes to (signed) zero.
  ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
          0.1, -0.1, 0.26, 5.1, 4.9, 2.9, 1.3] + [0.0] * 10
  want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0,
          0.0, -0.0, 0.5, 6.0, 4.0, 3.0, 1.5] + [0.0] * 10
  # Block 1: max 7.5 -> floor(log2 7.5) = 2 -> X = 0; 7.5, 7 and 6.5 saturate to 6.
  sat = [7.5, -7.0, 6.5, 0.3] + [0.0] * 28
  # Block 2: max 8 -> X = 1; 7 / 2 = 3.5 -> 4 -> 8; 5 / 2 = 2.5 -> 2 -> 4; -1 / 2 -> -0.5 -> -1.
  two = [8.0, 7.0, 5.0, -1.0] + [0.0] * 28
  zero = [0.0] * 16 + [-0.0] * 16
  values = np.array([ties + sat, two + zero], np.float32)
  packed, scales = _check_against_reference(values)
  assert scales.tolist() == [[127, 127], [128, 127]]
  out = mxfp4.dequantize(packed, scales)
  assert out[0, :32].tolist() == want
  assert np.signbit(out[0, :32]).tolist() == np.signbit(want).tolist()
  assert out[0, 32:36].tolist() == [6.0, -6.0, 6.0, 0.5]
  assert out[1, :4].tolist() == [8.0, 8.0, 4.0, -1.0]
  assert out[1, 32:].tolist() == zero and np.signbit(out[1, 48:]).all()


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

def test_bad_input():
  p, s = np.zeros((4, 32), np.uint8), np.full((4, 2), 127, np.uint8)
  with pytest.raises(ValueError, match=r"weight_packed has dtype float32: expected uint8"):
    mxfp4.dequantize(p.astype(np.float32), s)
  with pytest.raises(ValueError, match=r"weight_scale has dtype int32: expected uint8"):
    mxfp4.dequantize(p, s.astype(np.int32))
  with pytest.raises(ValueError, match=r"weight_scale has shape \(4, 3\): expected \(4, 2\) = "
                     r"weight_packed's \(4, 32\) with the last dim × 2 / 32"):
    mxfp4.dequantize(p, np.full((4, 3), 127, np.uint8))
  with pytest.raises(ValueError, match=r"experts.0.w1_scale has shape \(2, 2\)"):
    mxfp4.dequantize(p, s[:2], name="experts.0.w1")
  with pytest.raises(ValueError,
                     match=r"weight_packed has shape \(4, 15\).*multiple of block_size"):
    mxfp4.dequantize(np.zeros((4, 15), np.uint8), s)
  with pytest.raises(ValueError, match=r"dtype float16 is not supported"):
    mxfp4.dequantize(p, s, dtype=np.float16)
  bad = s.copy()
  bad[1, 0] = 0xFF
  with pytest.raises(ValueError,
                     match=r"weight_scale\[1, 0\] is 0xFF \(E8M0 NaN\): block \(1, 0\)"):
    mxfp4.dequantize(p, bad)
  big = s.copy()
  big[2, 1] = 254
  mxfp4.dequantize(p, big)                                # zeros times 2^127: fine
  p_six = p.copy()
  p_six[2, 16] = 0x07                                      # element 32 of row 2 = 6 -> 6 * 2^127
  with pytest.raises(ValueError, match=r"block \(2, 1\) of weight_packed overflows"):
    mxfp4.dequantize(p_six, big)
  with pytest.raises(ValueError, match=r"shape \(2, 33\).*multiple of block_size 32"):
    mxfp4.quantize(np.zeros((2, 33), np.float32))
  with pytest.raises(ValueError, match=r"dtype int32: expected a float dtype"):
    mxfp4.quantize(np.zeros((2, 32), np.int32))
  with pytest.raises(ValueError, match=r"NaN or inf"):
    mxfp4.quantize(np.full((1, 32), np.nan, np.float32))
  with pytest.raises(ValueError, match=r"E8M0 scale range"):
    mxfp4.quantize(np.full((1, 32), 2.0**131))
  with pytest.raises(ValueError, match=r"block_size must be a positive even int"):
    mxfp4.quantize(np.zeros((1, 32), np.float32), block_size=0)
