"""Reading sharded checkpoints (checkpoint.sharded=true; framework/checkpoint.py has the format)
with ``torch.distributed.checkpoint`` (DCP): a module of its own because importing DCP takes about a
second, which no process that reads no sharded checkpoint should pay.
"""
from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from framework.checkpoint import DCP_METADATA, REST, by_index, checked_state, read_weights_only, with_tensors
from framework.errors import CheckpointError


class ShardReader(FileSystemReader):
    """DCP's reader of a sharded checkpoint, without its blind unpickling: DCP's ``.metadata`` is a
    pickle, which torch 2.14 unpickles with ``pickle.load`` (code named in it would run). Here only
    the classes DCP writes for tensors may be named in it, and an entry that is not a tensor (which
    DCP would unpickle with ``weights_only=False``) is refused."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        try:
            with open(path, "rb") as handle:
                metadata = MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"{path.parent} was refused and not executed: its {DCP_METADATA} names code to "
                                  f"run ({error}), not only DCP's tensor metadata.") from None
        except Exception as error:
            raise CheckpointError(f"{path.parent} is damaged: its {DCP_METADATA} cannot be read "
                                  f"({type(error).__name__}).") from None
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
            raise CheckpointError(f"{path.parent} is damaged: its {DCP_METADATA} is not DCP's metadata.")
        other = [key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata)]
        if other:
            raise CheckpointError(f"{path.parent} was refused: {other[0]!r} is not a tensor, and runlab's sharded "
                                  "checkpoints hold only tensors (anything else would be unpickled unchecked).")
        # DCP reads each shard from the path its metadata names: only a shard file of this folder is read.
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            if not (isinstance(name, str) and SHARD_FILE.fullmatch(name)) or getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path.parent} was refused: its {DCP_METADATA} names {name!r} as a shard, not "
                                      "one of its own __<rank>_<n>.distcp files.")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # the files DCP's FileSystemWriter names, in the folder itself

# What DCP writes into .metadata for a state of tensors, and nothing else.
DCP_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
    "_MEM_FORMAT_ENCODING")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in DCP_CLASSES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_sharded(path: Path, require: Sequence[str] = (), into: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A sharded checkpoint's dict. Its tensors are read into ``into`` by every process of the group,
    each its part (parallel=fsdp, at any number of processes: DCP reshards); without ``into``, whole, by
    this process alone, the optimizer's by index as a single file holds it (consolidated)."""
    if not (path / REST).is_file():
        raise CheckpointError(f"{path} is damaged: it lacks {REST}, which a sharded checkpoint holds beside its shards.")
    rest = checked_state(read_weights_only(path / REST), path / REST)
    reader = ShardReader(path)
    metadata = reader.read_metadata()
    try:
        if into is None:
            flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
                    for key, entry in metadata.state_dict_metadata.items()}
            with warnings.catch_warnings():  # that it reads in one process, which is the intent here
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(flat, storage_reader=reader, no_dist=True)
            state = with_tensors(rest, nested(flat, metadata.planner_data))
            state["optimizer"] = by_index(state["optimizer"])
        else:
            dcp.load(into, storage_reader=reader)
            state = with_tensors(rest, into)
    except dcp.CheckpointException as error:  # a BaseException: one per failed process, the first says why
        raise unreadable(path, next(iter(error.failures.values()))[0]) from None
    except Exception as error:
        raise unreadable(path, error) from None
    return checked_state(state, path, require)


def unreadable(path: Path, error: BaseException) -> CheckpointError:
    if isinstance(error, CheckpointError):
        return error
    cause = str(error).strip().splitlines()[:1]
    return CheckpointError(f"{path} is damaged, or is not this model's sharded checkpoint: its shards cannot be read "
                           f"({type(error).__name__}{': ' + cause[0][:200] if cause else ''}).")


def nested(flat: Dict[str, Any], paths: Any) -> Dict[str, Any]:
    """DCP's flat keys back into the nested dicts they were written from (DCP keeps each key's path)."""
    if not isinstance(paths, dict) or set(paths) != set(flat):
        raise ValueError(f"its {DCP_METADATA} lacks the path of each tensor")
    tree: Dict[str, Any] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        *parents, leaf = paths[key]
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


