"""Restore: committed step -> manifest -> verified reads -> decoded trees -> loaded in place.

Every file of a step is read and verified (size and checksum against the manifest) and decoded
*before* anything touches the live objects, so a damaged checkpoint never half-restores a run.
Loading never unpickles code: native files go through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch

from checkpointd.restore import device_image
from checkpointd.format import layout
from checkpointd.format.streams import ReadStream, byte_view
from checkpointd.codecs.checksum import ChecksumReader
from checkpointd.errors import CheckpointError, CorruptCheckpointError, StateMismatchError, UnsafeCheckpointError
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.rng import check_rng
from checkpointd.state import RNG_KEY, Entry, unwrap_module
from checkpointd.storage.store import Store
from checkpointd.restore.verify import check_file

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
    from checkpointd.codecs.compress import decode_bytes

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
        from checkpointd.format.mdlus import load_mdlus_state_dict

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


def read_step(store: Store, step_dir: str, manifest: Manifest, rank: int | None = 0, threads: int = 4) -> dict[str, Any]:
    """``{relative file path: decoded content}`` for the files of ``rank`` (all ranks if None)."""
    files = [f for f in manifest.files if rank is None or f.rank == rank]

    def one(entry: FileEntry) -> tuple[str, Any]:
        where = store.display(layout.join(step_dir, entry.path))
        if fast_read_applies(store, entry):
            return entry.path, read_local_fast(store, step_dir, entry)
        data = read_verified(store, step_dir, entry)
        return entry.path, load_native(decode(entry.codec, data, where), entry.format, where)

    if len(files) <= 1:
        return dict(one(f) for f in files)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files))), thread_name_prefix="checkpointd-read") as pool:
        return dict(pool.map(one, files))


FAST_READ_ENV = "CHECKPOINTD_FAST_READ"
"""Set to ``0`` to restore through the plain path (benchmarks compare the two)."""


def fast_read_applies(store: Store, entry: FileEntry) -> bool:
    """Local files in a format and codec the in-place loader knows (:mod:`checkpointd.restore.fastload`)."""
    return (
        getattr(store, "is_local", False)
        and entry.format in ("pt", "mdlus")
        and entry.codec in ("none", "", None, "zstd", "zstd-planes")
        and os.environ.get(FAST_READ_ENV, "1") != "0"
    )


def read_local_fast(store: Store, step_dir: str, entry: FileEntry) -> Any:
    """Decoded content of one local file: parallel verified read, decode, tensors built in place.

    Every byte is checked against the manifest before anything is parsed or applied. Within a restore
    into CUDA tensors a mapped file may be uploaded and checksummed on the GPU
    (:mod:`checkpointd.restore.device_image`), its image registered for the apply only once the checksum matched.
    """
    from checkpointd.restore import fastload

    rel = layout.join(step_dir, entry.path)
    where = store.display(rel)
    image: list[Any] = []

    def on_device(buf: Any) -> int | None:
        """Upload and checksum on the GPU when this restore verifies there (:mod:`checkpointd.restore.device_image`)."""
        got = device_image.verify(buf)
        if got is None:
            return None
        image.append(got[0])
        return got[1]

    plain = entry.codec in ("none", "", None)
    try:
        buf, size, checksum = fastload.read_file_verified(store.path(rel), entry.size, where,
                                                          device_verify=on_device if plain else None)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where} is listed in the manifest but missing") from exc
    except EOFError as exc:
        raise CorruptCheckpointError(f"{where} was truncated while being read: {exc}") from exc
    check_file(where, entry, size, checksum)  # before anything is parsed, or the image is registered
    device_image.register(image[0] if image else None)
    if not plain:
        try:
            buf = fastload.decode_to_buffer(entry.codec, buf, entry.raw_size)
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{where} could not be decompressed with codec {entry.codec!r}: {exc}") from exc
    try:
        return fastload.load_native_in_place(buf, entry.format)
    except Exception as exc:  # noqa: BLE001 - the plain loader gives the precise error (unsafe, corrupt)
        logger.debug("in-place load of %s failed (%r); using the plain loader", where, exc)
    return load_native(fastload.BufferReader(byte_view(buf)), entry.format, where)


def values_by_entry(manifest: Manifest, contents: Mapping[str, Any]) -> dict[str, Any]:
    """``{state name: stored value}`` from decoded files, following the manifest's entry map."""
    out: dict[str, Any] = {}
    for name, loc in manifest.entries.items():
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
    import threading

    threading.Thread(target=box.clear, name="checkpointd-release", daemon=True).start()


def rng_of(manifest: Manifest, contents: Mapping[str, Any]) -> Any:
    rng_file = manifest.extra.get("rng_file")
    if rng_file and isinstance(contents.get(rng_file), dict):
        return contents[rng_file].get(RNG_KEY)
    return None


# -- applying to live objects ----------------------------------------------------------------------
def check_compatible(entries: list[Entry], values: Mapping[str, Any], step: int,
                     saved_classes: Mapping[str, str | None] | None = None) -> None:
    """Refuse before touching anything when the live state cannot take the stored values.

    ``saved_classes``: the class each entry had when saved (the manifest's ``class_name``): an
    optimizer, scheduler, scaler or other stateful object of another class is refused.
    """
    for e in entries:
        if e.name not in values:
            raise StateMismatchError(
                f"checkpoint step {step} has no entry {e.name!r} (it holds {sorted(values)}); "
                "register the same state names that were saved"
            )
        v = values[e.name]
        saved = (saved_classes or {}).get(e.name)
        if saved and e.kind in ("optimizer", "scheduler", "scaler", "stateful") and saved != type(e.obj).__name__:
            raise StateMismatchError(
                f"state[{e.name!r}] is a {type(e.obj).__name__}, but step {step} saved a {saved}; "
                f"build a {saved} to resume from this checkpoint (its state does not fit a {type(e.obj).__name__})"
            )
        if e.kind == "module":
            live = unwrap_module(e.obj).state_dict()
            missing = sorted(set(live) - set(v))
            extra = sorted(set(v) - set(live))
            if missing or extra:
                raise StateMismatchError(
                    f"state[{e.name!r}] ({type(e.obj).__name__}) does not match step {step}: "
                    f"missing keys {missing[:5]}, unexpected keys {extra[:5]}"
                )
            for k, t in live.items():
                if isinstance(t, torch.Tensor) and isinstance(v[k], torch.Tensor) and t.shape != v[k].shape:
                    raise StateMismatchError(
                        f"state[{e.name!r}] key {k!r}: live shape {tuple(t.shape)}, saved {tuple(v[k].shape)} at step {step}"
                    )
        elif e.kind == "optimizer":
            live_sizes = [len(g["params"]) for g in e.obj.param_groups]
            groups = v.get("param_groups") if isinstance(v, dict) else None
            saved_sizes = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
            if saved_sizes != live_sizes:
                raise StateMismatchError(
                    f"state[{e.name!r}] ({type(e.obj).__name__}): live parameter groups of sizes {live_sizes}, "
                    f"saved {saved_sizes} at step {step}; build the optimizer over the same parameters that were saved"
                )
        elif e.kind == "tensor":
            if not isinstance(v, torch.Tensor) or v.shape != e.obj.shape:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise StateMismatchError(f"state[{e.name!r}]: live tensor shape {tuple(e.obj.shape)}, saved {got} at step {step}")
        elif e.kind == "data":
            if type(v) is not type(e.obj) and not (isinstance(v, dict) and isinstance(e.obj, dict)):
                raise StateMismatchError(f"state[{e.name!r}]: live {type(e.obj).__name__}, saved {type(v).__name__} at step {step}")


def apply_entry(e: Entry, value: Any) -> None:
    """Load one stored value into its live object, in place."""
    if e.kind == "module":
        unwrap_module(e.obj).load_state_dict(value, strict=True)
    elif e.kind == "optimizer":
        e.obj.load_state_dict(value)
        match_optimizer_state_layout(e.obj)
    elif e.kind in ("scheduler", "scaler", "stateful"):
        e.obj.load_state_dict(value)
    elif e.kind == "tensor":
        with torch.no_grad():
            e.obj.copy_(value)
    elif e.kind == "data":
        value = _onto_live_devices(e.obj, value)
        if isinstance(e.obj, dict):
            e.obj.clear()
            e.obj.update(value)
        else:
            e.obj[:] = value


def _onto_live_devices(live: Any, saved: Any) -> Any:
    """Saved plain data with each tensor moved to where the live tensor at the same place lives.

    Tensors in registered dicts/lists load as CPU tensors; a live CUDA tensor under the same key gets
    its value back on its own device, dtype and memory format (copied into a tensor like it).
    """
    if isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        if live.shape == saved.shape and (live.device != saved.device or live.dtype != saved.dtype or live.stride() != saved.stride()):
            out = torch.empty_like(live)
            out.copy_(saved)
            return out
        return saved
    if isinstance(saved, dict) and isinstance(live, dict):
        return type(saved)((k, _onto_live_devices(live[k], v) if k in live else v) for k, v in saved.items())
    if isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live):
        return [_onto_live_devices(a, b) for a, b in zip(live, saved)]
    return saved


def match_optimizer_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give every per-parameter state tensor its parameter's strides (channels_last stays channels_last).

    ``Optimizer.load_state_dict`` keeps whatever layout the stored tensor had; fused Adam computes
    wrong moments when a channels_last parameter gets contiguous state.
    """
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if not st:
                    continue
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape and v.stride() != p.stride():
                        fixed = torch.empty_like(p, dtype=v.dtype, device=v.device)
                        fixed.copy_(v)
                        st[k] = fixed


def restore_in_place(store: Store, step_dir: str, entries: list[Entry]) -> tuple[Manifest, dict[str, Any]]:
    """Verify and read one committed step, check it fits ``entries``, then load it into them.

    Single-process path (a sharded checkpoint is assembled whole first). Nothing is applied unless
    every file verified and every entry is compatible. Returns the manifest and decoded files (the
    caller restores RNG from them).
    """
    from checkpointd.commit import read_committed_manifest

    manifest = read_committed_manifest(store, step_dir)
    sharded = manifest.mode == "sharded"  # a distributed save, restored whole into this process
    # into CUDA tensors, mapped files of a single-process save may be verified on the GPU (their values
    # then copied from there); a sharded save's pieces are assembled on the host first
    device = None if sharded else device_image.target_device([e.obj for e in entries])
    with device_image.verifying_on(device):
        with malformed_is_damage(store.display(step_dir)):
            if sharded:
                from checkpointd.restore.assemble import assemble_full_values

                contents = read_step(store, step_dir, manifest, rank=None)
                values = assemble_full_values(manifest, contents)
            else:
                contents = read_step(store, step_dir, manifest)
                values = values_by_entry(manifest, contents)
            check_compatible(entries, values, manifest.step,
                             {name: loc.class_name for name, loc in manifest.entries.items()})
            rng = rng_of(manifest, contents)
            if rng is not None:
                check_rng(rng)  # a malformed RNG state is damage, found before anything is applied
        _apply(entries, values)
    return manifest, contents


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
    from checkpointd.restore.apply import apply_entries

    try:
        apply_entries(entries, values)
    except torch.OutOfMemoryError:
        if not device_image.drop_all():
            raise
        logger.info("out of device memory with the restore's device images held: applying again without them")
        apply_entries(entries, values)
