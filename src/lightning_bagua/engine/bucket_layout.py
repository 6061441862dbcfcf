"""Keep a resumed run's gradient buckets equal to the uninterrupted run's, so compressed algorithms resume exactly."""

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_bagua.engine.algorithms.base import CommunicationHook

__all__ = ["BucketLayout"]

log = logging.getLogger(__name__)


class BucketLayout:
    """Record which parameters torch's reducer puts in each bucket, and replay a saved layout after a resume.

    A new DDP wrapper puts every parameter in one bucket for its first step and, from the second on, in buckets
    of the configured size in the order gradients became ready. The compressed algorithms quantise each bucket
    in chunks with their own ranges, so the same gradients round differently in different buckets: a run resumed
    into a new wrapper would round its first step unlike the uninterrupted run. The layout of the last completed
    step travels with the algorithm state; on the new wrapper's first step, the one bucket is cut into the saved
    buckets, and the algorithm's hook runs on each in order, as in the uninterrupted run. From the second step on
    torch's own rebuilt buckets are the saved ones again (the order gradients become ready does not change).

    Args:
        named_parameters: the parameters the reducer buckets, with their names.
    """

    def __init__(self, named_parameters: Sequence[tuple[str, Parameter]]) -> None:
        self._name_of = {id(parameter): name for name, parameter in named_parameters}
        self._names = set(self._name_of.values())
        self._current: dict[int, list[str]] = {}
        self._completed: list[list[str]] = []
        self._replay: list[list[str]] | None = None

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket of the last step whose last bucket was handed over, in bucket order."""
        return [list(names) for names in self._completed]

    def restore(self, buckets: Sequence[Sequence[str]]) -> None:
        """Cut the next all-in-one bucket into ``buckets`` (from :attr:`buckets` of the run being resumed).

        Args:
            buckets: parameter names per bucket; they must name every bucketed parameter once.

        Raises:
            ValueError: if the names are not exactly this model's bucketed parameters.
        """
        names = [name for bucket in buckets for name in bucket]
        if sorted(names) != sorted(self._names):
            unknown = sorted(set(names) - self._names)
            missing = sorted(self._names - set(names))
            raise ValueError(
                "The checkpoint's gradient bucket layout does not fit this model"
                f" (unknown: {unknown or 'none'}, missing: {missing or 'none'}). Resume the model that wrote it,"
                " or drop 'bucket_layout' from the saved algorithm state to start with torch's own buckets."
            )
        self._replay = [list(bucket) for bucket in buckets]
        self._completed = [list(bucket) for bucket in buckets]

    def wrap_hook(self, hook: CommunicationHook) -> CommunicationHook:
        """Return ``hook`` with the layout recorded around it, and a saved layout replayed when one is pending.

        Args:
            hook: the algorithm's communication hook.

        Returns:
            A hook with the same contract.
        """

        def layout_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
            names = [self._name_of[id(parameter)] for parameter in bucket.parameters()]
            replay, self._replay = self._replay, None
            # Only the all-in-one bucket is cut, and only where its order differs from the saved buckets'.
            if replay is not None and len(names) == len(self._names) and replay != [names]:
                return self._run_replayed(hook, state, bucket, names, replay)
            self._current[bucket.index()] = names
            if bucket.is_last():
                self._completed = [self._current[index] for index in sorted(self._current)]
                self._current = {}
            return hook(state, bucket)

        return layout_hook

    def _run_replayed(
        self,
        hook: CommunicationHook,
        state: Any,
        bucket: dist.GradBucket,
        names: list[str],
        replay: list[list[str]],
    ) -> torch.futures.Future[Tensor]:
        views = dict(zip(names, bucket.gradients(), strict=True))
        parameters = dict(zip(names, bucket.parameters(), strict=True))
        log.debug("Replaying the saved layout of %d gradient buckets on the all-in-one first bucket", len(replay))
        futures = []
        for index, members in enumerate(replay):
            part = _BucketPart(
                index, index == len(replay) - 1, [parameters[n] for n in members], [views[n] for n in members]
            )
            futures.append((part, hook(state, part)))  # type: ignore[arg-type]  # a duck-typed GradBucket
        buffer = bucket.buffer()

        def write_back(_: Any) -> Tensor:
            for part, future in futures:
                # `wait()`, not `value()`: this callback belongs to `collect_all`'s future, which knows no CUDA
                # streams, and an NCCL collective's future completes once the collective is queued. `wait()` makes
                # this callback's stream wait for the collective before the copy reads its result.
                part.copy_result_to(future.wait())
            if buffer.is_cuda:
                # The reducer reads the bucket on its own stream, and the parts' memory goes back to the allocator
                # when this returns: both must find the copies done. Once per resumed run, so the host may wait.
                torch.cuda.current_stream(buffer.device).synchronize()
            return buffer

        return torch.futures.collect_all([future for _, future in futures]).then(write_back)


class _BucketPart:
    """One saved bucket cut out of the all-in-one bucket, with the methods of ``dist.GradBucket`` the hooks call."""

    def __init__(self, index: int, last: bool, parameters: list[Tensor], views: list[Tensor]) -> None:
        self._index = index
        self._last = last
        self._parameters = parameters
        self._views = views
        self._buffer = torch.cat([view.reshape(-1) for view in views])
        self._gradients = self._shaped_as_views(self._buffer)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> list[Tensor]:
        return self._parameters

    def gradients(self) -> list[Tensor]:
        return self._gradients

    def copy_result_to(self, result: Tensor) -> None:
        """Write the hook's result for this part into the all-in-one bucket's gradient views."""
        for view, value in zip(self._views, self._shaped_as_views(result), strict=True):
            view.copy_(value)

    def _shaped_as_views(self, flat: Tensor) -> list[Tensor]:
        """Cut the flat ``flat`` into consecutive pieces shaped like this part's gradients."""
        pieces = flat.split([view.numel() for view in self._views])
        return [piece.view_as(view) for piece, view in zip(pieces, self._views, strict=True)]
