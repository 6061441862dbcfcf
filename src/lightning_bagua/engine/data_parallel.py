"""``BaguaDistributedDataParallel``: torch's DDP reducer driven by a Bagua algorithm."""

import functools
import inspect
import logging
import math
import os
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_bagua.engine._torch_compat import backward_context_out_of_tls, first_bucket_capped_at
from lightning_bagua.engine.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from lightning_bagua.engine.bucket_layout import BucketLayout
from lightning_bagua.engine.communication import (
    CommunicationCounter,
    CommunicationGroups,
    CommunicationHook,
    OrderedExecutor,
)
from lightning_bagua.engine.telemetry import CommunicationTelemetry

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_CUDA_BUCKET_CAP_MB",
    "BaguaDistributedDataParallel",
    "check_bucket_cap_mb",
    "check_timeout",
    "default_bucket_cap_mb",
    "warn_about_node_layout",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_CAP_MB = 10.0
"""The default bucket size off CUDA, in MiB: Bagua's."""
DEFAULT_CUDA_BUCKET_CAP_MB = 100.0
"""The default bucket size on CUDA, in MiB: four times torch's DDP's, for fewer hook calls on the host."""


def check_bucket_cap_mb(bucket_cap_mb: Any) -> None:
    """Raise a ``ValueError`` unless ``bucket_cap_mb`` is ``None`` or a finite positive number of MiB.

    Args:
        bucket_cap_mb: the bucket size given.
    """
    if bucket_cap_mb is not None and (
        not isinstance(bucket_cap_mb, (int, float))
        or isinstance(bucket_cap_mb, bool)
        or not math.isfinite(bucket_cap_mb)
        or bucket_cap_mb <= 0
    ):
        raise ValueError(f"`bucket_cap_mb` must be a positive number of MiB, got {bucket_cap_mb!r}.")


def check_timeout(timeout: Any) -> None:
    """Raise unless ``timeout`` is ``None`` or a positive ``timedelta``.

    Args:
        timeout: the collective timeout given.
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"`timeout` must be a datetime.timedelta or None, got {timeout!r} ({type(timeout).__name__})."
            " Pass e.g. timeout=timedelta(seconds=60)."
        )
    if timeout is not None and timeout <= timedelta(0):
        # torch would take it and fail the first join with a timeout that reads like a wrong address.
        raise ValueError(
            f"`timeout` must be positive: it bounds every collective, got {timeout!r}. Pass e.g."
            " timeout=timedelta(minutes=30), or None for torch's default."
        )


# Messages already logged by this process: rewrapping a model (autotuning) must not repeat them.
_logged_layout_warnings: set[str] = set()


def warn_about_node_layout(algorithm: Algorithm, groups: CommunicationGroups) -> None:
    """Warn once, from rank zero, when a hierarchical algorithm's node layout defeats its purpose.

    That is when all ranks form a single node (:attr:`Algorithm.single_node_effect` says what is communicated
    then), or when the ranks' hosts showed no layout the two-level groups can use.

    Args:
        algorithm: the wrapped model's algorithm.
        groups: the communicators it runs on, with their node layout.
    """
    layout, name = groups.layout, algorithm.name
    if not (algorithm.hierarchical and algorithm.warns_about_node_layout) or groups.rank != 0 or layout.world_size == 1:
        return
    if not layout.trusted:
        by_rank = ", ".join(f"{rank}: {host}" for rank, host in enumerate(layout.hosts))
        message = (
            f"{name} (hierarchical=True): the hosts of the {layout.world_size} ranks ({by_rank}) show no node layout"
            " the two levels can use, which needs the same number of consecutive ranks on every host. Every rank"
            f" counts as its own node instead: {name} communicates among all ranks as with hierarchical=False, and"
            " nothing is reduced inside a host first. To change it, number the ranks host by host and set"
            " LOCAL_WORLD_SIZE (or the wrapper's `ranks_per_node`) to the processes on each host; to silence this,"
            " pass hierarchical=False."
        )
    elif layout.num_nodes == 1:
        given_by = {
            "argument": f"ranks_per_node={layout.ranks_per_node}",
            "LOCAL_WORLD_SIZE": f"LOCAL_WORLD_SIZE={layout.ranks_per_node}",
            "hosts": f"every rank runs on host {layout.hosts[0] if layout.hosts else '?'}",
        }.get(layout.source, "nothing gives the processes per node")
        message = (
            f"{name} (hierarchical=True) found a single node of {layout.world_size} ranks ({given_by}), so"
            f" {algorithm.single_node_effect}. If the ranks run on several hosts, give the processes per host"
            " (LOCAL_WORLD_SIZE, the wrapper's `ranks_per_node`, or the Trainer's `devices` and `num_nodes`); to"
            f" run {name}'s own communication among all ranks, pass hierarchical=False."
        )
    else:
        return
    if message not in _logged_layout_warnings:
        _logged_layout_warnings.add(message)
        log.warning(message)


def default_bucket_cap_mb(device: torch.device | None = None) -> float:
    """Return the bucket size to use when none is given, in MiB.

    ``BAGUA_DEFAULT_BUCKET_SIZE`` (bytes) when set: ``lightning_bagua.launch --default_bucket_size`` sets it for its
    children, as Bagua's launcher did. Otherwise :data:`DEFAULT_CUDA_BUCKET_CAP_MB` (100 MiB) for a CUDA ``device``
    and :data:`DEFAULT_BUCKET_CAP_MB` (Bagua's 10 MiB) for any other. On GPUs over a fast link the step waits on the
    host, and every bucket costs a communication hook call on it (torch's own Python hooks pay it too). On two
    H200s, 100 MiB buckets shortened the NVLink step of every algorithm measured against DDP's 25 MiB, and changed
    the step over shaped sockets by a few percent either way (``benchmarks/results/gpu_bucket_cap_sockets.md`` and
    ``step_breakdown_bucket_cap_interleaved.md``).

    Args:
        device: the device the gradients live on; the CPU default when ``None``.
    """
    value = os.environ.get("BAGUA_DEFAULT_BUCKET_SIZE")
    if value is None:
        return DEFAULT_CUDA_BUCKET_CAP_MB if device is not None and device.type == "cuda" else DEFAULT_BUCKET_CAP_MB
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"BAGUA_DEFAULT_BUCKET_SIZE={value!r} must be a positive number of bytes.")
    return size / 1024**2


class BaguaDistributedDataParallel(DistributedDataParallel):
    """Replicate a module over a process group and communicate with a Bagua algorithm.

    This is torch's :class:`~torch.nn.parallel.DistributedDataParallel` (its reducer buckets gradients and
    starts each bucket's communication as soon as the bucket is ready, overlapping backward) with the
    algorithm's communication hook registered, on communicators of the engine's own. Everything DDP offers
    still works: ``no_sync()``, ``require_backward_grad_sync``, ``_ddp_params_and_buffers_to_ignore``.

    Args:
        module: the module to replicate; its parameters must be on one device.
        optimizers: the optimizers that update ``module`` (algorithms that act around the step need them;
            they can also be bound later with :meth:`bind_optimizers`).
        algorithm: the algorithm, or its registry name; defaults to ``gradient_allreduce``.
        process_group: the group to replicate over; the default group when ``None``. Every rank of the default
            group must construct the wrapper, since the engine creates communicators of its own.
        gradient_as_bucket_view: let gradients be views into the flat bucket buffers, so no copy is made
            before or after communication (Bagua's ``flatten``).
        find_unused_parameters: as in DDP.
        bucket_cap_mb: bucket size in MiB; :func:`default_bucket_cap_mb` when ``None`` (100 MiB on CUDA,
            Bagua's 10 MiB elsewhere).
        ranks_per_node: processes per node, for hierarchical algorithms; read from ``LOCAL_WORLD_SIZE`` when
            ``None``, and derived from the hosts the ranks run on (gathered once, here) if that is unset too.
        bagua_module_name: a name for this model in logs; derived from the module when ``None``.
        timeout: how long the engine's collectives may wait before they fail; torch's default when ``None``.
        telemetry: measure each step's communication (:attr:`telemetry`); off by default, and then nothing is
            measured at all.
        communication_counter: record into this counter instead of a new one (to keep counting across
            :meth:`rewrapped` wrappers of one model).
        **ddp_kwargs: further keywords for DDP (``device_ids``, ``broadcast_buffers``, ``static_graph``, ...).

    Example::

        model = BaguaDistributedDataParallel(model, optimizers=[optimizer], algorithm="gradient_allreduce")
        loss = model(batch).sum()
        loss.backward()  # gradients are averaged over all ranks
        optimizer.step()
    """

    def __init__(
        self,
        module: Module,
        optimizers: Sequence[Optimizer] = (),
        algorithm: Algorithm | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | None = None,
        ranks_per_node: int | None = None,
        bagua_module_name: str | None = None,
        timeout: timedelta | None = None,
        telemetry: bool = False,
        communication_counter: CommunicationCounter | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if algorithm is None:
            algorithm = GradientAllReduceAlgorithm()
        elif isinstance(algorithm, str):
            algorithm = Algorithm.init(algorithm)
        elif not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"`algorithm` must be an Algorithm or an algorithm name, got {algorithm!r}"
                f" ({type(algorithm).__name__})."
            )
        if not isinstance(module, Module):
            raise TypeError(f"`module` must be a torch.nn.Module, got {module!r} ({type(module).__name__}).")
        if isinstance(optimizers, Optimizer) or not all(isinstance(o, Optimizer) for o in optimizers):
            raise TypeError(
                f"`optimizers` must be a list of torch.optim.Optimizer, got {optimizers!r}. Pass e.g."
                " optimizers=[optimizer]."
            )
        if not isinstance(gradient_as_bucket_view, bool):
            raise TypeError(f"`gradient_as_bucket_view` must be a bool, got {gradient_as_bucket_view!r}.")
        if not isinstance(telemetry, bool):
            raise TypeError(f"`telemetry` must be a bool, got {telemetry!r} ({type(telemetry).__name__}).")
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(
                f"`ranks_per_node` must be a positive int, got {ranks_per_node!r}; None reads LOCAL_WORLD_SIZE."
            )
        check_bucket_cap_mb(bucket_cap_mb)
        check_timeout(timeout)
        _check_ddp_keywords(ddp_kwargs, algorithm)
        _merge_ignored_parameters(module)
        _refuse_sparse_gradients(module)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        reducer_cap_mb = default_bucket_cap_mb(device) if bucket_cap_mb is None else float(bucket_cap_mb)
        with first_bucket_capped_at(reducer_cap_mb):
            super().__init__(
                module,
                process_group=process_group,
                gradient_as_bucket_view=gradient_as_bucket_view,
                find_unused_parameters=find_unused_parameters,
                bucket_cap_mb=reducer_cap_mb,
                **ddp_kwargs,
            )
        # What `rewrapped()` needs to build an equal wrapper with another bucket size or algorithm.
        self._bagua_init_kwargs: dict[str, Any] = {
            "process_group": process_group,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
            "bucket_cap_mb": bucket_cap_mb,
            "ranks_per_node": ranks_per_node,
            "bagua_module_name": bagua_module_name,
            "timeout": timeout,
            "telemetry": telemetry,
            **ddp_kwargs,
        }
        self._bagua_bucket_cap_mb = reducer_cap_mb
        self.bagua_algorithm: Algorithm = algorithm
        self.bagua_module_name: str = bagua_module_name or f"{type(module).__name__}_{id(module)}"
        self.communication_counter = (
            communication_counter if communication_counter is not None else CommunicationCounter()
        )
        self._bagua_groups = CommunicationGroups.create(
            process_group, ranks_per_node, algorithm.hierarchical, timeout, device
        )
        warn_about_node_layout(algorithm, self._bagua_groups)
        self._bagua_executor = OrderedExecutor(device)
        named_parameters = tuple(
            (name, parameter)
            for name, parameter in module.named_parameters()
            if parameter.requires_grad and name not in self.parameters_to_ignore
        )
        context = AlgorithmContext(
            self._bagua_groups,
            self.communication_counter,
            self._bagua_executor,
            device,
            named_parameters,
            timeout,
            reducer_cap_mb,
        )
        try:
            self._bagua_impl: AlgorithmImpl = algorithm.reify(context)
        except BaseException:
            # The algorithm refused this layout (an odd ring for shift_one, say): release what was built for it.
            self._bagua_executor.close()
            self._bagua_groups.close()
            raise
        state, hook = self._bagua_impl.communication_hook()
        self._bagua_layout = BucketLayout(named_parameters)
        hook = self._bagua_layout.wrap_hook(hook)
        self._bagua_telemetry: CommunicationTelemetry | None = None
        if telemetry:
            self._bagua_telemetry = CommunicationTelemetry(self.communication_counter, self._bagua_impl, device)
            self._bagua_impl.telemetry = self._bagua_telemetry
            hook = self._bagua_telemetry.wrap_hook(hook)
        self.register_comm_hook(state, _without_backward_context(hook))
        self._bagua_optimizers: list[Optimizer] = []
        self._bagua_closed = False
        self.bind_optimizers(optimizers)
        log.debug("%s: wrapped with %r over %d ranks", self.bagua_module_name, algorithm, self._bagua_groups.world_size)

    @property
    def bagua_optimizers(self) -> list[Optimizer]:
        """The optimizers bound to this model."""
        return list(self._bagua_optimizers)

    @property
    def bagua_algorithm_impl(self) -> AlgorithmImpl:
        """The algorithm bound to this model (its hook state, buffers and threads)."""
        return self._bagua_impl

    @property
    def communication_groups(self) -> CommunicationGroups:
        """The engine's own communicators and the node layout."""
        return self._bagua_groups

    @property
    def bucket_cap_mb(self) -> float:
        """The gradient bucket size this wrapper was built with, in MiB."""
        return self._bagua_bucket_cap_mb

    @property
    def telemetry(self) -> CommunicationTelemetry | None:
        """The per-step communication telemetry, or ``None`` when the wrapper was built without ``telemetry=True``.

        ``model.telemetry.end_step()`` closes the current step and returns its record as a dict;
        ``model.telemetry.last_step`` is the last closed one (steps also close by themselves at the next forward).
        """
        return self._bagua_telemetry

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module, letting the algorithm act first on passes that record gradients in training mode."""
        # The wrapped module's mode, not the wrapper's: Lightning's validation inside fit puts the wrapper in eval
        # mode and restores only the LightningModule's own modules afterwards.
        if torch.is_grad_enabled() and self.module.training:
            if self._bagua_telemetry is not None:
                self._bagua_telemetry.on_forward_start()
            self._bagua_impl.on_forward_start(self.require_backward_grad_sync)
        return super().forward(*inputs, **kwargs)

    def rewrapped(
        self, bucket_cap_mb: float | None = None, algorithm: Algorithm | None = None
    ) -> "BaguaDistributedDataParallel":
        """Close this wrapper and return a new one over the same module, with another bucket size or algorithm.

        torch's reducer fixes its buckets when it is built, so a new bucket size needs a new wrapper. Call it
        between steps (no backward in flight), on every rank at the same step: building the wrapper is a
        collective. The module, its gradients (moved into the new buckets), the bound optimizers, the counter
        and every other setting carry over; the algorithm is bound anew, so use it for algorithms whose state
        lives in the optimizer or in the weights alone (the gradient-bucket algorithms).

        Args:
            bucket_cap_mb: the new bucket size in MiB; this wrapper's when ``None``.
            algorithm: the new algorithm; this wrapper's when ``None``.

        Returns:
            The new wrapper; this one is closed and must not be used again.
        """
        kwargs = dict(self._bagua_init_kwargs)
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        self.close()
        return BaguaDistributedDataParallel(
            self.module,
            optimizers=self._bagua_optimizers,
            algorithm=self.bagua_algorithm if algorithm is None else algorithm,
            communication_counter=self.communication_counter,
            **kwargs,
        )

    def bagua_state_dict(self) -> dict[str, Any]:
        """Return the algorithm's state on this rank (see :meth:`AlgorithmImpl.state_dict`), named for its kind.

        Save it beside the model's and the optimizers' ``state_dict()`` to resume exactly. It also holds the
        gradient buckets of the last step (parameter names per bucket), which a new wrapper replays on its first
        step so that compressed algorithms round it as the uninterrupted run did (see :class:`BucketLayout`).

        Returns:
            ``{"algorithm": <registered name>, "state": <the algorithm's state>, "bucket_layout": <names per bucket>}``.
        """
        return {
            "algorithm": self.bagua_algorithm.name,
            "state": self._bagua_impl.state_dict(),
            "bucket_layout": self._bagua_layout.buckets,
        }

    def load_bagua_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`bagua_state_dict` returned, after the module and optimizers have been restored.

        Args:
            state: a dict from :meth:`bagua_state_dict`.

        Raises:
            ValueError: if it was written by another algorithm, or its bucket layout names other parameters.
        """
        if state.get("algorithm") != self.bagua_algorithm.name:
            raise ValueError(
                f"The checkpoint holds state of the {state.get('algorithm')!r} algorithm, but this model trains with"
                f" {self.bagua_algorithm.name!r}. Resume with the same algorithm, or load the weights alone"
                " (without the algorithm state) to switch."
            )
        # Checked first, so that a layout that does not fit leaves the algorithm state as it was. Checkpoints
        # written before the layout was saved resume with torch's own first bucket.
        if state.get("bucket_layout"):
            self._bagua_layout.restore(state["bucket_layout"])
        self._bagua_impl.load_state_dict(state["state"])

    def bind_optimizers(self, optimizers: Iterable[Optimizer]) -> None:
        """Tell the algorithm which optimizers update this model (replacing any bound before).

        Args:
            optimizers: torch optimizers over this model's parameters.
        """
        optimizers = list(optimizers)
        for optimizer in optimizers:
            if not isinstance(optimizer, Optimizer):
                raise TypeError(f"Expected torch.optim.Optimizer instances, got {optimizer!r}.")
        self._bagua_optimizers = optimizers
        self._bagua_impl.bind_optimizers(optimizers)

    def close(self) -> None:
        """Stop the engine's threads and destroy its communicators; the wrapped module stays usable.

        Call it when training with this wrapper is over (the Lightning strategy does so in ``teardown``), and before
        ``dist.destroy_process_group()``: a CUDA graph that captured NCCL collectives, which this drops, keeps its
        communicator from being destroyed. Calling it twice does nothing.
        """
        if self._bagua_closed:
            return
        self._bagua_closed = True
        self._bagua_impl.close()
        self._bagua_executor.close()
        self._bagua_groups.close()


def _merge_ignored_parameters(module: Module) -> None:
    # Bagua users list parameters and buffers to leave alone under `_bagua_params_and_buffers_to_ignore`;
    # DDP reads `_ddp_params_and_buffers_to_ignore` only, so the union goes there.
    bagua_ignored = getattr(module, "_bagua_params_and_buffers_to_ignore", None)
    if not bagua_ignored:
        return
    ddp_ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", ())
    merged = list(dict.fromkeys([*ddp_ignored, *bagua_ignored]))
    module._ddp_params_and_buffers_to_ignore = merged  # type: ignore[assignment]


def _check_ddp_keywords(ddp_kwargs: dict[str, Any], algorithm: Algorithm) -> None:
    # Checked before torch's constructor, which would fail only after the first collectives of the wrapper began.
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    unknown = [name for name in ddp_kwargs if name not in accepted]
    if not unknown:
        return
    of_algorithm = [name for name in unknown if name in algorithm.keywords()]
    if of_algorithm:
        settings = ", ".join(f"{name}={ddp_kwargs[name]!r}" for name in of_algorithm)
        verb = "configures" if len(of_algorithm) == 1 else "configure"
        raise TypeError(
            f"{', '.join(of_algorithm)} {verb} the algorithm {algorithm.name!r}, not the wrapper: pass"
            f" algorithm=Algorithm.init({algorithm.name!r}, {settings})."
        )
    raise TypeError(
        f"Unknown keyword argument(s) {', '.join(map(repr, unknown))} for BaguaDistributedDataParallel. Beside its own"
        " it takes torch's DistributedDataParallel keywords: "
        f"{', '.join(name for name in accepted if name not in ('self', 'module'))}."
    )


def _refuse_sparse_gradients(module: Module) -> None:
    # Every algorithm communicates dense flat buckets; DDP would hand a sparse gradient to the hook as it is, and
    # the ranks would silently step with unsynchronised gradients. Refused before any collective runs.
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    sparse = []
    for name, submodule in module.named_modules():
        if getattr(submodule, "sparse", False) is not True:
            continue
        trained = [
            key
            for key, parameter in submodule.named_parameters(recurse=False)
            if parameter.requires_grad and (f"{name}.{key}" if name else key) not in ignored
        ]
        if trained:
            sparse.append(name or type(submodule).__name__)
    if sparse:
        raise ValueError(
            f"Bagua's algorithms communicate dense gradients, but {', '.join(sparse)} produce(s) sparse gradients"
            " (sparse=True). Construct them with sparse=False, or list their parameters in the module's"
            " `_bagua_params_and_buffers_to_ignore` and synchronise them yourself."
        )


def _without_backward_context(hook: CommunicationHook) -> CommunicationHook:
    """Return ``hook`` run without the backward's Python context in torch's thread-local state.

    What the hook issues then holds no Python object, so a Gloo worker can free it without the GIL
    (:func:`~lightning_bagua.engine._torch_compat.backward_context_out_of_tls` says why that matters).
    """

    @functools.wraps(hook)  # DDP and the telemetry tests see the hook it wraps
    def hook_without_context(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        with backward_context_out_of_tls():
            return hook(state, bucket)

    return hook_without_context
