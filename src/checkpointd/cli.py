"""``checkpointd``: list, inspect, verify, export and clean up checkpoints from the shell (SPEC §1).

Each command is a thin layer over a library module: ``verify`` over :mod:`checkpointd.verify` (the
same checks restore runs), ``export`` over :mod:`checkpointd.export`, ``gc`` over
:mod:`checkpointd.cleanup`, and ``inspect`` reads tensors' shapes and dtypes from the pickles alone
through :mod:`checkpointd.partial`. Human output goes to stdout, messages and the progress bar to
stderr (the bar only when stderr is a terminal); ``--json`` prints one JSON document for scripts.
Exit codes are part of the interface; see ``EXIT_CODES`` and ``checkpointd --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__, commit, layout, recycle
from .cleanup import DEFAULT_GRACE_SECS, collect_garbage, human_secs, parse_duration, scan_dir
from .errors import CheckpointError, CheckpointNotFoundError, ConfigError, IncompleteCheckpointError
from .storage import Store

__all__ = ["EXIT_CODES", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_CODES = {
    EXIT_OK: "success (verify: every checked step verifies)",
    EXIT_FAILED: "a checkpoint failed verification or could not be read, exported or removed "
                 "(corrupt, uncommitted, unsafe pickle, newer format, storage error)",
    EXIT_USAGE: "usage error, or nothing found (no such path, no step directory, no committed step)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

_EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4}{text}" for code, text in EXIT_CODES.items()) + """

paths may be local or any fsspec URL (s3://bucket/run, gs://..., memory://...);
pass backend options with --storage-option KEY=VALUE (VALUE is JSON when it parses, else a string).
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
    try:
        args.storage_options = parse_storage_options(args.storage_option)
        return int(args.run(args))
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except (Usage, ConfigError, CheckpointNotFoundError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except CheckpointError as exc:
        _err(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except (FileNotFoundError, NotADirectoryError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except (OSError, ImportError, ValueError) as exc:  # storage down, backend not installed, bad URL
        _err(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is decoded as JSON when possible")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    parser = argparse.ArgumentParser(
        prog="checkpointd", description="Inspect and maintain checkpointd checkpoints.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"checkpointd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _subcommand(sub, "ls", parents=[common, as_json], help="list the step directories of a root",
                       description="List step directories: committed, uncommitted (leftover or in flight), damaged.")
    p.add_argument("root", metavar="ROOT")
    p.set_defaults(run=cmd_ls)

    p = _subcommand(sub, "inspect", parents=[common, as_json], help="show one step's manifest and tensors",
                       description="Show a step's files, entries, tensors (shape/dtype, read from the pickles "
                                   "only), metrics and versions. Also accepts a single .pt/.mdlus[.zst] file.")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("--no-tensors", action="store_true", help="do not read the files' pickles")
    p.set_defaults(run=cmd_inspect)

    p = _subcommand(sub, "verify", parents=[common, as_json], help="verify every committed step, or one step",
                       description="Check each committed step (or the one STEP_DIR): commit marker against the "
                                   "manifest checksum, each file's size and CRC-32. Exit 0 only if all verify.")
    p.add_argument("path", metavar="ROOT|STEP_DIR")
    p.add_argument("--deep", action="store_true",
                   help="also decode every file and parse its pickles safely (codec and record checksums, unsafe pickles)")
    p.set_defaults(run=cmd_verify)

    p = _subcommand(sub, "export", parents=[common], help="write a step as native uncompressed files",
                       description="Decode every file of a committed step into OUT_DIR under its native name "
                                   "(.zst dropped), verifying checksums: a plain PhysicsNeMo-style directory.")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace files that already exist in OUT_DIR")
    p.set_defaults(run=cmd_export)

    p = _subcommand(sub, "gc", parents=[common, as_json], help="remove uncommitted leftovers",
                       description="Remove uncommitted step directories whose newest file is older than the grace "
                                   "period. Committed steps are never touched.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--older-than", default=str(int(DEFAULT_GRACE_SECS)), metavar="AGE",
                   help="grace period: seconds, or 30m, 1h, 2d (default 1h)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.set_defaults(run=cmd_gc)
    return parser


def _subcommand(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose help ends with the exit codes, like the top-level help."""
    return sub.add_parser(name, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


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
    store = _open_existing(args.root, args.storage_options)
    rows = [_ls_row(store, step, name) for step, name in sorted(commit.list_step_dirs(store).items())]
    if args.json:
        _print_json({"root": store.display(), "steps": rows})
        return EXIT_OK
    if not rows:
        print(f"no step directories under {store.display()}")
        return EXIT_OK
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
    print(f"{committed} committed, {len(rows) - committed} uncommitted, under {store.display()} "
          "(markers and manifests only; data is checked by checkpointd verify)")
    return EXIT_OK


def _ls_row(store: Store, step: int, name: str) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "path": store.display(name), "committed": commit.is_committed(store, name),
                           "status": "", "time": None, "size_bytes": 0, "files": 0, "codec": None, "metrics": {},
                           "error": None}
    if row["committed"]:
        try:
            m = commit.read_committed_manifest(store, name)
            row.update(status="committed", time=m.time, size_bytes=sum(f.size for f in m.files),
                       files=len(m.files), codec=m.codec, metrics=m.metrics)
            return row
        except CheckpointError as exc:
            row.update(status="damaged", error=str(exc))
    scan = scan_dir(store, name)
    row.update(time=scan.newest_mtime, size_bytes=scan.nbytes, files=scan.files)
    if not row["committed"]:
        row["status"] = "uncommitted"
    return row


# -- inspect ------------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    store = _open_existing(args.step_dir, args.storage_options)
    if store.is_file(""):
        return _inspect_file(store, args)
    if not _is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"list the steps of a root with: checkpointd ls {store.display()}")
    committed = commit.is_committed(store, "")
    try:
        manifest = commit.read_committed_manifest(store, "")
    except IncompleteCheckpointError:
        if committed or not store.exists(layout.MANIFEST_NAME):
            raise
        from .manifest import Manifest

        manifest = Manifest.from_json(store.read_bytes(layout.MANIFEST_NAME), where=store.display(layout.MANIFEST_NAME))
        _err(f"warning: {store.display()} is NOT committed (no {layout.COMMIT_MARKER_NAME}); it is not a checkpoint")
    tensors: dict[str, list[dict[str, Any]]] = {}
    if not args.no_tensors:
        from .partial import _open_in_store

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
    from .partial import open_file

    with open_file(store.url, args.storage_options) as cf:
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
    from .verify import stored_bytes, verify_step

    store = _open_existing(args.path, args.storage_options)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; verify takes a root or a step directory")
    if _is_step_dir(store):
        targets = [""]
    else:
        targets = [layout.step_dir_name(s) for s in commit.committed_steps(store)]
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
    from .export import export_step
    from .verify import stored_bytes

    store = _open_existing(args.step_dir, args.storage_options)
    if store.is_file("") or not _is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"find one with: checkpointd ls {store.display()}")
    out = Store(args.out_dir, args.storage_options)
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
    store = _open_existing(args.root, args.storage_options)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; gc takes a checkpoint root")
    results = collect_garbage(store, older_than_secs=grace, dry_run=args.dry_run)
    failed = [r for r in results if r.action.startswith("failed")]
    # retired files kept for a next save (recycle.py): a crashed run leaves them; taking them from a
    # running job only makes its next save write new files
    binned = recycle.contents(store) if store.is_local else (0, 0)
    if binned[0] and not args.dry_run:
        recycle.empty(store)
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
def _open_existing(path: str, storage_options: dict[str, Any]) -> Store:
    store = Store(path, storage_options)
    if not store.is_file("") and not store.list_dir(""):
        raise Usage(f"nothing at {store.display()}: no such file or directory (or it is empty)")
    return store


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
    print(f"checkpointd: {message}", file=sys.stderr)


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
