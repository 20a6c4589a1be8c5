"""``ffplane export JOB STEP DIR``: a step, as a plain DCP checkpoint directory that stock
``torch.distributed.checkpoint`` reads without ffplane, plus ``model.safetensors`` with the
whole tensors under the ``model`` key (every tensor when there is none).

A step saved through DCP keeps its DCP names and chunks. A step saved by ``Checkpointer.save``
becomes the state dict one process would have saved: each role's state rebuilt (razored
storages from its dp group), DTensors assembled whole from every role's local part, and values
that differ between roles (per-rank RNG state, a loader's ``dp_rank``) kept per role as
``{role: value}``.

The shards come from the node daemon (which pulls what is not local) or, with ``durable_dir``
and no daemon, from the durable tier. The directory is written by DCP's own
``FileSystemWriter``, so its format is DCP's.
"""

from __future__ import annotations

import io
import json
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ffplane_contract.errors import FFPlaneError
from trainer_client._restore import role_storages
from trainer_client.dcp import DaemonReader, metadata_of, narrow, shard_items
from trainer_client.razor import Layout
from trainer_client.state_codec import LocalPart, decode, placements_of

__all__ = ["Exported", "export"]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass
class Exported:
    directory: Path
    step: int
    items: int  # chunks and values written
    model_tensors: int  # tensors in model.safetensors


class _Values:
    """The planner ``FileSystemWriter.write_data`` asks for each item's data."""

    def __init__(self, values: dict[MetadataIndex, Any]) -> None:
        self.values = values

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.values[item.index]
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(value, buf)  # DCP's own format for non-tensor values, in the user's directory
            buf.seek(0)
            return buf
        return value.clone()  # its own storage: a view would drag the whole mapped shard into the file


def export(
    job: str,
    step: int,
    directory: str | os.PathLike[str],
    *,
    socket_path: str | os.PathLike[str] | None = None,
    durable_dir: str | os.PathLike[str] | None = None,
    model_key: str = "model",
) -> Exported:
    out = Path(directory)
    reader = DaemonReader(job, socket_path=socket_path, durable_dir=durable_dir)
    try:
        shards = reader.whole_step(step)
    finally:
        reader.close()
    catalogue = next(iter(shards.values()))["header"].get("dcp")
    if catalogue is None:
        return _export_checkpointer_step(job, step, shards, out, model_key)
    metadata, where = metadata_of(catalogue)
    items = {role: shard_items(sh) for role, sh in shards.items()}
    values = {index: items[role][key] for index, (role, key) in where.items()}
    plan = SavePlan(items=[_write_item(index, metadata) for index in where])
    out.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(str(out))
    writer.set_up_storage_writer(True)
    plan = writer.prepare_global_plan([writer.prepare_local_plan(plan)])[0]
    results = writer.write_data(plan, _Values(values)).wait()  # type: ignore[arg-type]
    writer.finish(Metadata(metadata.state_dict_metadata, planner_data=metadata.planner_data), [results])
    model = _whole_tensors(metadata, values, model_key)
    _write_safetensors(out / "model.safetensors", model, {"ffplane_job": job, "step": str(step)})
    return Exported(out, step, len(plan.items), len(model))


def _write_item(index: MetadataIndex, metadata: Metadata) -> WriteItem:
    md = metadata.state_dict_metadata[index.fqn]
    if not isinstance(md, TensorStorageMetadata):
        return WriteItem(index=index, type=WriteItemType.BYTE_IO)
    assert index.offset is not None
    chunk = next(c for c in md.chunks if c.offsets == index.offset)
    props = TensorProperties(dtype=md.properties.dtype, requires_grad=md.properties.requires_grad)
    data = TensorWriteData(chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes), properties=props, size=md.size)
    return WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)


def _whole_tensors(metadata: Metadata, values: dict[MetadataIndex, Any], model_key: str) -> dict[str, torch.Tensor]:
    """Each tensor of the model (fqns under ``model_key``, the key dropped) assembled from its chunks."""
    tensors = {fqn: md for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    prefix = next((p for p in (f"{model_key}.", f"app.{model_key}.") if any(f.startswith(p) for f in tensors)), "")
    out = {}
    for fqn, md in tensors.items():
        if not fqn.startswith(prefix):
            continue
        whole = torch.empty(md.size, dtype=md.properties.dtype)
        for chunk in md.chunks:
            narrow(whole, chunk.offsets, chunk.sizes).copy_(values[MetadataIndex(fqn, chunk.offsets)])
        out[fqn[len(prefix) :]] = whole
    return out


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format: a little-endian u64 header length, the JSON header, the bytes."""
    head: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        head[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    tmp.replace(path)


def _export_checkpointer_step(job: str, step: int, shards: dict[str, dict[str, Any]], out: Path, model_key: str) -> Exported:
    import torch.distributed.checkpoint as dcp

    states = {}
    for role, shard in sorted(shards.items()):
        saved = shard["header"].get("layout") or {}
        dp, pp, tp = (int(saved.get(k, 1)) for k in ("dp", "pp", "tp"))
        layout = Layout(dp, int(saved.get("dp_rank", 0)), pp, int(saved.get("pp_rank", 0)), tp, int(saved.get("tp_rank", 0)))
        header, storages = role_storages(role, shards, layout.dp_peers(), step, owned=False)
        states[role] = decode(header, storages, local_parts=True)
    state = _merge(states, ())
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist says
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(str(out)), no_dist=True)
    model = state.get(model_key, state) if isinstance(state, dict) else {}
    tensors = _flat_tensors(model, "")
    _write_safetensors(out / "model.safetensors", tensors, {"ffplane_job": job, "step": str(step)})
    return Exported(out, step, len(_flat_tensors(state, "")), len(tensors))


def _merge(by_role: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    """One state from every role's: dicts by key union, DTensor local parts assembled, equal
    values once, differing ones as ``{role: value}``."""
    values = list(by_role.values())
    if all(isinstance(v, LocalPart) for v in values):
        return _whole(by_role, path)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge({r: v[k] for r, v in by_role.items() if k in v}, (*path, k)) for k in keys}
    if all(isinstance(v, (list, tuple)) for v in values) and len({len(v) for v in values}) == 1:
        merged = [_merge({r: v[i] for r, v in by_role.items()}, (*path, i)) for i in range(len(values[0]))]
        return tuple(merged) if isinstance(values[0], tuple) else merged
    first = values[0]
    if all(_same(first, v) for v in values[1:]):
        return first.clone() if isinstance(first, torch.Tensor) else first
    return {role: v.clone() if isinstance(v, torch.Tensor) else v for role, v in by_role.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def _whole(parts: dict[str, LocalPart], path: tuple[str | int, ...]) -> torch.Tensor:
    """A DTensor assembled from its local parts: each placed where its mesh coordinate puts it."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    first = next(iter(parts.values()))
    shape = first.saved["shape"]
    whole = torch.empty(shape, dtype=first.local.dtype)
    placed: dict[tuple[int, ...], int] = {}
    for role, part in parts.items():
        coord = part.saved.get("coord")
        if not coord:
            raise FFPlaneError(
                f"state{''.join(f'[{k!r}]' for k in path)} of {role} was saved by an ffplane that did not record mesh "
                "coordinates; restore it and save again to export it"
            )
        sizes, offsets = _compute_local_shape_and_global_offset(shape, part.saved["mesh"], coord, placements_of(part.saved["placements"]))
        if tuple(sizes) != tuple(part.local.shape):
            raise FFPlaneError(f"{role}'s local part of state{list(path)} has shape {tuple(part.local.shape)}, its placements say {sizes}")
        narrow(whole, list(offsets), list(sizes)).copy_(part.local)
        placed[tuple(offsets)] = part.local.numel()
    if sum(placed.values()) != whole.numel():
        raise FFPlaneError(f"the saved local parts of state{list(path)} cover {sum(placed.values())} of its {whole.numel()} elements")
    return whole


def _flat_tensors(node: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under ``node`` by dotted name (``layers.0.weight``)."""
    if isinstance(node, torch.Tensor):
        return {prefix: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else []
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
