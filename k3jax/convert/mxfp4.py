"""MXFP4 (OCP Microscaling Formats v1.0) decoding and encoding, in NumPy, on host.

Format. A block of `block_size` (32) consecutive elements along the last (input, K) dimension
shares one E8M0 scale: a uint8 `e` meaning 2^(e - 127); 0xFF is NaN. Each element is FP4 E2M1
(sign, 2 exponent bits with bias 1, 1 mantissa bit); codes 0..7 are +{0, 0.5, 1, 1.5, 2, 3, 4, 6}
(0b0001 = 0.5 is the one subnormal), codes 8..15 the same with the sign bit set (0b1000 = -0).
A block decodes to E2M1_VALUES[code] * 2^(e - 127).

Shapes (compressed-tensors' "mxfp4-pack-quantized" layout): a logical [..., n] weight is stored as
`weight_packed` uint8 [..., n/2] and `weight_scale` uint8 [..., n/block_size].

Nibble order: element 2i is the LOW nibble of byte i, element 2i+1 the HIGH nibble. The OCP MX
spec defines the element and scale encodings; the byte packing here is that of the code that
writes and reads these checkpoints: compressed-tensors' `pack_fp4_to_uint8`
(`indices[:, 0] | (indices[:, 1] << 4)`) and `unpack_fp4_from_uint8` (`stack((low, high))`),
vLLM's `break_fp4_bytes` in
vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py (the same order),
transformers' gpt-oss `convert_moe_packed_tensors` (`out[..., 0::2] = lut[blk & 0x0F]`) and
PyTorch's float4_e2m1fn_x2 tests (`uint8_data[1::2] << 4 | uint8_data[::2]`). Some other code
(e.g. TVM's tests) packs high-first: that is not this format's convention.

Exactness. Every E2M1 value is m * 2^p with m in {1, 1.5} and p in [-1, 2] (or zero): at most two
significant bits. Times 2^(e - 127) it stays two significant bits with exponent in [-128, 129],
so it is exactly representable in float32 and in bfloat16 (8 exponent bits; subnormals reach
2^-133) whenever it is finite; the product of two floats is exact when its result is
representable, hence `dequantize` is exact. Only |value| >= 2^128 (4 or 6 times a scale e >= 253)
would overflow: `dequantize` raises rather than return inf, as it does for a NaN scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK_SIZE = 32
E8M0_NAN = 0xFF
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E2M1_VALUES.setflags(write=False)
# Byte -> its two elements (low nibble first): one gather decodes a whole tensor.
_BYTE_VALUES = np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], -1)
# Round-to-nearest-even on the E2M1 magnitudes: the midpoints between codes k and k+1, with ties
# going up when code k+1 is even (mantissa bit 0): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
# 3.5->4, 5->4. Magnitudes above 6 saturate to 6 (code 7).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
              (5.0, False))
_OUT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def _as_u8(x, name: str, e8m0: bool = False) -> np.ndarray:
  """uint8 view of `x` (uint8, or ml_dtypes.float8_e8m0fnu if `e8m0`); ValueError otherwise."""
  x = np.asarray(x)
  if e8m0 and x.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
    return x.view(np.uint8)
  if x.dtype != np.uint8:
    raise ValueError(f"{name} has dtype {x.dtype}: expected uint8")
  return x


def decode_e8m0(scale_u8) -> np.ndarray:
  """E8M0 scales uint8 [...] -> float32 [...]: 2^(e - 127), NaN for 0xFF (exact; e = 0 gives the
  float32 subnormal 2^-127)."""
  e = _as_u8(scale_u8, "scale", e8m0=True).astype(np.uint32)
  bits = np.where(e == 0, np.uint32(0x00400000), e << 23)
  bits = np.where(e == E8M0_NAN, np.uint32(0x7FC00000), bits)
  return bits.astype(np.uint32).view(np.float32)


def unpack_e2m1(packed_u8) -> np.ndarray:
  """Packed bytes uint8 [..., m] -> E2M1 codes uint8 [..., 2m] in element order (low nibble
  first)."""
  p = _as_u8(packed_u8, "packed")
  return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def pack_e2m1(codes) -> np.ndarray:
  """E2M1 codes uint8 [..., 2m] (each < 16) -> packed bytes uint8 [..., m], low nibble first."""
  c = np.asarray(codes)
  if c.dtype != np.uint8 or c.ndim == 0 or c.shape[-1] % 2 or np.any(c > 0xF):
    raise ValueError(f"codes must be uint8 [..., even] in 0..15: got {c.dtype} {c.shape}")
  return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _check_block_size(block_size: int) -> None:
  if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 2:
    raise ValueError(f"block_size must be a positive even int: got {block_size!r}")


def dequantize(packed, scales, block_size: int = BLOCK_SIZE, dtype=np.float32, *,
               name: str = "weight") -> np.ndarray:
  """MXFP4 -> dense, exactly.

  packed: uint8 [..., n/2] (`{name}_packed`); scales: uint8 (or float8_e8m0fnu)
  [..., n/block_size] (`{name}_scale`); dtype: np.float32 or ml_dtypes.bfloat16.
  Returns dtype [..., n]. ValueError for a wrong dtype or shape, a NaN (0xFF) scale, or a value
  that would overflow `dtype` (named by its block index); `name` prefixes the arrays' names in
  these messages (e.g. a checkpoint key).
  """
  _check_block_size(block_size)
  pname, sname = f"{name}_packed", f"{name}_scale"
  packed, scales = _as_u8(packed, pname), _as_u8(scales, sname, e8m0=True)
  out_dtype = np.dtype(dtype)
  if out_dtype not in _OUT_DTYPES:
    raise ValueError(f"dtype {out_dtype} is not supported: expected float32 or bfloat16")
  if packed.ndim == 0 or (2 * packed.shape[-1]) % block_size:
    raise ValueError(f"{pname} has shape {packed.shape}: its last dim × 2 must be a multiple of "
                     f"block_size {block_size}")
  expected = (*packed.shape[:-1], 2 * packed.shape[-1] // block_size)
  if scales.shape != expected:
    raise ValueError(f"{sname} has shape {scales.shape}: expected {expected} = {pname}'s "
                     f"{packed.shape} with the last dim × 2 / {block_size}")
  if np.any(scales == E8M0_NAN):
    idx = tuple(int(i) for i in np.argwhere(scales == E8M0_NAN)[0])
    raise ValueError(f"{sname}{list(idx)} is 0xFF (E8M0 NaN): block {idx} of {pname} holds no "
                     f"number (elements {idx[-1] * block_size}:{(idx[-1] + 1) * block_size} of "
                     f"its row)")
  n_blocks = expected[-1]
  values = _BYTE_VALUES[packed].reshape(*packed.shape[:-1], n_blocks, block_size)
  with np.errstate(over="ignore"):
    out = values * decode_e8m0(scales)[..., None]
  if scales.size and scales.max() >= 253 and not np.all(np.isfinite(out)):
    idx = tuple(int(i) for i in np.argwhere(~np.isfinite(out).all(-1))[0])
    raise ValueError(f"{sname}{list(idx)} = {scales[idx]}: block {idx} of {pname} overflows "
                     f"{out_dtype} (|value| >= 2^128)")
  return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).astype(out_dtype, copy=False)


def quantize(values, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
  """Dense -> MXFP4 by the OCP MX v1.0 conversion (section 6.3); exact for on-grid values.

  values: float (float16/32/64 or bfloat16) [..., n], n a multiple of block_size, all finite.
  Returns (packed uint8 [..., n/2], scales uint8 [..., n/block_size]).
  Per block: X = floor(log2(max |x|)) - 2 (2 = emax of E2M1, so the largest element lands in
  [4, 8)), clamped below at -127 (the E8M0 minimum; elements of such a tiny block then round
  towards zero); an all-zero block gets X = 0 (scale byte 127). Each x / 2^X is rounded to the
  nearest E2M1 value, ties to even mantissa (code), magnitudes above 6 saturating to 6; the sign
  is kept, so -0.0 and negatives that round to zero give code 0b1000 (-0). A block of values
  already on the grid of some scale round-trips exactly (`dequantize` returns the same values;
  the scale byte may differ when the block's largest magnitude is below 4 times its old scale).
  """
  _check_block_size(block_size)
  x = np.asarray(values)
  if not (np.issubdtype(x.dtype, np.floating) or x.dtype == np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"values have dtype {x.dtype}: expected a float dtype")
  if x.ndim == 0 or x.shape[-1] % block_size:
    raise ValueError(f"values have shape {x.shape}: the last dim must be a multiple of "
                     f"block_size {block_size}")
  x = x.astype(np.float64)
  if not np.all(np.isfinite(x)):
    raise ValueError("values contain NaN or inf: MXFP4 has no encoding for them")
  blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
  amax = np.abs(blocks).max(axis=-1)
  _, exp = np.frexp(amax)              # amax = f * 2^exp with f in [0.5, 1): floor(log2) = exp - 1
  shared = np.where(amax > 0, np.maximum(exp - 1 - 2, -127), 0)
  if np.any(shared > 127):
    raise ValueError(f"values reach {amax.max()}: beyond the E8M0 scale range (max |x| < 2^130)")
  mag = np.abs(np.ldexp(blocks, -shared[..., None]))   # exact: a power-of-two rescale
  codes = np.zeros(mag.shape, np.uint8)
  for mid, tie_up in _MIDPOINTS:
    codes += (mag >= mid) if tie_up else (mag > mid)
  codes |= np.signbit(blocks).astype(np.uint8) << 3
  return pack_e2m1(codes.reshape(x.shape)), (shared + 127).astype(np.uint8)
