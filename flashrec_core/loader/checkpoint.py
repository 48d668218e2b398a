"""Reading safetensors checkpoints (single file or sharded) one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the model expects."""


class Checkpoint:
    """Index of tensor name -> file; tensors are read lazily through memory-mapped handles."""

    def __init__(self, model_path: str | Path) -> None:
        self.root = Path(model_path)
        self.files = self._index()
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _index(self) -> dict[str, Path]:
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            files = {name: self.root / fname for name, fname in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise CheckpointError(
                        f"{index} names shard {path.name}, which is missing from {self.root}"
                    )
            return files
        single = self.root / "model.safetensors"
        if single.is_file():
            return dict.fromkeys(_tensor_names(single), single)
        shards = sorted(self.root.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.root} holds no *.safetensors files")
        files: dict[str, Path] = {}
        for shard in shards:
            for name in _tensor_names(shard):
                if name in files:
                    raise CheckpointError(
                        f"tensor '{name}' is in both {files[name].name} and {shard.name} "
                        f"under {self.root}; remove one copy or add an index.json"
                    )
                files[name] = shard
        return files

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def file_of(self, name: str) -> Path:
        return self.files[name]

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        handle = self._handles.get(path)
        try:
            if handle is None:
                handle = self._stack.enter_context(safe_open(path, framework="pt"))
                self._handles[path] = handle
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as exc:
            raise _unreadable(path, exc, f"tensor '{name}'") from exc

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))

    def iter_names(self) -> Iterator[str]:
        """Names grouped by file, so each shard is opened once and read front to back."""
        yield from sorted(self.files, key=lambda n: (str(self.files[n]), n))


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in one safetensors file's header."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc, "header") from exc


def _unreadable(path: Path, exc: Exception, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: cannot read the safetensors {what} ({exc}); the file is truncated or corrupt: "
        "copy or download it again"
    )
