"""``BaguaStrategy`` for Lightning Fabric: Fabric's DDP strategy with the model wrapped by the Bagua engine.

``Fabric(strategy="bagua")`` selects it with the default algorithm (no import needed); pass an instance to choose
another::

    from lightning.fabric import Fabric
    from lightning_bagua.strategies.fabric import BaguaStrategy

    fabric = Fabric(strategy=BaguaStrategy(algorithm=..., **algorithm_keywords), devices=4)

The class for the standalone ``lightning_fabric`` package is :class:`lightning_bagua.lightning_fabric.BaguaStrategy`.
This module holds Fabric's hooks only; what both strategies share is
:class:`~lightning_bagua.strategies._core.strategy.BaguaStrategyCore`.
"""

import atexit
import logging
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_bagua._lightning_compat import SCHEDULER_NOT_PASSED, fabric_load_checkpoint_keywords, fabric_setup_result
from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms.weights import parameters_not_updated
from lightning_bagua.engine.autotune import BucketAutotuner
from lightning_bagua.engine.telemetry import CommunicationTelemetry
from lightning_bagua.environments.bagua import BaguaEnvironment
from lightning_bagua.strategies._core.arguments import reduce_over_all_processes, telemetry_metrics
from lightning_bagua.strategies._core.checkpoint_io import AtomicTorchCheckpointIO
from lightning_bagua.strategies._core.data_resume import DataState
from lightning_bagua.strategies._core.faults import fail_at_exit, install_failure_hook
from lightning_bagua.strategies._core.strategy import BaguaStrategyCore
from lightning_bagua.strategies._fabric import checkpoint as fabric_checkpoint
from lightning_bagua.strategies._fabric.autotune import FabricAutotuning
from lightning_bagua.strategies._fabric.engines import WrappedEngines, updates

__all__ = ["BaguaStrategy"]

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the hooks, mixed into one class per Fabric package, type-check as `lightning`'s DDPStrategy
    _FabricBase = DDPStrategy
else:
    _FabricBase = object


class _FabricBaguaStrategyLogic(BaguaStrategyCore, _FabricBase):
    """Fabric's hooks of the Fabric :class:`BaguaStrategy`, shared by the classes for both Fabric packages.

    Each concrete class mixes it in before its package's ``DDPStrategy`` and names its package's
    :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` in ``_bagua_environment_cls``.
    """

    _precision_keyword = "precision"

    def __init__(
        self,
        algorithm: str | Algorithm = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any | None = None,
        checkpoint_io: Any | None = None,
        precision: Any | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        telemetry: bool = False,
        autotune: bool | None = None,
        average_before_save: bool = False,
        start_method: str = "popen",
        **bagua_kwargs: Any,
    ) -> None:
        if "pause_for_validation" in bagua_kwargs:
            # Not an algorithm keyword: say where it belongs instead of the algorithm's "unknown keyword".
            raise TypeError(
                "Fabric's BaguaStrategy takes no `pause_for_validation`: it applies to the Trainer's validation inside"
                " fit; Fabric runs your own loop. Call `module.bagua_algorithm_impl.stop()` and `.start()` on"
                " `strategy.bagua_modules` around your validation instead, on every process."
            )
        super().__init__(
            algorithm,
            flatten,
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            telemetry=telemetry,
            autotune=autotune,
            average_before_save=average_before_save,
            start_method=start_method,
            bagua_kwargs=bagua_kwargs,
        )
        # Every module wrapped and every optimizer set up so far, held weakly (see `WrappedEngines`).
        self._engines = WrappedEngines()
        # Modules whose optimizers do not yet update all their parameters: bound at their first forward pass.
        self._unbound: dict[int, RemovableHandle] = {}
        self._closes_at_exit = False
        self._remove_failure_hook: Callable[[], None] | None = None
        self._autotuning = FabricAutotuning(on_replace=self._replace_wrapper)

    @property
    def bagua_modules(self) -> list[BaguaDistributedDataParallel]:
        """The modules this strategy wrapped that are still in use and not torn down, in the order they were set up."""
        return self._bagua_modules

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
        return telemetry_metrics(telemetry.last_step)

    @property
    def autotuner(self) -> BucketAutotuner | None:
        """The bucket autotuner of the most recently set-up module when autotuning is on; ``None`` otherwise."""
        if not self._bagua_modules:
            return None
        return self._autotuning.tuner_of(self._bagua_modules[-1])

    def data_state(self, dataloader: Any) -> DataState:
        """Return the position of a dataloader's data, to save and load with the rest of the state.

        Call it once, after ``fabric.setup_dataloaders``, before the first iteration; put the result in the state
        given to ``fabric.save`` and ``fabric.load``
        (:class:`~lightning_bagua.strategies._core.data_resume.DataState`, the fault tolerance page of the docs)::

            data = fabric.strategy.data_state(train_loader)
            state = {"model": model, "optimizer": optimizer, "data": data}
            fabric.load(path, state)  # when resuming: the next `for batch in train_loader` continues mid-epoch
            for epoch in range(data.epoch, epochs):
                for batch_idx, batch in enumerate(train_loader, start=data.batches):
                    ...
                    data.batches = batch_idx + 1
                    fabric.save(path, state)
                data.batches = 0

        Args:
            dataloader: what ``fabric.setup_dataloaders`` returned.

        Returns:
            The data's position, a stateful object for ``fabric.save`` and ``fabric.load``.

        Raises:
            ValueError: the dataloader's batches do not come from a torch ``BatchSampler`` over a map-style dataset.
        """
        return DataState.of(dataloader, self.world_size, self.global_rank)

    @override
    def setup_environment(self) -> None:
        """Join the process group (bounded by the timeout, safe across restarts) and watch for a failing script.

        An exception that ends the script stops the algorithms without waiting for the peers and, after a failed
        collective, is printed with a note naming the ranks that died or raised, as under the Trainer.
        """
        super().setup_environment()
        if self._remove_failure_hook is None:
            self._remove_failure_hook = install_failure_hook(partial(self._handle_failure, script_ends=True))

    @override
    def _setup_distributed(self) -> None:
        self._join_process_group(self._set_world_ranks, super()._setup_distributed)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = SCHEDULER_NOT_PASSED
    ) -> tuple[Any, ...]:
        """Wrap the module, bind the optimizers to its engine, and start the algorithm.

        Args:
            module: the module to wrap.
            optimizers: the optimizers over its parameters.
            scheduler: an LR scheduler, passed through (Fabric passes one from 2.6 on).

        Returns:
            The wrapped module and the optimizers, and the scheduler where Fabric passed one.
        """
        schedulers = [] if scheduler is None or scheduler is SCHEDULER_NOT_PASSED else [scheduler]
        # Checked before wrapping, so that a wrong optimizer fails before the engine creates communicators.
        self._check_optimizers(optimizers, schedulers)
        # Held before wrapping, so that the module is bound once to all of them: a weight-exchanging algorithm
        # checks that its optimizers together update every parameter, which a part of them would fail.
        for optimizer in optimizers:
            self._engines.add_optimizer(optimizer)
        wrapped = self._wrap(module)
        wrapped.bagua_algorithm_impl.start()
        return fabric_setup_result(wrapped, optimizers, scheduler)

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
        wrapped.bagua_algorithm_impl.start()
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Bind the optimizer to the engine of every wrapped module whose parameters it updates.

        Args:
            optimizer: a torch optimizer.

        Returns:
            The same optimizer.
        """
        self._engines.add_optimizer(optimizer)
        for wrapped in self._bagua_modules:
            if updates(optimizer, wrapped):
                self._bind(wrapped)
        return optimizer

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the gradients by their norm, as Fabric's DDP strategy does, where the algorithm steps from them.

        Raises:
            MisconfigurationException: the optimizer steps from something else (``qadam`` after its warm-up).
        """
        self._refuse_gradient_clipping()
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip the gradients by value, as Fabric's DDP strategy does, where the algorithm steps from them.

        Raises:
            MisconfigurationException: the optimizer steps from something else (``qadam`` after its warm-up).
        """
        self._refuse_gradient_clipping()
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step the optimizer, then tell each module it updates, close its telemetry step and advance its autotuner.

        Args:
            optimizer: the optimizer to step.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What the optimizer's step returned.
        """
        output = super().optimizer_step(optimizer, **kwargs)
        for wrapped in self._bagua_modules:
            bound = wrapped.bagua_optimizers
            stepped = next((known for known in bound if known is optimizer), None)
            if stepped is None:
                continue
            wrapped.bagua_algorithm_impl.on_optimizer_step(stepped)
            if wrapped.telemetry is not None:
                # The step is complete here, the algorithm's post-step communication included (as under the Trainer).
                wrapped.telemetry.end_step()
            tuner = self._autotuning.tuner_of(wrapped)
            # One tuning step per training step: counted at the steps of the module's first optimizer, so that
            # several optimizers over one module do not count one step twice (the Trainer counts global steps).
            if tuner is not None and not tuner.finished and bound[0] is optimizer:
                self._autotuning.advance(wrapped)
        return output

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce a tensor over the processes, in place, as Fabric's ``DDPStrategy`` does; non-tensors pass through.

        Args:
            tensor: the value to reduce.
            group: the process group; ``None`` for all processes.
            reduce_op: an op name in any letter case (``"mean"``/``"avg"``, the default, average on every
                backend; ``"sum"``, ``"max"``, ...), a ``ReduceOp`` member, or ``None`` (average).

        Returns:
            ``tensor`` itself, holding the reduced value on every process, as Fabric documents.
        """
        return reduce_over_all_processes(tensor, group, reduce_op, f"{type(self).__name__}.all_reduce")

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save the state like Fabric's DDP strategy, plus every process's Bagua state for the wrapped modules.

        Process 0 writes the file, so each wrapped module's state is gathered from all processes first and stored
        under ``"bagua_algorithm_state"``, in the Trainer strategy's format (see the fault tolerance page of the
        docs): each process's :meth:`~lightning_bagua.engine.BaguaDistributedDataParallel.bagua_state_dict` and,
        for algorithms whose ranks hold different weights, each process's module weights and the states of the
        optimizers in ``state`` that update the module. ``filter`` applies to those per-process copies as to the
        shared ones: what it drops from a module's or an optimizer's state is not written for any process. Every
        process must call this (as ``fabric.save`` does).

        Args:
            path: where to write the checkpoint.
            state: names to modules, optimizers and other objects, as for ``fabric.save``.
            storage_options: passed to the checkpoint plugin.
            filter: per-key filters, as for ``fabric.save``.
        """
        state = fabric_checkpoint.state_to_save(self, state, filter or {})
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint like Fabric's DDP strategy, then restore each wrapped module's Bagua state.

        Where the module's ranks hold different weights, this process's own weights and optimizer states replace
        the shared ones; then the algorithm state is restored, from this process's own entry. None of it is part
        of what comes back. Checkpoints written by earlier releases of the Fabric strategy (the unversioned
        ``"bagua_algorithm_state"`` entry, or version 2 under ``"bagua"``) load too.

        An algorithm that works between steps (``async`` averaging in its thread) is stopped on every process before
        anything is loaded and started again once all is restored, so that no averaging round mixes the old weights
        into the loaded ones. Every process must call this, as ``fabric.load`` does; if loading raises, the
        algorithm stays stopped (start it again with ``.bagua_algorithm_impl.start()`` on each of
        :attr:`bagua_modules`, on every process).

        Args:
            path: the checkpoint to read.
            state: what to restore, as for ``fabric.load``.
            strict: whether every requested key must be in the checkpoint.
            weights_only: passed to ``torch.load`` (Fabric passes it from 2.6 on).

        Returns:
            The checkpoint's items that were not restored into ``state``; the whole checkpoint if ``state`` is empty.
        """
        keywords = fabric_load_checkpoint_keywords(weights_only)
        load = partial(super().load_checkpoint, path, state=state, strict=strict, **keywords)
        return fabric_checkpoint.load_and_restore(self, state, strict, load)

    @override
    def teardown(self) -> None:
        """Stop each wrapped module's algorithm and close its engine; the modules themselves stay usable."""
        _ = self.auto_decision  # kept for scripts that read it after the run
        try:
            self._close_engines()
        finally:
            # A failure of background work that stopping raised still leaves the strategy torn down.
            if self._remove_failure_hook is not None:
                self._remove_failure_hook()
                self._remove_failure_hook = None
            super().teardown()

    @override
    def _bagua_wrapped_modules(self) -> list[BaguaDistributedDataParallel]:
        return self._bagua_modules

    def _wrap(self, module: Module) -> BaguaDistributedDataParallel:
        wrapped = self._wrap_module(module, self._determine_ddp_device_ids())
        self._engines.add_module(wrapped)
        if not self._closes_at_exit:
            # Fabric has no end of run at which it tears its strategy down; engines still open when the script
            # ends are closed before the process group goes (atexit runs this before the earlier-registered
            # handler that destroys the group).
            atexit.register(self._close_engines_at_exit)
            self._closes_at_exit = True
        if self._engines.optimizers_of(wrapped):
            self._bind(wrapped)
        if self._autotune:
            self._autotuning.add(wrapped)
        return wrapped

    def _replace_wrapper(self, old: BaguaDistributedDataParallel, new: BaguaDistributedDataParallel) -> None:
        # `rewrapped` closed the old wrapper; the strategy's references move to the new one (Fabric's moved already).
        self._engines.replace_module(old, new)
        if old.telemetry is not None and new.telemetry is not None:
            # One record stream per module: the loop logs the step that ended with the rebuild after this step.
            new.telemetry.continue_from(old.telemetry)

    def _bind(self, wrapped: BaguaDistributedDataParallel) -> None:
        optimizers = self._engines.optimizers_of(wrapped)
        self._check_optimizers(optimizers, [])
        if not parameters_not_updated(wrapped.bagua_algorithm_impl.context.named_parameters, optimizers):
            self._bind_now(wrapped, optimizers)
        elif id(wrapped) not in self._unbound:
            # `fabric.setup_optimizers(a, b)` sets them up one at a time, and a weight-exchanging algorithm refuses
            # optimizers that leave parameters out: the rest may still come. Bound at the first forward pass with
            # what is set up by then (such an algorithm then names the parameters no optimizer updates).
            self._unbound[id(wrapped)] = wrapped.register_forward_pre_hook(
                lambda module, _: self._bind_now(module, self._engines.optimizers_of(module))
            )

    def _bind_now(self, wrapped: Module, optimizers: list[Optimizer]) -> None:
        assert isinstance(wrapped, BaguaDistributedDataParallel)
        handle = self._unbound.pop(id(wrapped), None)
        if handle is not None:
            handle.remove()
        wrapped.bind_optimizers(optimizers)

    def _close_engines_at_exit(self) -> None:
        """Close the engines still open when the script ends; a failure that surfaces here ends the process with 1.

        Stopping an algorithm can raise a failure of its background work that nothing reported before: async
        averaging's thread may learn that a peer died only now, when the training loop has already finished (it
        never waits for the peers). Python would print the exception and exit with 0, so it goes through the same
        diagnosis as an exception that ends the script (its note names the ranks that died), and then the process
        ends with exit code 1.
        """
        try:
            self._close_engines()
        except Exception as error:  # not swallowed: reported with its diagnosis, and the process exits with 1
            try:
                self._handle_failure(error, script_ends=True)
            except Exception:  # the error being reported is what must reach the screen, and the exit code
                log.exception("lightning_bagua: diagnosing a failure at exit failed too")
            fail_at_exit(error, self.global_rank, self.launcher)

    @property
    def _bagua_modules(self) -> list[BaguaDistributedDataParallel]:
        return self._engines.modules

    def _close_engines(self) -> None:
        try:
            self._engines.close()
        finally:
            self._autotuning.clear()
            for handle in self._unbound.values():
                handle.remove()
            self._unbound = {}


class BaguaStrategy(_FabricBaguaStrategyLogic, DDPStrategy):
    """Train with one of Bagua's communication algorithms under Lightning Fabric.

    ``Fabric(strategy="bagua")`` selects it with the default algorithm; pass an instance to choose another::

        fabric = Fabric(strategy=BaguaStrategy(algorithm=name, **algorithm_keywords))

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
        bucket_cap_mb: gradient bucket size in MiB; ``BAGUA_DEFAULT_BUCKET_SIZE`` (bytes) when ``None``, or else
            100 MiB on CUDA and Bagua's 10 MiB elsewhere.
        find_unused_parameters: as in DDP, for models whose forward skips parameters.
        telemetry: measure each step's communication (bytes sent and received, compression ratio, time waiting
            on communication, the algorithm's phase); a step's record closes when an optimizer over the module
            steps, and :attr:`telemetry_metrics` holds the last one under the Trainer strategy's metric names. Off
            by default, and then nothing is measured.
        autotune: try bucket sizes (and hierarchical communication on several nodes) during the first optimizer
            steps and keep the fastest, the same on every rank, as the Trainer strategy does; ``None`` reads
            ``BAGUA_AUTOTUNE`` (``1``: on; the launcher's ``--autotune_level 1`` sets it), off when unset. Rank
            zero logs the choice (Python logging), and :attr:`autotuner` holds it.
        average_before_save: with an algorithm whose ranks hold different weights, save the average of the
            processes' weights as the module's weights (what a plain ``fabric.load`` or ``torch.load`` reads)
            instead of rank 0's; resuming with this strategy still restores each process's own weights.
        start_method: how Lightning starts the processes of a node, as for its ``DDPStrategy``: ``"popen"`` (the
            default: the script runs again for each process), ``"spawn"``, ``"fork"`` (notebooks) or
            ``"forkserver"`` (processes started from this one, with the function and its arguments pickled).
        **bagua_kwargs: the algorithm's keywords, e.g. ``hierarchical=True``; checked here, so that a typo
            fails before any process starts.
    """

    _bagua_environment_cls = BaguaEnvironment
    _checkpoint_io_cls = AtomicTorchCheckpointIO
    _configuration_error = MisconfigurationException
