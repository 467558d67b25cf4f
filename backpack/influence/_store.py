"""Files of influence computations: scores written in chunks as they are computed, fits per block.

Scores on disk (`Influence.scores(..., out_dir=...)`): a folder with `manifest.json` and one
plain tensor file per chunk of training batches (`chunk-000000.pt`, ...): `[Q, n_c]` (or
`[Q, n_c, T]`), or `{module name: ...}` for per-module scores. The manifest records a SHA-256
of everything that determines the numbers (model parameters, fit, query gradients, options), the
chunks finished so far and a digest of each chunk's batches: a rerun with the same inputs skips
the finished chunks' batches (no forward, no backward) and refuses other inputs.

A fit per block (`Influence.save(path, per_module=True)`): a folder with `fit.pt` (strategy,
damping, facts, the block files' names) and one file per block under `blocks/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["ScoreChunks", "read_scores", "tensor_hash", "batch_digest", "cast_floats"]

_MANIFEST = "manifest.json"
_FORMAT = 1


def _update(h: Any, obj: Any) -> None:
    """Feed `obj` (tensors, numbers, strings, containers) into the hash `h`."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.device.type == "meta":  # shape only (another rank's block of an FSDP2 fit)
            h.update(f"M{tuple(t.shape)}{t.dtype}".encode())
            return
        t = t.contiguous().cpu()
        h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=str):
            h.update(repr(key).encode())
            _update(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _update(h, item)
        h.update(b"]")
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        h.update(type(obj).__name__.encode())
        _update(h, vars(obj))
    else:
        h.update(repr(obj).encode())


def tensor_hash(*objs: Any) -> str:
    """SHA-256 (hex) of tensors' bytes, shapes and dtypes and of plain values, nested."""
    h = hashlib.sha256()
    for obj in objs:
        _update(h, obj)
    return h.hexdigest()


def batch_digest(batch: Any) -> str:
    """A short digest of one `(X, y)` batch's values (exact bytes, first 16 hex digits)."""
    return tensor_hash(batch)[:16]


def cast_floats(obj: Any, dtype: torch.dtype | None) -> Any:
    """`obj` with every floating tensor cast to `dtype` (None: unchanged), nested."""
    if dtype is None:
        return obj
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        return {key: cast_floats(value, dtype) for key, value in obj.items()}
    if isinstance(obj, list):
        return [cast_floats(value, dtype) for value in obj]
    if isinstance(obj, tuple):
        return tuple(cast_floats(value, dtype) for value in obj)
    return obj


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_json(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class ScoreChunks:
    """The chunk files and manifest of one score computation in `out_dir` (created or resumed).

    Args:
        out_dir: The folder (created if missing).
        key: SHA-256 of what determines the scores; a manifest with another key is refused.
        chunk_size: Training batches per chunk.
        options: Plain facts recorded in the manifest (shown when refusing).

    Raises:
        ValueError: For a folder holding another computation's manifest.
    """

    def __init__(self, out_dir: Any, key: str, chunk_size: int, options: Mapping[str, Any]) -> None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive number of batches, got {chunk_size}.")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / _MANIFEST
        if self.path.exists():
            manifest = json.loads(self.path.read_text())
            if manifest.get("format") != _FORMAT:
                raise ValueError(f"{self.path} is not a score manifest of format {_FORMAT}.")
            if manifest["key"] != key or manifest["chunk_size"] != int(chunk_size):
                raise ValueError(
                    f"{self.dir} holds scores of other inputs (model, fit, queries or options "
                    f"differ: recorded {manifest['options']}, chunk_size "
                    f"{manifest['chunk_size']}; now {dict(options)}, chunk_size {chunk_size}). "
                    "Use another out_dir or delete it to start over."
                )
            self.manifest = manifest
        else:
            self.manifest = {
                "format": _FORMAT,
                "key": key,
                "chunk_size": int(chunk_size),
                "options": dict(options),
                "chunks": {},
                "num_batches": None,
                "complete": False,
            }
            _atomic_json(self.manifest, self.path)
        self.chunk_size = int(chunk_size)

    def done(self, chunk: int) -> bool:
        """Whether chunk `chunk` is on disk."""
        return str(chunk) in self.manifest["chunks"]

    def check(self, chunk: int, digests: list[str]) -> None:
        """Refuse a finished chunk whose batches now differ from those it was computed on."""
        recorded = self.manifest["chunks"][str(chunk)]["data"]
        if tensor_hash(digests) != recorded:
            raise ValueError(
                f"The training batches of chunk {chunk} differ from those its scores in "
                f"{self.dir} were computed on: use the same training data (and order), or "
                "another out_dir."
            )

    def write(self, chunk: int, value: Any, digests: list[str]) -> None:
        """Save one chunk's scores and record it in the manifest."""
        name = f"chunk-{chunk:06d}.pt"
        _atomic_save(value, self.dir / name)
        first = value if isinstance(value, Tensor) else next(iter(value.values()))
        self.manifest["chunks"][str(chunk)] = {
            "file": name,
            "columns": int(first.shape[1]),
            "batches": len(digests),
            "data": tensor_hash(digests),
        }
        _atomic_json(self.manifest, self.path)

    def finish(self, num_batches: int) -> None:
        """Mark the computation complete (all `num_batches` batches' chunks on disk)."""
        chunks = -(-num_batches // self.chunk_size)
        missing = [c for c in range(chunks) if not self.done(c)]
        if missing:
            raise RuntimeError(f"chunks {missing} of {self.dir} are missing.")
        extra = [c for c in self.manifest["chunks"] if int(c) >= chunks]
        if extra:
            raise ValueError(
                f"{self.dir} holds chunks {extra} past the {num_batches} training batches given: "
                "the training data differ from the earlier run's."
            )
        self.manifest["num_batches"] = num_batches
        self.manifest["complete"] = True
        _atomic_json(self.manifest, self.path)


def read_scores(out_dir: Any, partial: bool = False) -> Tensor | dict[str, Tensor]:
    """The scores written by `Influence.scores(..., out_dir=out_dir)`, chunks concatenated.

    `[Q, N]` (or `[Q, N, T]`), or `{module name: ...}` for per-module scores, in the dtype they
    were stored in.

    Args:
        out_dir: The folder.
        partial: Return the leading finished chunks of an interrupted computation instead of
            refusing it.

    Raises:
        ValueError: For a folder without a manifest, or an unfinished computation
            (`partial=False`).
    """
    path = Path(out_dir) / _MANIFEST
    if not path.exists():
        raise ValueError(f"{out_dir} holds no scores ({_MANIFEST} missing).")
    manifest = json.loads(path.read_text())
    if not manifest["complete"] and not partial:
        done = sorted(int(c) for c in manifest["chunks"])
        raise ValueError(
            f"The scores in {out_dir} are unfinished (chunks {done} done): rerun the same "
            "scores(..., out_dir=...) call to finish them, or pass partial=True."
        )
    parts = []
    chunk = 0
    while str(chunk) in manifest["chunks"]:
        file = Path(out_dir) / manifest["chunks"][str(chunk)]["file"]
        parts.append(torch.load(file, map_location="cpu", weights_only=True))
        chunk += 1
    if not parts:
        raise ValueError(f"{out_dir} holds no finished chunk yet.")
    if isinstance(parts[0], Tensor):
        return torch.cat(parts, dim=1)
    return {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}


# --- fits per block ---------------------------------------------------------------------------
_FIT = "fit.pt"


def _file_name(index: int, name: str) -> str:
    return f"{index:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.pt"


def save_blocks(
    path: Any, state: Mapping[str, Any], writes: Any = None, head_too: bool = True
) -> None:
    """Write a fit's `state()` as a folder: `fit.pt` and one file per block in `blocks/`.

    `writes(name) -> bool`: the blocks this process writes (None: all); `head_too`: whether it
    writes `fit.pt` (several processes writing one folder, each its own blocks).
    """
    root = Path(path)
    (root / "blocks").mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in state.items() if k != "blocks"}
    blocks = state["blocks"]
    files = None
    if blocks is not None:
        files = {}
        for i, block in enumerate(blocks):
            file = _file_name(i, block["name"])
            if writes is None or writes(block["name"]):
                _atomic_save(block, root / "blocks" / file)
            files[block["name"]] = file
    head["block_files"] = files
    if head_too:
        _atomic_save(head, root / _FIT)


def is_block_folder(path: Any) -> bool:
    """Whether `path` is a folder written by `save_blocks`."""
    return Path(path).is_dir() and (Path(path) / _FIT).exists()


def load_head(path: Any, device: Any) -> dict[str, Any]:
    """`fit.pt` of a block folder."""
    return torch.load(Path(path) / _FIT, map_location=device, weights_only=True)


def load_block_state(path: Any, name: str, device: Any = "cpu") -> dict[str, Any]:
    """One block's state from a block folder, by its name."""
    head = load_head(path, device)
    files = head.get("block_files") or {}
    if name not in files:
        raise KeyError(f"{path} has no block {name!r}; it has {sorted(files)}.")
    return torch.load(Path(path) / "blocks" / files[name], map_location=device, weights_only=True)


def load_block_states(path: Any, device: Any, keep: Any = None) -> list[dict[str, Any]] | None:
    """Every block's state of a block folder, in the fit's order (None for "identity").

    `keep(states) -> [bool]`: given every block's shape-only (meta) state, which to load for
    real (None: all); the others stay shape-only.
    """
    head = load_head(path, device)
    files = head.get("block_files")
    if files is None:
        return None
    root = Path(path) / "blocks"
    if keep is None:
        return [
            torch.load(root / f, map_location=device, weights_only=True) for f in files.values()
        ]
    shapes = [torch.load(root / f, map_location="meta", weights_only=True) for f in files.values()]
    return [
        torch.load(root / f, map_location=device, weights_only=True) if wanted else state
        for f, state, wanted in zip(files.values(), shapes, keep(shapes))
    ]
