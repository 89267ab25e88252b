"""Hand-built pickles inside real ``torch.save`` zips: only allowed globals, but BUILD opcodes that set
attributes of torch's own functions, or REDUCE calls of allowed callables with hostile arguments.

``torch.load(weights_only=True)`` refuses every one of them, so every loader must refuse them too,
leave the process as it was, and (signed by the attacker or not) never let them change a function's
``__defaults__``/``__kwdefaults__``/``__code__``/``__dict__``. A file whose checksum is wrong must not be
parsed at all.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd import CheckpointManager, CorruptCheckpointError, UnsafeCheckpointError

from . import craft
from .craft import (BAD, EMPTY_DICT, GOOD, MARK, NONE, POP, REDUCE, SETITEM, TUPLE, TUPLE1, op_global,
                    op_int, op_str)

REBUILD = ("torch._utils", "_rebuild_tensor_v2")
PARAM = ("torch._utils", "_rebuild_parameter")


def _build(target: tuple[str, str], attr: str, value: bytes, slotstate: bool = True) -> Callable[[bytes], bytes]:
    return lambda pkl: craft.inject_into_pickle(pkl, craft.build_pickle_prefix(target, attr, value, slotstate=slotstate))


def _reduce(target: tuple[str, str], args: bytes) -> Callable[[bytes], bytes]:
    return lambda pkl: craft.inject_into_pickle(pkl, op_global(*target) + MARK + args + TUPLE + REDUCE + POP)


def _storage_offset_out_of_bounds(pkl: bytes) -> bytes:
    """The weight's rebuild call with a storage offset far past its storage (an out-of-bounds view)."""
    pattern = re.compile(rb"Q(K\x00)K\x04K\x04\x86")  # BINPERSID, offset 0, size (4, 4)
    assert pattern.search(pkl), "unexpected pickle layout for Linear(4, 4)"
    return pattern.sub(lambda m: b"Q" + op_int(1 << 24) + b"K\x04K\x04\x86", pkl, count=1)


ATTACKS: dict[str, Callable[[bytes], bytes]] = {
    "build-defaults": _build(REBUILD, "__defaults__", op_str("pwned") + TUPLE1),
    "build-kwdefaults": _build(REBUILD, "__kwdefaults__", EMPTY_DICT + op_str("metadata") + op_int(1) + SETITEM),
    "build-code": _build(PARAM, "__code__", op_str("not code")),
    "build-dict": _build(PARAM, "pwned", op_int(1), slotstate=False),
    "build-ordereddict-defaults": _build(("collections", "OrderedDict"), "__init__", NONE),
    "reduce-ordereddict-int": _reduce(("collections", "OrderedDict"), op_int(5)),
    "reduce-size-str": _reduce(("torch", "Size"), op_str("x")),
    "reduce-rebuild-none-storage": _reduce(REBUILD, NONE + op_int(0) + op_int(4) + TUPLE1 + op_int(1) + TUPLE1
                                           + b"\x89" + op_global("collections", "OrderedDict") + b")" + REDUCE),
    "reduce-parameter-of-int": _reduce(PARAM, op_int(5) + b"\x89" + op_global("collections", "OrderedDict") + b")" + REDUCE),
    "offset-out-of-bounds": _storage_offset_out_of_bounds,
}


@pytest.fixture(params=[None, "zstd"], ids=["raw", "zstd"])
def compression(request: pytest.FixtureRequest) -> str | None:
    return request.param


@pytest.fixture
def guard() -> Iterator[Callable[[], None]]:
    with craft.process_guard() as check:
        yield check


def _attack(root: Path, compression: str | None, attack: str, checksum: bool) -> tuple[craft.Run, bytes]:
    """A root whose newest step's model file carries the attack; returns the run and a good model file."""
    run = craft.save_run(root, compression=compression)
    good = craft.native_bytes(run.step_dir(GOOD), craft.model_file(run.step_dir(GOOD)))
    d = run.step_dir(BAD)
    rel = craft.model_file(d)
    native = craft.native_bytes(d, rel)
    pkl = ATTACKS[attack](craft.zip_member(native, "data.pkl"))
    craft.forge_native(d, rel, craft.zip_replace(native, "data.pkl", pkl), checksum=checksum)
    return run, good


def _process_unchanged(run: craft.Run, good: bytes, check: Callable[[], None]) -> None:
    check()
    loaded = torch.load(io.BytesIO(good), weights_only=True)
    assert torch.equal(loaded["weight"], run.values[GOOD]["model.weight"])
    state = craft.new_state(seed=7)
    with CheckpointManager(str(run.root), state, compression=run.compression) as mgr:
        mgr.restore(GOOD)
    craft.assert_values(state, run.values[GOOD], run.progress[GOOD])
    check()


def test_crafted_pickles_are_refused_by_torch_weights_only(tmp_path: Path, guard: Callable[[], None]) -> None:
    """Sanity of the crafted files: torch's weights-only loader refuses every one."""
    run = craft.save_run(tmp_path / "root", steps=(GOOD,))
    d = run.step_dir(GOOD)
    native = craft.native_bytes(d, craft.model_file(d))
    for name, attack in ATTACKS.items():
        forged = craft.zip_replace(native, "data.pkl", attack(craft.zip_member(native, "data.pkl")))
        with pytest.raises(Exception) as info:
            torch.load(io.BytesIO(forged), weights_only=True)
        assert not isinstance(info.value, AssertionError), name
    guard()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_signed_hostile_pickle_is_refused_everywhere(root: Path, compression: str | None, attack: str,
                                                     guard: Callable[[], None]) -> None:
    run, good = _attack(root, compression, attack, checksum=True)
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        checkpointd.load(str(run.step_dir(BAD)))
    guard()
    code, out = craft.cli("verify", "--deep", run.step_dir(BAD))
    assert code != 0, out
    guard()
    craft.assert_restores(run, GOOD).close()
    _process_unchanged(run, good, guard)


@pytest.mark.parametrize("attack", ["build-defaults", "build-kwdefaults", "build-dict", "reduce-ordereddict-int"])
def test_hostile_pickle_with_wrong_checksum_is_never_parsed(root: Path, compression: str | None, attack: str,
                                                            guard: Callable[[], None]) -> None:
    run, good = _attack(root, compression, attack, checksum=False)
    with pytest.raises(CorruptCheckpointError):
        checkpointd.load(str(run.step_dir(BAD)))
    guard()
    craft.assert_restores(run, GOOD).close()
    guard()
    code, out = craft.cli("verify", run.step_dir(BAD))
    assert code != 0, out
    _process_unchanged(run, good, guard)


def test_hostile_training_state_file_is_refused(root: Path, compression: str | None, guard: Callable[[], None]) -> None:
    """The same BUILD attack in the training-state file (optimizer, progress, RNG)."""
    run = craft.save_run(root, compression=compression)
    d = run.step_dir(BAD)
    rel = craft.data_file(d)
    native = craft.native_bytes(d, rel)
    pkl = ATTACKS["build-defaults"](craft.zip_member(native, "data.pkl"))
    craft.forge_native(d, rel, craft.zip_replace(native, "data.pkl", pkl))
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        checkpointd.load(str(root))
    guard()
    craft.assert_restores(run, GOOD).close()
    guard()
