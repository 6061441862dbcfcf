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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine._codec_segments import SegmentLayout, segment_backend
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
from lightning_bagua.engine.communication import CommunicationCounter, all_gather_into, all_reduce_hierarchically

__all__ = [
    "LowRankAlgorithm",
    "LowRankState",
    "TensorSlot",
    "factor_seed",
    "gram_schmidt_",
    "low_rank_hook",
    "orthonormalise_columns",
]

log = logging.getLogger(__name__)

# Elements of a factor column per codec chunk: each chunk has its own range (32 header bytes, 3% of 1024 codes).
CODEC_CHUNK_ELEMENTS = 1024
# A tensor is factored only if its two 8-bit factors (headers included) weigh at most this fraction of its bytes.
MAX_FACTOR_BYTES_FRACTION = 0.25
# Messages are padded to whole 8-byte words, so that a gathered row's full-precision part can be viewed as floats.
_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorSlot:
    """Where one gradient lives in a flat bucket, and how ``low_rank`` sends it.

    Args:
        name: the parameter's name.
        offset: its first element in the bucket.
        rows: ``n``, the gradient's first dimension (1 for a scalar or 1-D tensor, which is never factored).
        cols: ``m``, the product of the other dimensions.
        factored: whether it travels as rank-``r`` factors (else at full precision).
        p_chunks: codec chunks of the ``P`` factor (``r`` columns of ``n`` elements).
        q_chunks: codec chunks of the ``Q`` factor (``r`` columns of ``m`` elements).
    """

    name: str
    offset: int
    rows: int
    cols: int
    factored: bool
    p_chunks: int = 0
    q_chunks: int = 0

    @property
    def numel(self) -> int:
        """The gradient's number of elements."""
        return self.rows * self.cols


def _chunks_for_columns(length: int, rank: int) -> int:
    """Codec chunks for ``rank`` columns of ``length`` elements: about one range per column piece."""
    return rank * -(-length // CODEC_CHUNK_ELEMENTS)


def plan_slot(
    name: str, offset: int, shape: torch.Size, rank: int, element_size: int, codec: MinMaxUInt8Codec
) -> TensorSlot:
    """Decide how the gradient of one parameter travels, from its shape alone (the same on every rank).

    A gradient of ``n x m`` (first dimension by the rest) is factored when it has at least two dimensions, rank
    ``r`` is below ``min(n, m)`` and its two 8-bit factors weigh at most :data:`MAX_FACTOR_BYTES_FRACTION` of
    its full-precision bytes; otherwise it travels exactly, at full precision.

    Args:
        name: the parameter's name.
        offset: its first element in the bucket.
        shape: the gradient's shape.
        rank: the factors' rank ``r``.
        element_size: bytes per gradient element.
        codec: the codec (for its chunk sizes).

    Returns:
        The slot.
    """
    numel = shape.numel()
    rows = shape[0] if len(shape) >= 2 else 1
    cols = numel // rows if rows else 0
    if len(shape) < 2 or min(rows, cols) <= rank:
        return TensorSlot(name, offset, rows, cols, factored=False)
    p_chunks, q_chunks = _chunks_for_columns(rows, rank), _chunks_for_columns(cols, rank)
    factor_bytes = p_chunks * codec.row_bytes(rows * rank, p_chunks) + q_chunks * codec.row_bytes(cols * rank, q_chunks)
    if factor_bytes > MAX_FACTOR_BYTES_FRACTION * numel * element_size:
        return TensorSlot(name, offset, rows, cols, factored=False)
    return TensorSlot(name, offset, rows, cols, True, p_chunks, q_chunks)


def factor_seed(rows: int, cols: int, rank: int) -> int:
    """Return the seed of a gradient's first ``Q``: the CRC-32 of ``"{rows}x{cols}|{rank}"``.

    Every rank derives the same seed (Python's ``hash`` would differ between processes). The shape alone, not the
    parameter's name, so that a model trains the same under the Trainer and under Fabric, which name it apart.
    """
    return zlib.crc32(f"{rows}x{cols}|{rank}".encode())


def initial_factor(slot: TensorSlot, rank: int, device: torch.device) -> Tensor:
    """Return the first ``Q`` of ``slot``: ``m x r`` standard normal from :func:`factor_seed`, orthonormalised."""
    generator = torch.Generator().manual_seed(factor_seed(slot.rows, slot.cols, rank))
    q = torch.randn(slot.cols, rank, generator=generator, dtype=torch.float32)
    return orthonormalise_columns(q.unsqueeze(0))[0].to(device)


def initial_left_factor(slot: TensorSlot, rank: int, device: torch.device) -> Tensor:
    """Return the ``P_hat`` an alternating ``Q`` step uses before any ``P`` step kept one: ``n x r``, orthonormal.

    Only reached when the first ``P`` step of a bucket was not finite; seeded as :func:`initial_factor`, from the
    shape and a prefix of its own.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(f"P|{slot.rows}x{slot.cols}|{rank}".encode()))
    p = torch.randn(slot.rows, rank, generator=generator, dtype=torch.float32)
    return orthonormalise_columns(p.unsqueeze(0))[0].to(device)


def orthonormalise_columns(matrices: Tensor) -> Tensor:
    """Orthonormalise the columns of each matrix of a ``(b, k, r)`` batch by Gram-Schmidt, in place.

    Column ``j`` loses its projections on columns ``0..j-1``, then is divided by its norm. A column with no
    length left (a zero gradient, or one of rank below ``r``) stays zero instead of becoming NaN.

    On a CPU the same basis comes from one batched Householder QR, ``A = Q R`` (LAPACK), with each column of ``Q``
    multiplied by the sign of ``R``'s diagonal entry (``R_jj`` is the length column ``j`` has left): a few calls
    instead of several per column, about ten times less host time at ``r = 8``, equal to float rounding. Where
    some ``R_jj`` is exactly zero, QR would keep the later columns orthogonal to a direction of its own choosing,
    so that batch takes the column-by-column loop, as on CUDA.

    Args:
        matrices: a float tensor of shape ``(b, k, r)``.

    Returns:
        ``matrices``.
    """
    if matrices.device.type == "cpu":
        q, r = torch.linalg.qr(matrices)
        length_left = torch.diagonal(r, dim1=-2, dim2=-1)
        if not bool((length_left == 0).any()):
            return matrices.copy_(q.mul_(length_left.sign().unsqueeze(-2)))
    return gram_schmidt_(matrices)


def gram_schmidt_(matrices: Tensor) -> Tensor:
    """:func:`orthonormalise_columns` written out column by column, on any device, in place; returns ``matrices``."""
    tiny = torch.finfo(matrices.dtype).tiny
    for j in range(matrices.shape[2]):
        column = matrices[:, :, j : j + 1]
        if j:
            previous = matrices[:, :, :j]
            column.sub_(previous @ (previous.transpose(1, 2) @ column))
        column.div_(column.norm(dim=1, keepdim=True).clamp_min(tiny))
    return matrices


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
            names={id(parameter): name for name, parameter in context.named_parameters},
            device=context.device,
        )
        self._shapes = {name: parameter.shape for name, parameter in context.named_parameters}

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`low_rank_hook`."""
        return self.state, low_rank_hook

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
            "errors": {name: error.clone() for name, error in state.errors.items()},
            "factors": {name: factor.clone() for name, factor in state.factors.items()},
        }
        if state.alternate:
            saved["left_factors"] = {name: factor.clone() for name, factor in state.left_factors.items()}
        return saved

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
    """

    single_node_effect = "nothing is compressed: every bucket is all-reduced at full precision"
    impl_class = LowRankImpl

    def __init__(
        self,
        rank: int = 8,
        warmup_steps: int = 10,
        hierarchical: bool = True,
        average: bool = True,
        alternate: bool = False,
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
    _plans: dict[tuple[str, ...], list[TensorSlot]] = field(default_factory=dict, repr=False)
    _bucket_plans: dict[tuple[Any, ...], "_BucketPlan"] = field(default_factory=dict, repr=False)
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

    def bucket_plan(self, slots: list[TensorSlot], tensor: Tensor) -> "_BucketPlan":
        """Return how a bucket laid out as ``slots`` travels (cached per layout, dtype and device)."""
        key = (tuple(slots), tensor.dtype, tensor.device)
        plan = self._bucket_plans.get(key)
        if plan is None:
            plan = self._bucket_plans[key] = _plan_bucket(slots, tensor, self.rank, self.codec)
        return plan

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
    if bucket.is_last():
        state.steps += 1
    if not compressed:
        assert state.full_precision is not None
        return gradient_allreduce_hook(state.full_precision, bucket)
    buffer = bucket.buffer()
    slots = state.plan(bucket.parameters(), buffer.element_size())
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


def low_rank_reduce_(
    tensor: Tensor, slots: list[TensorSlot], group: dist.ProcessGroup | None, n: int, state: LowRankState
) -> Tensor:
    """Run steps 1-7 of :func:`low_rank_hook` on ``tensor`` among the ``n`` ranks of ``group``, in place.

    Args:
        tensor: this participant's flat bucket; overwritten with the result.
        slots: where each gradient lives in ``tensor`` and whether it factors.
        group: the group to exchange over.
        n: the size of ``group``.
        state: the codec, counter, factors and errors.

    Returns:
        ``tensor``.
    """
    if state.alternate:
        return _alternating_reduce_(tensor, slots, group, n, state)
    plan = state.bucket_plan(slots, tensor)
    rank = state.rank
    views = [tensor[slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols) for slot in plan.factored]

    # Steps 1-2: M_i into the slot's scratch, P_i^T straight into the flat factor buffer.
    corrected = [state.corrected(slot, view) for slot, view in zip(plan.factored, views, strict=True)]
    p_flat = torch.empty(plan.p_elements, dtype=torch.float32, device=tensor.device)
    for slot, m, offset in zip(plan.factored, corrected, plan.p_offsets, strict=True):
        torch.mm(state.factor(slot).T, m.T, out=p_flat[offset : offset + slot.rows * rank].view(rank, slot.rows))

    # Step 3: [exact bytes | P codes], one all-gather.
    message = _message_with_exact(tensor, plan, plan.first_message_bytes)
    if plan.p_layout is not None:
        plan.p_layout.encode_into(p_flat, message)
    gathered = _all_gather_bytes(message, group, n, state.counter, plan.first_share)
    _reduce_exact(tensor, plan, gathered, n, state.average)
    if plan.p_layout is None or plan.q_layout is None:
        return tensor
    p_sums = plan.p_layout.decode_sum(gathered)

    # Step 4, batched over the gradients with the same number of rows: a few launches per bucket, not per gradient.
    p_hats = _orthonormalised(p_sums, plan.p_offsets, plan.p_sizes, plan.same_rows, rank)

    # Steps 5-6: Q_i^T = P_hat^T M_i straight into the flat factor buffer.
    q_flat = torch.empty(plan.q_elements, dtype=torch.float32, device=tensor.device)
    for slot, m, p_hat, offset in zip(plan.factored, corrected, p_hats, plan.q_offsets, strict=True):
        torch.mm(p_hat.T, m, out=q_flat[offset : offset + slot.cols * rank].view(rank, slot.cols))
    message = torch.zeros(plan.second_message_bytes, dtype=torch.uint8, device=tensor.device)
    plan.q_layout.encode_into(q_flat, message)
    gathered = _all_gather_bytes(message, group, n, state.counter, plan.bucket_bytes - plan.first_share)
    q_sums = plan.q_layout.decode_sum(gathered)
    if state.average:
        q_sums.div_(n)

    # Step 7.
    finite = _finite(p_sums, q_sums, rank)
    for slot, view, m, p_hat, offset in zip(plan.factored, views, corrected, p_hats, plan.q_offsets, strict=True):
        q = q_sums[offset : offset + slot.cols * rank].view(rank, slot.cols).T
        state.finish(slot, view, m, p_hat, q, finite)
        state.keep_factor(state.factors, slot.name, q, finite)
    return tensor


def _alternating_reduce_(
    tensor: Tensor, slots: list[TensorSlot], group: dist.ProcessGroup | None, n: int, state: LowRankState
) -> Tensor:
    """Reduce ``tensor`` exchanging one factor, ``P`` or ``Q`` as ``state.exchange_left`` says, in place.

    ACP-SGD ("alternate compressed PowerSGD", from *Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning*) alternates PowerSGD's two half-steps between training steps, so each step takes
    one collective. Among the ``n`` participants, for every gradient
    ``G_i`` that factors, with its error ``e_i`` and the orthonormal factors ``Q_hat`` (``m x r``) and ``P_hat``
    (``n x r``) the last steps kept (at first ``Q_hat`` from :func:`factor_seed`, as :func:`low_rank_hook`):

    1. Add the error: ``M_i = G_i + e_i``.
    2. On a ``P`` step (the first compressed step, then every other one): ``P_i = M_i Q_hat``. On a ``Q`` step:
       ``Q_i = M_i^T P_hat``.
    3. One all-gather per bucket of ``[exact bytes | 8-bit codes of the P_i (or Q_i)]``; every participant decodes
       every row and sums in participant order, divided by ``n`` if ``average``: ``P = sum_i D(C(P_i)) / n``.
    4. Reconstruct: ``G_hat = P Q_hat^T`` (``Q`` step: ``G_hat = P_hat Q^T``), the mean of the ``M_i`` projected on
       the kept factor's span; ``e_i = M_i - G_hat``.
    5. Keep ``P_hat = orth(P)`` (``Q`` step: ``Q_hat = orth(Q)``) for the next step. A bucket whose result is not
       finite (``|P| >= float32 max / r``, or NaN) keeps its previous errors and factors.

    Args:
        tensor: this participant's flat bucket; overwritten with the result.
        slots: where each gradient lives in ``tensor`` and whether it factors.
        group: the group to exchange over.
        n: the size of ``group``.
        state: the codec, counter, factors, errors and phase.

    Returns:
        ``tensor``.
    """
    plan = state.bucket_plan(slots, tensor)
    rank = state.rank
    left_step = state.exchange_left
    sizes, offsets, layout, message_bytes, batches = plan.alternating_side(left_step)
    if left_step:
        kept, store = [state.factor(slot) for slot in plan.factored], state.left_factors
    else:
        kept, store = [state.left_factor(slot) for slot in plan.factored], state.factors
    views = [tensor[slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols) for slot in plan.factored]

    # Steps 1-2: P_i^T = Q_hat^T M_i^T (or Q_i^T = P_hat^T M_i) straight into the flat factor buffer.
    corrected = [state.corrected(slot, view) for slot, view in zip(plan.factored, views, strict=True)]
    flat = torch.empty(sum(sizes) * rank, dtype=torch.float32, device=tensor.device)
    for m, factor, offset, size in zip(corrected, kept, offsets, sizes, strict=True):
        torch.mm(factor.T, m.T if left_step else m, out=flat[offset : offset + size * rank].view(rank, size))

    # Step 3.
    message = _message_with_exact(tensor, plan, message_bytes)
    if layout is not None:
        layout.encode_into(flat, message)
    gathered = _all_gather_bytes(message, group, n, state.counter, plan.bucket_bytes)
    _reduce_exact(tensor, plan, gathered, n, state.average)
    if layout is None:
        return tensor
    sums = layout.decode_sum(gathered)
    if state.average:
        sums.div_(n)

    # Step 4, then step 5 in place on the sums (G_hat is written by then).
    finite = _bounded(sums, rank)
    for slot, view, m, factor, offset, size in zip(plan.factored, views, corrected, kept, offsets, sizes, strict=True):
        received = sums[offset : offset + size * rank].view(rank, size).T
        left, right = (received, factor) if left_step else (factor, received)
        state.finish(slot, view, m, left, right, finite)
    hats = _orthonormalised(sums, offsets, sizes, batches, rank)
    for slot, hat in zip(plan.factored, hats, strict=True):
        if left_step:
            state.left_factor(slot)  # a previous P_hat to keep if this step is not finite
        state.keep_factor(store, slot.name, hat, finite)
    return tensor


def _message_with_exact(tensor: Tensor, plan: "_BucketPlan", nbytes: int) -> Tensor:
    """A zeroed ``nbytes`` message that starts with the exact bytes of the bucket's tensors that do not factor."""
    message = torch.zeros(nbytes, dtype=torch.uint8, device=tensor.device)
    if plan.exact_index is not None:
        message[: plan.exact_bytes] = tensor.take(plan.exact_index).view(torch.uint8)
    return message


def _reduce_exact(tensor: Tensor, plan: "_BucketPlan", gathered: Tensor, n: int, average: bool) -> None:
    """Write the in-order sum (mean if ``average``) of the gathered exact bytes into their places in ``tensor``."""
    if plan.exact_index is None:
        return
    exact_sum = _sum_in_order(gathered[:, : plan.exact_bytes].view(tensor.dtype).float())
    if average:
        exact_sum.div_(n)
    tensor.index_copy_(0, plan.exact_index, exact_sum.to(tensor.dtype))


def _orthonormalised(
    flat: Tensor, offsets: list[int], sizes: list[int], batches: list[list[int]], rank: int
) -> list[Tensor]:
    """Orthonormalise the factors in ``flat`` (each stored transposed: ``r`` rows of its length), batch by batch.

    ``batches`` groups the factors of the same length, so that each group takes a few launches, not one per factor.
    A lone factor is orthonormalised in place, as a batch of one.

    Returns:
        One ``length x r`` matrix per factor.
    """
    hats: list[Tensor] = [flat] * len(sizes)
    for members in batches:
        size = sizes[members[0]]
        columns = [flat[offsets[i] : offsets[i] + size * rank].view(rank, size).T for i in members]
        stacked = torch.stack(columns) if len(columns) > 1 else columns[0].unsqueeze(0)
        orthonormalise_columns(stacked)
        for position, i in enumerate(members):
            hats[i] = stacked[position]
    return hats


def _finite(p_sums: Tensor, q_sums: Tensor, rank: int) -> Tensor:
    """Whether every ``G_hat = P_hat Q^T`` of a bucket is finite, from its factors alone (a boolean scalar tensor).

    ``P_hat`` is finite where ``P`` is (its columns have norm one or zero), so each entry of ``G_hat`` is at most
    ``r`` times ``Q``'s largest entry: ``|Q| < float32 max / r`` keeps it finite. NaN fails the comparison. One
    check per bucket: a non-finite gradient (a step a ``GradScaler`` skips) leaves the whole bucket's state as it
    was.
    """
    return torch.isfinite(p_sums).all() & _bounded(q_sums, rank)


def _bounded(factor: Tensor, rank: int) -> Tensor:
    """Whether ``|factor| < float32 max / r`` everywhere (False on NaN): times an orthonormal factor, stays finite."""
    return factor.abs().amax() < torch.finfo(torch.float32).max / rank


@dataclass
class _BucketPlan:
    """How one bucket layout travels: the factored slots, the exact tensors' elements and both messages' layouts."""

    factored: list[TensorSlot]
    same_rows: list[list[int]]  # indices into ``factored`` grouped by row count, for batched orthonormalisation
    same_cols: list[list[int]]  # the same by column count (the alternating form's Q steps)
    exact_index: Tensor | None
    exact_bytes: int
    p_sizes: list[int]  # each factored gradient's rows (the length of a P column)
    q_sizes: list[int]  # and its columns (the length of a Q column)
    p_offsets: list[int]
    q_offsets: list[int]
    p_layout: SegmentLayout | None
    q_layout: SegmentLayout | None
    first_message_bytes: int
    second_message_bytes: int
    first_share: int
    bucket_bytes: int
    # The alternating form's Q steps: [exact bytes | pad | Q codes | pad].
    q_alone_layout: SegmentLayout | None
    q_alone_message_bytes: int

    def alternating_side(self, left: bool) -> tuple[list[int], list[int], SegmentLayout | None, int, list[list[int]]]:
        """An alternating step's factor lengths, offsets, layout, message bytes and orthonormalisation batches."""
        if left:
            return self.p_sizes, self.p_offsets, self.p_layout, self.first_message_bytes, self.same_rows
        return self.q_sizes, self.q_offsets, self.q_alone_layout, self.q_alone_message_bytes, self.same_cols

    @property
    def p_elements(self) -> int:
        return 0 if self.p_layout is None else self.p_layout.elements

    @property
    def q_elements(self) -> int:
        return 0 if self.q_layout is None else self.q_layout.elements


def _plan_bucket(slots: list[TensorSlot], tensor: Tensor, rank: int, codec: MinMaxUInt8Codec) -> _BucketPlan:
    """Lay out both messages of a bucket: ``[exact bytes | pad | P codes | pad]`` and ``[Q codes | pad]``."""
    factored = [slot for slot in slots if slot.factored]
    exact = [slot for slot in slots if not slot.factored]
    element_size = tensor.element_size()
    exact_index = None
    if exact:
        exact_index = torch.cat([torch.arange(slot.offset, slot.offset + slot.numel) for slot in exact])
        exact_index = exact_index.to(tensor.device)
    exact_bytes = sum(slot.numel for slot in exact) * element_size
    start = exact_bytes + -exact_bytes % _ALIGNMENT
    p_layout = q_layout = q_alone_layout = None
    p_offsets, q_offsets = (
        _offsets([slot.rows * rank for slot in factored]),
        _offsets([slot.cols * rank for slot in factored]),
    )
    if factored:
        backend = segment_backend(codec)
        p_segments = [(slot.rows * rank, slot.p_chunks) for slot in factored]
        q_segments = [(slot.cols * rank, slot.q_chunks) for slot in factored]
        p_layout = SegmentLayout(p_segments, start, codec.eps, backend)
        q_layout = SegmentLayout(q_segments, 0, codec.eps, backend)
        q_alone_layout = SegmentLayout(q_segments, start, codec.eps, backend)
    first = start + (0 if p_layout is None else p_layout.nbytes)
    second = 0 if q_layout is None else q_layout.nbytes
    q_alone = start + (0 if q_layout is None else q_layout.nbytes)
    # The bucket's full-precision bytes, shared between the two collectives in proportion to what each carries.
    first_share = exact_bytes + sum(
        slot.numel * element_size * slot.rows // (slot.rows + slot.cols) for slot in factored
    )
    same_rows: dict[int, list[int]] = {}
    same_cols: dict[int, list[int]] = {}
    for index, slot in enumerate(factored):
        same_rows.setdefault(slot.rows, []).append(index)
        same_cols.setdefault(slot.cols, []).append(index)
    return _BucketPlan(
        factored=factored,
        same_rows=list(same_rows.values()),
        same_cols=list(same_cols.values()),
        exact_index=exact_index,
        exact_bytes=exact_bytes,
        p_sizes=[slot.rows for slot in factored],
        q_sizes=[slot.cols for slot in factored],
        p_offsets=p_offsets,
        q_offsets=q_offsets,
        p_layout=p_layout,
        q_layout=q_layout,
        first_message_bytes=first + -first % _ALIGNMENT,
        second_message_bytes=second + -second % _ALIGNMENT,
        first_share=first_share,
        bucket_bytes=tensor.numel() * element_size,
        q_alone_layout=q_alone_layout,
        q_alone_message_bytes=q_alone + -q_alone % _ALIGNMENT,
    )


def _offsets(sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def _all_gather_bytes(
    message: Tensor, group: dist.ProcessGroup | None, n: int, counter: CommunicationCounter, uncompressed: int
) -> Tensor:
    """All-gather one byte message; return the ``(n, length)`` rows."""
    gathered = torch.empty((n, message.numel()), dtype=torch.uint8, device=message.device)
    counter.record("all_gather", message, received=message.numel() * (n - 1), uncompressed=uncompressed)
    all_gather_into(gathered, message, group)
    return gathered


def _sum_in_order(rows: Tensor) -> Tensor:
    """Sum the rows of ``rows`` (one per participant) from the first to the last, as a new tensor."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total
