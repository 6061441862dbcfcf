"""``low_rank``: PowerSGD-style rank-``r`` gradient factors with error feedback, exchanged as 8-bit codes.

`PowerSGD <https://arxiv.org/abs/1905.13727>`_ (Vogels et al., 2019) replaces each gradient matrix by a rank-``r``
approximation found with one step of power iteration, warm-started from the previous step's factor, and keeps what
the approximation missed as an error that is added to the next step's gradient. This implementation goes further
than torch's ``powerSGD_hook`` in four ways:

* the factors travel as 8-bit MinMaxUInt8 codes with a range per column piece, a quarter of fp32's bytes;
* each bucket takes two collectives, one per factor, and the tensors that do not factor ride in the first one at
  full precision, so a slow link carries fewer, larger messages; with ``alternate=True`` one collective, the two
  factors taking turns from step to step (ACP-SGD);
* with ``hierarchical=True`` the ranks of a node reduce at full precision first, and only the node leaders
  exchange factors, as ``bytegrad`` does;
* the collectives of all buckets run in bucket order on one thread (the engine's ordered executor), so on Gloo
  the ranks' collectives can never interleave differently.

Quantisation acts per tensor (every factor has its own codec chunks), so the result does not depend on how the
reducer cut the gradients into buckets beyond float rounding (the orthonormalisation is batched over a bucket's
gradients of the same row count): the error-feedback and warm-start state is kept per parameter name.

The package, in reading order: :mod:`.algorithm` (the keywords and checkpoints), :mod:`.hook` (the state, the hook
and the algorithm, :func:`~.hook.power_step_`, which both the per-bucket and the whole-step path run), then the
private :mod:`._plans` (where factors and messages sit) and :mod:`._factors` (the shared math).
"""

from lightning_bagua.engine.algorithms.low_rank.algorithm import LowRankAlgorithm, LowRankImpl
from lightning_bagua.engine.algorithms.low_rank.hook import LowRankState, low_rank_hook

__all__ = ["LowRankAlgorithm", "LowRankImpl", "LowRankState", "low_rank_hook"]
