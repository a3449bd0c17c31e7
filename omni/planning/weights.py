"""A stage's weights in bytes, read from the checkpoint's safetensors headers (nothing is loaded).

A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON:
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [a, b]}, ...}`. The header alone says
every tensor's element count, so the bytes a stage will hold follow without reading the data:

    bytes = sum over the stage's tensors of numel * (the stage dtype's size for a floating tensor,
                                                     the stored size for any other)

because the loader casts floating weights to the stage's dtype (a float32 checkpoint loaded in
bfloat16 takes half its file size) and keeps integer buffers as stored. A checkpoint that holds
several stages (Qwen2.5-Omni: "thinker.", "talker.", "token2wav.") is filtered by the stage
model's `checkpoint_prefix`.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype tag -> bytes per element
_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                 "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# A header is JSON of a few MiB at most; a larger length field means the file is not safetensors.
_MAX_HEADER_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class CheckpointWeights:
    bytes: int  # in the stage's dtype
    num_tensors: int
    num_params: int
    files: tuple[str, ...]
    source: str  # "safetensors headers" | "file size" (a GGUF file: its size, a lower bound once dequantized)


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file (ValueError when it is not one)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is not a safetensors header")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_weights(model_path: str | Path, dtype_bytes: int, prefix: str = "") -> CheckpointWeights | None:
    """The weights of the tensors whose names start with `prefix`, as the stage will hold them; None when
    the path has no safetensors file (nor is a single weights file)."""
    path = Path(model_path)
    if path.is_file():
        if path.suffix == ".safetensors":
            files = [path]
        else:  # GGUF and the like: quantized blocks have no per-tensor header we read here
            return CheckpointWeights(path.stat().st_size, 0, 0, (str(path),), "file size")
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
    else:
        return None
    if not files:
        return None
    total = tensors = params = 0
    for file in files:
        for name, info in read_header(file).items():
            if not name.startswith(prefix):
                continue
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            tag = info["dtype"]
            total += numel * (dtype_bytes if tag in _FLOATING else _STORED_BYTES.get(tag, 4))
            tensors += 1
            params += numel
    return CheckpointWeights(total, tensors, params, tuple(str(f) for f in files), "safetensors headers")
