"""``BaguaStrategy`` for Lightning Fabric: Fabric's DDP strategy with the model wrapped by the Bagua engine.

``Fabric(strategy="bagua")`` selects it with the default algorithm (no import needed); pass an instance to choose
another::

    from lightning.fabric import Fabric
    from lightning_bagua.strategies.fabric import BaguaStrategy

    fabric = Fabric(strategy=BaguaStrategy(algorithm="bytegrad", hierarchical=False), devices=4)

The class for the standalone ``lightning_fabric`` package is :class:`lightning_bagua.lightning_fabric.BaguaStrategy`.
"""

import atexit
import logging
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.nn.modules.module import register_module_module_registration_hook
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, CommunicationCounter
from lightning_bagua.engine.algorithms.qadam import QAdamAlgorithm, check_qadam_configuration
from lightning_bagua.engine.autotune import BucketAutotuner
from lightning_bagua.engine.data_parallel import default_bucket_cap_mb
from lightning_bagua.engine.telemetry import CommunicationTelemetry
from lightning_bagua.environments.bagua import BaguaEnvironment
from lightning_bagua.strategies.bagua import (
    _check_engine_arguments,
    _check_telemetry_and_autotune,
    _destroy_process_group_at_exit,
    _fill_load_balancing_samplers,
    _reduce_over_all_processes,
    _telemetry_metrics,
)

if TYPE_CHECKING:
    # The logic is written once and mixed into one class per Fabric package; type-check it as the `lightning`
    # package's DDPStrategy subclass it is there.
    _StrategyLogicBase = DDPStrategy
else:
    _StrategyLogicBase = object

__all__ = ["ALGORITHM_STATE_KEY", "BaguaStrategy"]

log = logging.getLogger(__name__)

ALGORITHM_STATE_KEY = "bagua_algorithm_state"
"""The checkpoint entry that holds every process's algorithm state, by the name its module was saved under."""


class _FabricBaguaStrategyLogic(_StrategyLogicBase):
    """The body of the Fabric :class:`BaguaStrategy`, shared by the classes for both Fabric packages.

    Each concrete class mixes it in before its package's ``DDPStrategy`` and names its package's
    :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` in ``_bagua_environment_cls``.
    """

    strategy_name = "bagua"
    _bagua_environment_cls: ClassVar[type[ClusterEnvironment]]
    # Each Fabric package raises its own MisconfigurationException for a configuration it cannot train.
    _configuration_error: ClassVar[type[Exception]]

    def __init__(
        self,
        algorithm: str | Algorithm = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        telemetry: bool = False,
        autotune: bool | None = None,
        **bagua_kwargs: Any,
    ) -> None:
        self._algorithm = _check_engine_arguments(algorithm, flatten, bucket_cap_mb, bagua_kwargs)
        self._telemetry, self._autotune = _check_telemetry_and_autotune(telemetry, autotune)
        if cluster_environment is None and self._bagua_environment_cls.detect():
            cluster_environment = self._bagua_environment_cls()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._flatten = flatten
        self._bagua_kwargs = dict(bagua_kwargs)
        self._bucket_cap_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)
        self._find_unused_parameters = find_unused_parameters
        self._communication_counter: CommunicationCounter | None = None
        # Every module wrapped and every optimizer set up so far: Fabric may set them up in either order, together
        # or apart, so each module is (re)bound to the optimizers over its parameters whenever either side arrives.
        self._bagua_modules: list[BaguaDistributedDataParallel] = []
        self._bagua_optimizers: list[Optimizer] = []
        self._closes_at_exit = False
        # With autotuning: each wrapped module's tuner (by the wrapper's id), and, while any is still tuning, the
        # modules that hold a tuning wrapper as a child (Fabric's `_FabricModule`), so that a rebuilt wrapper takes
        # the old one's place where the user's loop calls it.
        self._autotuners: dict[int, BucketAutotuner] = {}
        self._wrapper_holders: dict[int, list[tuple[weakref.ref[Module], str]]] = {}
        self._holder_hook: RemovableHandle | None = None

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
        """The bucket size in MiB (``BAGUA_DEFAULT_BUCKET_SIZE`` or Bagua's 10 MiB unless given)."""
        return default_bucket_cap_mb() if self._bucket_cap_mb is None else self._bucket_cap_mb

    @property
    def communication_counter(self) -> CommunicationCounter | None:
        """What the engine of the most recently set-up module communicated; ``None`` before the first setup."""
        return self._communication_counter

    @property
    def bagua_modules(self) -> list[BaguaDistributedDataParallel]:
        """The modules this strategy wrapped and has not torn down yet, in the order they were set up."""
        return list(self._bagua_modules)

    @property
    def telemetry(self) -> CommunicationTelemetry | None:
        """The per-step telemetry of the most recently set-up module with ``telemetry=True``; ``None`` otherwise.

        Other modules' telemetry is ``strategy.bagua_modules[i].telemetry``.
        """
        return self._bagua_modules[-1].telemetry if self._bagua_modules else None

    @property
    def telemetry_metrics(self) -> dict[str, float]:
        """The last completed step's telemetry, under the names the Trainer strategy logs (``bagua/bytes_sent``, ...).

        A step completes at the optimizer step that follows a synchronizing backward. Empty before the first and
        when telemetry is off, so that ``fabric.log_dict(strategy.telemetry_metrics, step=step)`` always works.
        """
        telemetry = self.telemetry
        if telemetry is None or telemetry.last_step is None:
            return {}
        return _telemetry_metrics(telemetry.last_step)

    @property
    def autotuner(self) -> BucketAutotuner | None:
        """The bucket autotuner of the most recently set-up module when autotuning is on; ``None`` otherwise."""
        if not self._bagua_modules:
            return None
        return self._autotuners.get(id(self._bagua_modules[-1]))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _destroy_process_group_at_exit()

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """Wrap the module, bind the optimizers to its engine, and start the algorithm.

        Args:
            module: the module to wrap.
            optimizers: the optimizers over its parameters.
            scheduler: an LR scheduler, passed through.

        Returns:
            The wrapped module, the optimizers and the scheduler.
        """
        if isinstance(self._algorithm, QAdamAlgorithm):
            # Checked before wrapping, so that a wrong optimizer fails before the engine creates communicators.
            self._check_qadam(optimizers, [] if scheduler is None else [scheduler])
        wrapped = self._wrap(module)
        optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        _start_algorithm(wrapped)
        return wrapped, optimizers, scheduler

    @override
    def setup_module(self, module: Module) -> BaguaDistributedDataParallel:
        """Wrap the module in :class:`~lightning_bagua.engine.BaguaDistributedDataParallel` and start the algorithm.

        Optimizers set up before or after (``fabric.setup_optimizers``) are bound to it when they touch its
        parameters.

        Args:
            module: the module to wrap, on this process's device.

        Returns:
            The wrapped module.
        """
        wrapped = self._wrap(module)
        _start_algorithm(wrapped)
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Bind the optimizer to the engine of every wrapped module whose parameters it updates.

        Args:
            optimizer: a torch optimizer.

        Returns:
            The same optimizer.
        """
        if not any(optimizer is known for known in self._bagua_optimizers):
            self._bagua_optimizers.append(optimizer)
        for wrapped in self._bagua_modules:
            if _updates(optimizer, wrapped):
                self._bind(wrapped)
        return optimizer

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step the optimizer, then close the telemetry step and advance the autotuner of each module it updates.

        Args:
            optimizer: the optimizer to step.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What the optimizer's step returned.
        """
        output = super().optimizer_step(optimizer, **kwargs)
        for wrapped in list(self._bagua_modules):
            bound = wrapped.bagua_optimizers
            if not any(optimizer is known for known in bound):
                continue
            if wrapped.telemetry is not None:
                # The step is complete here, the algorithm's post-step communication included (as under the Trainer).
                wrapped.telemetry.end_step()
            tuner = self._autotuners.get(id(wrapped))
            # One tuning step per training step: counted at the steps of the module's first optimizer, so that
            # several optimizers over one module do not count one step twice (the Trainer counts global steps).
            if tuner is not None and not tuner.finished and bound[0] is optimizer:
                self._advance_autotuner(wrapped, tuner)
        return output

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """Give the dataloader's load-balancing samplers this process's place, where they were built without one.

        Args:
            dataloader: the dataloader Fabric prepared.

        Returns:
            The same dataloader.
        """
        dataloader = super().process_dataloader(dataloader)
        _fill_load_balancing_samplers(dataloader, self.world_size, self.global_rank)
        return dataloader

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce a tensor over all processes; anything that is not a tensor comes back unchanged.

        Args:
            tensor: the value to reduce.
            group: ``None`` or the default group (what ``fabric.all_reduce`` passes): the strategy reduces over
                all processes.
            reduce_op: ``"mean"``/``"avg"``/``None`` (the default: average), ``"sum"``, ``"max"``, ``"min"``,
                ``"product"``, or the matching ``ReduceOp`` member.

        Returns:
            The reduced value, on every process: written into ``tensor`` itself, as Fabric documents, unless the
            result has another dtype (the mean of an integer tensor), which comes back as a new tensor.
        """
        result = _reduce_over_all_processes(tensor, group, reduce_op, f"{type(self).__name__}.all_reduce")
        if isinstance(tensor, Tensor) and result is not tensor and result.dtype == tensor.dtype:
            return tensor.copy_(result)
        return result

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save the state like Fabric's DDP strategy, plus every process's algorithm state for the wrapped modules.

        Process 0 writes the file, so each wrapped module's
        :meth:`~lightning_bagua.engine.BaguaDistributedDataParallel.bagua_state_dict` is gathered from all
        processes first and stored, one entry per process, under ``"bagua_algorithm_state"``. Every process must
        call this (as ``fabric.save`` does).

        Args:
            path: where to write the checkpoint.
            state: names to modules, optimizers and other objects, as for ``fabric.save``.
            storage_options: passed to the checkpoint plugin.
            filter: per-key filters, as for ``fabric.save``.
        """
        if ALGORITHM_STATE_KEY in state:
            raise ValueError(
                f"The state to save has a key {ALGORITHM_STATE_KEY!r}, which {type(self).__name__} uses for the"
                " algorithm's state. Save your object under another name."
            )
        algorithm_state = {
            key: self._gather_algorithm_state(obj)
            for key, obj in state.items()
            if isinstance(obj, BaguaDistributedDataParallel)
        }
        if algorithm_state:
            state = {**state, ALGORITHM_STATE_KEY: algorithm_state}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint like Fabric's DDP strategy, then restore each wrapped module's algorithm state.

        The algorithm state is restored after the modules and optimizers, from this process's own entry, and is
        not part of what comes back.

        Args:
            path: the checkpoint to read.
            state: what to restore, as for ``fabric.load``.
            strict: whether every requested key must be in the checkpoint.
            weights_only: passed to ``torch.load``.

        Returns:
            The checkpoint's items that were not restored into ``state``; the whole checkpoint if ``state`` is empty.
        """
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            return remainder
        saved = remainder.pop(ALGORITHM_STATE_KEY, {})
        for key, obj in state.items():
            if isinstance(obj, BaguaDistributedDataParallel) and key in saved:
                self._load_algorithm_state(obj, key, saved[key])
        return remainder

    @override
    def teardown(self) -> None:
        """Stop each wrapped module's algorithm and close its engine; the modules themselves stay usable."""
        self._close_engines()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "bagua" not in strategy_registry:
            strategy_registry.register("bagua", cls, description="Bagua's communication algorithms")

    def _wrap(self, module: Module) -> BaguaDistributedDataParallel:
        log.debug(f"{type(self).__name__}: wrapping {type(module).__name__} with {self._algorithm!r}")
        # Wrapped on the current stream, the one forward and backward run on (see the Trainer strategy).
        wrapped = BaguaDistributedDataParallel(
            module,
            algorithm=self._algorithm,
            device_ids=self._determine_ddp_device_ids(),
            gradient_as_bucket_view=self._flatten,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            ranks_per_node=self.num_processes,
            timeout=self._timeout,
            telemetry=self._telemetry,
        )
        self._bagua_modules.append(wrapped)
        self._communication_counter = wrapped.communication_counter
        if not self._closes_at_exit:
            # Fabric has no end of run at which it tears its strategy down; engines still open when the script
            # ends are closed before the process group goes (atexit runs this before the earlier-registered
            # handler that destroys the group).
            atexit.register(self._close_engines)
            self._closes_at_exit = True
        if any(_updates(optimizer, wrapped) for optimizer in self._bagua_optimizers):
            self._bind(wrapped)
        if self._autotune:
            tuner = BucketAutotuner()
            self._autotuners[id(wrapped)] = tuner
            if self._holder_hook is None:
                self._holder_hook = register_module_module_registration_hook(self._note_holder)
            # The tuner's call before the first step's forward (the Trainer makes it at the first batch's start);
            # every later call follows an optimizer step, i.e. comes before the next step's forward.
            self._advance_autotuner(wrapped, tuner)
        return wrapped

    def _note_holder(self, holder: Module, name: str, child: Module) -> None:
        # Called for every child module registered anywhere while a module is tuning: remember who holds ours.
        if any(child is wrapped for wrapped in self._bagua_modules) and id(child) in self._autotuners:
            self._wrapper_holders.setdefault(id(child), []).append((weakref.ref(holder), name))

    def _advance_autotuner(self, wrapped: BaguaDistributedDataParallel, tuner: BucketAutotuner) -> None:
        tuned = tuner.step(wrapped)
        if tuned is not wrapped:
            self._replace_wrapper(wrapped, tuned)
        if all(tuner.finished for tuner in self._autotuners.values()):
            self._stop_noting_holders()

    def _replace_wrapper(self, old: BaguaDistributedDataParallel, new: BaguaDistributedDataParallel) -> None:
        # `rewrapped` closed the old wrapper; every reference the strategy and Fabric keep moves to the new one.
        self._bagua_modules = [new if wrapped is old else wrapped for wrapped in self._bagua_modules]
        if old.telemetry is not None and new.telemetry is not None:
            # One record stream per module: the step that ended with the rebuild stays readable (the loop logs it
            # after this optimizer step), and step indices go on counting instead of restarting at 0.
            new.telemetry.last_step = old.telemetry.last_step
            new.telemetry._step = old.telemetry._step
        self._autotuners[id(new)] = self._autotuners.pop(id(old))
        holders = self._wrapper_holders.pop(id(old), [])
        for reference, name in holders:
            holder = reference()
            # Set in the children's table itself: `_FabricModule.__setattr__` would forward the name to the user's
            # module, and registering anew would record the holder twice.
            if holder is not None and holder._modules.get(name) is old:
                holder._modules[name] = new
        self._wrapper_holders[id(new)] = holders

    def _stop_noting_holders(self) -> None:
        if self._holder_hook is not None:
            self._holder_hook.remove()
            self._holder_hook = None
        self._wrapper_holders = {}

    def _bind(self, wrapped: BaguaDistributedDataParallel) -> None:
        optimizers = [optimizer for optimizer in self._bagua_optimizers if _updates(optimizer, wrapped)]
        if isinstance(self._algorithm, QAdamAlgorithm):
            self._check_qadam(optimizers, [])
        wrapped.bind_optimizers(optimizers)

    def _check_qadam(self, optimizers: list[Optimizer], schedulers: list[Any]) -> None:
        try:
            check_qadam_configuration(optimizers, schedulers)
        except ValueError as error:
            raise self._configuration_error(
                f"{error} Set up the model with a single lightning_bagua.QAdamOptimizer over its parameters,"
                " e.g. `fabric.setup(model, QAdamOptimizer(model.parameters()))`."
            ) from None

    def _gather_algorithm_state(self, wrapped: BaguaDistributedDataParallel) -> list[dict[str, Any]]:
        # On the CPU, so that process 0 can hold (and unpickle) every process's tensors whatever their device.
        local = move_data_to_device(wrapped.bagua_state_dict(), torch.device("cpu"))
        if not (dist.is_available() and dist.is_initialized()):
            return [local]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return gathered

    def _load_algorithm_state(self, wrapped: BaguaDistributedDataParallel, key: str, saved: list[Any]) -> None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world_size > 1 else 0
        if len(saved) != world_size:
            if any(entry.get("state") for entry in saved):
                raise ValueError(
                    f"The checkpoint holds the algorithm state of {key!r} for {len(saved)} processes, but this run has"
                    f" {world_size}. Resume with {len(saved)} processes, or delete the checkpoint's"
                    f" {ALGORITHM_STATE_KEY!r} entry (torch.load, del, torch.save) to start the algorithm afresh."
                )
            # Stateless algorithms resume on any number of processes; the entry still names the algorithm.
            rank = 0
        wrapped.load_bagua_state_dict(saved[rank])

    def _close_engines(self) -> None:
        modules, self._bagua_modules = self._bagua_modules, []
        for wrapped in modules:
            _stop_algorithm(wrapped)
            wrapped.close()
        self._bagua_optimizers = []
        self._autotuners = {}
        self._stop_noting_holders()


class BaguaStrategy(_FabricBaguaStrategyLogic, DDPStrategy):
    """Train with one of Bagua's communication algorithms under Lightning Fabric.

    ``Fabric(strategy="bagua")`` selects it with the default algorithm; pass an instance to choose another::

        fabric = Fabric(strategy=BaguaStrategy(algorithm="decentralized", peer_selection_mode="shift_one"))

    ``fabric.setup(model, optimizer)`` (or ``fabric.setup_module`` and ``fabric.setup_optimizers``, in either
    order) wraps the model in :class:`~lightning_bagua.engine.BaguaDistributedDataParallel` and binds the optimizers
    that update it; ``fabric.no_backward_sync`` skips communication on accumulating steps; ``fabric.save`` and
    ``fabric.load`` carry each process's algorithm state along with the weights and optimizer state.
    ``strategy.teardown()`` closes the engines; engines still open at interpreter exit are closed then.

    With ``telemetry=True`` each optimizer step closes a record of what the module communicated in that step;
    Fabric logs only what the loop asks it to, so log it there, e.g. after ``optimizer.step()``::

        fabric.log_dict(fabric.strategy.telemetry_metrics, step=step)

    With ``autotune=True`` (or ``BAGUA_AUTOTUNE=1``) the first optimizer steps try bucket sizes and keep the
    fastest; the module Fabric returned calls the rebuilt wrapper from then on, so the loop needs no change.

    Args:
        algorithm: an algorithm name (``"gradient_allreduce"``) or an
            :class:`~lightning_bagua.engine.Algorithm` instance.
        flatten: let gradients be views into the flat communication buckets (no copies).
        accelerator: the accelerator, as for Fabric's ``DDPStrategy``.
        parallel_devices: the devices of this node.
        cluster_environment: the cluster environment; a
            :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` when ``BAGUA_SERVICE_PORT`` is set
            and none is given.
        checkpoint_io: the checkpoint plugin.
        precision: the precision plugin (Fabric's name for the Trainer strategy's ``precision_plugin``).
        process_group_backend: ``"nccl"`` or ``"gloo"``; chosen from the device when ``None``.
        timeout: how long a collective may wait before the job fails.
        bucket_cap_mb: gradient bucket size in MiB; ``BAGUA_DEFAULT_BUCKET_SIZE`` (bytes) or Bagua's 10 MiB when
            ``None``.
        find_unused_parameters: as in DDP, for models whose forward skips parameters.
        telemetry: measure each step's communication (bytes sent and received, compression ratio, time waiting
            on communication, the algorithm's phase); a step's record closes when an optimizer over the module
            steps, and :attr:`telemetry_metrics` holds the last one under the Trainer strategy's metric names. Off
            by default, and then nothing is measured.
        autotune: try bucket sizes (and hierarchical communication on several nodes) during the first optimizer
            steps and keep the fastest, the same on every rank, as the Trainer strategy does; ``None`` reads
            ``BAGUA_AUTOTUNE`` (``1``: on; the launcher's ``--autotune_level 1`` sets it), off when unset. Rank
            zero logs the choice (Python logging), and :attr:`autotuner` holds it.
        **bagua_kwargs: the algorithm's keywords, e.g. ``hierarchical=True``; checked here, so that a typo
            fails before any process starts.
    """

    _bagua_environment_cls = BaguaEnvironment
    _configuration_error = MisconfigurationException


def _updates(optimizer: Optimizer, module: Module) -> bool:
    parameters = {id(parameter) for parameter in module.parameters()}
    return any(id(parameter) in parameters for group in optimizer.param_groups for parameter in group["params"])


def _start_algorithm(wrapped: BaguaDistributedDataParallel) -> None:
    # Algorithms that run on their own between steps (Bagua's async) start and stop with the run.
    resume = getattr(wrapped.bagua_algorithm, "resume", None)
    if callable(resume):
        resume(wrapped)


def _stop_algorithm(wrapped: BaguaDistributedDataParallel) -> None:
    abort = getattr(wrapped.bagua_algorithm, "abort", None)
    if callable(abort):
        abort(wrapped)
