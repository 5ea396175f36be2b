"""The record file format, in one place: what every attnscope file is and how it is written and read.

A record file is an ordinary ``.safetensors`` file: its arrays, and the metadata as one JSON string
under the header key :data:`METADATA_KEY`. :func:`write_attnscope_file` writes one from arrays in
memory; :func:`read_attnscope_file` reads one back whole; :class:`RecordWriter` streams one to disk
layer by layer and :func:`open_arrays` opens one lazily (memory-mapped). The names of the per-row
statistics (:data:`ROW_STATISTICS`) and the distance histogram's bins (:func:`distance_bin_edges`)
are part of the format: the capture fills them, ``records.checks`` checks them.

A streamed file is written in place: the layout (every array's dtype,
shape and byte range) is fixed before the first layer arrives, the header is written first with
room to spare, each layer's slab is copied into a memory map of the file as soon as it is
computed (and then dropped from memory), and the header is rewritten with the final metadata
at the end. Why safetensors and not Zarr: one self-describing file that records already use,
that other tools read, with no new dependency, and whose arrays are contiguous, so opening it
lazily is one ``np.memmap`` per array (zero-copy; a slice reads only its pages). Zarr's chunked
stores would add compression, which float16 attention barely benefits from, at the price of a
folder of many files and a dependency.

>>> writer = RecordWriter(path, {"self.attention": ("float16", (30, 9, 8192, 8192))}, meta)  # doctest: +SKIP
>>> writer.write_layer("self.attention", 3, layer_array)                                      # doctest: +SKIP
>>> writer.close(final_meta)                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..files import cannot_read, written

DTYPE_CODES = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
               "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
NUMPY_DTYPES = {code: np.dtype(name) for name, code in DTYPE_CODES.items()}
HEADER_SLACK = 64 * 1024  # room for the final metadata, which grows a little after the layout is fixed
METADATA_KEY = "attnscope"  # the header's metadata entry: the record's JSON
SENTENCE_ATTENTION = "sentence_attention"  # a planned record's sentence x sentence block means
LOCALITY = "locality"  # a planned record's kept share per (sink, window) pair, [layer, head, pair]
# per-row statistics a capture plan can keep, [layer, head, row] each (``<kind>.stat_<name>``)
ROW_STATISTICS = ("first", "special", "self", "prev", "next", "entropy", "distance", "max_weight")


def _header(layout: Mapping[str, tuple[str, tuple[int, ...]]], meta: Mapping[str, Any]) -> tuple[dict, int]:
    """The safetensors header for ``layout`` (name -> (dtype name, shape)), and the data's size in bytes."""
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(meta)}}
    offset = 0
    for name, (dtype, shape) in layout.items():
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


class RecordWriter:
    """Writes one record file in place, an array slab at a time (see the module docstring)."""

    def __init__(self, path: Path, layout: Mapping[str, tuple[str, tuple[int, ...]]], meta: Mapping[str, Any], *,
                 final_meta_hint: Any = None) -> None:
        """``final_meta_hint``: the bulky parts the final metadata will hold (tokens, text), so that
        the header reserves room for them (twice their JSON: the metadata is a JSON string inside
        the header's JSON, so its quotes and escapes are escaped again)."""
        self.path, self.layout = path, dict(layout)
        header, data_size = _header(self.layout, meta)
        encoded = json.dumps(header).encode()
        reserve = HEADER_SLACK + 2 * len(json.dumps(final_meta_hint).encode())
        self.header_size = (len(encoded) + reserve + 7) // 8 * 8  # safetensors aligns the data to 8 bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(struct.pack("<Q", self.header_size))
            handle.write(encoded.ljust(self.header_size, b" "))
            handle.truncate(8 + self.header_size + data_size)  # sparse until written
        self.maps = {name: self._map(name, header[name]["data_offsets"][0]) for name in self.layout}

    def _map(self, name: str, begin: int) -> np.memmap:
        """Array ``name`` of the file being written, as a writable memory map."""
        dtype, shape = self.layout[name]
        return np.memmap(self.path, dtype=np.dtype(dtype), mode="r+", offset=8 + self.header_size + begin,
                         shape=tuple(shape))

    def write_layer(self, name: str, index: int, values: np.ndarray) -> None:
        """Copy ``values`` into slab ``index`` of the array ``name`` (its leading axis)."""
        self.maps[name][index] = values

    def write(self, name: str, values: np.ndarray) -> None:
        self.maps[name][...] = values

    def close(self, meta: Mapping[str, Any]) -> Path:
        """Flush every array and write the final metadata into the reserved header."""
        for array in self.maps.values():
            array.flush()
        self.maps.clear()
        header, _ = _header(self.layout, meta)
        encoded = json.dumps(header).encode()
        if len(encoded) > self.header_size:
            raise AttnscopeError(f"the metadata of {self.path} outgrew its reserved header")
        with open(self.path, "r+b") as handle:
            handle.seek(8)
            handle.write(encoded.ljust(self.header_size, b" "))
        return self.path


def open_arrays(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """The metadata (JSON text) and memory-mapped, read-only arrays of a record file (any
    safetensors record); a streamed file whose capture never finished is refused."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (header_size,) = struct.unpack("<Q", handle.read(8))
            if header_size > min(size - 8, 100 * 2**20):
                raise ValueError("header size out of range")
            header = json.loads(handle.read(header_size))
        meta_text = header.pop("__metadata__", {}).get(METADATA_KEY)
        if meta_text is None:
            raise AttnscopeError(f"{path} is not an attnscope record")
        unfinished = json.loads(meta_text).get("complete") is False
        arrays = {name: _mapped(path, 8 + header_size, entry, size) for name, entry in header.items()}
        _check_size(header, 8 + header_size, size)
    except OSError as error:
        raise cannot_read(path, error, "record") from None
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as error:
        raise AttnscopeError(f"cannot open record {path}: {error}") from None
    if unfinished:
        raise AttnscopeError(f"{path} was not finished (the capture that wrote it stopped early)")
    return meta_text, arrays


def _check_size(header: Mapping[str, Any], data_start: int, file_size: int) -> None:
    """The arrays fill the file to its end, as safetensors requires: bytes after them are not a record's."""
    end = data_start + max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end != file_size:
        raise ValueError(f"the file has {file_size - end:,} byte(s) after its last array (damaged, or something "
                         "appended)")


def _mapped(path: Path, data_start: int, entry: Mapping[str, Any], file_size: int) -> np.ndarray:
    dtype = NUMPY_DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    shape = tuple(int(n) for n in entry["shape"])
    if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > file_size:
        raise ValueError(f"array {entry} does not fit the file")
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)


def distance_bin_edges(length: int) -> np.ndarray:
    """Inclusive ``[low, high]`` distances of each histogram bin: 0, 1, 2, 3-4, 5-8, 9-16, ...

    >>> distance_bin_edges(10).tolist()
    [[0, 0], [1, 1], [2, 2], [3, 4], [5, 8], [9, 16]]
    """
    edges = [[0, 0], [1, 1]]
    while edges[-1][1] < max(length - 1, 1):
        low = edges[-1][1] + 1
        edges.append([low, 2 * edges[-1][1]])
    return np.array(edges, dtype=np.int64)

def write_attnscope_file(path: str | Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> Path:
    """One ``.safetensors`` file: ``arrays``, with ``metadata`` as JSON under the header key :data:`METADATA_KEY`."""
    from safetensors.numpy import save_file

    path = Path(path)
    with written(path) as temporary:
        save_file(dict(arrays), str(temporary), metadata={METADATA_KEY: json.dumps(metadata)})
    return path


def read_attnscope_file(path: str | Path, what: str) -> tuple[str | None, dict[str, np.ndarray]]:
    """The JSON header text (None if missing) and every array of a file :func:`write_attnscope_file`
    wrote; an unreadable file is one :class:`AttnscopeError` line naming ``what`` it should hold."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            header = (handle.metadata() or {}).get(METADATA_KEY)
            arrays = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise cannot_read(path, error, what) from None
    return header, arrays
