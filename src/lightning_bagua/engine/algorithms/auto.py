"""``auto``: measure the link and the model, time each candidate for a few steps, run the first to DDP's loss.

1. At the first training step every rank times a few all-reduces of two sizes on each tier of the node layout
   (all ranks, within a node, between node leaders): latency ``a`` and bandwidth ``B`` of ``t(s) = a + s / B``.
   The larger size grows from 64 KiB towards the gradients' size until it is bandwidth-bound.
   Rank 0 also counts the gradient bytes by dtype and times what its device pays for each candidate's compression
   (the 8-bit codec on the gradients, the rank-``r`` projections on the matrix shapes).
2. Rank 0 orders the candidates by a lower bound of their time to DDP's loss (per DDP step), ``f_c *
   max(compute + compress_c, bytes_c / B)``, with ``f_c`` the steps to DDP's target as a multiple of DDP's
   (:mod:`._auto_factors`): a step takes at least its compute and at least the bytes it sends (low_rank's 8-bit
   factors as its plan sends them) at the bandwidth of the tier its exchange crosses. Before any step is timed the
   compute is taken as 0, so the order is the link's; ``gradient_allreduce``'s bound is always its link bound.
3. Each candidate in that order runs ``trial_steps`` timed steps (after one untimed step that settles the switch).
   Its step ``T_c`` is the maximum over ranks of each rank's median (a step is as slow as its slowest rank), in the
   phase it would run in (``low_rank`` exchanges factors from its first trial step). A step is timed from its
   forward to the end of its optimizer step (the bound optimizers' step hook, or the strategy's report of a step the
   gradient scaler skipped), and the median time from there to the next forward is added: a validation loop or a
   checkpoint between two trial steps counts neither in ``T_c`` nor in what measuring cost, and a step over 4x its
   candidate's median (a pause of the whole process, such as a garbage collection) counts as 4 of them. The
   compute is then at most ``gradient_allreduce``'s step less its bytes over the link, once it has run.
4. Before each further candidate, rank 0 skips it if its bound already loses to the best ``T_c * f_c`` measured
   so far, or if it would overrun the budget (room for ``gradient_allreduce`` is kept until it has run or lost).
   On a slow link ``gradient_allreduce`` is not timed at all once a compressing candidate beats its bytes at the
   bandwidth. Where the run's length ``N`` is known the budget is also one of time: measuring may cost at most 5%
   of the run, ``0.05 * N * T_best``, beyond what the best candidate so far would have taken. Every trial step
   trains the model, so what it costs is its excess: a step of ``c`` makes ``1 / f_c`` of a DDP step's progress,
   which the best candidate makes in ``T_best * f_best / f_c``; the link timing counts whole. A candidate whose
   steps are about as fast as the best's is cheap to time however many steps it takes, and a slow one is not.
   Loading the codec counts only where the best candidate does not compress: one that does would pay it anyway.
5. Where steps are short, the candidates within 1.5x of the best ``T_c * f_c`` are then timed for longer, the best
   first: up to ``k = ceil(min_trial_s / T_c)`` steps, within an even share of the steps left and of the allowance.
   A few steps' noise cannot then decide between close candidates. The longer timing can raise the best one's
   step or lower the compute bound (a cold first trial of ``gradient_allreduce``): a candidate skipped by its bound
   that could now win goes back on trial, and the close ones are timed again.
6. Rank 0 picks the smallest predicted time (the earlier candidate on a tie; ``gradient_allreduce`` unless another
   beats it, measured or by its link bound) and broadcasts it; every rank builds that algorithm, with the keywords
   it was timed with, and runs exactly it from then on.
"""

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_bagua.engine.algorithms._auto_factors import LOW_RANK_MIN_RANK, steps_to_target
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    available_algorithms,
    check_positive_int,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.bytegrad import ByteGradAlgorithm
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from lightning_bagua.engine.algorithms.low_rank import LowRankAlgorithm
from lightning_bagua.engine.algorithms.low_rank._factors import plan_slot
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.telemetry import CommunicationTelemetry

__all__ = ["AutoAlgorithm", "AutoDecision", "AutoFigures", "decide", "describe_algorithm"]

log = logging.getLogger(__name__)

CANDIDATE_NAMES = ("gradient_allreduce", "bytegrad", "low_rank")
"""The algorithms ``auto`` can time during training: those that communicate DDP's gradient buckets and keep the
ranks' weights equal, so that switching between them at a step boundary is safe."""

DEFAULT_LOW_RANK = 16
"""The rank of the default ``low_rank`` candidate: the smallest within 1% of DDP's loss in the measured tables."""

# Message sizes for the link figures, in bytes: one latency-bound, one bandwidth-bound, from the smallest up to the
# model's gradients within the largest (an all-reduce of the gradients costs about a DDP step: it is never larger).
_SMALL_MESSAGE = 4 * 1024
_MIN_LARGE_MESSAGE = 16 * 1024
_FIRST_LARGE_MESSAGE = 64 * 1024
_LARGE_MESSAGE = 4 * 1024**2
_REPEATS = 3
# An all-reduce that takes this many times the small message's is mostly bytes over bandwidth: the fit stops there.
_BANDWIDTH_BOUND = 8
# The most timed steps per candidate, as a multiple of trial_steps, however short the steps.
_MAX_STEPS_PER_TRIAL = 8
# Where steps are short, the candidates predicted within this factor of the best one are timed for longer: a few
# steps' noise could put any of them first, where one further off would need a larger error to win.
_CLOSE = 1.5
# Where the run's length is known, measuring costs at most this share of its time beyond the best candidate's steps,
_RUN_SHARE = 0.05
# and takes at most this share of its steps, so that most of a short run is the pick's, whatever the candidates cost.
_RUN_STEP_SHARE = 0.25
# A trial step longer than this many times its candidate's median is a pause of the process, counted at that.
_PAUSE = 4
_CHECKPOINT_VERSION = 1


def describe_algorithm(algorithm: Algorithm) -> str:
    """Return a short, unambiguous label: the name and the keywords that tell candidates apart.

    Args:
        algorithm: a candidate.

    Returns:
        For example ``"gradient_allreduce"``, ``"bytegrad(hierarchical=False)"``,
        ``"low_rank(rank=16, hierarchical=True)"``.
    """
    if isinstance(algorithm, LowRankAlgorithm):
        return f"low_rank(rank={algorithm.rank}, hierarchical={algorithm.hierarchical})"
    if isinstance(algorithm, GradientAllReduceAlgorithm) and not algorithm.hierarchical:
        return "gradient_allreduce"
    return f"{algorithm.name}(hierarchical={algorithm.hierarchical})"


def _factor(algorithm: Algorithm) -> float:
    rank = algorithm.rank if isinstance(algorithm, LowRankAlgorithm) else None
    return steps_to_target(algorithm.name, rank)


@dataclass(eq=False)
class AutoFigures:
    """What ``auto`` decides from; measured during training, or given to make the decision reproducible.

    Args:
        step_s: each candidate's step time in seconds, by :func:`describe_algorithm` label (the maximum over
            ranks of each rank's median). Given whole (every candidate of the layout), no step is timed.
        links: per tier (``"all"``, ``"intra_node"``, ``"inter_node"``): ``{"latency_s": ..., "bandwidth_Bps": ...}``.
        gradient_bytes: the communicated gradients' bytes by dtype name.
        compress_s: what rank 0's device paid, per candidate label, for one step's compression work.
        skipped: candidates not timed, by label, with the reason.
    """

    step_s: dict[str, float] = field(default_factory=dict)
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    gradient_bytes: dict[str, int] = field(default_factory=dict)
    compress_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the figures as plain Python objects (for checkpoints and results files)."""
        return {
            "step_s": dict(self.step_s),
            "links": {tier: dict(values) for tier, values in self.links.items()},
            "gradient_bytes": dict(self.gradient_bytes),
            "compress_s": dict(self.compress_s),
            "skipped": dict(self.skipped),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AutoFigures":
        """Build figures from :meth:`to_dict`'s output."""
        return cls(
            **{key: dict(values.get(key, {})) for key in ("step_s", "links", "gradient_bytes", "compress_s", "skipped")}
        )


@dataclass
class AutoDecision:
    """What ``auto`` picked, from which figures, and why.

    Args:
        algorithm: the picked algorithm, as a user could have named it.
        label: its :func:`describe_algorithm` label.
        reason: one sentence.
        figures: the figures behind it.
        predicted_s: each timed candidate's predicted seconds per DDP step's worth of progress, ``T_c * f_c``.
        factors: each candidate's steps-to-target factor ``f_c``.
        world_size: the ranks it was decided for.
        layout: ``(nodes, ranks per node)`` it was decided for.
        trial_steps: the training steps spent measuring (0 when the figures were given or resumed).
        measure_s: the seconds rank 0 spent measuring: link figures, compression costs and trial steps (each from its
            forward to its optimizer step's end, at most 4 times its candidate's median, plus its candidate's usual time
            to the next forward, so that a validation loop, a checkpoint or a garbage collection is left out).
        excess_s: what measuring cost beyond the same progress at the pick's pace: the link timing and each trial
            step's time over the pick's for the progress it made (rank 0's clock; 0 when nothing was timed).
    """

    algorithm: Algorithm
    label: str
    reason: str
    figures: AutoFigures
    predicted_s: dict[str, float]
    factors: dict[str, float]
    world_size: int
    layout: tuple[int, int]
    trial_steps: int = 0
    measure_s: float = 0.0
    excess_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return the decision as plain Python objects: what checkpoints and results files store."""
        keywords = {key: getattr(self.algorithm, key) for key in self.algorithm.keywords()}
        return {
            "algorithm": self.algorithm.name,
            "keywords": keywords,
            "label": self.label,
            "reason": self.reason,
            "figures": self.figures.to_dict(),
            "predicted_s": dict(self.predicted_s),
            "factors": dict(self.factors),
            "world_size": self.world_size,
            "layout": list(self.layout),
            "trial_steps": self.trial_steps,
            "measure_s": self.measure_s,
            "excess_s": self.excess_s,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AutoDecision":
        """Build a decision from :meth:`to_dict`'s output."""
        return cls(
            algorithm=Algorithm.init(values["algorithm"], **values["keywords"]),
            label=values["label"],
            reason=values["reason"],
            figures=AutoFigures.from_dict(values["figures"]),
            predicted_s=dict(values["predicted_s"]),
            factors=dict(values["factors"]),
            world_size=int(values["world_size"]),
            layout=(int(values["layout"][0]), int(values["layout"][1])),
            trial_steps=int(values.get("trial_steps", 0)),
            measure_s=float(values.get("measure_s", 0.0)),
            excess_s=float(values.get("excess_s", 0.0)),
        )

    def metrics(self) -> dict[str, float]:
        """Return numbers for loggers, under ``bagua/auto/``: the predictions, step times, link figures."""
        metrics: dict[str, float] = {
            "bagua/auto/trial_steps": float(self.trial_steps),
            "bagua/auto/measure_s": self.measure_s,
            "bagua/auto/excess_s": self.excess_s,
        }
        for label, value in self.predicted_s.items():
            metrics[f"bagua/auto/predicted_s/{label}"] = value
            metrics[f"bagua/auto/picked/{label}"] = float(label == self.label)
        for label, value in self.figures.step_s.items():
            metrics[f"bagua/auto/step_s/{label}"] = value
        for tier, values in self.figures.links.items():
            for key, value in values.items():
                metrics[f"bagua/auto/link/{tier}/{key}"] = value
        return metrics

    def summary(self) -> str:
        """Return the log line: link figures, each candidate's step and predicted time to loss, the pick and why."""
        links = "; ".join(
            f"{tier} {_bandwidth_text(values['bandwidth_Bps'])}, {values['latency_s'] * 1e3:.2f} ms"
            for tier, values in self.figures.links.items()
        )
        gradients = ", ".join(f"{nbytes / 1e6:.2f} MB {dtype}" for dtype, nbytes in self.figures.gradient_bytes.items())
        candidates = "; ".join(
            f"{label}: {self.figures.step_s[label] * 1e3:.1f} ms/step x {self.factors[label]:.3g} steps"
            f" = {predicted * 1e3:.1f} ms"
            for label, predicted in self.predicted_s.items()
        )
        skipped = "; ".join(f"{label} ({why})" for label, why in self.figures.skipped.items())
        # A part with nothing behind it (one rank measures nothing; injected figures may leave links out) is left out.
        parts = [
            f"Bagua auto picked {self.label}: {self.reason}",
            f"Links: {links}." if links else "",
            f"Gradients: {gradients}." if gradients else "",
            f"Time to DDP's loss, per DDP step: {candidates}." if candidates else "",
            f"Not timed: {skipped}." if skipped else "",
            f"Measuring took {self.trial_steps} steps and {self.measure_s:.2f} s on rank 0, {self.excess_s:.2f} s"
            " more than the pick would have taken."
            if self.trial_steps or self.measure_s
            else "Nothing was measured.",
        ]
        return " ".join(part for part in parts if part)


def _bandwidth_text(bandwidth: float) -> str:
    if math.isinf(bandwidth):
        return "bandwidth beyond what the timed sizes resolve"
    return f"{bandwidth / 1e6:.1f} MB/s"


def decide(
    candidates: Sequence[Algorithm], figures: AutoFigures
) -> tuple[int, str, dict[str, float], dict[str, float]]:
    """Pick the candidate that reaches DDP's loss first, from the figures alone (deterministic).

    Args:
        candidates: the candidates, ``gradient_allreduce`` (flat) first.
        figures: with ``step_s`` for the candidates that were timed, and ``skipped`` for those that were not (an
            untimed ``gradient_allreduce`` lost by its link bound).

    Returns:
        The index of the pick, the reason, each timed candidate's predicted time ``T_c * f_c``, and the factors.
    """
    labels = [describe_algorithm(candidate) for candidate in candidates]
    factors = {label: _factor(candidate) for label, candidate in zip(labels, candidates, strict=True)}
    predicted = {label: figures.step_s[label] * factors[label] for label in labels if label in figures.step_s}
    baseline = labels[0]
    if baseline not in predicted:
        if not predicted or baseline not in figures.skipped:
            return 0, "gradient_allreduce was not timed, so nothing could be compared with it.", predicted, factors
        # Skipped because its bytes at the link's bandwidth alone lose to a measured candidate: that one beats it.
        best = min(predicted, key=lambda label: (predicted[label], labels.index(label)))
        return (
            labels.index(best),
            f"it reaches DDP's loss first of those timed (step {figures.step_s[best] * 1e3:.1f} ms,"
            f" {factors[best]:.4g}x DDP's steps), and gradient_allreduce's gradients alone take longer over the link.",
            predicted,
            factors,
        )
    best = min(predicted, key=lambda label: (predicted[label], labels.index(label)))
    if best == baseline or predicted[best] >= predicted[baseline]:
        return 0, "nothing measured reaches DDP's loss sooner than gradient_allreduce.", predicted, factors
    ratio = predicted[best] / predicted[baseline]
    return (
        labels.index(best),
        f"it reaches DDP's loss in {ratio:.3g}x gradient_allreduce's time (step {figures.step_s[best] * 1e3:.1f} ms"
        f" against {figures.step_s[baseline] * 1e3:.1f} ms, {factors[best]:.4g}x DDP's steps).",
        predicted,
        factors,
    )


@dataclass
class _DispatchState:
    """The state DDP hands the dispatching hook: the current algorithm's own state and hook."""

    state: Any
    hook: CommunicationHook


def _dispatch_hook(state: _DispatchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.hook(state.state, bucket)


class AutoImpl(AlgorithmImpl):
    """:class:`AutoAlgorithm` bound to one wrapped model: it measures, then delegates everything to its pick."""

    def __init__(self, algorithm: "AutoAlgorithm", context: AlgorithmContext) -> None:
        self._current: AlgorithmImpl | None = None
        self._step_hooks: list[RemovableHandle] = []
        super().__init__(algorithm, context)
        self.auto = algorithm
        groups = context.groups
        self.layout = (groups.layout.num_nodes, groups.layout.ranks_per_node)
        self.candidates = algorithm.candidates_for(groups.layout.num_nodes, groups.layout.ranks_per_node)
        self.labels = [describe_algorithm(candidate) for candidate in self.candidates]
        self.decision: AutoDecision | None = None
        self._optimizers: list[Optimizer] = []
        self._started = False
        self._figures = AutoFigures()
        self.run_steps = algorithm.run_steps
        self._trying = 0  # the candidate on trial
        self._steps_here = 0  # steps it has run (the first after a switch is not timed)
        self._timed_steps = algorithm.trial_steps  # the timed steps the candidate on trial reaches
        self._queue: list[int] | None = None  # rank 0: the candidates still to try, the most promising first
        self._close: list[int] | None = None  # rank 0, once all were tried: the close ones still to time for longer
        self._outbound: list[int] = []  # rank 0: the candidates skipped because their bound lost
        self._times: dict[int, list[float]] = {}  # each candidate's timed steps, forward to optimizer step
        self._gaps: dict[int, list[float]] = {}  # each candidate's times from an optimizer step to the next forward
        self._last_boundary: float | None = None
        self._step_end: float | None = None  # when the last optimizer step ended, while measuring
        self._trial_steps = 0
        self._start_up_s = 0.0  # the link and compression timing, which trains nothing
        self._codec_load_s = 0.0  # the codec's first use: a cost of any compressing method, auto's pick or not
        # Each candidate's trial steps' seconds, untimed too, forward to optimizer step (its usual gap apart).
        self._spent: dict[int, list[float]] = {}
        self._current = self._reify(0, trial=True)
        self._dispatch = _DispatchState(*self.current.communication_hook())
        if groups.world_size == 1:
            self._adopt(0, "one rank has nothing to communicate, so gradient_allreduce costs what DDP does.", {}, {})
        elif algorithm.figures is not None and all(label in algorithm.figures.step_s for label in self.labels):
            self._figures = self._given_figures()
            self._decide_and_adopt()

    # The wrapper reads the hook once; the dispatching one follows every switch. At world size 1 the pick is made
    # before, and its own hook goes to DDP, so the step costs what the algorithm named directly costs.
    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the hook that runs the current candidate's (the pick's, once decided)."""
        if self.context.groups.world_size == 1:
            return self.current.communication_hook()
        return self._dispatch, _dispatch_hook

    def use_run_length(self, steps: float) -> None:
        """Bound the measuring by the run's length, unless ``run_steps`` was given: at most 5% of its time.

        Args:
            steps: the run's training steps (``float("inf")`` when unknown, which leaves the budget as it is).
        """
        if self.run_steps is None and math.isfinite(steps) and steps >= 1:
            self.run_steps = int(steps)

    @property
    def current(self) -> AlgorithmImpl:
        """The implementation running now: a candidate on trial, or the pick."""
        assert self._current is not None
        return self._current

    @property
    def telemetry(self) -> CommunicationTelemetry | None:
        """The wrapper's telemetry; the current implementation gets it too."""
        return self._telemetry

    @telemetry.setter
    def telemetry(self, value: CommunicationTelemetry | None) -> None:
        self._telemetry = value
        if self._current is not None:
            self.current.telemetry = value

    def on_forward_start(self, synchronizing: bool) -> None:
        """Time the step that just ended, switch candidates where the schedule says, and decide when it is done."""
        if self.decision is None and synchronizing:
            self._trial_boundary()
        self.current.on_forward_start(synchronizing)

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Remember the optimizers, hand them to the current implementation, and note when each of their steps ends."""
        self._optimizers = list(optimizers)
        self.current.bind_optimizers(self._optimizers)
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = [optimizer.register_step_post_hook(self._note_step_end) for optimizer in self._optimizers]

    def on_optimizer_step(self, optimizer: Optimizer) -> None:
        """Hand the step to the current implementation; while measuring, note when the step's work ended.

        A strategy calls it for a step the gradient scaler skipped too, which ran no optimizer hook.
        """
        self.current.on_optimizer_step(optimizer)
        self._note_step_end()

    def start(self) -> None:
        """Start the current implementation's work (none for the gradient-bucket candidates)."""
        self._started = True
        self.current.start()

    @property
    def started(self) -> bool:
        """Whether the current implementation's work is on."""
        return self.current.started

    def stop(self, wait: bool = True) -> None:
        """Stop the current implementation's work."""
        self._started = False
        self.current.stop(wait)

    def telemetry_phase(self) -> dict[str, float]:
        """Return the current implementation's phase, with ``auto/measuring`` (1.0 while candidates are timed)."""
        return {**self.current.telemetry_phase(), "auto/measuring": float(self.decision is None)}

    def state_dict(self) -> dict[str, Any]:
        """Return the decision with its figures and the pick's own state (nothing but the layout before the pick)."""
        return {
            "version": _CHECKPOINT_VERSION,
            "world_size": self.context.groups.world_size,
            "layout": list(self.layout),
            "decision": None if self.decision is None else self.decision.to_dict(),
            "state": self.current.state_dict() if self.decision is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the saved pick on the same layout; elsewhere, drop the pick's state (with a warning) and decide again.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is not one :meth:`state_dict` wrote.
        """
        if not isinstance(state, dict) or state.get("version") != _CHECKPOINT_VERSION or "decision" not in state:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"Algorithm 'auto': the saved state must come from auto's state_dict (version {_CHECKPOINT_VERSION}),"
                f" got {found}. Was the checkpoint written with another algorithm?"
            )
        saved = state["decision"]
        if saved is None:
            return  # saved while measuring: measuring starts again here
        decision = AutoDecision.from_dict(saved)
        groups = self.context.groups
        same = decision.world_size == groups.world_size and decision.layout == self.layout
        if same and decision.label in self.labels:
            self._switch(self.labels.index(decision.label), trial=False)
            self.decision = decision
            self.current.load_state_dict(state["state"])
            if groups.rank == 0:
                log.info("Bagua auto resumes with its saved pick, %s.", decision.label)
            return
        if groups.rank == 0:
            dropped = sorted(state["state"]) if state["state"] else []
            log.warning(
                "Bagua auto: the checkpoint's pick, %s, was made for %d ranks laid out %dx%d, and this run has %d"
                " laid out %dx%d: auto measures and decides again.%s",
                decision.label,
                decision.world_size,
                *decision.layout,
                groups.world_size,
                *self.layout,
                f" The saved {decision.label} state is dropped: {', '.join(dropped)}." if dropped else "",
            )
        if self.decision is not None and groups.world_size > 1:
            self.decision = None
            self._restart_trials()

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Return this rank's state for a run of another world size: the decision, without the pick's state.

        The decision records the world size it was made for, so :meth:`load_state_dict` decides again and names
        the dropped state; rank 0's saved state stands for every rank's.

        Args:
            saved: every rank's :meth:`state_dict` from the run that saved.

        Returns:
            This rank's state.
        """
        if not saved:
            return {}
        rank = self.context.groups.rank
        return dict(saved[rank] if len(saved) == self.context.groups.world_size else saved[0])

    def close(self) -> None:
        """Close the current implementation and remove the optimizer hooks."""
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        self.current.close()

    # -- measuring and deciding -----------------------------------------------------------------------------------

    def _note_step_end(self, *_: Any) -> None:
        if self.decision is None:
            self._step_end = _clock()

    def _reify(self, index: int, trial: bool) -> AlgorithmImpl:
        candidate = self.candidates[index]
        if trial and isinstance(candidate, LowRankAlgorithm):
            # Timed in the phase it would run in: its full-precision warm-up steps are gradient_allreduce's.
            candidate = LowRankAlgorithm(
                rank=candidate.rank,
                warmup_steps=0,
                hierarchical=candidate.hierarchical,
                average=candidate.average,
                alternate=candidate.alternate,
                whole_step=candidate.whole_step,
            )
        context = self.context
        if not candidate.hierarchical and context.groups.is_hierarchical:
            context = replace(context, groups=replace(context.groups, intra_node=None, inter_node=None, _owned=[]))
        impl = candidate.reify(context)
        impl.telemetry = self.telemetry
        return impl

    def _switch(self, index: int, trial: bool) -> None:
        previous = self.current
        if previous.started:
            previous.stop()
        previous.close()
        self._current = self._reify(index, trial)
        self.current.bind_optimizers(self._optimizers)
        if self._started:
            self.current.start()
        self._dispatch.state, self._dispatch.hook = self.current.communication_hook()

    def _given_figures(self) -> AutoFigures:
        given = self.auto.figures
        return AutoFigures() if given is None else AutoFigures.from_dict(given.to_dict())

    def _restart_trials(self) -> None:
        self._trying, self._steps_here, self._timed_steps, self._queue = 0, 0, self.auto.trial_steps, None
        self._close = None
        self._times, self._gaps, self._last_boundary, self._step_end, self._trial_steps = {}, {}, None, None, 0
        self._start_up_s, self._codec_load_s, self._spent = 0.0, 0.0, {}
        self._figures = self._given_figures()
        self._switch(0, trial=True)

    def _trial_boundary(self) -> None:
        now, ended, self._step_end = _clock(), self._step_end, None
        if self._last_boundary is None:
            self._measure_start_up()
            first = self._next_everywhere()
            if first is None:
                self._decide_and_adopt()
            else:
                self._go_to(first)
            self._last_boundary = _clock()
            return
        # What ran after the optimizer step (data loading, and at times a validation loop or a checkpoint) is apart
        # from the step: each candidate's usual gap stands for it. A step whose end went unseen counts whole.
        index, elapsed = self._trying, now - self._last_boundary
        if ended is not None and ended >= self._last_boundary:
            elapsed = ended - self._last_boundary
            self._gaps.setdefault(index, []).append(now - ended)
        self._trial_steps += 1
        self._spent.setdefault(index, []).append(elapsed)
        if self._steps_here > 0:  # the first step after a switch settles it (buffers, factors) and is not timed
            self._times.setdefault(index, []).append(elapsed)
        self._steps_here += 1
        if len(self._times.get(index, [])) >= self._timed_steps:
            self._record(index)
            following = self._next_everywhere()
            if following is None:
                self._decide_and_adopt()
            elif following != index:  # the same one again times more of its steps, with no switch to settle
                self._go_to(following)
        self._last_boundary = _clock()

    def _go_to(self, index: int) -> None:
        if index != self._trying:
            self._switch(index, trial=True)
        self._trying, self._steps_here = index, 0

    def _measure_start_up(self) -> None:
        groups = self.context.groups
        if any(_compresses(candidate) for candidate in self.candidates):
            # Every rank loads the codec's backend here, before any step is timed, and the barrier waits for the
            # slowest: a compressing method pays this once, at its first step, whether auto or the user picked it.
            loading = _clock()
            MinMaxUInt8Codec().compress(torch.zeros(64, device=self.context.device))
            dist.barrier(group=groups.flat)
            self._codec_load_s = _clock() - loading
        started = _clock()
        self._figures = self._given_figures()  # what was given is not measured
        self._figures.step_s = {}
        self._figures.gradient_bytes = self._figures.gradient_bytes or _gradient_bytes(self.context)
        total = sum(self._figures.gradient_bytes.values())
        large = max(_MIN_LARGE_MESSAGE, min(_LARGE_MESSAGE, total))
        if not self._figures.links:
            self._figures.links = self._time_links(large)
        if groups.rank == 0:
            # The flat and hierarchical forms of a method compress the same gradients: their work is timed once.
            timed: dict[tuple[str, int], float] = {}
            for index, candidate in enumerate(self.candidates[1:], start=1):
                if self.labels[index] not in self._figures.compress_s:
                    work = _compression_work(candidate)
                    if work not in timed:
                        timed[work] = _compression_cost(candidate, self.context)
                    self._figures.compress_s[self.labels[index]] = timed[work]
        self._start_up_s = _clock() - started

    def _time_links(self, large: int) -> dict[str, dict[str, float]]:
        groups, device = self.context.groups, self.context.device
        links = {"all": _time_link(groups.flat, large, device)}
        if groups.is_hierarchical:
            assert groups.intra_node is not None
            links["intra_node"] = _time_link(groups.intra_node, large, device)
            if groups.inter_node is not None:
                links["inter_node"] = _time_link(groups.inter_node, large, device)
            else:
                links["inter_node"] = {"latency_s": math.nan, "bandwidth_Bps": math.nan}
            # Only the leaders measured the inter-node tier: rank 0, a leader, holds its figures.
            dist.barrier(group=groups.flat)
        return links

    def _record(self, index: int) -> None:
        """Record the candidate's step: the slowest rank's median, with its usual gap to the next step."""
        step = statistics.median(self._times[index]) + self._usual_gap_s(index)
        self._figures.step_s[self.labels[index]] = self._max_over_ranks([step])[0]

    def _usual_gap_s(self, index: int) -> float:
        """The median time from the candidate's optimizer steps to the next forward (0 where none was reported)."""
        gaps = self._gaps.get(index)
        return statistics.median(gaps) if gaps else 0.0

    def _spent_s(self, index: int) -> float:
        """What the candidate's trial steps took, each with its usual gap to the next step.

        A step over :data:`_PAUSE` times the candidate's median counts as that: a pause of the process (a full
        garbage collection takes a few hundred milliseconds in a process that has imported torch) meets any
        method's steps alike, the pick's too, so it is no cost of measuring.
        """
        timed = self._times.get(index)
        longest = _PAUSE * statistics.median(timed) if timed else math.inf
        spent = self._spent[index]
        return sum(min(seconds, longest) for seconds in spent) + len(spent) * self._usual_gap_s(index)

    def _next_everywhere(self) -> int | None:
        """Rank 0 says what runs next (``None``: nothing, decide) and the timed steps per candidate, for every rank."""
        groups = self.context.groups
        order = torch.tensor([-1, self._timed_steps], dtype=torch.int64)
        if groups.rank == 0:
            order = torch.tensor(self._next_trial(), dtype=torch.int64)
        dist.broadcast(order, src=groups.global_ranks[0], group=groups.flat)
        self._timed_steps = int(order[1])
        return None if order[0] < 0 else int(order[0])

    def _next_trial(self) -> tuple[int, int]:
        """Rank 0: the next candidate to time (-1: none) and the timed steps it is to reach.

        First every candidate, the most promising by its lower bound first, for ``trial_steps``: one whose bound
        already loses to the best time to DDP's loss measured so far is skipped, and so is one past the budget,
        with why. Then, where steps are short, the candidates within :data:`_CLOSE` of the best are timed for
        longer, as the budget allows. Last, the bounds that lost are held against the final figures: the longer
        timing can raise the best one's step, and lower the compute that bounds the others. A candidate whose
        bound no longer loses goes back on trial, and the close ones are timed again; the others' reasons are
        stated in the final figures, the ones the log line gives.
        """
        if self._queue is None:
            self._queue = sorted(range(len(self.candidates)), key=lambda index: (self._bound(index)[0], index))
            self._outbound = []
        predicted = self._predicted()
        best = self._best()
        trial = self.auto.trial_steps
        while self._queue:
            index = self._queue.pop(0)
            label = self.labels[index]
            # Room for gradient_allreduce, the fallback, stays until it has run or lost by its bound.
            keep_fallback = index != 0 and 0 in self._queue and self._could_win(0)
            needed = (trial + 1) * (2 if keep_fallback else 1)
            cost = (trial + 1) * (self._step_excess_s(index) + (self._step_excess_s(0) if keep_fallback else 0.0))
            allowance = self._allowance_s()
            # The codec's loading is no cost of timing a compressing candidate: if it wins, it would have paid it.
            spent = self._excess_s(compressing_wins=_compresses(self.candidates[index]))
            if not self._could_win(index):
                self._outbound.append(index)
                self._figures.skipped[label] = self._bound_lost(index)
            elif self._step_budget() - self._trial_steps < needed:
                self._figures.skipped[label] = f"past the budget of {self._step_budget()} measuring steps"
            elif index != 0 and spent + cost > allowance:
                assert best is not None  # the allowance is finite: a step was timed
                assert self.run_steps is not None
                self._figures.skipped[label] = (
                    f"past the allowance of {allowance * 1e3:.1f} ms beyond the best candidate's steps (5% of"
                    f" {self.run_steps} steps of {self._figures.step_s[best] * 1e3:.1f} ms): measuring had cost"
                    f" {spent * 1e3:.1f} ms"
                    + (f", and its {trial + 1} steps would cost at least {cost * 1e3:.1f} ms more" if cost > 0 else "")
                )
            else:
                return index, trial
        if self._close is None:
            assert best is not None  # the first candidate always runs
            close = [index for index, label in enumerate(self.labels) if label in predicted and self._is_close(label)]
            # The one on trial first: it goes on with no switch to settle.
            self._close = sorted(close, key=lambda index: (index != self._trying, predicted[self.labels[index]], index))
        while self._close:
            index = self._close.pop(0)
            steps = self._longer_steps(index)
            if steps > len(self._times[index]):
                return index, steps
        revived = [index for index in self._outbound if self._could_win(index)]
        if revived:
            self._outbound = [index for index in self._outbound if index not in revived]
            for index in revived:
                del self._figures.skipped[self.labels[index]]
            self._queue, self._close = revived, None
            return self._next_trial()
        for index in self._outbound:
            self._figures.skipped[self.labels[index]] = self._bound_lost(index)
        return -1, trial

    def _bound_lost(self, index: int) -> str:
        """Why a candidate is not timed: its lower bound loses to the best one's measured time to DDP's loss."""
        best = self._best()
        assert best is not None  # a bound loses only to a measured step
        (bound, binding), factor = self._bound(index), _factor(self.candidates[index])
        return (
            f"even at its {binding} bound, {factor:.4g}x steps of {bound * 1e3 / factor:.1f} ms each lose to"
            f" {best}'s {self._predicted()[best] * 1e3:.1f} ms per DDP step"
        )

    def _longer_steps(self, index: int) -> int:
        """The timed steps a close candidate is to reach: as many as fill ``min_trial_s``, within the budget.

        At most :data:`_MAX_STEPS_PER_TRIAL` times ``trial_steps``; at most an even share of the steps
        ``max_trial_steps`` leaves among the close candidates still to go (a switch's untimed step counted); and,
        where the run's length is known, at most what the time allowance leaves at its measured excess per step.
        A candidate no longer within :data:`_CLOSE` of the best keeps the steps it has.
        """
        label, done = self.labels[index], len(self._times[index])
        assert self._close is not None
        if not self._is_close(label):
            return done
        step = self._figures.step_s[label]
        settle = 0 if index == self._trying else 1
        steps = math.ceil(self.auto.min_trial_s / step) if step > 0 else done
        steps = min(steps, _MAX_STEPS_PER_TRIAL * self.auto.trial_steps)
        share = (self._step_budget() - self._trial_steps) // (1 + len(self._close))
        steps = min(steps, done - settle + share)
        per_step = self._beyond_pace_s(index, step)
        room = self._allowance_s() - self._excess_s()
        if per_step > 0 and math.isfinite(room):
            steps = min(steps, done - settle + math.floor(room / per_step))
        return steps

    def _step_budget(self) -> int:
        """The most training steps measuring may take: ``max_trial_steps``, and a quarter of ``run_steps`` if known.

        Never fewer than the first candidate's and gradient_allreduce's ``trial_steps + 1`` each.
        """
        budget = self.auto.max_trial_steps
        if self.run_steps is not None:
            budget = min(budget, max(2 * (self.auto.trial_steps + 1), int(self.run_steps * _RUN_STEP_SHARE)))
        return budget

    def _predicted(self) -> dict[str, float]:
        """Each timed candidate's predicted time to DDP's loss per DDP step, ``T_c * f_c``."""
        return {label: step * self._factor_of(label) for label, step in self._figures.step_s.items()}

    def _best(self) -> str | None:
        """The timed candidate that reaches DDP's loss first (the earlier one on a tie), if any was timed."""
        predicted = self._predicted()
        return min(predicted, key=lambda label: (predicted[label], self.labels.index(label)), default=None)

    def _is_close(self, label: str) -> bool:
        """Whether a timed candidate is within :data:`_CLOSE` of the best one's time to DDP's loss."""
        predicted = self._predicted()
        return predicted[label] <= _CLOSE * min(predicted.values())

    def _could_win(self, index: int) -> bool:
        best = self._best()
        return best is None or self._bound(index)[0] < self._predicted()[best]

    def _allowance_s(self) -> float:
        """What measuring may cost beyond the best candidate's pace: 5% of the run at its step.

        Unbounded until a step is timed, and where the run's length is unknown.
        """
        best = self._best()
        if self.run_steps is None or best is None:
            return math.inf
        return _RUN_SHARE * self.run_steps * self._figures.step_s[best]

    def _excess_s(self, compressing_wins: bool = False) -> float:
        """What measuring has cost so far beyond the best candidate's pace.

        The link timing trains nothing and counts whole; so does the codec's loading, unless the best candidate
        compresses (or ``compressing_wins``: one about to be timed might): that one would have paid it anyway. Each
        trial step, its candidate's untimed first one included, costs what it took beyond the best one's pace.
        """
        best = self._best()
        sunk = self._start_up_s
        if not (compressing_wins or (best is not None and _compresses(self.candidates[self.labels.index(best)]))):
            sunk += self._codec_load_s
        spent = sum(
            len(spent) * self._beyond_pace_s(index, self._spent_s(index) / len(spent))
            for index, spent in self._spent.items()
        )
        return sunk + spent

    def _step_excess_s(self, index: int) -> float:
        """At least what one trial step of a candidate not yet timed would cost beyond the best one's pace."""
        return self._beyond_pace_s(index, self._bound(index)[0] / _factor(self.candidates[index]))

    def _beyond_pace_s(self, index: int, step: float) -> float:
        """What a step of the candidate taking ``step`` costs beyond the best one's pace for the progress it makes.

        The step makes ``1 / f_c`` of a DDP step's progress, which the best candidate makes in ``T_best * f_best /
        f_c``. 0 before any step is timed.
        """
        best = self._best()
        if best is None:
            return 0.0
        return max(step - self._predicted()[best] / _factor(self.candidates[index]), 0.0)

    def _factor_of(self, label: str) -> float:
        return _factor(self.candidates[self.labels.index(label)])

    def _bound(self, index: int) -> tuple[float, str]:
        """A lower bound of the candidate's time to DDP's loss per DDP step, and what binds it (compute or link).

        A step takes at least the larger of its compute and its communication: the compute is at most what
        gradient_allreduce's step leaves after its communication (0 before it has run), plus this candidate's
        compression; the communication is its bytes at the measured bandwidth of the tier its exchange
        crosses, latency left out. ``gradient_allreduce``, the fallback, is bounded by its link alone.
        """
        comm = self._link_s(index, latency=False)
        compute = 0.0 if index == 0 else self._compute_floor() + self._figures.compress_s.get(self.labels[index], 0.0)
        factor = _factor(self.candidates[index])
        return (factor * compute, "compute") if compute >= comm else (factor * comm, "link")

    def _compute_floor(self) -> float:
        """The step's compute at most: gradient_allreduce's step less its communication (0 until it has run).

        Only its step: its communication is its bytes over the fitted link, where a compressing candidate's step
        holds work the link figures do not model (packing, several collectives), which would overstate the compute.
        """
        step = self._figures.step_s.get(self.labels[0])
        return 0.0 if step is None else max(step - self._link_s(0, latency=True), 0.0)

    def _link_s(self, index: int, latency: bool) -> float:
        """The candidate's bytes over the bandwidth of the tier its exchange crosses (0 where it was not measured)."""
        groups, candidate = self.context.groups, self.candidates[index]
        links = self._figures.links
        tier = links.get("inter_node", {}) if candidate.hierarchical and groups.is_hierarchical else links["all"]
        bandwidth, delay = tier.get("bandwidth_Bps", math.nan), tier.get("latency_s", 0.0)
        if not (bandwidth > 0 and math.isfinite(bandwidth)):
            return 0.0
        sent = _exchanged_bytes(candidate, self.context, self._figures.gradient_bytes)
        return sent / bandwidth + (delay if latency and math.isfinite(delay) else 0.0)

    def _decide_and_adopt(self) -> None:
        groups = self.context.groups
        index, reason, predicted, factors = decide(self.candidates, self._figures)
        # Rank 0's decision is everyone's: one broadcast settles any difference the figures might hold.
        choice = torch.tensor([index], dtype=torch.int64)
        dist.broadcast(choice, src=groups.global_ranks[0], group=groups.flat)
        self._adopt(int(choice.item()), reason, predicted, factors)

    def _adopt(self, index: int, reason: str, predicted: dict[str, float], factors: dict[str, float]) -> None:
        self._switch(index, trial=False)
        self.decision = AutoDecision(
            algorithm=self.candidates[index],
            label=self.labels[index],
            reason=reason,
            figures=self._figures,
            predicted_s=predicted,
            factors=factors,
            world_size=self.context.groups.world_size,
            layout=self.layout,
            trial_steps=self._trial_steps,
            measure_s=self._start_up_s + self._codec_load_s + sum(self._spent_s(index) for index in self._spent),
            excess_s=self._excess_s() if self._spent else 0.0,
        )
        if self.context.groups.rank == 0:
            log.info("%s", self.decision.summary())

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.context.groups.flat)
        return tensor.tolist()


@register_algorithm("auto")
class AutoAlgorithm(Algorithm):
    """Measure the link and the model during the first steps, then run the algorithm that reaches DDP's loss first.

    Every rank runs the same algorithm: rank 0 decides from the measured figures and broadcasts its pick. The pick
    is one a user could have named (``gradient_allreduce``, ``bytegrad`` or ``low_rank`` with a rank, flat or
    hierarchical); it is logged once from rank 0, kept in checkpoints, and exposed as the implementation's
    ``decision``. Where nothing measured beats it, the pick is ``gradient_allreduce``.

    Args:
        candidates: what to choose among: names from ``gradient_allreduce``, ``bytegrad``, ``low_rank`` (at rank 16)
            or configured instances of those algorithms (``LowRankAlgorithm(rank=32, hierarchical=False)``). A name
            stands for its flat and, on several nodes of several ranks, its hierarchical form. ``gradient_allreduce``
            is always timed, as the baseline. ``None``: the three, the methods whose final loss was within 1% of
            DDP's at equal steps in the project's tables.
        trial_steps: the fewest timed steps per candidate (each candidate after one untimed step that settles the
            switch).
        max_trial_steps: the most training steps the measurement may take, all candidates together; candidates
            past it are not timed, the least promising first. 48 by default: 4.8% of a 1,000-step run at most.
        min_trial_s: where a candidate within 1.5x of the best one's time to DDP's loss took less for its
            ``trial_steps``, it is timed for as many steps as fill about this many seconds (within an even share
            of the steps left and of the time allowance), so that a millisecond of noise on millisecond steps
            cannot flip the pick. Steps of ``min_trial_s / trial_steps`` or more (83 ms by default) are timed
            ``trial_steps`` times.
        figures: figures to decide from instead of measuring (for tests and reproductions); with a step time for
            every candidate no step is timed and the pick is made when the model is wrapped.
        run_steps: the run's training steps, where known: measuring then costs at most 5% of the run's time beyond
            what the best candidate timed so far would have taken for the same progress (the link timing counted
            whole; the first candidate's ``trial_steps + 1`` steps always run). The Trainer strategy passes the
            Trainer's estimated steps when this is ``None``; without either, only ``max_trial_steps`` bounds it.
    """

    impl_class = AutoImpl
    resize_effect = "the saved pick and its state are dropped, and auto measures and decides again for the new layout"
    # The two-level groups are created so that the hierarchical candidates can run; whether one runs is measured.
    hierarchical = True
    warns_about_node_layout = False

    def __init__(
        self,
        candidates: Sequence[str | Algorithm] | None = None,
        trial_steps: int = 3,
        max_trial_steps: int = 48,
        min_trial_s: float = 0.25,
        figures: AutoFigures | None = None,
        run_steps: int | None = None,
    ) -> None:
        check_positive_int(self.name, "trial_steps", trial_steps)
        if run_steps is not None:
            check_positive_int(self.name, "run_steps", run_steps)
        check_positive_int(self.name, "max_trial_steps", max_trial_steps)
        if isinstance(min_trial_s, bool) or not isinstance(min_trial_s, (int, float)) or not min_trial_s >= 0:
            raise ValueError(
                f"Algorithm 'auto': `min_trial_s` must be a number of seconds >= 0, got {min_trial_s!r}. Pass 0 to"
                " time exactly trial_steps steps per candidate."
            )
        if max_trial_steps < trial_steps + 1:
            raise ValueError(
                f"Algorithm 'auto': `max_trial_steps={max_trial_steps}` leaves no room for gradient_allreduce's"
                f" {trial_steps + 1} steps (trial_steps={trial_steps} plus one that settles the switch). Pass"
                f" max_trial_steps of at least {trial_steps + 1}, or fewer trial_steps."
            )
        if figures is not None and not isinstance(figures, AutoFigures):
            raise TypeError(f"Algorithm 'auto': `figures` must be an AutoFigures, got {type(figures).__name__}.")
        if candidates is not None and (
            isinstance(candidates, (str, Algorithm)) or not isinstance(candidates, Sequence)
        ):
            one = isinstance(candidates, (str, Algorithm))
            example = f"[{candidates!r}]" if one else "['bytegrad', 'low_rank']"
            raise TypeError(
                f"Algorithm 'auto': `candidates` must be a list of names or algorithms, got {candidates!r}. Pass e.g."
                f" candidates={example}."
            )
        self.candidates = None if candidates is None else tuple(_check_candidate(value) for value in candidates)
        self.trial_steps = trial_steps
        self.max_trial_steps = max_trial_steps
        self.min_trial_s = float(min_trial_s)
        self.figures = figures
        self.run_steps = run_steps

    def candidates_for(self, num_nodes: int, ranks_per_node: int) -> list[Algorithm]:
        """Return the candidates for a layout, flat ``gradient_allreduce`` first and no two alike.

        Args:
            num_nodes: nodes in the layout.
            ranks_per_node: ranks on each node.

        Returns:
            The candidates.
        """
        two_level = num_nodes > 1 and ranks_per_node > 1
        given = self.candidates if self.candidates is not None else CANDIDATE_NAMES
        built: list[Algorithm] = [GradientAllReduceAlgorithm(hierarchical=False)]
        for value in given:
            if isinstance(value, Algorithm):
                forms = [value]
            else:
                forms = [
                    _named_candidate(value, hierarchical) for hierarchical in ((False, True) if two_level else (False,))
                ]
            for form in forms:
                if form not in built:
                    built.append(form)
        return built


def _named_candidate(name: str, hierarchical: bool) -> Algorithm:
    if name == "low_rank":
        return LowRankAlgorithm(rank=DEFAULT_LOW_RANK, hierarchical=hierarchical)
    if name == "bytegrad":
        return ByteGradAlgorithm(hierarchical=hierarchical)
    return GradientAllReduceAlgorithm(hierarchical=hierarchical)


def _check_candidate(value: Any) -> str | Algorithm:
    valid = ", ".join(CANDIDATE_NAMES)
    if isinstance(value, str):
        if value not in CANDIDATE_NAMES:
            others = [name for name in available_algorithms() if name not in (*CANDIDATE_NAMES, AutoAlgorithm.name)]
            what = "is not a candidate" if value in others else "is an unknown candidate"
            raise ValueError(
                f"Algorithm 'auto': {value!r} {what}. Candidates are {valid} (or instances of their algorithms). The"
                f" other algorithms ({', '.join(others)}) change the weights or the optimizer, so auto cannot switch"
                " away from them after timing them: name one directly, e.g. BaguaStrategy(algorithm='qadam', ...)."
            )
        return value
    if isinstance(value, (GradientAllReduceAlgorithm, ByteGradAlgorithm, LowRankAlgorithm)):
        if isinstance(value, LowRankAlgorithm) and value.rank < LOW_RANK_MIN_RANK:
            raise ValueError(
                f"Algorithm 'auto': candidate {value!r} has rank {value.rank}, and low_rank below rank"
                f" {LOW_RANK_MIN_RANK} did not reach DDP's loss within 1% in the measured tables, so auto has no"
                f" convergence figure for it. Pass rank >= {LOW_RANK_MIN_RANK}, or name low_rank directly."
            )
        return value
    raise ValueError(
        f"Algorithm 'auto': candidate {value!r} ({type(value).__name__}) is not one auto can time. Candidates are"
        f" {valid}, by name or as instances of their algorithms."
    )


def _gradient_bytes(context: AlgorithmContext) -> dict[str, int]:
    by_dtype: dict[str, int] = {}
    for _, parameter in context.named_parameters:
        key = str(parameter.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + parameter.numel() * parameter.element_size()
    return by_dtype


def _time_link(group: dist.ProcessGroup, large: int, device: torch.device) -> dict[str, float]:
    """Fit ``t(s) = latency + s / bandwidth`` to the medians of a few all-reduces of two sizes on ``group``.

    One size is latency-bound (4 KiB). The other starts at 64 KiB (or ``large``, if smaller) and grows 4x at a time
    up to ``large``, stopping at the first that takes :data:`_BANDWIDTH_BOUND` times the small one: on a slow link a
    small message already measures the bandwidth, where a gradient-sized one would cost several training steps per
    call. Every rank reads the slowest rank's medians, so that all take the same sizes. Where the larger message
    takes no longer than the small one, the bandwidth is infinite: its bytes bound no candidate.
    """
    small_s = _all_reduce_s(group, _SMALL_MESSAGE, device, connect=True)
    size = min(_FIRST_LARGE_MESSAGE, large)
    size_s = _all_reduce_s(group, size, device)
    while size < large and size_s < _BANDWIDTH_BOUND * small_s:
        size = min(4 * size, large)
        size_s = _all_reduce_s(group, size, device)
    if size_s <= small_s:
        # The larger message took no longer: at these sizes the link's bytes cost nothing measurable.
        return {"latency_s": small_s, "bandwidth_Bps": math.inf}
    per_byte = (size_s - small_s) / (size - _SMALL_MESSAGE)
    return {"latency_s": max(small_s - _SMALL_MESSAGE * per_byte, 0.0), "bandwidth_Bps": 1.0 / per_byte}


def _all_reduce_s(group: dist.ProcessGroup, size: int, device: torch.device, connect: bool = False) -> float:
    """The slowest rank's median time of an all-reduce of ``size`` bytes on ``group``.

    With ``connect``, a first untimed call sets up the path; later sizes reuse it and need none.
    """
    tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
    median = _timed(lambda: dist.all_reduce(tensor, group=group), device, warm_up=connect)
    slowest = torch.tensor([median], dtype=torch.float64, device=device)  # as the step times' maximum
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def _exchanged_bytes(candidate: Algorithm, context: AlgorithmContext, gradient_bytes: dict[str, int]) -> float:
    """The bytes a candidate sends per step, each rank's share: at most what an all-reduce of them moves.

    ``gradient_allreduce``: the gradients. ``bytegrad``: one byte per element. ``low_rank``: as its own plan sends
    them (:func:`~.low_rank._factors.plan_slot`): the 8-bit ``P`` and ``Q`` factors of each factored gradient,
    headers included, and the other gradients exactly.
    """
    if isinstance(candidate, ByteGradAlgorithm):
        return float(sum(parameter.numel() for _, parameter in context.named_parameters))
    if isinstance(candidate, LowRankAlgorithm):
        codec, rank, sent = MinMaxUInt8Codec(), candidate.rank, 0
        for name, parameter in context.named_parameters:
            slot = plan_slot(name, 0, parameter.shape, rank, parameter.element_size(), codec)
            if slot.factored:
                sent += slot.p_chunks * codec.row_bytes(slot.rows * rank, slot.p_chunks)
                sent += slot.q_chunks * codec.row_bytes(slot.cols * rank, slot.q_chunks)
            else:
                sent += parameter.numel() * parameter.element_size()
        return float(sent)
    return float(sum(gradient_bytes.values()))


def _compresses(candidate: Algorithm) -> bool:
    """Whether the candidate runs the 8-bit codec (``bytegrad``'s gradients, ``low_rank``'s factors)."""
    return isinstance(candidate, (ByteGradAlgorithm, LowRankAlgorithm))


def _compression_work(candidate: Algorithm) -> tuple[str, int]:
    """What a candidate's compression work depends on: its method and, for ``low_rank``, its rank."""
    return type(candidate).__name__, candidate.rank if isinstance(candidate, LowRankAlgorithm) else 0


def _compression_cost(candidate: Algorithm, context: AlgorithmContext) -> float:
    """What one step's compression work costs on this device: the codec on every gradient, or the projections."""
    device = context.device
    parameters = [parameter for _, parameter in context.named_parameters]
    if isinstance(candidate, ByteGradAlgorithm):
        numel = sum(parameter.numel() for parameter in parameters)
        sample = min(numel, 1 << 22)
        tensor = torch.randn(sample, device=device)
        codec = MinMaxUInt8Codec()
        return _timed(lambda: codec.decompress(codec.compress(tensor), sample, torch.float32), device) * numel / sample
    if isinstance(candidate, LowRankAlgorithm):
        rank = candidate.rank
        shapes: dict[tuple[int, int], int] = {}
        for parameter in parameters:
            if parameter.dim() >= 2:
                rows = parameter.shape[0]
                cols = parameter.numel() // rows
                if (rows + cols) * rank < rows * cols:
                    shapes[(rows, cols)] = shapes.get((rows, cols), 0) + 1
        total = 0.0
        # The largest shapes first, 16 of them at most; the rest are scaled from them by their size.
        ordered = sorted(shapes, key=lambda shape: -shape[0] * shape[1])
        timed_size = timed_cost = 0.0
        for rows, cols in ordered[:16]:
            matrix = torch.randn(rows, cols, device=device)
            right = torch.randn(cols, rank, device=device)

            def project(matrix: torch.Tensor = matrix, right: torch.Tensor = right) -> None:
                left = torch.linalg.qr(matrix @ right).Q
                matrix.T @ left

            cost = _timed(project, device)
            timed_size += rows * cols * shapes[(rows, cols)]
            timed_cost += cost * shapes[(rows, cols)]
        total = timed_cost
        rest = sum(rows * cols * shapes[(rows, cols)] for rows, cols in ordered[16:])
        if rest and timed_size:
            total += timed_cost * rest / timed_size
        return total
    return 0.0


def _clock() -> float:
    """The clock trial steps are timed by (tests replace it with one they drive)."""
    return time.perf_counter()


def _timed(work: Any, device: torch.device, warm_up: bool = True) -> float:
    if warm_up:
        work()
    times = []
    for _ in range(_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
