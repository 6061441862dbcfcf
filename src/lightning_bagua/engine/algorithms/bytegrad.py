"""``bytegrad``: gradients exchanged as 8-bit MinMaxUInt8 codes by scatter-gather, overlapped with backward."""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    HookState,
    check_keyword_type,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState, gradient_allreduce_hook
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import (
    CommunicationCounter,
    all_gather_into,
    all_reduce_hierarchically,
    all_to_all_into,
)

__all__ = ["ByteGradAlgorithm", "ByteGradState", "bytegrad_hook", "compressed_scatter_gather_"]


class ByteGradImpl(AlgorithmImpl):
    """:class:`ByteGradAlgorithm` bound to one wrapped model."""

    def __init__(self, algorithm: "ByteGradAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.state = ByteGradState.from_context(
            context,
            average=algorithm.average,
            hierarchical=algorithm.hierarchical,
        )

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`bytegrad_hook`; on one node with ``hierarchical``, ``gradient_allreduce``'s.

        Hierarchical on one node leaves only the full-precision intra-node level, which is exactly
        :func:`gradient_allreduce_hook`'s all-reduce: that hook issues it from the reducer's thread, without a job
        on the executor per bucket, which is what makes this case cost what DDP costs over NVLink.
        """
        if self.state.full_precision_only:
            return GradientAllReduceState.from_context(
                self.context, average=self.state.average
            ), gradient_allreduce_hook
        return self.state, bytegrad_hook


@register_algorithm("bytegrad")
class ByteGradAlgorithm(Algorithm):
    """Reduce gradients as 8-bit codes: a quarter of fp32's bytes on the wire.

    Args:
        hierarchical: reduce inside each node at full precision first, run the compressed scatter-gather among
            node leaders only, then broadcast inside each node. With one node it is a full-precision all-reduce.
        average: divide the sum by the number of ranks; ``False`` keeps the sum.
    """

    single_node_effect = "nothing is compressed: every bucket is all-reduced at full precision"
    impl_class = ByteGradImpl

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        check_keyword_type(self.name, "average", average, bool)
        self.hierarchical = hierarchical
        self.average = average


@dataclass
class ByteGradState(HookState):
    """State of :func:`bytegrad_hook`.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``:

    Args:
        average: divide by the number of ranks.
        hierarchical: whether the user asked for two levels (with one node this means full precision).
        codec: the 8-bit codec.
    """

    average: bool = True
    hierarchical: bool = True
    codec: MinMaxUInt8Codec = field(default_factory=MinMaxUInt8Codec)

    @property
    def full_precision_only(self) -> bool:
        """Whether only the full-precision intra-node level is left: hierarchical, on one node.

        With one rank per node, every rank leads its node and the compressed scatter-gather is the inter-node level.
        """
        return self.hierarchical and self.groups.layout.num_nodes == 1 and not self.groups.is_hierarchical

    @property
    def exchanges_flat(self) -> bool:
        """Whether a bucket is exchanged as one flat compressed collective: the 8-bit scatter-gather over all ranks.

        Neither two-level (the groups are hierarchical) nor full precision (:attr:`full_precision_only`); the third
        way :func:`reduce_bucket` routes a bucket.
        """
        return not self.groups.is_hierarchical and not self.full_precision_only


def bytegrad_hook(state: ByteGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket of gradients with 8-bit scatter-gather.

    Args:
        state: the groups, counter, executor and codec to use.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the reduced bucket.
    """
    buffer = bucket.buffer()
    # Looked up at call time, so that a test can observe every bucket's input and output.
    if not state.exchanges_flat:
        return state.executor.submit(lambda: reduce_bucket(state, buffer), last=bucket.is_last())
    # Flat, a bucket's job is the same kernels and collectives on one communicator at every step: on CUDA it is
    # replayed as one graph.
    key = ("bytegrad", bucket.index(), buffer.numel(), buffer.dtype)
    return state.executor.submit_bucket(
        key, buffer, lambda tensor: reduce_bucket(state, tensor), state.counter, last=bucket.is_last()
    )


def reduce_bucket(state: ByteGradState, buffer: Tensor) -> Tensor:
    """Reduce ``buffer`` over all ranks the way ``state`` says and return it (blocking)."""
    groups = state.groups
    if state.exchanges_flat:
        return compressed_scatter_gather_(
            buffer, groups.flat, groups.world_size, state.average, state.codec, state.counter
        )
    if groups.is_hierarchical:
        ranks_per_node = groups.layout.ranks_per_node
        num_nodes = groups.layout.num_nodes

        def inter_node(node_sum: Tensor) -> None:
            if state.average:
                node_sum.div_(ranks_per_node)  # the node's mean; the nodes' mean of means is the global mean
            compressed_scatter_gather_(
                node_sum, groups.inter_node, num_nodes, state.average, state.codec, state.counter
            )

        return all_reduce_hierarchically(buffer, groups, state.counter, inter_node)
    # Hierarchical on one node: only the full-precision intra-node level is left.
    state.counter.record("all_reduce", buffer)
    dist.all_reduce(buffer, group=groups.flat)
    return buffer.div_(groups.world_size) if state.average else buffer


def compressed_scatter_gather_(
    tensor: Tensor,
    group: dist.ProcessGroup | None,
    n: int,
    average: bool,
    codec: MinMaxUInt8Codec,
    counter: CommunicationCounter,
) -> Tensor:
    """Reduce ``tensor`` over the ``n`` ranks of ``group`` with 8-bit codes, in place.

    `ByteGrad <https://arxiv.org/abs/2102.04013>`_ (Bagua's scatter-gather with MinMaxUInt8 compression). With
    ``g_i`` rank ``i``'s tensor, padded to ``n * L`` elements by repeating its last element (a repeated value
    never widens a chunk's range, and is dropped again at the end) and split into chunks ``g_i[0..n-1]``:

    1. Compress every chunk with its own range: ``c_i[j] = Q(g_i[j])``.
    2. All-to-all: rank ``r`` receives ``c_0[r], ..., c_{n-1}[r]``.
    3. Decompress and reduce them: ``s_r = sum_i D(c_i[r])``, divided by ``n`` if ``average``.
    4. Compress the reduced chunk: ``c_r = Q(s_r)``.
    5. All-gather ``c_0, ..., c_{n-1}``.
    6. Decompress all of them into ``tensor``: ``tensor <- [D(c_0), ..., D(c_{n-1})]``.

    Every rank ends with the same values, each within two quantisation steps of the exact reduction.

    Args:
        tensor: this rank's flat buffer; overwritten with the result.
        group: the group to reduce over.
        n: the size of ``group``.
        average: divide the sum by ``n``.
        codec: the 8-bit codec.
        counter: where the collectives are recorded.

    Returns:
        ``tensor``.
    """
    numel = tensor.numel()
    chunk = -(-numel // n)
    # The codec pads to n chunks of `chunk` elements by repeating the last element, as step 1 says.
    sent = codec.compress(tensor, num_chunks=n)
    received = torch.empty_like(sent)
    float_bytes = tensor.element_size()
    # One row stays here, one arrives from each other rank; the rows encode the padded floats.
    counter.record("all_to_all", sent, received=sent[0].numel() * (n - 1), uncompressed=chunk * n * float_bytes)
    all_to_all_into(received, sent, group)
    del sent
    # Rows are summed over the chunk length only: the codec may store longer rows for alignment.
    reduced = codec.decompress_sum(received, torch.empty(chunk, dtype=torch.float32, device=tensor.device))
    if average:
        reduced.div_(n)
    mine = codec.compress(reduced, num_chunks=1)
    gathered = torch.empty((n, mine.shape[1]), dtype=mine.dtype, device=mine.device)
    counter.record("all_gather", mine, received=mine.numel() * (n - 1), uncompressed=chunk * float_bytes)
    all_gather_into(gathered, mine, group)
    if gathered.shape[1] - codec.HEADER_BYTES == chunk and tensor.is_contiguous():
        # Decoded straight into the bucket, in its dtype (as decoding to float32 and copying would round).
        return codec.decompress(gathered, numel, tensor.dtype, out=tensor)
    decoded = codec.decompress_rows(gathered, dtype=torch.float32)[:, :chunk].reshape(-1)[:numel]
    return tensor.copy_(decoded)
