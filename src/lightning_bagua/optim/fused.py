"""``fuse_optimizer``: update many parameters with one elementwise step over flat storage.

An optimizer step over many small tensors spends most of its time on per-tensor overhead: every tensor costs
Python bookkeeping and a few kernel launches. :func:`fuse_optimizer` lays each group's parameters, gradients and
state out in flat buffers (the parameters stay the same ``Parameter`` objects; their ``.data`` and ``.grad`` become
views into the buffers) and adds ``optimizer.fuse_step()``, which shows the optimizer one flat tensor per buffer and
runs its own ``step`` on that. For an elementwise update, one step over the concatenation is the same arithmetic as
the steps over the pieces, so the results equal the unfused optimizer's.

How it relates to torch's own options: ``foreach=True`` (multi-tensor kernels, the default on GPUs) and
``fused=True`` (one fused kernel over all tensors, for Adam, AdamW, SGD and Adagrad) cut the kernel launches without
moving memory, but still gather and check every tensor in Python on every step. ``fuse_step`` leaves one tensor per
buffer to handle, which suits models with thousands of small tensors and the optimizers that have no fused kernel;
it composes with both options, which then act on the flat tensors (``fused=True`` under ``fuse_step`` was the
fastest variant in ``benchmarks/micro/fused_optimizer.py``). With few, large tensors there is little to gain, and
``fused=True`` alone is the simpler choice where it exists. Results are bitwise equal to the unfused optimizer's
with the single-tensor and foreach paths; with ``fused=True`` they agree to rounding only, because torch's CPU fused
kernels round a tensor's vectorised body and its tail differently, and concatenation moves the tails.

Bagua's ``fuse_optimizer`` took any optimizer. This one takes torch's elementwise optimizers only (see
``_ELEMENTWISE``): an update that reads a whole tensor (a norm, as in LAMB or LARS; a line search, as in LBFGS;
factored moments, as in Adafactor) changes when tensors are concatenated, so it is refused rather than silently
computing something else.

With :class:`~lightning_bagua.BaguaStrategy`, use ``flatten=False``. With ``flatten=True`` the gradients are views
into the engine's communication buckets, which the engine re-points them to in every backward; ``fuse_step`` would
then copy every gradient into its own buffer on every step, and nothing would be gained. Under Lightning, route the
optimizer's ``step`` to ``fuse_step`` so that Lightning's closure, clipping and precision handling still run::

    def configure_optimizers(self):
        optimizer = fuse_optimizer(torch.optim.AdamW(self.parameters(), lr=1e-3))
        optimizer.step = optimizer.fuse_step
        return optimizer
"""

import logging
from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_bagua.engine._torch_compat import mark_optimizer_stepped

__all__ = ["fuse_optimizer"]

log = logging.getLogger(__name__)

_OptimizerT = TypeVar("_OptimizerT", bound=Optimizer)

_ATTRIBUTE = "_lightning_bagua_fuser"

_ADAM_STATE = (frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), frozenset({"step"}))

# Torch's optimizers whose update of an element reads only that element of the parameter, the gradient and the
# state, plus per-parameter scalars that evolve alike for all parameters (the step count, ...). For these, a step
# over concatenated tensors equals the steps over the pieces. Matched by exact class: a subclass may change the
# update. Each entry names the state the class keeps: (entries shaped like the parameter, scalar entries).
_ELEMENTWISE: dict[type[Optimizer], tuple[frozenset[str], frozenset[str]]] = {
    torch.optim.SGD: (frozenset({"momentum_buffer"}), frozenset()),
    torch.optim.Adam: _ADAM_STATE,
    torch.optim.AdamW: _ADAM_STATE,
    torch.optim.RMSprop: (frozenset({"square_avg", "momentum_buffer", "grad_avg"}), frozenset({"step"})),
    torch.optim.Adagrad: (frozenset({"sum"}), frozenset({"step"})),
    torch.optim.Adamax: (frozenset({"exp_avg", "exp_inf"}), frozenset({"step"})),
    torch.optim.NAdam: (frozenset({"exp_avg", "exp_avg_sq"}), frozenset({"step", "mu_product"})),
    torch.optim.RAdam: (frozenset({"exp_avg", "exp_avg_sq"}), frozenset({"step"})),
    torch.optim.Adadelta: (frozenset({"square_avg", "acc_delta"}), frozenset({"step"})),
    torch.optim.Rprop: (frozenset({"prev", "step_size"}), frozenset({"step"})),
    torch.optim.ASGD: (frozenset({"ax"}), frozenset({"step", "eta", "mu"})),
}

# What `_Run.prepare` decides for a step.
_FUSED, _EACH, _SKIP = "fused", "each", "skip"

# A parameter's place in a flat buffer: storage offset, shape and strides of its view.
_Layout = tuple[int, tuple[int, ...], tuple[int, ...]]


def fuse_optimizer(optimizer: _OptimizerT, do_flatten: bool = True, check_flatten: bool = True) -> _OptimizerT:
    """Add ``optimizer.fuse_step()``, which updates each group's parameters as one flat tensor.

    With ``do_flatten``, each parameter group's trainable parameters are split by dtype and device, and each part is
    copied into one flat buffer; so are their gradients and optimizer state, now and whenever they are created later
    (the state by the first step). The parameters stay the same ``Parameter`` objects, and ``optimizer.step()``,
    ``state_dict()`` and ``load_state_dict()`` keep working on them as before, in torch's usual format.
    ``fuse_step(closure=None)`` then steps every buffer as one tensor, with the results of ``step()``.

    ``check_flatten`` makes every ``fuse_step`` first verify that the parameters and gradients are still views of
    the buffers, and copy them back in where they are not. That costs a Python loop over the parameters (about a
    microsecond each) on every step, plus a copy of every gradient on steps after ``zero_grad(set_to_none=True)``
    (torch's default), since the next backward allocates new gradients; ``zero_grad(set_to_none=False)`` avoids the
    copies. The check also lets ``fuse_step`` treat parameters without a gradient as ``step()`` does: a buffer whose
    parameters all lack one is skipped, and one where only some lack one is stepped tensor by tensor. With
    ``check_flatten=False`` nothing is verified: every buffer is stepped whole, with whatever its gradient buffer
    holds, so parameters without a gradient get one (zeros, in the buffer) at fusing, and the gradients must stay
    where they are: zero them with ``zero_grad(set_to_none=False)`` (in Lightning, override the module's
    ``optimizer_zero_grad``), or ``fuse_step`` steps with stale values.

    Without ``do_flatten`` nothing is moved: each ``fuse_step`` looks for parameters that already lie back to back in
    memory, with their gradients back to back too, and steps each such run as one tensor and the rest one by one
    (with ``check_flatten=False`` it looks once, at the first ``fuse_step``). The state of a run is kept in flat
    buffers of the fuser's own either way: it is the optimizer's memory, not the model's.

    Args:
        optimizer: an instance of one of torch's elementwise optimizers: ``SGD``, ``Adam``, ``AdamW``, ``RMSprop``,
            ``Adagrad``, ``Adamax``, ``NAdam``, ``RAdam``, ``Adadelta``, ``Rprop`` or ``ASGD``.
        do_flatten: copy parameters, gradients and state into flat buffers now.
        check_flatten: verify before every ``fuse_step`` that they are still there.

    Returns:
        The same optimizer, with ``fuse_step`` added.

    Raises:
        TypeError: if ``optimizer`` is not an optimizer, or not one whose update is elementwise.
        ValueError: if a group uses ``differentiable=True``.
        RuntimeError: if the optimizer was fused before.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if getattr(optimizer, _ATTRIBUTE, None) is not None:
        raise RuntimeError(f"This {type(optimizer).__name__} was fused already; fuse_optimizer takes it only once.")
    if type(optimizer) not in _ELEMENTWISE:
        supported = ", ".join(sorted(cls.__name__ for cls in _ELEMENTWISE))
        raise TypeError(
            f"fuse_optimizer cannot fuse {type(optimizer).__qualname__}: a fused step equals the per-tensor steps only"
            " for an update that treats every element on its own, which is known for torch's own optimizers"
            f" {supported} (exactly these classes, not subclasses). Optimizers that use whole-tensor quantities"
            " (norms as in LAMB or LARS, line searches as in LBFGS, factored moments as in Adafactor) would compute"
            " something else."
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"Parameter group {index} uses differentiable=True, which fuse_optimizer does not support."
            )
    fuser = _Fuser(optimizer, do_flatten=bool(do_flatten), check_flatten=bool(check_flatten))
    setattr(optimizer, _ATTRIBUTE, fuser)
    # Bound as a method, not a closure: torch's LR schedulers wrap `optimizer.step` by its `__func__`, which is how
    # `optimizer.step = optimizer.fuse_step` keeps working with them.
    optimizer.fuse_step = MethodType(_fuse_step, optimizer)  # type: ignore[attr-defined]
    return optimizer


def _fuse_step(optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """Step the optimizer with each flat buffer presented as one parameter; return the closure's loss, if any.

    Args:
        optimizer: the fused optimizer (bound: this is ``optimizer.fuse_step``).
        closure: reevaluates the model and returns the loss; called once, before the update.

    Returns:
        The closure's result, or ``None`` without a closure.
    """
    fuser: _Fuser = getattr(optimizer, _ATTRIBUTE)
    return fuser.step(closure)


class _Run:
    """Parameters stepped as one tensor: their data, gradients and state are slices of flat buffers.

    The state kept for the flat tensor lives in ``states`` (parameter-shaped entries, one flat buffer each) and
    ``scalars`` (one 0-d tensor each). Each parameter's own state entries are views into those buffers, and its
    scalar entries views into a ``[len(params)]`` table per key, so that ``optimizer.state`` stays complete and in
    torch's format, and one copy per key brings the scalars up to date after a fused step.

    The state takes whatever form the optimizer gives it, since that form differs between torch releases:

    - A scalar entry the optimizer keeps as a Python number rather than a 0-d tensor (the step count of
      ``RMSprop``, ``Adadelta`` and ``Rprop`` in torch 2.2, checked; a 0-d tensor in the releases after
      pytorch/pytorch#122007 of March 2024, 2.13 checked) is kept in ``numbers``, and every parameter's entry is
      that number.
    - A parameter-shaped entry the optimizer sets to ``None`` (``SGD``'s ``momentum_buffer`` without momentum in
      torch 2.2, checked; later releases, 2.13 checked, record no entry) is ``None`` for every parameter too.
    """

    def __init__(
        self,
        params: list[Parameter],
        layouts: list[_Layout],
        flat_data: Tensor,
        flat_grad: Tensor,
        keys: tuple[frozenset[str], frozenset[str]],
    ) -> None:
        self.params = params
        self.layouts = layouts
        self.flat = Parameter(flat_data, requires_grad=flat_data.requires_grad)
        self.flat.grad = flat_grad
        self.grad_views = [_view(flat_grad, layout) for layout in layouts]
        self.param_pointers = [_view(flat_data, layout).data_ptr() for layout in layouts]
        self.elementwise_keys, self.scalar_keys = keys
        self.states: dict[str, Tensor] = {}
        self.state_views: dict[str, list[Tensor]] = {}
        self.scalars: dict[str, Tensor] = {}
        self.tables: dict[str, Tensor] = {}
        self.table_views: dict[str, list[Tensor]] = {}
        self.numbers: dict[str, int | float] = {}
        # Per-parameter state may no longer be views of the buffers (after load_state_dict(), step(), or a
        # tensor-by-tensor fuse_step); verified before the next fused step.
        self.state_dirty = True

    @property
    def name(self) -> str:
        return f"{len(self.params)} {self.flat.dtype} tensors on {self.flat.device}"

    # ----------------------------------------------------------------------------------------- before a step

    def prepare(self, state: dict[Any, Any], check: bool, repair_params: bool) -> str:
        """Decide how to step this run, repairing what moved: fused, tensor by tensor, or not at all."""
        if check:
            if repair_params:
                self._repair_params()
            pairs = enumerate(zip(self.params, self.grad_views, strict=True))
            moved = [i for i, (p, view) in pairs if p.grad is not view]
            if moved:
                grads = [self.params[i].grad for i in moved]
                missing = sum(grad is None for grad in grads)
                if missing == len(self.params):
                    return _SKIP
                if missing or any(grad is not None and grad.layout != torch.strided for grad in grads):
                    self.state_dirty = True
                    return _EACH
                targets, sources = [], []
                for i, grad in zip(moved, grads, strict=True):
                    view = self.grad_views[i]
                    assert grad is not None
                    # A new tensor object over the same memory (as an engine may hand out) needs no copy.
                    if grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                        targets.append(view)
                        sources.append(grad)
                    self.params[i].grad = view
                _copy_all(targets, sources)
        if self.state_dirty:
            if not self._adopt_state(state):
                return _EACH
            self.state_dirty = False
        return _FUSED

    def _repair_params(self) -> None:
        if [p.data_ptr() for p in self.params] == self.param_pointers:
            return
        for p, layout, pointer in zip(self.params, self.layouts, self.param_pointers, strict=True):
            if p.data_ptr() == pointer:
                continue
            if p.dtype != self.flat.dtype or p.device != self.flat.device or tuple(p.shape) != layout[1]:
                raise RuntimeError(
                    f"A fused parameter changed to shape {tuple(p.shape)}, {p.dtype} on {p.device} after"
                    f" fuse_optimizer (it was {layout[1]}, {self.flat.dtype} on {self.flat.device}). Move or convert"
                    " the model before creating and fusing its optimizer."
                )
            view = _view(self.flat.detach(), layout)
            view.copy_(p.detach())
            p.data = view

    def _adopt_state(self, state: dict[Any, Any]) -> bool:
        """Make every parameter's state a view of the buffers; ``False`` where the parameters' states disagree."""
        entries = [state.get(p) or {} for p in self.params]
        keys = set(entries[0])
        if any(set(entry) != keys for entry in entries[1:]):
            return False  # some parameters were stepped without the others
        unknown = keys - self.elementwise_keys - self.scalar_keys
        if unknown:
            raise RuntimeError(f"Unexpected optimizer state {sorted(unknown)}; fuse_optimizer knows how to lay out only"
                               f" {sorted(self.elementwise_keys | self.scalar_keys)}.")  # fmt: skip
        for key in keys & self.scalar_keys:
            values = [entry[key] for entry in entries]
            if all(_is_number(value) for value in values):
                if any(value != values[0] for value in values[1:]):
                    return False  # e.g. step counts differ: one update cannot serve all
                self._set_number(key, values[0], state)
                continue
            if not all(isinstance(value, Tensor) and value.numel() == 1 for value in values):
                return False
            self.numbers.pop(key, None)
            table = self.tables.get(key)
            if table is None or table.dtype != values[0].dtype or table.device != values[0].device:
                self._set_scalar(key, values[0].detach().reshape(()).clone(), state)
                table = self.tables[key]
            views = self.table_views[key]
            for i, (value, view) in enumerate(zip(values, views, strict=True)):
                if value is not view:
                    view.copy_(value.reshape(()))
                    state[self.params[i]][key] = view
            if not torch.equal(table, table[:1].expand_as(table)):
                return False  # e.g. step counts differ: one update cannot serve all
            self.scalars[key].copy_(table[0])
        for key in keys & self.elementwise_keys:
            values = [entry[key] for entry in entries]
            if all(value is None for value in values):
                continue
            if not all(isinstance(value, Tensor) and value.layout == torch.strided for value in values):
                return False
            if key not in self.states:
                self._set_elementwise(key, torch.zeros_like(self.flat, dtype=values[0].dtype), state, values)
                continue
            for i, (value, view) in enumerate(zip(values, self.state_views[key], strict=True)):
                if value is not view:
                    view.copy_(value)
                    state[self.params[i]][key] = view
        # Entries the flat tensor has but the parameters lost (load_state_dict of a state without them).
        for key in set(self.states) - keys:
            del self.states[key], self.state_views[key]
        for key in set(self.scalars) - keys:
            del self.scalars[key], self.tables[key], self.table_views[key]
        for key in set(self.numbers) - keys:
            del self.numbers[key]
        return True

    def flat_state(self) -> dict[str, Tensor | int | float]:
        return {**self.states, **self.scalars, **self.numbers}

    # ------------------------------------------------------------------------------------------ after a step

    def absorb(self, flat_state: dict[str, Any], state: dict[Any, Any]) -> None:
        """Take over what the step left in the flat tensor's state: new buffers, and the scalars' new values."""
        for key, value in flat_state.items():
            if key in self.elementwise_keys:
                if value is None:
                    # No buffer (SGD without momentum on torch 2.2): the parameters' entries say so as torch's do.
                    self.states.pop(key, None)
                    self.state_views.pop(key, None)
                    for p in self.params:
                        state[p][key] = None
                    continue
                if value is self.states.get(key):
                    continue
                if not isinstance(value, Tensor) or value.shape != self.flat.shape:
                    raise RuntimeError(f"The optimizer left state {key!r} of an unexpected kind for a flat tensor.")
                self._set_elementwise(key, value, state)
            elif key in self.scalar_keys and _is_number(value):
                self._set_number(key, value, state)
            elif key in self.scalar_keys:
                self.numbers.pop(key, None)
                if value is not self.scalars.get(key):
                    self._set_scalar(key, value, state)
                self.tables[key].copy_(value.expand_as(self.tables[key]))
            else:
                raise RuntimeError(
                    f"The optimizer created state {key!r}, which fuse_optimizer does not know how to lay out per"
                    f" parameter; it knows {sorted(self.elementwise_keys | self.scalar_keys)}."
                )

    def _set_elementwise(
        self, key: str, buffer: Tensor, state: dict[Any, Any], values: Sequence[Tensor | None] | None = None
    ) -> None:
        self.states[key] = buffer
        views = [_view(buffer, layout) for layout in self.layouts]
        self.state_views[key] = views
        for i, (p, view) in enumerate(zip(self.params, views, strict=True)):
            if values is not None and values[i] is not None:
                view.copy_(values[i])  # type: ignore[arg-type]
            state[p][key] = view

    def _set_number(self, key: str, value: float, state: dict[Any, Any]) -> None:
        # A number cannot be viewed, so each parameter gets the value itself; the next step replaces it in the
        # flat tensor's state rather than changing it in place, and `absorb` hands the new one out again.
        if key in self.scalars:
            del self.scalars[key], self.tables[key], self.table_views[key]
        self.numbers[key] = value
        for p in self.params:
            state[p][key] = value

    def _set_scalar(self, key: str, value: Tensor, state: dict[Any, Any]) -> None:
        self.scalars[key] = value
        table = value.detach().reshape(1).repeat(len(self.params))
        self.tables[key] = table
        views = [table[i] for i in range(len(self.params))]
        self.table_views[key] = views
        for p, view in zip(self.params, views, strict=True):
            state[p][key] = view


class _Fuser:
    """The flat layout of one optimizer, and its ``fuse_step``."""

    def __init__(self, optimizer: Optimizer, do_flatten: bool, check_flatten: bool) -> None:
        self.optimizer = optimizer
        self.do_flatten = do_flatten
        self.check_flatten = check_flatten
        self.keys = _ELEMENTWISE[type(optimizer)]
        self.runs: list[list[_Run]] = []
        self.each: list[list[Tensor]] = []  # per group: the parameters stepped one by one
        self.group_params: list[list[Tensor]] = []
        self.detected: dict[tuple[int, ...], _Run] = {}
        self.stepping = False
        self.warned: set[str] = set()
        # Both may replace per-parameter state behind the fuser's back; runs verify their state before the next step.
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_load_state_dict_post_hook(self._after_load)
        if do_flatten:
            for index in range(len(optimizer.param_groups)):
                self._flatten_group(index)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self.stepping:
            self._mark_state_dirty()

    def _after_load(self, optimizer: Optimizer) -> None:
        self._mark_state_dirty()

    def _mark_state_dirty(self) -> None:
        for runs in [*self.runs, self.detected.values()]:
            for run in runs:
                run.state_dirty = True

    # ------------------------------------------------------------------------------------------------ layout

    def _flatten_group(self, index: int) -> None:
        group = self.optimizer.param_groups[index]
        params: list[Tensor] = group["params"]
        parts: dict[tuple[torch.dtype, torch.device], list[Parameter]] = {}
        each: list[Tensor] = []
        for p in params:
            if isinstance(p, Parameter) and p.requires_grad and p.layout == torch.strided:
                parts.setdefault((p.dtype, p.device), []).append(p)
            else:
                each.append(p)  # frozen or unusual: stepped as itself (and skipped by the optimizer without a grad)
        runs = []
        for part in parts.values():
            if len(part) == 1:
                each.extend(part)
            else:
                runs.append(self._flatten(part))
        if index < len(self.runs):
            self.runs[index], self.each[index], self.group_params[index] = runs, each, params
        else:
            self.runs.append(runs)
            self.each.append(each)
            self.group_params.append(params)
        log.debug(f"fuse_optimizer: group {index}: {[run.name for run in runs]}, {len(each)} tensors on their own")

    def _flatten(self, params: list[Parameter]) -> _Run:
        layouts = []
        offset = 0
        for p in params:
            shape = tuple(p.shape)
            layouts.append((offset, shape, _dense_strides(p)))
            offset += p.numel()
        first = params[0]
        flat_data = torch.empty(offset, dtype=first.dtype, device=first.device)
        run = _Run(params, layouts, flat_data, torch.zeros_like(flat_data), self.keys)
        for p, layout, grad_view in zip(params, layouts, run.grad_views, strict=True):
            view = _view(flat_data, layout)
            view.copy_(p.detach())
            p.data = view
            if p.grad is not None and p.grad.layout == torch.strided:
                grad_view.copy_(p.grad)
                p.grad = grad_view
            elif p.grad is None and not self.check_flatten:
                # Unchecked buffers are stepped whole, so every gradient must be in place before the first
                # backward, which then accumulates into it.
                p.grad = grad_view
        run._adopt_state(self.optimizer.state)  # where the states disagree, a later step tries again
        return run

    def _detect_runs(self, params: list[Tensor]) -> tuple[list[_Run], list[Tensor]]:
        """Find parameters that lie back to back in memory, gradients too (for ``do_flatten=False``)."""
        candidates: dict[tuple[torch.dtype, torch.device], list[Parameter]] = {}
        each: list[Tensor] = []
        for p in params:
            grad = p.grad
            if (
                isinstance(p, Parameter)
                and grad is not None
                and grad.layout == torch.strided
                and p.is_contiguous()
                and grad.is_contiguous()
            ):
                candidates.setdefault((p.dtype, p.device), []).append(p)
            else:
                each.append(p)
        runs: list[_Run] = []
        for part in candidates.values():
            part.sort(key=lambda p: p.data_ptr())
            chain = [part[0]]
            for p in part[1:]:
                previous = chain[-1]
                size = previous.numel() * previous.element_size()
                if (
                    p.data_ptr() == previous.data_ptr() + size
                    and p.grad.data_ptr() == previous.grad.data_ptr() + size  # type: ignore[union-attr]
                    and p.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr()
                    and p.grad.untyped_storage().data_ptr() == previous.grad.untyped_storage().data_ptr()  # type: ignore[union-attr]
                ):
                    chain.append(p)
                    continue
                self._close_chain(chain, runs, each)
                chain = [p]
            self._close_chain(chain, runs, each)
        return runs, each

    def _close_chain(self, chain: list[Parameter], runs: list[_Run], each: list[Tensor]) -> None:
        if len(chain) == 1:
            each.append(chain[0])
            return
        first = chain[0]
        grad = first.grad
        assert grad is not None
        key = (*(id(p) for p in chain), first.data_ptr(), grad.data_ptr())
        run = self.detected.get(key)
        if run is None:
            total = sum(p.numel() for p in chain)
            flat_data = first.detach().as_strided((total,), (1,), first.storage_offset())
            flat_grad = grad.as_strided((total,), (1,), grad.storage_offset())
            layouts = []
            offset = 0
            for p in chain:
                layouts.append((offset, tuple(p.shape), _contiguous_strides(tuple(p.shape))))
                offset += p.numel()
            run = _Run(chain, layouts, flat_data, flat_grad, self.keys)
            self.detected[key] = run
        runs.append(run)

    def _plan(self, index: int, params: list[Tensor]) -> tuple[list[_Run], list[Tensor]]:
        if self.do_flatten:
            if index >= len(self.runs) or self.group_params[index] is not params:
                self._flatten_group(index)  # added by add_param_group, or its parameter list was replaced
            return self.runs[index], self.each[index]
        if self.check_flatten or index >= len(self.runs):
            runs, each = self._detect_runs(params)
            if index < len(self.runs):
                self.runs[index], self.each[index] = runs, each
            else:
                self.runs.append(runs)
                self.each.append(each)
            live = {id(run) for group_runs in self.runs for run in group_runs}
            self.detected = {key: run for key, run in self.detected.items() if id(run) in live}
        return self.runs[index], self.each[index]

    # -------------------------------------------------------------------------------------------------- step

    def step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        optimizer = self.optimizer
        state = optimizer.state
        groups = optimizer.param_groups
        presented: list[list[Tensor]] = []
        fused: list[_Run] = []
        for index, group in enumerate(groups):
            runs, each = self._plan(index, group["params"])
            tensors = list(each)
            for run in runs:
                decision = run.prepare(state, self.check_flatten, repair_params=self.do_flatten)
                if decision == _FUSED:
                    tensors.append(run.flat)
                    fused.append(run)
                elif decision == _EACH:
                    tensors.extend(run.params)
                    run.state_dirty = True  # stepping them one by one may re-allocate their state
                    self._warn_once(run)
            presented.append(tensors)
        originals = [group["params"] for group in groups]
        self.stepping = True
        try:
            for group, tensors in zip(groups, presented, strict=True):
                group["params"] = tensors
            for run in fused:
                if run.states or run.scalars or run.numbers:
                    state[run.flat] = run.flat_state()
            # The class's step, not `optimizer.step`: that may be routed to fuse_step itself.
            type(optimizer).step(optimizer)
        finally:
            for group, params in zip(groups, originals, strict=True):
                group["params"] = params
            self.stepping = False
            for run in fused:
                run.absorb(state.pop(run.flat, None) or {}, state)
        mark_optimizer_stepped(optimizer)
        return loss

    def _warn_once(self, run: _Run) -> None:
        if run.name not in self.warned:
            self.warned.add(run.name)
            log.info(
                f"fuse_optimizer: stepping {run.name} one by one: some have no gradient, or their optimizer states"
                " differ (e.g. step counts, after steps that skipped some of them)."
            )


def _copy_all(targets: list[Tensor], sources: list[Tensor]) -> None:
    if not targets:
        return
    if hasattr(torch, "_foreach_copy_"):
        # One call for all the copies: after zero_grad(set_to_none=True) every gradient is copied on every step.
        torch._foreach_copy_(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _is_number(value: object) -> bool:
    """Whether ``value`` is a scalar state entry kept as a Python number (see :class:`_Run`)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    stride = 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


def _dense_strides(tensor: Tensor) -> tuple[int, ...]:
    """Keep a dense layout such as channels-last (the gradients follow the parameter's); else row-major."""
    shape = tuple(tensor.shape)
    if tensor.is_contiguous() or tensor.numel() == 0:
        return _contiguous_strides(shape)
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: tensor.stride(d)):
        if shape[dim] == 1:
            continue
        if tensor.stride(dim) != expected:
            return _contiguous_strides(shape)
        expected *= shape[dim]
    return tuple(tensor.stride())


def _view(buffer: Tensor, layout: _Layout) -> Tensor:
    offset, shape, strides = layout
    return buffer.as_strided(shape, strides, buffer.storage_offset() + offset)
