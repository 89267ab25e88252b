"""``checkpointd.load`` of a DCP directory (``.metadata`` + ``*.distcp``): what ``dcp.save`` wrote comes back
bit for bit, and crafted directories are refused before anything in them runs or is read out of bounds."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpointd
from checkpointd import CorruptCheckpointError, ManifestError, UnsafeCheckpointError
from checkpointd.format import dcp as dcp_format


def _save(state: dict[str, Any], path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3, 2))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2, 3, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "extra": {"bf16": torch.randn(4, dtype=torch.bfloat16), "scalar": torch.tensor(7, dtype=torch.int64),
                      "empty": torch.zeros(0, 3), "pairs": [(1, "a"), (2, "b")], "none": None,
                      "nested": [{"t": torch.arange(3)}, {"t": torch.arange(2)}]}}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = _state()
    return _save(state, tmp_path / "dcp"), state


def _rewrite_metadata(path: Path, change: Any) -> None:
    """Unpickle a .metadata this test wrote (trusted), change it, write it back."""
    md = pickle.loads((path / ".metadata").read_bytes())
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _set_paths(path: Path, rel: str) -> None:
    def change(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = rel
    _rewrite_metadata(path, change)


def test_reads_what_dcp_save_wrote(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    got = checkpointd.load(str(path))
    assert sorted(got) == ["extra", "model", "optimizer"]
    assert sorted(got["model"]) == sorted(want["model"])
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t) and got["model"][k].device.type == "cpu", k
    # DCP flattens dict keys to strings: the optimizer's integer parameter ids come back as "0", "1", ...
    assert sorted(got["optimizer"]["state"]) == ["0", "1", "2", "3"]
    for i, st in want["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(got["optimizer"]["state"][str(i)][key], t), (i, key)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    extra = got["extra"]
    assert extra["bf16"].dtype == torch.bfloat16 and torch.equal(extra["bf16"], want["extra"]["bf16"])
    assert torch.equal(extra["scalar"], want["extra"]["scalar"]) and extra["scalar"].shape == ()
    assert extra["empty"].shape == (0, 3)
    assert extra["pairs"] == [(1, "a"), (2, "b")] and extra["none"] is None
    assert [torch.equal(a["t"], b["t"]) for a, b in zip(extra["nested"], want["extra"]["nested"])] == [True, True]


def test_metadata_naming_code_is_refused_and_nothing_runs(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = saved
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    def plant(md: Any) -> None:  # deep inside an otherwise real Metadata
        md.planner_data["model.0.weight"] = Evil()

    _rewrite_metadata(path, plant)
    with pytest.raises(UnsafeCheckpointError, match=r"references (posix|os)\.system.*it was not run"):
        checkpointd.load(str(path))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))  # the whole file
    with pytest.raises(UnsafeCheckpointError, match="system"):
        checkpointd.load(str(path))
    (path / ".metadata").write_bytes(pickle.dumps(getattr))  # any global outside the allow-list
    with pytest.raises(UnsafeCheckpointError, match="builtins.getattr"):
        checkpointd.load(str(path))
    assert not marker.exists()


def test_pickle_state_on_a_class_is_refused(saved: tuple[Path, dict[str, Any]]) -> None:
    """BUILD with slot state on an allowed class would set a class attribute: refused, the class unchanged."""
    path, _ = saved
    data = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"  # GLOBAL: the (stand-in) class
            b"N}X\x01\x00\x00\x00xK\x01s\x86b.")  # (None, {"x": 1}), BUILD, STOP
    (path / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="pickle state applied to a type"):
        checkpointd.load(str(path))
    stand_in = dcp_format.ALLOWED_GLOBALS[("torch.distributed.checkpoint.metadata", "Metadata")]
    assert not hasattr(stand_in, "x")


@pytest.mark.parametrize("rel", ["../outside.distcp", "/tmp/outside.distcp", "sub/../../outside.distcp", ".metadata",
                                 "a\\..\\..\\outside.distcp"])
def test_data_paths_outside_the_directory_are_refused(saved: tuple[Path, dict[str, Any]], rel: str) -> None:
    path, _ = saved
    (path.parent / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())  # readable, were it followed
    _set_paths(path, rel)
    with pytest.raises(ManifestError, match="not inside the directory"):
        checkpointd.load(str(path))


def test_a_linked_data_file_is_refused(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    outside = path.parent / "outside.distcp"
    (path / "__0_0.distcp").rename(outside)
    (path / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="link"):
        checkpointd.load(str(path))


def test_truncated_data_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp has .* bytes, but item .* ends at byte .*truncated"):
        checkpointd.load(str(path))
    (path / "__0_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match="named by .metadata but missing"):
        checkpointd.load(str(path))


def test_damaged_item_and_overlapping_items(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    good = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(b"\0" * len(good))  # right size, no torch.save blobs
    with pytest.raises(CorruptCheckpointError, match="is not a readable torch.save blob"):
        checkpointd.load(str(path))
    (path / "__0_0.distcp").write_bytes(good)

    def overlap(md: Any) -> None:
        for info in md.storage_data.values():
            info.offset = 0
    _rewrite_metadata(path, overlap)
    with pytest.raises(CorruptCheckpointError, match="overlaps the item before it"):
        checkpointd.load(str(path))


def test_chunks_must_cover_their_tensor(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved

    def grow(md: Any) -> None:  # a huge declared size that the file's bytes do not back
        md.state_dict_metadata["model.0.weight"].size = torch.Size([10**6, 2, 3, 3])
    _rewrite_metadata(path, grow)
    with pytest.raises(ManifestError, match="do not cover its size"):
        checkpointd.load(str(path))


def test_stream_transforms_are_refused(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved

    def transform(md: Any) -> None:
        next(iter(md.storage_data.values())).transform_descriptors = ["stream.zstd"]
    _rewrite_metadata(path, transform)
    with pytest.raises(ManifestError, match="stream transforms.*load this checkpoint with torch.distributed.checkpoint"):
        checkpointd.load(str(path))


def test_an_item_naming_code_is_refused(tmp_path: Path) -> None:
    """A non-tensor item is a torch.save blob: loaded with weights_only=True (DCP itself uses False)."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    path = _save({"w": torch.ones(2), "x": Evil()}, tmp_path / "dcp")
    with pytest.raises(UnsafeCheckpointError, match="item 'x'.*weights-only"):
        checkpointd.load(str(path))
    assert not marker.exists()


def test_not_a_metadata_pickle(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ManifestError, match="holds a dict, not DCP Metadata"):
        checkpointd.load(str(path))
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ManifestError, match="not a readable DCP metadata pickle"):
        checkpointd.load(str(path))


def test_a_folder_of_step_directories(tmp_path: Path) -> None:
    """TorchTitan's layout: step-N DCP directories; the newest, or the one asked for."""
    for step in (5, 10):
        _save({"train_state": {"step": step}}, tmp_path / f"step-{step}")
    assert checkpointd.load(str(tmp_path))["train_state"] == {"step": 10}
    assert checkpointd.load(str(tmp_path), step=5)["train_state"] == {"step": 5}
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="no DCP directory step-7"):
        checkpointd.load(str(tmp_path), step=7)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match=r"is one DCP checkpoint \(step 5\), not step 10"):
        checkpointd.load(str(tmp_path / "step-5"), step=10)
