"""The algorithm interface and the registry behind ``Algorithm.init(name, **kwargs)``."""

import inspect
import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
from torch.optim import Optimizer

from lightning_bagua.engine.communication import (
    CommunicationCounter,
    CommunicationGroups,
    CommunicationHook,
    OrderedExecutor,
)
from lightning_bagua.engine.telemetry import CommunicationTelemetry

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "CommunicationHook",
    "HookState",
    "available_algorithms",
    "check_keyword_type",
    "check_positive_int",
    "check_state_keys",
    "register_algorithm",
    "weakly_bound",
]

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type["Algorithm"]] = {}

_A = TypeVar("_A", bound="Algorithm")
_S = TypeVar("_S", bound="HookState")


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm gets from the wrapper it is bound to.

    Args:
        groups: the engine's own communicators.
        counter: records every collective the algorithm issues.
        executor: runs multi-step communication jobs in bucket order.
        device: the device the model's gradients live on.
        named_parameters: the parameters the algorithm communicates, by name: those that require gradients and
            are not listed in ``_bagua_params_and_buffers_to_ignore`` / ``_ddp_params_and_buffers_to_ignore``.
        timeout: how long a collective may wait before it fails (the wrapper's ``timeout``); ``None`` for torch's
            default. An algorithm that creates communicators of its own creates them with it.
        bucket_cap_mb: the wrapper's bucket size in MiB; algorithms that communicate weights rather than DDP's
            gradient buckets cut their flat weights into pieces of this size where Bagua did.
    """

    groups: CommunicationGroups
    counter: CommunicationCounter
    executor: OrderedExecutor
    device: torch.device
    named_parameters: tuple[tuple[str, torch.nn.Parameter], ...] = ()
    timeout: timedelta | None = None
    bucket_cap_mb: float = 10.0


@dataclass
class HookState:
    """What every communication hook needs: the communicators, the counter and the ordered executor.

    An algorithm's hook state subclasses it with its own fields; :meth:`from_context` fills the shared ones.

    Args:
        groups: the engine's communicators; two-level when they were created hierarchical.
        counter: records every collective the hook issues.
        executor: runs multi-step communication jobs in bucket order, off the training thread.
    """

    groups: CommunicationGroups
    counter: CommunicationCounter
    executor: OrderedExecutor

    @classmethod
    def from_context(cls: type[_S], context: AlgorithmContext, **fields: Any) -> _S:
        """Build the state from the wrapper's context and the algorithm's own ``fields``.

        Args:
            context: the context the algorithm was reified with.
            **fields: the subclass's fields.

        Returns:
            The state.
        """
        return cls(groups=context.groups, counter=context.counter, executor=context.executor, **fields)


class AlgorithmImpl(ABC):
    """An algorithm bound to one wrapped model: its communication hook, its per-model state and its life cycle.

    The strategies drive every implementation through this interface alone: :meth:`start` when training with the
    model begins, :meth:`stop` when it ends (``wait=False`` when it ends in an error), :meth:`state_dict` and
    :meth:`load_state_dict` around checkpoints, :meth:`close` when the wrapper is closed.

    Args:
        algorithm: the configuration this implementation was bound from.
        context: the wrapper's groups, counter, executor, device, participating parameters and timeout.
    """

    def __init__(self, algorithm: "Algorithm", context: AlgorithmContext) -> None:
        self.algorithm = algorithm
        self.context = context
        # Set by the wrapper when telemetry is on; an algorithm that blocks on communication outside backward
        # (after the optimizer step, say) times that wait with `telemetry.blocking()` only when it is set.
        self.telemetry: CommunicationTelemetry | None = None

    def telemetry_phase(self) -> dict[str, float]:
        """Describe the algorithm's phase in the step that just ended, for telemetry; ``{}`` if it has none.

        Called once per step, only while telemetry is on. Values are numbers, so that any logger takes them:
        ``qadam`` reports ``{"compressed": 0.0}`` during warm-up and ``1.0`` after it; an asynchronous
        algorithm would report e.g. ``{"warmup": ..., "syncs_per_second": ...}``. The telemetry prefixes the keys
        with ``"phase/"``.

        Returns:
            Key to number.
        """
        return {}

    @abstractmethod
    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the ``(state, hook)`` pair the wrapper registers with DDP's reducer."""

    def on_forward_start(self, synchronizing: bool) -> None:  # noqa: B027 - optional hook
        """Act at the start of a training forward pass (one that records gradients), before the module runs.

        Args:
            synchronizing: ``False`` on the passes of accumulating steps (under ``no_sync()``), whose backward
                does not communicate.
        """

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:  # noqa: B027 - optional hook
        """Take note of the optimizers that update the model (algorithms that act around a step override this).

        Called again, with the new list, whenever the wrapper's optimizers change; an implementation that
        registers optimizer hooks removes the ones it registered before.

        Args:
            optimizers: the optimizers, in the order the user gave them.
        """

    def on_optimizer_step(self, optimizer: Optimizer) -> None:  # noqa: B027 - optional hook
        """Act right after a strategy stepped one of the bound optimizers.

        The strategies call it on every rank after each optimizer step they run, a step the gradient scaler skipped
        included, so it may be collective. A plain PyTorch loop need not call it: an algorithm that acts between
        steps must also act at the next :meth:`on_forward_start`.

        Args:
            optimizer: the optimizer that stepped.
        """

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start (or restart) the work the algorithm does between steps, such as a background thread; idempotent.

        Every rank calls it at the same point (when training starts), so it may be collective.
        """

    @property
    def started(self) -> bool:
        """Whether the work :meth:`start` begins is on: started and not stopped since; ``False`` when there is none.

        A strategy that must hold that work still for a moment (loading a checkpoint into the model, say) stops it
        and starts it again afterwards only when this is ``True``.
        """
        return False

    def stop(self, wait: bool = True) -> None:  # noqa: B027 - optional hook
        """Stop the work :meth:`start` began; idempotent, and a no-op when nothing runs.

        Args:
            wait: ``True`` when training ends normally: every rank calls it, so the stop may be collective (agree
                with the peers, finish a last round). ``False`` on an error path: stop at once without waiting for
                any peer, which may be dead, and let the peers' own work fail instead of hanging.
        """

    def state_dict(self) -> dict[str, Any]:
        """Return what this algorithm needs, beyond the model's and the optimizers' own state, to resume exactly.

        The values are tensors (on any device) and plain Python objects, as ``torch.save`` takes them; the dict
        is empty for algorithms that keep nothing between steps.

        Returns:
            This rank's algorithm state.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned, after the model and optimizers have been restored.

        Args:
            state: a dict from :meth:`state_dict` of the same algorithm.

        Raises:
            ValueError: if ``state`` holds anything, since this algorithm keeps no state.
        """
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state between steps, got state with keys {sorted(state)}."
                " Was the checkpoint written with another algorithm?"
            )

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Return this rank's state at the current world size, from the states every rank of another run saved.

        Called when resuming a checkpoint written by ``len(saved)`` ranks on a run of another size (rank and world
        size from ``self.context.groups``); the result goes to :meth:`load_state_dict`. An implementation re-shards
        by what its state means: shared state kept, residuals redistributed so that their sum over ranks is kept,
        per-rank state that follows the ranks' weights rebuilt from the averaged weights.

        Args:
            saved: each saved rank's :meth:`state_dict`, by rank.

        Returns:
            This rank's state; ``{}`` by default, when every saved state is empty.

        Raises:
            ValueError: a saved state holds something this implementation does not know how to re-shard.
        """
        if any(saved):
            raise ValueError(
                f"{type(self).__name__} cannot resize the state {len(saved)} processes saved to"
                f" {self.context.groups.world_size}: it does not implement `resize_state`. Resume with {len(saved)}"
                " processes, or load the weights alone to start the algorithm afresh."
            )
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and buffers; the wrapper calls this once when it is closed."""


class Algorithm(ABC):
    """A Bagua communication algorithm's configuration; :meth:`reify` binds it to a wrapped model.

    Build one by name with :meth:`init`, or construct a subclass directly. An algorithm's keywords are validated at
    construction, so a typo fails before any process group starts; they may be given by position in the order
    Bagua's constructors took them.
    """

    name: ClassVar[str]
    """The registry name, e.g. ``"gradient_allreduce"``."""

    hierarchical: bool = False
    """Whether to communicate in two levels: inside each node, then among node leaders."""

    single_node_effect: ClassVar[str] = "it communicates over all ranks exactly as with hierarchical=False"
    """What ``hierarchical=True`` amounts to when every rank is on one node (the wrapper's warning says it)."""

    warns_about_node_layout: ClassVar[bool] = True
    """Whether the wrapper warns when ``hierarchical=True`` meets a layout that defeats it (``auto`` decides itself)."""

    communicates_gradient_buckets: ClassVar[bool] = True
    """Whether the algorithm communicates DDP's gradient buckets, so that the bucket size matters (autotuning)."""

    resize_effect: ClassVar[str] = "it keeps no state between steps"
    """What resuming at another world size does to the algorithm's state (:meth:`AlgorithmImpl.resize_state`), for the
    message a resize logs."""

    results_depend_on_buckets: ClassVar[bool] = True
    """Whether the numbers the algorithm produces depend on how the gradients are bucketed (a codec's ranges are per
    bucket), so that a checkpoint keeps the bucket layout to resume exactly."""

    ranks_hold_different_weights: ClassVar[bool] = False
    """Whether the ranks' weights (and so their optimizer states) differ between steps, as with weight-averaging
    algorithms; checkpoints then carry every rank's weights and optimizer state, not rank 0's alone."""

    steps_from_gradients: ClassVar[bool] = True
    """Whether the bound optimizers step from the parameters' ``.grad`` in every phase. ``qadam``'s do not: after its
    warm-up the optimizer steps from a momentum the communication computes from the raw gradients, which a gradient
    scaler's unscaling and gradient clipping, both acting on ``.grad``, do not reach; the strategies refuse those."""

    misplaced_keywords: ClassVar[dict[str, str]] = {}
    """Keywords users pass to the algorithm that belong elsewhere, and where (said when such a keyword is refused)."""

    impl_class: ClassVar[type[AlgorithmImpl]]
    """The implementation :meth:`reify` builds, as ``impl_class(algorithm, context)``."""

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Bind this algorithm to one wrapped model.

        Args:
            context: the wrapper's groups, counter, executor, device, participating parameters and timeout.

        Returns:
            The bound implementation, ``impl_class(self, context)``; override to build it another way.
        """
        return self.impl_class(self, context)

    def check_optimizers(self, optimizers: Sequence[Optimizer], lr_schedulers: Sequence[Any]) -> None:  # noqa: B027
        """Raise a ``ValueError`` unless the algorithm can train with these optimizers and LR schedulers.

        The strategies call it before the model is wrapped where they can (Fabric), and before training starts
        (the Trainer, which builds optimizers after wrapping), so that a wrong configuration fails before any
        communication. Every configuration is accepted by default.

        Args:
            optimizers: the optimizers that will update the model.
            lr_schedulers: the LR schedulers (or the Trainer's scheduler configurations) that go with them.
        """

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> "Algorithm":
        """Build the algorithm registered as ``name`` with ``kwargs``.

        Args:
            name: one of :func:`available_algorithms`.
            **kwargs: the algorithm's keywords (see each algorithm's class).

        Returns:
            The configured algorithm.

        Raises:
            ValueError: ``name`` is not an algorithm.
            TypeError: a keyword is unknown or its value has the wrong type.
        """
        algorithm_cls = algorithm_class(name)
        accepted = algorithm_cls.keywords()
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            hints = "".join(
                f" {algorithm_cls.misplaced_keywords[key]}"
                for key in unknown
                if key in algorithm_cls.misplaced_keywords
            )
            raise TypeError(
                f"Unknown keyword argument(s) {', '.join(map(repr, unknown))} for algorithm {name!r}."
                f" It accepts: {_describe_keywords(accepted)}.{hints}"
            )
        return algorithm_cls(**kwargs)

    @classmethod
    def keywords(cls) -> dict[str, Any]:
        """Return the algorithm's keywords and their defaults (``inspect.Parameter.empty`` if required)."""
        # Positional ones too: Bagua's constructors took their keywords by position (QAdamAlgorithm(optimizer)).
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without `self`
        return {p.name: p.default for p in parameters if p.kind in kinds}

    def __repr__(self) -> str:
        values = ", ".join(f"{key}={getattr(self, key)!r}" for key in self.keywords())
        return f"{type(self).__name__}({values})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, key) == getattr(other, key) for key in self.keywords())

    def __hash__(self) -> int:
        return hash((type(self), *(getattr(self, key) for key in self.keywords())))


def register_algorithm(name: str) -> Callable[[type[_A]], type[_A]]:
    """Register an :class:`Algorithm` subclass under ``name`` (a class decorator).

    Args:
        name: the name :meth:`Algorithm.init` and ``BaguaStrategy(algorithm=...)`` accept.

    Returns:
        The decorator.
    """

    def decorate(algorithm_cls: type[_A]) -> type[_A]:
        if name in _REGISTRY:
            raise ValueError(f"An algorithm named {name!r} is already registered ({_REGISTRY[name].__qualname__}).")
        algorithm_cls.name = name
        _REGISTRY[name] = algorithm_cls
        return algorithm_cls

    return decorate


def available_algorithms() -> list[str]:
    """Return the names of the algorithms this release provides."""
    return sorted(_REGISTRY)


def algorithm_class(name: str) -> type[Algorithm]:
    """Return the class registered as ``name``, with errors that say what exists.

    Args:
        name: an algorithm name.

    Returns:
        The algorithm's class.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"The algorithm must be given by name (a str) or as an Algorithm instance, got {name!r}"
            f" ({type(name).__name__}). Available names: {', '.join(available_algorithms())}."
        )
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise ValueError(f"Unknown algorithm {name!r}. Available algorithms: {', '.join(available_algorithms())}.")


def check_keyword_type(algorithm: str, keyword: str, value: Any, expected: type | tuple[type, ...]) -> None:
    """Raise a ``TypeError`` naming the keyword, the value and the expected type unless ``value`` fits.

    ``bool`` is not accepted where ``int`` is expected (``True`` is an ``int`` to Python, never what a user meant).

    Args:
        algorithm: the algorithm's registry name, for the message.
        keyword: the keyword's name.
        value: the value given.
        expected: the accepted type(s).
    """
    types = expected if isinstance(expected, tuple) else (expected,)
    wrong_bool = isinstance(value, bool) and bool not in types
    if wrong_bool or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        article = "an" if names[0] in "aeiou" else "a"
        raise TypeError(
            f"Algorithm {algorithm!r}: `{keyword}` must be {article} {names}, got {value!r} ({type(value).__name__})."
        )


def check_positive_int(algorithm: str, keyword: str, value: Any) -> None:
    """Raise unless ``value`` is an ``int`` (not a ``bool``) of at least 1, naming the keyword and the value.

    Args:
        algorithm: the algorithm's registry name, for the message.
        keyword: the keyword's name.
        value: the value given.
    """
    check_keyword_type(algorithm, keyword, value, int)
    if value < 1:
        raise ValueError(f"Algorithm {algorithm!r}: `{keyword}` must be at least 1, got {value}.")


def check_state_keys(algorithm: str, state: Any, expected: dict[str, type | tuple[type, ...]]) -> None:
    """Raise a ``ValueError`` unless ``state`` is a dict with exactly the ``expected`` keys, each of its type(s).

    Args:
        algorithm: the algorithm's registry name, for the message.
        state: the saved state to check (for :meth:`AlgorithmImpl.load_state_dict`).
        expected: the type (or types) each key must hold; ``bool`` does not pass for ``int``.
    """
    if not isinstance(state, dict) or set(state) != set(expected):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"Algorithm {algorithm!r}: the saved state must have the keys {sorted(expected)}, got {found}. Was it"
            " written by another version or another algorithm?"
        )
    for key, kinds in expected.items():
        value = state[key]
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            names = " or ".join(kind.__name__ for kind in kinds)
            raise ValueError(
                f"Algorithm {algorithm!r}: saved state {key!r} must be {names}, got {value!r} ({type(value).__name__})."
            )


def weakly_bound(method: Callable[..., None]) -> Callable[..., None]:
    """Return a function that calls ``method`` while its object lives, and does nothing once the object is gone.

    For callbacks left with objects the implementation itself holds (its optimizers' step hooks, its hook state):
    a bound method there closes a reference cycle through the implementation, and the cycle keeps the engine's
    groups, and through them the default group's store, until Python's cycle collector runs. A script that destroys
    the default group and starts a new one through the same address would meet the old store there.

    Args:
        method: a bound method returning nothing.

    Returns:
        A function taking the method's arguments.
    """
    reference = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        bound = reference()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def _describe_keywords(keywords: dict[str, Any]) -> str:
    if not keywords:
        return "no keywords"
    return ", ".join(
        name if default is inspect.Parameter.empty else f"{name}={default!r}" for name, default in keywords.items()
    )
