"""The checkpoint format both strategies write and read: one versioned entry.

Version 2, written by the Trainer and Fabric strategies alike, under ``"bagua"`` by the Trainer strategy and under
``"bagua_algorithm_state"`` (the reserved key Fabric's docs name) by the Fabric strategy::

    checkpoint["bagua"] = {
        "version": 2,
        "world_size": n,
        "modules": {
            "<name>": {                       # "model" under the Trainer; the key given to fabric.save under Fabric
                "algorithm": "decentralized",
                "algorithm_states": [...],    # each rank's BaguaDistributedDataParallel.bagua_state_dict()
                "ranks": [...] or None,       # each rank's {"state_dict", "optimizer_states", "extra"} where ranks
                                              # differ ("extra": the framework's other per-rank entries)
                "averaged": bool,             # the top-level weights are the ranks' average (average_before_save)
            },
        },
    }

Per-rank weights are saved exactly when the algorithm's class says its ranks hold different weights
(:attr:`~lightning_bagua.engine.Algorithm.ranks_hold_different_weights`), so a registered third-party algorithm
gets them too. Older entries still load: the Trainer's version 1 (one module, the fields above at the top level),
Fabric's unversioned ``"bagua_algorithm_state"`` (each module's per-rank algorithm states only), and Fabric's version
2 under ``"bagua"`` (written before the Fabric strategy moved it to its documented key).
"""

import io
import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine import BaguaDistributedDataParallel

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_KEY",
    "CHECKPOINT_VERSION",
    "FABRIC_CHECKPOINT_KEY",
    "ModuleEntry",
    "RankResume",
    "attach_entries",
    "average_nested",
    "average_state_dicts",
    "averaged_weights",
    "entry_restores_something",
    "gather_module_entry",
    "gather_to_rank_zero",
    "make_entry",
    "module_entries",
    "rank_resume",
    "refuse_reserved_keys",
]

CHECKPOINT_KEY = "bagua"
CHECKPOINT_VERSION = 2
FABRIC_CHECKPOINT_KEY = "bagua_algorithm_state"
"""Where the Fabric strategy saves its entry; before checkpoint version 2 it held the per-rank algorithm states only."""


class ModuleEntry(TypedDict):
    """One wrapped module's part of the ``"bagua"`` entry (see the module docstring)."""

    algorithm: str
    algorithm_states: list[dict[str, Any]]
    ranks: list[dict[str, Any]] | None
    averaged: bool


class RankResume:
    """What one rank resumes a module from: its algorithm state and, where ranks' weights differ, its weights.

    Args:
        algorithm_state: this rank's ``bagua_state_dict()`` (rank 0's when resizing, for its bucket layout).
        state_dict: this rank's module weights, or ``None`` where every rank resumes from the shared ones.
        optimizer_states: this rank's optimizer states, in the framework's own layout, or ``None``.
        extra: this rank's other checkpoint entries that differ between ranks (under the Trainer, the callbacks'
            state and ``WeightAveraging``'s current weights); empty where none were saved.
        resized_from: when the checkpoint was written by another number of processes, every saved rank's
            ``bagua_state_dict()``, which :meth:`algorithm_state_for` re-shards; ``None`` otherwise.
    """

    def __init__(
        self,
        algorithm_state: dict[str, Any],
        state_dict: Any | None,
        optimizer_states: Any | None,
        extra: dict[str, Any] | None = None,
        resized_from: list[dict[str, Any]] | None = None,
    ) -> None:
        self.algorithm_state = algorithm_state
        self.state_dict = state_dict
        self.optimizer_states = optimizer_states
        self.extra = extra or {}
        self.resized_from = resized_from

    def algorithm_state_for(self, wrapped: BaguaDistributedDataParallel) -> dict[str, Any]:
        """Return the ``bagua_state_dict()`` this rank loads into ``wrapped``, re-sharded when resizing.

        Args:
            wrapped: the module, wrapped at this run's world size.

        Returns:
            The state for :meth:`~lightning_bagua.engine.BaguaDistributedDataParallel.load_bagua_state_dict`.
        """
        if self.resized_from is None:
            return self.algorithm_state
        states = [saved.get("state") or {} for saved in self.resized_from]
        return {**self.algorithm_state, "state": wrapped.bagua_algorithm_impl.resize_state(states)}


def gather_module_entry(
    wrapped: BaguaDistributedDataParallel, weights: Mapping[str, Any] | None, average: bool, world_size: int
) -> ModuleEntry | None:
    """Gather every rank's state of one wrapped module to rank 0 (collective: every rank calls it).

    Args:
        wrapped: the module.
        weights: this rank's ``{"state_dict": ..., "optimizer_states": ..., "extra": {...}}`` when the algorithm's
            ranks hold different weights, else ``None``.
        average: write the ranks' average as the top-level weights (only with per-rank weights).
        world_size: the number of processes.

    Returns:
        The module's entry on rank 0, ``None`` on the other ranks.
    """
    own: dict[str, Any] = {"algorithm_state": wrapped.bagua_state_dict()}
    if weights is not None:
        own.update(weights)
    # Tensors reach rank 0 as CPU copies (see gather_to_rank_zero), which load on any device.
    gathered = gather_to_rank_zero(own, world_size)
    if gathered is None:
        return None
    per_rank = weights is not None
    return {
        "algorithm": wrapped.bagua_algorithm.name,
        "algorithm_states": [rank_state["algorithm_state"] for rank_state in gathered],
        "ranks": (
            [{key: value for key, value in rank.items() if key != "algorithm_state"} for rank in gathered]
            if per_rank
            else None
        ),
        "averaged": per_rank and average,
    }


def gather_to_rank_zero(own: Any, world_size: int) -> list[Any] | None:
    """Gather every rank's picklable ``own`` to rank 0 through the default group, without ``torch.save``.

    ``dist.gather_object`` pickles tensors through ``torch.save``, so a checkpoint would call it on every rank, and a
    script that replaces ``torch.save`` (as Lightning's tests do) would break the gather. Here the tensors travel as
    raw bytes in the same buffer as the rest, which plain ``pickle`` encodes: two collectives (the sizes, then the
    buffers), whatever ``own`` holds.

    Returns:
        One object per rank on rank 0 (``[own]`` without a group of several ranks), ``None`` on the other ranks.
    """
    if not (world_size > 1 and dist.is_available() and dist.is_initialized()):
        return [own]
    device = _object_device()
    payload = _encode(own).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    is_zero = dist.get_rank() == 0
    buffers = [torch.empty_like(padded) for _ in range(world_size)] if is_zero else None
    dist.gather(padded, buffers, dst=0)
    if buffers is None:
        return None
    return [_decode(buffer[: int(size.item())].cpu()) for buffer, size in zip(buffers, sizes, strict=True)]


class _TensorPickler(pickle.Pickler):
    """Pickle everything but dense tensors, which it notes by index for :func:`_encode` to append as bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor) or obj.layout != torch.strided or obj.is_quantized:
            return None
        tensor = obj.detach().cpu().contiguous()
        self.tensors.append(tensor)
        return ("tensor", len(self.tensors) - 1, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, data: Tensor, offsets: list[int]) -> None:
        super().__init__(file)
        self._data = data
        self._offsets = offsets

    def persistent_load(self, pid: Any) -> Any:
        _, index, dtype, shape = pid
        start, end = self._offsets[index], self._offsets[index + 1]
        # Cloned first: a slice of the buffer need not be aligned for a wider dtype.
        return self._data[start:end].clone().view(getattr(torch, dtype)).reshape(shape)


def _encode(obj: Any) -> Tensor:
    # Layout: [header length (8 bytes)][pickled (skeleton, tensor byte lengths)][tensor bytes, one after another].
    file = io.BytesIO()
    pickler = _TensorPickler(file)
    pickler.dump(obj)
    raw = [tensor.reshape(-1).view(torch.uint8) for tensor in pickler.tensors]
    header = pickle.dumps((file.getvalue(), [chunk.numel() for chunk in raw]), protocol=pickle.HIGHEST_PROTOCOL)
    prefix = torch.frombuffer(bytearray(len(header).to_bytes(8, "little") + header), dtype=torch.uint8)
    return torch.cat([prefix, *raw])


def _decode(buffer: Tensor) -> Any:
    length = int.from_bytes(_bytes(buffer[:8]), "little")
    skeleton, lengths = pickle.loads(_bytes(buffer[8 : 8 + length]))
    offsets = [0]
    for size in lengths:
        offsets.append(offsets[-1] + size)
    return _TensorUnpickler(io.BytesIO(skeleton), buffer[8 + length :], offsets).load()


def _bytes(chunk: Tensor) -> bytes:
    # A clone owns exactly its bytes, which its storage hands over through the buffer protocol.
    return bytes(chunk.clone().untyped_storage())


def _object_device() -> torch.device:
    # NCCL moves CUDA tensors only; Gloo (and a mixed "cpu:gloo,cuda:nccl" group) takes CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def entry_restores_something(entry: ModuleEntry, wrapped: BaguaDistributedDataParallel) -> bool:
    """Tell whether a module's entry restores anything: a state, per-rank weights, or a bucket layout that matters.

    An algorithm whose results do not depend on how gradients are bucketed (``gradient_allreduce``) and that keeps
    no state resumes from the weights and optimizer states alone, as under DDP, so its entry need not be written.

    Args:
        entry: the module's entry.
        wrapped: the module.
    """
    if entry["ranks"] is not None or any(state.get("state") for state in entry["algorithm_states"]):
        return True
    return wrapped.bagua_algorithm.results_depend_on_buckets


def make_entry(modules: Mapping[str, ModuleEntry], world_size: int) -> dict[str, Any]:
    """Return the ``"bagua"`` checkpoint entry for these modules.

    Args:
        modules: each module's entry, by name.
        world_size: the number of processes.

    Returns:
        The entry.
    """
    return {"version": CHECKPOINT_VERSION, "world_size": world_size, "modules": dict(modules)}


def averaged_weights(entry: ModuleEntry) -> dict[str, Any] | None:
    """Return the ranks' averaged weights when the entry was written with ``average_before_save``, else ``None``.

    Args:
        entry: a module's entry.

    Returns:
        The average of the ranks' ``state_dict``, or ``None``.
    """
    if not entry["averaged"] or entry["ranks"] is None:
        return None
    state_dicts = [rank["state_dict"] for rank in entry["ranks"]]
    if any(state_dict is None for state_dict in state_dicts):  # a save filter left the weights out
        return None
    return average_state_dicts(state_dicts)


def refuse_reserved_keys(state: Mapping[str, Any], owner: str) -> None:
    """Refuse a state to save that uses a key the strategy keeps the algorithm's state under.

    Args:
        state: what is about to be saved.
        owner: the strategy's class name, for the message.

    Raises:
        ValueError: ``state`` has such a key.
    """
    for reserved in (CHECKPOINT_KEY, FABRIC_CHECKPOINT_KEY):
        if reserved in state:
            raise ValueError(
                f"The state to save has a key {reserved!r}, which {owner} uses for the algorithm's state. Save your"
                " object under another name."
            )


def attach_entries(
    checkpoint: dict[str, Any],
    entries: Mapping[str, ModuleEntry],
    world_size: int,
    weights_key: Callable[[str], str],
    key: str = CHECKPOINT_KEY,
) -> dict[str, Any]:
    """Return the checkpoint with the entry for these modules, averaged weights in place where asked.

    Args:
        checkpoint: what is about to be saved; not modified.
        entries: each module's entry, by name; with none, ``checkpoint`` comes back as it is.
        world_size: the number of processes.
        weights_key: the checkpoint key of a module's weights, from its name; an entry written with
            ``average_before_save`` puts the ranks' average there.
        key: the checkpoint key of the entry: :data:`CHECKPOINT_KEY` for the Trainer strategy,
            :data:`FABRIC_CHECKPOINT_KEY` for the Fabric strategy.

    Returns:
        The checkpoint to save.
    """
    if not entries:
        return checkpoint
    checkpoint = {**checkpoint, key: make_entry(entries, world_size)}
    for name, entry in entries.items():
        averaged = averaged_weights(entry)
        if averaged is not None:
            checkpoint[weights_key(name)] = averaged
    return checkpoint


def module_entries(checkpoint: dict[str, Any], default_name: str) -> tuple[int, dict[str, ModuleEntry]] | None:
    """Read the entry of a checkpoint of any version and either key, taking the Fabric key out of ``checkpoint``.

    Args:
        checkpoint: the loaded checkpoint (or, under Fabric, what is left of it after restoring the objects).
        default_name: the module name of a version 1 entry, which held one module.

    Returns:
        ``(world_size, modules)``, or ``None`` when the checkpoint holds no Bagua state.

    Raises:
        ValueError: the entry has a version this release cannot read.
    """
    fabric_entry = checkpoint.pop(FABRIC_CHECKPOINT_KEY, None)
    saved = checkpoint.get(CHECKPOINT_KEY)
    # A versioned entry is a dict with an integer version; the unversioned one maps module names to lists.
    legacy = fabric_entry
    if isinstance(fabric_entry, dict) and isinstance(fabric_entry.get("version"), int):
        saved, legacy = fabric_entry, None
    if saved is None and legacy is not None:
        # Fabric's entry before version 2: per module, the list of every rank's bagua_state_dict().
        modules: dict[str, ModuleEntry] = {
            name: {"algorithm": states[0]["algorithm"], "algorithm_states": states, "ranks": None, "averaged": False}
            for name, states in legacy.items()
        }
        return max((len(states) for states in legacy.values()), default=1), modules
    if saved is None:
        return None
    version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
    if version == 1:
        entry: ModuleEntry = {
            "algorithm": saved["algorithm"],
            "algorithm_states": saved["algorithm_states"],
            "ranks": saved["ranks"],
            "averaged": saved["averaged"],
        }
        return saved["world_size"], {default_name: entry}
    if version != CHECKPOINT_VERSION:
        raise ValueError(
            f"The checkpoint's {CHECKPOINT_KEY!r} entry has version {version!r}; this release reads versions 1 and"
            f" {CHECKPOINT_VERSION}. Resume with the release that wrote it, or delete the entry to load the weights"
            " alone."
        )
    return saved["world_size"], saved["modules"]


def rank_resume(entry: ModuleEntry, name: str, algorithm: str, world_size: int, rank: int) -> RankResume:
    """Check that a module's entry can resume this run, and return this rank's part of it.

    A checkpoint written by another number of processes resizes (see the fault tolerance page of the docs): where
    the ranks' weights differ, every rank resumes from their average (weights, optimizer states and the other
    per-rank entries: floating-point tensors averaged, everything else rank 0's); the algorithm state is re-sharded
    by the algorithm's :meth:`~lightning_bagua.engine.AlgorithmImpl.resize_state` once the module is wrapped. Rank 0
    logs what the resize does.

    Args:
        entry: the module's entry.
        name: the module's name, for messages.
        algorithm: the algorithm this run trains the module with.
        world_size: this run's number of processes.
        rank: this process's rank.

    Returns:
        This rank's part.

    Raises:
        ValueError: another algorithm wrote it.
    """
    if entry["algorithm"] != algorithm:
        raise ValueError(
            f"The checkpoint was written while training {name!r} with the {entry['algorithm']!r} algorithm, but"
            f" this strategy uses {algorithm!r}. Resume with the same algorithm, or load the weights alone"
            " (LightningModule.load_from_checkpoint, or delete the checkpoint's 'bagua' entry) to switch."
        )
    states = entry["algorithm_states"]
    if len(states) == world_size:
        own = entry["ranks"][rank] if entry["ranks"] is not None else {"state_dict": None, "optimizer_states": None}
        # Entries written before the per-rank "extra" was saved hold weights and optimizer states only.
        return RankResume(states[rank], own["state_dict"], own["optimizer_states"], own.get("extra"))
    if rank == 0:
        _log_resize(name, algorithm, len(states), world_size, per_rank=entry["ranks"] is not None)
    if entry["ranks"] is None:
        return RankResume(states[0], None, None, resized_from=list(states))
    ranks = entry["ranks"]
    return RankResume(
        states[0],
        average_nested([saved["state_dict"] for saved in ranks]),
        average_nested([saved["optimizer_states"] for saved in ranks]),
        average_nested([saved.get("extra") or {} for saved in ranks]),
        resized_from=list(states),
    )


def _log_resize(name: str, algorithm: str, saved_world_size: int, world_size: int, per_rank: bool) -> None:
    from lightning_bagua.engine.algorithms.base import algorithm_class

    try:
        effect = algorithm_class(algorithm).resize_effect
    except ValueError:  # not registered in this process: the load itself names the problem
        effect = "its state is re-sharded by its resize_state"
    weights = (
        (
            f"every rank resumes from the average of the {saved_world_size} ranks' weights and optimizer states"
            if saved_world_size > 1
            else "every rank resumes from the one saved rank's weights and optimizer state"
        )
        if per_rank
        else "every rank resumes from the shared weights and optimizer state"
    )
    log.warning(
        "Resizing %r from %d to %d processes: %s; for the %r algorithm, %s.",
        name,
        saved_world_size,
        world_size,
        weights,
        algorithm,
        effect,
    )


def average_nested(values: list[Any]) -> Any:
    """Average the ranks' copies of one object: floating-point tensors elementwise, everything else rank 0's.

    Args:
        values: one copy per rank, of the same structure (dicts, lists and tuples of tensors and other objects).

    Returns:
        The averaged object; ``None`` when any copy is ``None`` (a save filter left it out).
    """
    first = values[0]
    if any(value is None for value in values):
        return None
    if isinstance(first, Tensor):
        if first.is_floating_point() or first.is_complex():
            return torch.stack([value.to(first.dtype) for value in values]).mean(dim=0)
        return first
    if isinstance(first, dict):
        return {
            key: average_nested([value[key] for value in values]) if all(key in value for value in values) else item
            for key, item in first.items()
        }
    if isinstance(first, (list, tuple)) and all(len(value) == len(first) for value in values):
        return type(first)(average_nested([value[index] for value in values]) for index in range(len(first)))
    return first


def average_state_dicts(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Average the ranks' floating-point tensors; everything else (counters such as BatchNorm's) stays rank 0's.

    Args:
        state_dicts: one ``state_dict`` per rank, with the same keys.

    Returns:
        The averaged ``state_dict``.
    """
    averaged = dict(state_dicts[0])
    for key, value in state_dicts[0].items():
        if isinstance(value, Tensor) and value.is_floating_point():
            averaged[key] = torch.stack([state_dict[key] for state_dict in state_dicts]).mean(dim=0)
    return averaged
