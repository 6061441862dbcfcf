"""``BaguaStrategy``: Lightning's DDP strategy with the model wrapped by the Bagua engine."""

import atexit
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.apply_func import apply_to_collection
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
        average_before_save: bool = False,
        **bagua_kwargs: Any,
    ) -> None:
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(
                f"`timeout` must be a datetime.timedelta or None, got {timeout!r} ({type(timeout).__name__})."
                " Pass e.g. timeout=timedelta(seconds=60)."
            )
        if not isinstance(average_before_save, bool):
            raise TypeError(
                f"`average_before_save` must be a bool, got {average_before_save!r}"
                f" ({type(average_before_save).__name__})."
            )
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
        self._average_before_save = average_before_save
        # What `load_checkpoint` read for this rank, applied once the model is wrapped and its optimizers restored.
        self._bagua_resume: _RankResume | None = None
        self._fits_started = 0

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
    def average_before_save(self) -> bool:
        """Whether a checkpoint's ``state_dict`` holds the average of the ranks' weights instead of rank 0's."""
        return self._average_before_save

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
        backend = self._process_group_backend
        if backend is not None and "nccl" in backend and self.root_device.type != "cuda":
            raise self._configuration_error(
                f"process_group_backend={backend!r} needs CUDA devices, but this run trains on"
                f" {self.root_device.type!r}. Pass process_group_backend='gloo' (or leave it out to choose from the"
                " device), or train on GPUs with accelerator='gpu'."
            )
        try:
            if dist.is_available() and not dist.is_initialized():
                self._wait_for_store()
                if _restart_count() > 0:
                    self._init_restarted_process_group()
            super().setup_distributed()
        except dist.DistNetworkError as error:
            assert self.cluster_environment is not None
            address = f"{self.cluster_environment.main_address}:{self.cluster_environment.main_port}"
            raise dist.DistNetworkError(
                f"Rank {self.global_rank} of {self.world_size} could not join the process group through the store at"
                f" {address} ({error}). Check that MASTER_ADDR and MASTER_PORT name the main node and a port that is"
                f" free there and reachable from here, and that rank 0 runs; joining waits at most the strategy's"
                f" `timeout` ({self._timeout})."
            ) from error
        _destroy_process_group_at_exit()

    def _wait_for_store(self) -> None:
        # torch's store client tries to connect twice, each time for the whole timeout and with a random pause
        # between, so an unreachable address fails only after two to three timeouts; probing first bounds it by one.
        assert self.cluster_environment is not None
        self.set_world_ranks()
        if self.global_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            return  # this process hosts the store
        timeout = self._timeout or default_pg_timeout
        address = (self.cluster_environment.main_address, self.cluster_environment.main_port)
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            remaining = deadline - time.monotonic()
            try:
                with socket.create_connection(address, timeout=max(min(remaining, 5.0), 0.1)):
                    return
            except OSError as error:
                if time.monotonic() + 0.5 >= deadline:
                    raise dist.DistNetworkError(f"nothing answered within the timeout ({timeout}): {error}") from error
            time.sleep(0.5)  # rank 0 may still be starting

    def _init_restarted_process_group(self) -> None:
        # torch's elastic agent keeps one store for all attempts, and the process group's keys (each rank's
        # address) carry no attempt number: a restarted rank can read the address of a rank that died in the last
        # attempt and fail to connect. Keys under a prefix of their own per attempt cannot be stale; Lightning then
        # finds the group initialised and keeps it.
        assert self.cluster_environment is not None
        self.set_world_ranks()
        backend = self._get_process_group_backend()
        use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        timeout = self._timeout or default_pg_timeout
        store = dist.TCPStore(
            self.cluster_environment.main_address,
            self.cluster_environment.main_port,
            self.world_size,
            is_master=not use_agent_store and self.global_rank == 0,
            timeout=timeout,
        )
        log.info("Joining the process group of restart %d under its own store prefix", _restart_count())
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"lightning_bagua/restart_{_restart_count()}", store),
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._fits_started += 1
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
                self._log_to_loggers(_telemetry_metrics(record))
        return output

    def _log_autotune_decision(self, decision: AutotuneSetting) -> None:
        self._log_to_loggers(_autotune_metrics(decision))

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

    def _stop_async_averaging_on_failure(self) -> None:
        # First thing on an exception: the peers' averaging threads learn of it at their next round and stop too,
        # instead of waiting in a collective for this rank.
        impl = self._async_averaging()
        if impl is not None:
            self._async_paused_for_validation = False
            impl.stop_on_failure()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add every rank's algorithm state (and, where ranks' weights differ, their weights) and save on rank 0.

        Every rank must call it, as ``Trainer.save_checkpoint`` does: the ranks' states are gathered to rank 0.
        While fitting, the checkpoint gets a ``"bagua"`` entry (see the fault tolerance page of the docs): the
        algorithm's name, the world size, each rank's algorithm state, and, for algorithms whose ranks hold
        different weights (``decentralized``, ``low_precision_decentralized``), each rank's ``state_dict`` and
        ``optimizer_states``. Its top-level ``state_dict`` is rank 0's weights, or their average over the ranks
        with ``average_before_save=True``.

        Args:
            checkpoint: the checkpoint Lightning assembled on this rank.
            filepath: where rank 0 writes it.
            storage_options: passed to the checkpoint plugin.
        """
        if isinstance(self.model, BaguaDistributedDataParallel) and "state_dict" in checkpoint:
            checkpoint = self._add_bagua_state(checkpoint, self.model)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint; when fitting, put this rank's own weights and optimizer states where Lightning reads them.

        The algorithm state (and, where ranks' weights differ, this rank's weights once more: wrapping the model
        broadcasts rank 0's) is applied after the model is wrapped and the optimizers are restored.

        Args:
            checkpoint_path: the checkpoint to read.
            *args: passed on to Lightning's ``load_checkpoint``.
            **kwargs: passed on to Lightning's ``load_checkpoint``.

        Returns:
            The checkpoint, with this rank's ``state_dict`` and ``optimizer_states``.

        Raises:
            ValueError: when fitting, the checkpoint was written by another algorithm or another number of processes.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._bagua_resume = None
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            # Validating, testing or predicting read the top-level `state_dict` (rank 0's, or the ranks' average
            # with `average_before_save`), on any number of processes.
            return checkpoint
        saved = checkpoint.get("bagua")
        if saved is None:
            if self._algorithm.name in _PER_RANK_WEIGHTS:
                log.warning(
                    "%s holds no Bagua state (it was not saved by BaguaStrategy while fitting): every rank resumes"
                    " from its single `state_dict`, and the %r algorithm's state starts afresh.",
                    checkpoint_path,
                    self._algorithm.name,
                )
            return checkpoint
        self._bagua_resume = _read_rank_state(saved, self._algorithm.name, self.world_size, self.global_rank)
        if self._bagua_resume.state_dict is not None:
            checkpoint["state_dict"] = self._bagua_resume.state_dict
            if self._bagua_resume.optimizer_states is not None:
                checkpoint["optimizer_states"] = self._bagua_resume.optimizer_states
            checkpoint.update(self._bagua_resume.extra)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        resume, self._bagua_resume = self._bagua_resume, None
        wrapped = self.model if isinstance(self.model, BaguaDistributedDataParallel) else None
        if resume is not None and wrapped is not None and resume.state_dict is not None:
            # Wrapping broadcast rank 0's weights to every rank; this rank continues from its own.
            assert self.lightning_module is not None
            own = resume.extra.get("current_model_state", resume.state_dict)  # WeightAveraging saves the average
            self.lightning_module.load_state_dict(own, strict=self.lightning_module.strict_loading)
        super().load_optimizer_state_dict(checkpoint)
        if resume is not None and wrapped is not None:
            wrapped.load_bagua_state_dict(resume.algorithm_state)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks about this failure and, when a collective failed, name the ranks that went silent.

        Every rank that fails writes its error to the rendezvous store. A rank whose error looks like a failed
        collective then waits a few seconds for the others' reports and adds a note to its exception naming the
        ranks that raised (with their errors) and those that never reported: dead (killed, out of memory) or hung.
        Under Lightning's own launcher, the main process (rank 0) then kills the ranks it started.

        Args:
            exception: what interrupted the run.
        """
        super().on_exception(exception)
        self._stop_async_averaging_on_failure()
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            window = _DIAGNOSIS_WINDOW_S
            if self._timeout is not None:
                window = min(window, self._timeout.total_seconds())
            note = _diagnose_failure(exception, self.global_rank, self.world_size, self._fits_started, window)
            if note is not None:
                log.error(note)
                if hasattr(exception, "add_note"):
                    exception.add_note(note)
        _end_launched_children(self.launcher)

    def _add_bagua_state(self, checkpoint: dict[str, Any], wrapped: BaguaDistributedDataParallel) -> dict[str, Any]:
        per_rank = self._algorithm.name in _PER_RANK_WEIGHTS
        own: dict[str, Any] = {"algorithm_state": wrapped.bagua_state_dict()}
        if per_rank:
            own["state_dict"] = checkpoint["state_dict"]
            own["optimizer_states"] = checkpoint.get("optimizer_states")
            # Callbacks keep per-rank weights too: WeightAveraging's current model, SWA's averaged one.
            own["extra"] = {key: checkpoint[key] for key in ("current_model_state", "callbacks") if key in checkpoint}
        # Pickled to rank 0 through the default group; CPU copies travel on any backend.
        own = apply_to_collection(own, Tensor, lambda tensor: tensor.detach().cpu())
        gathered: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(own, gathered, dst=0)
        if gathered is None:
            return checkpoint  # only rank 0 writes
        checkpoint = dict(checkpoint)
        checkpoint["bagua"] = {
            "version": _CHECKPOINT_VERSION,
            "algorithm": self._algorithm.name,
            "world_size": self.world_size,
            "algorithm_states": [rank_state["algorithm_state"] for rank_state in gathered],
            "ranks": (
                [
                    {
                        "state_dict": rank_state["state_dict"],
                        "optimizer_states": rank_state["optimizer_states"],
                        "extra": rank_state["extra"],
                    }
                    for rank_state in gathered
                ]
                if per_rank
                else None
            ),
            "averaged": per_rank and self._average_before_save,
        }
        if per_rank and self._average_before_save:
            checkpoint["state_dict"] = _average_state_dicts([rank_state["state_dict"] for rank_state in gathered])
        return checkpoint

    @override
    def teardown(self) -> None:
        self._bagua_resume = None
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
        timeout: how long a collective, or joining the process group, may wait before the job fails; Lightning's
            30 minutes by default, which also covers ranks that wait for rank 0 to prepare data or write a
            checkpoint. A killed peer is noticed within seconds (its sockets close, and the launchers end the
            job); only a hung peer, or an unreachable master address, takes the whole timeout.
        bucket_cap_mb: gradient bucket size in MiB; ``BAGUA_DEFAULT_BUCKET_SIZE`` (bytes, set by the launcher's
            ``--default_bucket_size``) or Bagua's 10 MiB when ``None``.
        find_unused_parameters: as in DDP, for models whose forward skips parameters.
        telemetry: measure each step's communication (bytes sent and received, compression ratio, time waiting
            on communication, the algorithm's phase) and log it through the trainer's loggers from rank zero,
            under ``bagua/``; off by default, and then nothing is measured.
        autotune: try bucket sizes (and hierarchical communication on several nodes) during the first steps and
            keep the fastest, the same on every rank; ``None`` reads ``BAGUA_AUTOTUNE`` (``1``: on; the launcher's
            ``--autotune_level 1`` sets it), off when unset.
        average_before_save: with an algorithm whose ranks hold different weights (``decentralized``,
            ``low_precision_decentralized``), write the average of the ranks' weights as the checkpoint's
            ``state_dict`` (what ``load_from_checkpoint`` and evaluation read) instead of rank 0's. Training is
            unaffected, and resuming still restores each rank's own weights. With other algorithms the ranks'
            weights are equal, so rank 0's are their average.
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


def _telemetry_metrics(record: Mapping[str, float]) -> dict[str, float]:
    """Name a telemetry record's values as both strategies publish them: ``bagua/<key>``, the step index left out."""
    return {f"bagua/{key}": value for key, value in record.items() if key != "step"}


def _autotune_metrics(decision: AutotuneSetting) -> dict[str, float]:
    """Name the autotuner's choice as both strategies publish it."""
    return {
        "bagua/autotune/bucket_cap_mb": decision.bucket_cap_mb,
        "bagua/autotune/hierarchical": float(decision.hierarchical),
    }


# Algorithms whose ranks hold different weights between steps: checkpoints carry every rank's weights and optimizer
# state, since rank 0's alone would not resume the others.
_PER_RANK_WEIGHTS = frozenset({"decentralized", "low_precision_decentralized", "async"})
_CHECKPOINT_VERSION = 1
# How long a rank whose collective failed waits for the others' reports before naming the silent ones.
_DIAGNOSIS_WINDOW_S = 5.0
_FAILURE_KEY = "lightning_bagua/failure"


class _RankResume:
    """What one rank resumes from: its algorithm state and, where ranks' weights differ, its weights and optimizers."""

    def __init__(
        self,
        algorithm_state: dict[str, Any],
        state_dict: dict[str, Any] | None,
        optimizer_states: list[Any] | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.algorithm_state = algorithm_state
        self.state_dict = state_dict
        self.optimizer_states = optimizer_states
        self.extra: dict[str, Any] = extra or {}


def _read_rank_state(saved: Any, algorithm: str, world_size: int, rank: int) -> _RankResume:
    if not isinstance(saved, dict) or saved.get("version") != _CHECKPOINT_VERSION:
        version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(
            f"The checkpoint's 'bagua' entry has version {version!r}; this release reads version"
            f" {_CHECKPOINT_VERSION}. Resume with the release that wrote it, or delete the entry to load the weights"
            " alone."
        )
    if saved["algorithm"] != algorithm:
        raise ValueError(
            f"The checkpoint was written while training with the {saved['algorithm']!r} algorithm, but this strategy"
            f" uses {algorithm!r}. Resume with the same algorithm, or load the weights alone"
            " (LightningModule.load_from_checkpoint) to switch."
        )
    if saved["world_size"] != world_size:
        raise ValueError(
            f"The checkpoint holds the algorithm state of {saved['world_size']} processes, but this run has"
            f" {world_size}. Resume with {saved['world_size']} processes, or load the weights alone"
            " (LightningModule.load_from_checkpoint) to start the algorithm afresh."
        )
    ranks = saved["ranks"]
    own = ranks[rank] if ranks is not None else {"state_dict": None, "optimizer_states": None}
    return _RankResume(saved["algorithm_states"][rank], own["state_dict"], own["optimizer_states"], own.get("extra"))


def _average_state_dicts(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    averaged = dict(state_dicts[0])
    for key, value in state_dicts[0].items():
        # Floating tensors are averaged; counters (BatchNorm's num_batches_tracked) stay rank 0's.
        if isinstance(value, Tensor) and value.is_floating_point():
            averaged[key] = torch.stack([state_dict[key] for state_dict in state_dicts]).mean(dim=0)
    return averaged


def _end_launched_children(launcher: Any) -> None:
    """Kill the processes Lightning's own launcher started from this one, which cannot go on without it."""
    # Under Lightning's launcher this process is rank 0 and hosts the rendezvous store; the other ranks are its
    # children, and Lightning ends them only on KeyboardInterrupt. Otherwise a child still joining the group, or
    # blocked in a collective that the dead store cannot fail, waits out the whole timeout as an orphan.
    children = [proc for proc in getattr(launcher, "procs", None) or () if isinstance(proc, subprocess.Popen)]
    for child in children:
        if child.poll() is None:
            log.error("Ending rank process %d, started by this one, since this one is failing", child.pid)
            child.kill()


def _restart_count() -> int:
    """Return how often torch's elastic agent restarted this job's workers (0 outside torchelastic)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _looks_like_failed_collective(exception: BaseException) -> bool:
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("gloo", "nccl", "connection", "timed out", "timeout", "peer")
    )


def _diagnose_failure(exception: BaseException, rank: int, world_size: int, fit: int, window_s: float) -> str | None:
    """Report this rank's failure to the store; after a failed collective, return a note naming the silent ranks."""
    # Keys are per restart (the agent's store outlives its workers) and per fit, so old reports never count.
    prefix = f"{_FAILURE_KEY}/{_restart_count()}/{fit}"
    summary = f"{type(exception).__name__}: {str(exception).strip().splitlines()[0] if str(exception).strip() else ''}"
    collective = _looks_like_failed_collective(exception)
    try:
        store = dist.distributed_c10d._get_default_store()
        # A store that stopped answering must not hold the failing process for the whole collective timeout.
        store.set_timeout(timedelta(seconds=max(window_s, 1.0)))
        store.set(f"{prefix}/{rank}", summary[:500])
        if not collective:
            return None
        reports: dict[int, str] = {}
        deadline = time.monotonic() + window_s
        while True:
            for other in range(world_size):
                if other not in reports and store.check([f"{prefix}/{other}"]):
                    reports[other] = store.get(f"{prefix}/{other}").decode(errors="replace")
            if len(reports) == world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception as error:  # the original error is re-raised either way; this one goes into its note
        # The store dies with the process hosting it, and a launcher's SIGTERM can interrupt the wait (Lightning's
        # handler then runs a collective of its own, which fails too).
        if not collective:
            return None
        return (
            f"lightning_bagua: rank {rank} of {world_size} saw a collective fail; collecting the other ranks'"
            f" reports failed too ({type(error).__name__}: {error}). If the rendezvous store is gone, the process"
            " hosting it died: rank 0 under Lightning's own launcher; under torchrun or lightning_bagua.launch the"
            " agent, whose summary names the failed rank."
        )
    silent = [other for other in range(world_size) if other not in reports]
    raised = [f"rank {other} ({reports[other]})" for other in sorted(reports) if other != rank]
    parts = [f"lightning_bagua: rank {rank} of {world_size} saw a collective fail."]
    if silent:
        parts.append(
            f"Failed rank(s): {', '.join(map(str, silent))} (no report within {window_s:g} s: the process died,"
            " was killed or hangs)."
        )
    if raised:
        parts.append(f"Other ranks that raised: {'; '.join(raised)}.")
    return " ".join(parts)


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
