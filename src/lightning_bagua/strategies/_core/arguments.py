"""The strategies' arguments, checked before any process starts, and the reduction both strategies offer."""

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_bagua.engine import Algorithm
from lightning_bagua.engine.autotune import AutotuneSetting, autotune_from_environment
from lightning_bagua.engine.communication import gloo_threads_batch_scheduled
from lightning_bagua.engine.data_parallel import check_bucket_cap_mb

__all__ = [
    "START_METHODS",
    "autotune_metrics",
    "check_engine_arguments",
    "check_flag",
    "check_process_group_backend",
    "check_start_method",
    "check_telemetry_and_autotune",
    "fill_load_balancing_samplers",
    "reduce_over_all_processes",
    "telemetry_metrics",
]

# Names that mean the average, in any letter case; Gloo has no AVG, so an average is a sum divided by the world size.
_MEAN_NAMES = ("mean", "avg")


def check_engine_arguments(
    algorithm: str | Algorithm, flatten: bool, bucket_cap_mb: float | None, bagua_kwargs: dict[str, Any]
) -> Algorithm:
    """Check the engine's arguments and build the algorithm from them.

    Args:
        algorithm: a registered name or an :class:`~lightning_bagua.engine.Algorithm` instance.
        flatten: whether gradients are views into the buckets.
        bucket_cap_mb: the bucket size in MiB, or ``None`` for the default.
        bagua_kwargs: the algorithm's keywords (only with a name).

    Returns:
        The configured algorithm.
    """
    if not isinstance(flatten, bool):
        raise TypeError(
            f"`flatten` must be a bool, got {flatten!r} ({type(flatten).__name__}). Pass True to let gradients"
            " live in the communication buckets (no copies), or False to keep them separate."
        )
    built = _build_algorithm(algorithm, bagua_kwargs)
    check_bucket_cap_mb(bucket_cap_mb)
    gloo_threads_batch_scheduled()  # its environment variable is checked before any process group starts
    return built


def check_process_group_backend(backend: Any) -> None:
    """Raise unless ``backend`` is ``None`` or names backends torch knows, alone or per device (``"cpu:gloo,..."``).

    Args:
        backend: the strategy's ``process_group_backend`` argument.
    """
    if backend is None:
        return
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    hint = (
        f"`process_group_backend` must be one of {', '.join(map(repr, known))}, or one per device such as"
        f" 'cpu:gloo,cuda:nccl'; leave it out to choose from the device. Got {backend!r}"
    )
    if not isinstance(backend, str):
        raise TypeError(f"{hint} ({type(backend).__name__}).")
    names = [part.split(":", 1)[1] if ":" in part else part for part in backend.split(",")]
    if not all(name.strip().lower() in known for name in names):
        raise ValueError(f"{hint}.")


START_METHODS = ("popen", "spawn", "fork", "forkserver")
"""How Lightning may start the processes of one node, as for its ``DDPStrategy``."""


def check_start_method(start_method: Any) -> str:
    """Return ``start_method`` if Lightning's launchers know it; raise a ``ValueError`` naming the choices otherwise.

    Args:
        start_method: the strategy's ``start_method`` argument.

    Returns:
        The value.
    """
    if not isinstance(start_method, str) or start_method not in START_METHODS:
        raise ValueError(
            f"`start_method` must be one of {', '.join(map(repr, START_METHODS))}, got {start_method!r}. Use"
            " 'popen' (the default: the script is run again for each process) unless your script cannot be rerun,"
            " as in a notebook ('fork') or when processes must be spawned from this one ('spawn')."
        )
    return start_method


def check_flag(name: str, value: Any) -> bool:
    """Return ``value`` if it is a ``bool``; raise a ``TypeError`` naming the argument otherwise.

    Args:
        name: the argument's name, for the message.
        value: the value given.

    Returns:
        The value.
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__}).")
    return value


def check_telemetry_and_autotune(telemetry: Any, autotune: Any) -> tuple[bool, bool]:
    """Check the two measurement flags; ``autotune=None`` follows ``BAGUA_AUTOTUNE``.

    Args:
        telemetry: the strategy's ``telemetry`` argument.
        autotune: the strategy's ``autotune`` argument.

    Returns:
        ``(telemetry, autotune)`` as bools.
    """
    if not isinstance(telemetry, bool):
        raise TypeError(
            f"`telemetry` must be a bool, got {telemetry!r} ({type(telemetry).__name__}). Pass True to measure and"
            " log each step's communication."
        )
    if autotune is None:
        autotune = autotune_from_environment()
    elif not isinstance(autotune, bool):
        raise TypeError(
            f"`autotune` must be a bool or None, got {autotune!r} ({type(autotune).__name__}). Pass True to tune the"
            " bucket size during the first steps, or None to follow BAGUA_AUTOTUNE."
        )
    return telemetry, autotune


def reduce_over_all_processes(
    tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None, caller: str
) -> Tensor | Any:
    """Reduce ``tensor`` in place over ``group`` as Lightning's ``DDPStrategy`` does; anything else comes back as is.

    Takes what Lightning's DDP takes, with the same results: an op name in any letter case (``"sum"``, ``"MAX"``;
    ``"mean"``/``"avg"`` average, on every backend) or a ``ReduceOp`` member, and any process group. On top of
    that, ``None`` and ``ReduceOp.AVG`` average too (as lightning-bagua 0.1.0 did), also on Gloo.

    Args:
        tensor: the value to reduce.
        group: the process group; ``None`` for all processes.
        reduce_op: the reduction (see above).
        caller: the method's name, for messages.

    Returns:
        ``tensor`` itself, holding the result on every process of the group (an integer tensor's average rounded
        toward zero, as with DDP); unchanged where no process group is initialised.
    """
    if not isinstance(tensor, Tensor):
        return tensor
    op, average = _resolve_reduce_op(reduce_op, caller)
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = dist.group.WORLD if group is None else group
    dist.all_reduce(tensor, op=op, group=group)
    if not average:
        return tensor
    world_size = dist.get_world_size(group)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(world_size)
    return tensor.copy_(tensor / world_size)


def _resolve_reduce_op(reduce_op: ReduceOp | str | None, caller: str) -> tuple[Any, bool]:
    """Return the op ``all_reduce`` runs and whether the result is then divided by the world size."""
    if reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in _MEAN_NAMES):
        return ReduceOp.SUM, True
    if isinstance(reduce_op, str):
        # PREMUL_SUM needs a factor (torch builds it with _make_nccl_premul_sum): no name can stand for it.
        named = {name: op for name, op in ReduceOp.RedOpType.__members__.items() if name not in ("AVG", "PREMUL_SUM")}
        member = named.get(reduce_op.upper())
        if member is None:
            names = ", ".join(repr(name.lower()) for name in named)
            raise ValueError(
                f"{caller}: unsupported `reduce_op` {reduce_op!r}. Use a torch.distributed.ReduceOp member or its name"
                f" in any letter case: 'mean' (or 'avg', None), {names}."
            )
        return member, False
    if reduce_op == ReduceOp.AVG:
        return ReduceOp.SUM, True
    if isinstance(reduce_op, (ReduceOp, ReduceOp.RedOpType)):
        return reduce_op, False
    raise ValueError(
        f"{caller}: unsupported `reduce_op` {reduce_op!r} ({type(reduce_op).__name__}). Use a"
        " torch.distributed.ReduceOp member or its name as a string, e.g. 'sum' or 'mean'."
    )


def telemetry_metrics(record: Mapping[str, float]) -> dict[str, float]:
    """Name a telemetry record's values as both strategies publish them: ``bagua/<key>``, the step index left out.

    Args:
        record: a record of :class:`~lightning_bagua.engine.CommunicationTelemetry`.

    Returns:
        Metric name to value.
    """
    return {f"bagua/{key}": value for key, value in record.items() if key != "step"}


def autotune_metrics(decision: AutotuneSetting) -> dict[str, float]:
    """Name the autotuner's choice as both strategies publish it.

    Args:
        decision: the chosen setting.

    Returns:
        Metric name to value.
    """
    return {
        "bagua/autotune/bucket_cap_mb": decision.bucket_cap_mb,
        "bagua/autotune/hierarchical": float(decision.hierarchical),
    }


def fill_load_balancing_samplers(dataloader: object, world_size: int, global_rank: int) -> None:
    """Give the dataloader's load-balancing samplers this process's place, where they were built without one.

    Args:
        dataloader: a dataloader the framework prepared.
        world_size: the number of processes.
        global_rank: this process's rank.
    """
    # Imported here: the strategies should not load the data utilities unless a dataloader comes by.
    from lightning_bagua.data.samplers import LoadBalancingDistributedSampler

    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, LoadBalancingDistributedSampler):
            sampler._fill_distributed(world_size, global_rank)


def _build_algorithm(algorithm: str | Algorithm, bagua_kwargs: dict[str, Any]) -> Algorithm:
    if isinstance(algorithm, Algorithm):
        if bagua_kwargs:
            raise TypeError(
                f"Algorithm keywords {sorted(bagua_kwargs)} were given with an Algorithm instance ({algorithm!r})."
                " Pass them to the algorithm's constructor, or give the algorithm by name."
            )
        return algorithm
    return Algorithm.init(algorithm, **bagua_kwargs)
