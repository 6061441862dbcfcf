"""``low_rank``'s keywords and checkpoints: :class:`LowRankAlgorithm` and its per-model :class:`LowRankImpl`.

The bucket's trip itself (the state, the hook and the algorithm) is in :mod:`.hook`.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

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
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState
from lightning_bagua.engine.algorithms.low_rank.hook import LowRankState, low_rank_hook

__all__ = ["LowRankAlgorithm", "LowRankImpl"]


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
            "errors": {name: _copy(error) for name, error in state.memory.errors.items()},
            "factors": {name: _copy(factor) for name, factor in state.memory.factors.items()},
        }
        if state.alternate:
            saved["left_factors"] = {name: _copy(factor) for name, factor in state.memory.left_factors.items()}
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
        self.state.memory.errors = loaded["errors"]
        self.state.memory.factors = loaded["factors"]
        self.state.memory.left_factors = loaded.get("left_factors", {})
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
            shape (:func:`~lightning_bagua.engine.algorithms.low_rank.hook.reduce_step`): a few launches per
            distinct shape instead of several per gradient, and two collectives a step, for no overlap of the
            exchange with backward. ``None`` (the default) takes it on CUDA, where the per-bucket path is bound by
            the host, and not on CPU, where the per-bucket path overlaps backward on the engine's worker thread.
            Not with ``alternate=True``.
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


def _copy(tensor: Tensor) -> Tensor:
    """A contiguous copy (the whole-step path keeps ``Q`` as a transposed view)."""
    return tensor.clone(memory_format=torch.contiguous_format)
