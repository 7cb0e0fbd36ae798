"""One `.safetensors` file read straight into the tensors that will hold it: every byte read once, no mmap.

Start-up cost is what this is for (issue 29). A tensor handed out by `safe_open` is a view of a private mmap:
copying it into a parameter pays a page fault per 4 KiB of the file and, for a GPU, a pageable host-to-device
copy that the driver stages again. Here the header is parsed once (names, dtypes, shapes, offsets, each checked
against the file's size), and `copy_into` reads each tensor's bytes with `readinto`:
- a CPU destination of the stored dtype gets them directly in its own memory;
- a CUDA destination gets them through two pinned staging buffers, one filling from the file while the other's
  asynchronous copy runs, so the read and the transfer overlap;
- anything else (a cast, another device) goes through a staging buffer and `copy_`, which casts as it copies.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Large enough that a 2048-wide bf16 projection is a handful of reads, small enough that two pinned buffers
# cost nothing next to the model.
STAGING_BYTES = 64 << 20
_HEADER_LIMIT = 100 << 20  # the format's own bound on the JSON header


class CheckpointError(ValueError):
    """The checkpoint folder does not hold exactly the tensors and files this model needs (a file missing,
    truncated or corrupt here; a tensor missing, extra or mis-shaped in the loader)."""


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class SafetensorsFile:
    """Names, shapes and dtypes of one `.safetensors` file from its header, and its tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"missing file {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(_HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{self.path}: header length {length} runs past the file ({size} bytes)"
                                           " - a truncated or corrupt download?")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{self.path}: unreadable safetensors header ({err})") from None
        self._data_start = 8 + length
        self._entries = _parse_entries(self.path, header, size - self._data_start)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.copy_into([(name, out)])
        return out

    def copy_into(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Each named tensor's stored values into its destination (same shape; cast where the dtypes differ),
        in file order. Returns once every destination holds its values, on whatever device it lives."""
        order = sorted(pairs, key=lambda pair: self._entries[pair[0]].begin)
        staging = _Staging()
        try:
            with open(self.path, "rb", buffering=0) as f:
                for name, dest in order:
                    self._copy_one(f, name, dest, staging)
        finally:
            staging.finish()

    def _copy_one(self, f, name: str, dest: torch.Tensor, staging: "_Staging") -> None:
        entry = self._entries[name]
        if tuple(dest.shape) != entry.shape:
            raise ValueError(f"{self.path}: {name} has shape {list(entry.shape)}, destination {list(dest.shape)}")
        if dest.numel() == 0:
            return
        f.seek(self._data_start + entry.begin)
        if dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous():
            self._read_exactly(f, _byte_view(dest), name)
            return
        flat = dest.view(-1) if dest.is_contiguous() else None
        if flat is None:  # never for a module built by to_empty; read whole, then copy_ lays it out
            whole = torch.empty(entry.shape, dtype=entry.dtype)
            self._read_exactly(f, _byte_view(whole), name)
            dest.copy_(whole)
            return
        item = entry.dtype.itemsize
        per_chunk = STAGING_BYTES // item
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            buffer = staging.take(dest.device)[: count * item]
            self._read_exactly(f, buffer.numpy(), name)
            flat[start:start + count].copy_(buffer.view(entry.dtype), non_blocking=buffer.is_pinned())
            staging.sent(dest.device)

    def _read_exactly(self, f, target, name: str) -> None:
        view = memoryview(target).cast("B")
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{self.path}: file ends inside tensor {name!r} - a truncated download?")
            done += got


class _Staging:
    """Host buffers for destinations that cannot be read into directly: for a CUDA device two pinned ones used
    in turn (each reused only once the copy that last read it has finished), otherwise one pageable one."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list = []
        self._turn = 0
        self._device: torch.device | None = None

    def take(self, device: torch.device) -> torch.Tensor:
        if not self._buffers:
            self._device = device
            pinned = device.type == "cuda"
            count = 2 if pinned else 1
            self._buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)]
            self._events = [None] * count
        self._turn = (self._turn + 1) % len(self._buffers)
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()
            self._events[self._turn] = None
        return self._buffers[self._turn]

    def sent(self, device: torch.device) -> None:
        if device.type == "cuda" and self._buffers[self._turn].is_pinned():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[self._turn] = event

    def finish(self) -> None:
        # The destinations are read next on other streams (the engine's), and the buffers are freed here.
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events = [None] * len(self._events)


def _byte_view(t: torch.Tensor):
    """A writable buffer over a contiguous CPU tensor's bytes."""
    return t.view(-1).view(torch.uint8).numpy()


def _parse_entries(path: Path, header: object, data_size: int) -> dict[str, _Entry]:
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    entries = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[spec["dtype"]]
            shape = tuple(int(n) for n in spec["shape"])
            begin, end = (int(n) for n in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has an unreadable or unsupported header entry "
                                       f"{spec!r}") from None
        if any(n < 0 for n in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {spec!r}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} holds {end - begin} bytes, its shape {list(shape)}"
                                       f" and dtype {spec['dtype']} need {math.prod(shape) * dtype.itemsize}")
        if end > data_size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {end} of a {data_size}-byte data "
                                       "section - a truncated download?")
        entries[name] = _Entry(dtype, shape, begin, end)
    # As safetensors itself requires: the tensors tile the data section, no gap, no overlap, nothing after.
    covered = 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1].begin):
        if entry.begin != covered:
            raise CheckpointError(f"{path}: tensor {name!r} starts at byte {entry.begin} of the data section, the "
                                  f"tensors before it end at {covered} (a gap or an overlap: a corrupt header)")
        covered = entry.end
    if covered != data_size:
        raise CheckpointError(f"{path}: the data section holds {data_size} bytes, its tensors {covered}")
    return entries
