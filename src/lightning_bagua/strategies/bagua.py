"""``BaguaStrategy``: Lightning's DDP strategy with the model wrapped by the Bagua engine.

This module holds the Trainer's hooks only; what the Trainer and Fabric strategies share (arguments, wrapping,
joining, checkpoint entries, failure handling) is :class:`~lightning_bagua.strategies._core.strategy.BaguaStrategyCore`.
"""

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bagua.engine import Algorithm, AlgorithmImpl, BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms.auto import AutoImpl
from lightning_bagua.engine.autotune import BucketAutotuner
from lightning_bagua.engine.telemetry import CommunicationTelemetry
from lightning_bagua.environments.bagua import BaguaEnvironment
from lightning_bagua.strategies._core.arguments import (
    autotune_metrics,
    check_flag,
    reduce_over_all_processes,
    telemetry_metrics,
)
from lightning_bagua.strategies._core.checkpoint import (
    CHECKPOINT_KEY,
    RankResume,
    attach_entries,
    module_entries,
    rank_resume,
)
from lightning_bagua.strategies._core.checkpoint_io import AtomicTorchCheckpointIO, LastCheckpointLinks
from lightning_bagua.strategies._core.data_resume import (
    DATA_KEY,
    DataResume,
    PositionedSampler,
    capture_rng_states,
    data_entry,
    positioned_sampler,
)
from lightning_bagua.strategies._core.strategy import BaguaStrategyCore

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment

    # The logic is written once and mixed into one class per Lightning package; type-check it as the `lightning`
    # package's DDPStrategy subclass it is there.
    _TrainerBase = DDPStrategy
else:
    _TrainerBase = object

__all__ = ["BaguaStrategy"]

log = logging.getLogger(__name__)

# The Trainer checkpoints one module, under this name in the "bagua" entry.
_MODULE_NAME = "model"
# Checkpoint entries besides the weights and optimizer states that differ between ranks whose weights differ.
_PER_RANK_ENTRIES = ("current_model_state", "callbacks")


class _BaguaStrategyLogic(BaguaStrategyCore, _TrainerBase):
    """The Trainer hooks of :class:`BaguaStrategy`, shared by the classes for both Lightning packages.

    Each concrete class mixes it in before its package's ``DDPStrategy`` and names its package's
    :class:`~lightning_bagua.environments.bagua.BaguaEnvironment` in ``_bagua_environment_cls``.
    """

    # Per fit: the autotuner, the global step it last saw, whether its choice was logged; and what
    # `load_checkpoint` read for this rank, applied once the model is wrapped and its optimizers restored.
    _autotuner: BucketAutotuner | None = None
    _autotune_last_step: int | None = None
    _autotune_logged: bool = False
    _auto_logged: bool = False
    _bagua_resume: RankResume | None = None
    _paused_for_validation: bool = False
    # Per fit: the training dataloader's positioned sampler, and the data position `load_checkpoint` read for this
    # rank, applied when the training dataloader is prepared (position) and when training starts (generators).
    _positioned: PositionedSampler | None = None
    _data_resume: DataResume | None = None
    # `ModelCheckpoint(save_last="link")`'s links, kept whole through a kill (set up with the Trainer).
    _last_links: LastCheckpointLinks | None = None

    def __init__(
        self,
        algorithm: str | Algorithm = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: "ClusterEnvironment | None" = None,
        checkpoint_io: Any | None = None,
        precision_plugin: Any | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        telemetry: bool = False,
        autotune: bool | None = None,
        average_before_save: bool = False,
        pause_for_validation: bool = False,
        start_method: str = "popen",
        **bagua_kwargs: Any,
    ) -> None:
        self._pause_for_validation = check_flag("pause_for_validation", pause_for_validation)
        super().__init__(
            algorithm,
            flatten,
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
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

    @property
    def pause_for_validation(self) -> bool:
        """Whether background work (async averaging) stops, and starts again, around validation inside fit."""
        return self._pause_for_validation

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
        self._join_process_group(self.set_world_ranks, super().setup_distributed)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if trainer.gradient_clip_val:
            self._refuse_gradient_clipping()
        super().setup(trainer)
        self._last_links = LastCheckpointLinks()
        self._last_links.install(trainer.checkpoint_callbacks)
        if trainer.state.fn == "fit":
            self._check_optimizers(self.optimizers, self.lr_scheduler_configs)
        if isinstance(self.model, BaguaDistributedDataParallel):
            # Lightning creates the optimizers after wrapping; algorithms that act around the step need them.
            self.model.bind_optimizers(self.optimizers)
            impl = self.model.bagua_algorithm_impl
            if isinstance(impl, AutoImpl) and trainer.state.fn == "fit":
                impl.use_run_length(trainer.estimated_stepping_batches)

    @override
    def _setup_model(self, model: Module) -> BaguaDistributedDataParallel:
        wrapped = self._wrap_module(model, self.determine_ddp_device_ids())
        self._auto_logged = False
        if self._autotune:
            self._autotuner = BucketAutotuner()
            self._autotune_last_step = None
            self._autotune_logged = False
        return wrapped

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Prepare a dataloader; the training one also resumes from a checkpoint's batch, mid-epoch included.

        The sampler of the training dataloader's ``BatchSampler`` is replaced by a
        :class:`~lightning_bagua.strategies._core.data_resume.PositionedSampler`, which yields the same indices and,
        when fitting resumes from a checkpoint written by this strategy, skips the batches of the epoch already
        trained on (none of them is loaded).

        Args:
            dataloader: the dataloader the Trainer prepared.

        Returns:
            The same dataloader.
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training:
            return dataloader
        if callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None)):
            # It saves its own position (torchdata's StatefulDataLoader, say), and Lightning restores it: skipping
            # here as well would skip its batches twice.
            return dataloader
        resume, self._data_resume = self._data_resume, None
        self._positioned = positioned_sampler(dataloader)
        if self._positioned is None:
            if resume is not None and resume.batches and self.global_rank == 0:
                log.warning(
                    "The training dataloader's batches do not come from a torch `BatchSampler` over a map-style"
                    " dataset (it has a custom batch sampler, `batch_size=None` or an `IterableDataset`), so"
                    " BaguaStrategy cannot skip the %d batches of epoch %d already trained on: the epoch restarts from"
                    " its first batch, as Lightning does. Use a DataLoader with `batch_size` over a map-style dataset,"
                    " or resume from a checkpoint written at an epoch's end.",
                    resume.batches,
                    resume.epoch,
                )
            return dataloader
        self._positioned.note_generator()
        if resume is not None:
            resume.apply(self._positioned)
            self._data_resume = resume  # its generator states are restored when training starts
            if resume.batches:
                # Shown where Lightning's own resume messages are, next to its warning that this loader cannot resume.
                rank_zero_info(
                    f"BaguaStrategy resumes epoch {resume.epoch} at batch {resume.batches}: the sampler skips the"
                    " batches already trained on, and the random number generators continue from their saved states."
                    " Lightning's warning that the dataloader is not resumable does not apply."
                )
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        impl = self._algorithm_impl()
        if impl is not None:
            impl.start()
        resume, self._data_resume = self._data_resume, None
        if resume is not None:
            # Last before the first batch: the hooks of the start of fitting ran once in the undisturbed run, before
            # the states saved in the checkpoint.
            resume.restore_rng()

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
            self._log_to_loggers(autotune_metrics(self._autotuner.decision))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: "pl.LightningModule | Module | None" = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        impl = self._algorithm_impl()
        if impl is not None:
            impl.on_optimizer_step(optimizer)
        if not self._auto_logged and (decision := self.auto_decision) is not None:
            self._auto_logged = True
            self._log_to_loggers(decision.metrics())
        telemetry = self.telemetry
        if telemetry is not None:
            # The step is complete here, the algorithm's post-step communication included.
            record = telemetry.end_step()
            if record is not None:
                self._log_to_loggers(telemetry_metrics(record))
        return output

    @override
    def on_validation_start(self) -> None:
        # Only when asked: stopping background work (async averaging) is a collective with a sync of its own, which
        # Bagua never made here; its rounds wait for the next training step anyway, so validation reads whole ones.
        super().on_validation_start()
        impl = self._algorithm_impl()
        if impl is not None and self._pause_for_validation:
            impl.stop()
            self._paused_for_validation = True
        elif impl is not None and getattr(impl, "validates_outer_weights", False):
            # diloco validates its synced weights, put aside again by the start() at the end of validation.
            getattr(impl, "show_outer_weights")()  # noqa: B009 - not on the AlgorithmImpl interface
            self._paused_for_validation = True

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        impl = self._algorithm_impl()
        if impl is not None and self._paused_for_validation:
            self._paused_for_validation = False
            impl.start()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        impl = self._algorithm_impl()
        if impl is not None:
            impl.stop()

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce a tensor over the processes, in place, as Lightning's ``DDPStrategy`` does; non-tensors pass through.

        Args:
            tensor: the value to reduce.
            group: the process group; ``None`` for all processes.
            reduce_op: an op name in any letter case (``"mean"``/``"avg"``, the default, average on every
                backend; ``"sum"``, ``"max"``, ...), a ``ReduceOp`` member, or ``None`` (average, as
                lightning-bagua 0.1.0 took it).

        Returns:
            ``tensor`` itself, holding the reduced value on every process (as DDP and lightning-bagua 0.1.0 reduce).
        """
        return reduce_over_all_processes(tensor, group, reduce_op, f"{type(self).__name__}.reduce")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add every rank's algorithm state (and, where ranks' weights differ, their weights) and save on rank 0.

        Every rank must call it, as ``Trainer.save_checkpoint`` does: the ranks' states are gathered to rank 0.
        While fitting, the checkpoint gets a ``"bagua"`` entry (see the fault tolerance page of the docs): per
        module, the algorithm's name, each rank's algorithm state and, for algorithms whose ranks hold different
        weights (:attr:`~lightning_bagua.engine.Algorithm.ranks_hold_different_weights`), each rank's ``state_dict`` and
        ``optimizer_states``. Its top-level ``state_dict`` is rank 0's weights, or their average over the ranks
        with ``average_before_save=True``. The entry also holds the training data's position (epoch and batches
        trained on) and every rank's random number generator states, under ``"data"``, so that fitting can resume
        in the middle of an epoch.

        Args:
            checkpoint: the checkpoint Lightning assembled on this rank.
            filepath: where rank 0 writes it.
            storage_options: passed to the checkpoint plugin.
        """
        # First: gathering the entries must not move the generators away from the states the next batch draws from.
        rng = capture_rng_states()
        if isinstance(self.model, BaguaDistributedDataParallel) and "state_dict" in checkpoint:
            entry = self._gather_module_entry(
                self.model,
                lambda: {
                    "state_dict": checkpoint["state_dict"],
                    "optimizer_states": checkpoint.get("optimizer_states"),
                    # Callbacks keep per-rank weights too: WeightAveraging's current model, SWA's averaged one.
                    "extra": {key: checkpoint[key] for key in _PER_RANK_ENTRIES if key in checkpoint},
                },
            )
            if entry is not None:
                entries = {_MODULE_NAME: entry}
                checkpoint = attach_entries(checkpoint, entries, self.world_size, weights_key=lambda _: "state_dict")
            if self._positioned is not None:
                data = self._data_entry(self._positioned, rng)
                if data is not None and CHECKPOINT_KEY in checkpoint:
                    checkpoint[CHECKPOINT_KEY][DATA_KEY] = data
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint on rank 0, or keep it while ``last.ckpt`` links to it (see :class:`LastCheckpointLinks`).

        Args:
            filepath: the checkpoint to remove.
        """
        if self._last_links is None or not self.is_global_zero:
            super().remove_checkpoint(filepath)
        else:
            self._last_links.remove(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint; when fitting, put this rank's own weights and optimizer states where Lightning reads them.

        The algorithm state (and, where ranks' weights differ, this rank's weights once more: wrapping the model
        broadcasts rank 0's) is applied after the model is wrapped and the optimizers are restored; the data's
        position when the training dataloader is prepared, and the generator states when training starts.

        Args:
            checkpoint_path: the checkpoint to read.
            *args: passed on to Lightning's ``load_checkpoint``.
            **kwargs: passed on to Lightning's ``load_checkpoint``.

        Returns:
            The checkpoint, with this rank's ``state_dict`` and ``optimizer_states``.

        Raises:
            ValueError: when fitting, the checkpoint was written by another algorithm.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._bagua_resume = None
        self._data_resume = None
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            # Validating, testing or predicting read the top-level `state_dict` (rank 0's, or the ranks' average
            # with `average_before_save`), on any number of processes.
            return checkpoint
        self._data_resume = self._read_data_entry(checkpoint, checkpoint_path)
        saved = module_entries(checkpoint, _MODULE_NAME)
        entry = None if saved is None else saved[1].get(_MODULE_NAME)
        if entry is None:
            if self._algorithm.ranks_hold_different_weights:
                log.warning(
                    "%s holds no Bagua state (it was not saved by BaguaStrategy while fitting): every rank resumes"
                    " from its single `state_dict`, and the %r algorithm's state starts afresh.",
                    checkpoint_path,
                    self._algorithm.name,
                )
            return checkpoint
        resume = rank_resume(entry, _MODULE_NAME, self._algorithm.name, self.world_size, self.global_rank)
        self._bagua_resume = resume
        if resume.state_dict is not None:
            checkpoint["state_dict"] = resume.state_dict
            if resume.optimizer_states is not None:
                checkpoint["optimizer_states"] = resume.optimizer_states
            checkpoint.update(resume.extra)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        resume, self._bagua_resume = self._bagua_resume, None
        wrapped = self.model if isinstance(self.model, BaguaDistributedDataParallel) else None
        if resume is not None and wrapped is not None and resume.state_dict is not None:
            # Wrapping broadcast rank 0's weights to every rank; this rank continues from its own (the current ones:
            # with WeightAveraging, `state_dict` holds the average).
            assert self.lightning_module is not None
            own = resume.extra.get("current_model_state", resume.state_dict)
            self.lightning_module.load_state_dict(own, strict=self.lightning_module.strict_loading)
        super().load_optimizer_state_dict(checkpoint)
        if resume is not None and wrapped is not None:
            wrapped.load_bagua_state_dict(resume.algorithm_state_for(wrapped))

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Stop the algorithm, tell the other ranks about this failure, and decide whether the job can go on.

        Every rank that fails writes its error to the rendezvous store and waits for the others' reports. An error
        every rank raised leaves every process alive: the run is torn down as usual, and a script that catches the
        error can fit again, as with Lightning's DDP. After a failed collective the exception gets a note naming
        the ranks that raised (with their errors) and those that never reported (dead, killed or hung), and under
        Lightning's own launcher rank 0 ends the ranks it started. A rank whose own error no other rank reported
        within :data:`~lightning_bagua.strategies._core.faults.SHARED_FAILURE_WINDOW_S` raised alone: the others
        wait for it in a collective, so it prints the error and ends its process (exit code 1), and they fail at
        once. See the fault tolerance page of the docs.

        Args:
            exception: what interrupted the run.
        """
        super().on_exception(exception)
        self._paused_for_validation = False
        self._handle_failure(exception)

    @override
    def teardown(self) -> None:
        self._bagua_resume = None
        self._data_resume = None
        self._positioned = None
        if isinstance(self.model, BaguaDistributedDataParallel):
            _ = self.auto_decision  # kept for scripts that read it after fit
            self.model.close()
            # Unwrapped here so that DDPStrategy's teardown, which would suggest DDP-only options, skips its own.
            self.model = self.lightning_module
        super().teardown()

    @override
    def _bagua_wrapped_modules(self) -> list[BaguaDistributedDataParallel]:
        return [self.model] if isinstance(self.model, BaguaDistributedDataParallel) else []

    def _data_entry(self, positioned: PositionedSampler, rng: dict[str, Any]) -> dict[str, Any] | None:
        """Gather the training data's position and every rank's generator states to rank 0 (collective)."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        # Batches fetched and trained on in this epoch; batches the loop has fetched ahead of time are not counted.
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        epoch_done = batches >= trainer.num_training_batches
        return data_entry(positioned, rng, trainer.current_epoch, batches, epoch_done, self.world_size)

    def _read_data_entry(self, checkpoint: Mapping[str, Any], checkpoint_path: Any) -> DataResume | None:
        """Return this rank's part of the checkpoint's data position, or ``None`` where it cannot resume this run."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        entry = saved.get(DATA_KEY) if isinstance(saved, Mapping) else None
        if entry is None:
            return None
        if entry["world_size"] != self.world_size:
            if self.global_rank == 0 and entry["batches"] and not entry["epoch_done"]:
                log.warning(
                    "%s was written by %d processes and this run has %d: each rank's share of the data differs, so"
                    " epoch %d restarts from its first batch, as Lightning does. Resume with %d processes to continue"
                    " at batch %d.",
                    checkpoint_path,
                    entry["world_size"],
                    self.world_size,
                    entry["epoch"],
                    entry["world_size"],
                    entry["batches"],
                )
            return None
        # Lightning restores its epoch count, and sets a finished epoch again when the checkpoint was written at its
        # last batch (validation there), before the next one's.
        return DataResume(entry, self.global_rank, framework_counts_epochs=True)

    def _algorithm_impl(self) -> AlgorithmImpl | None:
        return self.model.bagua_algorithm_impl if isinstance(self.model, BaguaDistributedDataParallel) else None

    def _log_to_loggers(self, metrics: dict[str, float]) -> None:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


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
            ``--default_bucket_size``) when ``None``, or else 100 MiB on CUDA and Bagua's 10 MiB elsewhere.
        find_unused_parameters: as in DDP, for models whose forward skips parameters.
        telemetry: measure each step's communication (bytes sent and received, compression ratio, time waiting
            on communication, the algorithm's phase) and log it through the trainer's loggers from rank zero,
            under ``bagua/``; off by default, and then nothing is measured.
        autotune: try bucket sizes (and hierarchical communication on several nodes) during the first steps and
            keep the fastest, the same on every rank; ``None`` reads ``BAGUA_AUTOTUNE`` (``1``: on; the launcher's
            ``--autotune_level 1`` sets it), off when unset.
        average_before_save: with an algorithm whose ranks hold different weights (the weight-averaging ones,
            :attr:`~lightning_bagua.engine.Algorithm.ranks_hold_different_weights`), write the average of the
            ranks' weights as the checkpoint's ``state_dict`` (what ``load_from_checkpoint`` and evaluation read)
            instead of rank 0's. Training is unaffected, and resuming still restores each rank's own weights. With
            other algorithms the ranks' weights are equal, so rank 0's are their average.
        pause_for_validation: stop background work (``async``'s averaging thread) when validation starts inside
            fit, and start it again when validation ends, so that validation reads weights no round is changing;
            off by default, as in lightning-bagua 0.1.0 (whose rounds wait for the next training step anyway).
        start_method: how Lightning starts the processes of a node, as for its ``DDPStrategy``: ``"popen"`` (the
            default: the script runs again for each process), ``"spawn"``, ``"fork"`` (notebooks) or
            ``"forkserver"`` (processes started from this one, with the function and its arguments pickled).
        **bagua_kwargs: the algorithm's keywords, e.g. ``hierarchical=True``; checked here, so that a typo
            fails before any process starts.
    """

    _bagua_environment_cls = BaguaEnvironment
    _checkpoint_io_cls = AtomicTorchCheckpointIO
    _configuration_error = MisconfigurationException
