"""Restore: committed step -> manifest -> verified reads -> decoded trees -> loaded in place.

Every file of a step is read and verified (size and checksum against the manifest) and decoded
*before* anything touches the live objects, so a damaged checkpoint never half-restores a run.
Loading never unpickles code: native files go through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import threading
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import torch

from checkpointd.codecs.checksum import ChecksumReader
from checkpointd.codecs.compress import decode_bytes
from checkpointd.commit import read_committed_manifest
from checkpointd.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from checkpointd.format import layout
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.format.mdlus import load_mdlus_state_dict
from checkpointd.format.sharding import materialize
from checkpointd.format.subclasses import check_described, check_loaded, check_sharded_described
from checkpointd.format.streams import ReadStream, byte_view
from checkpointd.restore import device_decode, device_image, fastload
from checkpointd.restore.apply import apply_entries
from checkpointd.restore.assemble import assemble_full_values, sharded_values
from checkpointd.restore.per_entry import Selection, fit_values
from checkpointd.restore.verify import check_file
from checkpointd.rng import check_rng
from checkpointd.state import RNG_KEY, Entry
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")


def read_verified(store: Store, step_dir: str, entry: FileEntry) -> bytes:
    """The stored bytes of one file, checked against its manifest entry."""
    rel = layout.join(step_dir, entry.path)
    where = store.display(rel)
    try:
        data = store.read_bytes(rel)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where} is listed in the manifest but missing") from exc
    reader = ChecksumReader()
    reader.update(data)
    check_file(where, entry, len(data), reader.checksum)  # the one comparison, shared with `checkpointd verify`
    return data


def decode(codec_name: str, data: bytes, where: str) -> bytes | bytearray:
    if codec_name in ("none", "", None):
        return data
    try:
        return decode_bytes(codec_name, data)
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where} could not be decompressed with codec {codec_name!r}: {exc}") from exc


def load_native(data: bytes | bytearray | ReadStream, fmt: str, where: str) -> Any:
    """A native ``.pt`` or ``.mdlus`` file's content, with CPU tensors and no code execution."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if fmt == "mdlus":
        return load_mdlus_state_dict(stream)
    return safe_torch_load(stream, where)


def safe_torch_load(stream: Any, where: str) -> Any:
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} holds a pickle that references code outside the weights-only allow-list; it was not run. "
            f"Load it only if you trust its source. ({exc})"
        ) from exc
    except (RuntimeError, EOFError, ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable .pt file: {exc}") from exc


def read_step(store: Store, step_dir: str, manifest: Manifest, rank: int | None = 0, threads: int = 4,
              decode_on_device: bool = False) -> dict[str, Any]:
    """``{relative file path: decoded content}`` for the files of ``rank`` (all ranks if None).

    ``decode_on_device``: within a restore that verifies on a device (:func:`restore_in_place`), local
    ``zstd-planes`` files may be decoded there; the host bytes of their float tensors are then written
    only when read through :func:`checkpointd.restore.device_image.ensure_host`.

    Uploads to the device take turns, largest file first (:class:`checkpointd.restore.device_image.UploadTurns`):
    a file is parsed once its upload ended, while the next uploads, so the largest (the most tensors to
    parse, as a rule the optimizer's) is parsed off the critical path.
    """
    files = sorted((f for f in manifest.files if rank is None or f.rank == rank), key=lambda f: -f.size)
    turns = device_image.UploadTurns()

    def one(i: int, entry: FileEntry) -> tuple[str, Any]:
        try:
            where = store.display(layout.join(step_dir, entry.path))
            if fast_read_applies(store, entry):
                return entry.path, read_local_fast(store, step_dir, entry, decode_on_device, (turns, i))
            data = read_verified(store, step_dir, entry)
            return entry.path, load_native(decode(entry.codec, data, where), entry.format, where)
        finally:
            turns.end(i)  # (if its file was not uploaded)

    if len(files) <= 1:
        return dict(one(i, f) for i, f in enumerate(files))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files))), thread_name_prefix="checkpointd-read") as pool:
        return dict(pool.map(one, range(len(files)), files))  # started in order: no turn waits for a later one


def fast_read_applies(store: Store, entry: FileEntry) -> bool:
    """Local files in a format and codec the in-place loader knows (:mod:`checkpointd.restore.fastload`)."""
    return (
        getattr(store, "is_local", False)
        and entry.format in ("pt", "mdlus")
        and entry.codec in ("none", "", None, "zstd", "zstd-planes")
    )


def read_local_fast(store: Store, step_dir: str, entry: FileEntry, decode_on_device: bool = False,
                    turn: tuple[device_image.UploadTurns, int] | None = None) -> Any:
    """Decoded content of one local file: parallel verified read, decode, tensors built in place.

    Every byte is checked against the manifest before anything is parsed or applied. Within a restore
    into CUDA tensors a mapped file may be uploaded and checksummed on the GPU
    (:mod:`checkpointd.restore.device_image`), its image registered for the apply only once the checksum
    matched; a ``zstd-planes`` file is then decoded there too where ``decode_on_device``. ``turn``: the
    upload's turn among the restore's files (:func:`read_step`).
    """
    rel = layout.join(step_dir, entry.path)
    where = store.display(rel)
    image: list[Any] = []

    def on_device(buf: Any) -> int | None:
        """Upload and checksum on the GPU when this restore verifies there (:mod:`checkpointd.restore.device_image`)."""
        got = device_image.verify(buf, device_decode.PlanesDecoding(buf, entry.raw_size) if planes else None, turn)
        if got is None:
            return None
        image.append(got[0])
        return got[1]

    plain = entry.codec in ("none", "", None)
    planes = decode_on_device and entry.codec == "zstd-planes"
    try:
        buf, size, checksum = fastload.read_file_verified(store.path(rel), entry.size, where,
                                                          device_verify=on_device if plain or planes else None)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where} is listed in the manifest but missing") from exc
    except EOFError as exc:
        raise CorruptCheckpointError(f"{where} was truncated while being read: {exc}") from exc
    check_file(where, entry, size, checksum)  # before anything is parsed, or the image is registered
    decoded = None
    if plain:
        device_image.register(image[0] if image else None)
    else:
        stored = [buf]
        try:
            decoded = device_decode.decode_planes(buf, image[0] if image else None, entry.raw_size) if planes else None
            buf = decoded.host if decoded is not None else fastload.decode_to_buffer(entry.codec, buf, entry.raw_size)
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{where} could not be decompressed with codec {entry.codec!r}: {exc}") from exc
        image.clear()
        drop_later(stored)  # the stored bytes are done with: unmapped or freed off this thread
    content, failure = None, None
    try:
        content = fastload.load_native_in_place(buf, entry.format)  # beside the device's decoding, if any
    except Exception as exc:  # noqa: BLE001 - the plain loader gives the precise error (unsafe, corrupt)
        failure = exc
    if decoded is not None:
        try:
            device_image.register(decoded)  # waits for the device's decoding: it raises if that found damage
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from exc
    if failure is None:
        if decoded is not None and not device_image.follows(content):
            device_image.fill_host(decoded)  # a tree ensure_host cannot follow: the host gets every byte now
        return content
    logger.debug("in-place load of %s failed (%r); using the plain loader", where, failure)
    if decoded is not None:
        device_image.fill_host(decoded)
    return load_native(fastload.BufferReader(byte_view(buf)), entry.format, where)


def values_by_entry(manifest: Manifest, contents: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """``{state name: stored value}`` from decoded files, following the manifest's entry map.

    ``names``: only these entries (those the manifest lacks are left out); default: every entry.
    """
    out: dict[str, Any] = {}
    chosen = manifest.entries.items() if names is None else [(n, manifest.entries[n]) for n in names if n in manifest.entries]
    for name, loc in chosen:
        content = contents.get(loc.file)
        if content is None:
            raise CorruptCheckpointError(f"step {manifest.step}: entry {name!r} points to file {loc.file!r}, which was not read")
        if loc.key is None:
            out[name] = content
        else:
            if not isinstance(content, dict) or loc.key not in content:
                raise CorruptCheckpointError(f"step {manifest.step}: {loc.file} has no key {loc.key!r} for entry {name!r}")
            out[name] = content[loc.key]
    return out


def drop_later(box: list[Any]) -> None:
    """Free ``box``'s items on a short-lived thread instead of the caller's.

    Why: the read buffers of a restore die with its decoded contents, and unmapping or freeing a
    multi-GB buffer costs ~20 ms (page tables torn down), which the training thread need not wait
    for. The caller must hold no other reference to the items.
    """
    threading.Thread(target=box.clear, name="checkpointd-release", daemon=True).start()


def rng_of(manifest: Manifest, contents: Mapping[str, Any]) -> Any:
    rng_file = manifest.extra.get("rng_file")
    if rng_file and isinstance(contents.get(rng_file), dict):
        return contents[rng_file].get(RNG_KEY)
    return None


def files_for(manifest: Manifest, selection: Selection) -> Manifest:
    """The manifest cut to the files a restore of ``selection`` reads: every file without ``entries=``,
    else the files holding the chosen entries, and the RNG file when RNG state is restored.

    A sharded step keeps every file: each rank's file holds blocks of every entry.
    """
    if selection.read_all or manifest.mode == "sharded":
        return manifest
    paths = {manifest.entries[e.name].file for e in selection.entries if e.name in manifest.entries}
    rng_file = manifest.extra.get("rng_file")
    if selection.restores_rng and isinstance(rng_file, str):
        paths.add(rng_file)
    return Manifest(**{**manifest.__dict__, "files": [f for f in manifest.files if f.path in paths]})


def restore_in_place(store: Store, step_dir: str, selection: Selection) -> tuple[Manifest, dict[str, Any], list[str]]:
    """Verify and read one committed step, check it fits the chosen entries, then load it into them.

    Single-process path (a sharded checkpoint is assembled whole first). Nothing is applied unless
    every file read verified and every chosen entry is compatible. With ``entries=`` only the files
    of the chosen entries are read (:func:`files_for`). Returns the manifest, the decoded files (the
    caller restores RNG from them) and what ``strict=False`` left (:attr:`Fitted.left`).
    """
    manifest = read_committed_manifest(store, step_dir)
    # a tensor subclass this process has not imported or does not accept: refused before any pickle runs
    check_described(manifest.extra.get("subclasses"), f"step {manifest.step}")
    check_sharded_described(manifest.extra.get("sharded"), f"step {manifest.step}")
    sharded = manifest.mode == "sharded"  # a distributed save, restored whole into this process
    names = None if selection.read_all else [e.name for e in selection.entries]
    # into CUDA tensors, mapped files of a single-process save may be verified on the GPU (their values
    # then copied from there); a sharded save's pieces are assembled on the host first
    device = None if sharded else device_image.target_device([e.obj for e in selection.entries])
    with device_image.verifying_on(device):
        with malformed_is_damage(store.display(step_dir)):
            if sharded:
                contents = read_step(store, step_dir, manifest, rank=None)
                if names is None:
                    values = assemble_full_values(manifest, contents)
                else:
                    values = {n: materialize(t) for n, t in sharded_values(manifest, contents).items() if n in names}
            else:
                contents = read_step(store, step_dir, files_for(manifest, selection), decode_on_device=True)
                values = values_by_entry(manifest, contents, names)
            check_loaded(values, f"step {manifest.step}")
            fitted = fit_values(selection, values, f"step {manifest.step}",
                                {name: loc.class_name for name, loc in manifest.entries.items()}, manifest.entries)
            rng = rng_of(manifest, contents)
            device_image.ensure_host(rng)
            if rng is not None:
                check_rng(rng)  # a malformed RNG state is damage, found before anything is applied
        _apply(fitted.entries, fitted.values)
    return manifest, contents, fitted.left


def restore_values(selection: Selection, values: Mapping[str, Any], source: str,
                   available: Iterable[str] | None = None) -> list[str]:
    """Load already verified values (``checkpointd.load``'s) into the chosen entries, in place.

    Checked first like a step (:func:`fit_values`, ``source`` names the checkpoint in messages);
    returns what ``strict=False`` left.
    """
    with malformed_is_damage(source):
        check_loaded(values, source)
        fitted = fit_values(selection, values, source, available=available)
    _apply(fitted.entries, fitted.values)
    return fitted.left


@contextlib.contextmanager
def malformed_is_damage(where: str) -> Iterator[None]:
    """Turn the builtin errors that malformed (verified, but not well-formed) content raises while it is
    read and interpreted into :class:`CorruptCheckpointError`, so such a step falls back like damage.

    Only around reading and checking, never around applying to live objects: a failure there is not
    the checkpoint's. Errors of the library (a ``StateMismatchError``) and out-of-memory pass through.
    """
    try:
        yield
    except (CheckpointError, torch.OutOfMemoryError, MemoryError):
        raise
    except (ArithmeticError, AttributeError, EOFError, LookupError, RecursionError, RuntimeError, TypeError,
            ValueError, zipfile.BadZipFile) as exc:
        raise CorruptCheckpointError(
            f"{where} holds malformed content ({type(exc).__name__}: {str(exc)[:300]}); the checkpoint is damaged"
        ) from exc


def _apply(entries: list[Entry], values: Mapping[str, Any]) -> None:
    """Bulk copies into the live tensors, then the per-entry rest (:mod:`checkpointd.restore.apply`).

    Out of device memory with device images held: once more without them. Live tensors change only
    after every entry was planned (the planning allocates), and a second apply writes the same bytes.
    """
    try:
        apply_entries(entries, values)
    except torch.OutOfMemoryError:
        if not device_image.drop_all():
            raise
        logger.info("out of device memory with the restore's device images held: applying again without them")
        apply_entries(entries, values)


__all__ = ["decode", "drop_later", "fast_read_applies", "files_for", "load_native", "malformed_is_damage",
           "read_local_fast", "read_step", "read_verified", "restore_in_place", "restore_values", "rng_of",
           "safe_torch_load", "values_by_entry"]
