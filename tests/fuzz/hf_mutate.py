"""Seeded mutations of a Hugging Face folder (config.json + model.safetensors + tokenizer.json).

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets) and the tensor bytes; the mutations aim at each: the length field, the JSON as text, each
tensor's entry (dtype, shape, offsets, name), the data, and cuts anywhere. config.json gets wrong types,
missing and absurd values; tokenizer.json gets cut or garbage.
"""

from __future__ import annotations

import json
import struct

import numpy as np

# kind -> cases per run
KINDS = {
    "st_header_len": 8, "st_header_bytes": 10, "st_dtype": 8, "st_shape": 10, "st_offsets": 12,
    "st_drop_tensor": 4, "st_rename_tensor": 4, "st_truncate": 10, "st_data_bytes": 4,
    "config_value": 16, "config_drop_key": 8, "config_text": 6, "tokenizer": 6,
}  # fmt: skip
FILE_OF = {"config": "config.json", "tokenizer": "tokenizer.json", "st": "model.safetensors"}
_ABSURD = [0, -1, 1, 3, 2**31, 2**63 - 1, 1e30, "7", None, [], {}, True, float("nan")]


def file_of(kind: str) -> str:
    return FILE_OF[kind.split("_", 1)[0]]


def _split(st: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", st, 0)[0]
    return json.loads(st[8 : 8 + n]), st[8 + n :]


def _join(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def mutate(kind: str, original: bytes, seed: int) -> bytes:
    """The mutated bytes of the file ``kind`` aims at (``file_of(kind)``)."""
    rng = np.random.default_rng(seed)
    buf = bytearray(original)
    if kind.startswith("st_"):
        header, data = _split(original)
        names = sorted(k for k in header if k != "__metadata__")
        name = names[int(rng.integers(len(names)))]
        entry = header[name]
        if kind == "st_header_len":
            value = [0, 1, 7, len(original), len(original) - 7, 2**63, 2**64 - 1, 2**31][int(rng.integers(8))]
            struct.pack_into("<Q", buf, 0, value)
            return bytes(buf)
        if kind == "st_header_bytes":
            n = struct.unpack_from("<Q", original, 0)[0]
            for pos in rng.integers(8, 8 + n, int(rng.integers(1, 4))):
                buf[pos] = int(rng.integers(256))
            return bytes(buf)
        if kind == "st_dtype":
            entry["dtype"] = ["F64", "I8", "U8", "BOOL", "F8_E4M3", "Q4", "", 7][int(rng.integers(8))]
        elif kind == "st_shape":
            shape = list(entry["shape"])
            choice = int(rng.integers(4))
            if choice == 0 and shape:
                shape[int(rng.integers(len(shape)))] = [0, -1, 2**40, 3][int(rng.integers(4))]
            elif choice == 1:
                shape = shape[::-1] if len(shape) > 1 else shape + [2]
            elif choice == 2:
                shape = shape + [1, 2]
            else:
                shape = "wide"
            entry["shape"] = shape
        elif kind == "st_offsets":
            a, b = entry["data_offsets"]
            entry["data_offsets"] = [
                [b, a], [a, b + 4], [a + 2, b], [a, len(data) + 64], [-4, b], [a, a], [0, b - a], [a, 2**63],
                [a], "x", [a, b, 1], [a - 4, b - 4],
            ][int(rng.integers(12))]
        elif kind == "st_drop_tensor":
            del header[name]
        elif kind == "st_rename_tensor":
            header[name.replace("weight", "weigth") if "weight" in name else name + ".x"] = header.pop(name)
        elif kind == "st_truncate":
            return bytes(buf[: int(rng.integers(0, len(buf)))])
        elif kind == "st_data_bytes":
            data = bytearray(data)
            for pos in rng.integers(0, len(data), 8):
                data[pos] = int(rng.integers(256))
            return _join(header, bytes(data))
        return _join(header, data)
    if kind.startswith("config_"):
        if kind == "config_text":
            cut = int(rng.integers(0, len(buf)))
            return bytes(buf[:cut]) if rng.integers(2) else b"\x00\xff{" + bytes(buf[cut:])
        cfg = json.loads(original)
        keys = sorted(k for k, v in cfg.items() if not isinstance(v, (dict, list)) or k == "architectures")
        key = keys[int(rng.integers(len(keys)))]
        if kind == "config_drop_key":
            del cfg[key]
        else:
            cfg[key] = _ABSURD[int(rng.integers(len(_ABSURD)))]
        return json.dumps(cfg).encode()
    # tokenizer.json
    cut = int(rng.integers(0, len(buf)))
    return bytes(buf[:cut]) if rng.integers(2) else json.dumps({"model": {"type": "Nonsense"}}).encode()
