"""A training state (nested dicts/lists of tensors and JSON values) ↔ raw storage bytes + a header.

Tensors are saved by *storage*: tensors that share one (views, tied weights) are saved once and
restored sharing it again; non-contiguous tensors keep their strides. The header is JSON — the
tree with every tensor replaced by a reference (storage, offset, shape, stride, dtype) — so no
pickle crosses a process boundary, and any leaf that is neither a tensor nor JSON-serialisable
is refused with an error naming its key. Two leaves are more than a tensor: a DTensor (FSDP2,
tensor parallel) is saved as its local part with its placements and mesh shape, and a Stateful
object (``state_dict()`` / ``load_state_dict()``) as its ``state_dict()``.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ffplane_contract.errors import FFPlaneError
from trainer_client._collector import paused as collector_paused
from trainer_client.razor import Layout

ALIGN = 64  # storage start alignment in the byte stream (cache line; any dtype)
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}  # fmt: skip
_NAMES = {d: name for name, d in _DTYPES.items()}
_TENSOR_TAG = "__ffplane_tensor__"
_STATEFUL_TAG = "__ffplane_stateful__"
LOADER_KIND = "ffplane.DataLoader"  # a DataLoader's state_dict(): its position, bound to the saved step


class StateError(FFPlaneError, TypeError):
    """The state holds something that cannot be saved; the message names the key."""


@dataclass
class StorageEntry:
    stream: str  # "replicated" (razored across the dp group) or "private" (this role's own)
    offset: int  # byte offset in its stream
    nbytes: int
    device: str = "cpu"  # where it was saved from ("cuda:0"): a fresh restore puts it back there


@dataclass
class TensorRef:
    storage: int
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int  # in elements
    requires_grad: bool = False
    # a DTensor's local part: {"placements": [["shard", dim] | ["strided_shard", dim, split_factor]
    #   | ["replicate"] | ["partial", op]],
    # "mesh": mesh shape, "coord": this rank's mesh coordinate, "shape": global shape, "stride": global stride}
    dtensor: dict[str, Any] | None = None


@dataclass
class Encoded:
    """What ``encode`` found: storages to copy (in stream order) and the JSON header parts."""

    storages: list[StorageEntry] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)  # uint8 view of each storage
    # each tensor's TensorRef as the header holds it (a dict: built once, shared by every header
    # of this save; a dataclass per tensor, then a dict per tensor again, cost 1.2 µs a tensor)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    # per tensor, what its entry says as one tuple (storage, offset, dtype, requires_grad, shape,
    # stride): the next save compares it with one C-level ``==`` instead of six dict lookups
    # and two lists made per tensor (encode's steady path)
    tensor_keys: list[tuple[Any, ...]] = field(default_factory=list)
    tree: Any = None
    stream_nbytes: dict[str, int] = field(default_factory=lambda: {"replicated": 0, "private": 0})
    # (address, bytes) as one int for a host storage, (device, address, bytes) otherwise → index in
    # storages (an int key, not a tuple: one object fewer per storage outliving every save)
    storage_ids: dict[int | tuple[str, int, int], int] = field(default_factory=dict)
    # per storage, (that key, stream, offset): the next save takes this save's entry and view
    # where its storage is the same one at the same place
    storage_places: list[tuple[Any, str, int]] = field(default_factory=list)
    # the header's storage list, built once and kept by later saves while their storages are these
    storage_dicts: list[dict[str, Any]] | None = None
    # which storages, at which places in the streams, through which source views: the previous
    # save's number while all three are its very objects, else a new one (a slot's kept copy list
    # is good for exactly one number: Checkpointer._pairs)
    generation: int = -1

    def header(self) -> dict[str, Any]:
        return {"tree_json": self.tree_json(), **self.static_header()}

    def tree_json(self) -> str:
        """The tree as a commit carries it: JSON text, which no daemon parses (a restore does).
        Each parse and re-encode of the tree as a structure (the daemon's commit, its record,
        the push, the receiver's, its record) cost more than the text's one encode here."""
        return _TREE_ENCODER.encode(self.tree)

    def static_header(self) -> dict[str, Any]:
        """The header but the tree: what stays the same from one save to the next."""
        # Not dataclasses.asdict: asdict deep-copies recursively and cost 1.8 ms per save for an
        # AdamW state of ~60 tensors (65 % of the save's Python time).
        if self.storage_dicts is None:
            self.storage_dicts = [
                {"stream": s.stream, "offset": s.offset, "nbytes": s.nbytes, **({"device": s.device} if s.device != "cpu" else {})}
                for s in self.storages
            ]
        return {"tensors": self.tensors, "storages": self.storage_dicts, "stream_nbytes": dict(self.stream_nbytes)}


def bind_position(position: dict[str, Any], step: int, path: tuple[str | int, ...] = ()) -> dict[str, Any]:
    """A DataLoader position saved with ``step``: the one that resumes at ``step + 1``.

    A loop that fetches the next batch before ``optimizer.step()`` (nanoGPT does) saves step
    ``s`` with the loader already at ``s + 2``; restored as is, the run would silently skip a
    batch. Any other position means the loop numbers its steps unlike the job's plan (the batch
    of step ``s`` is the loader's step ``s``), and binding it would skip or repeat batches.
    """
    at = position.get("next_step")
    if at not in (step + 1, step + 2):
        raise StateError(
            f"state{_key(path)}: a DataLoader at next_step={at} saved with step {step}; it must be at {step + 1} (or {step + 2}, "
            "the next batch fetched early). Number save() steps like the loader's (the batch of step s is the loader's step s, "
            "e.g. step = loader.next_step - 1 right after the batch is taken)"
        )
    return {**position, "next_step": step + 1}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a header gives ``dtype`` (StateError for a dtype ffplane cannot save)."""
    name = _NAMES.get(dtype)
    if name is None:
        raise StateError(f"dtype {dtype} cannot be saved by ffplane")
    return name


def dtype_of(name: str) -> torch.dtype:
    """The dtype a header names."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise StateError(f"a header names dtype {name!r}, unknown to this ffplane")
    return dtype


_GENERATIONS = itertools.count()  # Encoded.generation
_TAGS: list[dict[str, int]] = []  # {_TENSOR_TAG: i}, one per i, shared by every tree (never mutated)
_TAGS_MAX = 1 << 16  # past this many tensors a marker is made per save (bounded memory)
_TAGS_GROW = threading.Lock()  # saves may run on several threads (DCP's async save)
# the walk builds the tree afresh from the state, so it cannot hold a cycle (a cyclic state recurses
# in the walk instead): no id bookkeeping per container while it is written (~20 % of the encode)
_TREE_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_PLAIN = frozenset({int, str, bool, type(None)})  # leaves saved as they are (a float may be inf or nan)


def _tag(ref: int) -> dict[str, int]:
    if ref >= len(_TAGS):
        if ref >= _TAGS_MAX:
            return {_TENSOR_TAG: ref}
        with _TAGS_GROW:
            while len(_TAGS) <= ref:
                _TAGS.append({_TENSOR_TAG: len(_TAGS)})
    return _TAGS[ref]


def _key(path: tuple[str | int, ...], at: str | int | None = None) -> str:
    """``path`` (and then ``at``) as the subscripts that reach it from the state."""
    return "".join(f"[{p!r}]" for p in (path if at is None else (*path, at))) or "<root>"


def encode(
    state: Any,
    private_keys: frozenset[str] = frozenset(),
    previous: Encoded | None = None,
    step: int | None = None,
    layout: Layout | None = None,
) -> Encoded:
    """Walk ``state``; top-level keys in ``private_keys`` go to the private stream. With ``step``
    (the step being saved), a DataLoader's position is bound to it (``bind_position``). With a
    ``layout`` made from a mesh, a DTensor replicated over its dp dimensions (HSDP's replicate
    dimension; tensor-parallel state under DDP) stays in the replicated stream (see
    ``_dtensor_recorder``).

    ``previous``: the last encode of the same training state, whose uint8 views of storages
    that are still there are reused (a save encodes the same tensors every step). Safe by
    construction: a view keeps its storage alive, so no other storage can take its address.
    """
    enc = Encoded()
    # what is the same as in the previous save is that save's object again: a save's header then
    # leaves a few dozen new objects alive rather than five per tensor, and the collector, which
    # runs for every ~700 objects left alive, hardly runs for a save (_collector's docstring)
    fresh = previous is None
    if previous is None:
        previous = Encoded()
    # The three parts are closures made once per save: what they share per tensor is read from
    # their cells, not looked up as attributes (this runs once per tensor of every save).
    tensor = _tensor_recorder(enc, previous)
    walk = _tree_walker(tensor, _dtensor_recorder(enc, tensor, layout), private_keys, step)
    # The walk reads tensors and never differentiates them. With grad mode on, every DTensor's
    # to_local() was an autograd call, the most of an FSDP2 state's encode (bench/save_cpu.py's
    # fsdp2 case). A Stateful leaf's state_dict() runs under no_grad too.
    with torch.no_grad(), collector_paused():  # see trainer_client._collector
        enc.tree = walk(state, (), "replicated")  # JSON by construction: walk lets nothing else through
    if not fresh and _same_items(enc.storages, previous.storages) and _same_items(enc.sources, previous.sources):
        enc.storage_dicts, enc.generation = previous.storage_dicts, previous.generation
    else:
        enc.generation = next(_GENERATIONS)
    return enc


_Path = tuple[str | int, ...]  # the keys that reach a node from the state's root


class _RecordTensor(Protocol):
    def __call__(self, t: torch.Tensor, path: _Path, at: str | int | None, stream: str, shared: bool = True) -> int: ...


_RecordDTensor = Callable[[Any, _Path, str], int]
_Walk = Callable[[Any, _Path, str], Any]


def _tree_walker(tensor: _RecordTensor, dtensor: _RecordDTensor, private_keys: frozenset[str], step: int | None) -> _Walk:
    """``walk(node, path, stream)``: ``node`` as the header's tree holds it, every tensor in it
    recorded (in ``stream``, or the private one under a top-level key of ``private_keys``) and
    replaced by its tag."""
    tensor_type, tags = torch.Tensor, _TAGS
    # looked up once per save, not per tensor (see _is_dtensor: a process with DTensors has the module)
    dtensor_type = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    # The walk runs once per save over every node of the state, so leaves that need nothing (a
    # number, a string, a plain tensor) are handled in their container's loop: no call and no
    # path made for them. A path is made only for a node walked into, and named only in errors.
    def walk(node: Any, path: _Path, stream: str) -> Any:
        if isinstance(node, tensor_type):
            if dtensor_type is not None and isinstance(node, dtensor_type):
                return _tag(dtensor(node, path, stream))
            return _tag(tensor(node, path, None, stream))
        if isinstance(node, dict):
            if step is not None and node.get("kind") == LOADER_KIND:
                node = bind_position(node, step, path)
            top = not path and private_keys
            out = {}
            for k, v in node.items():
                if type(k) is str:
                    key = k
                elif isinstance(k, str):  # a StrEnum, numpy.str_: saved as str(k), as always
                    key = str(k)
                elif isinstance(k, int) and not isinstance(k, bool):
                    key = f"__int__{k}"
                else:
                    raise StateError(f"state{_key(path)}[{k!r}] is a {type(k).__name__}; keys must be str or int")
                kind = type(v)
                if kind in _PLAIN:
                    out[key] = v
                elif kind is tensor_type:
                    ref = tensor(v, path, k, "private" if top and str(k) in private_keys else stream)
                    out[key] = tags[ref] if ref < len(tags) else _tag(ref)
                else:
                    out[key] = walk(v, (*path, k), "private" if top and str(k) in private_keys else stream)
            return out
        if isinstance(node, (list, tuple)):
            items = []
            for i, v in enumerate(node):
                kind = type(v)
                if kind in _PLAIN:
                    items.append(v)
                elif kind is tensor_type:
                    ref = tensor(v, path, i, stream)
                    items.append(tags[ref] if ref < len(tags) else _tag(ref))
                else:
                    items.append(walk(v, (*path, i), stream))
            return {"__tuple__": items} if isinstance(node, tuple) else items
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if _is_stateful(node):  # a scheduler, a GradScaler, a DataLoader, a module: its state_dict()
            return {_STATEFUL_TAG: walk(node.state_dict(), path, stream), "type": f"{type(node).__module__}.{type(node).__qualname__}"}
        if isinstance(node, float):
            if not math.isfinite(node):
                return {"__float__": repr(node)}  # JSON has no inf/nan
            return node
        raise StateError(
            f"state{_key(path)} is a {type(node).__module__}.{type(node).__name__}; only tensors and "
            "JSON values (dict, list, str, int, float, bool, None) can be saved — convert it (e.g. "
            "to a tensor or a dict) before save()"
        )

    return walk


def _tensor_recorder(enc: Encoded, previous: Encoded) -> _RecordTensor:
    """``tensor(t, path, at, stream)``: records ``t`` (and its storage, once) in ``enc``, taking
    ``previous``'s objects where they say the same; returns its index in the tensor list."""
    prev_tensors, prev_keys = previous.tensors, previous.tensor_keys
    prev_storages, prev_sources, prev_places = previous.storages, previous.sources, previous.storage_places
    storages, sources, storage_ids, places = enc.storages, enc.sources, enc.storage_ids, enc.storage_places
    tensors, keys, stream_nbytes = enc.tensors, enc.tensor_keys, enc.stream_nbytes
    names, strided = _NAMES, torch.strided

    def tensor(t: torch.Tensor, path: _Path, at: str | int | None, stream: str, shared: bool = True) -> int:
        """``t``'s index in the header's tensor list; ``(*path, at)`` names it in an error."""
        dtype = names.get(t.dtype)
        if dtype is None:
            raise StateError(f"state{_key(path, at)} has dtype {t.dtype}, which ffplane cannot save")
        if t.is_cpu:
            device = "cpu"  # str(t.device) costs more than the rest of a tensor's checks together
        elif t.is_cuda:
            device = str(t.device)
        else:
            raise StateError(f"state{_key(path, at)} is on {t.device}; ffplane saves CPU and CUDA tensors")
        if t.layout is not strided:
            raise StateError(f"state{_key(path, at)} is a {t.layout} tensor; save a dense tensor")
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        skey = storage.data_ptr() << 64 | nbytes if device == "cpu" else (device, storage.data_ptr(), nbytes)
        sid = storage_ids.get(skey)
        if sid is None:
            sid = len(storages)
            offset = stream_nbytes[stream]
            place = (skey, stream, offset)
            if sid < len(prev_places) and prev_places[sid] == place:
                # the same storage (the previous source view keeps it alive: no other can have its
                # address) at the same place in the same stream: the previous save's entry and view
                places.append(prev_places[sid])
                storages.append(prev_storages[sid])
                sources.append(prev_sources[sid])
            else:
                # a CUDA storage is copied device → slot directly (Checkpointer: on a side stream)
                entry = prev_storages[sid] if sid < len(prev_storages) else None
                if entry is None or (entry.stream, entry.offset, entry.nbytes, entry.device) != (stream, offset, nbytes, device):
                    entry = StorageEntry(stream, offset, nbytes, device)  # else another storage, placed alike
                places.append(place)
                storages.append(entry)
                sources.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (nbytes,), (1,)))
            stream_nbytes[stream] = offset + -(-nbytes // ALIGN) * ALIGN
            storage_ids[skey] = sid
        ref = len(tensors)
        key = (sid, t.storage_offset(), dtype, t.requires_grad, t.shape, t.stride())
        if shared and ref < len(prev_keys) and prev_keys[ref] == key and "dtensor" not in prev_tensors[ref]:
            # the previous save's objects: the new key dies here, and nothing is left for the collector
            keys.append(prev_keys[ref])
            tensors.append(prev_tensors[ref])  # a DTensor's entry is added to: never shared
        else:
            keys.append(key)
            tensors.append(
                {
                    "storage": sid,
                    "dtype": dtype,
                    "shape": list(key[4]),
                    "stride": list(key[5]),
                    "storage_offset": int(key[1]),
                    "requires_grad": key[3],
                }
            )  # a TensorRef's fields
        return ref

    return tensor


def _dtensor_recorder(enc: Encoded, tensor: _RecordTensor, layout: Layout | None) -> _RecordDTensor:
    """``dtensor(t, path, stream)``: records DTensor ``t``'s local part with ``tensor`` and adds
    its placements and mesh to its entry; returns its index in the tensor list."""
    # what a DTensor's mesh and placements say, worked out once per mesh and per placements in
    # a save (an FSDP2 state has a thousand DTensors on one mesh); shared, never mutated
    meshes: dict[int, tuple[Any, list[int], list[int], list[int] | None]] = {}
    placed: dict[Any, list[list[Any]]] = {}

    def dtensor(t: Any, path: _Path, stream: str) -> int:
        """A DTensor is saved as this rank's local part: in the key's stream when every rank of
        the dp group holds the same local part, else private. The same: replicated over each of
        its mesh dimensions that ``layout`` counts as dp (a dimension of another kind — tp,
        dp_shard — separates roles, not dp peers); with no layout from a mesh, over every one."""
        placements = _placements_of(t.placements, placed)
        mesh = t.device_mesh
        known = meshes.get(id(mesh))
        if known is None or known[0] is not mesh:  # kept alive in the entry: its id cannot be another's
            dp_dims = layout.dp_dims_of(mesh.mesh_dim_names, mesh.ndim) if layout is not None else None
            # coord: where the local part sits (ffplane export places it)
            known = meshes[id(mesh)] = (mesh, list(mesh.shape), list(mesh.get_coordinate() or []), dp_dims)
        _, mesh_shape, coord, dp_dims = known
        checked = range(len(placements)) if dp_dims is None else dp_dims
        same = all(placements[i] == ["replicate"] for i in checked)
        ref = tensor(t.to_local(), path, None, stream if same else "private", shared=False)  # its entry is added to below
        # under no_grad the local part of a parameter does not require grad; the DTensor says
        enc.tensors[ref]["requires_grad"] = t.requires_grad
        enc.tensors[ref]["dtensor"] = {
            "placements": placements,
            "mesh": mesh_shape,
            "coord": coord,
            "shape": list(t.shape),
            "stride": list(t.stride()),
        }
        return ref

    return dtensor


def _same_items(a: list[Any], b: list[Any]) -> bool:
    """The very same objects in the same order (identity: tensors' ``==`` compares elements)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def decode(
    header: dict[str, Any],
    storages: list[torch.Tensor],
    into: Any = None,
    copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
    mesh: Any = None,
    local_parts: bool = False,
) -> Any:
    """Rebuild the state from ``storages`` (uint8 tensors, one per storage entry).

    With ``into`` (a state of the same structure), every tensor is copied into the caller's
    existing tensor and ``into`` is returned updated; otherwise tensors view ``storages``.
    ``copy`` runs the (destination, source) copies for ``into`` (default: one after another).
    A saved DTensor lands in ``into``'s DTensor (same placements and mesh shape), or, where
    ``into`` has none, becomes a DTensor on ``mesh`` (a ``DeviceMesh`` of the saved shape).
    ``local_parts``: a saved DTensor comes back as a ``LocalPart`` (no mesh needed: export).
    """
    refs = [TensorRef(**t) for t in header["tensors"]]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending_stateful: list[tuple[Any, Any]] = []  # loaded once its tensors are copied

    def view(i: int) -> torch.Tensor:
        r = refs[i]
        dt = _DTYPES[r.dtype]
        base = storages[r.storage]
        typed = base.view(dt)
        # as_strided's offset counts from the start of the underlying buffer, not of ``base``
        return typed.as_strided(r.shape, r.stride, typed.storage_offset() + r.storage_offset)

    def build(node: Any, target: Any, path: tuple[str | int, ...]) -> Any:
        if isinstance(node, dict):
            if _TENSOR_TAG in node:
                src = view(node[_TENSOR_TAG])
                saved = refs[node[_TENSOR_TAG]].dtensor
                if saved is not None and local_parts:
                    return LocalPart(src, saved)
                if saved is not None:
                    return _dtensor_into(saved, src, target, mesh, path, pending)
                if target is None:
                    return src
                if not isinstance(target, torch.Tensor) or target.shape != src.shape or target.dtype != src.dtype:
                    raise StateError(f"into{_key(path)}: expected a {src.dtype} tensor of shape {tuple(src.shape)}, got {target!r:.80}")
                pending.append((target, src))
                return target
            if _STATEFUL_TAG in node:
                inner = build(node[_STATEFUL_TAG], None, path)
                if target is None:
                    return inner  # the saved state_dict(): the caller loads it
                if not _is_stateful(target):
                    raise StateError(f"into{_key(path)}: a {node['type']} was saved here, with load_state_dict(); got {target!r:.80}")
                pending_stateful.append((target, inner))  # loaded once the tensors are copied
                return target
            if "__tuple__" in node:
                return tuple(build(v, None, (*path, i)) for i, v in enumerate(node["__tuple__"]))
            if "__float__" in node:
                return float(node["__float__"])
            out = target if isinstance(target, dict) else {}
            for k, v in node.items():
                key: str | int = int(k[7:]) if k.startswith("__int__") else k
                out[key] = build(v, out.get(key) if isinstance(out, dict) else None, (*path, key))
            return out
        if isinstance(node, list):
            tgt = target if isinstance(target, list) and len(target) == len(node) else None
            items = [build(v, tgt[i] if tgt else None, (*path, i)) for i, v in enumerate(node)]
            if tgt is not None:
                tgt[:] = items
                return tgt
            return items
        return node

    tree = json.loads(header["tree_json"]) if "tree_json" in header else header["tree"]
    out = build(tree, into, ())
    with torch.no_grad():
        if copy is not None:
            copy(pending)
        else:
            for d, s in pending:
                d.copy_(s)
    for obj, inner in pending_stateful:
        # owned copies: a load_state_dict may keep the tensors it is given (an optimizer's does),
        # and these view the slot the role's second save from now writes into
        obj.load_state_dict(owned(inner))
    return out


@dataclass
class LocalPart:
    """A saved DTensor's local part and its ``TensorRef.dtensor`` description."""

    local: torch.Tensor
    saved: dict[str, Any]


def _is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (torch.Tensor, dict, list, tuple))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def owned(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, dict):
        return {k: owned(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(owned(v) for v in node)
    return node


def _is_dtensor(t: torch.Tensor) -> bool:
    # Looked up, not imported: a process that holds a DTensor has loaded the module, and importing
    # it costs ~1 s — paid on the first save of every restarted worker when this imported it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _placements_of(placements: tuple[Any, ...], seen: dict[Any, list[list[Any]]]) -> list[list[Any]]:
    """``_placement`` of each, looked up in ``seen`` (placements are frozen dataclasses; keyed
    with their types too: some torch releases have a ``_StridedShard`` equal to a ``Shard``)."""
    key = tuple((type(p), p) for p in placements)
    try:
        known = seen.get(key)
    except TypeError:  # an unhashable placement of some other kind: worked out each time
        return [_placement(p) for p in placements]
    if known is None:
        known = seen[key] = [_placement(p) for p in placements]
    return known


def _placement(p: Any) -> list[Any]:
    if type(p).__name__ == "_StridedShard":  # FSDP2 over tensor parallel: dp shards a tp shard, interleaved
        return ["strided_shard", int(p.dim), int(p.split_factor)]
    if p.is_shard():
        return ["shard", int(p.dim)]
    if p.is_replicate():
        return ["replicate"]
    if p.is_partial():
        return ["partial", str(getattr(p, "reduce_op", "sum"))]
    raise StateError(f"a DTensor placement {p!r} ffplane does not know; save its full_tensor() instead")


def placements_of(saved: list[list[Any]]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    made = {
        "shard": lambda p: Shard(p[1]),
        "strided_shard": lambda p: _StridedShard(p[1], split_factor=p[2]),
        "replicate": lambda p: Replicate(),
        "partial": lambda p: Partial(p[1]),
    }
    return [made[p[0]](p) for p in saved]


def _dtensor_into(saved: dict[str, Any], src: torch.Tensor, target: Any, mesh: Any, path: tuple[str | int, ...], pending: list[Any]) -> Any:
    """A saved DTensor's local part into ``target``'s, or as a new DTensor on ``mesh``."""
    where = f"state{_key(path)} was saved as a DTensor with placements {saved['placements']} on a mesh of shape {saved['mesh']}"
    if target is not None:
        if not _is_dtensor(target):
            raise StateError(
                f"{where}; into{_key(path)} is a {type(target).__name__}: pass the DTensor state (e.g. the sharded model's state_dict())"
            )
        if [_placement(p) for p in target.placements] != saved["placements"] or list(target.device_mesh.shape) != saved["mesh"]:
            raise StateError(
                f"{where}; into{_key(path)} has {[_placement(p) for p in target.placements]} on {list(target.device_mesh.shape)}: "
                "a restore into another layout needs a resharding load (DCP)"
            )
        local = target.to_local()
        if local.shape != src.shape or local.dtype != src.dtype:
            raise StateError(
                f"{where}; into{_key(path)} holds a local {local.dtype} part of shape {tuple(local.shape)}, saved {tuple(src.shape)}"
            )
        pending.append((local, src))
        return target
    if mesh is None:
        raise StateError(f"{where}; restore it with restore(into=state) or restore(mesh=<its DeviceMesh>)")
    if list(mesh.shape) != saved["mesh"]:
        raise StateError(f"{where}; the mesh given has shape {list(mesh.shape)}")
    from torch.distributed.tensor import DTensor

    local = src.clone().to(mesh.device_type) if mesh.device_type != "cpu" else src.clone()
    return DTensor.from_local(
        local, mesh, placements_of(saved["placements"]), run_check=False, shape=torch.Size(saved["shape"]), stride=tuple(saved["stride"])
    )
