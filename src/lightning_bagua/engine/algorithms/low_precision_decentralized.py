"""``low_precision_decentralized``: DCD-PSGD, a ring exchanging 8-bit compressed weight differences."""

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

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
    weakly_bound,
)
from lightning_bagua.engine.algorithms.decentralized import local_gradient_hook
from lightning_bagua.engine.algorithms.weights import FlatWeights, check_optimizers_cover, group_by_dtype
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import (
    all_reduce_hierarchically,
    start_exchange,
)

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedImpl", "LowPrecisionDecentralizedState"]

log = logging.getLogger(__name__)

# Point-to-point tags by direction of travel, so that with two participants (left and right are the same peer)
# each receive still matches the intended send. Both carry the same bytes, so any matching would be correct too.
_TOWARDS_LEFT = 0
_TOWARDS_RIGHT = 1


class _RingCopies:
    """One dtype group's ring copies ``w``, ``L`` and ``R``, and what its rounds work with besides.

    Besides the copies: the scratch each round forms its difference in, and the neighbours' codes of the last round
    until they are decoded.

    On a ring of two, both neighbours are the one peer and ``L`` and ``R`` receive the same codes from the same
    start, so they are one tensor; alone on the ring, ``w`` is its own neighbour and all three are one tensor.

    A round needs ``L`` and ``R`` only to form the next round's difference, so it leaves its exchange in flight and
    the neighbours' codes undecoded (:attr:`pending`): the new weights depend on this rank's own code alone. The
    next round, :meth:`settle` or a checkpoint first waits for them and adds them to ``L`` and ``R``. Between rounds
    the ring thus holds the codes of one round too: one byte per weight from each distinct neighbour, and the byte
    it sent, which an unfinished send still reads.

    Args:
        weights: the group's current (starting) weights, flat.
        num_chunks: how many independently scaled chunks the group's code has (one per bucket-sized piece).
        ring_size: the number of ring members.
    """

    def __init__(self, weights: Tensor, num_chunks: int, ring_size: int) -> None:
        self.num_chunks = num_chunks
        self.ring_size = ring_size
        self.w = weights.clone()
        self.left = self.w if ring_size == 1 else weights.clone()
        self.right = self.left if ring_size <= 2 else weights.clone()
        # Where each round forms its difference: kept, since allocating weight-sized memory every round costs page
        # faults on the CPU (CUDA's caching allocator would keep the block anyway).
        self.difference = torch.empty_like(weights)
        self.pending: _NeighbourCodes | None = None

    def distinct(self) -> list[Tensor]:
        """Return the distinct tensors among ``w``, ``L`` and ``R`` (the copies held between rounds)."""
        distinct: list[Tensor] = []
        for tensor in (self.w, self.left, self.right):
            if all(tensor is not other for other in distinct):
                distinct.append(tensor)
        return distinct

    def settle(self, codec: MinMaxUInt8Codec) -> None:
        """Wait for the last round's exchange, if still pending, and add the neighbours' codes to ``L`` and ``R``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        # Decoded straight into the copies; a copy shared by two roles is updated once.
        codec.decompress_add(pending.from_left, self.left)
        if self.right is not self.left:
            codec.decompress_add(pending.from_right, self.right)


@dataclass
class _NeighbourCodes:
    """A round's exchange in flight: its works, the codes sent and received, and which neighbour sent which."""

    works: list[dist.Work]
    sent: Tensor
    from_left: Tensor
    from_right: Tensor


# Elements per block of the round's elementwise work: the terms of ``d`` are formed in a scratch of this size,
# not in weight-sized temporaries. Larger on GPUs, where each block costs kernel launches.
_ROUND_BLOCK = {"cpu": 1 << 20, "cuda": 1 << 24}


@dataclass
class LowPrecisionDecentralizedState(HookState):
    """State of :class:`LowPrecisionDecentralizedImpl`.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``:

    Args:
        device: the device the parameters live on.
        communication_interval: communicate on the steps of every ``communication_interval``-th forward pass.
        bucket_cap_mb: the size of the pieces of ``d`` that are compressed with a min/max each.
        node_average: ``hierarchical=True`` on a single node: the round averages the node's weights at full
            precision (there is no ring of nodes), so the node's ranks keep identical weights, as in Bagua.
        codec: compresses the differences.
        weights: the participating parameters, grouped by dtype.
        copies: ``w``, ``L``, ``R`` per dtype group, on the ring's members, from the first forward pass on.
        forward_passes: training forward passes seen (the spec's ``t``).
        due: a forward pass of the current step asked for communication.
        armed: a synchronizing pass ran with ``due`` set; the ring round follows that step.
    """

    device: torch.device
    communication_interval: int
    bucket_cap_mb: float = 10.0
    node_average: bool = False
    codec: MinMaxUInt8Codec = field(default_factory=MinMaxUInt8Codec)
    weights: list[FlatWeights] = field(default_factory=list)
    copies: list[_RingCopies] | None = None
    forward_passes: int = 0
    due: bool = False
    armed: bool = False

    @property
    def on_ring(self) -> bool:
        """Whether this rank is a member of the ring (every rank when flat, the node leaders when two-level)."""
        if self.node_average:
            return False
        return not self.groups.is_hierarchical or self.groups.is_node_leader


class LowPrecisionDecentralizedImpl(AlgorithmImpl):
    """:class:`LowPrecisionDecentralizedAlgorithm` bound to one wrapped model.

    When the ring round runs: a step communicates if any of its forward passes (accumulating ones included) has
    ``t % communication_interval == 0``. The round runs once every bound optimizer has stepped since the last
    round, so with several optimizers it follows the last of them, whatever their order. Under a strategy, which
    reports every step on every rank (:meth:`on_optimizer_step`), a step the ``GradScaler`` skipped on one rank
    included, the reports alone count, so every rank runs the round at the same point, before any collective of
    the strategy or the user's code that follows the step. In a plain PyTorch loop the optimizers' post-step hooks
    count instead; if they never complete a step before the next training forward pass (a skipped step, or an
    optimizer that steps less often), the round runs at the start of that pass, or in :meth:`close`: either way
    each rank runs exactly one round per communicating step, so the ring's point-to-point messages always match.
    """

    def __init__(self, algorithm: "LowPrecisionDecentralizedAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        groups = context.groups
        node_average = algorithm.hierarchical and groups.layout.num_nodes == 1 and groups.world_size > 1
        # The flat ring reads the parameters in place and leaves them alone until it writes its result (the round
        # runs between two steps, never beside one). The node-level paths reduce the weights in place, so a
        # collective that fails half way must find a copy there, not the parameters.
        flat_ring = not node_average and not groups.is_hierarchical
        self.state = LowPrecisionDecentralizedState.from_context(
            context,
            device=context.device,
            communication_interval=algorithm.communication_interval,
            bucket_cap_mb=context.bucket_cap_mb,
            node_average=node_average,
            weights=group_by_dtype([parameter for _, parameter in context.named_parameters], alias=flat_ring),
        )
        self._optimizers: list[Optimizer] = []
        self._stepped: set[int] = set()
        self._hook_handles: list[RemovableHandle] = []

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return a state and a hook that leave gradients local."""
        return self.state, local_gradient_hook

    def on_forward_start(self, synchronizing: bool) -> None:
        """Count the pass, run a round a skipped step still owes, and note whether this step communicates.

        Args:
            synchronizing: ``False`` on the passes of accumulating steps; the step ends with a synchronizing one.
        """
        state = self.state
        if not self._optimizers and state.weights:
            raise RuntimeError(
                f"Algorithm {LowPrecisionDecentralizedAlgorithm.name!r} communicates right after the optimizer"
                " step, but no optimizer is bound to the model. Pass `optimizers=` to BaguaDistributedDataParallel"
                " or call its `bind_optimizers()` before training."
            )
        if state.copies is None and state.on_ring:
            # The replicas are identical now (DDP broadcast them, and any checkpoint has been loaded).
            state.copies = [_ring_copies(weights.gather(), state) for weights in state.weights]
        if state.armed:  # the step that should have run the round never completed on this rank
            self._run_round()
        if state.forward_passes % state.communication_interval == 0:
            state.due = True
        state.forward_passes += 1
        if synchronizing and state.due:
            state.due = False
            state.armed = True

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Hook the optimizers' steps, replacing the hooks of any optimizers bound before.

        Args:
            optimizers: the optimizers; together they must update every participating parameter.

        Raises:
            ValueError: a participating parameter is not updated by any of ``optimizers``.
        """
        if optimizers:
            check_optimizers_cover(LowPrecisionDecentralizedAlgorithm.name, self.context.named_parameters, optimizers)
        self._remove_hooks()
        self._optimizers = list(optimizers)
        self._stepped.clear()
        self._hook_handles = [
            optimizer.register_step_post_hook(weakly_bound(self._after_step)) for optimizer in optimizers
        ]

    def on_optimizer_step(self, optimizer: Optimizer) -> None:
        """Count a step the strategy reports, and run the round once every bound optimizer has one.

        The first report removes the optimizers' post-step hooks: a skipped step fires no hook on the rank that
        skipped it, so from then on the reports, which every rank gets alike, decide where a step ends.

        Args:
            optimizer: the optimizer that stepped (or whose step the gradient scaler skipped); one not bound to the
                model is ignored.
        """
        if not any(optimizer is bound for bound in self._optimizers):
            return
        if self._hook_handles:
            self._remove_hooks()
            self._stepped.discard(id(optimizer))  # its hook has counted this very step already
        self._after_step(optimizer, None, None)

    def settle(self) -> None:
        """Finish the last round's exchange, if still in flight, and add the neighbours' codes to ``L`` and ``R``.

        Idempotent, and free when nothing is in flight. Rounds call it themselves; :meth:`state_dict`,
        :meth:`load_state_dict` and :meth:`close` too.
        """
        for copies in self.state.copies or ():
            copies.settle(self.state.codec)

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's ring copies and counters: what it needs beyond its weights to continue the ring.

        Returns:
            ``{"forward_passes": int, "due": bool, "armed": bool, "copies": ...}``; ``armed`` is a round still
            owed by a step that has not completed, and ``copies`` is ``None`` before the first training forward
            pass and off the ring (non-leaders when two-level), else one ``{"w", "left", "right"}`` dict of
            flat tensors (clones) per dtype group.
        """
        self.settle()
        state = self.state
        copies = None
        if state.copies is not None:
            copies = [
                {"w": ring.w.clone(), "left": ring.left.clone(), "right": ring.right.clone()} for ring in state.copies
            ]
        return {"forward_passes": state.forward_passes, "due": state.due, "armed": state.armed, "copies": copies}

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Keep the shared counters and drop the ring copies, which the averaged weights replace.

        Every rank resumes from the same averaged weights, so the next training forward pass builds its copies of
        itself and its neighbours from them.

        Args:
            saved: each saved rank's :meth:`state_dict`.

        Returns:
            Rank 0's counters, with ``"copies": None``.
        """
        return {**saved[0], "copies": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, after the weights have been restored.

        Args:
            state: a dict from :meth:`state_dict` of the same rank, with the same parameters and ring layout.

        Raises:
            ValueError: the state does not match this model's dtype groups or this rank's place on the ring.
        """
        name = LowPrecisionDecentralizedAlgorithm.name
        check_state_keys(name, state, {"forward_passes": int, "due": bool, "armed": bool, "copies": (list, type(None))})
        self.settle()  # the peer's exchange in flight still writes into the copies about to be replaced
        saved = state["copies"]
        own = self.state
        if saved is not None and not own.on_ring:
            raise ValueError(
                f"Algorithm {name!r}: the saved state holds ring copies, but this rank is not on the ring (it is not"
                " its node's leader). Resume with the same number of nodes and processes per node."
            )
        if saved is not None and len(saved) != len(own.weights):
            raise ValueError(
                f"Algorithm {name!r}: the saved ring copies have {len(saved)} dtype group(s), this model has"
                f" {len(own.weights)}. Resume with the same model."
            )
        copies = None
        if saved is not None:
            copies = []
            for index, (ring, weights) in enumerate(zip(saved, own.weights, strict=True)):
                buffer = weights.buffer
                for key in ("w", "left", "right"):
                    tensor = ring.get(key) if isinstance(ring, dict) else None
                    if not isinstance(tensor, Tensor) or tensor.shape != buffer.shape or tensor.dtype != buffer.dtype:
                        raise ValueError(
                            f"Algorithm {name!r}: saved ring copy {key!r} of dtype group {index} does not match the"
                            f" model's {buffer.numel()} {buffer.dtype} weights. Resume with the same model."
                        )
                copy = _ring_copies(ring["w"].to(buffer.device), own)
                copy.left.copy_(ring["left"])
                copy.right.copy_(ring["right"])
                copies.append(copy)
        own.copies = copies
        own.forward_passes = state["forward_passes"]
        own.due = state["due"]
        own.armed = state["armed"]

    def close(self) -> None:
        """Remove the optimizer hooks, run a round the last step still owes, and finish the last round's exchange.

        The peers ran the owed round too, and their exchange with this rank is in flight until it finishes.
        """
        self._remove_hooks()
        try:
            if self.state.armed:
                self._run_round()
            self.settle()
        except RuntimeError as error:  # a peer that is gone must not turn shutdown into a crash
            log.warning("Dropping an unfinished ring round on close: %s", error)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped.add(id(optimizer))
        if len(self._stepped) < len(self._optimizers):
            return
        if self.state.armed:
            self._run_round()
        self._stepped.clear()

    def _run_round(self) -> None:
        if self.telemetry is not None:
            # The round runs after the step, where nothing overlaps it; the wait for the last round's exchange,
            # when still in flight, comes at its start.
            with self.telemetry.blocking():
                self._run_round_now()
        else:
            self._run_round_now()

    def _run_round_now(self) -> None:
        state = self.state
        state.armed = False
        self._stepped.clear()
        for index, weights in enumerate(state.weights):
            x = weights.gather()  # on the flat ring, the parameters themselves (see __init__)
            copies = state.copies[index] if state.copies is not None else None
            if state.node_average:
                state.counter.record("all_reduce", x)
                dist.all_reduce(x, group=state.groups.flat)
                x.div_(state.groups.world_size)
            elif state.groups.is_hierarchical:
                all_reduce_hierarchically(x, state.groups, state.counter, partial(_leader_round, state, copies))
            else:
                assert copies is not None
                x = _ring_round(x, copies, state, state.groups.flat, state.groups.rank, state.groups.global_ranks)
            weights.scatter(x)

    def _remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


@register_algorithm("low_precision_decentralized")
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Gossip 8-bit compressed weight differences around a ring: DCD-PSGD.

    DCD-PSGD is described by Tang et al. 2018, https://arxiv.org/abs/1803.06443. Every rank ``r`` of the ``n``
    on the ring trains with its own gradients (no gradient all-reduce) and keeps three flat copies of the
    weights, all set to the (identical) starting weights at the first training forward pass: ``w``, the weight
    it last communicated, and ``L`` and ``R``, its estimates of its left ``(r - 1) mod n`` and right
    ``(r + 1) mod n`` neighbours' ``w``. With ``t`` counting training forward passes from 0, after the optimizer
    step of every step that ran a pass with ``t % communication_interval == 0``:

    1. Take the change to communicate, ``d = x + L/3 + R/3 - 5 w/3`` with ``x`` the parameters after the local
       step. It reads ``d = (x - w) + ((w + L + R)/3 - w)``: the local progress since the last round, plus the
       move of ``w`` to the average of the three neighbouring ``w`` (the ring's mixing weights of 1/3 each).
    2. Compress it to 8 bits with the MinMaxUInt8 codec, one chunk (one min/max) per bucket-sized piece of ``d``
       (the wrapper's ``bucket_cap_mb``), as Bagua compresses per bucket:
       ``c = compress(d)``.
    3. Send ``c`` to both neighbours; receive ``cL`` from the left one and ``cR`` from the right one. On a ring
       of two, the one peer is both neighbours: ``c`` is sent once and ``cL = cR``.
    4. Update the copies with what every side decodes, so that ``L`` and ``R`` stay exactly equal to the
       neighbours' own ``w``: ``L += decompress(cL)``, ``R += decompress(cR)``, ``w += decompress(c)``.
    5. Continue from the communicated weight: ``x = w``.

    Step 5 needs only this rank's own code, so the round adds ``decompress(cL)`` and ``decompress(cR)`` to ``L`` and
    ``R`` when they are next needed (the next round, a checkpoint, closing), leaving the exchange in flight over the
    next step; the weights and copies are those of the steps above, in that order. On the flat ring the
    participating parameters live in one flat buffer per dtype, each one's ``data`` a view into it
    (:class:`~.weights.FlatWeights` with ``alias=True``), so the round reads ``x`` in place and writes ``w`` back
    with one copy.

    Args:
        hierarchical: first average the weights inside each node (full precision, on the node's leader); the
            leaders alone form the ring (``n`` counts nodes) and keep ``w``, ``L`` and ``R``; each leader then
            broadcasts its new ``w`` inside its node. With one rank per node this is the flat ring over all
            ranks; with one node, as in Bagua, each round averages the node's weights at full precision instead
            (no ring, nothing compressed), so its ranks keep identical weights.
        communication_interval: communicate after the steps of every ``communication_interval``-th forward pass.

    Raises:
        ValueError: ``communication_interval`` is below 1.
        TypeError: a keyword has the wrong type.
    """

    ranks_hold_different_weights = True
    resize_effect = (
        "the counters are kept; every rank starts from the ranks' average weights and rebuilds its ring copies"
    )
    single_node_effect = "each round averages the node's weights at full precision instead of the compressed ring"
    impl_class = LowPrecisionDecentralizedImpl

    # Weights travel as flat per-dtype buffers; the gradient buckets never leave the rank.
    communicates_gradient_buckets = False

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        check_positive_int(self.name, "communication_interval", communication_interval)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval


def _leader_round(state: LowPrecisionDecentralizedState, copies: _RingCopies | None, node_sum: Tensor) -> None:
    assert copies is not None, "the ring copies live on node leaders"
    layout = state.groups.layout
    node_sum.div_(layout.ranks_per_node)  # the node's average weight is the ring member's x
    leaders = [state.groups.global_ranks[leader] for leader in layout.leaders()]
    w = _ring_round(node_sum, copies, state, state.groups.inter_node, layout.node_of(state.groups.rank), leaders)
    node_sum.copy_(w)  # what the leader broadcasts to its node


def _ring_copies(weights: Tensor, state: LowPrecisionDecentralizedState) -> _RingCopies:
    # As Bagua compresses each bucket on its own: one min/max per bucket-sized piece of the flat weights, so the
    # quantisation step follows each piece's range, not the whole model's.
    bucket_bytes = state.bucket_cap_mb * 1024**2
    num_chunks = max(1, math.ceil(weights.numel() * weights.element_size() / bucket_bytes))
    groups = state.groups
    ring_size = groups.layout.num_nodes if groups.is_hierarchical else groups.world_size
    return _RingCopies(weights, num_chunks, ring_size)


def _ring_round(
    x: Tensor,
    copies: _RingCopies,
    state: LowPrecisionDecentralizedState,
    group: dist.ProcessGroup | None,
    position: int,
    members: list[int],
) -> Tensor:
    """Run one DCD-PSGD round for ring member ``position`` of ``members`` (global ranks) and return ``w``.

    ``x`` is read only. The returned tensor is the ring copy ``w`` itself, the new weights: read it, never change
    it.
    """
    codec, numel = state.codec, x.numel()
    copies.settle(codec)  # L and R must hold the last round's codes before they enter the difference
    difference = _difference_into(copies.difference, x, copies)
    code = codec.compress(difference, num_chunks=copies.num_chunks)
    size = len(members)
    assert copies.ring_size == size, "the copies were laid out for another ring"
    if size == 1:
        # Alone on the ring, this rank is its own neighbour on both sides: L and R are w.
        codec.decompress_add(code, copies.w)
        return copies.w
    # One code from each distinct neighbour, kept until the next round adds it to L or R.
    received = torch.empty((min(size - 1, 2), *code.shape), dtype=code.dtype, device=code.device)
    if size == 2:
        # Both neighbours are the one peer, and both would be sent the same code: one exchange carries it.
        peer = members[1 - position]
        state.counter.record("send", code, uncompressed=numel * x.element_size())
        works = start_exchange(
            [
                dist.P2POp(dist.isend, code, peer, group, _TOWARDS_RIGHT),
                dist.P2POp(dist.irecv, received[0], peer, group, _TOWARDS_RIGHT),
            ]
        )
        from_left = from_right = received[0]
    else:
        left, right = members[(position - 1) % size], members[(position + 1) % size]
        # Each code sent is matched by a code of the same size received from the other side.
        uncompressed = numel * x.element_size()
        state.counter.record("send", code, uncompressed=uncompressed)
        state.counter.record("send", code, uncompressed=uncompressed)
        works = start_exchange(
            [
                dist.P2POp(dist.isend, code, left, group, _TOWARDS_LEFT),
                dist.P2POp(dist.isend, code, right, group, _TOWARDS_RIGHT),
                # The right neighbour's code travels leftwards to reach us, the left one's rightwards.
                dist.P2POp(dist.irecv, received[1], right, group, _TOWARDS_LEFT),
                dist.P2POp(dist.irecv, received[0], left, group, _TOWARDS_RIGHT),
            ]
        )
        from_left, from_right = received[0], received[1]
    # The new weights need only this rank's own code; the neighbours' codes are added to L and R when they are next
    # needed (_RingCopies.settle), so that their exchange overlaps the next step instead of ending this one.
    codec.decompress_add(code, copies.w)
    copies.pending = _NeighbourCodes(works, code, from_left, from_right)
    return copies.w


def _difference_into(out: Tensor, x: Tensor, copies: _RingCopies) -> Tensor:
    """Write the change to communicate, ``d = x + L/3 + R/3 - 5w/3``, into ``out`` and return it.

    On CUDA with Triton, one kernel reads each operand once (:mod:`._dcd_triton`) and writes the bits torch's
    ops below write there. Elsewhere torch's ops run in that order, block by block, through a block-sized scratch
    instead of weight-sized temporaries.
    """
    kernels = _difference_kernels() if x.device.type == "cuda" else None
    if kernels is not None:
        kernels.difference_into(out, x, copies.left, copies.right, copies.w)
        return out
    numel = x.numel()
    block_size = _ROUND_BLOCK.get(x.device.type, 1 << 24)
    scratch = torch.empty(min(numel, block_size), dtype=x.dtype, device=x.device)
    for start in range(0, numel, block_size):
        end = min(start + block_size, numel)
        term = scratch[: end - start]
        block = out[start:end].copy_(x[start:end])
        block.add_(torch.div(copies.left[start:end], 3, out=term))
        block.add_(torch.div(copies.right[start:end], 3, out=term))
        block.sub_(torch.mul(copies.w[start:end], 5, out=term).div_(3))
    return out


@functools.cache
def _difference_kernels() -> ModuleType | None:
    """The fused difference kernel's module, or ``None`` when Triton cannot be imported (torch's ops run)."""
    try:
        from lightning_bagua.engine.algorithms import _dcd_triton
    except ImportError as error:
        log.debug("Triton is unavailable (%s); the ring's difference runs on torch ops.", error)
        return None
    return _dcd_triton
