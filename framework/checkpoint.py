"""Checkpoints: one plain dict per file, written atomically, read back without unpickling code.

A checkpoint holds the unwrapped model's weights, the optimizer and scheduler, the loop
position, every RNG state and the resolved config with the model's constructor call, so
``load_model`` rebuilds the network from the file alone.

A sharded checkpoint (``checkpoint.sharded=true``, parallel=fsdp) holds the same dict, but no
process ever holds all of its tensors: each process writes its shards of the model and optimizer
with ``torch.distributed.checkpoint`` (DCP) into a directory, and rank 0 writes the rest beside
them, as ``runlab.pt``. The directories live in ``checkpoints/sharded/``, and ``last.pt`` and
``best.pt`` are symbolic links to them: replacing a link is atomic where replacing a directory is
not, so a crash mid-write leaves the previous checkpoint in place, and every name and path that
reads a checkpoint (``resume=auto``, ``ckpt=``, ``finetune.from=``) reads a sharded one too. One
process reading it (task=eval, task=export, parallel=none or ddp) consolidates its tensors;
parallel=fsdp reads each process's part, at any number of processes (framework/shards.py reads them).
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from hydra.utils import get_object
from torch import nn

from framework.errors import CheckpointError, ResourceError, disk_full
from framework.model import EXTRA_BUILDERS, build_model
from framework.paths import shown

log = logging.getLogger(__name__)

FORMAT = "runlab-checkpoint"
VERSION = 1
# What a training run saves (Trainer.state) and needs back to resume; "metrics" came later and is optional.
TRAINING_STATE = ("model", "model_spec", "optimizer", "scheduler", "scaler", "epoch", "step", "batch_in_epoch",
                  "micro_batch", "checkpointer", "early_stopping", "rng", "config")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temp file beside ``path``, then rename: a crash mid-write leaves the old file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        if not disk_full(error, path.parent):
            raise
        raise no_space_left(path) from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def no_space_left(path: Path) -> ResourceError:
    """The error of a checkpoint write to ``path`` that found the disk full; what was written before stays."""
    kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written before"
    return ResourceError(f"no space left on device writing {shown(path)}; {kept}. Free some space, then continue with "
                         "resume=auto.")


def atomic_link(source: Path, path: Path) -> None:
    """Make ``path`` a second name of the written and synced file ``source``, atomically: no data is
    copied or synced again. ``source`` is only ever replaced, never changed in place, so ``path``
    keeps this content. Where the file system has no hard links, a copy. Where ``source`` is a
    sharded checkpoint's link, ``path`` becomes a link to the same directory."""
    if source.is_symlink():
        atomic_symlink(os.readlink(source), path)
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # left by a process of this pid that died between link and rename
    try:
        os.link(source, tmp)
    except OSError:
        atomic_write(path, lambda copy: shutil.copyfile(source, copy))
        return
    os.replace(tmp, path)
    # Where path already was a name of source, rename() leaves both names as they were.
    tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def atomic_symlink(target: str | Path, path: Path) -> None:
    """Make ``path`` a symbolic link to ``target`` (relative to ``path``'s folder), replacing what it was atomically."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(state: Dict[str, Any], path: Path) -> None:
    atomic_write(Path(path), lambda tmp: torch.save({"format": FORMAT, "version": VERSION, **state}, tmp))


def written_checkpoint(run_dir: Path, kind: str) -> Optional[Path]:
    """A run dir's ``best`` or ``last`` checkpoint, if the run wrote it."""
    path = Path(run_dir) / "checkpoints" / f"{kind}.pt"
    return path if path.is_file() or is_sharded(path) else None


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint file or a sharded checkpoint's directory (not a run dir)."""
    return Path(path).is_file() or is_sharded(Path(path))


def read_pretrained(path: Path) -> Dict[str, Any]:
    """A runlab checkpoint with the model's weights and constructor call, or a plain state dict of
    tensors (e.g. another library's weights file), read without unpickling code."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{path} is a safetensors file; reading it needs the safetensors package.") from None
        try:
            return {"model": load_file(str(path))}
        except Exception as error:
            raise CheckpointError(f"{path} is not a readable safetensors file ({type(error).__name__}).") from None
    if is_sharded(path):
        from framework.shards import read_sharded

        return read_sharded(path, require=("model", "model_spec"))
    state = read_weights_only(path)
    if isinstance(state, dict) and state.get("format") == FORMAT:
        return checked_state(state, path, require=("model", "model_spec"))
    if isinstance(state, dict) and state and all(hasattr(v, "shape") for v in state.values()):
        return {"model": state}
    raise CheckpointError(f"{path} is neither a runlab checkpoint nor a state dict of tensors; finetune.from needs one of them.")


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint file, a run dir (its best checkpoint, else its last), or a folder of runs
    such as outputs/<name> (its most recently written run)."""
    path = Path(path)
    if is_sharded(path):
        return path
    if path.is_dir():
        run_dir = path
        if not (path / "checkpoints").is_dir():
            latest = find_latest_checkpoint(path, exclude=None)
            run_dir = latest.parent.parent if latest else path
        found = written_checkpoint(run_dir, "best") or written_checkpoint(run_dir, "last")
        if found:
            return found
        raise CheckpointError(f"{path} is a directory without checkpoints/best.pt or checkpoints/last.pt, "
                              "and no run below it has one.")
    if path.exists() and not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is {file_kind(path)}, not a checkpoint file; give a checkpoint "
                              "file or a run dir.")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    return path


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in a few words."""
    kinds = ((Path.is_fifo, "a named pipe (FIFO)"), (Path.is_socket, "a socket"), (Path.is_char_device, "a character device"),
             (Path.is_block_device, "a block device"))
    return next((name for test, name in kinds if test(path)), "not a regular file")


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
# torch.save's older format opens with a magic number pickled at protocol 2.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def read_weights_only(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True``: a file is untrusted input and must never run code.
    A file that is not in one of torch.save's formats is refused before it is read."""
    with open(path, "rb") as handle:
        head = handle.read(len(LEGACY_MAGIC))
    if not (head.startswith(ZIP_MAGIC) or head == LEGACY_MAGIC):
        raise CheckpointError(f"{path} is not a checkpoint file: {not_torch_file(head)}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]
        if refused:  # the file names Python code to run on unpickling: never ours, never executed
            raise CheckpointError(f"{path} was refused and not executed: it is a torch file whose pickle names code to "
                                  f"run, not a runlab checkpoint ({refused[0]}).") from None
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be read.") from None
    except Exception as error:
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be read ({type(error).__name__}).") from None


def not_torch_file(head: bytes) -> str:
    """What a file that torch.save did not write looks like, from its first bytes."""
    if head[:1] == b"\x80":  # a pickle's PROTO opcode
        return ("it is a raw Python pickle, not torch.save's format, and was not unpickled (a pickle can run code); "
                "save the weights with torch.save.")
    if not head:
        return "it is empty."
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "it is neither torch.save's zip format nor its older pickle format."
    return f"it is a text file (it starts with {text!r}), not torch.save's format."


# The type each key of a checkpoint must have, where it has the key: a file is untrusted input,
# and a wrong type would otherwise surface as a traceback far from the file that caused it.
STATE_TYPES: Dict[str, type] = {
    "model": dict, "model_spec": dict, "optimizer": dict, "scheduler": dict, "scaler": dict, "epoch": int, "step": int,
    "batch_in_epoch": int, "micro_batch": int, "eval_batch_size": int, "checkpointer": dict, "early_stopping": dict,
    "rng": dict, "config": dict, "metrics": dict, "classes": list,
}


def checked_state(state: Any, path: str | Path, require: Sequence[str] = ()) -> Dict[str, Any]:
    """A runlab checkpoint's dict, refused unless it has the marker, every key in ``require`` and
    the right type under every key it has: the one structural check of every path that reads one
    (resume, task=eval, finetune.from, load_model)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a runlab checkpoint (it lacks the runlab format marker).")
    missing = [key for key in require if key not in state]
    if missing:
        raise CheckpointError(f"{path} has the runlab marker but lacks {', '.join(missing)}: it is damaged, or was "
                              "not written by a training run.")
    wrong = [f"{key} is {type(state[key]).__name__}, not {kind.__name__}" for key, kind in STATE_TYPES.items()
             if key in state and not (isinstance(state[key], kind) and not isinstance(state[key], bool))]
    if "model" in state and isinstance(state["model"], dict):
        wrong += [f"model[{name!r}] is {type(value).__name__}, not a tensor" for name, value in state["model"].items()
                  if not torch.is_tensor(value)][:1]
    if wrong:
        raise CheckpointError(f"{path} has the runlab marker but is damaged: {'; '.join(wrong)}.")
    return state


def load_checkpoint(path: str | Path, require: Sequence[str] = ()) -> Dict[str, Any]:
    """A runlab checkpoint's dict, refused unless it holds every key in ``require`` (``checked_state``)."""
    path = resolve_checkpoint_path(path)
    if is_sharded(path):
        from framework.shards import read_sharded

        return read_sharded(path, require)
    return checked_state(read_weights_only(path), path, require)


def checked_spec(spec: Any, source: str | Path) -> Dict[str, Any]:
    """A model spec read from a file, refused unless it only constructs a ``torch.nn.Module`` class
    (or calls one of runlab's own builders of torchvision and timm models).

    ``instantiate`` calls whatever ``_target_`` names, so a crafted file could otherwise name
    ``os.system``; nested ``_target_`` keys would be called too, so none may appear.
    """
    target = spec.get("_target_") if isinstance(spec, dict) else None
    builder = isinstance(target, str) and target in EXTRA_BUILDERS
    if not (builder or _is_module_class(target)):
        raise CheckpointError(f"{source} was refused: its model_spec._target_={target!r} is not an importable "
                              "torch.nn.Module class, and nothing else is constructed from a file.")
    if any(_names_target(value) for key, value in spec.items() if key != "_target_"):
        raise CheckpointError(f"{source} was refused: its model_spec has nested _target_ keys, which would call code.")
    return spec


def _is_module_class(target: Any) -> bool:
    try:
        resolved = get_object(target) if isinstance(target, str) else None
    except Exception:
        return False
    return isinstance(resolved, type) and issubclass(resolved, nn.Module)


def _names_target(value: Any) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(_names_target(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_names_target(v) for v in value)


def model_from_state(state: Dict[str, Any], source: str | Path) -> nn.Module:
    """The checkpoint's model with its weights, built from its saved constructor call."""
    model = build_model(checked_spec(state.get("model_spec"), source))
    model.load_state_dict(state["model"])
    return model


def load_model(path: str | Path, device: str = "cpu") -> nn.Module:
    """Rebuild a trained model from a checkpoint alone, in eval mode: the way to share a run.

    ``model.classes[i]`` is the label of output ``i`` (the class names of the run's data).
    """
    state = load_checkpoint(path, require=("model", "model_spec"))
    model = model_from_state(state, path).to(device).eval()
    model.classes = checkpoint_classes(state)
    return model


def checkpoint_classes(state: Dict[str, Any]) -> List[str]:
    """The label of each output; checkpoints written before labels were kept get the indices."""
    return list(state.get("classes") or map(str, range(state["model_spec"].get("num_classes", 0))))


# --- sharded checkpoints (checkpoint.sharded=true) ----------------------------------------

SHARDED = "sharded"  # the folder of checkpoints/ that holds the directories last.pt and best.pt link to
REST = "runlab.pt"  # a sharded checkpoint's state but its tensors, beside DCP's files
DCP_METADATA = ".metadata"  # DCP's index of the tensors and their shards: a pickle


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory (a damaged one included, to be refused as such)."""
    return path.is_dir() and ((path / REST).exists() or (path / DCP_METADATA).exists())


def split_tensors(state: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A training state's model and optimizer tensors (what each process writes its shards of) and the
    rest: DCP writes anything but a tensor as a pickle, which its reader would unpickle unchecked."""
    optimizer = state.get("optimizer", {"state": {}, "param_groups": []})
    tensors = {"model": state["model"], "optimizer": {
        name: {key: value for key, value in values.items() if torch.is_tensor(value)}
        for name, values in optimizer["state"].items()}}
    rest = {key: value for key, value in state.items() if key != "model"}
    rest["optimizer"] = {"param_groups": optimizer["param_groups"], "state": {
        name: {key: value for key, value in values.items() if not torch.is_tensor(value)}
        for name, values in optimizer["state"].items()}}
    return tensors, rest


def with_tensors(rest: Dict[str, Any], tensors: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of ``split_tensors``."""
    read = tensors["optimizer"]
    state = {name: {**values, **read.get(name, {})} for name, values in rest["optimizer"]["state"].items()}
    return {**rest, "model": tensors["model"], "optimizer": {"state": state,
                                                             "param_groups": rest["optimizer"]["param_groups"]}}


def unpublished(path: Path) -> Path:
    """Where the processes write the sharded checkpoint ``path`` (last.pt) until it is complete."""
    return path.parent / SHARDED / f".{path.name}.tmp"


def clear(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def publish_sharded(tmp: Path, path: Path, step: int) -> None:
    """Rank 0, once ``tmp`` holds the whole checkpoint, synced: move it to a name of its own and link
    ``path`` to it. Until that link's rename, ``path`` names the previous checkpoint, whole."""
    final = tmp.parent / f"step-{step}-{time.time_ns()}"
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    atomic_symlink(Path(SHARDED) / final.name, path)
    prune_sharded(path.parent)


def copy_sharded(source: Path, path: Path) -> None:
    """Publish a copy of the sharded checkpoint ``source`` (the best.pt of the run a resumed run continues) as ``path``."""
    tmp = unpublished(path)
    clear(tmp)
    shutil.copytree(source, tmp)
    for copied in tmp.iterdir():
        with open(copied, "rb+") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(tmp)
    publish_sharded(tmp, path, checked_state(read_weights_only(tmp / REST), source, require=("step",))["step"])


def prune_sharded(directory: Path) -> None:
    """Remove the sharded checkpoints no name in ``directory`` (last.pt, best.pt, step-<step>.pt) links
    to any more: older writes and unfinished ones. The retention is the links'."""
    if not (directory / SHARDED).is_dir():
        return  # none written here
    linked = {Path(os.readlink(name)).name for name in directory.iterdir() if name.is_symlink()}
    if not linked:  # the run went on in one file (it resumed a sharded checkpoint in one process)
        clear(directory / SHARDED)
    for written in (directory / SHARDED).glob("*"):
        if written.name not in linked:
            clear(written)


def by_index(state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state with parameters by name (FSDP's) in torch's own form (by index), as parallel=none saves it."""
    if not state:
        return state  # a rank other than 0 of a gathered state: it writes nothing
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(state: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """The inverse of ``by_index``, for an optimizer whose parameters are ``names``."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]}


# --- RNG state -------------------------------------------------------------------------

def rng_state() -> Dict[str, Any]:
    """Every RNG the run draws from, as tensors and plain values (weights_only-loadable). The
    generators' words are tensors: pickled as 625 separate ints, Python's alone took a quarter
    of the time a small model's checkpoint takes to write."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, torch.tensor(py_internal, dtype=torch.int64), py_gauss],
    }


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_internal, py_gauss = state["python"]
    words = py_internal.tolist() if torch.is_tensor(py_internal) else py_internal  # a list before the tensor
    random.setstate((py_version, tuple(words), py_gauss))


# --- policy ----------------------------------------------------------------------------

class MetricTracker:
    """Remembers the best value of one metric and says whether a new value improves on it."""

    def __init__(self, monitor: str, mode: str, min_delta: float = 0.0):
        self.monitor, self.mode, self.min_delta = monitor, mode, min_delta
        self.best: Optional[float] = None

    def improved(self, metrics: Dict[str, float]) -> bool:
        value = metrics[self.monitor]
        better = self.best is None or (
            value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta)
        if better:
            self.best = value
        return better


# Immutable leaves, which snapshot keeps as they are.
PLAIN = frozenset({int, float, str, bool, type(None)})


def snapshot(value: Any) -> Any:
    """A CPU copy of every tensor in a nested state, so training can go on changing the originals."""
    # Plain leaves are told by their exact type, inline: a state holds thousands (the resolved
    # config, Python's RNG state), and a call, or an isinstance against torch.Tensor, for each
    # would cost a small model's epoch a few percent.
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: v if type(v) in PLAIN else snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(v if type(v) in PLAIN else snapshot(v) for v in value)
    return value


class Checkpointer:
    """Writes ``last.pt`` after every validation and ``best.pt`` when the monitored metric improves;
    also mid-epoch on a schedule of steps or minutes (``on_step``), so that a long epoch's work survives
    a kill -9; ``keep_last`` keeps the newest writes as ``step-<step>.pt`` besides.

    The state is copied to CPU memory on the caller's thread and written to disk by one
    background thread, started at the first write and kept for the run, so the next epoch
    waits neither for serialisation and fsync nor for a thread to start. One write is in
    flight at a time; ``wait`` finishes it and re-raises its error, if any.

    Where building the state takes every process (``collective_state``: fsdp gathers the shards),
    the others build it too, and only the writer writes it. Where every process writes its own
    shards (``write_shards``, checkpoint.sharded=true), every process writes, on the training
    thread: the write is collective; the writer then names it.
    """

    def __init__(self, directory: Path, monitor: str, mode: str, enabled: bool, is_writer: bool, *,
                 every_n_steps: int = 0, every_minutes: float = 0.0, keep_last: int = 0, collective_state: bool = False,
                 write_shards: Optional[Callable[[Dict[str, Any], Path], None]] = None):
        self.directory, self.enabled, self.is_writer = Path(directory), enabled, is_writer
        self.write_shards = write_shards
        self.builds_state = enabled and (is_writer or collective_state)
        self.tracker = MetricTracker(monitor, mode)
        self.best_epoch: Optional[int] = None  # the epoch count at the best validation
        self.every_n_steps, self.every_s, self.keep_last = every_n_steps, every_minutes * 60, keep_last
        self.scheduled = self.builds_state and bool(every_n_steps or every_minutes)
        self.written_at = time.monotonic()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight: Optional[Future] = None

    @property
    def last(self) -> Path:
        return self.directory / "last.pt"

    @property
    def best(self) -> Path:
        return self.directory / "best.pt"

    def maybe_save(self, state: Callable[[], Dict[str, Any]], metrics: Dict[str, float]) -> None:
        # Every rank tracks the best value so all agree on it; only the writer touches disk.
        improved = self.tracker.improved(metrics)
        if improved:
            self.best_epoch = metrics.get("epoch")
        if self.builds_state:
            self._submit(state, improved)

    def on_step(self, state: Callable[[], Dict[str, Any]], step: int) -> None:
        """Write last.pt mid-epoch when checkpoint.every_n_steps or checkpoint.every_minutes says so."""
        if self.scheduled and ((self.every_n_steps and step % self.every_n_steps == 0)
                               or (self.every_s and time.monotonic() - self.written_at >= self.every_s)):
            self._submit(state, improved=False)

    def _submit(self, state: Callable[[], Dict[str, Any]], improved: bool) -> None:
        built = state()
        if self.write_shards:
            self.written_at = time.monotonic()
            self._write(built, improved)
            return
        if not self.is_writer:
            return  # its part of a collective state is done
        copy = snapshot(built)
        self.wait()
        self.written_at = time.monotonic()
        try:
            self._in_flight = self._writer.submit(self._write, copy, improved)
        except RuntimeError:  # no thread to be had (e.g. an address-space limit): write it here
            self._write(copy, improved)

    def save_last(self, state: Callable[[], Dict[str, Any]]) -> None:
        """Write last.pt now, on this thread: the run is stopping mid-epoch and a resume continues here."""
        if self.builds_state:
            self.wait()
            self._save_last(state())

    def _save_last(self, state: Dict[str, Any]) -> None:
        if self.write_shards:
            self.write_shards(state, self.last)
        elif self.is_writer:
            save_checkpoint(state, self.last)

    def adopt_best(self, best: Path) -> None:
        """A resumed run starts with the best checkpoint of the run it continues, so its test uses it."""
        if not (self.enabled and self.is_writer and best.exists() and best.resolve() != self.best.resolve()):
            return
        if is_sharded(best):
            copy_sharded(best.resolve(), self.best)
        else:
            atomic_write(self.best, lambda tmp: shutil.copyfile(best, tmp))

    def _write(self, state: Dict[str, Any], improved: bool) -> None:
        self._save_last(state)
        if not self.is_writer:
            return
        if improved:
            atomic_link(self.last, self.best)
        if self.keep_last:
            self._keep_recent(state["step"])
        if improved or self.keep_last:
            prune_sharded(self.directory)  # what best.pt or step-<step>.pt no longer links to

    def _keep_recent(self, step: int) -> None:
        """Name the durable last.pt step-<step>.pt too; only then remove what keep_last no longer keeps."""
        atomic_link(self.last, self.directory / f"step-{step}.pt")
        kept = sorted(self.directory.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
        for old in kept[:-self.keep_last]:
            old.unlink(missing_ok=True)

    def wait(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()  # a failed write raises here, on the training thread

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.tracker.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.tracker.best, self.best_epoch = state["best"], state.get("best_epoch")  # none before runlab kept it


class EarlyStopping:
    """Stops training after ``patience`` validations (epochs, unless trainer.val_every_n_steps validates by
    steps) without an improvement of ``min_delta``."""

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float, enabled: bool):
        self.tracker, self.patience, self.enabled = MetricTracker(monitor, mode, min_delta), patience, enabled
        self.bad_validations = 0

    def update(self, metrics: Dict[str, float]) -> bool:
        """Record one validation's metrics; True when training should stop."""
        self.bad_validations = 0 if self.tracker.improved(metrics) else self.bad_validations + 1
        return self.exhausted()

    def exhausted(self) -> bool:
        return self.enabled and self.bad_validations >= self.patience

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.tracker.best, "bad_validations": self.bad_validations}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # "bad_epochs": a checkpoint of a runlab that validated once per epoch
        self.tracker.best, self.bad_validations = state["best"], state.get("bad_validations", state.get("bad_epochs"))


def find_latest_checkpoint(search_dir: Path, exclude: Optional[Path]) -> Optional[Path]:
    """The most recently written last.pt under ``search_dir`` outside the run dir ``exclude``."""
    candidates = [p for p in Path(search_dir).glob("**/checkpoints/last.pt")
                  if exclude not in p.parents and p.exists()]  # a link whose sharded checkpoint was not copied along
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)
