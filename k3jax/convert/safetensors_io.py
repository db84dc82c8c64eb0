"""Reading and writing Hugging Face checkpoint folders, one tensor at a time.

The safetensors format is a little-endian u64 header size, a JSON header {name: {'dtype',
'shape', 'data_offsets': [start, end]}} (offsets relative to the end of the header), then the
tensors' bytes. It is read and written here directly: safetensors' own NumPy API has no bfloat16,
and its JAX API places every tensor on the default device (a GPU, on a GPU host). The tests read
what this module writes with the `safetensors` library, and the converter's benchmark compares the
two readers (experiments/benchmarks/convert_bench.py).

A folder holds either `model.safetensors`, or shards `*.safetensors` listed by
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).
`CheckpointReader` opens the shards lazily (safetensors' `safe_open`, which maps the file and
reads a tensor only when asked), so that converting a model holds one tensor, or one layer's
experts, in host memory at a time. `ShardedWriter` writes tensors into shards of at most
`max_shard_bytes` as they come, and the index at the end. bfloat16 tensors are
`ml_dtypes.bfloat16` NumPy arrays (the bytes reinterpreted, which is exact).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors' dtype names -> NumPy dtypes, and back.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointFormatError(ValueError):
  """A Hugging Face folder that cannot be read as a checkpoint: one line naming what is wrong."""


def _header(path: str) -> dict:
  """The safetensors header of `path`: {name: {'dtype', 'shape', 'data_offsets'}} (and
  '__metadata__'), read without touching the tensors' bytes."""
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    if size <= 0 or size > 100 * 2**20:
      raise CheckpointFormatError(f"{path} is not a safetensors file (header size {size})")
    return json.loads(f.read(size))


class CheckpointReader:
  """The tensors of a Hugging Face checkpoint folder, read one at a time.

  `names()` lists them; `shape(name)`, `dtype_name(name)` come from the headers; `get(name)`
  returns the NumPy array (bfloat16 as ml_dtypes.bfloat16). A folder without safetensors files, an
  index naming a missing shard, or a shard missing a tensor its index names raises
  CheckpointFormatError naming the file or tensor.
  """

  def __init__(self, folder: str):
    self.folder = folder
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
      with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{index_path} has no 'weight_map'")
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
      files, weight_map = [SINGLE_FILE], None
    else:
      found = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
      if not found:
        raise CheckpointFormatError(f"{folder} holds no {SINGLE_FILE}, no {INDEX_FILE} and no "
                                    "*.safetensors file")
      files, weight_map = found, None
    self._headers = {}
    for file in files:
      path = os.path.join(folder, file)
      if not os.path.isfile(path):
        raise CheckpointFormatError(f"missing shard {path} (named by {INDEX_FILE})")
      self._headers[file] = _header(path)
    self._file_of = {}
    for file, header in self._headers.items():
      for name in header:
        if name != "__metadata__":
          self._file_of[name] = file
    if weight_map is not None:
      for name, file in weight_map.items():
        if self._file_of.get(name) != file:
          raise CheckpointFormatError(f"{INDEX_FILE} puts tensor {name!r} in {file}, which does "
                                      "not hold it")
    self._open = {}

  def names(self) -> list[str]:
    return sorted(self._file_of)

  def __contains__(self, name: str) -> bool:
    return name in self._file_of

  def _entry(self, name: str) -> dict:
    if name not in self._file_of:
      raise CheckpointFormatError(f"{self.folder} has no tensor {name!r}")
    return self._headers[self._file_of[name]][name]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entry(name)["shape"])

  def dtype_name(self, name: str) -> str:
    """safetensors' dtype name ('BF16', 'F32', 'U8', ...)."""
    return self._entry(name)["dtype"]

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a NumPy array of its stored dtype and shape (a copy: the file's
    mapping is not kept alive by it)."""
    entry = self._entry(name)
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
      raise CheckpointFormatError(f"tensor {name!r} has dtype {entry['dtype']}, which k3jax does "
                                  f"not read (one of {sorted(_DTYPES)})")
    start, end = entry["data_offsets"]   # relative to the end of the header
    path = os.path.join(self.folder, self._file_of[name])
    with open(path, "rb") as f:
      header_size = int.from_bytes(f.read(8), "little")
      f.seek(8 + header_size + start)
      data = f.read(end - start)
    if len(data) != end - start:
      raise CheckpointFormatError(f"{path} is truncated: tensor {name!r} needs bytes "
                                  f"{start}..{end} of its data")
    return np.frombuffer(data, dtype=dtype).reshape(entry["shape"]).copy()

  def total_bytes(self) -> int:
    return sum(e - s for h in self._headers.values() for n, v in h.items()
               if n != "__metadata__" for s, e in [v["data_offsets"]])


class ShardedWriter:
  """Writes tensors into `folder/model-0000i-of-0000n.safetensors` shards of at most
  `max_shard_bytes` each (a larger tensor gets a shard of its own), in the order given, and
  `model.safetensors.index.json`; a single shard is written as `model.safetensors` with no index
  (what `save_pretrained` writes for small models). Use `add(name, array)` then `close()`."""

  def __init__(self, folder: str, max_shard_bytes: int = 5 * 2**30,
               metadata: Optional[dict] = None):
    self.folder = folder
    self.max_shard_bytes = max_shard_bytes
    self.metadata = {"format": "pt", **(metadata or {})}
    self._pending: list[tuple[str, np.ndarray]] = []
    self._pending_bytes = 0
    self._shards: list[list[str]] = []
    self._names: set[str] = set()
    self._total = 0
    os.makedirs(folder, exist_ok=True)

  def add(self, name: str, array: np.ndarray) -> None:
    if name in self._names:
      raise ValueError(f"tensor {name!r} written twice")
    self._names.add(name)
    array = np.ascontiguousarray(array)
    if np.dtype(array.dtype) not in _NAMES:
      raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
    if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    self._pending.append((name, array))
    self._pending_bytes += array.nbytes
    self._total += array.nbytes

  def _flush(self) -> None:
    index = len(self._shards)
    self._write(os.path.join(self.folder, f"shard-{index:05d}.tmp"), self._pending)
    self._shards.append([name for name, _ in self._pending])
    self._pending, self._pending_bytes = [], 0

  def _write(self, path: str, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    header, offset, arrays = {"__metadata__": self.metadata}, 0, []
    for name, array in tensors:
      header[name] = {"dtype": _NAMES[np.dtype(array.dtype)], "shape": list(array.shape),
                      "data_offsets": [offset, offset + array.nbytes]}
      offset += array.nbytes
      arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
      f.write(len(blob).to_bytes(8, "little"))
      f.write(blob)
      for array in arrays:
        f.write(array.tobytes())

  def close(self) -> list[str]:
    """Writes the last shard and the index; returns the shard file names."""
    if self._pending or not self._shards:
      self._flush()
    n = len(self._shards)
    if n == 1:
      os.replace(os.path.join(self.folder, "shard-00000.tmp"),
                 os.path.join(self.folder, SINGLE_FILE))
      return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, names in enumerate(self._shards):
      file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      os.replace(os.path.join(self.folder, f"shard-{i:05d}.tmp"), os.path.join(self.folder, file))
      files.append(file)
      weight_map.update({name: file for name in names})
    with open(os.path.join(self.folder, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": self._total},
                 "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return files
