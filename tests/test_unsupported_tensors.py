"""Tensors the snapshot cannot store as plain bytes (nested, quantized, sparse) are refused by ``maybe_save``.

Each kind, in each place state can hold a tensor (a tensor entry, a module buffer or parameter seen
through its state_dict, an optimizer's state, plain data), raises ``StateError`` from ``maybe_save``
itself, naming the entry and key path and what to do, and nothing is written.

Traceable wrapper subclasses (``__tensor_flatten__``/``__tensor_unflatten__``: torchao's quantized
tensors, see ``tests/subclasses``) are accepted when their class is; still refused: nested tensors
(jagged ones are traceable subclasses too), PyTorch's built-in quantized tensors, sparse and meta
tensors, a subclass without ``__tensor_flatten__``, a class not accepted, and an accepted class whose
attributes hold something a weights-only loader cannot read or whose inner tensor is itself refused."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import checkpointd
from checkpointd import CheckpointManager, StateError
from checkpointd.format import subclasses
from checkpointd.state import validate_tree
from tests.subclasses.pair_tensor import PairTensor

pytestmark = pytest.mark.filterwarnings(  # torch warns that these kinds of tensor are deprecated or in beta
    "ignore:.*quantized tensor creation functions.*:UserWarning", "ignore:Sparse CSR tensor support:UserWarning")


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype nested-tensor API warns on every construction
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _jagged() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.linspace(-1, 1, 6), 0.1, 3, torch.quint8)


def _quantized_per_channel() -> torch.Tensor:
    return torch.quantize_per_channel(torch.randn(3, 2), torch.tensor([0.1, 0.2, 0.3]), torch.zeros(3, dtype=torch.long),
                                      0, torch.qint8)


KINDS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "nested": (_nested, r"is a nested tensor \(layout torch.strided\).*register plain dense tensors"),
    "nested-jagged": (_jagged, r"is a nested tensor \(layout torch.jagged\).*register plain dense tensors"),
    "quantized": (_quantized, r"is a quantized tensor \(torch.quint8, torch.per_tensor_affine\).*dequantize.*"
                              r"int_repr\(\) and q_scale\(\)/q_zero_point\(\)"),
    "quantized-per-channel": (_quantized_per_channel, r"is a quantized tensor \(torch.qint8, torch.per_channel_affine\)"
                                                      r".*q_per_channel_scales\(\)"),
    "sparse-coo": (lambda: torch.eye(3).to_sparse(), r"is a sparse tensor \(layout torch.sparse_coo\).*to_dense\(\)"),
    "sparse-csr": (lambda: torch.eye(3).to_sparse_csr(), r"is a sparse tensor \(layout torch.sparse_csr\).*to_dense\(\)"),
}


def _place(where: str, bad: torch.Tensor) -> tuple[dict[str, Any], str]:
    """A state holding ``bad`` at ``where``, and the key path the error must name (as a regex)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state: dict[str, Any] = {"model": model, "opt": opt, "data": {"epoch": 1}}
    if where == "tensor entry":
        state["table"] = bad
        return state, r"^state\['table'\] "
    if where == "module buffer":
        model[0].register_buffer("codes", bad)
        return state, r"^state\['model'\]\['0.codes'\] "
    if where == "module parameter":
        model[0].extra = torch.nn.Parameter(bad, requires_grad=False)
        return state, r"^state\['model'\]\['0.extra'\] "
    if where == "optimizer state":
        opt.state[model[0].weight]["momentum_buffer"] = bad
        return state, r"^state\['opt'\]\['state'\]\[0\]\['momentum_buffer'\] "
    assert where == "plain data"
    state["data"]["tables"] = [torch.zeros(2), {"t": bad}]
    return state, r"^state\['data'\]\['tables'\]\[1\]\['t'\] "


PLACES = ["tensor entry", "module buffer", "module parameter", "optimizer state", "plain data"]


def _written(root: Path) -> list[str]:
    """Every file of every step directory under ``root`` (the root's own bookkeeping files aside)."""
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if os.path.relpath(d, root).startswith("step-"))


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_maybe_save_refuses_and_writes_nothing(tmp_path: Path, kind: str, where: str) -> None:
    make, what = KINDS[kind]
    state, key = _place(where, make())
    root = tmp_path / "ckpt"
    with CheckpointManager(root, state) as mgr:
        with pytest.raises(StateError, match=key + what):
            mgr.maybe_save(1, force=True)
        assert mgr.steps() == []
    assert _written(root) == []


def test_refused_after_a_good_save_leaves_the_root_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    root = tmp_path / "ckpt"
    with CheckpointManager(root, {"model": model}, keep_last=None) as mgr:
        mgr.save(1)
        mgr.wait()
        before = _written(root)
        model.register_buffer("q", _quantized())
        with pytest.raises(StateError, match=r"state\['model'\]\['q'\] is a quantized tensor"):
            mgr.maybe_save(2, force=True)
        assert _written(root) == before and mgr.steps() == [1]
        del model.q
        mgr.save(2)  # the same manager saves again once the state is plain
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_a_quantized_module_is_refused_naming_its_packed_weight(tmp_path: Path) -> None:
    qlinear = torch.ao.nn.quantized.Linear(4, 3)
    with CheckpointManager(tmp_path / "ckpt", {"qmodel": qlinear}) as mgr:
        with pytest.raises(StateError, match=r"state\['qmodel'\]\['_packed_params._packed_params'\]\[0\] "
                                             r"is a quantized tensor \(torch.qint8"):
            mgr.maybe_save(1, force=True)
    assert _written(tmp_path / "ckpt") == []


def test_dense_tensors_of_the_same_values_are_accepted() -> None:
    """What the messages suggest is accepted: dense, dequantized, int_repr, unbound and padded tensors."""
    q, n = _quantized(), _nested()
    validate_tree({"deq": q.dequantize(), "codes": q.int_repr(), "scale": q.q_scale(), "zp": q.q_zero_point(),
                   "parts": list(n.unbind()), "padded": torch.nested.to_padded_tensor(n, 0.0),
                   "dense": torch.eye(3).to_sparse().to_dense()}, "state['d']")


class _Tagged(torch.Tensor):
    """A subclass made with ``as_subclass``: no ``__tensor_flatten__``, so no inner tensors to store."""


@pytest.mark.parametrize("case", ["not traceable", "not accepted", "unsafe attribute", "meta inner"])
def test_subclasses_that_cannot_be_stored_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    bad: torch.Tensor
    if case == "not traceable":
        bad = torch.ones(3).as_subclass(_Tagged)
        what = r"is a tensor subclass .*_Tagged that does not implement __tensor_flatten__/__tensor_unflatten__"
    elif case == "not accepted":
        bad = PairTensor(torch.ones(3), torch.zeros(3))
        what = (r"is a tensor subclass tests.subclasses.pair_tensor.PairTensor, which checkpointd does not accept; if "
                r"you trust its code, call checkpointd.allow_tensor_subclasses\(PairTensor\)")
    else:
        monkeypatch.setattr(subclasses, "ALLOWED", dict(subclasses.ALLOWED))
        checkpointd.allow_tensor_subclasses(PairTensor)
        if case == "unsafe attribute":
            bad = PairTensor(torch.ones(3), torch.zeros(3), tag=object())  # type: ignore[arg-type]
            what = (r"is a tensor subclass tests.subclasses.pair_tensor.PairTensor whose attribute 'tag' holds a "
                    r"builtins.object, which a weights-only loader cannot read")
        else:
            bad = PairTensor(torch.ones(3), torch.empty(3, device="meta"))
            what = r"\(PairTensor\) has an inner tensor 'b' that is a meta tensor"
    state, key = _place("module buffer", bad)
    root = tmp_path / "ckpt"
    with CheckpointManager(root, state) as mgr:
        with pytest.raises(StateError, match=key + what):
            mgr.maybe_save(1, force=True)
    assert _written(root) == []
