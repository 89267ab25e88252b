"""``checkpointd verify``, ``export`` and ``gc``: check checkpoints, copy one out, clean up leftovers.

Each is a thin layer over a library module: ``verify`` over :mod:`checkpointd.restore.verify` (the same
checks a restore runs), ``export`` over :mod:`checkpointd.export` (``--format native|dcp|safetensors``),
``gc`` over :mod:`checkpointd.cleanup` (and the recycling bin of ``storage/recycle.py``).
"""

from __future__ import annotations

import argparse

from checkpointd.storage import recyclebin
from checkpointd import commit
from checkpointd.cleanup import collect_garbage, human_secs, parse_duration
from checkpointd.cli.exits import EXIT_FAILED, EXIT_OK, Usage
from checkpointd.cli.output import Progress, fmt_age, fmt_bytes, print_json
from checkpointd.cli.stores import is_step_dir, open_existing, open_store
from checkpointd.errors import CheckpointError
from checkpointd.export import export_step
from checkpointd.format import layout
from checkpointd.restore.verify import stored_bytes, verify_step


# -- verify -------------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    store = open_existing(args.path, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; verify takes a root or a step directory")
    if is_step_dir(store):
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
        print_json({"path": store.display(), "ok": not failed, "steps": [r.to_dict() for r in reports]})
    else:
        for r in reports:
            name = f"step {r.step}" if r.step is not None else "step ?"
            if r.ok:
                print(f"OK    {name:<16} {r.path}  ({r.files} files, {fmt_bytes(r.nbytes)})")
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
    store = open_existing(args.step_dir, args)
    if store.is_file("") or not is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"find one with: checkpointd ls {store.display()}")
    out = open_store(args.out_dir, args)
    if out.is_file(""):
        raise Usage(f"OUT_DIR {out.display()} is a file")
    total = stored_bytes(commit.read_committed_manifest(store, ""))
    with Progress(total, "export") as bar:
        files = export_step(store, "", out, format=args.export_format, overwrite=args.overwrite, on_bytes=bar.update,
                            dequantize=args.dequantize)
    for f in files:
        left_out = f"  (left out, not tensors: {', '.join(f.skipped)})" if f.skipped else ""
        print(f"{f.target}  {fmt_bytes(f.native_bytes)}{left_out}")
    print(f"exported {len(files)} file(s) to {out.display()} ({args.export_format})")
    return EXIT_OK


# -- gc -----------------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    grace = parse_duration(args.older_than)
    store = open_existing(args.root, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file; gc takes a checkpoint root")
    results = collect_garbage(store, older_than_secs=grace, dry_run=args.dry_run)
    failed = [r for r in results if r.action.startswith("failed")]
    # retired files kept for a next save (recycle.py): a crashed run leaves them; taking them from a
    # running job only makes its next save write new files
    binned = recyclebin.contents(store) if store.is_local else (0, 0)
    if store.is_local and not args.dry_run:
        recyclebin.empty(store)  # also a bin that is a link: removed as a link, never followed
    if args.json:
        print_json({"root": store.display(), "older_than_secs": grace, "dry_run": args.dry_run,
                     "dirs": [r.to_dict() for r in results],
                     "recycle_bin": {"files": binned[0], "bytes": binned[1]}})
    else:
        if binned[0]:
            print(f"{'would remove' if args.dry_run else 'removed'} {binned[0]} retired file(s), "
                  f"{binned[1] / 1e9:.2f} GB, from {recyclebin.BIN_NAME}")
        for r in results:
            age = "age ?" if r.age_secs is None else f"age {fmt_age(r.age_secs)}"
            print(f"{r.action:<28} step {r.step:<12} {age:<12} {r.path}")
        done = sum(r.action in ("removed", "would remove") for r in results)
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {done} uncommitted step director{'y' if done == 1 else 'ies'} older than {human_secs(grace)}; "
              f"{len(results) - done} kept")
    return EXIT_FAILED if failed else EXIT_OK


__all__ = ["cmd_export", "cmd_gc", "cmd_verify"]
