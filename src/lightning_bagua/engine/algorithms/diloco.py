"""``diloco``: local SGD with an outer optimizer (DiLoCo), streamed by fragments, with low-precision outer gradients.

Design:

* Steps are counted at step boundaries. A step opens at a forward pass whose backward synchronizes (not under
  ``no_sync()``) and closes once the last bound optimizer has stepped, where the strategies report it
  (``on_optimizer_step``), or else at the start of the next training forward pass, whatever drives the
  optimizers (plain PyTorch, manual optimization, gradient accumulation). Everything the algorithm does to the
  weights happens at a boundary.
* The parameters are cut into ``fragments`` contiguous groups of about equal size. Each keeps ``θ_outer`` as one
  flat float32 tensor (on the model's device, or in host memory with ``offload``) and its own outer optimizer.
* An exchange of one fragment: on the training thread, ``Δ = θ_outer - x`` (float32); on the exchange thread,
  encode, all-gather among the participants on a communicator of the algorithm's own, decode and average every
  row, take the outer step. It is merged ``fragment_sync_delay`` steps later, on the training thread. The thread
  waits for its collectives itself (never a Python callback on a Gloo future), and on CUDA it works on a stream
  of its own that waits for the training stream's ``Δ``.
* Hierarchical: the ranks of a node all-reduce their gradients at every step (full precision, over the node), so
  they hold one replica; only node leaders gather among nodes, and each leader broadcasts the average inside its
  node, so that every rank takes the same outer step and holds the same ``θ_outer``.
"""

import copy
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_bagua.engine._torch_compat import destroy_process_group, process_group_exists
from lightning_bagua.engine.algorithms._diloco_quantize import QUANTIZATIONS, OuterGradientCodec
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    check_keyword_type,
    check_positive_int,
    check_state_keys,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.decentralized import local_gradient_hook
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState, gradient_allreduce_hook
from lightning_bagua.engine.algorithms.weights import check_optimizers_cover, views_like
from lightning_bagua.engine.communication import CommunicationGroups, NodeLayout, all_gather_into

__all__ = ["DiLoCoAlgorithm", "DiLoCoImpl", "fragment_offsets", "split_fragments"]

log = logging.getLogger(__name__)

_PAPER_OUTER_KWARGS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}

THREAD_NAME = "bagua-diloco-exchange"
"""The name of the exchange thread, one per wrapped model."""


def fragment_offsets(sync_every: int, fragments: int) -> list[int]:
    """Return the step offset of every fragment: fragment ``p`` syncs after the steps ``k > 0`` with ``k % H == o_p``.

    The offsets ``o_p = ⌊(p + 1)·H / F⌋ mod H`` are spread evenly over the period, and the last fragment syncs at
    the period's end (``o_{F-1} = 0``), so with one fragment every parameter syncs after steps ``H, 2H, ...``.

    Args:
        sync_every: the period ``H``.
        fragments: the number of fragments ``F``, at most ``H``.

    Returns:
        ``F`` distinct offsets in ``[0, H)``.
    """
    return [((p + 1) * sync_every // fragments) % sync_every for p in range(fragments)]


def split_fragments(sizes: Sequence[int], fragments: int) -> list[range]:
    """Cut a list of parameters into ``fragments`` contiguous runs of about equal total size.

    Args:
        sizes: every parameter's number of elements, in order.
        fragments: the number of runs, at most ``len(sizes)``.

    Returns:
        The runs, as index ranges into ``sizes``; none is empty.
    """
    total = sum(sizes)
    bounds = [0]
    running = 0
    for index, size in enumerate(sizes):
        running += size
        cut = len(bounds)
        # Close a run once it reaches its share, leaving at least one parameter for each run still to come.
        if cut < fragments and running >= total * cut / fragments and len(sizes) - (index + 1) >= fragments - cut:
            bounds.append(index + 1)
    while len(bounds) < fragments:  # tiny leading parameters: give the last runs one parameter each
        bounds.append(len(sizes) - (fragments - len(bounds)))
    bounds.append(len(sizes))
    return [range(bounds[p], bounds[p + 1]) for p in range(fragments)]


@dataclass
class _Fragment:
    """One fragment: its parameters, its ``θ_outer`` and outer optimizer, and its error-feedback residual."""

    parameters: list[Parameter]
    outer: Parameter
    optimizer: Optimizer
    offset: int
    residual: Tensor | None = None

    @property
    def numel(self) -> int:
        return self.outer.numel()


@dataclass
class _Exchange:
    """An exchange in flight: which fragment, the step it merges at, and the thread's future."""

    fragment: int
    merge_at: int
    future: Future[None] | None = None  # None: already settled (or restored from a checkpoint)


@dataclass
class _Telemetry:
    syncs: int = 0
    waited_s: float = 0.0
    step_waited_s: float = 0.0


class DiLoCoImpl(AlgorithmImpl):
    """:class:`DiLoCoAlgorithm` bound to one wrapped model."""

    validates_outer_weights = True
    """The Trainer strategy calls :meth:`show_outer_weights` before validation inside fit, and :meth:`start` after."""

    def __init__(self, algorithm: "DiLoCoAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.config = algorithm
        groups = context.groups
        layout = groups.layout
        self._cuda = context.device.type == "cuda"
        # Two levels whenever a node holds several ranks: they share one replica, trained on the node's gradients.
        self.two_level = algorithm.hierarchical and layout.ranks_per_node > 1
        self.gradient_state: GradientAllReduceState | None = None
        if self.two_level:
            node_group = groups.intra_node if groups.is_hierarchical else groups.flat
            node = layout.node_of(groups.rank)
            node_ranks = [groups.global_ranks[r] for r in layout.node_ranks(node)]
            node_groups = CommunicationGroups(
                NodeLayout(layout.ranks_per_node, layout.ranks_per_node, source="argument"),
                groups.rank % layout.ranks_per_node,
                node_ranks,
                node_group,  # type: ignore[arg-type]
            )
            self.gradient_state = GradientAllReduceState(node_groups, context.counter, context.executor, average=True)
        self.participants = layout.num_nodes if self.two_level else groups.world_size
        self.is_exchanger = groups.is_node_leader if self.two_level else True
        # The exchange's own communicators, made by every rank in the same order (new_group is collective).
        self._owned: list[dist.ProcessGroup] = []
        self.exchange_group: dist.ProcessGroup | None = None
        self.node_group: dist.ProcessGroup | None = None
        self.node_leader = groups.node_leader_global_rank
        if self.two_level:
            leaders = [groups.global_ranks[r] for r in layout.leaders()]
            if layout.num_nodes > 1:
                leader_group = dist.new_group(ranks=leaders, timeout=context.timeout)
                self._owned.append(leader_group)
                if self.is_exchanger:
                    self.exchange_group = leader_group
            for node in range(layout.num_nodes):
                ranks = [groups.global_ranks[r] for r in layout.node_ranks(node)]
                node_exchange = dist.new_group(ranks=ranks, timeout=context.timeout)
                self._owned.append(node_exchange)
                if node == layout.node_of(groups.rank):
                    self.node_group = node_exchange
        elif groups.world_size > 1:
            self.exchange_group = dist.new_group(ranks=groups.global_ranks, timeout=context.timeout)
            self._owned.append(self.exchange_group)
        parameters = [parameter for _, parameter in context.named_parameters]
        if parameters and algorithm.fragments > len(parameters):
            raise ValueError(
                f"Algorithm {DiLoCoAlgorithm.name!r}: `fragments={algorithm.fragments}` is more than the"
                f" {len(parameters)} parameters that take part; a fragment holds whole parameters. Pass"
                f" fragments={len(parameters)} or fewer."
            )
        self.codec = OuterGradientCodec(algorithm.quantization)
        self.outer_device = torch.device("cpu") if algorithm.offload else context.device
        self.fragments: list[_Fragment] = []
        offsets = fragment_offsets(algorithm.sync_every, algorithm.fragments)
        if parameters:
            runs = split_fragments([parameter.numel() for parameter in parameters], algorithm.fragments)
            for run, offset in zip(runs, offsets, strict=True):
                members = [parameters[i] for i in run]
                outer = Parameter(self._outer_buffer(sum(p.numel() for p in members)))
                residual = torch.zeros_like(outer.data) if algorithm.error_feedback and self.is_exchanger else None
                optimizer = algorithm.outer_optimizer([outer], **algorithm.resolved_outer_optimizer_kwargs())
                self.fragments.append(_Fragment(members, outer, optimizer, offset, residual))
        self.steps = 0
        self.step_open = False
        self.initialized = False
        self.in_flight: list[_Exchange] = []
        self.stats = _Telemetry()
        self._optimizers: list[Optimizer] = []
        self._stashed: list[Tensor] | None = None  # local weights while the model shows θ_outer
        self._executor: ThreadPoolExecutor | None = None
        self._side_stream = torch.cuda.Stream(context.device) if self._cuda else None
        self._closed = False

    # ------------------------------------------------------------------------------------------- public surface

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the node's gradient all-reduce when two-level, else a hook that leaves gradients local."""
        if self.gradient_state is not None:
            return self.gradient_state, gradient_allreduce_hook
        return _LocalState(self.context.device), local_gradient_hook

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Check that the inner optimizers update every participating parameter.

        Args:
            optimizers: the inner optimizers.
        """
        if optimizers:
            check_optimizers_cover(DiLoCoAlgorithm.name, self.context.named_parameters, optimizers)
        self._optimizers = list(optimizers)

    def on_forward_start(self, synchronizing: bool) -> None:
        """Close the step the previous synchronizing pass began, and act at its boundary.

        Args:
            synchronizing: ``False`` on the passes of accumulating steps, which belong to the step still open.
        """
        self._restore_local()
        self._initialize()
        self._close_step()
        if synchronizing:
            self.step_open = True

    def on_optimizer_step(self, optimizer: Optimizer) -> None:
        """Close the open step once the last bound optimizer stepped, so that its sync belongs to it.

        Checkpoints, validation and the end of training then see that step's sync. With no optimizer bound, or
        after another one, the step stays open for :meth:`on_forward_start`.

        Args:
            optimizer: the optimizer that stepped.
        """
        if self._optimizers and optimizer is self._optimizers[-1] and self._stashed is None:
            self._close_step()

    @property
    def started(self) -> bool:
        """Whether the model holds the local weights (``False`` while :meth:`show_outer_weights` shows ``θ_outer``)."""
        return self._stashed is None

    def start(self) -> None:
        """Put the local weights back where :meth:`show_outer_weights` showed ``θ_outer``; a no-op otherwise."""
        self._restore_local()

    def stop(self, wait: bool = True) -> None:
        """Settle the exchanges in flight; the model keeps this rank's local weights (callbacks may have written them).

        Args:
            wait: ``False`` on an error path: drop the exchanges in flight without waiting for the peers.
        """
        if not wait:
            self._shutdown_executor(wait=False)
            self.in_flight = [exchange for exchange in self.in_flight if exchange.future is None]
            return
        self.settle()

    def show_outer_weights(self) -> None:
        """Settle the exchanges in flight and show ``θ_outer`` in the model, keeping the local weights aside.

        For evaluation: the Trainer strategy calls it before validation inside fit. The next training forward
        pass (or :meth:`start`) brings the local weights back; a checkpoint taken meanwhile keeps them too.
        """
        if self._stashed is None:
            # Evaluation comes after the batch's optimizer steps: a step still open is over, and its sync is due.
            self._close_step()
        self.settle()
        if self._stashed is not None or not self.fragments or not self.initialized:
            return
        with torch.no_grad():
            self._stashed = [
                parameter.detach().clone() for fragment in self.fragments for parameter in fragment.parameters
            ]
            for fragment in self.fragments:
                outer = fragment.outer.detach().to(self.context.device, non_blocking=True)
                targets: list[Tensor] = list(fragment.parameters)
                torch._foreach_copy_(targets, views_like(outer, targets))

    def settle(self) -> None:
        """Wait for the exchanges in flight; their results stay for the step boundary where they merge."""
        for exchange in self.in_flight:
            if exchange.future is not None:
                exchange.future.result()
                exchange.future = None

    def telemetry_phase(self) -> dict[str, float]:
        """Return ``outer_syncs`` (fragment exchanges merged so far) and ``outer_wait_s`` (this step's wait)."""
        waited, self.stats.step_waited_s = self.stats.step_waited_s, 0.0
        return {"outer_syncs": float(self.stats.syncs), "outer_wait_s": waited}

    @property
    def waited_seconds(self) -> float:
        """Seconds the training thread waited for exchanges that were slower than ``fragment_sync_delay`` steps."""
        return self.stats.waited_s

    def state_dict(self) -> dict[str, Any]:
        """Return ``θ_outer``, the outer optimizers' state, the step count, the exchanges awaiting their merge.

        An exchange in flight is settled first: its outer step is taken, and its merge stays due at its step.

        Returns:
            ``{"steps", "step_open", "outer", "outer_optimizers", "residuals", "pending", "local"}``.
        """
        self._initialize()
        self.settle()
        return {
            "steps": self.steps,
            "step_open": self.step_open,
            "outer": [fragment.outer.detach().cpu().clone() for fragment in self.fragments],
            # Copies, as for θ_outer: torch's state_dict holds the live momentum, which the next outer step changes.
            "outer_optimizers": [copy.deepcopy(fragment.optimizer.state_dict()) for fragment in self.fragments],
            "residuals": [
                None if fragment.residual is None else fragment.residual.cpu().clone() for fragment in self.fragments
            ],
            "pending": [[exchange.fragment, exchange.merge_at] for exchange in self.in_flight],
            # While the model shows θ_outer (validation), its own weights are not the replica: keep the replica here.
            "local": None if self._stashed is None else [tensor.cpu().clone() for tensor in self._stashed],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, after the model and the inner optimizers were restored.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ValueError: the keys, types, or the number and sizes of the fragments do not match.
        """
        check_state_keys(
            DiLoCoAlgorithm.name,
            state,
            {
                "steps": int,
                "step_open": bool,
                "outer": list,
                "outer_optimizers": list,
                "residuals": list,
                "pending": list,
                "local": (list, type(None)),
            },
        )
        sizes = [tuple(outer.shape) for outer in state["outer"]]
        if sizes != [tuple(fragment.outer.shape) for fragment in self.fragments]:
            raise ValueError(
                f"Algorithm {DiLoCoAlgorithm.name!r}: the checkpoint's fragments have the sizes {sizes}, this model's"
                f" {[tuple(f.outer.shape) for f in self.fragments]}. Resume with the same model and `fragments`."
            )
        self.settle()
        with torch.no_grad():
            for fragment, outer, optimizer_state, residual in zip(
                self.fragments, state["outer"], state["outer_optimizers"], state["residuals"], strict=True
            ):
                fragment.outer.copy_(outer)
                fragment.optimizer.load_state_dict(optimizer_state)
                if fragment.residual is not None:
                    if residual is None:
                        fragment.residual.zero_()
                    else:
                        fragment.residual.copy_(residual)
        self.steps = state["steps"]
        self.step_open = state["step_open"]
        self.in_flight = [_Exchange(int(p), int(at)) for p, at in state["pending"]]
        self.initialized = True
        self._stashed = None
        if state["local"] is not None:
            with torch.no_grad():
                targets: list[Tensor] = [p for fragment in self.fragments for p in fragment.parameters]
                torch._foreach_copy_(targets, [tensor.to(self.context.device) for tensor in state["local"]])

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Return this rank's state at the current world size, from the states of a run of ``len(saved)`` ranks.

        ``θ_outer``, the outer optimizers' state, the step count and the pending merges are the same on every rank
        and are kept (rank 0's). Error-feedback residuals are summed over the saved ranks and shared out evenly, so
        that their sum is kept. The local replicas are the model's weights, which the strategy restores (the ranks'
        average where their number changed); the pending merges then mix ``θ_outer`` into that average. A state
        saved while validation showed ``θ_outer`` holds each rank's replica aside: those are averaged too, or the
        resumed replica would be rank 0's alone.

        Args:
            saved: every saved rank's :meth:`state_dict`.

        Returns:
            The state for :meth:`load_state_dict`.
        """
        if not saved:
            raise ValueError(f"Algorithm {DiLoCoAlgorithm.name!r}: no saved state to resize.")
        first = dict(saved[0])
        holders = [state["residuals"] for state in saved if any(r is not None for r in state["residuals"])]
        if holders:
            world = self.participants
            first["residuals"] = [
                sum(residuals[p] for residuals in holders if residuals[p] is not None) / world
                for p in range(len(first["outer"]))
            ]
        locals_ = [state["local"] for state in saved if state.get("local") is not None]
        if locals_:
            first["local"] = [torch.stack(replicas).mean(dim=0) for replicas in zip(*locals_, strict=True)]
        return first

    def close(self) -> None:
        """Settle the exchanges in flight, stop the exchange thread and destroy the algorithm's communicators."""
        if self._closed:
            return
        self._closed = True
        try:
            self.settle()
        except RuntimeError as error:  # a peer that is gone must not turn shutdown into a crash
            log.warning("Dropping an unfinished DiLoCo exchange on close: %s", error)
        self._shutdown_executor(wait=True)
        for group in self._owned:
            if process_group_exists(group):
                destroy_process_group(group)
        self._owned.clear()

    # ------------------------------------------------------------------------------------------- step boundaries

    def _close_step(self) -> None:
        # A step opens at its synchronizing forward pass and closes after its optimizer step; only then are its
        # weights final, and the fragments due at its number sync.
        if self.step_open:
            self.step_open = False
            self.steps += 1
            self._at_boundary(self.steps)

    def _at_boundary(self, step: int) -> None:
        config = self.config
        due = [exchange for exchange in self.in_flight if exchange.merge_at <= step]
        for exchange in due:
            self._merge(exchange)
        self.in_flight = [exchange for exchange in self.in_flight if exchange.merge_at > step]
        phase = step % config.sync_every
        for index, fragment in enumerate(self.fragments):
            if fragment.offset != phase:
                continue
            exchange = _Exchange(index, step + config.fragment_sync_delay)
            exchange.future = self._start_exchange(fragment)
            if config.fragment_sync_delay == 0:
                self._merge(exchange)
            else:
                self.in_flight.append(exchange)

    def _start_exchange(self, fragment: _Fragment) -> Future[None]:
        with torch.no_grad():
            local = torch.cat([parameter.detach().reshape(-1).float() for parameter in fragment.parameters])
            delta = fragment.outer.detach().to(local.device, non_blocking=True) - local
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return self._executor.submit(self._exchange, fragment, delta, ready)

    def _exchange(self, fragment: _Fragment, delta: Tensor, ready: "torch.cuda.Event | None") -> None:
        stream_context = torch.cuda.stream(self._side_stream) if self._side_stream is not None else nullcontext()
        with stream_context, torch.no_grad():
            if ready is not None:
                ready.wait()
            average = self._average(fragment, delta)
            outer = fragment.outer
            outer.grad = average.to(outer.device, non_blocking=True)
            fragment.optimizer.step()
            outer.grad = None
            if self._side_stream is not None:
                self._side_stream.synchronize()

    def _average(self, fragment: _Fragment, delta: Tensor) -> Tensor:
        counter = self.context.counter
        if self.is_exchanger:
            if fragment.residual is not None:
                delta.add_(fragment.residual.to(delta.device, non_blocking=True))
            if self.participants > 1:
                encoded = self.codec.encode(delta)
                gathered = torch.empty(
                    (self.participants * encoded.shape[0], *encoded.shape[1:]), dtype=encoded.dtype, device=delta.device
                )
                counter.record("all_gather", encoded)
                all_gather_into(gathered, encoded, self.exchange_group)
                average = self.codec.average(gathered, self.participants, fragment.numel)
                if fragment.residual is not None:
                    sent = self.codec.decode(encoded, fragment.numel)
                    fragment.residual.copy_(delta.sub_(sent))
            else:
                average = delta
        else:
            average = torch.empty(fragment.numel, dtype=torch.float32, device=delta.device)
        if self.node_group is not None:
            counter.record("broadcast", average)
            dist.broadcast(average, src=self.node_leader, group=self.node_group)
        return average

    def _merge(self, exchange: _Exchange) -> None:
        if exchange.future is not None:
            begin = time.perf_counter()
            if self.telemetry is not None:
                with self.telemetry.blocking():
                    exchange.future.result()
            else:
                exchange.future.result()
            waited = time.perf_counter() - begin
            self.stats.waited_s += waited
            self.stats.step_waited_s += waited
            exchange.future = None
        fragment = self.fragments[exchange.fragment]
        alpha = self.config.fragment_update_alpha
        with torch.no_grad():
            outer = fragment.outer.detach().to(self.context.device, non_blocking=True)
            targets: list[Tensor] = list(fragment.parameters)
            views = views_like(outer, targets)
            if alpha == 0.0:
                torch._foreach_copy_(targets, views)
            else:
                for target, view in zip(targets, views, strict=True):
                    target.mul_(alpha).add_(view.to(target.dtype), alpha=1.0 - alpha)
        self.stats.syncs += 1

    # ----------------------------------------------------------------------------------------------- helpers

    def _initialize(self) -> None:
        if self.initialized:
            return
        self.initialized = True
        with torch.no_grad():
            for fragment in self.fragments:
                local = torch.cat([parameter.detach().reshape(-1).float() for parameter in fragment.parameters])
                fragment.outer.copy_(local)

    def _outer_buffer(self, numel: int) -> Tensor:
        pin = self.config.offload and self._cuda
        return torch.zeros(numel, dtype=torch.float32, device=self.outer_device, pin_memory=pin)

    def _restore_local(self) -> None:
        stashed, self._stashed = self._stashed, None
        if stashed is None:
            return
        with torch.no_grad():
            targets: list[Tensor] = [parameter for fragment in self.fragments for parameter in fragment.parameters]
            torch._foreach_copy_(targets, stashed)

    def _shutdown_executor(self, wait: bool) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)


@dataclass
class _LocalState:
    device: torch.device


@register_algorithm("diloco")
class DiLoCoAlgorithm(Algorithm):
    """Train locally, and every ``sync_every`` steps average the ranks' progress through an outer optimizer.

    DiLoCo is described by Douillard et al. 2023, https://arxiv.org/abs/2311.08105, and its streaming form by
    Douillard et al. 2025, https://arxiv.org/abs/2501.18512. With ``n`` participants (ranks, or nodes when
    hierarchical), ``H = sync_every``, ``F = fragments``, ``τ = fragment_sync_delay``, ``alpha = fragment_update_alpha``
    and ``k`` counting optimizer steps:

    1. Every rank steps its own (inner) optimizer on its own gradients; nothing crosses between participants.
    2. The parameters are cut into ``F`` fragments of about equal size; fragment ``p`` keeps the shared
       ``θ_p`` (float32) and an outer optimizer, and syncs after the steps ``k > 0`` with
       ``k mod H = ⌊(p+1)H/F⌋ mod H``.
    3. At its sync, each participant forms ``Δ_p = θ_p - x_p`` (shared minus local), sends it encoded
       (``quantization``), and every participant averages the decoded ``Δ̄_p = (1/n) Σ_i Δ_{p,i}`` in float32.
    4. The outer optimizer steps ``θ_p ← OuterOpt(θ_p, Δ̄_p)``, ``Δ̄_p`` taken as the gradient: SGD with Nesterov
       momentum, lr 0.7, momentum 0.9 by default.
    5. ``τ`` steps after the sync began, every rank mixes ``x_p ← alpha·x_p + (1 - alpha)·θ_p``
       (``alpha = 0`` adopts ``θ_p``).
       The exchange and the outer step run on a thread and a communicator of their own meanwhile.

    With one participant and outer SGD at lr 1 without momentum, this is local training.

    Args:
        sync_every: ``H``, the steps between two syncs of a fragment; at least 1.
        fragments: ``F``, between 1 and ``sync_every`` (and at most the number of parameters).
        fragment_sync_delay: ``τ``, the steps an exchange runs behind before it merges (the issue's ``overlap``);
            between 0 and ``sync_every - 1``.
        fragment_update_alpha: ``alpha`` in ``[0, 1]``, the local share of the merged fragment.
        outer_optimizer: a ``torch.optim.Optimizer`` class for the outer step, one that steps without a closure.
        outer_optimizer_kwargs: its keywords; ``None`` gives the paper's ``lr=0.7, momentum=0.9, nesterov=True``
            for SGD and the class's defaults for any other class.
        quantization: ``"uint8"`` (MinMaxUInt8, one min/max per 2048 values), ``"uint4"``, or ``None`` (float32).
        error_feedback: add to each pseudo-gradient what quantization dropped from the previous one.
        hierarchical: with several ranks per node, all-reduce gradients inside each node at every step and run
            DiLoCo among the nodes.
        offload: keep ``θ_outer`` and the outer optimizer's state in host memory (pinned on CUDA).

    Raises:
        TypeError: a keyword has the wrong type.
        ValueError: a keyword is out of range.
    """

    ranks_hold_different_weights = True
    communicates_gradient_buckets = False
    single_node_effect = (
        "its ranks all-reduce gradients at every step and train one replica, with the outer step on top; pass"
        " hierarchical=False to run DiLoCo among the ranks"
    )
    resize_effect = (
        "θ_outer, the outer optimizer's state, the step count and the merges still due are kept; every replica starts"
        " from the ranks' average, and their error feedback is summed and split evenly"
    )
    impl_class = DiLoCoImpl

    def __init__(
        self,
        sync_every: int = 100,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        outer_optimizer: type[Optimizer] = torch.optim.SGD,
        outer_optimizer_kwargs: dict[str, Any] | None = None,
        quantization: str | None = "uint8",
        error_feedback: bool = False,
        hierarchical: bool = True,
        offload: bool = False,
    ) -> None:
        name = "diloco"
        check_positive_int(name, "sync_every", sync_every)
        check_positive_int(name, "fragments", fragments)
        check_keyword_type(name, "fragment_sync_delay", fragment_sync_delay, int)
        check_keyword_type(name, "fragment_update_alpha", fragment_update_alpha, (float, int))
        check_keyword_type(name, "error_feedback", error_feedback, bool)
        check_keyword_type(name, "hierarchical", hierarchical, bool)
        check_keyword_type(name, "offload", offload, bool)
        if fragments > sync_every:
            raise ValueError(
                f"Algorithm {name!r}: `fragments` must be between 1 and sync_every={sync_every} (each fragment syncs"
                f" at its own step of the period), got {fragments}. Pass fewer fragments or a larger sync_every."
            )
        if not 0 <= fragment_sync_delay < sync_every:
            raise ValueError(
                f"Algorithm {name!r}: `fragment_sync_delay` must be between 0 and sync_every - 1 = {sync_every - 1}"
                f" (an exchange must merge before its fragment syncs again), got {fragment_sync_delay}."
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"Algorithm {name!r}: `fragment_update_alpha` must be in [0, 1] (0 adopts the synced fragment, 1"
                f" keeps the local one), got {fragment_update_alpha}."
            )
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"Algorithm {name!r}: `quantization` must be one of {', '.join(map(repr, QUANTIZATIONS))}, got"
                f" {quantization!r}."
            )
        if not (isinstance(outer_optimizer, type) and issubclass(outer_optimizer, Optimizer)):
            raise TypeError(
                f"Algorithm {name!r}: `outer_optimizer` must be a torch.optim.Optimizer class such as"
                f" torch.optim.SGD, got {outer_optimizer!r}."
            )
        if outer_optimizer_kwargs is not None and not isinstance(outer_optimizer_kwargs, dict):
            raise TypeError(
                f"Algorithm {name!r}: `outer_optimizer_kwargs` must be a dict or None, got {outer_optimizer_kwargs!r}."
            )
        self.sync_every = sync_every
        self.fragments = fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.outer_optimizer = outer_optimizer
        self.outer_optimizer_kwargs = None if outer_optimizer_kwargs is None else dict(outer_optimizer_kwargs)
        self.quantization = quantization
        self.error_feedback = error_feedback
        self.hierarchical = hierarchical
        self.offload = offload
        probe = Parameter(torch.zeros(1))
        try:  # a bad keyword fails here, before any process group starts
            probe_optimizer = outer_optimizer([probe], **self.resolved_outer_optimizer_kwargs())
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"Algorithm {name!r}: {outer_optimizer.__name__} does not accept outer_optimizer_kwargs="
                f"{self.outer_optimizer_kwargs!r}: {error}"
            ) from error
        probe.grad = torch.zeros_like(probe)
        try:  # the outer step has a pseudo-gradient but no loss to re-evaluate, so no closure to pass
            probe_optimizer.step()
        except TypeError as error:
            raise TypeError(
                f"Algorithm {name!r}: the outer optimizer must step from gradients alone, without a closure, but"
                f" {outer_optimizer.__name__}.step() failed without one: {error}. Pick one such as torch.optim.SGD"
                " (the default) or torch.optim.Adam."
            ) from error

    def resolved_outer_optimizer_kwargs(self) -> dict[str, Any]:
        """Return the outer optimizer's keywords, the paper's defaults filled in for SGD when none were given."""
        if self.outer_optimizer_kwargs is not None:
            return dict(self.outer_optimizer_kwargs)
        return dict(_PAPER_OUTER_KWARGS) if self.outer_optimizer is torch.optim.SGD else {}

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))
