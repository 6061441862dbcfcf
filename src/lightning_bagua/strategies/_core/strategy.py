"""``BaguaStrategyCore``: what the Trainer's and Fabric's Bagua strategies share, mixed in before each one's DDP.

It holds the constructor and its read-only properties, wrapping a module, checking the optimizers against the
algorithm, joining the process group without long hangs, checkpoint entries, and failure handling. It knows no
algorithm by name or class: what differs between algorithms is asked of the algorithm
(:attr:`~lightning_bagua.engine.Algorithm.ranks_hold_different_weights`,
:meth:`~lightning_bagua.engine.Algorithm.check_optimizers`, :meth:`~lightning_bagua.engine.AlgorithmImpl.start`,
:meth:`~lightning_bagua.engine.AlgorithmImpl.stop`).
"""

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.optim import Optimizer

from lightning_bagua.engine import Algorithm, AutoDecision, BaguaDistributedDataParallel, CommunicationCounter
from lightning_bagua.engine.algorithms.auto import AutoImpl
from lightning_bagua.engine.data_parallel import check_timeout, default_bucket_cap_mb
from lightning_bagua.strategies._core import faults
from lightning_bagua.strategies._core.arguments import (
    check_engine_arguments,
    check_flag,
    check_process_group_backend,
    check_start_method,
    check_telemetry_and_autotune,
    fill_load_balancing_samplers,
)
from lightning_bagua.strategies._core.checkpoint import ModuleEntry, gather_module_entry

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment

    class _StrategyAttributes:
        """What the core uses of Lightning's and Fabric's ``DDPStrategy``, which it is mixed in before."""

        cluster_environment: ClusterEnvironment | None
        _timeout: timedelta | None
        _process_group_backend: str | None
        parallel_devices: list[torch.device] | None

        def __init__(self, **kwargs: Any) -> None: ...

        @property
        def global_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def num_processes(self) -> int: ...

        @property
        def root_device(self) -> torch.device: ...

        @property
        def launcher(self) -> Any: ...

        def _get_process_group_backend(self) -> str: ...

        def _configure_launcher(self) -> None: ...

        def process_dataloader(self, dataloader: Any) -> Any: ...

    _CoreBase = _StrategyAttributes
else:
    _CoreBase = object

__all__ = ["BaguaStrategyCore"]

log = logging.getLogger(__name__)


class BaguaStrategyCore(_CoreBase):
    """The body of both Bagua strategies (see the module docstring); its arguments are documented on each.

    A concrete class mixes it in before its package's ``DDPStrategy``, names its package's cluster environment
    and configuration error, and the keyword its ``DDPStrategy`` takes the precision plugin under.
    """

    strategy_name = "bagua"
    _bagua_environment_cls: ClassVar[type["ClusterEnvironment"]]
    _checkpoint_io_cls: ClassVar[type[Any]]
    """The default checkpoint plugin, for the concrete class's package: an ``AtomicTorchCheckpointIO``."""
    # Each Lightning package raises its own MisconfigurationException for a configuration it cannot train.
    _configuration_error: ClassVar[type[Exception]]
    _precision_keyword: ClassVar[str] = "precision_plugin"

    def __init__(
        self,
        algorithm: str | Algorithm,
        flatten: bool,
        accelerator: Any | None,
        parallel_devices: list[torch.device] | None,
        cluster_environment: "ClusterEnvironment | None",
        checkpoint_io: Any | None,
        precision_plugin: Any | None,
        *,
        process_group_backend: str | None,
        timeout: timedelta | None,
        bucket_cap_mb: float | None,
        find_unused_parameters: bool,
        telemetry: bool,
        autotune: bool | None,
        average_before_save: bool,
        start_method: str,
        bagua_kwargs: dict[str, Any],
    ) -> None:
        """Check and keep the arguments both strategies take; each public class declares them with its defaults.

        ``precision_plugin`` goes to the framework's ``DDPStrategy`` under ``_precision_keyword``, and
        ``bagua_kwargs`` are the algorithm's keywords (a dict here, ``**bagua_kwargs`` on the public classes).
        """
        check_timeout(timeout)
        check_start_method(start_method)
        check_process_group_backend(process_group_backend)
        check_flag("find_unused_parameters", find_unused_parameters)
        self._average_before_save = check_flag("average_before_save", average_before_save)
        self._algorithm = check_engine_arguments(algorithm, flatten, bucket_cap_mb, bagua_kwargs)
        self._telemetry, self._autotune = check_telemetry_and_autotune(telemetry, autotune)
        if cluster_environment is None and self._bagua_environment_cls.detect():
            cluster_environment = self._bagua_environment_cls()
        if checkpoint_io is None:
            # Lightning's default with saves a kill cannot tear (a restart must never find half a checkpoint).
            checkpoint_io = self._checkpoint_io_cls()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **{self._precision_keyword: precision_plugin},
        )
        self._flatten = flatten
        self._bagua_kwargs = dict(bagua_kwargs)
        self._bucket_cap_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)
        self._find_unused_parameters = find_unused_parameters
        self._communication_counter: CommunicationCounter | None = None
        self._last_auto_decision: AutoDecision | None = None
        # Tells one run's failure reports in the store from an earlier run's: set when a run starts.
        self._failure_scope = 0

    @property
    def algorithm(self) -> Algorithm:
        """The configured algorithm."""
        return self._algorithm

    @property
    def flatten(self) -> bool:
        """Whether gradients are views into the communication buckets."""
        return self._flatten

    @property
    def bagua_kwargs(self) -> dict[str, Any]:
        """The keywords given for the algorithm."""
        return dict(self._bagua_kwargs)

    @property
    def bucket_cap_mb(self) -> float:
        """The bucket size in MiB.

        As given, else ``BAGUA_DEFAULT_BUCKET_SIZE``, else 100 MiB on CUDA and Bagua's 10 MiB elsewhere (see
        :func:`~lightning_bagua.engine.data_parallel.default_bucket_cap_mb`).
        """
        if self._bucket_cap_mb is not None:
            return self._bucket_cap_mb
        return default_bucket_cap_mb(self.root_device if self.parallel_devices else None)

    @property
    def average_before_save(self) -> bool:
        """Whether a checkpoint's weights are the average of the ranks' instead of rank 0's, where ranks differ."""
        return self._average_before_save

    @property
    def communication_counter(self) -> CommunicationCounter | None:
        """What the engine of the most recently wrapped module communicated; ``None`` before the first wrap."""
        return self._communication_counter

    @property
    def auto_decision(self) -> AutoDecision | None:
        """What ``algorithm="auto"`` picked for the wrapped model, and why; ``None`` before the pick or without auto.

        ``strategy.auto_decision.label`` names the pick, ``.summary()`` is rank 0's log line, ``.to_dict()`` holds
        the figures behind it. It stays readable after the run, once the model is unwrapped.
        """
        for wrapped in self._bagua_wrapped_modules():
            impl = wrapped.bagua_algorithm_impl
            if isinstance(impl, AutoImpl):
                if impl.decision is not None:
                    self._last_auto_decision = impl.decision
                return impl.decision
        return self._last_auto_decision

    @classmethod
    def auto(cls, **kwargs: Any) -> Any:
        """Return the strategy with ``algorithm="auto"``: what the ``"bagua_auto"`` strategy name builds.

        Args:
            **kwargs: the strategy's other arguments, and ``auto``'s keywords (``candidates``, ``trial_steps``, ...).

        Returns:
            The strategy.
        """
        return cls(algorithm="auto", **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy as ``"bagua"`` and, with ``algorithm="auto"``, as ``"bagua_auto"`` (once each).

        Args:
            strategy_registry: the framework's strategy registry.
        """
        if "bagua" not in strategy_registry:
            strategy_registry.register("bagua", cls, description="Bagua's communication algorithms")
        if "bagua_auto" not in strategy_registry:
            strategy_registry.register(
                "bagua_auto", cls, description="Bagua, with the algorithm measured and picked", algorithm="auto"
            )

    def process_dataloader(self, dataloader: Any) -> Any:
        """Give the dataloader's load-balancing samplers this process's place, where they were built without one.

        Lightning and Fabric keep a :class:`~lightning_bagua.LoadBalancingDistributedSampler` (it is a
        ``DistributedSampler``) instead of putting their own in, so the sampler's ``num_replicas`` and ``rank``,
        when left out, come from here.

        Args:
            dataloader: the dataloader the framework prepared.

        Returns:
            The same dataloader.
        """
        dataloader = super().process_dataloader(dataloader)
        fill_load_balancing_samplers(dataloader, self.world_size, self.global_rank)
        return dataloader

    def _bagua_wrapped_modules(self) -> Sequence[BaguaDistributedDataParallel]:
        """Return the modules wrapped now, for failure handling (each strategy knows where it keeps them)."""
        raise NotImplementedError

    def _configure_launcher(self) -> None:
        """Refuse a backend the devices cannot run, then let the framework choose its launcher.

        The framework calls this when the Trainer or Fabric is built, with the devices known and no process started.
        """
        backend = self._process_group_backend
        off_cuda = {device.type for device in self.parallel_devices or [] if device.type != "cuda"}
        for device_type in sorted(off_cuda):
            if backend is not None and _backend_for_device(backend, device_type) in (None, "nccl"):
                raise self._configuration_error(
                    f"process_group_backend={backend!r} needs CUDA devices, but this run trains on"
                    f" {device_type!r}. Pass process_group_backend='gloo' (or leave it out to choose from the"
                    " device), or train on GPUs with accelerator='gpu'."
                )
        precision = getattr(self, self._precision_keyword, None)
        if getattr(precision, "scaler", None) is not None and not self._algorithm.steps_from_gradients:
            raise self._configuration_error(
                f"Algorithm {self._algorithm.name!r} steps the optimizer from a momentum it computes from the raw"
                " gradients, which the gradient scaler of precision='16-mixed' leaves scaled (and an overflow would"
                " stay in the momentum). Train with precision='bf16-mixed' or '32-true', or choose another algorithm."
            )
        super()._configure_launcher()

    def _refuse_gradient_clipping(self) -> None:
        """Raise when the algorithm's optimizer steps from something other than ``.grad``, which clipping changes."""
        if not self._algorithm.steps_from_gradients:
            raise self._configuration_error(
                f"Algorithm {self._algorithm.name!r} steps the optimizer from a momentum it computes from the raw"
                " gradients after its warm-up, so clipping `.grad` would change nothing from then on. Train without"
                " gradient clipping (lower the learning rate or lengthen the warm-up instead), or choose another"
                " algorithm."
            )

    def _join_process_group(self, set_world_ranks: Callable[[], None], join: Callable[[], None]) -> None:
        """Run the framework's ``join`` of the default group, bounded by the timeout and safe across restarts.

        Args:
            set_world_ranks: the framework's method that sets this process's rank and the world size.
            join: the framework's method that initialises the default process group.
        """
        assert self.cluster_environment is not None
        address = (self.cluster_environment.main_address, self.cluster_environment.main_port)
        # Every run joins (or finds the group joined): its failure reports get a number of their own, alike on every
        # rank. And a rank 0 that cannot join ends the ranks it started, which would wait for its store.
        self._failure_scope = faults.next_failure_scope()
        faults.end_children_when_the_script_fails(self.launcher)
        try:
            if dist.is_available() and not dist.is_initialized():
                set_world_ranks()
                hosts_store = self.global_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
                faults.wait_for_store(address, hosts_store, self._timeout)
                if faults.under_torchelastic():
                    backend = self._get_process_group_backend()
                    faults.init_elastic_process_group(
                        address, backend, self.global_rank, self.world_size, self._timeout
                    )
            join()
        except dist.DistNetworkError as error:
            message = faults.join_failed_message(self.global_rank, self.world_size, address, self._timeout, error)
            raise dist.DistNetworkError(message) from error
        faults.destroy_process_group_at_exit()

    def _wrap_module(self, module: Module, device_ids: list[int] | None) -> BaguaDistributedDataParallel:
        log.debug(f"{type(self).__name__}: wrapping {type(module).__name__} with {self._algorithm!r}")
        # Wrapped on the current stream, the one forward and backward run on: DDP keeps references to the
        # gradient accumulators it sees at construction, and torch warns (and synchronises) when those were
        # created on another stream.
        wrapped = BaguaDistributedDataParallel(
            module,
            algorithm=self._algorithm,
            device_ids=device_ids,
            gradient_as_bucket_view=self._flatten,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            ranks_per_node=self.num_processes,
            timeout=self._timeout,
            telemetry=self._telemetry,
        )
        self._communication_counter = wrapped.communication_counter
        return wrapped

    def _check_optimizers(self, optimizers: Sequence[Optimizer], lr_schedulers: Sequence[Any]) -> None:
        try:
            self._algorithm.check_optimizers(optimizers, lr_schedulers)
        except ValueError as error:
            raise self._configuration_error(str(error)) from None

    def _gather_module_entry(
        self, wrapped: BaguaDistributedDataParallel, weights: Callable[[], Mapping[str, Any]]
    ) -> ModuleEntry | None:
        """Gather a module's checkpoint entry to rank 0, with every rank's ``weights()`` where the ranks differ."""
        per_rank = wrapped.bagua_algorithm.ranks_hold_different_weights
        return gather_module_entry(wrapped, weights() if per_rank else None, self._average_before_save, self.world_size)

    def _handle_failure(self, exception: BaseException, script_ends: bool = False) -> None:
        """Stop the algorithms without waiting for peers, compare notes with the other ranks, and end the job if needed.

        The decision (see the fault tolerance page of the docs): an error every rank raised leaves every process
        alive, so that a script that catches it can run again; a failed collective ends the ranks this process
        started (they cannot go on); an error this rank raised alone, while the others wait for it in a
        collective, ends this process and the ranks it started, unless the script ends anyway.

        Args:
            exception: what interrupted the run.
            script_ends: the exception is leaving the script (Fabric's exception hook): nothing to decide.
        """
        # First: background work (async averaging) learns of the failure at its next round and stops on the peers
        # too, instead of waiting in a collective for this rank.
        for wrapped in self._bagua_wrapped_modules():
            wrapped.bagua_algorithm_impl.stop(wait=False)
        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return
        timeout_s = None if self._timeout is None else self._timeout.total_seconds()
        # Lightning ends the job itself after a KeyboardInterrupt (kills the children, exits): nothing to decide.
        script_ends = script_ends or isinstance(exception, KeyboardInterrupt)
        report = faults.diagnose_failure(
            exception, self.global_rank, self.world_size, self._failure_scope, timeout_s, decide_alone=not script_ends
        )
        note = report.note()
        if note is None:
            return
        if hasattr(exception, "add_note"):
            exception.add_note(note)
        if report.alone:
            faults.leave_the_job(exception, self.global_rank, report.silent, self._failure_scope, self.launcher)
        log.error(note)
        faults.mark_told(self.global_rank, self._failure_scope)
        if report.collective:
            # A rank that raised alone prints its error and exits once told; those still running then are stuck.
            faults.end_launched_children(
                self.launcher, f"a collective failed on rank {self.global_rank}", grace_s=faults.CHILDREN_GRACE_S
            )


def _backend_for_device(backend: str, device_type: str) -> str | None:
    """The backend ``process_group_backend`` names for tensors on ``device_type``, alone or per device."""
    if ":" not in backend:
        return backend.strip().lower()
    pairs = (part.split(":", 1) for part in backend.split(","))
    return {device.strip().lower(): name.strip().lower() for device, name in pairs}.get(device_type)
