"""torchft's DiLoCo as a peer of the engine's ``diloco`` in the CPU labs: one replica per rank, Gloo, env://.

torchft runs DiLoCo only behind its own coordination: a ``Manager`` per replica group that asks a *lighthouse* (a
Rust server in the wheel) for a quorum before every sync. :func:`torchft_diloco` builds that from the lab's
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``: every rank is a replica group of one, rank 0 starts
the lighthouse and publishes its address through a store, every rank checks it starts from the same weights
(torchft's own weight sync serves checkpoints at the host name, which the lab's namespaces do not resolve), and the
model is split into ``fragments``, each with an outer optimizer of its own. Under Lightning
(``benchmarks/convergence.py``) :func:`lightning_callback` does the same with ``strategy="ddp"``. Every wait has
``timeout`` and a failed commit raises (``max_retries=0``): a dead peer ends the run with a message.

Install torchft in an environment of its own: ``requirements/benchmarks-torchft.txt`` says how. Quantized outer
gradients need torchft's Triton kernels (CUDA); on CPU the peer refuses them rather than send full precision.
"""

import ctypes
import hashlib
import itertools
import logging
import os
import socket
from datetime import timedelta
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "torchft is not installed in this environment. Give it an environment of its own: "
    "python3 -m venv .venv-torchft && .venv-torchft/bin/pip install torch==2.13.0 "
    "&& .venv-torchft/bin/pip install -r requirements/benchmarks-torchft.txt -e .[test] "
    "then run the lab with .venv-torchft/bin/python."
)
# Every call gets a store prefix of its own: a lab builds the method once per round, in the same order on every rank.
_SESSIONS = itertools.count()


class TorchftDiLoCo(nn.Module):
    """A model trained by torchft's DiLoCo: forward is the model's; :meth:`close` ends torchft's servers.

    Attributes:
        fragments: the model's parameter groups, synced in turn.
        communication_counter: ``bytes_sent`` counts the pseudo-gradient bytes that committed syncs all-reduced.
        syncs: the syncs committed so far (one fragment each).
    """

    def __init__(self, model: nn.Module, fragments: list[nn.Module], resources: "_Resources") -> None:
        super().__init__()
        self.module = model
        self.fragments = fragments
        self.communication_counter = SimpleNamespace(bytes_sent=0)
        self.syncs = 0
        self._resources = resources
        self._fragment_bytes = [sum(p.numel() * p.element_size() for p in f.parameters()) for f in fragments]
        self._committed_step = resources.manager.current_step()
        hook = resources.inner_optimizer.register_step_post_hook(self._count_sync)
        resources.hooks.append(hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def close(self) -> None:
        """Remove the optimizer hooks and stop the manager, the lighthouse and the stores; safe to call twice."""
        self._resources.close()

    def _count_sync(self, *_: Any) -> None:
        # Runs after torchft's own post-step hook: a committed sync has advanced the manager's step by one.
        step = self._resources.manager.current_step()
        if step != self._committed_step:
            fragment = self._committed_step % len(self.fragments)
            self.communication_counter.bytes_sent += self._fragment_bytes[fragment]
            self.syncs += step - self._committed_step
            self._committed_step = step


def torchft_diloco(
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    *,
    sync_every: int,
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    quantize: bool = False,
    timeout: timedelta = timedelta(seconds=60),
) -> TorchftDiLoCo:
    """Train ``model`` under torchft's (Streaming) DiLoCo, one replica per rank, on Gloo.

    Call it on every rank with the same arguments and identically initialised models, with ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (and ``RANK`` and ``WORLD_SIZE`` unless a default process group is up); train with
    ``inner_optimizer`` as usual and call :meth:`TorchftDiLoCo.close` at the end. ``sync_every``, ``fragments``,
    ``fragment_sync_delay`` and ``fragment_update_alpha`` are torchft's; the outer optimizer is SGD with Nesterov
    momentum; ``timeout`` bounds every collective, quorum and connection.

    Raises:
        ValueError: a setting torchft would refuse or ignore, before anything is started.
        ImportError: torchft is missing, with how to install it.
        RuntimeError: the ranks' starting weights differ.
    """
    _check_settings(sync_every, fragments, fragment_sync_delay, fragment_update_alpha)
    # torchft's Rust servers log every quorum at INFO; a lab wants warnings only (the user may ask for more).
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import IS_TRITON_AVAILABLE
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    if quantize and not (IS_TRITON_AVAILABLE and torch.cuda.is_available()):
        raise ValueError(
            "quantize=True: torchft quantizes outer gradients only with Triton on CUDA, which this machine lacks; on "
            "CPU its Manager.allreduce would send full precision silently. Use quantize=False here."
        )
    groups = split_fragments(model, fragments)
    if dist.is_initialized():  # Lightning's launcher sets no RANK for the processes it starts
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    address = own_address(master_addr, master_port)
    resources = _Resources(inner_optimizer)
    try:
        store = _coordination_store(master_addr, master_port, rank, world_size, timeout, resources)
        _check_same_weights(store, model, rank, world_size)
        if rank == 0:
            lighthouse = LighthouseServer(
                bind=f"{address}:0", min_replicas=world_size, join_timeout_ms=100, heartbeat_timeout_ms=5000
            )
            resources.lighthouse = lighthouse
            # The server names itself by the machine's host name; the peers reach it by the lab's address.
            store.set("lighthouse", f"http://{address}:{lighthouse.address().rsplit(':', 1)[1]}")
        lighthouse_address = store.get("lighthouse").decode()
        group_store = dist.TCPStore(address, 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
        resources.group_store = group_store
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=world_size,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=group_store.port,
            lighthouse_addr=lighthouse_address,
            replica_id=f"rank{rank}",
            hostname=address,
            init_sync=False,
            max_retries=0,
        )
        resources.manager = manager
        outer_optimizers = [
            torch.optim.SGD(group.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
            for group in groups
        ]
        diloco = DiLoCo(
            manager,
            groups,
            inner_optimizer,
            outer_optimizers,
            sync_every=sync_every,
            pin_memory=False,
            should_quantize=quantize,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
        )
        diloco.__enter__()
        resources.diloco = diloco
        wrapped = TorchftDiLoCo(model, groups, resources)
    except BaseException:
        resources.close()
        raise
    if rank == 0:
        log.info(
            "torchft %s DiLoCo: %d replicas, H=%d, %d fragments, delay %d, alpha %s, lighthouse %s",
            version("torchft"),
            world_size,
            sync_every,
            fragments,
            fragment_sync_delay,
            fragment_update_alpha,
            lighthouse_address,
        )
    return wrapped


def lightning_callback(**settings: Any) -> Any:
    """Return a Lightning ``Callback`` that trains the module under :func:`torchft_diloco` with ``settings``.

    Use it with ``strategy="ddp"``: at the start of training it switches off DDP's gradient all-reduce (DiLoCo's
    inner steps are local) and wraps the module's one optimizer; at the end it closes torchft's servers.
    """
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.nn.parallel import DistributedDataParallel

    class TorchftDiLoCoCallback(Callback):
        def __init__(self) -> None:
            self.peer: TorchftDiLoCo | None = None

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            ddp = trainer.strategy.model
            if not isinstance(ddp, DistributedDataParallel):
                raise TypeError(f"the torchft callback needs strategy='ddp'; the module is wrapped in {type(ddp)}")
            ddp.require_backward_grad_sync = False
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"torchft's DiLoCo takes one inner optimizer; the module has {len(trainer.optimizers)}"
                )
            self.peer = torchft_diloco(pl_module, trainer.optimizers[0], **settings)

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            if self.peer is None:
                return
            self.peer.close()
            # The inner optimizer's hooks are the only sign that torchft ran: a run long enough to sync must have.
            period = settings["sync_every"] // settings.get("fragments", 1)
            if trainer.global_step >= period and self.peer.syncs == 0:
                raise RuntimeError(f"torchft's DiLoCo never synced in {trainer.global_step} steps (every {period})")
            if trainer.is_global_zero:
                log.info(
                    "torchft DiLoCo: %d syncs, %.2f MB all-reduced by each rank",
                    self.peer.syncs,
                    self.peer.communication_counter.bytes_sent / 1e6,
                )

    return TorchftDiLoCoCallback()


def require_torchft() -> None:
    """Raise the ImportError that says how to install torchft when it is not importable; import nothing else."""
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error


def split_fragments(model: nn.Module, fragments: int) -> list[nn.Module]:
    """Split ``model``'s parameterised modules, in order, into ``fragments`` contiguous groups of about equal size.

    Each group is an ``nn.ModuleList`` of the model's own modules (no copies), cut where the running parameter
    count reaches the next multiple of the total over ``fragments``; every group holds at least one module.

    Raises:
        ValueError: fewer parameterised modules than ``fragments``.
    """
    owners = [module for module in model.modules() if any(True for _ in module.parameters(recurse=False))]
    if fragments < 1 or fragments > len(owners):
        raise ValueError(
            f"fragments={fragments}: the model has {len(owners)} modules with parameters of their own; choose"
            f" between 1 and {len(owners)}."
        )
    sizes = [sum(p.numel() for p in module.parameters(recurse=False)) for module in owners]
    total = sum(sizes)
    cuts = [0]
    for k in range(1, fragments):
        # The first module at which the running count reaches k / fragments of the total, leaving every group one.
        cut = next((i for i in range(len(owners)) if sum(sizes[:i]) * fragments >= k * total), len(owners))
        cuts.append(min(max(cut, cuts[-1] + 1), len(owners) - (fragments - k)))
    cuts.append(len(owners))
    groups = [owners[start:stop] for start, stop in itertools.pairwise(cuts)]
    return [nn.ModuleList(group) for group in groups]


def own_address(master_addr: str, master_port: int) -> str:
    """The address this host reaches ``master_addr`` from: where its peers reach it (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, master_port))
        return str(probe.getsockname()[0])


class _Resources:
    """What a session started, stopped in reverse order by :meth:`close`."""

    def __init__(self, inner_optimizer: torch.optim.Optimizer) -> None:
        self.inner_optimizer = inner_optimizer
        self.hooks: list[Any] = []
        self.store: Any = None
        self.lighthouse: Any = None
        self.group_store: Any = None
        self.manager: Any = None
        self.diloco: Any = None

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        self.group_store = None
        self.store = None


def _check_settings(sync_every: int, fragments: int, fragment_sync_delay: int, fragment_update_alpha: float) -> None:
    """Refuse what torchft's DiLoCo would refuse later (or assert on), with the valid range and the fix."""
    if sync_every < 1:
        raise ValueError(f"sync_every={sync_every}: must be at least 1.")
    if fragments < 1 or sync_every % fragments:
        raise ValueError(
            f"fragments={fragments} with sync_every={sync_every}: fragments must be a positive divisor of sync_every"
            " (torchft syncs one fragment every sync_every / fragments steps)."
        )
    if not 0 <= fragment_sync_delay < sync_every // fragments:
        raise ValueError(
            f"fragment_sync_delay={fragment_sync_delay}: must be in [0, {sync_every // fragments}) for"
            f" sync_every={sync_every} and fragments={fragments} (a fragment lands before its next exchange starts)."
        )
    if not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha={fragment_update_alpha}: must be in [0, 1].")


def _coordination_store(
    master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta, resources: _Resources
) -> dist.Store:
    """A store the ranks share, under a prefix of this session's own."""
    if dist.is_initialized():
        base = dist.distributed_c10d._get_default_store()
    else:
        base = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
        resources.store = base
    return dist.PrefixStore(f"torchft_peer/{next(_SESSIONS)}", base)


def _check_same_weights(store: dist.Store, model: nn.Module, rank: int, world_size: int) -> None:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        # The raw bytes, read without numpy (torch's CPU wheel does not bring it).
        tensor = parameter.detach().cpu().contiguous()
        digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    store.set(f"weights/{rank}", digest.hexdigest())
    differing = [other for other in range(world_size) if store.get(f"weights/{other}").decode() != digest.hexdigest()]
    if differing:
        raise RuntimeError(
            f"rank {rank}: ranks {differing} start from other weights; torchft's DiLoCo here assumes identical"
            " starting weights (seed every rank's model alike, e.g. torch.manual_seed before building it)."
        )
