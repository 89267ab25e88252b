"""What the manager does differently under torch.distributed: one object, consulted at a few hook points.

The manager builds a :class:`DistributedRuntime` when ``torch.distributed`` is initialized. It then:

- asks :meth:`is_due` (rank 0 decides time-based saves, so every rank saves the same steps);
- builds this rank's files with :meth:`build_files` instead of ``state.build_files``:
  full mode gathers on every rank (collective, training thread) and rank 0 gets the PhysicsNeMo files
  of SPEC §3, the other ranks one small RNG file each (``rng/rank-0000r.pt``); sharded mode gives every
  rank one file with its own blocks (layout in ``assemble.py``). When any rank cannot (bad state),
  every rank raises from that same call and the ranks stay in step (:meth:`DistributedRuntime.build_files`);
- writes through :class:`~checkpointd.distributed.coordination.DistributedWriter` (rank 0 commits after
  every rank reported success; :meth:`merge_manifest` lists every rank's files);
- restores with :meth:`restore_step`: every rank reads and verifies the files it needs (full mode: rank 0's
  files and its own RNG file; sharded mode: rank 0's file, its own for RNG, and only the rank files whose
  blocks overlap its regions), the ranks agree that all read and verified (damage found by one rank makes
  every rank skip the step, any other error stops every rank), then that the values fit every rank's
  live objects (a rank that refuses them stops every rank), then each rank copies its part into the
  live objects in place; ``restore_loaded`` (``restore_from``) has every rank load the full values and
  apply its part the same way. Partial and non-strict restores: a ``Selection`` (see ``manager_restore.py``).

RNG under a changed world size: per-rank RNG streams cannot be mapped onto a different number of ranks,
so when the checkpoint's world size differs from the current one the RNG state is left as it is (a
RuntimeWarning says so on rank 0); reseed per rank (e.g. ``seed + rank``) if the run needs it. With the
same world size, rank r gets back exactly rank r's Python, NumPy, torch CPU and CUDA RNG state.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch

from checkpointd.restore import per_entry
from checkpointd import commit
from checkpointd.restore import step as restore_mod
from checkpointd.errors import NOT_VERIFIED, CheckpointError, CorruptCheckpointError, StateMismatchError
from checkpointd.format.manifest import EntryLocation, FileEntry, Manifest
from checkpointd.restore.per_entry import Selection
from checkpointd.rng import restore_rng
from checkpointd.state import EPOCH_KEY, RNG_KEY, Entry, FileContent, build_files, entry_state, validate_tree
from checkpointd.storage.store import Store
from checkpointd.save.job import SaveJob
from checkpointd.restore.assemble import shard_file_name, sharded_values
from checkpointd.restore.sharded_subclasses import plan_copy_into
from checkpointd.distributed.coordination import Coordinator, DistributedWriter, PeerStateError, RankFailedError
from checkpointd.format.sharding import ShardedLeaf, materialize, merge_records, split_tree, walk
from checkpointd.format.subclasses import check_described, check_sharded_described
from checkpointd.distributed.state_dicts import (as_state_error, check_optimizer, entry_tree, gather_tree, is_fsdp1,
                          live_module_state, load_module, load_optimizer, module_state, optimizer_state, owner_module,
                          plan_module, plan_optimizer, state_failure)
from checkpointd.distributed.statecache import LocalStates

logger = logging.getLogger("checkpointd")

RNG_DIR = "rng"
LAYOUT_VERSION = 1


def rng_file_name(rank: int, codec_suffix: str = "") -> str:
    return f"{RNG_DIR}/rank-{rank:05d}.pt{codec_suffix}"


class DistributedRuntime:
    """Per-manager distributed state: the coordinator, the mode and the optimizer -> module map."""

    def __init__(self, entries: list[Entry], mode: str, timeout_secs: float = 600.0) -> None:
        self.coord = Coordinator(timeout_secs)
        self.rank = self.coord.rank
        self.world_size = self.coord.world_size
        self.mode = mode
        self.entries = entries
        modules = [e.obj for e in entries if e.kind == "module"]
        self.owner = {e.name: owner_module(e.obj, modules) for e in entries if e.kind == "optimizer"}
        self.local_states = LocalStates(entries, self.owner)  # sharded saves: state dicts without the full walk
        self._split_cache: dict[str, dict[Any, Any]] = {e.name: {} for e in entries}  # DTensor records by path
        self.writer: DistributedWriter | None = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def make_writer(self, store: Store, codec: Any, file_threads: int, **hooks: Any) -> DistributedWriter:
        """This rank's committer: a :class:`DistributedWriter` with the writer ``hooks`` (see ``BackgroundWriter``)."""
        self.writer = DistributedWriter(store, codec, self.coord, file_threads, self.merge_manifest, **hooks)
        return self.writer

    def abandon(self, step: int, error: BaseException) -> Future:
        """This rank's ``maybe_save(step)`` failed after :meth:`build_files` returned (staging): fail the save
        of ``step`` on every rank now (see :meth:`DistributedWriter.abandon`); returns this rank's job future."""
        assert self.writer is not None, "make_writer() comes first"
        return self.writer.abandon(step, error)

    def close(self) -> None:
        self.coord.close()

    # -- saving (training thread) ----------------------------------------------------------------
    def is_due(self, due_here: bool, time_based: bool) -> bool:
        """Rank 0's decision when it depends on the clock; the step-based rules agree by themselves."""
        return bool(self.coord.agree(due_here)) if time_based else due_here

    def agree(self, value: Any) -> Any:
        return self.coord.agree(value)

    def _state_of(self, e: Entry, full: bool) -> Any:
        if not full and e.kind in ("module", "optimizer"):
            return self.local_states.state(e.name, lambda: self._full_call(e, full))
        return self._full_call(e, full)

    def _full_call(self, e: Entry, full: bool) -> Any:
        if e.kind == "module":
            return module_state(e.obj, full)
        if e.kind == "optimizer":
            return optimizer_state(e.obj, self.owner[e.name], full)
        tree = entry_state(e)
        return gather_tree(tree) if full else tree

    def build_files(self, step: int, metrics: dict[str, Any], rng: dict[str, Any], codec_suffix: str,
                    mdlus_members: Callable[[Any], dict[str, bytes]] | None) -> tuple[list[FileContent], dict[str, EntryLocation] | None, dict[str, Any]]:
        """This rank's files, the manifest's entry map (None: derive it from the files) and ``extra``.

        Collective on every rank, in registration order. When any rank cannot build its files (bad state,
        a ``state_dict()`` that raises), every rank raises in this same call and nothing is written: that
        rank its own error (a StateError naming the entry and key), the others a
        :class:`~checkpointd.distributed.coordination.PeerStateError` (a StateError) or
        :class:`~checkpointd.distributed.coordination.RankFailedError` naming the rank and its error.
        The ranks stay in step: the next save proceeds as usual.

        How (one all-reduce of three integers on the manager's ``control`` group per check, see
        :meth:`Coordinator.settle`): sharded mode builds locally and checks once. Full mode first takes
        the state of every entry that is not a module or optimizer (user code: ``state_dict()`` of
        schedulers and other objects, plain data) and validates it, checks, and only then gathers
        (collectives on the training process group), builds the files and checks again. Why the first
        check: a rank that raised before a gather would leave the others inside that collective, which
        then pairs with whatever collective that rank issues next (the next forward's FSDP all-gather:
        gloo aborts the process, NCCL may hang or mix up data). A module or optimizer whose state dict
        raises inside PyTorch's gather on one rank only is not covered: the others fail at the training
        group's timeout.
        """
        if self.mode == "full":
            return self._build_full(step, metrics, rng, codec_suffix, mdlus_members)
        built: Any = None
        error: BaseException | None = None
        try:
            built = self._build_sharded(step, rng, codec_suffix)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone goes on
            error = state_failure(exc, step)
        self._settle(step, error)
        return built

    def _build_full(self, step: int, metrics: dict[str, Any], rng: dict[str, Any], codec_suffix: str,
                    mdlus_members: Callable[[Any], dict[str, bytes]] | None) -> tuple[list[FileContent], None, dict[str, Any]]:
        base = {"distributed": {"world_size": self.world_size, "backend": str(torch.distributed.get_backend())}}
        own = [e for e in self.entries if e.kind not in ("module", "optimizer")]
        local: dict[str, Any] = {}
        error: BaseException | None = None
        try:
            for e in own:  # local: no rank enters a gather before every rank has these
                local[e.name] = entry_tree(e)
                validate_tree(local[e.name], f"state[{e.name!r}]")
        except Exception as exc:  # noqa: BLE001
            error = state_failure(exc, step)
        if own:
            self._settle(step, error)
        built: Any = None
        try:
            trees = {e.name: as_state_error(e, "gathering its state", lambda e=e: self._gathered(e, local))
                     for e in self.entries}
            rng_files = {str(r): rng_file_name(r, codec_suffix) for r in range(1, self.world_size)}
            if self.is_rank0:
                files = build_files(self.entries, step, metrics, rng, codec_suffix, mdlus_members=mdlus_members,
                                    state_of=lambda e: trees[e.name])
                built = files, None, {**base, "rng_file": files[-1].rel_path, "rng_files": rng_files}
            else:  # rank 0's trees are the ones written; the others' must be as valid (the same state)
                for e in self.entries:
                    if e.kind in ("module", "optimizer"):
                        validate_tree(trees[e.name], f"state[{e.name!r}]", module_keys=e.kind == "module")
                tree = {RNG_KEY: rng, EPOCH_KEY: step}
                rng_file = FileContent(rel_path=rng_file_name(self.rank, codec_suffix), format="pt", tree=tree, rank=self.rank)
                built = [rng_file], None, base
        except Exception as exc:  # noqa: BLE001
            error = state_failure(exc, step)
        self._settle(step, error)
        return built

    def _gathered(self, e: Entry, local: dict[str, Any]) -> Any:
        """An entry's full state (collective): PyTorch's gather for modules and optimizers, else ``local``'s DTensors gathered."""
        if e.kind in ("module", "optimizer"):
            return self._full_call(e, True)
        return gather_tree(local[e.name])

    def _settle(self, step: int, error: BaseException | None) -> None:
        """Raise on every rank alike when any rank failed (``error``) or the ranks are at different steps."""
        failures = self.coord.settle(step, error)
        if not failures:
            return
        if len({s for _, s, _ in failures}) > 1:
            steps = ", ".join(f"rank {r}: step {s}" for r, s, _ in failures)
            raise RankFailedError(
                f"the ranks called maybe_save with different steps ({steps}); nothing was saved. Every rank must call "
                "maybe_save with the same steps (an exception one rank caught and the others did not, e.g. from an "
                "earlier maybe_save, puts them out of step)") from error
        if error is not None:
            raise error
        bad = [(r, e) for r, _, e in failures if e is not None]
        cls = PeerStateError if all(is_state for _, (is_state, _) in bad) else RankFailedError
        ranks = ", ".join(str(r) for r, _ in bad)
        raise cls(f"step {step} was not saved on any rank: rank(s) {ranks} cannot save their state: "
                  + "; ".join(f"rank {r}: {text}" for r, (_, text) in bad[:4])
                  + f". Nothing of step {step} was written; fix the state on rank(s) {ranks} (their own maybe_save "
                  "raised the error in detail) and save a later step")

    def _build_sharded(self, step: int, rng: dict[str, Any],
                       codec_suffix: str) -> tuple[list[FileContent], dict[str, EntryLocation], dict[str, Any]]:
        """This rank's shard file (local: no communication)."""
        base = {"distributed": {"world_size": self.world_size, "backend": str(torch.distributed.get_backend())}}
        skeletons: dict[str, Any] = {}
        blocks: dict[str, Any] = {}
        records: dict[str, Any] = {}
        self.local_states.begin()
        for e in self.entries:
            tree = as_state_error(e, "taking its state dict", lambda e=e: self._state_of(e, False))
            validate_tree(tree, f"state[{e.name!r}]", module_keys=e.kind == "module")
            split_cache = self._split_cache[e.name] if self.local_states.enabled else None
            skeletons[e.name], blocks[e.name], records[e.name] = split_tree(tree, self.rank, split_cache)
        content: dict[str, Any] = {"blocks": blocks, RNG_KEY: rng, EPOCH_KEY: step}
        if self.is_rank0:
            content["entries"] = skeletons
        own = shard_file_name(self.rank, codec_suffix)
        root_file = shard_file_name(0, codec_suffix)
        files = [FileContent(rel_path=own, format="pt", tree=content,
                             entry_names=[e.name for e in self.entries] if self.is_rank0 else [], rank=self.rank)]
        locations = {e.name: EntryLocation(kind=e.kind, file=root_file, key=e.name, class_name=e.class_name) for e in self.entries}
        extra = {**base, "rng_file": root_file,
                 "sharded": {"layout_version": LAYOUT_VERSION,
                             "rank_files": {str(r): shard_file_name(r, codec_suffix) for r in range(self.world_size)}},
                 "_rank_local": records}
        return files, locations, extra

    def staging_files(self, rng: dict[str, Any], codec_suffix: str) -> list[FileContent] | None:
        """This rank's files as a save now would build them, for preparing staging buffers ahead; None when
        that would need a collective or change state.

        Sharded mode builds them locally (no communication), which also warms the state caches. Not
        possible: full mode and FSDP1 modules (gathered: collective), and an optimizer with a registered
        module but no state yet (``get_optimizer_state_dict`` would initialise it with a zero-lr step).
        """
        if self.mode != "sharded":
            return None
        for e in self.entries:
            model = e.obj if e.kind == "module" else self.owner.get(e.name) if e.kind == "optimizer" else None
            if model is not None and is_fsdp1(model):
                return None
            if e.kind == "optimizer" and model is not None and not e.obj.state:
                return None
        try:
            files, _, _ = self._build_sharded(0, rng, codec_suffix)
        except Exception as exc:  # noqa: BLE001 - the save itself reports bad state
            logger.debug("checkpointd: no staging buffers prepared ahead (%s: %s)", type(exc).__name__, exc)
            return None
        return files

    # -- committing (committer thread, rank 0) ---------------------------------------------------
    def merge_manifest(self, job: SaveJob, reports: list[dict[str, Any]]) -> Manifest:
        m = job.manifest
        extra = {k: v for k, v in m.extra.items() if k != "_rank_local"}
        if "sharded" in extra:
            extra["sharded"] = {**extra["sharded"], "tensors": merge_records([r["extra"] or {} for r in reports])}
        files = [FileEntry(**f) for r in reports for f in r["files"]]
        return Manifest(step=m.step, time=m.time, world_size=self.world_size, mode=m.mode, codec=m.codec,
                        library_version=m.library_version, torch_version=m.torch_version, files=files,
                        entries=m.entries, metrics=m.metrics, extra=extra)

    # -- restoring (training thread, every rank) -------------------------------------------------
    def restore_step(self, store: Store, step_dir: str, selection: Selection | None = None) -> None:
        """Read and verify on every rank, agree, then load each rank's part of the chosen entries in place.

        ``selection`` (default: every entry, strict): see :mod:`checkpointd.manager_restore`.

        Raises (on every rank alike, so that every rank goes on to the same older step or stops):
            CorruptCheckpointError: a rank could not read or verify the step (damaged, malformed or unsafe
                content: :data:`~checkpointd.errors.NOT_VERIFIED`).
            CheckpointError: anything else failed on a rank (the failing rank raises its own error).
        """
        sel = selection or per_entry.select_entries(self.entries)
        error: BaseException | None = None
        values: dict[str, Any] = {}
        rng: Any = None
        manifest: Manifest | None = None
        try:
            manifest = commit.read_committed_manifest(store, step_dir)
            check_described(manifest.extra.get("subclasses"), f"step {manifest.step}")  # before any pickle runs
            check_sharded_described(manifest.extra.get("sharded"), f"step {manifest.step}")
            values, rng = self._read(store, step_dir, manifest, sel)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone goes on
            error = exc
        problems = [p for p in self.coord.gather_control(
            None if error is None else (isinstance(error, NOT_VERIFIED), f"rank {self.rank}: {type(error).__name__}: {error}")) if p]
        if problems:
            listed = "; ".join(msg for _, msg in problems[:4])
            if all(unverified for unverified, _ in problems):  # only damage: every rank skips the step alike
                raise CorruptCheckpointError(f"{store.display(step_dir)} does not verify on every rank: {listed}") from error
            if error is not None and not isinstance(error, NOT_VERIFIED):
                raise error
            raise CheckpointError(f"{store.display(step_dir)} could not be read on every rank: {listed}") from error
        assert manifest is not None
        self._load(values, f"step {manifest.step}", sel, manifest.entries)
        if not sel.restores_rng:
            return
        if manifest.world_size != self.world_size:
            if self.is_rank0:
                warnings.warn(
                    f"checkpointd: step {manifest.step} was saved by {manifest.world_size} ranks and is restored on "
                    f"{self.world_size}; RNG state was not restored (reseed per rank if the run needs it)",
                    RuntimeWarning, stacklevel=3)
        elif isinstance(rng, dict):
            restore_rng(rng)

    def restore_loaded(self, read: Callable[[], tuple[dict[str, Any], list[str]]], source: str, selection: Selection) -> None:
        """``restore_from``: every rank runs ``read`` (``checkpointd.load``: full values), the ranks agree that
        all could, then each loads its part of the chosen entries in place (a DTensor its local block)."""
        values: dict[str, Any] = {}
        available: list[str] = []
        error: BaseException | None = None
        try:
            values, available = read()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone goes on
            error = exc
        self._all_or_none(error, f"{source} could not be loaded on every rank: ")
        self._load(values, source, selection, available)

    def _load(self, values: dict[str, Any], source: str, selection: Selection, available: Any) -> None:
        """Check the chosen entries against ``values``, agree that they fit on every rank (nothing is applied
        on any rank when one does not), apply, warn (rank 0)."""
        fitted: per_entry.Fitted | None = None
        error: BaseException | None = None
        try:
            fitted = self._fit(values, source, selection, available)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone applies
            error = exc
        self._all_or_none(error, f"{source} does not fit the live state on every rank, so no rank restored it: ")
        assert fitted is not None
        for e in fitted.entries:
            self._apply(e, fitted.values[e.name], f"state[{e.name!r}]")
        if fitted.left and self.is_rank0:
            warnings.warn("checkpointd: " + "; ".join(fitted.left), RuntimeWarning, stacklevel=4)

    def _all_or_none(self, error: BaseException | None, failed: str) -> None:
        """Every rank learns whether any failed: the failing ranks raise their own error, the others ``failed``
        and theirs (a StateMismatchError if one was)."""
        problems = [p for p in self.coord.gather_control(None if error is None else (type(error).__name__, f"rank {self.rank}: {error}")) if p]
        if error is not None:
            raise error
        if problems:
            kind = StateMismatchError if any(name == StateMismatchError.__name__ for name, _ in problems) else CheckpointError
            raise kind(failed + "; ".join(msg for _, msg in problems[:4]))

    def _read(self, store: Store, step_dir: str, manifest: Manifest, sel: Selection) -> tuple[dict[str, Any], Any]:
        if manifest.mode == "sharded":
            return self._read_sharded(store, step_dir, manifest, sel)
        view = restore_mod.files_for(manifest, sel)
        wanted = {f.path for f in view.files if f.rank == 0}
        own_rng = (manifest.extra.get("rng_files") or {}).get(str(self.rank)) if sel.restores_rng else None
        if own_rng:
            wanted.add(own_rng)
        files = [f for f in manifest.files if f.path in wanted]
        view = Manifest(**{**manifest.__dict__, "files": files})
        contents = restore_mod.read_step(store, step_dir, view, rank=None)
        values = restore_mod.values_by_entry(manifest, contents, None if sel.read_all else [e.name for e in sel.entries])
        rng_content = contents.get(own_rng) if own_rng else None
        rng = rng_content.get(RNG_KEY) if isinstance(rng_content, dict) else restore_mod.rng_of(manifest, contents)
        if self.rank != 0 and not own_rng:
            rng = None
        return values, rng

    @staticmethod
    def _read_files(store: Store, step_dir: str, manifest: Manifest, paths: set[str]) -> dict[str, Any]:
        """Read and verify (checksums against the manifest) the listed files of the step."""
        files = [f for f in manifest.files if f.path in paths]
        if not files:
            return {}
        return restore_mod.read_step(store, step_dir, Manifest(**{**manifest.__dict__, "files": files}), rank=None)

    def _read_sharded(self, store: Store, step_dir: str, manifest: Manifest, sel: Selection) -> tuple[dict[str, Any], Any]:
        """This rank's part of a sharded step: rank 0's file, its own (for RNG), and the files holding its blocks.

        1. rank 0's file (the entries skeleton, plain tensors) and, when RNG is restored (same world size,
           every entry chosen), this rank's own file; also any data file that is not a rank's shard file;
        2. the plan (:meth:`_plan_reads`): the blocks of the chosen entries that overlap the regions the load will ask for,
           from the manifest's block records and the live objects' placements;
        3. the rank files holding those blocks, each verified; a needed block missing from its file is
           CorruptCheckpointError here, before the ranks agree, so nothing is applied.
        When no plan can be made, every rank file is read.
        """
        info = manifest.extra.get("sharded")
        if not isinstance(info, dict) or not isinstance(info.get("rank_files"), dict):
            raise CorruptCheckpointError(f"step {manifest.step}: sharded manifest without extra['sharded'] layout")
        rank_files = {int(r): p for r, p in info["rank_files"].items()}
        shard_paths = set(rank_files.values())
        own = rank_files.get(self.rank) if manifest.world_size == self.world_size and sel.restores_rng else None
        first = {f.path for f in manifest.files if f.path not in shard_paths} | {rank_files.get(0, ""), own or ""}
        contents = self._read_files(store, step_dir, manifest, first)
        values = sharded_values(manifest, contents)  # its leaves read `contents` lazily: later reads land there too
        if not sel.read_all:
            values = {e.name: values[e.name] for e in sel.entries if e.name in values}
        plan = self._plan_reads(values, list(sel.entries))
        needed_ranks = set(rank_files) if plan is None else plan[0]
        listed = {f.path for f in manifest.files}
        for r in sorted(needed_ranks):
            if rank_files.get(r) not in listed:
                raise CorruptCheckpointError(f"step {manifest.step}: the shard file of rank {r} is not listed in the manifest")
        contents.update(self._read_files(store, step_dir, manifest, {rank_files[r] for r in needed_ranks} - set(contents)))
        if plan is not None:
            for name, key, r in sorted(plan[1]):
                content = contents.get(rank_files[r])
                blocks = content.get("blocks", {}) if isinstance(content, dict) else {}
                if key not in (blocks.get(name) or {}):
                    raise CorruptCheckpointError(f"step {manifest.step}: entry {name!r} tensor {key}: rank {r}'s file lacks its block")
        logger.debug("rank %d restores step %d from the shard files of ranks %s", self.rank, manifest.step, sorted(needed_ranks | {0}))
        rng = contents.get(own, {}).get(RNG_KEY) if own and isinstance(contents.get(own), dict) else None
        return values, rng

    def _plan_reads(self, values: dict[str, Any], entries: list[Entry]) -> tuple[set[int], set[tuple[str, str, int]]] | None:
        """(ranks whose files hold blocks this rank's load will copy, {(entry, tensor key, rank)}); None: read all.

        Mirrors :meth:`_apply` without touching anything: a leaf copied into a live DTensor needs the blocks
        overlapping that DTensor's local region; every other sharded leaf (plain live tensors, materialized
        values, FSDP1) needs all its blocks.
        """
        regions: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

        def want(leaf: ShardedLeaf, live: Any) -> None:
            regions.setdefault(id(leaf), []).append(leaf.target_region(live))

        try:
            for e in entries:
                v = values.get(e.name)
                if e.kind == "module" and isinstance(v, dict):
                    plan_module(e.obj, v, want)
                elif e.kind == "optimizer" and isinstance(v, dict):
                    plan_optimizer(e.obj, self.owner[e.name], v, want)
                elif e.kind == "tensor" and isinstance(v, ShardedLeaf):
                    want(v, e.obj)
        except Exception as exc:  # noqa: BLE001 - the load will report it; read everything meanwhile
            logger.debug("no read plan (%s: %s); reading every shard file", type(exc).__name__, exc)
            return None
        ranks: set[int] = set()
        needed: set[tuple[str, str, int]] = set()
        for e in entries:
            for _path, leaf in walk(values.get(e.name)):
                if not isinstance(leaf, ShardedLeaf):
                    continue
                wanted = regions.get(id(leaf)) or [(tuple(0 for _ in leaf.shape), leaf.shape)]
                for offsets, shape in wanted:
                    for block in leaf.blocks_for(offsets, shape):  # CorruptCheckpointError if not covered
                        ranks.add(int(block["rank"]))
                        needed.add((leaf.name, leaf.key, int(block["rank"])))
        return ranks, needed

    def _fit(self, values: dict[str, Any], source: str, sel: Selection, available: Any) -> per_entry.Fitted:
        """Refuse before touching anything when a chosen entry is missing (strict), a module's keys or shapes
        differ (strict; else the keys that fit: :func:`per_entry.fit_module`) or an optimizer's groups differ."""

        def fit_one(e: Entry, v: Any) -> tuple[Any, str | None]:
            if e.kind == "module":
                if is_fsdp1(e.obj):  # PyTorch's loader checks FSDP1's keys (strict=False: theirs)
                    return (v if sel.strict else per_entry.KeySubset(v)), None
                return per_entry.fit_module(e, live_module_state(e.obj), v, source, sel.strict)
            if e.kind == "optimizer":
                try:
                    check_optimizer(e.obj, self.owner[e.name], v, f"state[{e.name!r}] at {source}")
                except StateMismatchError as exc:
                    if sel.strict:
                        raise
                    raise StateMismatchError(f"{exc} (strict=False does not apply inside an optimizer: leave "
                                             f"{e.name!r} out of entries= to keep the live optimizer state)") from exc
            return v, None

        return per_entry.fit_values(sel, values, source, available=available, fit_one=fit_one)

    def _apply(self, e: Entry, value: Any, where: str) -> None:
        if e.kind == "module":
            load_module(e.obj, value, where)
        elif e.kind == "optimizer":
            load_optimizer(e.obj, self.owner[e.name], value, where)
        elif e.kind == "tensor":
            plan_copy_into(e.obj, value, where)()
        else:
            per_entry.apply_entry(e, materialize(value))
