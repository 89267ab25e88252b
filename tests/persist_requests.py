"""Record the requests this process sends to the (started) persist process, for tests."""

from __future__ import annotations

from typing import Any

from checkpointd.storage import persist_process


def record_requests(monkeypatch: Any, *kinds: str) -> list[tuple]:
    """Every request of one of ``kinds`` (``"write"``, ``"attach"``, ``"put"``, ...) sent from now on;
    starts the persist process if it is not running."""
    process = persist_process.client()
    assert process is not None and process.alive
    requests: list[tuple] = []
    real_send = process._send

    def send(message: tuple, fds: list[int] | None = None) -> None:
        if message[0] in kinds:
            requests.append(message)
        real_send(message, fds)

    monkeypatch.setattr(process, "_send", send)
    return requests
