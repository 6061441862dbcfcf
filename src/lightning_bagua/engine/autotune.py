"""Bucket-size autotuning: try settings during the first steps, keep the fastest, the same on every rank."""

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_bagua.engine.algorithms.base import AlgorithmImpl
from lightning_bagua.engine.data_parallel import BaguaDistributedDataParallel

__all__ = ["AUTOTUNE_ENV", "DEFAULT_BUCKET_SIZES_MB", "AutotuneSetting", "BucketAutotuner", "autotune_from_environment"]

log = logging.getLogger(__name__)

AUTOTUNE_ENV = "BAGUA_AUTOTUNE"
"""Turns autotuning on (``1``) or off (``0``); the launcher's ``--autotune_level`` sets it."""

DEFAULT_BUCKET_SIZES_MB = (1.0, 4.0, 10.0, 25.0, 64.0)
"""Bucket sizes tried by default, in MiB (the model's own size is always tried too)."""


def autotune_from_environment() -> bool:
    """Return whether ``BAGUA_AUTOTUNE`` asks for autotuning (unset or ``0``: no; ``1``: yes).

    Raises:
        ValueError: for any other value.
    """
    value = os.environ.get(AUTOTUNE_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(
            f"{AUTOTUNE_ENV}={value!r} is not a valid autotune level: use 0 (off) or 1 (tune the bucket size, and"
            " hierarchical communication where it applies)."
        )
    return value == "1"


@dataclass(frozen=True)
class AutotuneSetting:
    """One candidate configuration.

    Args:
        bucket_cap_mb: the gradient bucket size in MiB.
        hierarchical: the algorithm's ``hierarchical`` keyword.
    """

    bucket_cap_mb: float
    hierarchical: bool

    def describe(self) -> str:
        """Return a short human-readable form, e.g. ``"bucket_cap_mb=10, hierarchical=False"``."""
        return f"bucket_cap_mb={self.bucket_cap_mb:g}, hierarchical={self.hierarchical}"


class BucketAutotuner:
    """Choose the bucket size (and hierarchical communication, on several nodes) from measured step times.

    Call :meth:`step` once per training step, before the step's forward pass, on every rank, and train with the
    model it returns::

        tuner = BucketAutotuner()
        for inputs, targets in loader:
            model = tuner.step(model)
            optimizer.zero_grad()
            loss_fn(model(inputs), targets).backward()
            optimizer.step()

    The candidates are every bucket size of ``bucket_sizes_mb`` plus the model's own, times ``hierarchical``
    on and off when the algorithm takes that keyword and the ranks span several nodes with several ranks each
    (otherwise hierarchical changes nothing). Each candidate runs ``warmup_steps`` steps (torch rebuilds the
    buckets after a wrapper's first step) and then ``measured_steps`` timed steps; the model's own setting runs
    first, so tuning starts without rebuilding. When all have run, every rank's mean step times are combined with
    an all-reduce taking the maximum over ranks (a step is as slow as its slowest rank), so every rank holds the
    same numbers and picks the same setting: the fastest, the earlier candidate on a tie. The model is rebuilt
    with it (see :meth:`BaguaDistributedDataParallel.rewrapped`), rank zero logs the choice, and later calls
    return the model untouched.

    Algorithms that never communicate gradient buckets (``decentralized``, ``low_precision_decentralized``,
    ``diloco``) have nothing to tune here, and those that keep state in their implementation (``low_rank``,
    ``async``, ``auto``) would lose it with each rebuild: the tuner logs so and keeps their setting.

    Args:
        bucket_sizes_mb: bucket sizes to try, in MiB.
        warmup_steps: untimed steps per candidate.
        measured_steps: timed steps per candidate.
        timer: the clock, in seconds; by default ``time.perf_counter`` after synchronising the device on GPUs
            (only at the start and the end of each timed window). Tests inject a deterministic one.
    """

    def __init__(
        self,
        bucket_sizes_mb: Sequence[float] = DEFAULT_BUCKET_SIZES_MB,
        warmup_steps: int = 1,
        measured_steps: int = 3,
        timer: Callable[[], float] | None = None,
    ) -> None:
        sizes = list(bucket_sizes_mb)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, (int, float)) or s <= 0 for s in sizes):
            raise ValueError(f"`bucket_sizes_mb` must be positive numbers of MiB, got {bucket_sizes_mb!r}.")
        for name, value, minimum in (("warmup_steps", warmup_steps, 0), ("measured_steps", measured_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an int of at least {minimum}, got {value!r}.")
        self._sizes = sorted({float(s) for s in sizes})
        self._warmup = warmup_steps
        self._measured = measured_steps
        self._timer = timer
        self._plan: list[AutotuneSetting] | None = None
        self._trial = 0
        self._step_in_trial = 0
        self._window_start = 0.0
        self._local_times: list[float] = []
        self.measurements: list[tuple[AutotuneSetting, float]] = []
        """Each candidate and its step time in seconds (the maximum over ranks), once tuning has finished."""
        self.decision: AutotuneSetting | None = None
        """The chosen setting, once tuning has finished."""

    @property
    def finished(self) -> bool:
        """Whether a setting has been chosen."""
        return self.decision is not None

    @property
    def steps_needed(self) -> int | None:
        """How many steps tuning takes, once the first :meth:`step` has planned it."""
        return None if self._plan is None else len(self._plan) * (self._warmup + self._measured)

    def step(self, model: BaguaDistributedDataParallel) -> BaguaDistributedDataParallel:
        """Advance the tuning by one step and return the model to train with (a new wrapper when it changes).

        Args:
            model: the wrapper the previous call returned (or the first one).

        Returns:
            The wrapper to use for this step.
        """
        if self.decision is not None:
            return model
        if self._plan is None:
            self._plan = self._make_plan(model)
            if len(self._plan) == 1:
                self.decision = self._plan[0]
                if _rank(model) == 0:
                    log.info(
                        "Bagua autotune: nothing to tune for %r (%s); keeping %s",
                        model.bagua_algorithm,
                        _untuned_reason(model) or "one candidate on this layout",
                        self.decision.describe(),
                    )
                return model
        if self._step_in_trial == self._warmup:
            self._window_start = self._now(model)
        elif self._step_in_trial == self._warmup + self._measured:
            self._local_times.append((self._now(model) - self._window_start) / self._measured)
            self._trial += 1
            self._step_in_trial = 0
            if self._trial == len(self._plan):
                return self._decide(model)
            model = _apply(model, self._plan[self._trial])
            if self._warmup == 0:
                self._window_start = self._now(model)
        self._step_in_trial += 1
        return model

    def _make_plan(self, model: BaguaDistributedDataParallel) -> list[AutotuneSetting]:
        algorithm = model.bagua_algorithm
        current = AutotuneSetting(model.bucket_cap_mb, bool(algorithm.hierarchical))
        if _untuned_reason(model) is not None:
            return [current]
        layout = model.communication_groups.layout
        hierarchical_options = [current.hierarchical]
        if "hierarchical" in algorithm.keywords() and layout.num_nodes > 1 and layout.ranks_per_node > 1:
            hierarchical_options.append(not current.hierarchical)
        others = [
            AutotuneSetting(size, hierarchical)
            for hierarchical, size in itertools.product(hierarchical_options, self._sizes)
            if AutotuneSetting(size, hierarchical) != current
        ]
        return [current, *others]

    def _now(self, model: BaguaDistributedDataParallel) -> float:
        if self._timer is not None:
            return self._timer()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _decide(self, model: BaguaDistributedDataParallel) -> BaguaDistributedDataParallel:
        assert self._plan is not None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        times = torch.tensor(self._local_times, dtype=torch.float64, device=device)
        # The maximum over ranks: every rank ends with the same vector, hence the same choice.
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=model.communication_groups.flat)
        reduced = times.tolist()
        self.measurements = list(zip(self._plan, reduced, strict=True))
        best = min(range(len(reduced)), key=lambda index: (reduced[index], index))
        self.decision = self._plan[best]
        if _rank(model) == 0:
            table = "; ".join(
                f"{setting.describe()}: {seconds * 1000:.2f} ms" for setting, seconds in self.measurements
            )
            log.info("Bagua autotune chose %s (step time per candidate: %s)", self.decision.describe(), table)
        return _apply(model, self.decision)


def _apply(model: BaguaDistributedDataParallel, setting: AutotuneSetting) -> BaguaDistributedDataParallel:
    algorithm = model.bagua_algorithm
    same_algorithm = bool(algorithm.hierarchical) == setting.hierarchical
    if same_algorithm and model.bucket_cap_mb == setting.bucket_cap_mb:
        return model
    new_algorithm = None
    if not same_algorithm:
        keywords = {name: getattr(algorithm, name) for name in algorithm.keywords()}
        new_algorithm = type(algorithm)(**{**keywords, "hierarchical": setting.hierarchical})
    return model.rewrapped(bucket_cap_mb=setting.bucket_cap_mb, algorithm=new_algorithm)


def _untuned_reason(model: BaguaDistributedDataParallel) -> str | None:
    if not type(model.bagua_algorithm).communicates_gradient_buckets:
        return "it communicates no gradient buckets"
    # Rebuilding binds the algorithm anew: state it keeps in its implementation (low_rank's error feedback and
    # step count, async's thread, auto's trials) would restart with every candidate.
    if type(model.bagua_algorithm_impl).state_dict is not AlgorithmImpl.state_dict:
        return "a rebuild would reset the state it keeps"
    return None


def _rank(model: BaguaDistributedDataParallel) -> int:
    return model.communication_groups.rank
