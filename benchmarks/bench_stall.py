"""Training stall per checkpoint: checkpointd beside torch.save and DCP async_save, in the same process.

Workload: L transformer blocks of width D (LayerNorm, QKV projection, causal
attention through F.scaled_dot_product_attention, 4x MLP), fp32 parameters, AdamW (fused on CUDA),
bf16 autocast, batch B x sequence S. One checkpoint every EVERY steps, CKPTS checkpoints per method.

Stall, defined: per checkpoint, the sum over the save step and the 20 steps after it of
(step time - median step time of the `none` run of this same process). Every step ends with
torch.cuda.synchronize(), so a step's wall time is its true cost. Reported: mean and min/max over the
checkpoints, the first one included; the same sum with negative terms clipped to zero (``stall+``,
biased up by noise, the reference script's definition); the time the save call itself blocked; the
steady-state step time between checkpoints (outside the 21-step windows, while the background persist
runs) as a ratio to the `none` run over the same steps; pinned host memory; checkpointd's stats().
The target column says ``ok`` when the mean and the first checkpoint are within the target (averaged
over the checkpoints, the first one included) and names the max when any single
checkpoint exceeds it.

``checkpointd_host25`` sets ``StagingOptions(host_budget_bytes=...)`` to 25 % of the state: pinned memory
(``ckd pin GB``) stays at the budget and the stall is the price, about (state - budget) / write bandwidth
minus one forward/backward; ``stats()`` reports the hooks' wait as ``staging_hook_wait_secs``.

``lightning_async`` and ``checkpointd_lightning`` save the dict a Lightning Trainer would
(``{"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step", "epoch"}``)
through Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (one save in flight: its thread pool is
drained before the next save) and through ``checkpointd.integrations.lightning.CheckpointdIO``
(``save_checkpoint``, the previous file removed as ``ModelCheckpoint(save_top_k=1)`` does). For them, ``torch_save`` and the ``checkpointd`` methods, the ``saved=step`` column says
whether the saved values are those of the save step: after the timed loop, one more save (untimed),
two training steps right after it that change the live tensors, then the checkpoint loaded back and
compared bit for bit with a copy taken at the save (``values_at_save`` in the JSON).

A method may carry environment settings for its run: ``METHOD@NAME=VALUE[+NAME=VALUE...]``, e.g.
``checkpointd@CHECKPOINTD_IO_THREADS=2`` or ``checkpointd@CHECKPOINTD_RECYCLE=0``. They are set before the method's setup and put back
after it; the persist process is restarted on both sides, so settings it reads at start apply.

Run:  python benchmarks/bench_stall.py [--state-gb 5] [--methods none,checkpointd,...] [--json out.json]
      python benchmarks/bench_stall.py --cpu --tiny          (CPU smoke test, tiny sizes)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import threading
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

WINDOW = 21  # the save step + 20 steps after it

ALL_METHODS = ["none", "torch_save", "dcp_async", "dcp_async_pinned", "checkpointd", "checkpointd_zstd", "checkpointd_planes",
               "checkpointd_device", "checkpointd_device_planes", "checkpointd_host25", "checkpointd_threads", "io_only",
               "io_only_reuse", "copy_only", "clone_only", "lightning_async", "checkpointd_lightning"]
DEFAULT_METHODS = ["none", "checkpointd", "checkpointd_zstd", "checkpointd_device", "checkpointd_host25",
                   "copy_only", "dcp_async_pinned", "dcp_async", "torch_save", "lightning_async",
                   "checkpointd_lightning", "none",
                   "checkpointd", "checkpointd_device", "none"]
"""The baselines once; checkpointd's two targeted modes twice, between `none` runs, for the interleaved
estimate (:func:`interleaved_summary`) that a drifting loop cannot bias."""


# ----------------------------------------------------------------------------------------------------
# savers: one object per method; save(step) is the timed blocking call, before_opt_step() runs between
# backward and optimizer.step (where DCP's async staging must be waited for), finish() drains.


class Saver:
    name = "none"
    saves_every_step = False  # checkpointd: maybe_save is called on every step and decides itself

    def __init__(self, bench: "Bench"):
        self.b = bench
        self.notes: list[str] = []
        self.persist_s: list[float] = []

    def setup(self) -> None: ...
    def before_opt_step(self) -> None: ...
    def save(self, step: int) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None:
        """After finish() and the values check: release what the method holds."""

    def saved_values(self, step: int) -> dict | None:
        """``{"model": state dict, "optim": optimizer state dict}`` as saved at ``step`` (the save drained
        first), or None where the method does not support the values check."""
        return None

    def extra(self) -> dict:
        return {}

    def peek_stats(self) -> dict | None:
        return None


class TorchSave(Saver):
    name = "torch_save"

    def save(self, step):
        prev = getattr(self, "_prev", None)
        t0 = time.perf_counter()
        path = os.path.join(self.b.dir, f"s{step}.pt")
        torch.save({"model": self.b.model.state_dict(), "optim": self.b.opt.state_dict()}, path)
        self.persist_s.append(time.perf_counter() - t0)
        if prev and os.path.exists(prev):
            os.remove(prev)
        self._prev = path

    def saved_values(self, step):
        return torch.load(os.path.join(self.b.dir, f"s{step}.pt"), weights_only=True)


class DcpAsync(Saver):
    """dcp.async_save with its default stager (pageable, synchronous staging) or the pinned async one."""

    name = "dcp_async"
    pinned = False

    def setup(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        self.dcp = dcp
        self.kw: dict[str, Any] = {}
        self.stager = None
        if self.pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415
            self.stager = DefaultStager(StagingOptions(True, False, True, True))
            self.kw["async_stager"] = self.stager
        self.pending = None  # (future, t0, dir)
        self.staging = None
        self.old_dirs: list[str] = []

    def _drain(self):
        if self.pending is not None:
            fut, t0, d = self.pending
            fut.result()
            self.persist_s.append(time.perf_counter() - t0)
            self.pending = None
            for od in self.old_dirs:
                shutil.rmtree(od, ignore_errors=True)
            self.old_dirs = [d]

    def before_opt_step(self):
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def _async_save(self, d: str) -> Any:
        """Start DCP's async_save of the model and optimizer into ``d``; its return value."""
        sd = {"model": self.b.model.state_dict(), "optim": self.b.opt.state_dict()}
        try:
            return self.dcp.async_save(sd, checkpoint_id=d, no_dist=True, **self.kw)
        except (RuntimeError, ValueError, AssertionError) as e:
            if "process group" not in str(e).lower():
                raise
            self.notes.append(C.init_single_rank_group(self.b.dev.cuda))  # as the reference does, if needed
            return self.dcp.async_save(sd, checkpoint_id=d, no_dist=True, **self.kw)

    def save(self, step):
        self._drain()  # at most one in flight, as max_pending=1
        t0 = time.perf_counter()
        d = os.path.join(self.b.dir, f"s{step}")
        r = self._async_save(d)
        if hasattr(r, "staging_completion"):
            self.staging = r.staging_completion
            fut = r.upload_completion
        else:
            fut = r
        self.pending = (fut, t0, d)

    def finish(self):
        self.before_opt_step()
        self._drain()
        if self.stager is not None:
            self.stager.close()


class DcpAsyncPinned(DcpAsync):
    name = "dcp_async_pinned"
    pinned = True


class Checkpointd(Saver):
    name = "checkpointd"
    saves_every_step = True
    compression: str | None = None

    def kwargs(self) -> dict | None:
        return {}

    def setup(self):
        C.require_checkpointd()
        extra = self.kwargs()
        if extra is None:
            raise SkipMethod(self.notes[-1] if self.notes else "not supported")
        if self.compression == "zstd" and not C.has_zstd():
            raise SkipMethod("zstandard is not installed")
        kw = dict(every_n_steps=self.b.every, keep_last=self.b.args.keep_last, compression=self.compression,
                  max_pending=self.b.args.max_pending)
        kw = C.merge_kwargs(kw, self.b.ckd_kwargs, extra)
        t0 = time.perf_counter()
        self.mgr = C.make_manager(self.b.dir, {"model": self.b.model, "optim": self.b.opt}, notes=self.notes, **kw)
        self.b.dev.sync()
        self.setup_s = time.perf_counter() - t0
        self.kw_used = C.merge_kwargs(kw)
        self.nonsave_call_s: list[float] = []

    def save(self, step):
        t0 = time.perf_counter()
        started = self.mgr.maybe_save(step)
        dt = time.perf_counter() - t0
        if not started and step % self.b.every == 0:
            self.notes.append(f"maybe_save({step}) returned False on a checkpoint step")
        return dt

    def peek_stats(self):
        return C.safe_stats(self.mgr)

    def finish(self):
        t0 = time.perf_counter()
        self.mgr.wait()
        self.drain_s = time.perf_counter() - t0
        self.stats = C.safe_stats(self.mgr)

    def close(self):
        self.mgr.close()

    def saved_values(self, step):
        self.mgr.wait()
        got = C.require_checkpointd().load(self.b.dir, step=step)
        return {"model": got["model"], "optim": got["optim"]}

    def extra(self):
        return {"setup_s": getattr(self, "setup_s", None), "final_wait_s": getattr(self, "drain_s", None),
                "max_nonsave_call_ms": 1e3 * max(self.nonsave_call_s) if getattr(self, "nonsave_call_s", None) else None,
                "stats": getattr(self, "stats", None), "kwargs": getattr(self, "kw_used", None)}


class CheckpointdZstd(Checkpointd):
    name = "checkpointd_zstd"
    compression = "zstd"


class CheckpointdPlanes(Checkpointd):
    """``compression="zstd-planes"``: what ``compression="auto"`` picks for an object store."""

    name = "checkpointd_planes"
    compression = "zstd-planes"


class CheckpointdDevice(Checkpointd):
    name = "checkpointd_device"

    def kwargs(self):
        if not self.b.dev.cuda:
            self.notes.append("device staging needs CUDA")
            return None
        kw, why = C.device_staging_kwargs(self.b.device_kwargs)
        self.notes.append(why)
        return kw


class CheckpointdDevicePlanes(CheckpointdDevice):
    """Device staging with ``compression="zstd-planes"``: a compressed save's stall beside ``checkpointd_device``."""

    name = "checkpointd_device_planes"
    compression = "zstd-planes"


class CheckpointdHost25(Checkpointd):
    """Host staging budget of 25 % of the state: a fixed ring of pinned chunks instead of a state-sized
    buffer; the optimizer step waits while the state streams through it (the stall this costs)."""

    name = "checkpointd_host25"
    fraction = 0.25

    def kwargs(self):
        budget = int(self.fraction * C.nbytes(C.state_tensors(self.b.model, self.b.opt)))
        self.notes.append(f"host budget {budget / 1e9:.2f} GB")
        return {"staging": {"host_budget_bytes": budget}}


class CheckpointdThreads(Checkpointd):
    """checkpointd with the persist process turned off (``CHECKPOINTD_PERSIST_PROCESS=0``): staging in
    private memory, files written by threads of the training process."""

    name = "checkpointd_threads"

    def setup(self):
        self._env = contextlib.ExitStack()
        self._env.enter_context(C.env_set({"CHECKPOINTD_PERSIST_PROCESS": "0"}))
        super().setup()

    def close(self):
        try:
            super().close()
        finally:
            self._env.close()


def lightning_checkpoint(b: "Bench", step: int) -> dict:
    """The dict a Lightning Trainer hands its CheckpointIO: live state dicts (sharing the parameters'
    and the optimizer's memory) and the loop counters."""
    return {"state_dict": b.model.state_dict(), "optimizer_states": [b.opt.state_dict()], "global_step": step,
            "epoch": 0}


def lightning_values(ckpt: dict) -> dict:
    return {"model": ckpt["state_dict"], "optim": ckpt["optimizer_states"][0]}


class LightningAsync(Saver):
    """Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``: every tensor of the dict cloned on the
    training thread, then ``torch.save`` on a worker thread. One save in flight: the worker is drained
    (``teardown``) before the next save, as ``max_pending=1``; the previous file is removed after."""

    name = "lightning_async"

    def setup(self):
        try:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: PLC0415
        except ImportError as e:
            raise SkipMethod(f"lightning is not installed ({e})") from e
        saver = self

        class TimedTorchIO(TorchCheckpointIO):
            def save_checkpoint(self, *args, **kwargs):
                super().save_checkpoint(*args, **kwargs)
                saver.persist_s.append(time.perf_counter() - saver.t0)

        self.io = AsyncCheckpointIO(TimedTorchIO())
        self.prev: str | None = None
        self.t0 = 0.0

    def _path(self, step: int) -> str:
        return os.path.join(self.b.dir, f"step={step}.ckpt")

    def save(self, step):
        self.io.teardown()  # the previous save finished (and raised, had it failed)
        self.t0 = time.perf_counter()
        self.io.save_checkpoint(lightning_checkpoint(self.b, step), self._path(step))
        if self.prev is not None:
            self.io.remove_checkpoint(self.prev)
        self.prev = self._path(step)

    def finish(self):
        self.io.teardown()

    def saved_values(self, step):
        self.io.teardown()
        return lightning_values(torch.load(self._path(step), weights_only=True))


class CheckpointdLightning(Saver):
    """``CheckpointdIO.save_checkpoint`` with the same dict (root ``DIR/.checkpointd``, the checkpointd
    method's compression and max_pending); the previous file removed as ``ModelCheckpoint`` does."""

    name = "checkpointd_lightning"

    def setup(self):
        try:
            from checkpointd.integrations.lightning import CheckpointdIO, load_checkpoint  # noqa: PLC0415
        except ImportError as e:
            raise SkipMethod(f"lightning is not installed ({e})") from e
        self.load_checkpoint = load_checkpoint
        kw = C.manager_kwargs(C.merge_kwargs({"compression": None, "max_pending": self.b.args.max_pending},
                                             self.b.ckd_kwargs))
        takes = {"compression", "max_pending", "storage_options", "staging", "io"}
        for k in sorted(set(kw) - takes):
            self.notes.append(f"CheckpointdIO has no argument {k!r}; dropped")
        self.io = CheckpointdIO(os.path.join(self.b.dir, ".checkpointd"), **{k: v for k, v in kw.items() if k in takes})
        self.prev: str | None = None

    def _path(self, step: int) -> str:
        return os.path.join(self.b.dir, f"step={step}.ckpt")

    def save(self, step):
        self.io.save_checkpoint(lightning_checkpoint(self.b, step), self._path(step))
        if self.prev is not None:
            self.io.remove_checkpoint(self.prev)
        self.prev = self._path(step)

    def peek_stats(self):
        return C.safe_stats(self.io)

    def finish(self):
        t0 = time.perf_counter()
        self.io.wait()
        self.drain_s = time.perf_counter() - t0
        self.stats = C.safe_stats(self.io)

    def close(self):
        self.io.teardown()

    def saved_values(self, step):
        self.io.wait()
        return lightning_values(self.load_checkpoint(self._path(step)))

    def extra(self):
        return {"final_wait_s": getattr(self, "drain_s", None), "stats": getattr(self, "stats", None)}


def hold_frozen_heap() -> contextlib.ExitStack:
    """Freeze the heap for a floor method's run, as a manager does for its lifetime (``gcfreeze``).

    Why: on the two-GPU loop a full garbage collection of the unfrozen heap costs one step 18-47 ms
    about once a minute; without this the floors (``io_only*``, ``copy_only``) count such a pause that
    ``checkpointd``'s runs do not have, and are no floor. Undone by closing the returned stack."""
    from checkpointd.save import gcfreeze  # noqa: PLC0415
    stack = contextlib.ExitStack()
    gcfreeze.acquire()
    stack.callback(gcfreeze.release)
    return stack


class IoOnly(Saver):
    """The persist phase alone: checkpointd's persist process writes this process's state bytes (model
    third and optimizer two thirds, two files as a save has) from a shared slab filled once at setup,
    with no snapshot, pickling, manifest or commit. Its stall is what the file writing itself costs the
    training steps that run meanwhile (host memory traffic, caches, cores), a floor for ``checkpointd``
    (run with the heap frozen as under a manager, :func:`hold_frozen_heap`)."""

    name = "io_only"

    def setup(self):
        from checkpointd.storage import fsinfo
        from checkpointd.storage import persist_process
        from checkpointd.storage import iopool, sharedmem, writemode  # noqa: PLC0415
        if not sharedmem.supported() or persist_process.client() is None:
            raise SkipMethod("the persist process cannot run here")
        self.fsinfo, self.iopool, self.writemode, self.pp = fsinfo, iopool, writemode, persist_process
        local = [t.to_local() if hasattr(t, "to_local") else t for t in C.state_tensors(self.b.model, self.b.opt)]
        n_model = C.nbytes(local[:len(list(self.b.model.parameters()))])  # this rank's shards (FSDP2: DTensor)
        total = C.nbytes(local)
        self.sizes = [n_model, max(0, total - n_model)]
        self.slab = sharedmem.SharedSlab(total)
        self.slab.array[:] = 7  # touched: every page exists before the first save, as a staging arena's
        self.pending: list[tuple[Any, int, str]] = []
        self.t0 = 0.0
        self.old: list[str] = []
        self.tidying = threading.Thread(target=lambda: None)
        self.tidying.start()
        self.gc = hold_frozen_heap()  # last: finish() undoes it

    def _drain(self):
        if not self.pending:
            return
        pending, old = self.pending, self.old
        try:
            for fut, _, _ in pending:
                fut.result()
            self.persist_s.append(max(self.done_at) - self.t0)  # when the last write finished
        finally:
            def tidy() -> None:
                for _, fd, _ in pending:
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                for path in old:
                    os.remove(path)

            # off the training thread, as checkpointd's fsync and retention are (freeing GBs of tmpfs pages
            # takes ~0.1 s); finish() waits for it
            self.tidying = threading.Thread(target=tidy, daemon=True)
            self.tidying.start()
        self.old = [path for _, _, path in pending]
        self.pending = []

    def _open(self, step: int, k: int) -> tuple[int, str]:
        """A new file for part ``k`` of the save at ``step``."""
        path = os.path.join(self.b.dir, f"io{step}-{k}-rank{os.environ.get('RANK', '0')}.bin")
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644), path

    def save(self, step):
        self._drain()  # at most one in flight, as max_pending=1
        self.t0 = time.perf_counter()
        self.done_at: list[float] = []
        chunk = self.iopool.DEFAULT_CHUNK_BYTES
        start = 0
        for k, size in enumerate(self.sizes):
            fd, path = self._open(step, k)
            os.ftruncate(fd, size)
            mode, lanes = self.writemode.persist_mode(fd)  # as a save's
            tasks = [[(off, self.slab.id, start + off, min(chunk, size - off))] for off in range(0, size, chunk)]
            fut = self.pp.client().submit_write(fd, size, mode, lanes, tasks, [self.slab], self.fsinfo.early_writeback(fd))
            fut.add_done_callback(lambda _f: self.done_at.append(time.perf_counter()))
            self.pending.append((fut, fd, path))
            start += size

    def finish(self):
        try:
            self._drain()
            self.tidying.join()
            for path in self.old:
                os.remove(path)
        finally:
            self.slab.release()
            self.gc.close()


class SkipMethod(Exception):
    pass


class IoOnlyReuse(IoOnly):
    """``io_only`` writing into the files of the save before last instead of new ones (two sets of
    files, alternating; nothing removed): the same bytes through the same process, but into tmpfs pages
    that already exist. Against ``io_only`` it tells what allocating (and freeing) a checkpoint's worth
    of file pages costs the training steps, apart from copying the bytes."""

    name = "io_only_reuse"

    def _open(self, step: int, k: int) -> tuple[int, str]:
        """Part ``k`` of the save before last, written over (the older of two sets of files)."""
        self.old = []  # nothing is removed: kept for the save after next
        slot = (step // max(1, self.b.every)) % 2
        path = os.path.join(self.b.dir, f"ioreuse{slot}-{k}-rank{os.environ.get('RANK', '0')}.bin")
        self.files.add(path)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), path

    def setup(self):
        super().setup()
        self.files: set[str] = set()

    def finish(self):
        try:
            super().finish()
        finally:
            for path in self.files:
                if os.path.exists(path):
                    os.remove(path)


class CopyOnly(Saver):
    """The device-to-host copy alone: this process's state (FSDP2: its local shards) copied into a
    page-locked buffer on a side stream, as checkpointd's pinned mode does it: ordered after the save
    point, queued at the next forward (the loop synchronises the device after every step), and waited
    for by the compute stream before the next optimizer step. Nothing is pickled, written or committed.
    Its stall is what the copy itself costs the steps (copy engines, PCIe, host memory, the wait), a
    floor for ``checkpointd`` beside ``io_only``'s writing. Both run with the heap frozen as under a
    manager (:func:`hold_frozen_heap`)."""

    name = "copy_only"

    def setup(self):
        if not self.b.dev.cuda:
            raise SkipMethod("the device-to-host copy needs CUDA")
        from checkpointd.save.arena import StagingArena, tensor_spec  # noqa: PLC0415
        self.src = [t.to_local() if hasattr(t, "to_local") else t for t in C.state_tensors(self.b.model, self.b.opt)]
        self.src = [t for t in self.src if t.is_cuda]
        self.arena = StagingArena([tensor_spec(t) for t in self.src], pin=True, shared=False)
        if not self.arena.pinned:
            raise SkipMethod("could not page-lock the copy's buffer")
        self.stream = torch.cuda.Stream()
        self.save_point: Any = None
        self.done: Any = None
        self.hook = self.b.model.register_forward_pre_hook(lambda _m, _a: self._queue())
        self.gc = hold_frozen_heap()  # last: finish() undoes it

    def save(self, step):
        self.save_point = torch.cuda.Event()
        self.save_point.record()

    def _queue(self):
        if self.save_point is None:
            return
        self.stream.wait_event(self.save_point)
        self.save_point = None
        with torch.cuda.stream(self.stream), torch.no_grad():
            for src, dst in zip(self.src, self.arena.buffers):
                dst.copy_(src, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(self.stream)

    def before_opt_step(self):
        self._queue()
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
            self.done = None

    def finish(self):
        self.hook.remove()
        self.before_opt_step()
        self.stream.synchronize()
        self.arena.release()
        self.gc.close()


class CloneOnly(CopyOnly):
    """Device staging's copies alone, as ``checkpointd_device`` does them: the state cloned into a
    reused GPU buffer on a side stream (ordered after the save point, queued at the next forward,
    waited for by the compute stream before the next optimizer step), then the clone copied into a
    page-locked buffer on the same stream, paced like checkpointd's (``DEVICE_PACE_BYTES`` queued at
    each forward and each optimizer step). Nothing is pickled, written or committed: with the save
    call (``block ms``) and ``io_only_reuse``'s writing it accounts for device staging's stall."""

    name = "clone_only"

    def setup(self):
        super().setup()
        from checkpointd.save.device_copies import DEVICE_PACE_BYTES  # noqa: PLC0415
        self.pace = DEVICE_PACE_BYTES
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            self.gpu = [torch.empty_like(t) for t in self.src]  # dense sources: the same strides
        except BaseException:  # out of GPU memory: undo the copy's setup (the heap's freeze included)
            self.gpu = []
            self.hook.remove()
            self.arena.release()
            self.gc.close()
            raise

    def _queue(self):
        if self.save_point is not None:
            self.stream.wait_event(self.save_point)
            self.save_point = None
            with torch.cuda.stream(self.stream), torch.no_grad():
                torch._foreach_copy_(self.gpu, self.src)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
            self.pending = list(zip(self.gpu, self.arena.buffers))  # drops what the last save left: only cost counts
        self._pace()

    def _pace(self, everything: bool = False):
        nbytes = 0
        with torch.cuda.stream(self.stream), torch.no_grad():
            while self.pending and (everything or nbytes < self.pace):
                gpu, host = self.pending.pop(0)
                host.copy_(gpu, non_blocking=True)
                nbytes += gpu.numel() * gpu.element_size()

    def finish(self):
        self._queue()
        self._pace(everything=True)
        super().finish()
        self.gpu, self.pending = [], []  # the next method gets this GPU memory back


SAVERS = {c.name: c for c in [Saver, TorchSave, DcpAsync, DcpAsyncPinned, Checkpointd, CheckpointdZstd, CheckpointdPlanes,
                              CheckpointdDevice, CheckpointdDevicePlanes, CheckpointdHost25, CheckpointdThreads, IoOnly, IoOnlyReuse, CopyOnly,
                              CloneOnly, LightningAsync, CheckpointdLightning]}


# ----------------------------------------------------------------------------------------------------


def split_method(method: str) -> tuple[str, dict[str, str]]:
    """``"io_only@A=1+B=2"`` -> ``("io_only", {"A": "1", "B": "2"})``: the saver and its run's environment."""
    name, _, spec = method.partition("@")
    env: dict[str, str] = {}
    for item in filter(None, spec.split("+")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"method {method!r}: expected NAME=VALUE after '@', got {item!r}")
        env[key] = value
    return name, env


@contextlib.contextmanager
def method_env(env: dict[str, str]):
    """The method's environment settings for its run, with a fresh persist process on both sides."""
    if not env:
        yield
        return
    from checkpointd.storage import persist_process  # noqa: PLC0415
    before = {k: os.environ.get(k) for k in env}
    persist_process.shutdown()
    os.environ.update(env)
    try:
        yield
    finally:
        persist_process.shutdown()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Bench:
    def __init__(self, args, dev: C.Dev | None = None):
        self.args = args
        self.dev = dev or C.Dev(cpu=args.cpu)
        self.dir = args.dir
        self.every = args.every
        self.ckd_kwargs = C.parse_json_arg(args.ckd_kwargs)
        self.device_kwargs = C.parse_json_arg(args.device_kwargs) or None
        torch.manual_seed(0)
        self.model = self.wrap(C.make_model(args.D, args.L, self.dev.device))
        self.opt = C.make_optimizer(self.model, self.dev)
        self.x = torch.randn(args.B, args.S, args.D, device=self.dev.device)
        self.amp_dtype = torch.bfloat16

    def wrap(self, model):
        """The model as trained (bench_stall_dist.py shards it with FSDP2 here, before the optimizer exists)."""
        return model

    def fwd_bwd(self):
        with torch.autocast(self.dev.device.type, dtype=self.amp_dtype):
            y = self.model(self.x)
        y.float().pow(2).mean().backward()

    def train_step(self):
        self.fwd_bwd()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def warmup(self, n):
        for _ in range(n):
            self.train_step()
        self.dev.sync()

    # --- the copy-time floor of the stall target ----------------------------------------------------
    def floor(self, state_bytes: int) -> dict:
        out: dict[str, Any] = {}
        ts = []
        for _ in range(10):
            dt, _ = C.timed(self.fwd_bwd, self.dev)
            ts.append(dt)
        self.opt.zero_grad(set_to_none=True)
        out["fwdbwd_ms"] = 1e3 * C.median(ts)
        if not self.dev.cuda:
            return out
        n = min(1 << 30, max(state_bytes, 64 << 20))
        g = torch.empty(n, dtype=torch.uint8, device=self.dev.device).random_(0, 255)
        t0 = time.perf_counter()
        p = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out["pin_alloc_s_per_GiB"] = (time.perf_counter() - t0) * (1 << 30) / n
        p.copy_(g, non_blocking=True)
        self.dev.sync()
        bw = []
        for _ in range(5):
            dt, _ = C.timed(lambda p=p, g=g: p.copy_(g, non_blocking=True), self.dev)
            bw.append(n / dt)
        out["d2h_pinned_GBps"] = max(bw) / 1e9
        h = torch.empty_like(g)
        d2d = []
        for _ in range(5):
            dt, _ = C.timed(lambda h=h, g=g: h.copy_(g), self.dev)
            d2d.append(n / dt)
        out["d2d_GBps"] = max(d2d) / 1e9
        del g, p, h
        C.collect()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
        out["copy_ms"] = 1e3 * state_bytes / (out["d2h_pinned_GBps"] * 1e9)
        out["target_pinned_ms"] = 1.2 * max(0.0, out["copy_ms"] - out["fwdbwd_ms"]) + 10.0
        out["target_device_ms"] = 20.0
        return out

    # --- whether a method saves the values of the save step ------------------------------------------
    def check_values(self, saver: Saver) -> dict | None:
        """One more save after the timed loop (untimed), then two training steps that change the live
        tensors while it may still be writing; the checkpoint loaded back is compared bit for bit with
        a copy taken at the save. None for methods without ``saved_values``, and under torch.distributed
        (``bench_stall_dist.py``: sharded state has no single-process copy to compare with)."""
        if type(saver).saved_values is Saver.saved_values:
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return None
        step = (self.steps // self.every + 1) * self.every  # a checkpoint step (checkpointd's schedule)
        self.dev.sync()
        ref = state_copy(self.model, self.opt)
        saver.save(step)
        for _ in range(2):
            self.fwd_bwd()
            saver.before_opt_step()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.dev.sync()
        try:
            got = saver.saved_values(step)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be read back is the finding
            return {"step": step, "equal": False, "first_difference": "load failed: " + C.error_text(e)}
        diff = first_difference(ref, got)
        return {"step": step, "equal": diff is None, "first_difference": diff}

    # --- one method ---------------------------------------------------------------------------------
    def run(self, method: str) -> dict:
        name, env = split_method(method)
        with method_env(env):
            res = self._run(SAVERS[name](self), method)
        if env:
            res["env"] = env
        return res

    def _run(self, saver: Saver, method: str) -> dict:
        args = self.args
        C.clean_dir(self.dir)
        C.collect()
        if self.dev.cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
        if self.dev.cuda and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            try:  # pin GB is then this method's peak
                torch.cuda.reset_peak_host_memory_stats()
            except Exception:  # noqa: BLE001
                pass
        mem0 = C.host_memory(self.dev)
        res: dict[str, Any] = {"method": method}
        try:
            saver.setup()
        except SkipMethod as e:
            return {"method": method, "skipped": str(e), "notes": saver.notes}
        except Exception as e:  # noqa: BLE001 - a baseline that fails is a finding
            traceback.print_exc()
            return {"method": method, "error": C.error_text(e), "notes": saver.notes}
        mem_setup = C.host_memory(self.dev)
        step_t: list[float] = []
        block_t: list[float] = []
        mem_first = None
        stats_first = None
        first_save = None  # checkpointd's stats()["last_save"] once it is the first save's
        saves = [s for s in range(1, self.steps + 1) if s % self.every == 0][: args.ckpts] if saver.name != "none" else []
        save_set = set(saves)
        counters = C.StepCounters() if args.step_counters else None
        try:
            self.dev.sync()
            for step in range(1, self.steps + 1):
                t0 = time.perf_counter()
                self.fwd_bwd()
                saver.before_opt_step()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                if step in save_set:
                    self.dev.sync()
                    tb = time.perf_counter()
                    saver.save(step)
                    block_t.append(time.perf_counter() - tb)
                elif saver.saves_every_step and step % self.every != 0:
                    saver.nonsave_call_s.append(saver.save(step))
                self.dev.sync()
                step_t.append(time.perf_counter() - t0)
                if counters is not None:  # untimed, like the memory probe below
                    counters.sample()
                if saves and step == saves[0] + WINDOW:  # untimed: after this step's clock stopped
                    mem_first = C.host_memory(self.dev)
                    stats_first = saver.peek_stats()
                if saves and first_save is None and step > saves[0]:  # while the first save is not yet committed
                    last = (saver.peek_stats() or {}).get("last_save") or {}  # untimed, as above
                    if last.get("step") is not None and last["step"] >= saves[0]:
                        first_save = last if last["step"] == saves[0] else {}  # {}: seen only after a later one
            t0 = time.perf_counter()
            saver.finish()
            res["drain_after_loop_s"] = time.perf_counter() - t0
            values = self.check_values(saver)
            if values is not None:
                res["values_at_save"] = values
            saver.close()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["error"] = C.error_text(e)
            for end in (saver.finish, saver.close):
                try:
                    end()
                except Exception:  # noqa: BLE001
                    pass
        res.update({"step_s": step_t, "block_s": block_t, "saves": saves, "persist_s": saver.persist_s,
                    "notes": saver.notes, "mem_before": mem0, "mem_after_setup": mem_setup,
                    "mem_after_first_save": mem_first, "mem_end": C.host_memory(self.dev),
                    "stats_after_first_save": stats_first, "first_save": first_save})
        if counters is not None:
            res["step_counters"] = counters.deltas
            res["slow_step_profile"] = C.slow_step_profile(step_t, counters.deltas)
        res.update(saver.extra())
        return res


def state_copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The model's and optimizer's state dicts, every tensor copied to the CPU."""
    def copy(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return tree.detach().to("cpu", copy=True)
        if isinstance(tree, dict):
            return {k: copy(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(copy(v) for v in tree)
        return tree
    return {"model": copy(model.state_dict()), "optim": copy(opt.state_dict())}


def first_difference(ref: Any, got: Any, where: str = "") -> str | None:
    """Where ``got`` differs from ``ref`` (tensors bit for bit, on the CPU), or None if nowhere."""
    if isinstance(ref, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == ref.dtype and torch.equal(ref, got.detach().cpu())
        return None if ok else where or "."
    if isinstance(ref, dict):
        if not isinstance(got, dict) or set(map(str, ref)) != set(map(str, got)):
            return f"{where}: keys differ"
        by_str = {str(k): v for k, v in got.items()}
        return next((d for k, v in ref.items() if (d := first_difference(v, by_str[str(k)], f"{where}/{k}"))), None)
    if isinstance(ref, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(ref):
            return f"{where}: lengths differ"
        return next((d for i, (a, b) in enumerate(zip(ref, got)) if (d := first_difference(a, b, f"{where}/{i}"))), None)
    return None if ref == got else where or "."


def run_base(method: str) -> str:
    """A run's method without its repeat count (``checkpointd#2`` -> ``checkpointd``)."""
    return method.split("#")[0]


def is_baseline_run(r: dict) -> bool:
    """A `none` run that has step times to measure against (not an error)."""
    return run_base(r["method"]) == "none" and bool(r.get("step_s")) and "error" not in r


def analyse(runs: list[dict], every: int, steps: int) -> None:
    """Add stall numbers to every run, against the `none` runs of this process.

    The baseline median is that of all `none` steps pooled (the first two of each run left out), so a
    later `none` run guards against drift; per-step baselines (steady x) average the `none` runs.
    """
    bases = [r["step_s"] for r in runs if is_baseline_run(r)]
    if not bases:
        return
    n0 = min(len(b) for b in bases)
    st0 = [sum(b[j] for b in bases) / len(bases) for j in range(n0)]
    med = C.median([x for b in bases for x in b[2:]])
    for r in runs:
        st = r.get("step_s")
        if not st:
            continue
        r["median_step_ms"] = 1e3 * C.median(st[2:])
        r["none_median_step_ms"] = 1e3 * med
        stalls, clipped = [], []
        r["saves"] = [s for s in r["saves"] if s - 1 + WINDOW <= len(st)]  # a failed run stops early
        for s in r["saves"]:
            idx = range(s - 1, s - 1 + WINDOW)
            stalls.append(sum(st[j] - med for j in idx))
            clipped.append(sum(max(0.0, st[j] - med) for j in idx))
        r["stall_ms"] = [1e3 * x for x in stalls]
        r["stall_clipped_ms"] = [1e3 * x for x in clipped]
        r["stall_local_ms"] = [1e3 * local_stall(st, s) for s in r["saves"]]
        if r["saves"]:  # where the stall lands: the save step, the next two, the 18 after (means over checkpoints)
            parts = [[st[s - 1 + k] - med for s in r["saves"]] for k in range(3)]
            parts.append([sum(st[j] - med for j in range(s + 2, s - 1 + WINDOW)) for s in r["saves"]])
            r["stall_by_step_ms"] = [1e3 * sum(p) / len(p) for p in parts]
        at = r["saves"]
        if not r["saves"]:  # the none runs, scored with the checkpoints' windows: the host's own noise
            at = placebo_saves(st, every, steps)
            r["placebo_ms"] = [1e3 * window_sum(st, s, med) for s in at]
        r["stall_paired_ms"] = [1e3 * x for x in paired_stalls(st, at, every, med)]
        in_window = set()
        for s in r["saves"]:
            in_window.update(range(s - 1, s - 1 + WINDOW))
        outside = [j for j in range(1, len(st)) if j not in in_window]  # the first step is slow in every run
        if outside:  # what the stall does not count: e.g. a one-time page-locking of staging buffers
            j = max(outside, key=lambda k: st[k])
            r["longest_outside_ms"], r["longest_outside_step"] = 1e3 * (st[j] - med), j + 1
        s0 = r["saves"][0] if r["saves"] else every  # before the first save: what preparing the buffers cost, spread or not
        pre = range(1, min(s0 - 1, len(st), n0))
        if len(pre):
            r["before_first_save_ms"] = 1e3 * sum(st[j] - st0[j] for j in pre)
        # steady state: after the first save's window (when persisting overlaps training), outside windows
        first = (r["saves"][0] - 1 + WINDOW) if r["saves"] else every - 1 + WINDOW
        steady = [j for j in range(first, min(len(st), len(st0))) if j not in in_window]
        if not r["saves"]:  # the none runs: same indices as the checkpointing runs
            steady = [j for j in range(every - 1 + WINDOW, len(st)) if (j - (every - 1)) % every >= WINDOW]
        if steady:
            mean_m = sum(st[j] for j in steady) / len(steady)
            mean_0 = sum(st0[j] for j in steady) / len(steady)
            r["steady_steps"] = len(steady)
            r["steady_mean_ratio"] = mean_m / mean_0
            r["steady_median_ratio"] = C.median([st[j] for j in steady]) / C.median([st0[j] for j in steady])
    adjacent_stalls(runs, every, steps)


def placebo_saves(st: list[float], every: int, steps: int) -> list[int]:
    """The steps a run without checkpoints is scored at: where the checkpoints would be, whole windows only."""
    return [k * every for k in range(1, steps // every + 1) if k * every - 1 + WINDOW <= len(st)]


def window_sum(st: list[float], save: int, base: float) -> float:
    """The stall of one window: the save step and the 20 after it, each against ``base``."""
    return sum(st[j] - base for j in range(save - 1, save - 1 + WINDOW))


def adjacent_stalls(runs: list[dict], every: int, steps: int) -> None:
    """Score every run's windows against the `none` runs just before and after it (``stall_adjacent_ms``;
    on `none` runs ``placebo_adjacent_ms``, against the nearest other `none` runs).

    Why: the baseline is "the same run without checkpointing". When the loop's median step wanders by
    several ms within a process (two-GPU FSDP2 runs: 46-72 ms in 30-step blocks of one `none` run), one pooled median of `none` runs minutes away moves every 21-step window by up to
    hundreds of ms. Interleaving the methods (``none,checkpointd,none,checkpointd,none``) and scoring each
    run against its neighbours turns that drift into noise that averages out over many checkpoints;
    :func:`interleaved_summary` gives the mean with its 95 % confidence interval, the placebo beside it."""
    nones = [k for k, r in enumerate(runs) if is_baseline_run(r)]
    for k, r in enumerate(runs):
        st = r.get("step_s")
        if not st or "error" in r:
            continue
        is_none = k in nones
        before = [j for j in nones if j < k]
        after = [j for j in nones if j > k]
        near = before[-1:] + after[:1]
        if not near:
            continue
        med = C.median([x for j in near for x in runs[j]["step_s"][2:]])
        if is_none:
            r["placebo_adjacent_ms"] = [1e3 * window_sum(st, s, med) for s in placebo_saves(st, every, steps)]
        else:
            r["stall_adjacent_ms"] = [1e3 * window_sum(st, s, med) for s in r.get("saves", [])]
        r["adjacent_median_step_ms"] = 1e3 * med


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
        15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}


def mean_ci95(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (Student's t; nan for fewer than 2)."""
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    if n < 2:
        return mean, float("nan")
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
    t = _T95[max(d for d in _T95 if d <= n - 1)]  # the tabulated df at or below: never narrower than exact
    return mean, t * sd / n ** 0.5


def interleaved_summary(runs: list[dict]) -> list[dict]:
    """:func:`window_summary` of ``runs``, empty unless some method ran twice (else the table says it all)."""
    bases = [run_base(r["method"]) for r in runs]
    if not any(bases.count(b) > 1 and b != "none" for b in set(bases)):
        return []
    return window_summary(runs)


def window_summary(runs: list[dict]) -> list[dict]:
    """Per method (repeats pooled: ``checkpointd`` and ``checkpointd#2`` together): every checkpoint's
    window against its run's neighbouring `none` runs (:func:`adjacent_stalls`) and against the window
    halfway to the next save (``paired``), as mean +- 95 % CI over all of them; `none` runs give the
    placebo, the same estimator where no checkpoint is taken."""
    bases = [run_base(r["method"]) for r in runs]
    out = []
    for base in dict.fromkeys(bases):
        mine = [r for r in runs if run_base(r["method"]) == base]
        key = "placebo_adjacent_ms" if base == "none" else "stall_adjacent_ms"
        adj = [x for r in mine for x in r.get(key) or []]
        pair = [x for r in mine for x in r.get("stall_paired_ms") or []]
        if not adj:
            continue
        m, h = mean_ci95(adj)
        row = {"method": base, "runs": len(mine), "n": len(adj), "mean_ms": m, "ci95_ms": h,
               "min_ms": min(adj), "max_ms": max(adj), "placebo": base == "none"}
        if pair:
            pm, ph = mean_ci95(pair)
            row.update(paired_n=len(pair), paired_mean_ms=pm, paired_ci95_ms=ph)
        out.append(row)
    return out


def interleaved_lines(rows: list[dict], label: str = "", targets: dict[str, float | None] | None = None) -> str:
    """The interleaved estimate as text (one line per method), '' if there is none; with ``targets``
    (method: ms), whether the mean meets it and whether the whole 95 % interval does."""
    if not rows:
        return ""
    out = [f"interleaved{label}: each checkpoint's window against the `none` runs just before and after its run; mean +- 95% CI "
           "over all windows of the method's runs (`none`: the placebo, the same windows without checkpoints)"]
    for r in rows:
        line = (f"   {r['method']:<20} {r['mean_ms']:8.1f} +- {C.fmt(r['ci95_ms'])} ms  [{r['min_ms']:.1f}, {r['max_ms']:.1f}]  "
                f"n={r['n']} windows in {r['runs']} runs")
        if "paired_mean_ms" in r:
            line += f"; paired {r['paired_mean_ms']:.1f} +- {C.fmt(r['paired_ci95_ms'])} (n={r['paired_n']})"
        tgt = (targets or {}).get(r["method"])
        if tgt is not None:
            upper = r["mean_ms"] + (r["ci95_ms"] if r["ci95_ms"] == r["ci95_ms"] else 0.0)
            line += f"; target {tgt:.1f}: {'ok' if r['mean_ms'] <= tgt else 'MISS'}" + (
                " (the whole interval below)" if upper <= tgt else "")
        out.append(line)
    return "\n".join(out)


LOCAL_BASE_STEPS = 20


def paired_stalls(st: list[float], saves: list[int], every: int, med: float) -> list[float]:
    """A diagnostic beside the stall: each save's window minus a window of the same length
    halfway to the next save, in the same run. Drift between runs and a host's own stalls (the
    placebo) weigh on both alike and cancel on average; what the checkpoint costs after its window
    (nothing, once its writing is done) would too, so it needs ``every >= 2 * WINDOW`` (else [])."""
    if every < 2 * WINDOW:
        return []
    out = []
    for s in saves:
        mid = s + every // 2
        if mid - 1 + WINDOW <= len(st):
            out.append(sum(st[j] - med for j in range(s - 1, s - 1 + WINDOW))
                       - sum(st[j] - med for j in range(mid - 1, mid - 1 + WINDOW)))
    return out


def local_stall(st: list[float], save: int) -> float:
    """A diagnostic beside the stall: the same window against the median of the 20 steps just
    before the save (which run no checkpoint work) instead of the `none` runs. A host's step time drifts
    by up to ~1 ms a step between runs a minute apart (21 steps: ~20 ms either way); this baseline is
    blind to that drift, though not to noise within the window. Verdicts use the stall's definition."""
    before = st[max(2, save - 1 - LOCAL_BASE_STEPS):save - 1]
    if not before:
        return float("nan")
    base = C.median(before)
    return sum(st[j] - base for j in range(save - 1, save - 1 + WINDOW))


WRITES_LEGEND = ("write s 1st/last [recycled] = the first and last saves' write seconds [how many of their files were written\n"
                 "   over retired or blank files from the recycling bin / files, first save, last save] (checkpointd stats()[\"last_save\"])\n")


def persist_and_notes(r: dict, row: dict, width: int) -> None:
    """The table columns every stall table shares: mean persist seconds, the first and last saves' write
    seconds with how many of their files were written over recycled ones (checkpointd ``stats()``), and
    the notes (errors first).

    Why the writes: a run's first saves find no retired files, and whether they found blank ones made
    ahead decides how fast they write (0.88-1.06 s for 2.42 GB a rank into reserved blank files, 0.46-0.49
    over retired ones, on a 2x H200 host)."""
    if r.get("persist_s"):
        row["persist"] = C.fmt(sum(r["persist_s"]) / len(r["persist_s"]), ".2f")
    first = (r.get("first_save") if "first_save" in r  # JSON without it: the stats 20 steps after the first save
             else (r.get("stats_after_first_save") or {}).get("last_save")) or {}
    last = (r.get("stats") or {}).get("last_save") or {}
    if first.get("write_secs") is not None and last.get("write_secs") is not None:
        row["writes"] = (f"{first['write_secs']:.2f}/{last['write_secs']:.2f} "
                         f"[{first.get('files_recycled', '?')}/{first.get('files', '?')},"
                         f"{last.get('files_recycled', '?')}/{last.get('files', '?')}]")
    notes = list(r.get("notes") or [])
    if "error" in r:
        notes.insert(0, "ERROR " + r["error"])
    if notes:
        row["note"] = "; ".join(notes)[:width]


DRIFT_WARN = 0.03
"""Flag a run whose `none` runs' median steps differ by more than this fraction, or where a method's
median step is this much below the baseline (checkpointing cannot make steps faster: that is drift)."""


def drift_warning(runs: list[dict]) -> str | None:
    """A warning when the loop's median step moved between the methods of this run, else None.

    Why: a stall sums 21 steps against the `none` runs' median, so a drift of d ms a step moves every
    stall by ~21 d: a 0.45 GB run whose loop drifts from 10.0 to 7.0 ms a step and back within one
    process gives negative stalls. Slower medians are not flagged: persisting may
    really slow the steps between checkpoints (the `steady x` column). The table still prints; this
    says not to read it as a verdict."""
    base = next((r["none_median_step_ms"] for r in runs if r.get("none_median_step_ms")), None)
    if not base:
        return None
    measured = [(r["method"], r["median_step_ms"]) for r in runs if r.get("median_step_ms")]
    nones = [(m, v) for m, v in measured if run_base(m) == "none"]
    off = [(m, v) for m, v in measured if run_base(m) != "none" and v < base * (1.0 - DRIFT_WARN)]
    if len(nones) >= 2 and max(v for _, v in nones) > min(v for _, v in nones) * (1.0 + DRIFT_WARN):
        off = nones + off
    if not off:
        return None
    shift = WINDOW * max(abs(v - base) for _, v in off)
    return (f"WARNING: the loop's median step drifted within this run (the `none` baseline {base:.2f} ms; "
            + ", ".join(f"{m} {v:.2f}" for m, v in off) + f"; more than {DRIFT_WARN:.0%} apart). A stall sums {WINDOW} "
            f"steps, so this moves each by up to {shift:.0f} ms: not a verdict; rerun")


OUTSIDE_WARN_MS = 50.0
"""A step this much above the `none` median outside every stall window is named under the table."""


def outside_warning(runs: list[dict]) -> str | None:
    """The methods with a step outside every stall window more than :data:`OUTSIDE_WARN_MS` above the
    `none` median (the first step of a run left out), else None.

    Why: the stall counts the save step and the 20 after it. A cost paid elsewhere, once (staging
    buffers page-locked on the training thread at step 2 would hold it for 1.7-2.8 s at 4.83 GB) or
    between checkpoints, is in no stall number; the steady column averages it away."""
    hits = [(r["method"], r["longest_outside_ms"], r["longest_outside_step"]) for r in runs
            if r.get("longest_outside_ms", 0.0) > OUTSIDE_WARN_MS]
    if not hits:
        return None
    return ("NOTE: steps outside every stall window (not counted in any stall above): "
            + ", ".join(f"{m} {v:.1f} ms above the median at step {k}" for m, v, k in hits))


def summarise(res: dict) -> str:
    runs = res["runs"]
    fl = res.get("floor", {})
    dcp_stall = next((sum(r["stall_ms"]) / len(r["stall_ms"]) for r in runs
                      if r["method"] == "dcp_async" and r.get("stall_ms")), None)
    rows = []
    for r in runs:
        row: dict[str, Any] = {"method": r["method"]}
        base = run_base(r["method"]).split("@")[0]
        if "skipped" in r:
            row["note"] = "skipped: " + r["skipped"]
            rows.append(row)
            continue
        pair = r.get("stall_paired_ms") or []
        if pair:
            row["paired"] = C.fmt(sum(pair) / len(pair))
        p = r.get("placebo_ms") or []
        if p and not r.get("stall_ms"):
            row.update(stall=C.fmt(sum(p) / len(p)), smin=C.fmt(min(p)), smax=C.fmt(max(p)), first=C.fmt(p[0]),
                       note="placebo: no checkpoint, the same windows")
        s = r.get("stall_ms") or []
        if s:
            mean = sum(s) / len(s)
            row.update(stall=C.fmt(mean), smin=C.fmt(min(s)), smax=C.fmt(max(s)),
                       first=C.fmt(s[0]), clip=C.fmt(sum(r["stall_clipped_ms"]) / len(s)))
            loc = r.get("stall_local_ms") or []
            if loc:
                row["local"] = C.fmt(sum(loc) / len(loc))
            b = r["block_s"]
            row.update(block=C.fmt(1e3 * sum(b) / len(b), ".1f"), bfirst=C.fmt(1e3 * b[0], ".1f"))
            if r.get("stall_by_step_ms"):
                row["where"] = "/".join(f"{x:.0f}" for x in r["stall_by_step_ms"])
            if base.startswith("checkpointd"):
                tgt = fl.get("target_device_ms") if base == "checkpointd_device" else fl.get("target_pinned_ms")
                if base.startswith("checkpointd_host"):
                    tgt = None  # a host budget trades stall for memory: ~(state - budget) / write bandwidth
                verdict = []
                if tgt is not None:  # the mean over the checkpoints, and the first one too
                    verdict.append(f"{'ok' if mean <= tgt and s[0] <= tgt else 'MISS'} <= {tgt:.0f}ms"
                                   f"{'' if max(s) <= tgt else f' (max {max(s):.0f})'}")
                if dcp_stall and dcp_stall > 0 and mean > 0 and base not in ("checkpointd_device", "checkpointd_host25"):
                    verdict.append(f"{dcp_stall / max(mean, 1e-9):.0f}x vs dcp")
                row["target"] = ", ".join(verdict)
        if "before_first_save_ms" in r:
            row["pre"] = C.fmt(r["before_first_save_ms"])
        if "median_step_ms" in r:
            row["med"] = C.fmt(r["median_step_ms"], ".2f")
        if "steady_mean_ratio" in r:
            row["steady"] = C.fmt(r["steady_mean_ratio"], ".3f")
        me = r.get("mem_end") or {}
        m0 = r.get("mem_before") or {}
        if me.get("pinned_bytes") is not None and m0.get("pinned_bytes") is not None:
            mf = r.get("mem_after_first_save") or {}
            if me.get("pinned_peak_bytes") is not None:
                row["pinned"] = C.fmt(me["pinned_peak_bytes"] / 1e9, ".2f")
            if mf.get("pinned_allocs_total") is not None and me.get("pinned_allocs_total") is not None:
                row["newpin"] = str(me["pinned_allocs_total"] - mf["pinned_allocs_total"])
        st, sf = r.get("stats") or {}, r.get("stats_after_first_save") or {}
        if st.get("pinned_bytes") is not None:
            row["ckdpin"] = C.fmt(st["pinned_bytes"] / 1e9, ".2f")
        if st.get("staging_allocations") is not None and sf.get("staging_allocations") is not None:
            row["ckdnew"] = str(st["staging_allocations"] - sf["staging_allocations"])
        if me.get("rss_bytes") and m0.get("rss_bytes"):
            row["drss"] = C.fmt((me["rss_bytes"] - m0["rss_bytes"]) / 1e9, ".2f")
        persist_and_notes(r, row, 110)
        values = r.get("values_at_save")
        if values is not None:
            row["values"] = "ok" if values.get("equal") else "DIFFER"
            if not values.get("equal"):
                row["note"] = f"saved values differ at {values.get('first_difference')}; " + row.get("note", "")
        rows.append(row)
    cols = [("method", "method"), ("stall", "stall ms"), ("smin", "min"), ("smax", "max"), ("first", "first"),
            ("clip", "stall+"), ("local", "local"), ("paired", "paired"), ("where", "save/+1/+2/rest"), ("block", "block ms"), ("bfirst", "block 1st"), ("pre", "pre ms"), ("med", "step ms"),
            ("steady", "steady x"), ("pinned", "pin GB"), ("newpin", "new pins"), ("ckdpin", "ckd pin GB"),
            ("ckdnew", "ckd new allocs"), ("drss", "dRSS GB"),
            ("persist", "persist s"), ("writes", "write s 1st/last [recycled]"), ("values", "saved=step"),
            ("target", "target"), ("note", "note")]
    i = res["info"]
    w = res["workload"]
    head = (f"\n== stall: {i['device']}, torch {i['torch']}, {i['date']}\n"
            f"   D={w['D']} L={w['L']} B={w['B']} S={w['S']}: {w['params'] / 1e6:.1f}M params, "
            f"state {w['state_bytes'] / 1e9:.3f} GB in {w['tensors']} tensors; {w['ckpts']} checkpoints every "
            f"{w['every']} steps, {w['steps']} steps/method; dir {w['dir']} ({w['dir_fs']})\n")
    if fl:
        head += f"   fwd+bwd {C.fmt(fl.get('fwdbwd_ms'), '.1f')} ms"
        if "d2h_pinned_GBps" in fl:
            head += (f"; pinned D2H {fl['d2h_pinned_GBps']:.1f} GB/s -> copy {fl['copy_ms']:.1f} ms; "
                     f"D2D {fl['d2d_GBps']:.0f} GB/s; pin alloc {fl['pin_alloc_s_per_GiB']:.2f} s/GiB\n"
                     f"   targets: pinned stall <= 1.2*max(0, copy - fwdbwd) + 10 = {fl['target_pinned_ms']:.1f} ms "
                     f"and >= 40x below dcp_async; device staging <= 20 ms; steady x <= 1.02")
        head += "\n"
    nones = [r for r in runs if run_base(r["method"]) == "none" and "median_step_ms" in r]
    if nones:
        head += ("   `none` baseline median step " + C.fmt(nones[0].get("none_median_step_ms"), ".2f") + " ms (pooled over "
                 + ", ".join(f"{r['method']} {r['median_step_ms']:.2f}" for r in nones) + " ms)\n")
    head += ("   stall = sum over save step + 20 steps of (step - median step of `none`), mean [min, max] over "
             "checkpoints, first included; on `none` rows the same windows of a run without checkpoints (placebo: what the host's\n"
             "   own noise adds to a stall); stall+ = same with negatives clipped; local = mean of the same windows against the median of\n"
             "   the 20 steps before each save (blind to drift between runs; a diagnostic, not the verdict); paired = each window minus the window\n"
             "   halfway to the next save in the same run (drift and the host's own stalls cancel; a diagnostic); save/+1/+2/rest = the stall's share on the save step,\n"
             "   the next two steps and the 18 after (means); block = time inside the save call; pre = sum over steps 2 to the one before the\n"
             "   first save of (step - the `none` runs' same step): what preparing the staging buffers cost, spread over steps or not;\n"
             "   steady x = mean step time between checkpoints (outside the windows) / `none` on the same steps; "
             "pin GB = peak torch pinned allocator bytes; new pins = pinned allocations after the first save;\n"
             "   ckd pin GB / ckd new allocs = checkpointd stats() pinned_bytes / staging_allocations made after the first save;\n"
             "   saved=step = one more save after the loop, two training steps right after it, loaded back: ok when it holds\n"
             "   the values of its save step bit for bit;\n"
             "   " + WRITES_LEGEND)
    warning = drift_warning(runs)
    outside = outside_warning(runs)
    profile = slow_step_lines(runs)
    inter = interleaved_lines(interleaved_summary(runs), targets={"checkpointd": fl.get("target_pinned_ms"),
                                                                  "checkpointd_device": fl.get("target_device_ms")})
    return (head + C.table(rows, [c for c in cols if any(c[0] in r for r in rows)]) + ("\n" + warning if warning else "")
            + ("\n" + outside if outside else "") + ("\n" + profile if profile else "") + ("\n" + inter if inter else ""))


def slow_step_lines(runs: list[dict]) -> str:
    """With ``--step-counters``: per run, the counters' mean per slow step against the other steps."""
    out = []
    for r in runs:
        prof = r.get("slow_step_profile")
        if not prof:
            continue
        parts = ", ".join(f"{k} {a:g}/{b:g}" for k, (a, b) in prof["per_step"].items())
        out.append(f"   {r['method']}: {prof['slow_steps']} steps > median + {prof['over_ms']:g} ms; "
                   f"per slow step / per other step: {parts}")
    if not out:
        return ""
    return "step counters (the training thread's wait for a CPU, switches, faults; host reclaim and compaction):\n" + "\n".join(out)


def ckd_stats_lines(runs: list[dict]) -> str:
    out = []
    for r in runs:
        if r["method"].startswith("checkpointd") and r.get("stats"):
            s = {k: v for k, v in r["stats"].items() if not isinstance(v, (dict, list))}
            s.update({"last." + k: v for k, v in (r["stats"].get("last_save") or {}).items()})
            out.append(f"   {r['method']} stats(): " + ", ".join(f"{k}={C.fmt(v, '.4g')}" for k, v in s.items())[:600])
            prep = r["stats"].get("staging_prepare_secs") or {}
            if prep:
                out.append(f"   {r['method']} staging arena: pages allocated in {C.fmt(prep.get('populate'), '.3f')} s, page-locked in "
                           f"{C.fmt(prep.get('register'), '.3f')} s ({prep.get('pieces')} pieces); saves waited "
                           f"{C.fmt(r['stats'].get('staging_arena_wait_secs'), '.3f')} s for it")
            if r.get("setup_s") is not None:
                out.append(f"   {r['method']} construction {r['setup_s']:.2f} s, final wait {C.fmt(r.get('final_wait_s'), '.2f')} s, "
                           f"max non-save maybe_save {C.fmt(r.get('max_nonsave_call_ms'), '.3f')} ms")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA is available")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--state-gb", type=float, default=C.env_float("STATE_GB", None),
                   help="preset: 0.5, 5 or 20 GB of state (chooses D and L); other values pick L at D=2048")
    p.add_argument("--D", type=int, default=C.env_int("D", None))
    p.add_argument("--L", type=int, default=C.env_int("L", None))
    p.add_argument("--B", type=int, default=C.env_int("B", None))
    p.add_argument("--S", type=int, default=C.env_int("S", None))
    p.add_argument("--every", type=int, default=C.env_int("EVERY", None), help="checkpoint every N steps (default 100)")
    p.add_argument("--ckpts", type=int, default=C.env_int("CKPTS", 3), help="checkpoints per method (>= 3)")
    p.add_argument("--steps", type=int, default=C.env_int("STEPS", None),
                   help="timed steps per method (default (ckpts+1)*every - 1)")
    p.add_argument("--warmup", type=int, default=C.env_int("WARMUP", 5))
    p.add_argument("--step-counters", action="store_true", default=bool(C.env_int("STEP_COUNTERS", 0)),
                   help="record kernel counters per step (the training thread's wait for a CPU, context switches, "
                        "faults, reclaim and compaction) and compare the slow steps with the rest")
    p.add_argument("--methods", default=C.env_str("METHODS", ",".join(DEFAULT_METHODS)),
                   help="comma list from: " + ", ".join(ALL_METHODS) + " (the first `none` is the baseline)")
    p.add_argument("--dir", default=C.env_str("CKDIR", "/dev/shm/ckd-bench"), help="checkpoint target (cleaned per method)")
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--max-pending", type=int, default=1)
    p.add_argument("--ckd-kwargs", default=C.env_str("CKD_KWARGS", None),
                   help="JSON object of extra CheckpointManager kwargs for every checkpointd method")
    p.add_argument("--device-kwargs", default=C.env_str("CKD_DEVICE_KWARGS", None),
                   help="JSON object of kwargs that turn on device staging (checkpointd_device); auto-detected if absent")
    C.add_prefault_arg(p)
    p.add_argument("--json", default=None, help="write all results here")
    a = p.parse_args(argv)
    return resolve_args(p, a, SAVERS)


def resolve_args(p: argparse.ArgumentParser, a: argparse.Namespace, savers: dict) -> argparse.Namespace:
    """Workload defaults (tiny, or the --state-gb preset), then the checks (also bench_stall_dist's)."""
    if a.tiny:
        d = dict(D=64, L=2, B=2, S=32, every=25)
    else:
        dd, ll = C.shape_for_gb(a.state_gb if a.state_gb is not None else 5.0)
        d = dict(D=dd, L=ll, B=8, S=512, every=100)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.steps is None:
        a.steps = (a.ckpts + 1) * a.every - 1
    if a.every < WINDOW + 1:
        p.error(f"--every must be > {WINDOW} so the stall windows do not overlap")
    if a.steps < a.ckpts * a.every + WINDOW - 1:
        p.error(f"--steps must be >= ckpts*every + {WINDOW - 1}")
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in a.methods:
        try:
            name, _ = split_method(m)
        except ValueError as e:
            p.error(str(e))
        if name not in savers:
            p.error(f"unknown method {name!r}; choose from {list(savers)}")
    return a


def main(argv=None):
    args = parse_args(argv)
    prefault = C.prefault_host_memory(args.prefault_gb, C.Dev(cpu=args.cpu))
    b = Bench(args)
    b.steps = args.steps
    info = C.env_info(b.dev)
    info["prefault"] = prefault
    print(f"[stall] {info['device']}  torch {info['torch']}  checkpointd {info['checkpointd']}", flush=True)
    if not b.dev.cuda:
        print("[stall] CPU mode: a smoke test of the script; its timings mean nothing", flush=True)
    os.makedirs(args.dir, exist_ok=True)
    b.warmup(args.warmup)
    sb = C.nbytes(C.state_tensors(b.model, b.opt))
    workload = {"D": args.D, "L": args.L, "B": args.B, "S": args.S, "params": sum(p.numel() for p in b.model.parameters()),
                "state_bytes": sb, "tensors": len(C.state_tensors(b.model, b.opt)), "every": args.every,
                "ckpts": args.ckpts, "steps": args.steps, "dir": args.dir, "dir_fs": C.fs_type(args.dir),
                "amp": "bf16", "fused_adamw": b.dev.cuda}
    print(f"[stall] state {sb / 1e9:.3f} GB; D={args.D} L={args.L} B={args.B} S={args.S}", flush=True)
    floor = b.floor(sb)
    print(f"[stall] floor {floor}", flush=True)
    res = {"info": info, "workload": workload, "floor": floor, "runs": [], "complete": False}
    counts: dict[str, int] = {}
    for m in args.methods:
        t0 = time.perf_counter()
        r = b.run(m)
        counts[m] = counts.get(m, 0) + 1
        if counts[m] > 1:
            r["method"] = f"{m}#{counts[m]}"
        r["wall_s"] = time.perf_counter() - t0
        res["runs"].append(r)
        analyse(res["runs"], args.every, args.steps)
        C.write_json(args.json, res, quiet=True)
        brief = {k: r.get(k) for k in ("stall_ms", "block_s", "steady_mean_ratio", "error", "skipped") if r.get(k) is not None}
        print(f"[stall] {r['method']}: {C.jsonable(brief)} ({r['wall_s']:.1f} s)", flush=True)
    C.clean_dir(args.dir)
    text = summarise(res)
    stats = ckd_stats_lines(res["runs"])
    print(text + ("\n" + stats if stats else ""), flush=True)
    res["table"] = text + ("\n" + stats if stats else "")
    res["drift_warning"] = drift_warning(res["runs"])
    res["interleaved"] = interleaved_summary(res["runs"])
    res["complete"] = True
    C.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
