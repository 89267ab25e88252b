"""checkpointd.format.mdlus without PhysicsNeMo: format, duck typing, the tar format, corrupt and unsafe files."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd.errors import CorruptCheckpointError, StateError, UnsafeCheckpointError
from checkpointd.format.mdlus import (
    MEMBER_NAMES,
    is_physicsnemo_module,
    load_mdlus_state_dict,
    mdlus_json_members,
    open_mdlus_model_pt,
    read_mdlus_json,
    write_mdlus,
)
from checkpointd.format.serialize import plan_pt
from fake_physicsnemo import FakePNModule


class Encoder(FakePNModule):
    __model_checkpoint_version__ = "0.3.0"

    def __init__(self, *, act: torch.nn.Module, width: int = 4, clip: float = float("inf")) -> None:
        super().__init__()
        self.act = act
        self.lin = torch.nn.Linear(2, width)


class Act(FakePNModule):
    def __init__(self, *, slope: float = 0.1) -> None:
        super().__init__()


class Net(FakePNModule):
    def __init__(self, *, encoder: torch.nn.Module, channels: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        self.conv = torch.nn.Conv2d(channels, channels, 3)
        self.conv.to(memory_format=torch.channels_last)


class RecordingSink:
    """A write-only sink with a ``dtype_hint``, like a codec stream; records the hint of each write."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.dtype_hint: torch.dtype | None = None
        self.writes: list[tuple[torch.dtype | None, int]] = []

    def write(self, data: memoryview, /) -> int:
        self.writes.append((self.dtype_hint, memoryview(data).nbytes))
        return self.buffer.write(data)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net(encoder=Encoder(act=Act(slope=0.2), width=4), channels=2)


def write_to_bytes(module: torch.nn.Module) -> bytes:
    sink = RecordingSink()
    write_mdlus(sink, mdlus_json_members(module), plan_pt(module.state_dict()))
    return sink.buffer.getvalue()


def assert_same_state(got: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
        assert got[key].stride() == tensor.stride(), key


def test_round_trip_is_a_stored_zip_of_three_members() -> None:
    net = make_net()
    data = write_to_bytes(net)

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == sorted(MEMBER_NAMES)
        assert {info.compress_type for info in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.testzip() is None
    state = load_mdlus_state_dict(io.BytesIO(data))
    assert_same_state(state, net.state_dict())
    assert state["conv.weight"].is_contiguous(memory_format=torch.channels_last)


def test_model_pt_loads_with_plain_torch_load() -> None:
    net = make_net()
    with zipfile.ZipFile(io.BytesIO(write_to_bytes(net))) as zf:
        state = torch.load(io.BytesIO(zf.read("model.pt")), weights_only=True)
    assert_same_state(state, net.state_dict())


def test_write_streams_without_seeking_and_forwards_dtype_hint() -> None:
    net = make_net()
    plan = plan_pt(net.state_dict())
    dtypes = {key: torch.float32 for key, _ in plan.storages}
    sink = RecordingSink()  # no seek/tell: zipfile must stream with data descriptors

    write_mdlus(sink, mdlus_json_members(net), plan, dtypes)

    hinted_bytes = sum(nbytes for hint, nbytes in sink.writes if hint is torch.float32)
    assert hinted_bytes == plan.data_nbytes  # exactly the tensor bytes pass with the hint
    assert sink.writes[0][0] is None and sink.writes[-1][0] is None
    assert sink.dtype_hint is None
    assert_same_state(load_mdlus_state_dict(sink.buffer.getvalue()), net.state_dict())


def test_write_to_sink_without_dtype_hint() -> None:
    class PlainSink:
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        def write(self, data: memoryview, /) -> int:
            self.chunks.append(bytes(data))
            return len(data)

    net = make_net()
    sink = PlainSink()
    write_mdlus(sink, mdlus_json_members(net), plan_pt(net.state_dict()), {"0": torch.float32})
    assert not hasattr(sink, "dtype_hint")
    assert_same_state(load_mdlus_state_dict(b"".join(sink.chunks)), net.state_dict())


def test_large_model_pt_gets_zip64_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1024)  # stands in for the 2 GiB limit
    net = make_net()
    data = write_to_bytes(net)

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.getinfo("model.pt").file_size > 1024
        assert zf.testzip() is None
    assert_same_state(load_mdlus_state_dict(data), net.state_dict())


def test_json_members_for_nested_modules() -> None:
    members = mdlus_json_members(make_net())

    assert set(members) == {"args.json", "metadata.json"}
    args_text = members["args.json"].decode()
    assert json.loads(args_text) == {
        "__name__": "Net",
        "__module__": __name__,
        "__args__": {"encoder": "__physicsnemo.Module__.encoder", "channels": 2},
        "__physicsnemo.Module__.encoder": {
            "__name__": "Encoder",
            "__module__": __name__,
            "__args__": {"act": "__physicsnemo.Module__.encoder.act", "width": 4},
        },
        "__physicsnemo.Module__.encoder.act": {"__name__": "Act", "__module__": __name__, "__args__": {"slope": 0.2}},
    }
    metadata = json.loads(members["metadata.json"])
    assert list(metadata) == [
        "physicsnemo_version",
        "mdlus_file_version",
        "__physicsnemo.Module__.encoder.mdlus_file_version",
        "__physicsnemo.Module__.encoder.act.mdlus_file_version",
    ]
    assert metadata["mdlus_file_version"] == "0.1.0"
    assert metadata["__physicsnemo.Module__.encoder.mdlus_file_version"] == "0.3.0"
    assert isinstance(metadata["physicsnemo_version"], str) and metadata["physicsnemo_version"]


def test_json_members_keep_infinity_and_leave_module_args_alone() -> None:
    encoder = Encoder(act=Act(), clip=float("inf"))
    before = dict(encoder._args["__args__"])

    members = mdlus_json_members(encoder)

    assert b'"clip": Infinity' in members["args.json"]
    assert encoder._args["__args__"] == before  # the live module's _args are not rewritten


def test_duck_typing_recognises_wrapped_modules_only() -> None:
    net = make_net()
    assert is_physicsnemo_module(net)
    assert is_physicsnemo_module(torch.nn.DataParallel(net))
    compiled = torch.compile(net)  # never called, so nothing is compiled
    assert is_physicsnemo_module(compiled)
    assert mdlus_json_members(compiled) == mdlus_json_members(net)
    assert not is_physicsnemo_module(torch.nn.Linear(2, 2))
    assert not is_physicsnemo_module(object())


def test_json_members_reject_plain_torch_module_argument() -> None:
    wrapper = Net(encoder=torch.nn.Linear(2, 2))
    with pytest.raises(StateError, match="plain torch.nn.Module"):
        mdlus_json_members(wrapper)


def test_json_members_reject_non_json_argument() -> None:
    act = Act(slope=torch.float32)
    with pytest.raises(StateError, match="JSON-serializable"):
        mdlus_json_members(act)


def test_reads_the_tar_format(tmp_path: Path) -> None:
    net = make_net()
    members = mdlus_json_members(net)
    members["model.pt"] = _torch_save_bytes(net.state_dict())
    path = tmp_path / "tarred.mdlus"
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    with open(path, "rb") as f:
        assert_same_state(load_mdlus_state_dict(f), net.state_dict())
        args, metadata = read_mdlus_json(f)
    assert args["__name__"] == "Net"
    assert metadata["mdlus_file_version"] == "0.1.0"


def test_reads_zip_with_deflated_members() -> None:
    net = make_net()
    members = {**mdlus_json_members(net), "model.pt": _torch_save_bytes(net.state_dict())}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)

    assert_same_state(load_mdlus_state_dict(buffer.getvalue()), net.state_dict())
    assert open_mdlus_model_pt(buffer).seekable()


@pytest.mark.parametrize(
    "data",
    [b"", b"not an archive at all" * 100, b"PK\x03\x04" + b"\x00" * 200],
    ids=["empty", "garbage", "bad-zip"],
)
def test_corrupt_file_raises_corrupt_checkpoint_error(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="not a valid .mdlus file"):
        load_mdlus_state_dict(io.BytesIO(data))
    with pytest.raises(CorruptCheckpointError):
        read_mdlus_json(io.BytesIO(data))


def test_truncated_file_raises_corrupt_checkpoint_error() -> None:
    data = write_to_bytes(make_net())
    with pytest.raises(CorruptCheckpointError):
        load_mdlus_state_dict(io.BytesIO(data[: len(data) // 2]))


def test_zip_without_model_pt_raises_corrupt_checkpoint_error() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in mdlus_json_members(make_net()).items():
            zf.writestr(name, data)
    with pytest.raises(CorruptCheckpointError, match="'model.pt'"):
        open_mdlus_model_pt(buffer)


def test_corrupt_model_pt_raises_corrupt_checkpoint_error() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("model.pt", b"\x00" * 64)
    with pytest.raises(CorruptCheckpointError, match="not a valid torch.save file"):
        load_mdlus_state_dict(buffer)


def _reduce_payload(command: str, protocol: int) -> bytes:
    return pickle.dumps(_RunsCode(command), protocol=protocol)


def _inst_payload(command: str, protocol: int) -> bytes:
    return f"(S'{command}'\nios\nsystem\n.".encode()  # protocol 0 INST: no GLOBAL opcode at all


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    ("make_payload", "protocol"),
    [(_reduce_payload, 2), (_reduce_payload, 4), (_inst_payload, 0)],
    ids=["global-reduce", "stack-global", "inst"],
)
def test_code_running_pickle_is_refused_and_runs_nothing(tmp_path: Path, make_payload: Any, protocol: int) -> None:
    marker = tmp_path / "pwned"
    model_pt = _torch_save_bytes({"w": torch.zeros(2)}, pickle_bytes=make_payload(f"touch {marker}", protocol))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in mdlus_json_members(make_net()).items():
            zf.writestr(name, data)
        zf.writestr("model.pt", model_pt)

    with pytest.raises(UnsafeCheckpointError, match=r"references (os|posix)\.system.*before anything ran"):
        load_mdlus_state_dict(buffer)

    assert not marker.exists()


class _RunsCode:
    """Pickles as ``os.system(command)``: what an attacker would put into a checkpoint."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (self.command,))


def _torch_save_bytes(obj: Any, pickle_bytes: bytes | None = None) -> bytes:
    """``torch.save`` of ``obj``; with ``pickle_bytes``, its ``data.pkl`` replaced by them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    if pickle_bytes is None:
        return buffer.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = pickle_bytes if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()
