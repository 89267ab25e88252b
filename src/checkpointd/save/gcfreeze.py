"""Keep Python's full garbage collections short while a manager is alive (``gc.freeze``).

Why: a save creates tens of thousands of small objects (pickle records, zip pieces, futures) that
live for the seconds the files take to write. The collector promotes them to its oldest generation,
and once enough have accumulated it runs a *full* collection, which walks every tracked object of
the process: with torch imported that is ~270,000 objects and 60-180 ms, holding the GIL, so the
training thread stops for that long. Measured on an H200 host (16 cores), one such collection landed
on the step after every second or third checkpoint and cost that step +83-150 ms, more than the rest
of checkpointd's stall together.

``gc.freeze()`` moves every object alive at that moment (modules, the model, the optimizer, torch's
own tables) into the permanent generation, which collections skip; later full collections walk only
newer objects and take a few milliseconds. It is process-wide, so it is reference-counted across
managers and undone (``gc.unfreeze()``) when the last manager closes, after which frozen objects are
collectable again. A full ``gc.collect()`` runs first, so garbage that exists at construction is freed
rather than frozen. Nothing happens when the collector is disabled (the application manages it) or
when ``freeze_gc=False`` is passed to the manager.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

logger = logging.getLogger("checkpointd")

_lock = threading.Lock()
_holders = 0
_frozen_by_us = False


def acquire() -> None:
    """A manager starts: collect and freeze the heap if no other manager has done so."""
    global _holders, _frozen_by_us
    with _lock:
        _holders += 1
        if _holders > 1 or not gc.isenabled():
            return
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        _frozen_by_us = True
        logger.debug("checkpointd: gc.freeze() of %d objects after a %.0f ms collection",
                     gc.get_freeze_count(), 1e3 * (time.perf_counter() - t0))


def release() -> None:
    """A manager closes: the last one unfreezes the heap (the frozen objects become collectable)."""
    global _holders, _frozen_by_us
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _frozen_by_us:
            gc.unfreeze()
            _frozen_by_us = False


def holders() -> int:
    return _holders
