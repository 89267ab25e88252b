"""``checkpointd ls`` and ``checkpointd inspect``: what a root holds, and what one step or file holds.

``ls`` reads markers and manifests only (data is checked by ``verify``); ``inspect`` reads tensors'
shapes and dtypes from the pickles alone, through :class:`checkpointd.restore.checkpoint_file.CheckpointFile`,
without loading their data.
"""

from __future__ import annotations

import argparse
from typing import Any

from checkpointd import commit
from checkpointd.cleanup import scan_dir
from checkpointd.cli.exits import EXIT_OK, EXIT_USAGE, Usage
from checkpointd.cli.output import err, fmt_bytes, fmt_metrics, fmt_time, print_json, print_table
from checkpointd.cli.stores import has_valid_marker, is_step_dir, open_existing
from checkpointd.errors import CheckpointError, IncompleteCheckpointError
from checkpointd.format import layout
from checkpointd.format.manifest import Manifest
from checkpointd.restore.partial import codec_of, format_of, open_in_store
from checkpointd.storage.store import Store



# -- ls ------------------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    store = open_existing(args.root, args)
    if store.is_file(""):
        raise Usage(f"{store.display()} is a file, not a checkpoint root; show a checkpoint file with: "
                    f"checkpointd inspect {store.display()}")
    step_dirs = commit.list_step_dirs(store)
    marked = set(commit.marked_steps(store)) if step_dirs else set()
    rows = [ls_row(store, step, name, step in marked) for step, name in sorted(step_dirs.items())]
    committed = sum(r["committed"] for r in rows)
    if args.json:
        print_json({"root": store.display(), "steps": rows})
    elif rows:
        print_ls_table(store, rows)
    if not rows:
        raise Usage(f"no step directories under {store.display()}: it is not a checkpoint root")
    if not committed:
        err(f"error: no committed step under {store.display()} ({len(rows)} uncommitted or damaged step "
             f"director{'y' if len(rows) == 1 else 'ies'})")
        return EXIT_USAGE
    return EXIT_OK


def print_ls_table(store: Store, rows: list[dict[str, Any]]) -> None:
    table = [["STEP", "STATUS", "TIME", "SIZE", "FILES", "CODEC", "METRICS"]]
    for r in rows:
        table.append([str(r["step"]), r["status"].upper() if r["status"] == "damaged" else r["status"],
                      fmt_time(r["time"]), fmt_bytes(r["size_bytes"]), str(r["files"]), r["codec"] or "-",
                      fmt_metrics(r["metrics"])])
    print_table(table, right={0, 3, 4})
    for r in rows:
        if r["status"] == "damaged":
            print(f"step {r['step']} is DAMAGED: {r['error']}")
    committed = sum(r["committed"] for r in rows)
    damaged = sum(r["status"] == "damaged" for r in rows)
    print(f"{committed} committed, {damaged} damaged, {len(rows) - committed - damaged} uncommitted, under "
          f"{store.display()} (markers and manifests only; data is checked by checkpointd verify)")


def ls_row(store: Store, step: int, name: str, marked: bool) -> dict[str, Any]:
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
    store = open_existing(args.step_dir, args)
    if store.is_file(""):
        return inspect_file(store, args)
    if not is_step_dir(store):
        raise Usage(f"{store.display()} is not a step directory (no {layout.MANIFEST_NAME}); "
                    f"list the steps of a root with: checkpointd ls {store.display()}")
    committed = True
    try:
        manifest = commit.read_committed_manifest(store, "")
    except IncompleteCheckpointError:
        if has_valid_marker(store) or not store.exists(layout.MANIFEST_NAME):
            raise  # damaged: the marker names a manifest that is not there
        committed = False
        manifest = Manifest.from_json(store.read_bytes(layout.MANIFEST_NAME), where=store.display(layout.MANIFEST_NAME))
        err(f"warning: {store.display()} is NOT committed (no valid {layout.COMMIT_MARKER_NAME}); it is not a checkpoint")
    tensors: dict[str, list[dict[str, Any]]] = {}
    if not args.no_tensors:
        for f in manifest.files:
            with open_in_store(store, f.path, f.codec, f.format, store.display(f.path)) as cf:
                tensors[f.path] = [tensor_dict(t) for t in cf.tensors()]
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
        print_json(doc)
        return EXIT_OK
    print(f"step {manifest.step}  {'committed' if committed else 'NOT COMMITTED'}  {fmt_time(manifest.time)}  "
          f"mode {manifest.mode}  world size {manifest.world_size}  codec {manifest.codec}")
    print(f"path      {store.display()}")
    print(f"versions  checkpointd {manifest.library_version}, torch {manifest.torch_version}")
    print(f"metrics   {fmt_metrics(manifest.metrics)}")
    print("\nfiles")
    table = [["PATH", "SIZE", "NATIVE", "CODEC", "FORMAT", "RANK", "CHECKSUM"]]
    for f in manifest.files:
        table.append([f.path, fmt_bytes(f.size), fmt_bytes(f.raw_size), f.codec, f.format, str(f.rank), f.checksum])
    print_table(table, right={1, 2, 5}, indent="  ")
    print("\nentries")
    table = [["NAME", "KIND", "FILE", "KEY"]]
    for name, loc in manifest.entries.items():
        kind = f"{loc.kind} ({loc.class_name})" if loc.class_name else loc.kind
        table.append([name, kind, loc.file, loc.key if loc.key is not None else "(whole file)"])
    print_table(table, indent="  ")
    for rel, items in tensors.items():
        print_tensors(rel, items)
    return EXIT_OK


def inspect_file(store: Store, args: argparse.Namespace) -> int:
    name = store.root.rsplit("/", 1)[-1]
    with open_in_store(store, "", codec_of(name), format_of(name), store.display()) as cf:
        items = [] if args.no_tensors else [tensor_dict(t) for t in cf.tensors()]
    if args.json:
        print_json({"path": store.display(), "size_bytes": store.size(""), "tensors": items})
    else:
        print(f"file {store.display()}  {fmt_bytes(store.size(''))}")
        print_tensors(store.root.rsplit("/", 1)[-1], items)
    return EXIT_OK


def tensor_dict(t: Any) -> dict[str, Any]:
    return {"key": t.key, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "nbytes": t.nbytes}


def print_tensors(rel: str, items: list[dict[str, Any]]) -> None:
    total = sum(i["nbytes"] for i in items)
    print(f"\ntensors in {rel}: {len(items)}, {fmt_bytes(total)}")
    table = [["KEY", "DTYPE", "SHAPE", "SIZE"]]
    for i in items:
        table.append([i["key"], i["dtype"], str(tuple(i["shape"])), fmt_bytes(i["nbytes"])])
    if items:
        print_table(table, right={3}, indent="  ")


__all__ = ["cmd_inspect", "cmd_ls"]
