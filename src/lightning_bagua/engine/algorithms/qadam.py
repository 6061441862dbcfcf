"""``qadam``: Adam whose momentum, after a warm-up, is exchanged as 8-bit codes instead of the gradients.

Bagua's QAdam follows `1-bit Adam <https://arxiv.org/abs/2102.02888>`_: Adam's second moment settles early in
training, so after a full-precision warm-up it is frozen, and what the ranks exchange from then on is the first
moment (the momentum), compressed. Here the compression is bytegrad's 8-bit scatter-gather.

Design:

* :class:`QAdamOptimizer` holds all of the state (``step``, ``exp_avg`` = ``m``, ``exp_avg_sq`` = ``v`` per
  parameter), so an optimizer ``state_dict`` checkpoint resumes in the same phase with the same moments.
* The phase of a step is read from the optimizer's own step count: during the backward pass of the step that
  will become step ``s = state["step"] + 1`` the hook asks :meth:`QAdamOptimizer.is_compressed_step`, which is
  true once ``s >= warmup_steps``.
* Warm-up: the hook all-reduces the gradient bucket at full precision (as ``gradient_allreduce``), and the
  optimizer updates ``m`` and ``v`` as Adam.
* Compressed phase: per gradient bucket, the hook computes every parameter's new local momentum
  ``b1 * m + (1 - b1) * g_local`` into one flat tensor (in the order of ``bucket.parameters()``), averages it with
  bytegrad's scatter-gather (hierarchical as bytegrad), and writes the average back into the optimizer's ``m``,
  marking those parameters as synchronised. The gradient bucket is returned untouched, so after backward ``.grad``
  holds each rank's *local* gradient in this phase; the optimizer does not read it for a synchronised parameter.
* Used alone (no algorithm, one process), the optimizer updates ``m`` from ``.grad`` itself in the compressed
  phase too, which is the same math with one rank.
* A bucket whose parameters are in both phases (a parameter that had no gradient in some steps, so that its count
  lags, or parameter groups with different ``warmup_steps``) is all-reduced at full precision, and the optimizer
  updates each parameter by its own phase: for one in the compressed phase that is the same ``m``, averaged
  exactly instead of in 8 bits.

Two deliberate differences from Bagua (the migration page lists every one): the compressed momentum is exchanged
from the step at which the warm-up ends, where Bagua all-reduced that step's gradient and then dropped it; and
``weight_decay`` keeps acting in the compressed phase, where Bagua dropped it silently.

Binding the optimizer: ``QAdamAlgorithm(q_adam_optimizer=opt)`` in plain PyTorch, or ``q_adam_optimizer=None``
when the optimizer is created later (the Lightning strategy creates it in ``configure_optimizers`` and binds it
through :meth:`~lightning_bagua.engine.BaguaDistributedDataParallel.bind_optimizers`): the bound implementation
then takes the single :class:`QAdamOptimizer` among the bound optimizers. Binding optimizers none of which is a
:class:`QAdamOptimizer` is a ``ValueError``; a backward pass with no :class:`QAdamOptimizer` known is a
``RuntimeError`` that says how to provide one.
"""

import logging
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    check_keyword_type,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.bytegrad import ByteGradState, reduce_bucket
from lightning_bagua.engine.algorithms.gradient_allreduce import (
    GradientAllReduceState,
    all_reduce_bucket,
    gradient_allreduce_hook,
)
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import OrderedExecutor

log = logging.getLogger(__name__)

__all__ = ["QAdamAlgorithm", "QAdamImpl", "QAdamOptimizer", "QAdamState", "check_qadam_configuration", "qadam_hook"]

QADAM_CONFIGURATION_ERROR = "Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler"
# The per-group settings QAdamOptimizer's constructor takes.
_SETTINGS = ("lr", "warmup_steps", "betas", "eps", "weight_decay")


class QAdamOptimizer(Optimizer):
    """Adam with a full-precision warm-up, then a frozen second moment and a communicated momentum.

    With ``s`` a parameter's step count after it is incremented, ``g = grad + weight_decay * x``, and ``m``,
    ``v`` starting at zero:

    1. Warm-up, while ``s < warmup_steps`` (gradients all-reduced at full precision by :class:`QAdamAlgorithm`):
       ``m = b1 * m + (1 - b1) * g`` and ``v = b2 * v + (1 - b2) * g * g``.
    2. Compressed phase, once ``s >= warmup_steps``: ``v`` is frozen; ``m = b1 * m + (1 - b1) * g_local`` is
       computed and averaged over the ranks (8-bit) by :class:`QAdamAlgorithm` during backward. A parameter whose
       momentum was not synchronised that way (no algorithm) gets ``m`` updated here from its ``.grad``.
    3. Both phases: ``x = x - lr / (1 - b1^s) * m / (sqrt(v) / sqrt(1 - b2^s) + eps)``.

    Args:
        params: the parameters, or parameter groups (dicts), to optimise.
        lr: the learning rate, ``>= 0``.
        warmup_steps: the step count at which the compressed phase starts, ``> 0``.
        betas: ``(b1, b2)``, each in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``.
        weight_decay: L2 penalty added to the gradient, ``>= 0``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps <= 0:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an int > 0)")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
                raise TypeError(f"Invalid {name}: {value!r} ({type(value).__name__}); it must be a number >= 0")
        # Written as `not x >= 0` so that NaN is refused too.
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr!r} (must be >= 0)")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps!r} (must be >= 0)")
        if len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas!r} (must be a pair)")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta!r} (must be in [0, 1))")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0)")
        defaults = {
            "lr": lr,
            "warmup_steps": warmup_steps,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        # Parameters whose momentum the algorithm averaged during this step's backward; not checkpointed, since a
        # checkpoint is taken between steps, when the set is empty.
        self._synchronized: set[int] = set()
        # Per gradient bucket, what the hook needs from the parameter groups and state (see bucket_momenta).
        self._bucket_momenta: dict[Hashable, BucketMomenta] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned, also from a release that did not store every setting.

        Parameter groups saved without a setting this optimizer has (``warmup_steps``, which releases before it
        was kept per group did not store) take the constructor's value, instead of failing at the next step.

        Args:
            state_dict: an optimizer state dict.
        """
        super().load_state_dict(state_dict)
        self._bucket_momenta.clear()  # they hold the replaced groups and moments
        # Only QAdam's own settings: torch adds keys of its own to ``defaults`` (``differentiable``) that a group
        # saved without them must not gain, or a state_dict would not round-trip.
        for group in self.param_groups:
            for key in _SETTINGS:
                group.setdefault(key, self.defaults[key])

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        # The hook asks for every parameter of every bucket, so the lookup is cached; the cache is rebuilt when the
        # groups change (``add_param_group`` appends, ``load_state_dict`` replaces the list).
        # The list itself is kept (not its id), so a later list can never be mistaken for it.
        cached: tuple[list[dict[str, Any]], int] | None = getattr(self, "_groups_key", None)
        if cached is None or cached[0] is not self.param_groups or cached[1] != len(self.param_groups):
            self._groups_by_param = {id(p): group for group in self.param_groups for p in group["params"]}
            self._groups_key = (self.param_groups, len(self.param_groups))
        group = self._groups_by_param.get(id(param))
        if group is None:
            raise ValueError("The parameter is not optimised by this QAdamOptimizer.")
        return group

    def _state_of(self, param: Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def is_compressed_step(self, param: Tensor) -> bool:
        """Whether ``param``'s next step (``s = step + 1``) is in the compressed phase (``s >= warmup_steps``)."""
        step = self.state[param].get("step", 0) if param in self.state else 0
        return step + 1 >= self._group_of(param)["warmup_steps"]

    @torch.no_grad()
    def local_momentum(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
        """Return the new local momenta ``b1 * m + (1 - b1) * (grad + weight_decay * x)``, flattened in order.

        The optimizer's ``m`` is left unchanged: :meth:`set_synchronized_momentum` writes the average back.

        Args:
            params: the parameters, in bucket order.
            grads: their local gradients.

        Returns:
            A new flat tensor.
        """
        flat = torch.empty(sum(param.numel() for param in params), dtype=params[0].dtype, device=params[0].device)
        # Straight into their places in the flat tensor: no per-parameter temporary, no concatenating copy.
        into = [
            piece.view_as(param) for piece, param in zip(flat.split([p.numel() for p in params]), params, strict=True)
        ]
        by_setting: dict[tuple[float, float], tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]] = {}
        for param, grad, out in zip(params, grads, into, strict=True):
            group = self._group_of(param)
            entry = by_setting.setdefault((group["betas"][0], group["weight_decay"]), ([], [], [], []))
            entry[0].append(param)
            entry[1].append(grad)
            entry[2].append(self._state_of(param)["exp_avg"])
            entry[3].append(out)
        for (beta1, weight_decay), (group_params, group_grads, momenta, outs) in by_setting.items():
            gradients = (
                torch._foreach_add(group_grads, group_params, alpha=weight_decay) if weight_decay else group_grads
            )
            torch._foreach_copy_(outs, momenta)
            torch._foreach_mul_(outs, beta1)
            torch._foreach_add_(outs, gradients, alpha=1 - beta1)
        return flat

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as :meth:`torch.optim.Optimizer.add_param_group` does.

        Args:
            param_group: the group's parameters and settings.
        """
        super().add_param_group(param_group)
        # Absent while the constructor adds the first groups.
        getattr(self, "_bucket_momenta", {}).clear()

    def bucket_momenta(
        self, key: Hashable, params: Sequence[Tensor], buffer: Tensor, gradients: Callable[[], Sequence[Tensor]]
    ) -> "BucketMomenta":
        """Return the gradient bucket ``key``'s :class:`BucketMomenta`, built on first use and kept between steps.

        The hook runs once per bucket at every step; what it needs from the parameter groups and the state (the
        group, the ``exp_avg`` tensors, where each parameter's momentum lies in the flat tensor) is looked up
        once, not per parameter at every step. It is built again when the bucket's parameters or their ``m``
        tensors change (DDP rebuilds its buckets; Lightning moves the state between devices), and after
        :meth:`load_state_dict` or :meth:`add_param_group`.

        Args:
            key: what identifies the bucket from step to step (its index).
            params: the bucket's parameters, in bucket order.
            buffer: the bucket's flat gradients (DDP's bucket buffer).
            gradients: returns the bucket's gradients, one per parameter; called only to build.

        Returns:
            The bucket's momenta.
        """
        momenta = self._bucket_momenta.get(key)
        if momenta is None or not momenta.holds(params):
            momenta = self._bucket_momenta[key] = BucketMomenta(self, params, buffer, gradients())
        return momenta

    @torch.no_grad()
    def set_synchronized_momentum(self, params: Sequence[Tensor], flat: Tensor) -> None:
        """Store the averaged momenta ``flat`` (as laid out by :meth:`local_momentum`) as the params' ``m``.

        Args:
            params: the parameters, in the order given to :meth:`local_momentum`.
            flat: the averaged momenta.
        """
        momenta = [self._state_of(param)["exp_avg"] for param in params]
        pieces = flat.split([momentum.numel() for momentum in momenta])
        torch._foreach_copy_(
            momenta, [piece.view_as(momentum) for piece, momentum in zip(pieces, momenta, strict=True)]
        )
        self._synchronized.update(id(param) for param in params)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimisation step (steps 1 to 3 of the class docstring) for every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, if any.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        self._synchronized.clear()
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # One multi-tensor kernel per operation and per device, dtype and step count, not a few kernels per
        # parameter: with a model's hundreds of parameters the per-parameter loop was the step's longest part.
        beta1, beta2 = group["betas"]
        moving: dict[tuple[Any, ...], tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]] = {}
        updated: dict[tuple[Any, ...], tuple[list[Tensor], list[Tensor], list[Tensor]]] = {}
        for param in group["params"]:
            synchronized = id(param) in self._synchronized
            if param.grad is None and not synchronized:
                continue
            state = self._state_of(param)
            state["step"] += 1
            step = state["step"]
            key = (param.device, param.dtype, step)
            # A synchronised m was averaged during backward; otherwise (warm-up, or no algorithm) update it here.
            if step < group["warmup_steps"] or not synchronized:
                entry = moving.setdefault(key, ([], [], [], []))
                entry[0].append(param)
                entry[1].append(param.grad)
                entry[2].append(state["exp_avg"])
                entry[3].append(state["exp_avg_sq"])
            entry_updated = updated.setdefault(key, ([], [], []))
            entry_updated[0].append(param)
            entry_updated[1].append(state["exp_avg"])
            entry_updated[2].append(state["exp_avg_sq"])
        for (_, _, step), (params, grads, momenta, second_moments) in moving.items():
            if group["weight_decay"]:
                grads = list(torch._foreach_add(grads, params, alpha=group["weight_decay"]))
            torch._foreach_mul_(momenta, beta1)
            torch._foreach_add_(momenta, grads, alpha=1 - beta1)
            if step < group["warmup_steps"]:  # v is frozen once the warm-up is over
                torch._foreach_mul_(second_moments, beta2)
                torch._foreach_addcmul_(second_moments, grads, grads, value=1 - beta2)
        for (_, _, step), (params, momenta, second_moments) in updated.items():
            denominators = torch._foreach_sqrt(second_moments)
            torch._foreach_div_(denominators, math.sqrt(1 - beta2**step))
            torch._foreach_add_(denominators, group["eps"])
            torch._foreach_addcdiv_(params, momenta, denominators, value=-group["lr"] / (1 - beta1**step))


class BucketMomenta:
    """One gradient bucket's parameters and momenta, looked up once for :func:`qadam_hook`'s every step.

    When the parameters share a group and DDP's bucket buffer lays their gradients out as their momenta are laid
    out in :meth:`local`'s flat tensor (contiguous, in bucket order, end to end), :meth:`local` computes on the
    whole buffer at once: a few kernels and no per-parameter Python, which is what a step over a fast link waits
    for. Otherwise it falls back on :meth:`QAdamOptimizer.local_momentum`.

    Args:
        optimizer: the optimizer whose state the momenta are.
        params: the bucket's parameters, in bucket order.
        buffer: the bucket's flat gradients (DDP's bucket buffer).
        gradients: the bucket's gradients, one per parameter, as views into ``buffer``.
    """

    def __init__(
        self, optimizer: QAdamOptimizer, params: Sequence[Tensor], buffer: Tensor, gradients: Sequence[Tensor]
    ) -> None:
        self._optimizer = optimizer
        self.params = list(params)
        self._ids = tuple(id(param) for param in self.params)
        self._sizes = [param.numel() for param in self.params]
        groups = {id(group): group for group in map(optimizer._group_of, self.params)}
        self._group = next(iter(groups.values())) if len(groups) == 1 else None
        self._momenta = [optimizer._state_of(param)["exp_avg"] for param in self.params]
        self.reads_buffer = self._group is not None and self._lines_up(buffer, gradients)
        # Flat views, for the multi-tensor kernels against the flat tensor's pieces (all contiguous when reads_buffer).
        self._flat_momenta = [momentum.view(-1) for momentum in self._momenta] if self.reads_buffer else []

    def holds(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` are the parameters these momenta were built for, in order, with the same ``m``.

        Lightning moves an optimizer's state between devices by replacing its tensors: momenta kept from before
        would no longer be the optimizer's.
        """
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params, strict=True)):
            return False
        state = self._optimizer.state
        return all(
            (entry := state.get(param)) is not None and entry.get("exp_avg") is momentum
            for param, momentum in zip(self.params, self._momenta, strict=True)
        )

    @torch.no_grad()
    def local(self, buffer: Tensor, gradients: Sequence[Tensor] | None) -> Tensor:
        """Return the new local momenta ``b1 * m + (1 - b1) * (grad + weight_decay * x)``, flat in bucket order.

        The optimizer's ``m`` is left unchanged: :meth:`store` writes the average back.

        Args:
            buffer: the bucket's flat gradients (DDP's bucket buffer).
            gradients: the bucket's gradients per parameter; read only when not :attr:`reads_buffer`.

        Returns:
            A new flat tensor.
        """
        if not self.reads_buffer:
            if gradients is None:
                raise ValueError("These momenta cannot read the bucket buffer whole: pass the gradients too.")
            return self._optimizer.local_momentum(self.params, gradients)
        assert self._group is not None  # reads_buffer says so
        beta1, weight_decay = self._group["betas"][0], self._group["weight_decay"]
        flat = torch.empty_like(buffer)
        pieces = flat.split(self._sizes)
        torch._foreach_copy_(pieces, self._flat_momenta)
        flat.mul_(beta1).add_(buffer, alpha=1 - beta1)
        if weight_decay:
            # The parameters' views are taken anew: moving a module (`param.data = ...`) keeps the parameter but
            # replaces its storage.
            weights = [param.view(-1) for param in self.params]
            torch._foreach_add_(pieces, weights, alpha=(1 - beta1) * weight_decay)
        return flat

    @torch.no_grad()
    def store(self, flat: Tensor) -> None:
        """Write the averaged momenta ``flat`` (laid out as :meth:`local`'s) into the optimizer's ``m``.

        Args:
            flat: the averaged momenta.
        """
        if not self.reads_buffer:
            self._optimizer.set_synchronized_momentum(self.params, flat)
            return
        torch._foreach_copy_(self._flat_momenta, flat.split(self._sizes))
        self._optimizer._synchronized.update(self._ids)

    def _lines_up(self, buffer: Tensor, gradients: Sequence[Tensor]) -> bool:
        # DDP's reducer places a gradient with its parameter's strides: only contiguous gradients, end to end in
        # bucket order, line up element for element with the momenta's pieces of the flat tensor.
        tensors = (*self.params, *self._momenta)
        if buffer.dim() != 1 or sum(self._sizes) != buffer.numel() or not all(t.is_contiguous() for t in tensors):
            return False
        address, element = buffer.data_ptr(), buffer.element_size()
        for gradient, size in zip(gradients, self._sizes, strict=True):
            if not gradient.is_contiguous() or gradient.data_ptr() != address or gradient.numel() != size:
                return False
            address += size * element
        return all(momentum.dtype == buffer.dtype for momentum in self._momenta)


@dataclass
class QAdamState:
    """State of :func:`qadam_hook`.

    Args:
        full_precision: the warm-up's all-reduce state.
        compressed: the compressed phase's bytegrad state (``average=True``).
        executor: runs the compressed jobs in bucket order.
        optimizer: the bound optimizer, ``None`` until one is known.
        last_compressed: whether the last bucket communicated was in the compressed phase (``None`` before one).
        on_executor: whether an earlier bucket of this step went to the executor, so that a full-precision bucket
            must follow it there to keep the order of collectives alike on every rank.
        warned_mixed: whether the note on a bucket in both phases was logged.
    """

    full_precision: GradientAllReduceState
    compressed: ByteGradState
    executor: OrderedExecutor
    optimizer: QAdamOptimizer | None = field(default=None)
    last_compressed: bool | None = None
    on_executor: bool = False
    warned_mixed: bool = False

    def require_optimizer(self) -> QAdamOptimizer:
        """Return the bound optimizer, or raise a ``RuntimeError`` that says how to bind one."""
        if self.optimizer is None:
            raise RuntimeError(
                "Algorithm 'qadam' has no QAdamOptimizer: pass `q_adam_optimizer=` to QAdamAlgorithm, or the"
                " optimizer to BaguaDistributedDataParallel(optimizers=[...]) / bind_optimizers([...])."
            )
        return self.optimizer


class QAdamImpl(AlgorithmImpl):
    """:class:`QAdamAlgorithm` bound to one wrapped model."""

    def __init__(self, algorithm: "QAdamAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self._given = algorithm.q_adam_optimizer
        self.state = QAdamState(
            full_precision=GradientAllReduceState.from_context(context, average=True),
            compressed=ByteGradState.from_context(
                context,
                average=True,
                hierarchical=algorithm.hierarchical,
                codec=MinMaxUInt8Codec(),
            ),
            executor=context.executor,
        )
        if self._given is not None:
            self._set_optimizer(self._given)

    def _set_optimizer(self, optimizer: QAdamOptimizer) -> None:
        optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, param in self.context.named_parameters if id(param) not in optimised]
        if missing:
            raise ValueError(f"Algorithm 'qadam': the QAdamOptimizer does not optimise {', '.join(missing)}.")
        self.state.optimizer = optimizer

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`qadam_hook`."""
        return self.state, qadam_hook

    def telemetry_phase(self) -> dict[str, float]:
        """Return ``{"compressed": 1.0}`` after the warm-up, ``0.0`` during it (``{}`` before any bucket)."""
        if self.state.last_compressed is None:
            return {}
        return {"compressed": float(self.state.last_compressed)}

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Take the single :class:`QAdamOptimizer` among ``optimizers`` (unless one was given to the algorithm).

        Args:
            optimizers: the optimizers that update the model; an empty list leaves the binding as it is.

        Raises:
            ValueError: there are optimizers but not exactly one :class:`QAdamOptimizer`, or it differs from the
                one given to the algorithm.
        """
        if not optimizers:
            return
        found = [optimizer for optimizer in optimizers if isinstance(optimizer, QAdamOptimizer)]
        if len(found) != 1:
            raise ValueError(
                f"Algorithm 'qadam' needs exactly one QAdamOptimizer among the bound optimizers, got"
                f" {[type(optimizer).__name__ for optimizer in optimizers]}."
            )
        if self._given is not None and found[0] is not self._given:
            raise ValueError("Algorithm 'qadam': the bound QAdamOptimizer is not the `q_adam_optimizer` it was given.")
        self._set_optimizer(found[0])


@register_algorithm("qadam")
class QAdamAlgorithm(Algorithm):
    """Full-precision gradient all-reduce during warm-up, then 8-bit momentum averaging (see the module docstring).

    Args:
        q_adam_optimizer: the model's :class:`QAdamOptimizer`. ``None`` when it is bound later through
            ``bind_optimizers`` (as the Lightning strategy does).
        hierarchical: in the compressed phase, average inside each node at full precision first and run the
            8-bit scatter-gather among node leaders only (with one node this is a full-precision all-reduce).
            The warm-up all-reduce is two-level too when the groups are.
    """

    single_node_effect = "nothing is compressed: after the warm-up, the momentum is all-reduced at full precision"
    impl_class = QAdamImpl
    steps_from_gradients = False
    misplaced_keywords: ClassVar[dict[str, str]] = {
        key: f"`{key}` is set on the optimizer: QAdamOptimizer(params, {key}=...)."
        for key in ("lr", "warmup_steps", "betas", "eps", "weight_decay")
    }

    def check_optimizers(self, optimizers: Sequence[Optimizer], lr_schedulers: Sequence[Any]) -> None:
        """Require exactly one :class:`QAdamOptimizer` and at most one LR scheduler (Bagua's rule).

        Args:
            optimizers: the optimizers that will update the model.
            lr_schedulers: the LR schedulers (or scheduler configurations) that go with them.

        Raises:
            ValueError: the rule does not hold; the message starts with "Bagua QAdam can only accept one
                QAdamOptimizer and one LR Scheduler" and says how to set the model up.
        """
        check_qadam_configuration(optimizers, lr_schedulers)

    def __init__(self, q_adam_optimizer: QAdamOptimizer | None = None, hierarchical: bool = True) -> None:
        if q_adam_optimizer is not None:
            check_keyword_type(self.name, "q_adam_optimizer", q_adam_optimizer, QAdamOptimizer)
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        self.q_adam_optimizer = q_adam_optimizer
        self.hierarchical = hierarchical

    @property
    def optimizer(self) -> QAdamOptimizer | None:
        """The optimizer given as ``q_adam_optimizer`` (Bagua's name for it); ``None`` when bound later."""
        return self.q_adam_optimizer


def qadam_hook(state: QAdamState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communicate one bucket: its gradients during warm-up, its parameters' momenta afterwards.

    1. Ask the optimizer which phase the coming step is in for each of the bucket's parameters.
    2. Warm-up, or parameters in both phases: all-reduce the gradients at full precision (mean) and return them;
       the optimizer then updates each parameter's ``m`` (and ``v`` in warm-up) from the average.
    3. Compressed: ``m_i = b1 * m + (1 - b1) * (g_i + weight_decay * x)`` for the bucket's parameters, flattened;
       ``m = mean_i m_i`` by 8-bit scatter-gather (run flat on CUDA, replayed as a CUDA graph once it has run
       twice, as ``bytegrad``'s buckets are); ``m`` written back into the optimizer; the local gradients returned
       untouched.

    Args:
        state: the phases' states and the bound optimizer.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the bucket's gradients.
    """
    optimizer = state.require_optimizer()
    params = bucket.parameters()
    buffer = bucket.buffer()
    index, last = bucket.index(), bucket.is_last()
    if index == 0:  # DDP's reducer hands the buckets over in index order
        state.on_executor = False
    phases = {optimizer.is_compressed_step(param) for param in params}
    compressed = phases == {True}
    state.last_compressed = compressed
    if len(phases) > 1 and not state.warned_mixed:
        state.warned_mixed = True
        if state.full_precision.groups.rank == 0:
            log.warning(
                "qadam: gradient bucket %d holds parameters in the warm-up and in the compressed phase (one had no"
                " gradient in some steps, or their parameter groups have different warmup_steps); such a bucket is"
                " all-reduced at full precision. Give every group the same warmup_steps, and keep parameters that"
                " get no gradient out of the optimizer, to compress every bucket.",
                index,
            )
    if not compressed:
        if not state.on_executor:
            return gradient_allreduce_hook(state.full_precision, bucket)
        state.on_executor = True
        return state.executor.submit(lambda: all_reduce_bucket(state.full_precision, buffer), last=last)
    state.on_executor = True
    momenta = optimizer.bucket_momenta(index, params, buffer, bucket.gradients)
    gradients = None if momenta.reads_buffer else bucket.gradients()
    compressed_state = state.compressed
    # Flat, the momenta's exchange is the same kernels and collectives on one communicator at every step: on CUDA
    # it is replayed as one graph. The momenta themselves are computed eagerly: they read the optimizer's
    # hyper-parameters, which a schedule may change, and its state, which loading a checkpoint replaces.
    graphable = compressed_state.exchanges_flat

    def exchange(momentum: Tensor) -> Tensor:
        return reduce_bucket(compressed_state, momentum)

    def job() -> Tensor:
        # The local gradients stay in the bucket until the returned future completes; computed in the job, the
        # momentum is made on the executor's stream (on CUDA), off the stream backward runs on.
        momentum = momenta.local(buffer, gradients)
        if graphable:
            key = ("qadam", index, momentum.numel(), momentum.dtype)
            state.executor.run_part(key, momentum, exchange, compressed_state.counter, last=last)
        else:
            exchange(momentum)
        momenta.store(momentum)
        return buffer

    return state.executor.submit(job, last=last)


def check_qadam_configuration(optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any]) -> None:
    """Check the Lightning strategy's rule for ``qadam``: one :class:`QAdamOptimizer`, at most one LR scheduler.

    Args:
        optimizers: the optimizers ``configure_optimizers`` returned.
        lr_scheduler_configs: the LR scheduler configurations it returned.

    Raises:
        ValueError: the rule does not hold; the message starts with "Bagua QAdam can only accept one
            QAdamOptimizer and one LR Scheduler".
    """
    if len(optimizers) != 1 or not isinstance(optimizers[0], QAdamOptimizer) or len(lr_scheduler_configs) > 1:
        raise ValueError(
            f"{QADAM_CONFIGURATION_ERROR}, got optimizers {[type(o).__name__ for o in optimizers]} and"
            f" {len(lr_scheduler_configs)} LR scheduler(s). Give the model a single lightning_bagua.QAdamOptimizer"
            " over all its parameters: return it from `configure_optimizers` (Trainer), or"
            " `fabric.setup(model, QAdamOptimizer(model.parameters()))` (Fabric)."
        )
