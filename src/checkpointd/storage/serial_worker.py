"""One background thread that handles queued items strictly in order (the committer, the uploader).

Why a base class: both the background writer (one save at a time, so commits happen in step order)
and the two-tier uploader (one step at a time) need the same queue, condition variable, shutdown
flag and loop; subclasses say only what handling an item means.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class SerialWorker:
    """Subclasses implement :meth:`_handle`; :meth:`_took` runs under the lock when an item is taken.

    ``_cv`` guards ``_queue`` and ``_closed`` and any state a subclass keeps beside them; the loop
    ends once closed and drained.
    """

    def __init__(self, thread_name: str) -> None:
        self._cv = threading.Condition()
        self._queue: deque[Any] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _stop(self) -> None:
        """Let the queued items finish, then end the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._took(item)
            self._handle(item)

    def _took(self, item: Any) -> None:
        """Called with ``_cv`` held as ``item`` leaves the queue."""

    def _handle(self, item: Any) -> None:
        raise NotImplementedError
