"""Method names, in every benchmark alike, and the algorithm and keywords each stands for.

``low_rank_r4`` is ``low_rank`` at rank 4 (:func:`split_rank`); a stem may stand for an algorithm with keywords of
its own (:data:`ALGORITHM_VARIANTS`, :func:`resolve_algorithm`); ``diloco_h20`` is ``diloco`` syncing every 20
steps, ``diloco_h20_f2_d5`` streams it in 2 fragments, each exchange behind 5 steps (:func:`diloco_keywords`), and
``torchft_diloco_h20`` torchft's DiLoCo at the same settings (:mod:`lab.torchft_peer`).
"""

import re
from typing import Any

LOW_RANK_RANKS = (1, 4, 8)  # the ranks of ``low_rank`` and of DDP's PowerSGD that are compared
# Methods that run an algorithm with keywords of their own: method stem -> (algorithm, keywords).
ALGORITHM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"low_rank_alt": ("low_rank", {"alternate": True})}
# Ranks of ``low_rank`` (and its variants) accepted by name, ``low_rank_r16``, but not in the default list.
EXTRA_LOW_RANK_RANKS = (16,)


def split_rank(method: str) -> tuple[str, int | None]:
    """``"low_rank_r4"`` -> ``("low_rank", 4)``; a name without an ``_r<k>`` suffix -> ``(name, None)``."""
    stem, _, suffix = method.rpartition("_r")
    return (stem, int(suffix)) if stem and suffix.isdigit() else (method, None)


def resolve_algorithm(stem: str) -> tuple[str, dict[str, Any]]:
    """A method stem's algorithm and extra keywords: ``"low_rank_alt"`` -> ``("low_rank", {"alternate": True})``.

    ``diloco_h<H>`` is ``diloco`` syncing every ``H`` steps: ``("diloco", {"sync_every": H})``.
    """
    diloco = diloco_keywords(stem)
    if diloco is not None:
        return "diloco", diloco
    name, keywords = ALGORITHM_VARIANTS.get(stem, (stem, {}))
    return name, dict(keywords)


def engine_algorithm(method: str, warmup_steps: int, run_steps: int | None = None) -> tuple[str, dict[str, Any]]:
    """The engine algorithm and keywords of an engine method, as every lab sets them.

    ``low_rank_r4:flat`` -> ``("low_rank", {"rank": 4, "warmup_steps": warmup_steps, "hierarchical": False})``: a rank
    also sets the uncompressed start (PowerSGD's), ``:flat`` / ``:hierarchical`` set ``hierarchical``, and an
    algorithm that takes ``run_steps`` (auto) is told the run's length.
    """
    from lightning_bagua.engine.algorithms.base import algorithm_class

    base, _, variant = method.partition(":")
    stem, rank = split_rank(base)
    name, keywords = resolve_algorithm(stem)
    accepted = algorithm_class(name).keywords()
    if rank is not None:
        keywords["rank"] = rank
        if "warmup_steps" in accepted:
            keywords["warmup_steps"] = warmup_steps
    if variant:
        keywords["hierarchical"] = variant == "hierarchical"
    if run_steps is not None and "run_steps" in accepted:
        keywords["run_steps"] = run_steps
    return name, keywords


def layout_variants(method: str, ranks_per_host: int) -> list[str]:
    """``method`` as the labs time it: with several ranks per host, an engine algorithm that takes ``hierarchical``
    as ``method:flat`` and ``method:hierarchical`` (with one, every rank leads its node and both move the same bytes).
    """
    from lightning_bagua.engine import available_algorithms
    from lightning_bagua.engine.algorithms.base import algorithm_class

    name, _ = resolve_algorithm(split_rank(method)[0])
    if ranks_per_host > 1 and name in available_algorithms() and "hierarchical" in algorithm_class(name).keywords():
        return [f"{method}:flat", f"{method}:hierarchical"]
    return [method]


DILOCO_METHODS = ("diloco_h10", "diloco_h20", "diloco_h50")
"""``diloco`` at the sync periods the labs accept by name (any ``diloco_h<H>`` resolves; these are listed)."""


def diloco_keywords(stem: str) -> dict[str, Any] | None:
    """``"diloco_h20"`` -> ``{"sync_every": 20}``; ``_f<F>`` and ``_d<τ>`` add ``fragments`` and
    ``fragment_sync_delay`` (``"diloco_h20_f2_d5"``: streaming); ``_lr<x>`` and ``_m<μ>`` set the outer SGD's
    learning rate and momentum, the default's 0.7 and 0.9 where left out, Nesterov where the momentum is not 0
    (``"diloco_h20_lr1_m0"``: plain averaging of the replicas); ``_fp32`` and ``_u4`` send the outer gradients at
    full precision or in 4 bits instead of 8; any other stem -> ``None``."""
    match = re.fullmatch(
        r"diloco_h(\d+)(?:_f(\d+))?(?:_d(\d+))?(?:_lr(\d+(?:\.\d+)?))?(?:_m(\d+(?:\.\d+)?))?(_fp32|_u4)?", stem
    )
    if match is None or int(match[1]) == 0 or match[2] == "0" or (match[4] and float(match[4]) == 0):
        return None
    keywords: dict[str, Any] = {"sync_every": int(match[1])}
    if match[2]:
        keywords["fragments"] = int(match[2])
    if match[3]:
        keywords["fragment_sync_delay"] = int(match[3])
    if match[4] or match[5]:
        momentum = float(match[5]) if match[5] else 0.9
        lr = float(match[4]) if match[4] else 0.7
        keywords["outer_optimizer_kwargs"] = {"lr": lr, "momentum": momentum, "nesterov": momentum > 0}
    if match[6]:
        keywords["quantization"] = None if match[6] == "_fp32" else "uint4"
    return keywords


def diloco_period(stem: str) -> int | None:
    """``"diloco_h20"`` -> ``20`` (also with fragments and delay); any other stem -> ``None``."""
    keywords = diloco_keywords(stem)
    return None if keywords is None else keywords["sync_every"]


TORCHFT_METHODS = ("torchft_diloco", *(f"torchft_{method}" for method in DILOCO_METHODS))
"""torchft's DiLoCo (:mod:`lab.torchft_peer`) by name: ``torchft_diloco_h<H>`` mirrors ``diloco_h<H>``."""
TORCHFT_NOTE = (
    "torchft's DiLoCo, full precision: torchft quantizes outer gradients only with Triton on CUDA (diloco sends uint8)"
)
TORCHFT_FLAT_NOTE = "flat: one torchft replica per rank (torchft's peer has no hierarchical layout)"


def torchft_settings(method: str) -> dict[str, Any] | None:
    """``"torchft_diloco_h20"`` -> the peer's keywords at our ``diloco``'s defaults, H=20 (``_f<F>``, ``_d<τ>``,
    ``_lr<x>``, ``_m<μ>`` and ``_fp32`` as :func:`diloco_keywords`); other names, ``_u4`` too -> ``None``.

    ``sync_every``, ``fragments``, ``fragment_sync_delay`` and ``fragment_update_alpha`` are the ones the labs'
    ``diloco_h<H>`` runs with (the algorithm's defaults; ``torchft_diloco`` alone takes its default H too).
    """
    import inspect

    ours = {} if method == "torchft_diloco" else diloco_keywords(method.removeprefix("torchft_"))
    if not method.startswith("torchft_") or ours is None:
        return None
    from lightning_bagua.engine.algorithms.diloco import DiLoCoAlgorithm

    shared = ("sync_every", "fragments", "fragment_sync_delay", "fragment_update_alpha")
    parameters = inspect.signature(DiLoCoAlgorithm.__init__).parameters
    if ours.pop("quantization", None) is not None:  # the peer sends full precision only (TORCHFT_NOTE)
        return None
    outer = ours.pop("outer_optimizer_kwargs", None)
    if outer is not None:
        ours |= {"outer_lr": outer["lr"], "outer_momentum": outer["momentum"]}
    return {name: parameters[name].default for name in shared} | ours


def extra_low_rank_methods() -> list[str]:
    """``low_rank``, its variants and DDP's PowerSGD at ``EXTRA_LOW_RANK_RANKS`` (PowerSGD only without ``low_rank``).

    PowerSGD comes at the same ranks, so that every ``low_rank`` rank has torch's hook at that rank to compare with.
    """
    from lightning_bagua.engine import available_algorithms

    powersgd = [f"ddp_powersgd_r{rank}" for rank in EXTRA_LOW_RANK_RANKS]
    if "low_rank" not in available_algorithms():
        return powersgd
    stems = ["low_rank", *(stem for stem, (name, _) in ALGORITHM_VARIANTS.items() if name == "low_rank")]
    return [*powersgd, *(f"{stem}_r{rank}" for stem in stems for rank in EXTRA_LOW_RANK_RANKS)]
