from __future__ import annotations

import gc
import json
import threading
from typing import Any

import pytest
import torch

from trainer_client import StateError
from trainer_client.razor import Layout, layout_of
from trainer_client.state_codec import decode, encode


def _round_trip(state: object, private: frozenset[str] = frozenset()) -> object:
    enc = encode(state, private)
    header = json.loads(json.dumps(enc.header()))  # what crosses the process boundary
    return decode(header, [s.clone() for s in enc.sources])


def test_the_tree_travels_as_text_and_older_headers_still_decode() -> None:
    """A commit carries the tree as JSON text (no daemon parses it); shards saved before, and
    their durable copies, hold it as a JSON value under ``tree`` — both restore alike."""
    state = {"w": torch.arange(6.0).view(2, 3), "loop": {"lr": 0.1, "n": [1, 2]}}
    enc = encode(state)
    header = enc.header()
    assert isinstance(header["tree_json"], str) and "tree" not in header
    older = {**{k: v for k, v in header.items() if k != "tree_json"}, "tree": json.loads(header["tree_json"])}
    for h in (header, older):
        out = decode(json.loads(json.dumps(h)), [s.clone() for s in enc.sources])
        assert torch.equal(out["w"], state["w"]) and out["loop"] == state["loop"]


def test_keys_of_str_subclasses_save_as_their_string() -> None:
    """A StrEnum (or numpy.str_) key is a str: it saves as ``str(k)`` and restores as that string."""
    import enum

    class Part(enum.StrEnum):
        MODEL = "model"

    out = _round_trip({Part.MODEL: {"w": torch.ones(2)}, 3: "three"})
    assert isinstance(out, dict) and set(out) == {"model", 3} and torch.equal(out["model"]["w"], torch.ones(2))


def test_every_common_dtype_and_json_leaves() -> None:
    state = {
        "t": {
            str(d): (torch.arange(7) % 2).to(d)
            for d in (
                torch.bfloat16,
                torch.float16,
                torch.float32,
                torch.float64,
                torch.int64,
                torch.int32,
                torch.int8,
                torch.uint8,
                torch.bool,
            )
        },
        "loop": {"step": 12, "lr": 3e-4, "name": "run", "flags": [True, None], "inf": float("inf"), "pair": (1, 2)},
        3: "int key",
    }
    out = _round_trip(state)
    assert isinstance(out, dict)
    for k, v in state["t"].items():
        assert out["t"][k].dtype == v.dtype and torch.equal(out["t"][k], v)
    assert out["loop"] == state["loop"] and out[3] == "int key"


def test_non_contiguous_and_shared_storage_survive() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tied = torch.nn.Parameter(torch.randn(5, 3))
    state = {"t": base.t(), "slice": base[1:3, ::2], "whole": base, "a": tied, "b": tied}
    enc = encode(state)
    assert len(enc.storages) == 2  # base once, tied once
    out = _round_trip(state)
    assert out["t"].stride() == (1, 6) and torch.equal(out["t"], base.t())
    assert torch.equal(out["slice"], base[1:3, ::2])
    assert out["a"].data_ptr() == out["b"].data_ptr()
    out["whole"][0, 0] = 100.0
    assert out["t"][0, 0] == 100.0  # views still share after restore


def test_private_keys_go_to_the_private_stream() -> None:
    enc = encode({"model": torch.ones(10), "optim": {"m": torch.ones(20)}}, frozenset({"optim"}))
    streams = {s.stream: s.nbytes for s in enc.storages}
    assert streams == {"replicated": 40, "private": 80}


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ({"model": {"layer": object()}}, r"state\['model'\]\['layer'\] is a builtins.object"),
        ({"opt": [1, {2.5: 1}]}, r"state\['opt'\]\[1\]\[2\.5\] is a float; keys must be str or int"),
        ({"s": torch.ones(2).to_sparse()}, r"state\['s'\] is a torch.sparse_coo tensor"),
    ],
)
def test_unsupported_leaves_are_refused_by_key(state: object, needle: str) -> None:
    with pytest.raises(StateError, match=needle):
        encode(state)


def test_restore_into_copies_into_existing_tensors() -> None:
    src = {"w": torch.randn(3, 3), "n": 1}
    enc = encode(src)
    target = {"w": torch.zeros(3, 3), "n": 0}
    ptr = target["w"].data_ptr()
    out = decode(json.loads(json.dumps(enc.header())), [s.clone() for s in enc.sources], into=target)
    assert out is target and target["w"].data_ptr() == ptr and torch.equal(target["w"], src["w"]) and target["n"] == 1
    with pytest.raises(StateError, match=r"into\['w'\]: expected a torch.float32 tensor of shape \(3, 3\)"):
        decode(enc.header(), enc.sources, into={"w": torch.zeros(2)})


def test_encode_reuses_the_previous_views_only_of_storages_still_in_the_state() -> None:
    kept, replaced = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    first = encode({"kept": kept, "replaced": replaced})
    fresh = torch.full((64,), 7.0)  # same size: it could only share an address if the old one were freed
    second = encode({"kept": kept, "replaced": fresh}, previous=first)
    assert second.sources[0] is first.sources[0]  # the same storage: its view is reused
    assert second.sources[1] is not first.sources[1]
    out = decode(json.loads(json.dumps(second.header())), [s.clone() for s in second.sources])
    assert torch.equal(out["kept"], kept) and torch.equal(out["replaced"], fresh)


def test_encode_reuses_the_previous_header_entries_only_where_they_are_still_true() -> None:
    """What did not change is the previous save's object again (a save leaves few objects for
    the collector); what changed is new — and the header says what a fresh encode's says."""
    a, b, c = torch.arange(12.0).reshape(3, 4), torch.zeros(6), torch.ones(5)
    first = encode({"a": a, "b": b, "c": c, "n": 1})
    state = {"a": a, "b": b.view(2, 3), "c": torch.ones(5), "n": 2}  # b reshaped; c another storage
    second = encode(state, previous=first)
    assert second.tensors[0] is first.tensors[0] and second.storages[0] is first.storages[0]
    assert second.tensors[1] is not first.tensors[1] and second.storages[1] is first.storages[1]
    assert second.sources[2] is not first.sources[2]  # its own view; its entries equal the old ones in value
    assert second.generation != first.generation  # a copy list made for the first would copy the old c
    third = encode(state, previous=second)
    assert third.generation == second.generation and third.storage_dicts is second.storage_dicts
    assert json.loads(json.dumps(second.header())) == json.loads(json.dumps(encode(state).header()))
    assert second.tree["a"] is first.tree["a"]  # the tensor markers are shared (never mutated)
    out = decode(json.loads(json.dumps(second.header())), [s.clone() for s in second.sources])
    assert torch.equal(out["b"], b.view(2, 3)) and torch.equal(out["c"], state["c"]) and out["n"] == 2


@pytest.fixture
def mesh(tmp_path):  # type: ignore[no-untyped-def]
    """A one-rank gloo group and its device mesh, torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_saved_as_its_local_part_and_comes_back_only_onto_a_mesh(mesh) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = DTensor.from_local(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
    replicated = DTensor.from_local(torch.ones(5), mesh, [Replicate()])
    enc = encode({"w": sharded, "b": replicated, "step": torch.tensor(3)})
    assert [s.stream for s in enc.storages] == ["private", "replicated", "replicated"]  # sharded: this rank's own
    header = json.loads(json.dumps(enc.header()))
    storages = [src.clone() for src in enc.sources]
    with pytest.raises(StateError, match=r"state\['w'\] was saved as a DTensor .* restore\(mesh="):
        decode(header, storages)
    with pytest.raises(StateError, match=r"into\['w'\] is a Tensor"):
        decode(header, storages, into={"w": torch.zeros(3, 4), "b": torch.zeros(5), "step": torch.tensor(0)})
    back = decode(header, storages, mesh=mesh)
    assert isinstance(back["w"], DTensor) and back["w"].placements == (Shard(0),) and torch.equal(back["w"].to_local(), sharded.to_local())
    into = {
        "w": DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)]),
        "b": DTensor.from_local(torch.zeros(5), mesh, [Replicate()]),
        "step": torch.tensor(0),
    }
    decode(header, storages, into=into)
    assert torch.equal(into["w"].to_local(), sharded.to_local()) and torch.equal(into["b"].to_local(), torch.ones(5))
    wrong = {**into, "w": DTensor.from_local(torch.zeros(3, 4), mesh, [Replicate()])}
    with pytest.raises(StateError, match="resharding load"):
        decode(header, storages, into=wrong)


def test_a_dtensor_parameter_saves_the_same_header_with_grad_mode_on_or_off(mesh) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import DTensor, Shard

    # FSDP2's parameters are nn.Parameter(DTensor); the encoder reads their local parts without
    # autograd, and the header still says the parameter requires grad
    weight = torch.nn.Parameter(DTensor.from_local(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)]))
    moment = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)])
    state = {"w": weight, "exp_avg": moment, "again": moment}
    grad_on = encode(state).header()
    with torch.no_grad():
        grad_off = encode(state).header()
    assert grad_on == grad_off
    assert [t["requires_grad"] for t in grad_on["tensors"]] == [True, False, False]
    assert [t["dtensor"]["placements"] for t in grad_on["tensors"]] == [[["shard", 0]]] * 3


def test_encoding_a_large_state_sets_off_no_garbage_collection_and_leaves_the_collector_as_it_was() -> None:
    state = {f"t{i}": torch.zeros(1) for i in range(5000)}
    collections: list[int] = []
    this_thread = threading.get_ident()

    def count(phase: str, info: dict[str, Any]) -> None:
        # only this thread's: a collection another thread of the test process runs is not encode's
        if phase == "start" and threading.get_ident() == this_thread:
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        encode(state)
        # walked with the collector on, 5,000 tensors' containers set off dozens of collections
        assert len(collections) <= 1, collections
        assert gc.isenabled()
        with pytest.raises(StateError):
            encode({**state, "bad": object()})
        assert gc.isenabled()  # on again after a refused state too
        gc.disable()
        try:
            encode(state)
            assert not gc.isenabled()  # a caller's own choice stands
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(count)


class _Counter:
    """A Stateful leaf of the user's own: state_dict() / load_state_dict()."""

    def __init__(self) -> None:
        self.seen, self.history = 0, torch.zeros(3)

    def state_dict(self) -> dict[str, object]:
        return {"seen": self.seen, "history": self.history}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.seen, self.history = state["seen"], state["history"]  # keeps the tensor it is given


def test_stateful_leaves_are_saved_by_state_dict_and_loaded_into_the_callers_objects() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    counter = _Counter()
    for _ in range(3):
        opt.step()
        sched.step()
    scaler.scale(torch.ones(1))  # the scale tensor exists from the first scaled loss on
    scaler.update(512.0)
    counter.seen, counter.history = 7, torch.tensor([1.0, 2.0, 3.0])
    enc = encode({"sched": sched, "scaler": scaler, "counter": counter, "model": model})  # before: refused
    header = json.loads(json.dumps(enc.header()))
    storages = [s.clone() for s in enc.sources]

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2, counter2 = torch.amp.GradScaler("cpu"), _Counter()
    decode(header, storages, into={"sched": sched2, "scaler": scaler2, "counter": counter2, "model": model2})
    assert sched2.state_dict()["last_epoch"] == 3 and sched2.get_last_lr() == sched.get_last_lr()
    assert scaler2.state_dict() == scaler.state_dict() and scaler2.get_scale() == 512.0
    assert counter2.seen == 7 and torch.equal(counter2.history, counter.history)
    storages[header["tensors"][0]["storage"]].zero_()  # the slot is reused later: the loaded state must not see it
    assert torch.equal(counter2.history, torch.tensor([1.0, 2.0, 3.0]))
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), model.state_dict().values()))
    plain = decode(header, storages)  # without into: the saved state_dict()s, for the caller to load
    assert plain["counter"]["seen"] == 7 and plain["sched"]["last_epoch"] == 3


@pytest.mark.parametrize(
    "shape, names, coords, expected",
    [
        ((4,), (), (2,), Layout(dp=4, dp_rank=2)),
        ((2, 2), ("dp", "tp"), (1, 0), Layout(dp=2, dp_rank=1, tp=2, tp_rank=0)),
        # HSDP: the replicate dimension is dp (its ranks hold the same shards), the shard one is not
        ((2, 3, 2), ("dp_replicate", "dp_shard", "tp"), (1, 2, 1), Layout(dp=2, dp_rank=1, tp=6, tp_rank=5)),
        ((4,), ("dp_shard",), (3,), Layout(tp=4, tp_rank=3)),
        ((2, 2, 2), ("pp", "dp", "tp"), (1, 0, 1), Layout(dp=2, dp_rank=0, pp=2, pp_rank=1, tp=2, tp_rank=1)),
    ],
)
def test_the_layout_comes_from_the_device_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], coords: tuple[int, ...], expected: Layout
) -> None:
    assert layout_of(shape, names, coords) == expected


def test_layout_from_a_live_mesh(mesh) -> None:  # type: ignore[no-untyped-def]
    assert Layout.from_mesh(mesh) == Layout()
