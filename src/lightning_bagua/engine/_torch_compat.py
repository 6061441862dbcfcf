"""The torch private APIs the project relies on, in one place, each with why it is needed and what was checked.

Everything else in the package uses torch's public API, as far back as torch 2.2 (the declared floor), except where
an older release lacks it: then the function here has one branch per group of releases, each naming them. Each
function was checked on torch 2.2 and 2.13 (the floor and the newest that ran); when torch changes one of them, only
this module changes.
"""

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeGuard

import torch
import torch.distributed as dist
from packaging.version import Version
from torch.optim import Optimizer

__all__ = [
    "backward_context_out_of_tls",
    "default_store",
    "destroy_process_group",
    "first_bucket_capped_at",
    "mark_optimizer_stepped",
    "process_group_exists",
    "queue_backward_callback",
    "store_has_key",
]

# A value no key of the store holds: `store_has_key` compares against it.
_NO_VALUE = "\0lightning_bagua: no value\0"

# Whether the Python `ProcessGroup` object frees its C++ group with the GIL released: from torch 2.8 on
# (pytorch/pytorch#154976); see `destroy_process_group`.
_GROUP_FREED_WITHOUT_GIL = Version(torch.__version__).release >= (2, 8)


# The key under which torch's `autograd.graph._engine_run_backward` stashes the caller's `contextvars` context in the
# C++ thread-local state for the backward's duration.
_BACKWARD_CONTEXT_KEY = "context"


@contextmanager
def backward_context_out_of_tls() -> Iterator[None]:
    """Take the backward's Python ``contextvars`` context out of torch's thread-local state inside the block.

    Every collective and future made during a backward copies the C++ thread-local state, and since torch keeps the
    caller's ``contextvars`` context there for the backward (``torch._C._stash_obj_in_tls("context", ...)``, in
    ``torch/autograd/graph.py``), each copy holds a Python object. A Gloo worker that finishes such a work must take
    the GIL to let it go. If the thread that frees the work's group holds the GIL meanwhile, as a DDP reducer's
    destructor does while it joins the group's workers, both wait for good: a script that freed torch's own DDP
    right after its last backward hung so, with the worker in ``~ThreadLocalState`` waiting for the GIL (seen with
    gdb, torch 2.13). The engine's hooks and end-of-backward callbacks run inside this block, so that what they
    issue holds no Python object; the context is put back when the block ends. ``_is_key_in_tls``,
    ``_get_obj_in_tls``, ``_remove_obj_from_tls`` and ``_stash_obj_in_tls`` are private; where they are missing
    (older releases, which stash nothing), the block changes nothing.

    Yields:
        Nothing; the context is back in place after the block, also when it raises.
    """
    has_key = getattr(torch._C, "_is_key_in_tls", None)
    if has_key is None or not has_key(_BACKWARD_CONTEXT_KEY):
        yield
        return
    context = torch._C._get_obj_in_tls(_BACKWARD_CONTEXT_KEY)
    torch._C._remove_obj_from_tls(_BACKWARD_CONTEXT_KEY)
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls(_BACKWARD_CONTEXT_KEY, context)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass running now has finished, after the callbacks queued before it.

    DDP's reducer finalises a backward (waits for every bucket's future, writes the gradients) from a callback of
    the autograd engine queued at the first gradient; the algorithms that act once all buckets are reduced
    (decentralized's weight copy, async's weight release) and telemetry's end-of-backward mark queue theirs after
    it. torch exposes no public way to run code at the end of a backward: ``Variable._execution_engine`` is the
    engine DDP itself uses (``torch/nn/parallel/distributed.py``), present from torch 1.x through 2.14.

    The callback runs without the backward's Python context in torch's thread-local state
    (:func:`backward_context_out_of_tls`), so that the collectives it issues hold no Python object.

    Args:
        callback: called with no arguments on the thread that runs the backward.
    """

    def run_callback() -> None:
        with backward_context_out_of_tls():
            callback()

    torch.autograd.Variable._execution_engine.queue_callback(run_callback)


def default_store() -> dist.Store:
    """Return the rendezvous store of the default process group.

    Failure diagnosis writes each failing rank's report there and reads the others', so that a surviving rank
    can name the ranks that went silent. torch keeps the store private (``distributed_c10d._get_default_store``,
    unchanged from torch 1.8 through 2.14); opening a second store would need the rendezvous address and a port
    that a launcher may not give.

    Returns:
        The store.
    """
    return dist.distributed_c10d._get_default_store()


def mark_optimizer_stepped(optimizer: Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped, for a step made without calling ``optimizer.step``.

    A scheduler warns ("lr_scheduler.step() before optimizer.step()") unless the optimizer's ``_opt_called`` flag
    is set, which only the wrapped ``optimizer.step`` sets; the fused optimizer steps through the class's method
    instead. The flag is read by ``torch.optim.lr_scheduler`` from torch 1.1 through 2.14.

    Args:
        optimizer: the optimizer that just stepped.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


def store_has_key(store: dist.Store, key: str) -> bool:
    """Return whether ``key`` is set in ``store``, without waiting for it to be set.

    - torch with ``Store.check`` in its Python API (2.4 on; 2.13 checked): that method.
    - torch without it (2.2 checked): ``compare_set`` with a value no key holds as both the expected and the new
      value. For a key that is set it returns the key's value and changes nothing; for a missing key it returns
      the expected value and, that value not being empty, does not create the key. Every store type answers it
      without blocking (TCP, file and hash stores checked, each behind a ``PrefixStore``).

    Args:
        store: the store to look in.
        key: the key.

    Returns:
        Whether the key is set.
    """
    if hasattr(store, "check"):
        return bool(store.check([key]))
    return store.compare_set(key, _NO_VALUE, _NO_VALUE) != _NO_VALUE.encode()


@contextmanager
def first_bucket_capped_at(bucket_cap_mb: float) -> Iterator[None]:
    """Make a DDP reducer built inside the block cap its first bucket at ``bucket_cap_mb`` too, as it caps the others.

    A reducer rebuilds its buckets after the first step, in the order gradients became ready, with a size limit
    for the first bucket of its own:

    - torch 2.2 and 2.4 (checked): the limit is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) whatever
      ``bucket_cap_mb`` says, read when the reducer is built. So a smaller ``bucket_cap_mb`` left the first
      bucket at 1 MiB, and a model under 1 MiB in one bucket; the block sets the module global to the cap.
    - torch 2.13 (checked): an explicit ``bucket_cap_mb`` is also the first bucket's limit and the global is not
      read; setting it changes nothing.

    Args:
        bucket_cap_mb: the bucket size the reducer is given, in MiB.

    Yields:
        Nothing; the global is restored on leaving.
    """
    default = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(bucket_cap_mb * 1024 * 1024)
    try:
        yield
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = default


def process_group_exists(group: dist.ProcessGroup | None) -> TypeGuard[dist.ProcessGroup]:
    """Return whether ``group`` is still one of torch.distributed's live groups, so that destroying it is valid.

    A script may destroy the default group itself (``dist.destroy_process_group()``), which takes every subgroup
    with it, and may then start a new default group; a subgroup created before is then unknown to torch, and
    destroying it again raises ``ValueError: Invalid process group specified``. Only a group torch still lists may be
    destroyed. torch has no public query for this: ``distributed_c10d._world.pg_map`` (private, unchanged from torch
    2.0 through 2.13) is the registry that ``dist.destroy_process_group`` itself checks.

    Args:
        group: a group from ``dist.new_group`` (or what it returns on ranks outside the group), or ``None``.

    Returns:
        ``True`` when the group is registered with the current default group's world; ``False`` for ``None``, for
        a non-member's placeholder, and for every group once the default group is gone or was replaced.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    return isinstance(group, dist.ProcessGroup) and group in dist.distributed_c10d._world.pg_map


def destroy_process_group(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` as ``dist.destroy_process_group`` does, so that freeing it later cannot deadlock.

    When the last reference to a group goes, its Gloo backend's destructor joins the backend's worker threads. A
    worker may still be finishing a work whose future had a Python callback (a communication hook's ``then``),
    and it needs the GIL to let go of that callback.

    - torch 2.2 to 2.7 (2.2 checked): the Python ``ProcessGroup`` object frees the C++ group with the GIL held, so
      such a worker and the thread freeing the group wait for each other forever. It happened at eight Gloo ranks
      on a loaded machine, as the frame holding a finished model's groups unwound. The backends' own Python objects
      are freed with the GIL released (torch binds ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` so, unlike
      ``ProcessGroup``): a reference to each backend is kept until the group's Python object is gone, so that the
      backend is freed last, through its own object, without the GIL. ``ProcessGroup._get_backend`` and
      ``_device_types`` are private; both exist from torch 2.1 through 2.13.
    - torch 2.8 and later (2.13 checked): the ``ProcessGroup`` object is freed with the GIL released; torch's
      function is enough.

    The default group takes every other group with it, so then every group's backends are kept this way: a
    subgroup whose work still had a callback deadlocked the same way once its last reference went (a test's
    subgroup, at four Gloo ranks on a loaded machine, torch 2.2). The groups are listed from
    ``distributed_c10d._world.pg_map``, private, which exists from torch 2.0 through 2.13.

    Args:
        group: a group from ``dist.new_group``, or what it returns on ranks outside the group, or the default
            group (``dist.GroupMember.WORLD``), which destroys every group, as torch's function does.
    """
    if not _GROUP_FREED_WITHOUT_GIL and isinstance(group, dist.ProcessGroup):
        world = group is dist.GroupMember.WORLD
        for member in list(dist.distributed_c10d._world.pg_map) if world else [group]:
            backends = {id(backend): backend for backend in map(member._get_backend, member._device_types)}
            # Called when the group's Python object is freed, after it let go of the C++ group; `clear` drops the
            # last references to the backends there, which free them without the GIL.
            weakref.finalize(member, list(backends.values()).clear)
    dist.destroy_process_group(group)
