"""The command line's argument parser: the commands, their options and help, ending with the exit codes.

Each command's ``run`` default is the function that carries it out (``listing.py``: ls, inspect;
``maintenance.py``: verify, export, gc).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any

from checkpointd.cli.exits import EXIT_CODES, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from checkpointd.cli.listing import cmd_inspect, cmd_ls
from checkpointd.cli.maintenance import cmd_export, cmd_gc, cmd_verify
from checkpointd.cli.stores import DEFAULT_RETRY_TIMEOUT_SECS, PROGRESS_INTERVAL_SECS
from checkpointd.cleanup import DEFAULT_GRACE_SECS
from checkpointd.errors import ConfigError
from checkpointd.export import FORMATS
from checkpointd.version import VERSION

EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4}{text}" for code, text in EXIT_CODES.items()) + f"""

paths may be local or any fsspec URL (s3://bucket/run, gs://..., memory://...);
pass backend options with --storage-option KEY=VALUE (VALUE is JSON when it parses, else a string).
storage calls that fail with a transient error are retried for --retry-timeout seconds (default {DEFAULT_RETRY_TIMEOUT_SECS:g}),
with a line on stderr every {PROGRESS_INTERVAL_SECS:g} s at most; on s3:// each attempt is a single request
(botocore's own retries are off unless -o config_kwargs sets them).
"""
"""The end of every help text: the exit codes and how paths and retries work."""


def build_parser() -> argparse.ArgumentParser:
    """The ``checkpointd`` parser; each command sets ``run`` to its function."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is decoded as JSON when possible")
    common.add_argument("--retry-timeout", type=seconds, default=DEFAULT_RETRY_TIMEOUT_SECS, metavar="SECS",
                        help="retry storage calls that fail with transient errors (connection refused, timeouts, "
                             f"throttling) for this many seconds, then exit {EXIT_UNREACHABLE} "
                             f"(default {DEFAULT_RETRY_TIMEOUT_SECS:g})")
    common.add_argument("--import", action="append", default=[], dest="imports", metavar="MODULE",
                        help="import MODULE first (repeatable): a checkpoint holding its tensor subclasses (e.g. "
                             "torchao's quantized tensors and optimizer states) is then read; checkpointd never "
                             "imports what a checkpoint names")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    parser = argparse.ArgumentParser(
        prog="checkpointd", description="Inspect and maintain checkpointd checkpoints.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"checkpointd {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = subcommand(sub, "ls", parents=[common, as_json], help="list the step directories of a root",
                       description="List step directories: committed, uncommitted (leftover or in flight), damaged. "
                                   f"Exit {EXIT_OK} when at least one step is committed; {EXIT_USAGE} when none is "
                                   "(the listing is still printed), when ROOT holds no step directory, is a file "
                                   "or does not exist.")
    p.add_argument("root", metavar="ROOT")
    p.set_defaults(run=cmd_ls)

    p = subcommand(sub, "inspect", parents=[common, as_json], help="show one step's manifest and tensors",
                       description="Show a step's files, entries, tensors (shape/dtype, read from the pickles "
                                   "only), metrics and versions. Also accepts a single .pt/.mdlus[.zst] file. "
                                   f"An uncommitted step is shown with a warning (exit {EXIT_OK}); exit {EXIT_USAGE} "
                                   "when STEP_DIR is not a step directory or file.")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("--no-tensors", action="store_true", help="do not read the files' pickles")
    p.set_defaults(run=cmd_inspect)

    p = subcommand(sub, "verify", parents=[common, as_json], help="verify every committed step, or one step",
                       description="Check each committed step (or the one STEP_DIR): commit marker against the "
                                   "manifest checksum, each file's size and CRC-32. A step whose marker no longer "
                                   "matches its manifest is checked, and fails. "
                                   f"Exit {EXIT_OK} only if all verify; {EXIT_FAILED} naming each that fails; "
                                   f"{EXIT_USAGE} when there is no committed step.")
    p.add_argument("path", metavar="ROOT|STEP_DIR")
    p.add_argument("--deep", action="store_true",
                   help="also decode every file and parse its pickles safely (codec and record checksums, unsafe pickles)")
    p.set_defaults(run=cmd_verify)

    p = subcommand(sub, "export", parents=[common], help="write a step as native files, a DCP directory or safetensors",
                       description="Write a committed step into OUT_DIR, verifying every file's checksum first. "
                                   "--format native (default): every file decoded under its native name (.zst "
                                   "dropped), a plain PhysicsNeMo-style directory. --format dcp: a "
                                   "torch.distributed.checkpoint directory (.metadata, __0_0.distcp) keyed by the "
                                   "state names, as dcp.load({'model': model.state_dict(), ...}, checkpoint_id=OUT_DIR) "
                                   "reads it; sharded steps are assembled whole; OUT_DIR must be empty. "
                                   "--format safetensors: one <entry>.safetensors per nn.Module entry, for "
                                   "safetensors.torch.load_file. "
                                   f"Exit {EXIT_FAILED} when the step is uncommitted or damaged (nothing is left "
                                   f"half-exported), {EXIT_USAGE} when STEP_DIR is not a step directory or a file "
                                   "in OUT_DIR is in the way (see --overwrite).")
    p.add_argument("step_dir", metavar="STEP_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--format", choices=list(FORMATS), default="native", dest="export_format",
                   help="native (default), dcp or safetensors")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files that already exist in OUT_DIR (dcp: its DCP files are removed first)")
    p.add_argument("--dequantize", action="store_true",
                   help="dcp, safetensors: write tensor subclasses (quantized tensors) as plain dequantized "
                        "tensors, NOT bit-exact (a step holding them is refused without it)")
    p.set_defaults(run=cmd_export)

    p = subcommand(sub, "gc", parents=[common, as_json], help="remove uncommitted leftovers",
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


def subcommand(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose help ends with the exit codes, like the top-level help."""
    if "description" in kwargs:
        kwargs["description"] = textwrap.fill(kwargs["description"], 100)
    return sub.add_parser(name, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def seconds(text: str) -> float:
    """``--retry-timeout``: a finite number of seconds >= 0."""
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


__all__ = ["EPILOG", "build_parser", "parse_storage_options", "seconds", "subcommand"]
