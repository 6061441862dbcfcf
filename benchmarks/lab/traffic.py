"""Bytes a rank sends per training step with each algorithm, derived from the algorithms' definitions.

This is arithmetic, not a measurement: it counts what each algorithm puts on the wire for a model of
``parameters`` fp32 values among ``ranks`` peers, assuming ring collectives (an all-reduce of ``S`` bytes sends
``2 (n - 1) / n * S`` bytes per rank, an all-gather or all-to-all ``(n - 1) / n`` of the gathered or exchanged
data). The 8-bit codec stores one byte per value plus a 32-byte header per chunk. With ``hierarchical=True``
the formula applies to the node leaders, with ``ranks`` the number of nodes: that is the traffic that crosses
the network between nodes.

>>> wire_bytes("gradient_allreduce", parameters=1_000_000, ranks=2)
4000000.0
>>> wire_bytes("bytegrad", parameters=1_000_000, ranks=2) / wire_bytes("gradient_allreduce", 1_000_000, 2)
0.25...
>>> wire_bytes("decentralized", 1_000_000, 8, peer_selection_mode="shift_one", communication_interval=2)
2000000.0
"""

import math

__all__ = ["ALGORITHMS", "HEADER_BYTES", "break_even_gbit", "payload_bytes", "wire_bytes", "wire_seconds"]

HEADER_BYTES = 32
"""Bytes of the MinMaxUInt8 header of every compressed chunk (``MinMaxUInt8Codec.HEADER_BYTES``)."""

ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam")
"""The algorithms the model knows, in the order the documentation lists them."""

_DEFAULT_BUCKET_BYTES = 10 * 1024**2


def _buckets(parameters: int, bucket_bytes: int) -> list[int]:
    # Gradient algorithms work bucket by bucket; each bucket pays its own codec headers.
    per_bucket = max(1, bucket_bytes // 4)
    full, rest = divmod(parameters, per_bucket)
    return [per_bucket] * full + ([rest] if rest else [])


def _compressed_scatter_gather(elements: int, ranks: int) -> float:
    # All-to-all of n chunks (n - 1 leave the rank), then an all-gather of one reduced chunk per rank.
    row = HEADER_BYTES + math.ceil(elements / ranks)
    return 2 * (ranks - 1) * row


def wire_bytes(
    algorithm: str,
    parameters: int,
    ranks: int,
    *,
    peer_selection_mode: str = "all",
    communication_interval: int = 1,
    warmup: bool = False,
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
) -> float:
    """Return the bytes one rank sends per training step, on average over ``communication_interval`` steps.

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        parameters: number of fp32 parameters (or gradients) communicated.
        ranks: peers that communicate (the number of nodes for the inter-node level of a hierarchical run).
        peer_selection_mode: ``"all"`` or ``"shift_one"``, for ``decentralized``.
        communication_interval: communicate on every n-th step (the decentralized algorithms).
        warmup: for ``qadam``, count a warm-up step (full-precision gradients) instead of a compressed one.
        bucket_bytes: the gradient bucket size (Bagua's 10 MiB); buckets are compressed separately.

    Returns:
        Bytes sent by one rank, per step.

    Raises:
        ValueError: for an unknown algorithm or peer selection mode, or a non-positive count.

    >>> wire_bytes("low_precision_decentralized", parameters=1000, ranks=4)
    2064.0
    >>> wire_bytes("gradient_allreduce", 1000, 1)
    0.0
    >>> wire_bytes("adam", 1000, 2)
    Traceback (most recent call last):
    ...
    ValueError: Unknown algorithm 'adam'; choose one of gradient_allreduce, bytegrad, decentralized, ...
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}.")
    if parameters < 0 or ranks < 1 or communication_interval < 1:
        raise ValueError(
            f"Need parameters >= 0, ranks >= 1, communication_interval >= 1; got {parameters}, {ranks},"
            f" {communication_interval}."
        )
    if ranks == 1:
        return 0.0
    full_precision_allreduce = 2 * (ranks - 1) / ranks * 4 * parameters
    if algorithm == "gradient_allreduce" or (algorithm == "qadam" and warmup):
        return full_precision_allreduce
    if algorithm in ("bytegrad", "qadam"):
        return float(sum(_compressed_scatter_gather(size, ranks) for size in _buckets(parameters, bucket_bytes)))
    if algorithm == "decentralized":
        if peer_selection_mode == "all":
            return full_precision_allreduce / communication_interval
        if peer_selection_mode == "shift_one":
            return 4 * parameters / communication_interval
        raise ValueError(f"Unknown peer_selection_mode {peer_selection_mode!r}; choose 'all' or 'shift_one'.")
    # low_precision_decentralized: one compressed chunk of the whole model to each ring neighbour (on a ring of
    # two, the one peer is both and gets it once).
    neighbours = 1 if ranks == 2 else 2
    return neighbours * (HEADER_BYTES + parameters) / communication_interval


def payload_bytes(algorithm: str, parameters: int, ranks: int) -> float:
    """Return the bytes one rank hands to collectives per step, as the engine's ``CommunicationCounter`` counts them.

    Every collective counts its whole input once: an all-reduce of ``P`` bytes counts ``P``, an all-to-all counts
    all ``n`` rows (the own one too), an all-gather the rank's own part. Flat algorithms, default keywords; ``qadam``
    after its warm-up. :func:`wire_bytes` counts what leaves the rank instead.

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        parameters: number of fp32 parameters communicated.
        ranks: peers that communicate.

    Returns:
        Bytes handed to collectives by one rank, per step.

    Raises:
        ValueError: for an unknown algorithm.

    >>> payload_bytes("gradient_allreduce", parameters=1000, ranks=2)
    4000.0
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}.")
    if ranks == 1:
        return 0.0
    if algorithm in ("gradient_allreduce", "decentralized"):
        return 4.0 * parameters
    if algorithm in ("bytegrad", "qadam"):
        rows = (HEADER_BYTES + math.ceil(size / ranks) for size in _buckets(parameters, _DEFAULT_BUCKET_BYTES))
        return float(sum((ranks + 1) * row for row in rows))  # all-to-all of n rows, all-gather of the reduced row
    # low_precision_decentralized: the compressed model to each ring neighbour (one on a ring of two).
    return (1 if ranks == 2 else 2) * (HEADER_BYTES + parameters)


def wire_seconds(nbytes: float, gbit_per_s: float) -> float:
    """Return how long ``nbytes`` take on a link of ``gbit_per_s`` gigabits per second, ignoring latency.

    >>> wire_seconds(125_000_000, gbit_per_s=1.0)
    1.0
    """
    return nbytes * 8 / (gbit_per_s * 1e9)


def break_even_gbit(codec_gbyte_per_s: float) -> float:
    """Return the link speed below which ``bytegrad`` beats ``gradient_allreduce``, for a given codec speed.

    Per value, the all-reduce sends 8 bytes (``2 * 4``, for many ranks) and the scatter-gather 2; the
    scatter-gather compresses and decompresses twice, each pass at ``codec_gbyte_per_s`` GB/s of fp32 input.
    Compression wins while the 6 bytes it saves take longer on the link than the two codec passes on 4
    bytes: ``6 / B > 8 / C``, so ``B < 3 C / 4`` (in bytes per second), ignoring overlap with backward.

    Args:
        codec_gbyte_per_s: fp32 bytes the codec compresses and decompresses per second, in GB/s.

    Returns:
        The break-even link speed in Gbit/s.

    >>> break_even_gbit(10.0)
    60.0
    """
    return 0.75 * codec_gbyte_per_s * 8
