"""Helpers of the attack suite: small runs to attack, forging (edit a file, then re-sign manifest and
marker the way an attacker who controls the root can), hand-built pickles, and the CLI in-process.

A checkpoint root is untrusted input: every helper here writes what an attacker can write, and the
tests assert what the library does with it (SPEC §2, "Everything in a checkpoint is untrusted input").
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import shutil
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import checkpointd
from checkpointd.format import layout
from checkpointd.codecs.checksum import checksum_bytes, sha256_hex
from checkpointd.cli import main as cli_main
from checkpointd.testing.tamper import _encode, recommit


GOOD, BAD = 10, 20
"""The two steps of an attacked root: ``GOOD`` stays intact, ``BAD`` (the newest) is attacked."""
DAMAGED_DIR = ".checkpointd-damaged"
"""Where a step that failed verification during a restore is moved aside (SPEC §2)."""


# -- runs to attack -----------------------------------------------------------------------------------
def new_state(seed: int = 0) -> dict[str, Any]:
    """A Linear(4, 4) with an SGD-momentum optimizer (so it has per-parameter state) and a progress dict."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "progress": {"seen": seed}}


def state_values(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` (model parameters, optimizer moments) as detached clones."""
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for idx, st in state["opt"].state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{idx}.{k}"] = v.detach().clone()
    return out


def advance(state: dict[str, Any], step: int) -> None:
    """Give the run values that differ at every step (so a restore of the wrong step shows)."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(float(step) + 0.25)
        for st in state["opt"].state.values():
            st["momentum_buffer"].mul_(1.5).add_(float(step))
    state["progress"]["seen"] = step


class Run:
    """A root with committed steps and the values each one holds."""

    def __init__(self, root: Path, compression: str | None, values: dict[int, dict[str, torch.Tensor]],
                 progress: dict[int, dict[str, Any]]) -> None:
        self.root, self.compression, self.values, self.progress = root, compression, values, progress

    def step_dir(self, step: int) -> Path:
        return step_dir(self.root, step)


_PRISTINE: dict[tuple[Any, ...], tuple[Path, Run]] = {}
"""Runs saved once per process and copied for each test (saving is most of a test's time)."""


def save_run(root: Path, steps: tuple[int, ...] = (GOOD, BAD), compression: str | None = None, **kwargs: Any) -> Run:
    """A root holding ``steps`` (values differing per step); returns what each step holds.

    The first call for given arguments saves them with a manager (into a private directory); every
    call copies that pristine root to ``root``.
    """
    key = (steps, compression, tuple(sorted(kwargs.items())))
    if key not in _PRISTINE:
        top = tempfile.mkdtemp(prefix="checkpointd-adversarial-")
        atexit.register(shutil.rmtree, top, True)
        pristine = Path(top) / "root"
        _PRISTINE[key] = (pristine, _save_run(pristine, steps, compression, **kwargs))
    pristine, run = _PRISTINE[key]
    shutil.copytree(pristine, root, symlinks=True)
    return Run(root, compression, run.values, run.progress)


def _save_run(root: Path, steps: tuple[int, ...], compression: str | None, **kwargs: Any) -> Run:
    state = new_state(0)
    values: dict[int, dict[str, torch.Tensor]] = {}
    progress: dict[int, dict[str, Any]] = {}
    kwargs.setdefault("keep_last", None)
    with checkpointd.CheckpointManager(str(root), state, compression=compression, **kwargs) as mgr:
        for s in steps:
            advance(state, s)
            mgr.save(s)
            mgr.wait()
            values[s] = state_values(state)
            progress[s] = dict(state["progress"])
    return Run(root, compression, values, progress)


def assert_values(state: dict[str, Any], expected: dict[str, torch.Tensor], progress: dict[str, Any] | None = None) -> None:
    got = state_values(state)
    assert sorted(got) == sorted(expected), f"restored tensors {sorted(got)} != saved {sorted(expected)}"
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{k} is not bit-exact after the restore"
    if progress is not None:
        assert state["progress"] == progress


def assert_restores(run: Run, expect: int, *, warns_about: int | None = BAD, **kwargs: Any) -> checkpointd.CheckpointManager:
    """``restore_latest()`` of a fresh manager returns ``expect`` bit-exact; with ``warns_about``, a
    RuntimeWarning naming that step is required. Returns the (open) manager; the caller closes it."""
    state = new_state(seed=99)
    mgr = checkpointd.CheckpointManager(str(run.root), state, compression=run.compression, **kwargs)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = mgr.restore_latest()
        assert got == expect, f"restore_latest() returned {got}, expected step {expect}"
        assert_values(state, run.values[expect], run.progress[expect])
        if warns_about is not None:
            texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert any(str(warns_about) in t for t in texts), f"no RuntimeWarning naming step {warns_about}: {texts}"
    except BaseException:
        mgr.close()
        raise
    mgr.state = state  # type: ignore[attr-defined]
    return mgr


# -- paths --------------------------------------------------------------------------------------------
def step_dir(root: Path, step: int) -> Path:
    return root / layout.step_dir_name(step)


def _manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / layout.MANIFEST_NAME).read_bytes())


def data_file(d: Path) -> str:
    """Relative path of the training-state file (optimizer, progress, RNG) of step directory ``d``."""
    return next(f["path"] for f in _manifest(d)["files"] if f["path"].startswith(layout.TRAINING_STATE_STEM + "."))


def model_file(d: Path) -> str:
    """Relative path of the model's file of step directory ``d``."""
    return next(f["path"] for f in _manifest(d)["files"] if f["path"].startswith("Linear."))


# -- forging ------------------------------------------------------------------------------------------
def write_marker(d: Path, manifest_bytes: bytes, step: int) -> None:
    """A ``COMMITTED`` marker that matches ``manifest_bytes`` and names ``step``."""
    marker = {"manifest": layout.MANIFEST_NAME, "manifest_checksum": sha256_hex(manifest_bytes), "step": step}
    (d / layout.COMMIT_MARKER_NAME).write_text(json.dumps(marker))


def sign_raw_manifest(d: Path, manifest_bytes: bytes, step: int | None = None) -> None:
    """Replace ``manifest.json`` by arbitrary bytes and write a marker that matches them."""
    step = layout.parse_step_dir_name(d.name) if step is None else step
    (d / layout.MANIFEST_NAME).write_bytes(manifest_bytes)
    write_marker(d, manifest_bytes, step)  # type: ignore[arg-type]


def resign(d: Path, *rels: str) -> None:
    """After editing data files ``rels`` of ``d`` (all listed files if none given), put their sizes
    and checksums into the manifest and rewrite the marker: the step passes every integrity check."""
    doc = _manifest(d)
    for f in doc["files"]:
        if not rels or f["path"] in rels:
            data = (d / f["path"]).read_bytes()
            f["size"], f["checksum"] = len(data), checksum_bytes(data)
    (d / layout.MANIFEST_NAME).write_bytes(json.dumps(doc).encode())
    recommit(d)


def edit_manifest(d: Path, change: Callable[[dict[str, Any]], Any], *, sign: bool = True) -> None:
    """Apply ``change`` to the manifest document; with ``sign``, the marker matches the result."""
    doc = _manifest(d)
    change(doc)
    data = json.dumps(doc).encode()
    (d / layout.MANIFEST_NAME).write_bytes(data)
    if sign:
        write_marker(d, data, layout.parse_step_dir_name(d.name))  # type: ignore[arg-type]


def forge_native(d: Path, rel: str, native: bytes, *, checksum: bool = True, raw_size: int | None = None) -> None:
    """Replace data file ``rel`` by ``native`` (encoded with the file's codec) and make the manifest
    (size, raw size and, with ``checksum``, the checksum) and the marker agree with it. Without
    ``checksum`` the checksum of the original bytes stays: the file has the listed size but fails its checksum."""
    entry = next(f for f in _manifest(d)["files"] if f["path"] == rel)
    stored = _encode(entry["codec"], native) if entry["codec"] not in ("none", "") else native
    (d / rel).write_bytes(stored)

    def change(doc: dict[str, Any]) -> None:
        for f in doc["files"]:
            if f["path"] == rel:
                f.update(size=len(stored), raw_size=len(native) if raw_size is None else raw_size)
                if checksum:
                    f["checksum"] = checksum_bytes(stored)

    edit_manifest(d, change)


def native_bytes(d: Path, rel: str) -> bytes:
    """The native (decoded) bytes of data file ``rel``."""
    from checkpointd.codecs.compress import decode_bytes

    entry = next(f for f in _manifest(d)["files"] if f["path"] == rel)
    data = (d / rel).read_bytes()
    return data if entry["codec"] in ("none", "") else bytes(decode_bytes(entry["codec"], data))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def zip_replace(native: bytes, member_suffix: str, new: bytes) -> bytes:
    """A copy of the zip ``native`` (a ``torch.save`` file) with the member ending in ``member_suffix``
    replaced by ``new``; every other member is kept as it is."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(native)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = new if info.filename.endswith(member_suffix) else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def zip_member(native: bytes, member_suffix: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(native)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith(member_suffix)))


def torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- hand-built pickle opcodes (pickletools' names) ------------------------------------------------------
def op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def op_int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)  # BININT


NONE, EMPTY_DICT, MARK, TUPLE, TUPLE1, TUPLE2, SETITEM, BUILD, REDUCE, POP = (
    b"N", b"}", b"(", b"t", b"\x85", b"\x86", b"s", b"b", b"R", b"0")


def build_pickle_prefix(target: tuple[str, str], attr: str, value_ops: bytes, *, slotstate: bool = True) -> bytes:
    """Opcodes that push the allowed global ``target`` and BUILD it with ``{attr: value}``, then POP it:
    prepended to a real ``data.pkl`` (after its PROTO), the file still yields the original object.

    With ``slotstate`` the state is ``(None, {attr: value})``, which a plain unpickler applies with
    ``setattr`` (so ``__defaults__``/``__code__`` would really change); else the dict alone (it would
    land in the function's ``__dict__``).
    """
    state = EMPTY_DICT + op_str(attr) + value_ops + SETITEM
    if slotstate:
        state = NONE + state + TUPLE2
    return op_global(*target) + state + BUILD + POP


def inject_into_pickle(original: bytes, prefix: bytes) -> bytes:
    """``original`` (protocol 2, starts with PROTO) with ``prefix`` run first."""
    assert original[:1] == b"\x80", "expected a protocol-2+ pickle"
    return original[:2] + prefix + original[2:]


# -- the command line, in-process ---------------------------------------------------------------------
def cli(*args: str) -> tuple[int, str]:
    """Run ``checkpointd ARGS``; returns the exit code and stdout+stderr."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli_main([str(a) for a in args])
    return code, out.getvalue()


# -- watching the process's own code ------------------------------------------------------------------
def function_fingerprint() -> dict[str, tuple[Any, ...]]:
    """``__defaults__``, ``__kwdefaults__``, ``__code__`` and ``__dict__`` of every function on torch's
    weights-only allow-list: a pickle that changes one of them has changed the process."""
    from torch._weights_only_unpickler import _get_allowed_globals

    out: dict[str, tuple[Any, ...]] = {}
    for name, obj in _get_allowed_globals().items():
        if hasattr(obj, "__code__"):
            out[name] = (obj.__defaults__, dict(obj.__kwdefaults__ or {}) if obj.__kwdefaults__ is not None else None,
                         obj.__code__, dict(obj.__dict__))
    return out


@contextlib.contextmanager
def process_guard() -> Iterator[Callable[[], None]]:
    """Yields ``check()`` asserting that no allowed function changed; afterwards puts them back, so a
    successful attack cannot leak into later tests."""
    from torch._weights_only_unpickler import _get_allowed_globals

    funcs = {n: o for n, o in _get_allowed_globals().items() if hasattr(o, "__code__")}
    saved = {n: (o.__defaults__, o.__kwdefaults__, o.__code__, dict(o.__dict__)) for n, o in funcs.items()}
    before = function_fingerprint()

    def check() -> None:
        after = function_fingerprint()
        changed = sorted(n for n in before if after.get(n) != before[n])
        assert not changed, f"loading a checkpoint changed functions of this process: {changed}"

    try:
        yield check
    finally:
        for n, o in funcs.items():
            defaults, kwdefaults, code, attrs = saved[n]
            o.__defaults__, o.__kwdefaults__, o.__code__ = defaults, kwdefaults, code
            o.__dict__.clear()
            o.__dict__.update(attrs)


def tree_state(top: Path, skip: str | None = None) -> dict[str, tuple[str, int, str]]:
    """``{relative path: (kind, size, sha256)}`` under ``top`` (links not followed), leaving out the
    subtree named ``skip``: compare two of them to see what a command wrote or deleted."""
    out: dict[str, tuple[str, int, str]] = {}
    for path in sorted(top.rglob("*")):
        rel = str(path.relative_to(top))
        if skip is not None and (rel == skip or rel.startswith(skip + "/")):
            continue
        if path.is_symlink():
            out[rel] = ("link", 0, str(path.readlink()))
        elif path.is_file():
            out[rel] = ("file", path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            out[rel] = ("dir" if path.is_dir() else "other", 0, "")
    return out


def copy_step(root: Path, src: int, dst_name: str) -> Path:
    out = root / dst_name
    shutil.copytree(step_dir(root, src), out)
    return out



