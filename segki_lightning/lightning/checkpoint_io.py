"""SafeCheckpointIO: Lightning checkpoints that load without running code, save atomically, and refuse to load
damaged.

- Loading: always ``torch.load(weights_only=True)`` (tensors and plain containers only: a pickled payload raises
  instead of running), whatever the path -- a local file, or a remote one (``http(s)://``, ``s3://`` ...) read
  through fsspec into memory first. (Lightning itself loads ``http`` checkpoints with ``weights_only=False``.)
- Saving (local paths): written beside the target in the same folder (``.<name>.tmp-<pid>``), flushed and fsynced,
  then renamed over the target, so a kill at any moment leaves either the previous complete file or the new one,
  never a partial or 0-byte one; the next save removes any leftovers of a killed one. Nothing goes through
  ``$TMPDIR``. Remote paths keep Lightning's own save.
- Integrity: every save records a checksum of each tensor (the wrapping int64 sum of its bytes; a flipped bit
  changes it) under ``segki_checksums``; every load recomputes it and checks that the floating-point tensors of the
  model and optimizer are finite, and names what is wrong otherwise.

Example:
    >>> trainer = Trainer(plugins=[SafeCheckpointIO()], callbacks=[ModelCheckpoint(...)])
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from typing_extensions import override

CHECKSUMS = "segki_checksums"
_TMP = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: not loadable as weights only, damaged, or holding non-finite values."""


def tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts/lists/tuples with a dotted name, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            if k != CHECKSUMS:
                yield from tensors(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}" if prefix else str(i))


def checksum(t: torch.Tensor) -> int:
    """The wrapping int64 sum of ``t``'s bytes (8-byte words where its size allows, else single bytes)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    try:
        words = raw.view(torch.int64)
    except RuntimeError:   # a size or storage offset that is not a whole number of words
        words = raw.to(torch.int64)
    return int(words.sum()) if words.numel() else 0


def checksums(checkpoint: dict[str, Any]) -> dict[str, int]:
    return {name: checksum(t) for name, t in tensors(checkpoint)}


def verify(checkpoint: dict[str, Any], source: str) -> None:
    """Raise :class:`CheckpointError` when a recorded checksum differs or a floating-point tensor of the model's
    weights or the optimizer's state is not finite."""
    want = checkpoint.get(CHECKSUMS)
    if want is not None:
        bad = [n for n, t in tensors(checkpoint) if want.get(n) != checksum(t)]
        missing = sorted(set(want) - {n for n, _ in tensors(checkpoint)})
        if bad or missing:
            raise CheckpointError(f"checkpoint {source} is damaged: {len(bad) + len(missing)} tensors differ from "
                                  f"what was saved (first: {(bad + missing)[0]}); resume from an earlier checkpoint")
    for part in ("state_dict", "optimizer_states"):
        for name, t in tensors(checkpoint.get(part, {}), part):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"checkpoint {source} holds non-finite values in {name}; resume from an "
                                      "earlier checkpoint")


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save``/``torch.load`` checkpoint IO, loading weights-only from any path, saving atomically
    and checking integrity (see the module docstring)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
                        ) -> None:
        checkpoint = {**checkpoint, CHECKSUMS: checksums(checkpoint)}
        if not _is_local_file_protocol(str(path)):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_save(checkpoint, Path(path))

    @override
    def load_checkpoint(self, path: str | os.PathLike, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise CheckpointError("SafeCheckpointIO loads checkpoints weights-only; load a trusted file that needs "
                                  "pickled objects with torch.load yourself")
        source = str(path)
        fs = get_filesystem(source)
        if not fs.exists(source):
            raise FileNotFoundError(f"checkpoint {source} does not exist: check ckpt_path")
        with fs.open(source, "rb") as f:
            data = io.BytesIO(f.read()) if not _is_local_file_protocol(source) else None
            try:
                checkpoint = torch.load(data or f, map_location=map_location, weights_only=True)
            except Exception as err:
                raise CheckpointError(f"checkpoint {source} cannot be loaded as weights only (tensors and plain "
                                      f"values): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                                      "A file that needs code to load is refused; if it was cut short, resume from "
                                      "an earlier checkpoint") from None
        verify(checkpoint, source)
        checkpoint.pop(CHECKSUMS, None)
        return checkpoint


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` into ``.<name>.tmp-<pid>`` beside ``path``, fsync, rename over ``path``, fsync the folder; the
    leftovers of earlier saves to ``path`` that were killed are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}{_TMP}*"):
        old.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}{_TMP}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
