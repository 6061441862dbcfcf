"""``BaguaStrategy``: Lightning's DDP strategy with the model wrapped by the Bagua engine."""

import atexit
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, CommunicationCounter
from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageImpl
from lightning_bagua.engine.algorithms.qadam import QAdamAlgorithm, check_qadam_configuration
from lightning_bagua.engine.autotune import AutotuneSetting, BucketAutotuner, autotune_from_environment
from lightning_bagua.engine.data_parallel import default_bucket_cap_mb
from lightning_bagua.engine.telemetry import CommunicationTelemetry
from lightning_bagua.environments.bagua import BaguaEnvironment

if TYPE_CHECKING:
    import lightning.pytorch as pl

    # The logic is written once and mixed into one class per Lightning package; type-check it as the
    # `lightning` package's DDPStrategy subclass it is there.
    _StrategyLogicBase = DDPStrategy
else:
    _StrategyLogicBase = object

__all__ = ["BaguaStrategy"]

log = logging.getLogger(__name__)

# The accepted `reduce_op` spellings. Gloo has no AVG, so "mean" is always a sum followed by a division.
_REDUCE_OPS: dict[Any, str] = {
    None: "mean",
    "mean": "mean",
    "avg": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    "product": "product",
    ReduceOp.AVG: "mean",
    ReduceOp.SUM: "sum",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
    ReduceOp.PRODUCT: "product",
}
_TORCH_OPS = {
    "sum": ReduceOp.SUM,
    "mean": ReduceOp.SUM,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}


class _BaguaStrategyLogic(_StrategyLogicBase):
    """The body of :class:`BaguaStrategy`, shared by the classes for both Lightning packages.

    Each concrete class mixes it in before its package's ``DDPStrategy`` and names its package's
    :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` in ``_bagua_environment_cls``.
    """

    strategy_name = "bagua"
    _bagua_environment_cls: ClassVar[type[ClusterEnvironment]]
    # Each Lightning package raises its own MisconfigurationException for a configuration it cannot train.
    _configuration_error: ClassVar[type[Exception]]

    def __init__(
        self,
        algorithm: str | Algorithm = "gradient_allreduce",
        flatten: bool = True,
        accelerator: "Accelerator | None" = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._flatten = flatten
        self._bagua_kwargs = dict(bagua_kwargs)
        self._bucket_cap_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)
        self._find_unused_parameters = find_unused_parameters
        self._communication_counter: CommunicationCounter | None = None
        self._autotuner: BucketAutotuner | None = None
        self._autotune_last_step: int | None = None
        self._autotune_logged = False

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
        """What the engine communicated in the current or last fit; ``None`` before the first fit."""
        return self._communication_counter

    @property
    def telemetry(self) -> CommunicationTelemetry | None:
        """The wrapped model's per-step telemetry while fitting with ``telemetry=True``; ``None`` otherwise."""
        model = self.model
        return model.telemetry if isinstance(model, BaguaDistributedDataParallel) else None

    @property
    def autotuner(self) -> BucketAutotuner | None:
        """The bucket autotuner of the current or last fit when autotuning is on; ``None`` otherwise."""
        return self._autotuner

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        _destroy_process_group_at_exit()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if isinstance(self._algorithm, QAdamAlgorithm) and trainer.state.fn == "fit":
            try:
                check_qadam_configuration(self.optimizers, self.lr_scheduler_configs)
            except ValueError as error:
                raise self._configuration_error(str(error)) from None
        if isinstance(self.model, BaguaDistributedDataParallel):
            # Lightning creates the optimizers after wrapping; algorithms that act around the step need them.
            self.model.bind_optimizers(self.optimizers)

    @override
    def _setup_model(self, model: Module) -> BaguaDistributedDataParallel:
        log.debug(f"{type(self).__name__}: wrapping the model with {self._algorithm!r}")
        # Wrapped on the current stream, the one forward and backward run on: DDP keeps references to the
        # gradient accumulators it sees at construction, and torch warns (and synchronises) when those were
        # created on another stream.
        wrapped = BaguaDistributedDataParallel(
            model,
            algorithm=self._algorithm,
            device_ids=self.determine_ddp_device_ids(),
            gradient_as_bucket_view=self._flatten,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            ranks_per_node=self.num_processes,
            timeout=self._timeout,
            telemetry=self._telemetry,
        )
        self._communication_counter = wrapped.communication_counter
        if self._autotune:
            self._autotuner = BucketAutotuner()
            self._autotune_last_step = None
            self._autotune_logged = False
        return wrapped

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._autotuner is None or not isinstance(self.model, BaguaDistributedDataParallel):
            return
        # Once per optimizer step (the batches of an accumulated step share one global step), before its forward.
        assert self.lightning_module is not None
        step = self.lightning_module.trainer.global_step
        if step == self._autotune_last_step:
            return
        self._autotune_last_step = step
        tuned = self._autotuner.step(self.model)
        if tuned is not self.model:
            self.model = tuned
        if self._autotuner.decision is not None and not self._autotune_logged:
            self._autotune_logged = True
            self._log_autotune_decision(self._autotuner.decision)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: "pl.LightningModule | Module | None" = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        telemetry = self.telemetry
        if telemetry is not None:
            # The step is complete here, the algorithm's post-step communication included.
            record = telemetry.end_step()
            if record is not None:
                self._log_to_loggers({f"bagua/{key}": value for key, value in record.items() if key != "step"})
        return output

    def _log_autotune_decision(self, decision: AutotuneSetting) -> None:
        self._log_to_loggers(
            {
                "bagua/autotune/bucket_cap_mb": decision.bucket_cap_mb,
                "bagua/autotune/hierarchical": float(decision.hierarchical),
            }
        )

    def _log_to_loggers(self, metrics: dict[str, float]) -> None:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give the dataloader's load-balancing samplers this process's place, where they were built without one.

        Lightning keeps a :class:`~lightning_bagua.LoadBalancingDistributedSampler` (it is a ``DistributedSampler``)
        instead of putting its own in, so the sampler's ``num_replicas`` and ``rank``, when left out, come from here.

        Args:
            dataloader: the dataloader Lightning prepared.

        Returns:
            The same dataloader.
        """
        dataloader = super().process_dataloader(dataloader)
        _fill_load_balancing_samplers(dataloader, self.world_size, self.global_rank)
        return dataloader

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce a tensor over all processes; anything that is not a tensor comes back unchanged.

        Args:
            tensor: the value to reduce.
            group: must be ``None``: the strategy reduces over all processes.
            reduce_op: ``"mean"``/``"avg"``/``None`` (the default: average), ``"sum"``, ``"max"``, ``"min"``,
                ``"product"``, or the matching ``ReduceOp`` member.

        Returns:
            A new tensor holding the reduced value, on every process.
        """
        return _reduce_over_all_processes(tensor, group, reduce_op, f"{type(self).__name__}.reduce")

    # ------------------------------------------------------------------------------------ async model averaging
    # Background averaging runs while fitting: resumed when training starts, paused (with a final average, so every
    # rank validates the same weights) while validation runs inside fit, aborted when training ends; on an exception
    # it stops without waiting for other ranks. Teardown's close() aborts whatever is still running.

    _async_paused_for_validation: bool = False

    def _async_averaging(self) -> AsyncModelAverageImpl | None:
        if isinstance(self.model, BaguaDistributedDataParallel):
            impl = self.model.bagua_algorithm_impl
            if isinstance(impl, AsyncModelAverageImpl):
                return impl
        return None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        impl = self._async_averaging()
        if impl is not None:
            impl.resume()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        impl = self._async_averaging()
        if impl is not None and impl.enabled:
            impl.abort()
            self._async_paused_for_validation = True

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        impl = self._async_averaging()
        if impl is not None and self._async_paused_for_validation:
            self._async_paused_for_validation = False
            impl.resume()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        impl = self._async_averaging()
        if impl is not None:
            impl.abort()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._stop_async_averaging_on_failure()

    def _stop_async_averaging_on_failure(self) -> None:
        # First thing on an exception: the peers' averaging threads learn of it at their next round and stop too,
        # instead of waiting in a collective for this rank.
        impl = self._async_averaging()
        if impl is not None:
            self._async_paused_for_validation = False
            impl.stop_on_failure()

    @override
    def teardown(self) -> None:
        if isinstance(self.model, BaguaDistributedDataParallel):
            self.model.close()
            # Unwrapped here so that DDPStrategy's teardown, which would suggest DDP-only options, skips its own.
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "bagua" not in strategy_registry:
            strategy_registry.register("bagua", cls, description="Bagua's communication algorithms")


class BaguaStrategy(_BaguaStrategyLogic, DDPStrategy):
    """Train with one of Bagua's communication algorithms: Lightning's DDP, communicating the Bagua way.

    ``Trainer(strategy="bagua")`` selects it with the default algorithm; pass an instance to choose another::

        trainer = Trainer(strategy=BaguaStrategy(algorithm="gradient_allreduce", hierarchical=True))

    The module is wrapped in :class:`~lightning_bagua.engine.BaguaDistributedDataParallel` only while fitting;
    validation, testing and prediction run on the plain module. Gradient accumulation skips communication on
    the accumulating steps, and manual optimization communicates inside ``manual_backward``.

    Args:
        algorithm: an algorithm name (``"gradient_allreduce"``) or an
            :class:`~lightning_bagua.engine.Algorithm` instance.
        flatten: let gradients be views into the flat communication buckets (no copies).
        accelerator: the accelerator, as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        parallel_devices: the devices of this node.
        cluster_environment: the cluster environment; a
            :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` when ``BAGUA_SERVICE_PORT`` is set
            and none is given.
        checkpoint_io: the checkpoint plugin.
        precision_plugin: the precision plugin.
        process_group_backend: ``"nccl"`` or ``"gloo"``; chosen from the device when ``None``.
        timeout: how long a collective may wait before the job fails.
        bucket_cap_mb: gradient bucket size in MiB; ``BAGUA_DEFAULT_BUCKET_SIZE`` (bytes, set by the launcher's
            ``--default_bucket_size``) or Bagua's 10 MiB when ``None``.
        find_unused_parameters: as in DDP, for models whose forward skips parameters.
        telemetry: measure each step's communication (bytes sent and received, compression ratio, time waiting
            on communication, the algorithm's phase) and log it through the trainer's loggers from rank zero,
            under ``bagua/``; off by default, and then nothing is measured.
        autotune: try bucket sizes (and hierarchical communication on several nodes) during the first steps and
            keep the fastest, the same on every rank; ``None`` reads ``BAGUA_AUTOTUNE`` (``1``: on; the launcher's
            ``--autotune_level 1`` sets it), off when unset.
        **bagua_kwargs: the algorithm's keywords, e.g. ``hierarchical=True``; checked here, so that a typo
            fails before any process starts.
    """

    _bagua_environment_cls = BaguaEnvironment
    _configuration_error = MisconfigurationException


def _check_engine_arguments(
    algorithm: str | Algorithm, flatten: bool, bucket_cap_mb: float | None, bagua_kwargs: dict[str, Any]
) -> Algorithm:
    """Check the arguments the Trainer's and Fabric's strategies share, and build the algorithm from them."""
    if not isinstance(flatten, bool):
        raise TypeError(
            f"`flatten` must be a bool, got {flatten!r} ({type(flatten).__name__}). Pass True to let gradients"
            " live in the communication buckets (no copies), or False to keep them separate."
        )
    built = _build_algorithm(algorithm, bagua_kwargs)
    if bucket_cap_mb is not None and (
        not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0
    ):
        raise ValueError(f"`bucket_cap_mb` must be a positive number of MiB, got {bucket_cap_mb!r}.")
    return built


def _reduce_over_all_processes(
    tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None, caller: str
) -> Tensor | Any:
    """Reduce ``tensor`` over the default process group (see ``BaguaStrategy.reduce`` for the accepted ops)."""
    if not isinstance(tensor, Tensor):
        return tensor
    # Fabric names the default group explicitly where the Trainer passes None.
    if group is not None and group is not getattr(dist.group, "WORLD", None):
        raise ValueError(
            f"{caller} reduces over all processes and takes no `group`, got {group!r}."
            " Call torch.distributed.all_reduce yourself to reduce over a subgroup."
        )
    op = _REDUCE_OPS.get(reduce_op) if _is_hashable(reduce_op) else None
    if op is None and reduce_op is not None:
        raise ValueError(
            f"Unsupported `reduce_op` {reduce_op!r}. Use one of 'mean' (or 'avg', None), 'sum', 'max', 'min',"
            " 'product', or the matching torch.distributed.ReduceOp member."
        )
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    result = tensor.clone()
    if op == "mean" and not result.is_floating_point():
        result = result.to(torch.get_default_dtype())
    dist.all_reduce(result, op=_TORCH_OPS[op or "mean"])
    if op == "mean":
        result.div_(dist.get_world_size())
    return result


def _check_telemetry_and_autotune(telemetry: Any, autotune: Any) -> tuple[bool, bool]:
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


def _build_algorithm(algorithm: str | Algorithm, bagua_kwargs: dict[str, Any]) -> Algorithm:
    if isinstance(algorithm, Algorithm):
        if bagua_kwargs:
            raise TypeError(
                f"Algorithm keywords {sorted(bagua_kwargs)} were given with an Algorithm instance ({algorithm!r})."
                " Pass them to the algorithm's constructor, or give the algorithm by name."
            )
        return algorithm
    return Algorithm.init(algorithm, **bagua_kwargs)


_EXIT_HANDLER_REGISTERED = False


def _destroy_process_group_at_exit() -> None:
    # Lightning leaves the default process group alive when a run ends, and a script that exits with it alive
    # can abort in interpreter shutdown: Gloo's worker threads still hold tensors whose release needs the GIL
    # ("terminate called without an active exception", SIGABRT after a successful fit). Destroying it from an
    # atexit handler, while the interpreter is whole, ends the process cleanly; a user who destroyed it already
    # is left alone.
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_default_process_group)
        _EXIT_HANDLER_REGISTERED = True


def _destroy_default_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _fill_load_balancing_samplers(dataloader: object, world_size: int, global_rank: int) -> None:
    # Imported here: the strategy module should not load the data utilities unless a dataloader comes by.
    from lightning_bagua.data.samplers import LoadBalancingDistributedSampler

    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, LoadBalancingDistributedSampler):
            sampler._fill_distributed(world_size, global_rank)
