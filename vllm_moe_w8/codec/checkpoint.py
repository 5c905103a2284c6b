"""Read safetensors checkpoints (index + shards) and check their structure without loading them.

Headers first: a safetensors file starts with an 8-byte little-endian header length and a JSON header
giving every tensor's dtype, shape and byte range. Parsing only that is fast even for ~64k tensors in
40+ shards, and it is what lets us detect a truncated shard (a data range past the file's end) before
any tensor is read. Tensors are read one at a time, only when asked, with safetensors' ``safe_open``.

The checkpoint's index (``model.safetensors.index.json``, ``weight_map``) is authoritative: we iterate
it and never assume shard numbers. A folder with no index but ``*.safetensors`` files is read too.

Imports neither vLLM nor torch at import time (torch only inside :meth:`Checkpoint.load`).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from vllm_moe_w8.codec.model_config import QuantFormat, quant_format, text_config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Bytes per element of every safetensors dtype we may meet.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FP8_DTYPES = ("F8_E4M3",)
SCALE_DTYPES = ("F32", "BF16", "F16")

# Routed experts, per expert: `<prefix>.mlp.experts.{e}.{gate,up,down}_proj.<suffix>`.
EXPERT_RE = re.compile(
    r"^(?P<prefix>.*?)(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
    r"(?P<suffix>weight|weight_scale_inv|weight_scale|input_scale|weight_scale_2)$"
)
LAYER_RE = re.compile(r"\.(\d+)\.")

class CheckpointError(ValueError):
    """A checkpoint problem; the message names the file and/or tensor and the remedy."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its shard's header describes it (nothing loaded)."""

    name: str
    dtype: str  # safetensors spelling: F8_E4M3, BF16, F32, ...
    shape: tuple[int, ...]
    file: str  # shard file name, relative to the checkpoint folder
    begin: int  # byte range inside the shard's data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 1)

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES


@dataclass(frozen=True)
class ExpertName:
    """The parts of a routed-expert tensor name."""

    name: str
    prefix: str  # everything before the layer index, e.g. "model.language_model.layers."
    layer: int
    expert: int
    proj: str  # gate_proj | up_proj | down_proj
    suffix: str  # weight | weight_scale_inv | weight_scale | input_scale

    @property
    def stem(self) -> str:
        """The name without its suffix: `...experts.{e}.{proj}`."""
        return self.name[: -len(self.suffix) - 1]

    @property
    def layer_key(self) -> str:
        """`<prefix><layer>`, e.g. `model.layers.3` (MTP layers keep their own prefix)."""
        return f"{self.prefix}{self.layer}"


def parse_expert_name(name: str) -> ExpertName | None:
    m = EXPERT_RE.match(name)
    if not m:
        return None
    return ExpertName(name, m["prefix"], int(m["layer"]), int(m["expert"]), m["proj"], m["suffix"])


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header dict, data-section offset) of one safetensors file; raises CheckpointError if unreadable."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header (truncated download?)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20 or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} does not fit the file ({size} bytes): not a safetensors file, or truncated"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from e
    _check_header(path, header)
    return header, 8 + n


def _check_header(path: Path, header: Any) -> None:
    """The header's structure: {name: {dtype: str, shape: [int >= 0], data_offsets: [begin, end]}} (else corrupt)."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is JSON {type(header).__name__}, not an object; the file is corrupt")
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(meta, dict) and isinstance(meta.get("dtype"), str)
        shape, offsets = (meta.get("shape"), meta.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2
        ok = ok and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]
        if not ok:
            raise CheckpointError(
                f"{path}: header entry for tensor {name!r} is malformed ({json.dumps(meta)[:200]}); expected "
                "dtype, shape and data_offsets [begin, end]: the file is corrupt, re-download it"
            )


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a [N, K] weight for tiles ``block`` (bk == 0: one column); mirrors fp8.grid_shape."""
    n, k = shape
    bn, bk = block
    return (math.ceil(n / bn), 1 if bk == 0 else math.ceil(k / bk))


class Checkpoint:
    """A checkpoint folder: config.json, the index (or single file) and every shard's header."""

    def __init__(self, path: str | os.PathLike, check_files: bool = True):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder; pass the checkpoint directory (with config.json and *.safetensors)")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing; a Hugging Face checkpoint needs its config.json")
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{cfg_path}: must hold a JSON object, got {type(self.config).__name__}")
        self.index_path: Path | None = None
        self.weight_map: dict[str, str] = self._read_weight_map()
        self.tensors: dict[str, TensorInfo] = {}
        self.file_sizes: dict[str, int] = {}
        self.headers_bytes: dict[str, int] = {}
        self.problems: list[str] = []  # file-level problems (missing / truncated shards), filled by _scan_headers
        self._scan_headers(check_files)

    # -- reading -------------------------------------------------------------------------------
    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            self.index_path = index
            try:
                data = json.loads(index.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: not valid JSON ({e})") from e
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{index}: has no 'weight_map'; re-download the index file")
            bad = [v for v in wm.values() if not (isinstance(v, str) and v and "\x00" not in v and len(v) < 256)]
            if bad:
                raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names; found {str(bad[0])[:80]!r}")
            return {str(k): v for k, v in wm.items()}
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no {INDEX_NAME} and no *.safetensors files")
        wm: dict[str, str] = {}
        for name in files:
            header, _ = read_header(self.path / name)
            for t in header:
                if t != "__metadata__":
                    wm[t] = name
        return wm

    @property
    def shard_files(self) -> list[str]:
        """Shard file names in the order the index first mentions them."""
        return list(dict.fromkeys(self.weight_map.values()))

    def _scan_headers(self, check_files: bool) -> None:
        for fname in self.shard_files:
            fpath = self.path / fname
            if not fpath.is_file():
                self.problems.append(f"{fpath}: shard listed in {INDEX_NAME} is missing ({self._count(fname)} tensors); re-download it")
                continue
            try:
                header, data_start = read_header(fpath)
            except CheckpointError as e:
                self.problems.append(str(e))
                continue
            size = fpath.stat().st_size
            self.file_sizes[fname] = size
            self.headers_bytes[fname] = data_start
            data_end = data_start
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                info = TensorInfo(name, meta["dtype"], tuple(int(s) for s in meta["shape"]), fname, int(begin), int(end))
                data_end = max(data_end, data_start + int(end))
                if self.weight_map.get(name) == fname:
                    self.tensors[name] = info
            if check_files and data_end > size:
                self.problems.append(
                    f"{fpath}: truncated: its header needs {data_end} bytes of data, the file has {size} "
                    f"({data_end - size} missing); re-download this shard"
                )
        for name, fname in self.weight_map.items():
            if name not in self.tensors and fname in self.file_sizes:
                self.problems.append(f"{self.path / fname}: tensor '{name}' is listed in the index for this file but is not in it")

    def _count(self, fname: str) -> int:
        return sum(1 for f in self.weight_map.values() if f == fname)

    def raise_on_file_problems(self) -> None:
        if self.problems:
            raise CheckpointError("; ".join(self.problems[:5]) + (f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""))

    # -- views ---------------------------------------------------------------------------------
    @property
    def text_config(self) -> dict:
        return text_config(self.config)

    @property
    def architecture(self) -> str | None:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else None

    @property
    def quant(self) -> QuantFormat:
        return quant_format(self.config)

    def tensors_in(self, fname: str) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.file == fname]

    def experts(self) -> Iterator[tuple[ExpertName, TensorInfo]]:
        for name, info in self.tensors.items():
            en = parse_expert_name(name)
            if en is not None:
                yield en, info

    def scale_for(self, en: ExpertName) -> TensorInfo | None:
        """The dequantisation scale of an expert weight (weight_scale_inv or weight_scale)."""
        for suffix in ("weight_scale_inv", "weight_scale"):
            t = self.tensors.get(f"{en.stem}.{suffix}")
            if t is not None:
                return t
        return None

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self) -> dict[str, Any]:
        """Identifies the checkpoint's content cheaply (shard names, sizes, header hashes, config)."""
        import hashlib

        h = hashlib.sha256()
        h.update(json.dumps(self.config, sort_keys=True).encode())
        for fname in self.shard_files:
            h.update(fname.encode())
            h.update(str(self.file_sizes.get(fname, -1)).encode())
            fpath = self.path / fname
            if fpath.is_file():
                with open(fpath, "rb") as f:
                    h.update(f.read(self.headers_bytes.get(fname, 8)))
        return {"sha256": h.hexdigest(), "shards": len(self.shard_files), "tensors": len(self.tensors)}

    # -- loading -------------------------------------------------------------------------------
    def load(self, name: str):
        """One tensor as a torch tensor (read from its shard only)."""
        from safetensors import safe_open

        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor named '{name}' in the checkpoint")
        with safe_open(str(self.path / info.file), framework="pt") as f:
            return f.get_tensor(name)

    def load_many(self, names: Iterable[str]) -> dict[str, Any]:
        """Several tensors, opening each shard once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            info = self.tensors.get(n)
            if info is None:
                raise CheckpointError(f"{self.path}: no tensor named '{n}' in the checkpoint")
            by_file.setdefault(info.file, []).append(n)
        out = {}
        for fname, ns in by_file.items():
            with safe_open(str(self.path / fname), framework="pt") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out


def layer_of(name: str) -> int | None:
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None
