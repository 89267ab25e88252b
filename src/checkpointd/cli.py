"""``checkpointd``: list, inspect, verify, export and clean up checkpoints from the shell (SPEC §1).

Each command is a thin layer over a library module: ``verify`` over :mod:`checkpointd.restore.verify` (the
same checks restore runs), ``export`` over :mod:`checkpointd.export`, ``gc`` over
:mod:`checkpointd.cleanup`, and ``inspect`` reads tensors' shapes and dtypes from the pickles alone
through :mod:`checkpointd.restore.partial`. Human output goes to stdout, messages and the progress bar to
stderr (the bar only when stderr is a terminal); ``--json`` prints one JSON document for scripts.
Exit codes are part of the interface; see ``EXIT_CODES`` and ``checkpointd --help``.

Storage calls are retried on transient errors for ``--retry-timeout`` seconds (the library's two
minutes by default); :class:`RetryReporter` says so on stderr while it happens, and a failure ends with
one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, TextIO

from checkpointd import commit
from checkpointd.version import VERSION
from checkpointd.format import layout
from checkpointd.storage import recycle
from checkpointd.cleanup import DEFAULT_GRACE_SECS, collect_garbage, human_secs, parse_duration, scan_dir
from checkpointd.errors import CheckpointError, CheckpointNotFoundError, ConfigError, IncompleteCheckpointError
from checkpointd.storage.retry import RetryEvent, RetryPolicy
from checkpointd.storage.store import Store

__all__ = ["EXIT_CODES", "RetryReporter", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141
EXIT_CODES = {
    EXIT_OK: "success (ls: at least one committed step; verify: every checked step verifies)",
    EXIT_FAILED: "a checkpoint failed verification or could not be read, exported or removed "
                 "(corrupt, uncommitted, unsafe pickle, newer format, storage error)",
    EXIT_USAGE: "usage error, or nothing to act on: no such path, a file where a directory is needed, "
                "no step directory, no committed step (ls, verify)",
    EXIT_UNREACHABLE: "storage unreachable: connection errors, timeouts or throttling outlasted --retry-timeout",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE_CLOSED: "the reader of the output went away (e.g. piped into head); nothing is printed",
}

DEFAULT_RETRY_TIMEOUT_SECS = RetryPolicy().max_elapsed_secs
"""``--retry-timeout`` default: the library's own budget (two minutes)."""
PROGRESS_INTERVAL_SECS = 5.0
"""At most one retry progress line per this many seconds (the first failure is reported at once)."""

_EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4}{text}" for code, text in EXIT_CODES.items()) + f"""

paths may be local or any fsspec URL (s3://bucket/run, gs://..., memory://...);
pass backend options with --storage-option KEY=VALUE (VALUE is JSON when it parses, else a string).
storage calls that fail with a transient error are retried for --retry-timeout seconds (default {DEFAULT_RETRY_TIMEOUT_SECS:g}),
with a line on stderr every {PROGRESS_INTERVAL_SECS:g} s at most; on s3:// each attempt is a single request
(botocore's own retries are off unless -o config_kwargs sets them).
"""


class Usage(Exception):
    """Nothing to act on (exit 2)."""


# -- entry point --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``python -m checkpointd`` exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.reporter = RetryReporter()
    try:
        with _library_warnings_on_stderr(), contextlib.redirect_stdout(_Output(sys.stdout)):
            args.storage_options = parse_storage_options(args.storage_option)
            return int(args.run(args))
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure ends with one line; a bug still shows its traceback
        code = _failure(exc, args.reporter)
        if code is None:
            raise
        return code


@contextlib.contextmanager
def _library_warnings_on_stderr() -> Any:
    """The library's warnings as ``checkpointd: warning: ...`` lines on stderr, but for its retry records:
    the :class:`RetryReporter` tells of those."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("checkpointd: warning: %(message)s"))
    handler.addFilter(lambda record: not hasattr(record, "retry_event"))
    lib_logger = logging.getLogger("checkpointd")
    lib_logger.addHandler(handler)
    try:
        yield
    finally:
        lib_logger.removeHandler(handler)


def _failure(exc: BaseException, reporter: RetryReporter) -> int | None:
    """Print the one error line for ``exc`` and return the exit code; None for an unexpected error."""
    if isinstance(exc, _OutputClosed):
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    gave_up = reporter.gave_up_on(exc)
    if gave_up is not None:
        url, event = gave_up
        tried = f"{event.attempt} attempts" if event.attempt > 1 else "1 attempt"
        _err(f"error: cannot reach {url} after {event.elapsed_secs:.1f} s of retries ({tried}): "
             f"{_one_line(event.error)}. Check the endpoint and credentials (or raise --retry-timeout).")
        return EXIT_UNREACHABLE
    if isinstance(exc, (Usage, ConfigError, CheckpointNotFoundError)):
        _err(f"error: {_one_line(exc, with_type=False, limit=None)}")
        return EXIT_USAGE
    if isinstance(exc, CheckpointError):
        _err(f"error: {_one_line(exc, limit=None)}")
        return EXIT_FAILED
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        _err(f"error: {_one_line(exc, with_type=False)}")
        return EXIT_USAGE
    backend = _raised_by_backend(exc)
    if isinstance(exc, TypeError) and backend:  # an option the backend does not take
        _err(f"error: {_one_line(exc)}; check the --storage-option values")
        return EXIT_USAGE
    if isinstance(exc, (OSError, ImportError, ValueError)) or backend:
        _err(f"error: {_one_line(exc)}")  # storage down, backend not installed, bad URL, no credentials
        return EXIT_FAILED
    return None


class _OutputClosed(Exception):
    """stdout's reader went away (``checkpointd ls | head -1``); a storage BrokenPipeError is not this."""


class _Output:
    """stdout, telling a closed reader (:class:`_OutputClosed`) from a storage connection's broken pipe."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError as exc:
            raise _OutputClosed() from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError as exc:
            raise _OutputClosed() from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Point stdout, whose reader went away, at /dev/null: the interpreter's final flush stays quiet."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _innermost_module(exc: BaseException) -> str:
    """The module whose code raised ``exc`` (the innermost Python frame of its traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""


_BACKEND_MODULES = frozenset({"botocore", "aiobotocore", "boto3", "aiohttp", "s3fs", "gcsfs", "google", "adlfs",
                              "azure", "fsspec", "urllib3", "requests"})


def _raised_by_backend(exc: BaseException) -> bool:
    """Whether a storage backend library raised ``exc`` (no credentials, access denied, an option it does
    not take), rather than checkpointd itself (a bug, whose traceback is wanted)."""
    return any(module.split(".", 1)[0] in _BACKEND_MODULES for module in (type(exc).__module__, _innermost_module(exc)))


def _one_line(exc: BaseException, with_type: bool = True, limit: int | None = 300) -> str:
    """``exc`` as one line (``limit``: at most that many characters of its message)."""
    text = " ".join(str(exc).split()) or repr(exc)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if with_type else text


class RetryReporter:
    """Shows storage retries on stderr while they happen, and remembers each call that gave up.

    Installed by the command line on every :class:`Store` it opens (``RetryPolicy.on_retry``); the
    library itself never prints. The first transient failure is reported at once, later ones at most
    every ``interval_secs``. Thread-safe.
    """

    def __init__(self, stream: TextIO | None = None, interval_secs: float = PROGRESS_INTERVAL_SECS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.interval_secs = interval_secs
        self.clock = clock
        self._last_line: float | None = None
        self._gave_up: list[tuple[str, RetryEvent]] = []
        self._lock = threading.Lock()

    def hook(self, url: str) -> Callable[[RetryEvent], None]:
        """The ``on_retry`` callback for the store at ``url`` (the name its messages use)."""
        return lambda event: self.report(url, event)

    def report(self, url: str, event: RetryEvent) -> None:
        with self._lock:
            if event.giving_up:
                self._gave_up.append((url, event))
                return
            now = self.clock()
            if self._last_line is not None and now - self._last_line < self.interval_secs:
                return
            self._last_line = now
        print(f"checkpointd: cannot reach {url}: {_one_line(event.error)}; retrying for another "
              f"{event.remaining_secs:.0f} s (attempt {event.attempt + 1})", file=self.stream or sys.stderr, flush=True)

    def gave_up_on(self, exc: BaseException) -> tuple[str, RetryEvent] | None:
        """``(url, event)`` of the retried call whose error ``exc`` is (or was raised from), if any."""
        chain: list[BaseException] = []
        cause: BaseException | None = exc
        while cause is not None and len(chain) < 20 and all(cause is not seen for seen in chain):
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        with self._lock:
            for url, event in reversed(self._gave_up):
                if any(event.error is e for e in chain):
                    return url, event
        return None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is decoded as JSON when possible")
    common.add_argument("--retry-timeout", type=_seconds, default=DEFAULT_RETRY_TIMEOUT_SECS, metavar="SECS",
                        help="retry storage calls that fail with transient errors (connection refused, timeouts, "
                             f"throttling) for this many seconds, then exit {EXIT_UNREACHABLE} "
                             f"(default {DEFAULT_RETRY_TIMEOUT_SECS:g})")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    parser = argparse.ArgumentParser(
        prog="checkpointd", description="Inspect and maintain checkpointd checkpoints.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"checkpointd {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _subcommand(sub, "ls", parents=[common, as_json], help="list the step directories of a root",
                       description="List step directories: committed, uncommitted (leftover or in flight), damaged. "
                                   f"Exit {EXIT_OK} when at least one step is committed; {EXIT_USAGE} when none is "
                                   "(the listing is still printed), when ROOT holds no step directory, is a file "
                                   "or does not exist.")
    p.add_argument("root", metavar="ROOT")
    p.set_defaults(run=cmd_ls)

    p = _subcommand(sub, "inspect", parents=[common, as_json], help="show one step's manifest and tensors",
                       description="Show a step's files, entries, tensors (shape/dtype, read from the pickles "
                                   "only), metrics and versions. Also accepts a single .pt/.mdlus[.zst] file. "
                                   f"An uncommitted step is shown with a warning (exit {EXIT_OK}); exit {EXIT_USAGE} "
                                   "when STEP_DIR is not a step directory or file.")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("--no-tensors", action="store_true", help="do not read the files' pickles")
    p.set_defaults(run=cmd_inspect)

    p = _subcommand(sub, "verify", parents=[common, as_json], help="verify every committed step, or one step",
                       description="Check each committed step (or the one STEP_DIR): commit marker against the "
                                   "manifest checksum, each file's size and CRC-32. A step whose marker no longer "
                                   "matches its manifest is checked, and fails. "
                                   f"Exit {EXIT_OK} only if all verify; {EXIT_FAILED} naming each that fails; "
                                   f"{EXIT_USAGE} when there is no committed step.")
    p.add_argument("path", metavar="ROOT|STEP_DIR")
    p.add_argument("--deep", action="store_true",
                   help="also decode every file and parse its pickles safely (codec and record checksums, unsafe pickles)")
    p.set_defaults(run=cmd_verify)

    p = _subcommand(sub, "export", parents=[common], help="write a step as native uncompressed files",
                       description="Decode every file of a committed step into OUT_DIR under its native name "
                                   "(.zst dropped), verifying checksums: a plain PhysicsNeMo-style directory. "
                                   f"Exit {EXIT_FAILED} when the step is uncommitted or damaged (nothing is left "
                                   f"half-exported), {EXIT_USAGE} when STEP_DIR is not a step directory or a file "
                                   "in OUT_DIR is in the way (see --overwrite).")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace files that already exist in OUT_DIR")
    p.set_defaults(run=cmd_export)

    p = _subcommand(sub, "gc", parents=[common, as_json], help="remove uncommitted leftovers",
                       description="Remove uncommitted step directories whose newest file is older than the grace "
                                   "period. Committed steps are never touched. Exit "
                                   f"{EXIT_OK} also when there is nothing to remove, {EXIT_FAILED} when a removal "
                                   f"failed, {EXIT_USAGE} when ROOT is a file or does not exist.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--older-than", default=str(int(DEFAULT_GRACE_SECS)), metavar="AGE",
                   help="grace period: seconds, or 30m, 1h, 2d (default 1h)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.set_defaults(run=cmd_gc)
    return parser


def _subcommand(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose help ends with the exit codes, like the top-level help."""
    if "description" in kwargs:
        kwargs["description"] = textwrap.fill(kwargs["description"], 100)
    return sub.add_parser(name, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``["anon=true", "endpoint_url=http://x"]`` -> ``{"anon": True, "endpoint_url": "http://x"}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


# -- ls -----------------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    store = _open_existing(args.root, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file, not a checkpoint root; show a checkpoint file with: "
                    f"checkpointd inspect {store.display()}")
    step_dirs = commit.list_step_dirs(store)
    marked = set(commit.marked_steps(store)) if step_dirs else set()
    rows = [_ls_row(store, step, name, step in marked) for step, name in sorted(step_dirs.items())]
    committed = sum(r["committed"] for r in rows)
    if args.json:
        _print_json({"root": store.display(), "steps": rows})
    elif rows:
        _print_ls_table(store, rows)
    if not rows:
        raise Usage(f"no step directories under {store.display()}: it is not a checkpoint root")
    if not committed:
        _err(f"error: no committed step under {store.display()} ({len(rows)} uncommitted or damaged step "
             f"director{'y' if len(rows) == 1 else 'ies'})")
        return EXIT_USAGE
    return EXIT_OK


def _print_ls_table(store: Store, rows: list[dict[str, Any]]) -> None:
    table = [["STEP", "STATUS", "TIME", "SIZE", "FILES", "CODEC", "METRICS"]]
    for r in rows:
        table.append([str(r["step"]), r["status"].upper() if r["status"] == "damaged" else r["status"],
                      _fmt_time(r["time"]), _fmt_bytes(r["size_bytes"]), str(r["files"]), r["codec"] or "-",
                      _fmt_metrics(r["metrics"])])
    _print_table(table, right={0, 3, 4})
    for r in rows:
        if r["status"] == "damaged":
            print(f"step {r['step']} is DAMAGED: {r['error']}")
    committed = sum(r["committed"] for r in rows)
    damaged = sum(r["status"] == "damaged" for r in rows)
    print(f"{committed} committed, {damaged} damaged, {len(rows) - committed - damaged} uncommitted, under "
          f"{store.display()} (markers and manifests only; data is checked by checkpointd verify)")


def _ls_row(store: Store, step: int, name: str, marked: bool) -> dict[str, Any]:
    """One step directory: committed (marker matches manifest), damaged (a valid marker whose manifest
    does not match or cannot be read) or uncommitted (no valid marker: a leftover or a save in flight)."""
    row: dict[str, Any] = {"step": step, "path": store.display(name), "committed": False, "status": "uncommitted",
                           "time": None, "size_bytes": 0, "files": 0, "codec": None, "metrics": {}, "error": None}
    if marked:
        try:
            m = commit.read_committed_manifest(store, name)
            row.update(committed=True, status="committed", time=m.time, size_bytes=sum(f.size for f in m.files),
                       files=len(m.files), codec=m.codec, metrics=m.metrics)
            return row
        except CheckpointError as exc:
            row.update(status="damaged", error=str(exc))
    scan = scan_dir(store, name)
    row.update(time=scan.newest_mtime, size_bytes=scan.nbytes, files=scan.files)
    return row


# -- inspect ------------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    store = _open_existing(args.step_dir, args)
    if store.is_file(""):
        return _inspect_file(store, args)
    if not _is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"list the steps of a root with: checkpointd ls {store.display()}")
    committed = True
    try:
        manifest = commit.read_committed_manifest(store, "")
    except IncompleteCheckpointError:
        if _has_valid_marker(store) or not store.exists(layout.MANIFEST_NAME):
            raise  # damaged: the marker names a manifest that is not there
        from checkpointd.format.manifest import Manifest

        committed = False
        manifest = Manifest.from_json(store.read_bytes(layout.MANIFEST_NAME), where=store.display(layout.MANIFEST_NAME))
        _err(f"warning: {store.display()} is NOT committed (no valid {layout.COMMIT_MARKER_NAME}); it is not a checkpoint")
    tensors: dict[str, list[dict[str, Any]]] = {}
    if not args.no_tensors:
        from checkpointd.restore.partial import _open_in_store

        for f in manifest.files:
            rel = f.path
            with _open_in_store(store, rel, f.codec, f.format, store.display(rel)) as cf:
                tensors[rel] = [_tensor_dict(t) for t in cf.tensors()]
    doc = {"path": store.display(), "committed": committed, "step": manifest.step, "time": manifest.time,
           "mode": manifest.mode, "world_size": manifest.world_size, "codec": manifest.codec,
           "library_version": manifest.library_version, "torch_version": manifest.torch_version,
           "metrics": manifest.metrics,
           "files": [vars(f) for f in manifest.files],
           "entries": {k: vars(v) for k, v in manifest.entries.items()},
           "extra": manifest.extra}
    if not args.no_tensors:
        doc["tensors"] = tensors
    if args.json:
        _print_json(doc)
        return EXIT_OK
    print(f"step {manifest.step}  {'committed' if committed else 'NOT COMMITTED'}  {_fmt_time(manifest.time)}  "
          f"mode {manifest.mode}  world size {manifest.world_size}  codec {manifest.codec}")
    print(f"path      {store.display()}")
    print(f"versions  checkpointd {manifest.library_version}, torch {manifest.torch_version}")
    print(f"metrics   {_fmt_metrics(manifest.metrics)}")
    print("\nfiles")
    table = [["PATH", "SIZE", "NATIVE", "CODEC", "FORMAT", "RANK", "CHECKSUM"]]
    for f in manifest.files:
        table.append([f.path, _fmt_bytes(f.size), _fmt_bytes(f.raw_size), f.codec, f.format, str(f.rank), f.checksum])
    _print_table(table, right={1, 2, 5}, indent="  ")
    print("\nentries")
    table = [["NAME", "KIND", "FILE", "KEY"]]
    for name, loc in manifest.entries.items():
        kind = f"{loc.kind} ({loc.class_name})" if loc.class_name else loc.kind
        table.append([name, kind, loc.file, loc.key if loc.key is not None else "(whole file)"])
    _print_table(table, indent="  ")
    for rel, items in tensors.items():
        _print_tensors(rel, items)
    return EXIT_OK


def _inspect_file(store: Store, args: argparse.Namespace) -> int:
    from checkpointd.restore.partial import _codec_of, _format_of, _open_in_store

    name = store.root.rsplit("/", 1)[-1]
    with _open_in_store(store, "", _codec_of(name), _format_of(name), store.display()) as cf:
        items = [] if args.no_tensors else [_tensor_dict(t) for t in cf.tensors()]
    if args.json:
        _print_json({"path": store.display(), "size_bytes": store.size(""), "tensors": items})
    else:
        print(f"file {store.display()}  {_fmt_bytes(store.size(''))}")
        _print_tensors(store.root.rsplit("/", 1)[-1], items)
    return EXIT_OK


def _tensor_dict(t: Any) -> dict[str, Any]:
    return {"key": t.key, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "nbytes": t.nbytes}


def _print_tensors(rel: str, items: list[dict[str, Any]]) -> None:
    total = sum(i["nbytes"] for i in items)
    print(f"\ntensors in {rel}: {len(items)}, {_fmt_bytes(total)}")
    table = [["KEY", "DTYPE", "SHAPE", "SIZE"]]
    for i in items:
        table.append([i["key"], i["dtype"], str(tuple(i["shape"])), _fmt_bytes(i["nbytes"])])
    if items:
        _print_table(table, right={3}, indent="  ")


# -- verify -------------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from checkpointd.restore.verify import stored_bytes, verify_step

    store = _open_existing(args.path, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; verify takes a root or a step directory")
    if _is_step_dir(store):
        targets = [""]
    else:  # a step whose marker no longer matches its manifest is checked too, and fails
        targets = [layout.step_dir_name(s) for s in commit.marked_steps(store)]
        if not targets:
            leftovers = len(commit.list_step_dirs(store))
            raise Usage(f"no committed step under {store.display()}"
                        + (f" ({leftovers} uncommitted step directories; see checkpointd ls)" if leftovers else ""))
    total = 0
    for t in targets:
        try:
            total += stored_bytes(commit.read_committed_manifest(store, t))
        except CheckpointError:
            pass
    reports = []
    with Progress(total, "verify") as bar:
        for t in targets:
            bar.label = f"verify {t or store.root.rsplit('/', 1)[-1]}"
            reports.append(verify_step(store, t, deep=args.deep, on_bytes=bar.update))
    failed = [r for r in reports if not r.ok]
    if args.json:
        _print_json({"path": store.display(), "ok": not failed, "steps": [r.to_dict() for r in reports]})
    else:
        for r in reports:
            name = f"step {r.step}" if r.step is not None else "step ?"
            if r.ok:
                print(f"OK    {name:<16} {r.path}  ({r.files} files, {_fmt_bytes(r.nbytes)})")
            else:
                print(f"FAIL  {name:<16} {r.path}")
                for e in r.errors:
                    print(f"      {e}")
            for w in r.warnings:
                print(f"      warning: {w}")
        if failed:
            names = ", ".join(str(r.step) if r.step is not None else r.path for r in failed)
            print(f"{len(failed)} of {len(reports)} step(s) FAILED verification: {names}")
        else:
            print(f"all {len(reports)} step(s) verify")
    return EXIT_FAILED if failed else EXIT_OK


# -- export -------------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    from checkpointd.export import export_step
    from checkpointd.restore.verify import stored_bytes

    store = _open_existing(args.step_dir, args)
    if store.is_file("") or not _is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"find one with: checkpointd ls {store.display()}")
    out = _store(args.out_dir, args)
    if out.is_file(""):
        raise Usage(f"OUT_DIR {out.display()} is a file")
    total = stored_bytes(commit.read_committed_manifest(store, ""))
    with Progress(total, "export") as bar:
        files = export_step(store, "", out, overwrite=args.overwrite, on_bytes=bar.update)
    for f in files:
        print(f"{f.target}  {_fmt_bytes(f.native_bytes)}")
    print(f"exported {len(files)} file(s) to {out.display()}")
    return EXIT_OK


# -- gc -----------------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    grace = parse_duration(args.older_than)
    store = _open_existing(args.root, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; gc takes a checkpoint root")
    results = collect_garbage(store, older_than_secs=grace, dry_run=args.dry_run)
    failed = [r for r in results if r.action.startswith("failed")]
    # retired files kept for a next save (recycle.py): a crashed run leaves them; taking them from a
    # running job only makes its next save write new files
    binned = recycle.contents(store) if store.is_local else (0, 0)
    if store.is_local and not args.dry_run:
        recycle.empty(store)  # also a bin that is a link: removed as a link, never followed
    if args.json:
        _print_json({"root": store.display(), "older_than_secs": grace, "dry_run": args.dry_run,
                     "dirs": [r.to_dict() for r in results],
                     "recycle_bin": {"files": binned[0], "bytes": binned[1]}})
    else:
        if binned[0]:
            print(f"{'would remove' if args.dry_run else 'removed'} {binned[0]} retired file(s), "
                  f"{binned[1] / 1e9:.2f} GB, from {recycle.BIN_NAME}")
        for r in results:
            age = "age ?" if r.age_secs is None else f"age {_fmt_age(r.age_secs)}"
            print(f"{r.action:<28} step {r.step:<12} {age:<12} {r.path}")
        done = sum(r.action in ("removed", "would remove") for r in results)
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {done} uncommitted step director{'y' if done == 1 else 'ies'} older than {human_secs(grace)}; "
              f"{len(results) - done} kept")
    return EXIT_FAILED if failed else EXIT_OK


# -- helpers ------------------------------------------------------------------------------------------
def _store(path: str, args: argparse.Namespace) -> Store:
    """A Store whose calls retry for ``--retry-timeout`` seconds, reporting on stderr as they do."""
    policy = RetryPolicy(max_elapsed_secs=args.retry_timeout, on_retry=args.reporter.hook(path))
    options = _backend_options(path, args.storage_options)
    try:
        return Store(path, options, retry=policy)
    except (TypeError, ValueError) as exc:  # the backend refuses an option or the URL
        raise ConfigError(f"cannot open {path} with storage options {sorted(options)}: {_one_line(exc)}") from exc


def _backend_options(path: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``path``'s backend. On s3:// one attempt per request (botocore retries a refused
    connection for seconds on its own, unseen): the Store's policy retries instead, with progress on
    stderr, for ``--retry-timeout`` seconds. An explicit ``config_kwargs`` "retries" wins."""
    if path.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = options.get("config_kwargs", {})
    if not isinstance(config, dict) or "retries" in config:
        return options
    return {**options, "config_kwargs": {**config, "retries": {"total_max_attempts": 1}}}


def _open_existing(path: str, args: argparse.Namespace) -> Store:
    store = _store(path, args)
    if not store.is_file("") and not store.list_dir(""):
        if store.exists(""):
            raise Usage(f"nothing at {store.display()}: the directory is empty")
        raise Usage(f"nothing at {store.display()}: no such file or directory")
    return store


def _has_valid_marker(store: Store) -> bool:
    """Whether the step directory ``store`` has a commit marker that is valid on its own (its manifest may
    still not match it: the step is then damaged, not uncommitted)."""
    try:
        commit.read_marker(store, "")
        return True
    except IncompleteCheckpointError:
        return False


def _is_step_dir(store: Store) -> bool:
    if layout.parse_step_dir_name(store.root) is not None:
        return True
    names = store.list_dir("")
    return layout.MANIFEST_NAME in names or layout.COMMIT_MARKER_NAME in names


class Progress:
    """A one-line text progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and total > 0
        self.total, self.label, self.done = total, label, 0
        self._last = 0.0

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.label[:40]:<40} [{bar:<30}] {frac:4.0%} "
                              f"{_fmt_bytes(self.done)}/{_fmt_bytes(self.total)}\x1b[K")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._last:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _print_table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "") -> None:  # type: ignore[assignment]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print(indent + "  ".join(cells).rstrip())


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1, default=str))


def _err(message: str) -> None:
    print(f"checkpointd: {message}", file=sys.stderr, flush=True)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_age(secs: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f}{unit}"
    return f"{secs:.0f}s"


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    if not metrics:
        return "-"
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
