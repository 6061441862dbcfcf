"""``low_rank``: PowerSGD-style rank-``r`` gradient factors with error feedback, exchanged as 8-bit codes.

`PowerSGD <https://arxiv.org/abs/1905.13727>`_ (Vogels et al., 2019) replaces each gradient matrix by a rank-``r``
approximation found with one step of power iteration, warm-started from the previous step's factor, and keeps what
the approximation missed as an error that is added to the next step's gradient. This implementation goes further
than torch's ``powerSGD_hook`` in four ways:

* the factors travel as 8-bit MinMaxUInt8 codes with a range per column piece, a quarter of fp32's bytes;
* each bucket takes two collectives, one per factor, and the tensors that do not factor ride in the first one at
  full precision, so a slow link carries fewer, larger messages; with ``alternate=True`` one collective, the two
  factors taking turns from step to step (ACP-SGD);
* with ``hierarchical=True`` the ranks of a node reduce at full precision first, and only the node leaders
  exchange factors, as ``bytegrad`` does;
* the collectives of all buckets run in bucket order on one thread (the engine's ordered executor), so on Gloo
  the ranks' collectives can never interleave differently.

Quantisation acts per tensor (every factor has its own codec chunks), so the result does not depend on how the
reducer cut the gradients into buckets beyond float rounding (the orthonormalisation is batched over a bucket's
gradients of the same row count): the error-feedback and warm-start state is kept per parameter name.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine.algorithms import _low_rank_step
from lightning_bagua.engine.algorithms._low_rank_bucket import BucketPlan, low_rank_reduce_, plan_bucket
from lightning_bagua.engine.algorithms._low_rank_factors import (
    CODEC_CHUNK_ELEMENTS,
    MAX_FACTOR_BYTES_FRACTION,
    TensorSlot,
    factor_seed,
    gram_schmidt_,
    initial_factor,
    initial_left_factor,
    orthonormalise_columns,
    plan_slot,
)
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    HookState,
    check_keyword_type,
    check_positive_int,
    check_state_keys,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState, gradient_allreduce_hook
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import all_reduce_hierarchically

__all__ = [
    "CODEC_CHUNK_ELEMENTS",
    "MAX_FACTOR_BYTES_FRACTION",
    "LowRankAlgorithm",
    "LowRankState",
    "TensorSlot",
    "factor_seed",
    "gram_schmidt_",
    "low_rank_hook",
    "low_rank_reduce_",
    "orthonormalise_columns",
    "plan_slot",
    "reduce_bucket",
]

log = logging.getLogger(__name__)


class LowRankImpl(AlgorithmImpl):
    """:class:`LowRankAlgorithm` bound to one wrapped model."""

    def __init__(self, algorithm: "LowRankAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        groups = context.groups
        self.state = LowRankState.from_context(
            context,
            rank=algorithm.rank,
            warmup_steps=algorithm.warmup_steps,
            average=algorithm.average,
            alternate=algorithm.alternate,
            hierarchical=algorithm.hierarchical,
            # Hierarchical on one node leaves only the full-precision intra-node level (with one rank per node,
            # every rank leads its node and the factor exchange is the inter-node level).
            full_precision_only=algorithm.hierarchical and groups.layout.num_nodes == 1,
            full_precision=GradientAllReduceState.from_context(context, average=algorithm.average),
            whole_step=algorithm.whole_step if algorithm.whole_step is not None else context.device.type == "cuda",
            names={id(parameter): name for name, parameter in context.named_parameters},
            device=context.device,
        )
        self._shapes = {name: parameter.shape for name, parameter in context.named_parameters}

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`low_rank_hook`."""
        return self.state, low_rank_hook

    def close(self) -> None:
        """Drop the whole-step plan with its CUDA graphs, which must not outlive the communicators they replay on.

        Destroying a NCCL communicator while a graph that captured collectives on it is alive blocks for good.
        """
        self.state.forget_step_plan()

    def telemetry_phase(self) -> dict[str, float]:
        """Return ``{"compressed": 1.0}`` once factors are exchanged, ``0.0`` before (``{}`` before any bucket)."""
        if self.state.last_compressed is None:
            return {}
        return {"compressed": float(self.state.last_compressed)}

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's step count, error-feedback tensors and warm-start factors, by parameter name.

        Returns:
            ``{"steps": int, "errors": {name: n x m float32}, "factors": {name: m x r float32}}`` (clones), and
            with ``alternate`` also ``"left_factors": {name: n x r float32}``; the dicts hold the factored
            parameters this rank compresses (none on ranks that are not node leaders when two-level, and none
            before the warm-up ends).
        """
        state = self.state
        saved: dict[str, Any] = {
            "steps": state.steps,
            "errors": {name: _copy(error) for name, error in state.errors.items()},
            "factors": {name: _copy(factor) for name, factor in state.factors.items()},
        }
        if state.alternate:
            saved["left_factors"] = {name: _copy(factor) for name, factor in state.left_factors.items()}
        return saved

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Keep the steps and the shared factors; split the ranks' summed error feedback evenly over the new ranks.

        The ranks that compress (all, or the node leaders when two-level) each get ``sum(errors) / their number``,
        so the residual the next exchange adds in is the saved one; the factors, the same on every rank after an
        exchange, are the first saved ones. A rank that does not compress, or a run that compresses nothing, gets
        none.

        Args:
            saved: each saved rank's :meth:`state_dict`.

        Returns:
            This rank's state.
        """
        groups = self.context.groups
        compressors = groups.layout.num_nodes if groups.is_hierarchical else groups.world_size
        compresses = not self.state.full_precision_only and (not groups.is_hierarchical or groups.is_node_leader)
        keys = ["factors", "left_factors"] if self.state.alternate else ["factors"]
        resized: dict[str, Any] = {"steps": int(saved[0]["steps"]), "errors": {}, **{key: {} for key in keys}}
        if not compresses:
            return resized
        for state in saved:
            for name, error in state["errors"].items():
                total = resized["errors"].get(name)
                resized["errors"][name] = error.float() if total is None else total + error.float()
            for key in keys:
                for name, factor in state.get(key, {}).items():
                    resized[key].setdefault(name, factor)
        resized["errors"] = {name: total / compressors for name, total in resized["errors"].items()}
        return resized

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: a dict from :meth:`state_dict` of the same rank and model, with the same ``rank``.

        Raises:
            ValueError: the keys or types are not those of :meth:`state_dict`, a name is not a parameter of this
                model, or a tensor's shape does not fit the parameter and ``rank``.
        """
        name = LowRankAlgorithm.name
        keys: list[str] = ["errors", "factors", "left_factors"] if self.state.alternate else ["errors", "factors"]
        check_state_keys(name, state, {"steps": int, **dict.fromkeys(keys, dict)})
        if state["steps"] < 0:
            raise ValueError(f"Algorithm {name!r}: saved state 'steps' must be at least 0, got {state['steps']}.")
        rank = self.state.rank
        loaded: dict[str, dict[str, Tensor]] = {}
        for key in keys:
            loaded[key] = {}
            for parameter, tensor in state[key].items():
                if parameter not in self._shapes:
                    raise ValueError(
                        f"Algorithm {name!r}: saved state {key!r} names {parameter!r}, which is not a communicated"
                        f" parameter of this model (those are {sorted(self._shapes)}). Resume the same model."
                    )
                shape = self._shapes[parameter]
                rows = shape[0] if len(shape) >= 2 else 1
                cols = shape.numel() // rows
                expected = {"errors": (rows, cols), "factors": (cols, rank), "left_factors": (rows, rank)}[key]
                if not isinstance(tensor, Tensor) or tuple(tensor.shape) != expected:
                    found = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                    raise ValueError(
                        f"Algorithm {name!r}: saved state {key!r}[{parameter!r}] must be a {expected} tensor, got"
                        f" {found}. Was it written with another `rank` (this one has rank={rank})?"
                    )
                loaded[key][parameter] = tensor.detach().to(self.context.device, torch.float32).clone()
        self.state.steps = state["steps"]
        self.state.errors = loaded["errors"]
        self.state.factors = loaded["factors"]
        self.state.left_factors = loaded.get("left_factors", {})
        self.state.forget_step_plan()


@register_algorithm("low_rank")
class LowRankAlgorithm(Algorithm):
    """Exchange rank-``r`` factors of the gradients as 8-bit codes, with error feedback (PowerSGD, beyond it).

    Args:
        rank: the rank ``r`` of the approximation; each ``n x m`` gradient travels as ``(n + m) * r`` bytes.
        warmup_steps: steps of exact full-precision all-reduce before the factors take over (as torch's
            ``start_powerSGD_iter``): the first steps' gradients change fastest, and the warm start has nothing to
            follow yet.
        hierarchical: reduce inside each node at full precision first, exchange factors among node leaders only,
            then broadcast inside each node. With one node it is a full-precision all-reduce.
        average: divide the sum by the number of ranks; ``False`` keeps the sum.
        alternate: exchange one factor per step, ``P`` and ``Q`` in turn (ACP-SGD): one collective per bucket
            instead of two, and half the encoding and projecting, for an approximation refreshed from one side
            each step.
        whole_step: reduce all of a step's buckets together once backward has handed over the last, batched by
            shape (:mod:`~lightning_bagua.engine.algorithms._low_rank_step`): a few launches per distinct shape
            instead of several per gradient, and two collectives a step, for no overlap of the exchange with
            backward. ``None`` (the default) takes it on CUDA, where the per-bucket path is bound by the host,
            and not on CPU, where the per-bucket path overlaps backward on the engine's worker thread. Not with
            ``alternate=True``.
    """

    single_node_effect = "nothing is compressed: every bucket is all-reduced at full precision"
    resize_effect = "the steps and factors are kept; the ranks' error feedback is summed and split evenly"
    impl_class = LowRankImpl

    def __init__(
        self,
        rank: int = 8,
        warmup_steps: int = 10,
        hierarchical: bool = True,
        average: bool = True,
        alternate: bool = False,
        whole_step: bool | None = None,
    ) -> None:
        check_positive_int(self.name, "rank", rank)
        check_keyword_type(self.name, "warmup_steps", warmup_steps, int)
        if warmup_steps < 0:
            raise ValueError(
                f"Algorithm {self.name!r}: `warmup_steps` must be at least 0, got {warmup_steps}. Use 0 to exchange"
                " factors from the first step."
            )
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        check_keyword_type(self.name, "average", average, bool)
        check_keyword_type(self.name, "alternate", alternate, bool)
        if whole_step is not None:
            check_keyword_type(self.name, "whole_step", whole_step, bool)
        if whole_step and alternate:
            raise ValueError(
                f"Algorithm {self.name!r}: `whole_step=True` does not support `alternate=True` yet. Pass"
                " `whole_step=False` to alternate the factors bucket by bucket, or `alternate=False`."
            )
        self.whole_step: bool | None = False if alternate else whole_step
        self.rank = rank
        self.alternate = alternate
        self.warmup_steps = warmup_steps
        self.hierarchical = hierarchical
        self.average = average


@dataclass
class LowRankState(HookState):
    """State of :func:`low_rank_hook`.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``:

    Args:
        rank: the factors' rank ``r``.
        warmup_steps: steps all-reduced at full precision before compression starts.
        average: divide by the number of ranks.
        alternate: exchange ``P`` and ``Q`` in turn, one per step.
        hierarchical: whether the user asked for two levels.
        full_precision_only: hierarchical on one node: every step is a full-precision all-reduce.
        full_precision: the state of the full-precision all-reduce (warm-up).
        names: parameter name by ``id`` of the parameter.
        device: where the factors and errors live.
        codec: the 8-bit codec.
        steps: steps whose last bucket has been handed over.
        errors: error feedback ``e`` (``n x m``) by parameter name, on the ranks that compress.
        factors: warm-start ``Q`` (``m x r``) by parameter name, on the ranks that compress; with ``alternate``,
            orthonormalised.
        left_factors: with ``alternate``, the orthonormalised ``P_hat`` (``n x r``) of the last ``P`` step.
        exchange_left: with ``alternate``, whether the step being reduced exchanges ``P`` (else ``Q``).
        last_compressed: whether the last bucket handed over was compressed (``None`` before one).
        whole_step: reduce each step's buckets together (:mod:`~lightning_bagua.engine.algorithms._low_rank_step`).
        batcher: holds a step's buckets for the whole-step path.
    """

    rank: int = 8
    warmup_steps: int = 10
    average: bool = True
    alternate: bool = False
    hierarchical: bool = True
    full_precision_only: bool = False
    full_precision: GradientAllReduceState | None = None
    names: dict[int, str] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    codec: MinMaxUInt8Codec = field(default_factory=MinMaxUInt8Codec)
    steps: int = 0
    errors: dict[str, Tensor] = field(default_factory=dict)
    factors: dict[str, Tensor] = field(default_factory=dict)
    left_factors: dict[str, Tensor] = field(default_factory=dict)
    exchange_left: bool = True
    last_compressed: bool | None = None
    whole_step: bool = False
    batcher: _low_rank_step.StepBatcher = field(default_factory=_low_rank_step.StepBatcher, repr=False)
    _step_plan: _low_rank_step.StepPlan | None = field(default=None, repr=False)
    _step_plan_key: tuple[Any, ...] | None = field(default=None, repr=False)
    _plans: dict[tuple[str, ...], list[TensorSlot]] = field(default_factory=dict, repr=False)
    _bucket_plans: dict[tuple[Any, ...], BucketPlan] = field(default_factory=dict, repr=False)
    # ``M`` of every factored parameter (its error plus its gradient), a buffer kept between steps.
    _scratch: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def plan(self, parameters: Sequence[Tensor], element_size: int) -> list[TensorSlot]:
        """Return the slots of a bucket's parameters, in bucket order (cached per layout)."""
        names = tuple(self.names[id(parameter)] for parameter in parameters)
        slots = self._plans.get(names)
        if slots is None:
            slots, offset = [], 0
            for name, parameter in zip(names, parameters, strict=True):
                slots.append(plan_slot(name, offset, parameter.shape, self.rank, element_size, self.codec))
                offset += parameter.numel()
            self._plans[names] = slots
        return slots

    def bucket_plan(self, slots: list[TensorSlot], tensor: Tensor) -> BucketPlan:
        """Return how a bucket laid out as ``slots`` travels (cached per layout, dtype and device)."""
        key = (tuple(slots), tensor.dtype, tensor.device)
        plan = self._bucket_plans.get(key)
        if plan is None:
            plan = self._bucket_plans[key] = plan_bucket(slots, tensor, self.rank, self.codec)
        return plan

    def step_plan(self, layouts: Sequence[Sequence[TensorSlot]], device: torch.device) -> _low_rank_step.StepPlan:
        """Return the whole-step plan of a step laid out in ``layouts``, bound to this state's errors and factors.

        One plan is kept: another layout (DDP's rebuilt buckets) makes a new one, which takes over the errors and
        factors by parameter name.
        """
        key = (tuple(tuple(slots) for slots in layouts), device)
        if self._step_plan is None or key != self._step_plan_key:
            plan = _low_rank_step.StepPlan(layouts, self.rank, self.codec, device)
            plan.bind(self)
            self.forget_step_plan()
            self._step_plan, self._step_plan_key = plan, key
        return self._step_plan

    def forget_step_plan(self) -> None:
        """Drop the whole-step plan, so that the next step binds a new one to the errors and factors held now.

        A plan whose CUDA graphs were captured waits for its device first: a replay may still be running, and the
        graphs' memory goes back to the allocator with them.
        """
        plan = self._step_plan
        if plan is not None and plan.graphs.captured:
            torch.cuda.synchronize(plan.device)
        self._step_plan = self._step_plan_key = None

    def factor(self, slot: TensorSlot) -> Tensor:
        """Return the warm-start ``Q`` of ``slot``, created on first use."""
        q = self.factors.get(slot.name)
        if q is None:
            q = self.factors[slot.name] = initial_factor(slot, self.rank, self.device)
        return q

    def left_factor(self, slot: TensorSlot) -> Tensor:
        """Return the ``P_hat`` of ``slot`` the last alternating ``P`` step kept (see :func:`initial_left_factor`)."""
        p = self.left_factors.get(slot.name)
        if p is None:
            p = self.left_factors[slot.name] = initial_left_factor(slot, self.rank, self.device)
        return p

    def corrected(self, slot: TensorSlot, gradient: Tensor) -> Tensor:
        """Return ``M = G + e`` of ``slot`` (``e = 0`` at first) in float32, in the slot's scratch buffer.

        A buffer apart from the error: the error must survive a step whose result is not finite.
        """
        m = self._scratch.get(slot.name)
        if m is None:
            m = self._scratch[slot.name] = torch.empty(slot.rows, slot.cols, dtype=torch.float32, device=self.device)
        error = self.errors.get(slot.name)
        if error is None:
            m.copy_(gradient)
        else:
            torch.add(gradient, error, out=m)
        return m

    def finish(
        self, slot: TensorSlot, gradient: Tensor, m: Tensor, left: Tensor, right: Tensor, finite: Tensor
    ) -> None:
        """Write ``G_hat = left right^T`` into ``gradient``; keep ``e = M - G_hat`` if ``finite``.

        Args:
            slot: the gradient's slot.
            gradient: its view in the bucket.
            m: its ``M``, which becomes the new error in place.
            left: ``P_hat`` (or, on an alternating ``P`` step, ``P``), ``n x r``.
            right: ``Q`` (or, on an alternating ``P`` step, ``Q_hat``), ``m x r``.
            finite: a boolean scalar tensor, whether the bucket's results are finite (see :func:`_finite`).
        """
        if gradient.dtype == torch.float32:
            torch.mm(left, right.T, out=gradient)
            m.addmm_(left, right.T, alpha=-1.0)
        else:
            approximation = left @ right.T
            gradient.copy_(approximation)
            m.sub_(approximation)
        previous = self.errors.get(slot.name)
        if m.device.type == "cpu":
            if bool(finite):
                # Swap: the new error is M's buffer, and the old error's buffer holds the next M.
                self.errors[slot.name] = m
                if previous is None:
                    del self._scratch[slot.name]
                else:
                    self._scratch[slot.name] = previous
            return
        # On CUDA a host check would synchronise the streams.
        self.errors[slot.name] = torch.where(finite, m, previous if previous is not None else torch.zeros_like(m))

    def keep_factor(self, factors: dict[str, Tensor], name: str, factor: Tensor, finite: Tensor) -> None:
        """Keep ``factor`` (made contiguous) as ``factors[name]``, which exists already, if ``finite``."""
        factor = factor.contiguous()
        if factor.device.type == "cpu":
            if bool(finite):
                factors[name] = factor
            return
        factors[name] = torch.where(finite, factor, factors[name])


def low_rank_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket of gradients through rank-``r`` factors.

    During the first ``warmup_steps`` steps (and always with ``hierarchical=True`` on one node) the bucket is
    all-reduced at full precision, as ``gradient_allreduce`` does. After that, among the ``N`` participants (the
    ranks, or the node leaders holding their node's mean or sum when two-level), for every gradient ``G_i`` of
    participant ``i`` that factors, reshaped to ``n x m``, with its error ``e_i`` (zero at first) and the warm-start
    ``Q`` (``m x r``, the same on every participant; at first standard normal from :func:`factor_seed`,
    orthonormalised):

    1. Add the error: ``M_i = G_i + e_i``.
    2. Project: ``P_i = M_i Q`` (``n x r``).
    3. First collective, one all-gather per bucket: every participant sends the 8-bit codes of all its ``P_i``
       (``P_i^T`` flattened, about one range per 1024 elements of a column) followed by the exact bytes of the
       bucket's gradients that do not factor. Each participant decodes every row and sums in participant order:
       ``P = sum_i D(C(P_i))``, and for the exact tensors ``G = sum_i G_i`` (divided by ``N`` if ``average``).
    4. Orthonormalise: ``P_hat = orth(P)`` by Gram-Schmidt, gradient by gradient; a column with nothing left
       stays zero. ``P``'s scale does not matter, so it is not averaged.
    5. Project back: ``Q_i = M_i^T P_hat`` (``m x r``).
    6. Second collective, one all-gather per bucket of the 8-bit codes of all ``Q_i``:
       ``Q = sum_i D(C(Q_i))``, divided by ``N`` if ``average``.
    7. Reconstruct: ``G_hat = P_hat Q^T`` is written into the bucket; ``e_i = M_i - G_hat`` and ``Q`` are kept for
       the next step. If ``G_hat`` is not finite (an overflowing gradient a ``GradScaler`` will skip), ``e_i`` and
       ``Q`` of the bucket's gradients keep their previous values (checked on the factors: ``P`` finite and
       ``|Q| < float32 max / r``).

    The host work per bucket does not grow with the number of gradients in it: each message's factors are encoded
    in one pass (:class:`~lightning_bagua.engine._codec_segments.SegmentLayout`, the same bytes as one codec call
    per factor) and the factors are written straight into it, and ``M_i`` lives in a buffer kept between steps.

    Every participant decodes the same bytes in the same order, so all of them hold the same ``P_hat``, ``Q`` and
    ``G_hat``; only ``e_i`` differs between participants.

    Args:
        state: the groups, counter, executor, codec and per-parameter factors and errors.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the reduced bucket.
    """
    compressed = state.steps >= state.warmup_steps and not state.full_precision_only
    state.last_compressed = compressed
    # The same for every bucket of a step: the step's jobs all finish before the next step's first hook.
    state.exchange_left = (state.steps - state.warmup_steps) % 2 == 0
    step = state.steps
    if bucket.is_last():
        state.steps += 1
    if not compressed:
        assert state.full_precision is not None
        return gradient_allreduce_hook(state.full_precision, bucket)
    buffer = bucket.buffer()
    slots = state.plan(bucket.parameters(), buffer.element_size())
    if state.whole_step:
        return state.batcher.add(state, buffer, slots, step, last=bucket.is_last())
    # Looked up at call time, so that a test can observe every bucket's input and output.
    return state.executor.submit(lambda: reduce_bucket(state, buffer, slots), last=bucket.is_last())


def reduce_bucket(state: LowRankState, buffer: Tensor, slots: list[TensorSlot]) -> Tensor:
    """Reduce ``buffer`` (laid out as ``slots``) over all ranks the way ``state`` says and return it (blocking)."""
    groups = state.groups
    if groups.is_hierarchical:
        ranks_per_node = groups.layout.ranks_per_node
        num_nodes = groups.layout.num_nodes

        def inter_node(node_sum: Tensor) -> None:
            if state.average:
                node_sum.div_(ranks_per_node)  # the node's mean; the nodes' mean of means is the global mean
            low_rank_reduce_(node_sum, slots, groups.inter_node, num_nodes, state)

        return all_reduce_hierarchically(buffer, groups, state.counter, inter_node)
    return low_rank_reduce_(buffer, slots, groups.flat, groups.world_size, state)


def _copy(tensor: Tensor) -> Tensor:
    """A contiguous copy (the whole-step path keeps ``Q`` as a transposed view)."""
    return tensor.clone(memory_format=torch.contiguous_format)
