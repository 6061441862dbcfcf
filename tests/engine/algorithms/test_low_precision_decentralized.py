"""``low_precision_decentralized`` (DCD-PSGD) on real Gloo processes, step by step against a simulation of the spec.

The simulation quantises with the engine's codec, and evaluates the spec's formulas with the same float32
operations the ranks run. Why not an independent codec: quantisation is discontinuous, so a last-bit difference
between two implementations of the same formula now and then moves a code by one level (``range(d) / 255``),
after which the trajectories differ everywhere by far more than float tolerance. With the same codec the
simulation reproduces the ring to float tolerance, which then catches any bookkeeping error, a missing
compression included (it errs by about half a level, ~1e-4 here). That the codec is the spec's is checked on
its own below, against a reference round trip written from section 3, within the codec's bound.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms import low_precision_decentralized
from lightning_bagua.engine.algorithms.base import Algorithm
from lightning_bagua.engine.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm,
    _difference_into,
    _ring_copies,
    _RingCopies,
)
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.optim import fuse_optimizer
from tests.distributed import run_processes
from tests.engine.algorithms.test_decentralized import batch_for, fake_context, make_model, snapshot
from tests.engine.codec.test_codec import loads_module

STEPS = 4
LR = 0.1
EPS = 1e-7
HEADER_BYTES = 32  # the codec's per-chunk header (lo, hi), padded to 32 bytes as in Bagua
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
CODEC = MinMaxUInt8Codec()


def numel() -> int:
    return sum(p.numel() for p in make_model().parameters())


class Simulation:
    """``n`` replicas in one process; the ring members are ranks, or nodes of ``ranks_per_node`` ranks."""

    def __init__(
        self, world_size: int, ranks_per_node: int = 1, quantise: bool = True, chunk_bytes: int | None = None
    ) -> None:
        # chunk_bytes: Bagua quantises each bucket on its own; the flat difference is cut into pieces of at most
        # this many bytes, each with its own min/max (None: one piece).
        self.chunk_bytes = chunk_bytes
        self.replicas = [make_model() for _ in range(world_size)]
        self.optimizers = [torch.optim.SGD(replica.parameters(), lr=LR) for replica in self.replicas]
        self.names = [name for name, _ in self.replicas[0].named_parameters()]
        self.ranks_per_node = ranks_per_node
        self.quantise = quantise  # False: a deliberately wrong, full-precision ring, to show the test can fail
        start = self.flat(0)
        members = world_size // ranks_per_node
        self.w = [start.clone() for _ in range(members)]
        self.left = [start.clone() for _ in range(members)]
        self.right = [start.clone() for _ in range(members)]

    def flat(self, rank: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.replicas[rank].parameters()])

    def local_step(self, rank: int, forward_passes: range, accumulate: int = 1) -> None:
        replica = self.replicas[rank]
        self.optimizers[rank].zero_grad()
        for forward_pass in forward_passes:
            inputs, targets = batch_for(rank, forward_pass)
            (nn.functional.mse_loss(replica(inputs), targets) / accumulate).backward()
        self.optimizers[rank].step()

    def round_trip(self, d: torch.Tensor) -> torch.Tensor:
        if not self.quantise:
            return d
        pieces = 1 if self.chunk_bytes is None else -(-d.numel() * d.element_size() // self.chunk_bytes)
        return CODEC.decompress(CODEC.compress(d, num_chunks=pieces), d.numel(), d.dtype)

    def node_average(self) -> None:
        # Bagua's hierarchical rule on a single node: the node's ranks average at full precision, no ring.
        average = sum(self.flat(rank) for rank in range(len(self.replicas))) / len(self.replicas)
        for replica in self.replicas:
            torch.nn.utils.vector_to_parameters(average.clone(), replica.parameters())

    def ring_round(self) -> None:
        k, members = self.ranks_per_node, len(self.w)
        # A node's member holds its ranks' average weight (sum, then divide: as the leader computes it).
        x = [sum(self.flat(r) for r in range(j * k, (j + 1) * k)) / k for j in range(members)]
        d = [x[j] + self.left[j] / 3 + self.right[j] / 3 - 5 * self.w[j] / 3 for j in range(members)]
        decoded = [self.round_trip(dj) for dj in d]
        for j in range(members):
            self.left[j] += decoded[(j - 1) % members]
            self.right[j] += decoded[(j + 1) % members]
            self.w[j] += decoded[j]
        for rank, replica in enumerate(self.replicas):
            torch.nn.utils.vector_to_parameters(self.w[rank // k].clone(), replica.parameters())

    def states(self) -> list[dict[str, torch.Tensor]]:
        return [dict(zip(self.names, (p.detach().clone() for p in r.parameters()), strict=True)) for r in self.replicas]


def simulate(
    world_size: int,
    ranks_per_node: int = 1,
    interval: int = 1,
    accumulate: int = 1,
    steps: int = STEPS,
    skipped: tuple[tuple[int, int], ...] = (),
    quantise: bool = True,
    chunk_bytes: int | None = None,
    one_node: bool = False,
) -> list[list[dict[str, torch.Tensor]]]:
    """Return every replica's parameters after each step (local SGD step, then the ring round when due)."""
    simulation = Simulation(world_size, ranks_per_node, quantise, chunk_bytes)
    history = []
    for step in range(steps):
        passes = range(step * accumulate, (step + 1) * accumulate)
        for rank in range(world_size):
            if (rank, step) not in skipped:
                simulation.local_step(rank, passes, accumulate)
        if any(forward_pass % interval == 0 for forward_pass in passes):
            simulation.node_average() if one_node else simulation.ring_round()
        history.append(simulation.states())
    return history


def assert_matches(results: list[dict], reference: list[list[dict[str, torch.Tensor]]]) -> None:
    for rank, result in enumerate(results):
        for step, state in enumerate(result["states"]):
            torch.testing.assert_close(state, reference[step][rank], **TOLERANCE, msg=f"rank {rank}, step {step}")


def train(rank: int, world_size: int, algorithm_kwargs: dict, options: dict | None = None) -> dict:
    """Train on this rank; ``options``: ranks_per_node, accumulate, steps, skipped (rank, step) pairs,
    split_optimizers (one optimizer per linear layer, stepped last-first), cuda, report_steps (report each step,
    skipped ones too, as the strategies do, then all-reduce a metric before the next pass)."""
    options = options or {}
    accumulate, steps, skipped = options.get("accumulate", 1), options.get("steps", STEPS), options.get("skipped", ())
    report_steps = options.get("report_steps", False)
    stray_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    cuda = options.get("cuda", False)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = make_model().to(device)
    if options.get("split_optimizers"):
        optimizers = [torch.optim.SGD(model[i].parameters(), lr=LR) for i in (0, 2)]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=LR)]
    fuse = options.get("fuse")  # lay the parameters out in a fused optimizer's flat buffer "before" or "after" wrapping
    if fuse == "before":
        optimizers = [fuse_optimizer(optimizer) for optimizer in optimizers]
    ddp = BaguaDistributedDataParallel(
        model,
        optimizers,
        LowPrecisionDecentralizedAlgorithm(**algorithm_kwargs),
        ranks_per_node=options.get("ranks_per_node"),
        device_ids=[rank] if cuda else None,
        bucket_cap_mb=options.get("bucket_cap_mb"),
    )
    if fuse == "after":
        optimizers = [fuse_optimizer(optimizer) for optimizer in optimizers]
    states = []
    for step in range(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, targets = (t.to(device) for t in batch_for(rank, step * accumulate + micro))
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                outputs = ddp(inputs)
                if micro == 0 and (rank, step - 1) in skipped and not report_steps:
                    states[-1] = snapshot(model)  # the round the skipped step owed ran as this pass started
                (nn.functional.mse_loss(outputs, targets) / accumulate).backward()
        if report_steps:  # a step of an optimizer the model is not bound to ends no step of the model
            ddp.bagua_algorithm_impl.on_optimizer_step(stray_optimizer)
        if (rank, step) not in skipped:  # e.g. a GradScaler that found infinities skips the step
            for optimizer in reversed(optimizers):
                optimizer.fuse_step() if fuse else optimizer.step()  # type: ignore[attr-defined]
        if report_steps:
            for optimizer in reversed(optimizers):
                ddp.bagua_algorithm_impl.on_optimizer_step(optimizer)
            # A collective right after the step, as a logged metric synced over ranks is: it must not meet a rank
            # still owing its ring round.
            metric = torch.tensor([float(step)], device=device)
            dist.all_reduce(metric)
            assert metric.item() == step * world_size
        states.append(snapshot(model))
        if step == options.get("new_storage_after"):  # as module.to() or load_state_dict(assign=True) would do
            for parameter in model.parameters():
                parameter.data = parameter.data.clone()
    calls_before_close = ddp.communication_counter.calls
    aliased = [weights.aliased for weights in ddp.bagua_algorithm_impl.state.weights]
    buffer_storage = ddp.bagua_algorithm_impl.state.weights[0].buffer.untyped_storage().data_ptr()
    storages = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    copies = ddp.bagua_algorithm_impl.state.copies
    pending = None if copies is None else copies[0].pending
    in_flight = None if pending is None else {"sent": pending.sent.dtype, "works": len(pending.works)}
    saved = None
    if options.get("checkpoint"):  # a checkpoint taken with the last round's exchange in flight
        saved = ddp.bagua_algorithm_impl.state_dict()["copies"]
        saved = None if saved is None else {key: tensor.cpu() for key, tensor in saved[0].items()}
    ddp.close()  # runs the round a skipped last step still owes
    if (rank, steps - 1) in skipped and not report_steps:
        states[-1] = snapshot(model)
    return {
        "states": states,
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
        "calls_before_close": calls_before_close,
        "hierarchical": ddp.communication_groups.is_hierarchical,
        "copies": None if copies is None else {k: getattr(copies[0], k).cpu() for k in ("w", "left", "right")},
        "in_flight": in_flight,
        "saved": saved,
        "aliased": aliased,
        "in_the_round_buffer": storages == {buffer_storage},
        "in_one_storage": len(storages) == 1,
    }


def ring_bytes(members: int) -> int:
    # One uint8 chunk (header + one code per element) to each neighbour per round; a ring of two has one.
    return (1 if members == 2 else 2) * (HEADER_BYTES + numel())


@pytest.mark.parametrize("world_size", [2, 4])
def test_flat_ring_matches_the_simulation_step_by_step(world_size):
    results = run_processes(train, world_size, {"hierarchical": False})
    assert_matches(results, simulate(world_size))
    # The test can fail: the same ring at full precision is told apart from the compressed one.
    with pytest.raises(AssertionError):
        assert_matches(results, simulate(world_size, quantise=False))
    for result in results:
        assert result["bytes_by_op"] == {"send": STEPS * ring_bytes(world_size)}  # and no gradient bytes at all
        assert not result["hierarchical"]
    # Gradients stay local and the ring only mixes: the replicas differ.
    assert not torch.equal(results[0]["states"][-1]["0.weight"], results[1]["states"][-1]["0.weight"])
    assert_ring_consistent(results)
    # The round reads the parameters where they live: each rank's one dtype group is laid out in its buffer.
    assert [result["aliased"] for result in results] == [[True]] * world_size


def test_parameters_given_new_storage_between_steps_are_laid_out_again():
    # module.to() or an assigning load_state_dict gives parameters new storage: the next round must read those,
    # not the buffer the old storage was laid out in.
    results = run_processes(train, 2, {"hierarchical": False}, {"new_storage_after": 1})
    assert_matches(results, simulate(2))
    assert [result["aliased"] for result in results] == [[True], [True]]


@pytest.mark.parametrize("fuse", ["before", "after"])
def test_parameters_a_fused_optimizer_laid_out_stay_in_its_buffer(fuse):
    # fuse_optimizer keeps the parameters as views into its own flat buffer and steps that: the round must not pull
    # them into its buffer, or the fused step would update memory the parameters have left.
    results = run_processes(train, 2, {"hierarchical": False}, {"fuse": fuse})
    assert_matches(results, simulate(2))
    for result in results:
        assert result["aliased"] == [False]
        assert result["in_one_storage"]
        assert not result["in_the_round_buffer"]


def fail_the_exchange(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = BaguaDistributedDataParallel(model, [optimizer], LowPrecisionDecentralizedAlgorithm(hierarchical=False))

    def peer_gone(operations: list) -> list:
        raise RuntimeError("the peer is gone")

    low_precision_decentralized.start_exchange = peer_gone  # this process's module only
    inputs, targets = batch_for(rank, 0)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    with pytest.raises(RuntimeError, match="the peer is gone"):
        optimizer.step()  # the round runs in the step's post-hook
    return {"state": snapshot(model)}


def test_a_round_whose_exchange_fails_leaves_the_weights_of_the_local_step():
    results = run_processes(fail_the_exchange, 2)
    simulation = Simulation(2)
    for rank, result in enumerate(results):
        simulation.local_step(rank, range(1))
        torch.testing.assert_close(result["state"], simulation.states()[rank], rtol=0, atol=0)
    # The test can fail: the step changed the weights, so keeping the starting ones would not pass.
    start = Simulation(2).states()[0]
    assert not torch.equal(results[0]["state"]["0.weight"], start["0.weight"])


def test_each_bucket_sized_piece_of_the_difference_is_quantised_on_its_own():
    # Bagua compresses per bucket: with 64-byte buckets the model's difference is cut into several pieces, each
    # scaled by its own range, which one global min/max would quantise differently.
    chunk_bytes = 64
    assert numel() * 4 > 2 * chunk_bytes
    results = run_processes(train, 2, {"hierarchical": False}, {"bucket_cap_mb": chunk_bytes / 1024**2})
    assert_matches(results, simulate(2, chunk_bytes=chunk_bytes))
    with pytest.raises(AssertionError):
        assert_matches(results, simulate(2))
    pieces = -(-numel() * 4 // chunk_bytes)
    piece = -(-numel() // pieces)
    assert results[0]["bytes_by_op"] == {"send": STEPS * pieces * (HEADER_BYTES + piece)}
    assert_ring_consistent(results)


def test_hierarchical_on_one_node_averages_the_node_at_full_precision_as_bagua():
    results = run_processes(train, 2, {"hierarchical": True}, {"ranks_per_node": 2})
    assert_matches(results, simulate(2, one_node=True))
    # The node's ranks keep identical weights, and nothing is compressed.
    for step in range(STEPS):
        torch.testing.assert_close(results[0]["states"][step], results[1]["states"][step], rtol=0, atol=0)
    assert results[0]["bytes_by_op"] == {"all_reduce": STEPS * numel() * 4}
    assert results[0]["copies"] is None


def assert_ring_consistent(results: list[dict]) -> None:
    # DCD-PSGD's invariant: every rank's L and R are its neighbours' w, bit for bit, and its parameters are its w.
    n = len(results)
    for rank, result in enumerate(results):
        copies = result["copies"]
        assert torch.equal(copies["left"], results[(rank - 1) % n]["copies"]["w"]), f"rank {rank}: L"
        assert torch.equal(copies["right"], results[(rank + 1) % n]["copies"]["w"]), f"rank {rank}: R"
        assert torch.equal(torch.cat([p.reshape(-1) for p in result["states"][-1].values()]), copies["w"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_round_leaves_its_exchange_in_flight_and_a_checkpoint_settles_it(world_size):
    # The new weights need only this rank's code: the neighbours' codes reach L and R when next needed. A checkpoint
    # taken between rounds must hold them already, so that a resumed ring continues exactly.
    results = run_processes(train, world_size, {"hierarchical": False}, {"checkpoint": True})
    assert_matches(results, simulate(world_size))
    for result in results:
        sends = 1 if world_size == 2 else 2
        assert result["in_flight"] == {"sent": torch.uint8, "works": 2 * sends}  # each send with its receive
    saved = [{"states": result["states"], "copies": result["saved"]} for result in results]
    assert_ring_consistent(saved)


def test_hierarchical_two_nodes_of_two_runs_the_ring_among_leaders():
    results = run_processes(train, 4, {}, {"ranks_per_node": 2})
    assert_matches(results, simulate(4, ranks_per_node=2))
    full = STEPS * numel() * 4  # fp32 weights, reduced to and broadcast from each leader every round
    for rank, result in enumerate(results):
        assert result["hierarchical"]
        expected = {"reduce": full, "broadcast": full}
        if rank % 2 == 0:
            expected["send"] = STEPS * ring_bytes(2)  # the ring of the two leaders
        assert result["bytes_by_op"] == expected, f"rank {rank}"
    assert [result["copies"] is None for result in results] == [False, True, False, True]  # leaders keep w, L, R
    assert_ring_consistent([results[0], results[2]])


def test_communication_interval_and_accumulation_count_forward_passes():
    # accumulate=2 runs passes (0,1) (2,3) (4,5) (6,7) (8,9); interval 3 is due at 0, 3, 6, 9 -> steps 0, 1, 3, 4.
    results = run_processes(
        train, 2, {"communication_interval": 3, "hierarchical": False}, {"accumulate": 2, "steps": 5}
    )
    assert_matches(results, simulate(2, interval=3, accumulate=2, steps=5))
    assert results[0]["bytes_by_op"] == {"send": 4 * ring_bytes(2)}


def test_several_optimizers_communicate_once_after_the_last_of_them():
    results = run_processes(train, 2, {"hierarchical": False}, {"steps": 3, "split_optimizers": True})
    assert_matches(results, simulate(2, steps=3))
    assert results[0]["bytes_by_op"] == {"send": 3 * ring_bytes(2)}


def test_a_skipped_step_still_runs_its_round_so_the_ring_does_not_hang():
    # Rank 1 skips steps 1 and 2 (the last): it runs the rounds at its next forward pass and in close().
    skipped = ((1, 1), (1, 2))
    results = run_processes(train, 2, {"hierarchical": False}, {"steps": 3, "skipped": skipped})
    assert_matches(results, simulate(2, steps=3, skipped=skipped))
    assert results[0]["calls_before_close"] == {"send": 3}  # one send per round on a ring of two
    assert results[1]["calls_before_close"] == {"send": 2}  # the last round waits for close()
    assert results[1]["bytes_by_op"] == {"send": 3 * ring_bytes(2)}
    assert_ring_consistent(results)


@pytest.mark.parametrize(("world_size", "algorithm_kwargs", "options"), [
    (2, {"hierarchical": False}, {"skipped": ((1, 1), (0, 2), (1, 3))}),
    (4, {"hierarchical": True}, {"ranks_per_node": 2, "skipped": ((1, 1), (2, 2))}),
    (2, {"hierarchical": False}, {"skipped": ((1, 1), (0, 2)), "split_optimizers": True}),
])  # fmt: skip
def test_a_reported_step_skipped_on_one_rank_runs_its_round_before_the_next_collective(
    world_size: int, algorithm_kwargs: dict, options: dict
) -> None:
    # Each snapshot is taken after the report and a metric all-reduce: the round is already in it on every rank.
    options = {**options, "steps": 4, "report_steps": True}
    results = run_processes(train, world_size, algorithm_kwargs, options)
    reference = simulate(world_size, options.get("ranks_per_node", 1), steps=4, skipped=options["skipped"])
    assert_matches(results, reference)
    if not algorithm_kwargs["hierarchical"]:  # on two levels only the node leaders hold ring copies
        assert_ring_consistent(results)


def test_parameters_no_optimizer_drives_are_named_with_the_hint():
    model = make_model()
    impl = LowPrecisionDecentralizedAlgorithm().reify(fake_context(2, 2, model))
    with pytest.raises(ValueError, match=r"2\.weight, 2\.bias.*_bagua_params_and_buffers_to_ignore"):
        impl.bind_optimizers([torch.optim.SGD(model[0].parameters(), lr=LR)])


def test_rebinding_replaces_the_step_hooks_and_training_without_an_optimizer_fails():
    model = make_model()
    impl = LowPrecisionDecentralizedAlgorithm().reify(fake_context(2, 2, model))
    with pytest.raises(RuntimeError, match="no optimizer is bound"):
        impl.on_forward_start(True)
    first, second = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(model.parameters(), lr=LR)
    impl.bind_optimizers([first])
    impl.bind_optimizers([second])
    assert (len(first._optimizer_step_post_hooks), len(second._optimizer_step_post_hooks)) == (0, 1)
    impl.close()
    assert len(second._optimizer_step_post_hooks) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"communication_interval": 0}, ValueError, "at least 1, got 0"),
        ({"communication_interval": "2"}, TypeError, "`communication_interval` must be an int"),
        ({"hierarchical": 1}, TypeError, "`hierarchical` must be a bool"),
        ({"peer_selection_mode": "all"}, TypeError, "Unknown keyword argument.*'peer_selection_mode'"),
    ],
)
def test_bad_keywords_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        Algorithm.init("low_precision_decentralized", **kwargs)


def test_registered_with_the_spec_defaults():
    assert repr(Algorithm.init("low_precision_decentralized")) == (
        "LowPrecisionDecentralizedAlgorithm(hierarchical=True, communication_interval=1)"
    )


def reference_round_trip(d: torch.Tensor) -> torch.Tensor:
    """Spec section 3 for one chunk, written independently of the engine's codec."""
    lo, hi = d.min(), d.max()
    scale = torch.tensor(255.0) / (hi - lo + EPS)
    upper = torch.round(hi * scale)
    lower = upper - 255
    q = torch.minimum(torch.round(d * scale), upper) - lower
    return (q + lower) / scale


def test_the_codec_used_is_the_spec_codec_in_one_chunk():
    # Differences like the ones the ring sends: a few hundred values of the size of a learning-rate step.
    d = torch.randn(numel(), generator=torch.Generator().manual_seed(0)) * 1e-2
    level = float(d.max() - d.min() + EPS) / 255
    encoded = CODEC.compress(d)
    assert encoded.shape == (1, HEADER_BYTES + numel()), "one chunk: one header, one byte per element"
    decoded = CODEC.decompress(encoded, d.numel(), d.dtype)
    assert float((decoded - d).abs().max()) <= level / 2 + 1e-7  # the codec's bound
    reference = reference_round_trip(d)
    assert float((reference - d).abs().max()) <= level / 2 + 1e-7
    # Same codes: equal up to float rounding, or one level apart where v * scale rounded the other way.
    apart = (decoded - reference).abs()
    assert float(apart.max()) <= level * 1.001
    assert int((apart > 1e-6).sum()) <= 3


@pytest.mark.gpu(count=2)
def test_nccl_ring_of_two_keeps_the_invariant_and_follows_the_simulation():
    results = run_processes(train, 2, {"hierarchical": False}, {"cuda": True}, backend="nccl")
    assert_ring_consistent(results)
    assert results[0]["bytes_by_op"] == {"send": STEPS * ring_bytes(2)}
    # GPU float32 differs from the CPU's in the last bits, which can move a code by a level (~1e-3 here): the
    # invariant above is the exact check, this one only that the trajectory is the simulated one.
    reference = simulate(2)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["states"][-1], reference[-1][rank], rtol=0, atol=5e-3)
    assert [result["aliased"] for result in results] == [[True], [True]]  # the CUDA parameters live in the buffer


@pytest.mark.gpu
def test_cuda_ring_of_one_reads_its_parameters_in_place_and_follows_the_simulation():
    # One GPU: the round's CUDA path (fused difference, one-pass decode-add into w, one copy back into the
    # parameters laid out in the buffer) against the simulation of a ring of one.
    (result,) = run_processes(train, 1, {"hierarchical": False}, {"cuda": True}, backend="nccl")
    assert result["aliased"] == [True]
    assert result["in_the_round_buffer"]
    reference = simulate(1)
    for step, state in enumerate(result["states"]):
        torch.testing.assert_close(state, reference[step][0], rtol=0, atol=5e-3, msg=f"step {step}")
    # Exactly: the last round wrote w into the parameters (its local step's x differs from w by the quantisation).
    last = torch.cat([tensor.reshape(-1) for tensor in result["states"][-1].values()])
    assert torch.equal(last, result["copies"]["w"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ring_size", [1, 2, 3])
@pytest.mark.parametrize("numel", [1, 4097, 3_000_017])
def test_cuda_difference_kernel_writes_the_bits_of_torchs_ops(dtype, ring_size, numel, monkeypatch):
    pytest.importorskip("triton", reason="the fused difference needs triton")
    assert low_precision_decentralized._difference_kernels() is not None, "Triton imports, so the kernel must run"
    generator = torch.Generator(device="cuda").manual_seed(numel + ring_size)
    start = torch.randn(numel, generator=generator, device="cuda").to(dtype)
    copies = _RingCopies(start, num_chunks=1, ring_size=ring_size)
    for tensor in copies.distinct():  # distinct values where the copies are distinct tensors
        tensor.add_(torch.randn(numel, generator=generator, device="cuda").to(dtype))
    x = start * 1.5 + 0.25
    fused = _difference_into(torch.empty_like(x), x, copies)
    monkeypatch.setattr(low_precision_decentralized, "_difference_kernels", lambda: None)
    by_torch_ops = _difference_into(torch.empty_like(x), x, copies)
    assert torch.equal(fused, by_torch_ops), f"{int((fused != by_torch_ops).sum())} of {numel} elements differ"
    # And the ops are the spec's: x + L/3 + R/3 - 5w/3, up to rounding each of seven ops to the dtype (the operands
    # are sums of two normal samples, so every intermediate, 5w included, stays under 64 in magnitude here).
    spec = x.double() + copies.left.double() / 3 + copies.right.double() / 3 - 5 * copies.w.double() / 3
    torch.testing.assert_close(fused.double(), spec, rtol=0, atol=7 * torch.finfo(dtype).eps * 64 / 2)


def test_a_round_on_cpu_does_not_import_the_triton_kernel():
    # The kernel's module imports Triton: only a round on CUDA may load it.
    code = (
        "import torch\n"
        "from lightning_bagua.engine.algorithms.low_precision_decentralized import _difference_into, _RingCopies\n"
        "copies = _RingCopies(torch.ones(5), num_chunks=1, ring_size=2)\n"
        "d = _difference_into(torch.empty(5), torch.full((5,), 2.0), copies)\n"
        "assert torch.allclose(d, torch.full((5,), 2.0 + 2 / 3 - 5 / 3)), d\n"
    )
    assert not loads_module(code, "lightning_bagua.engine.algorithms._dcd_triton")


@pytest.mark.parametrize(("world_size", "held"), [(1, 1), (2, 2), (4, 3)])
def test_the_ring_keeps_only_the_copies_its_math_needs(world_size, held):
    # w, L and R, of which a ring of two needs one neighbour copy (L = R) and a ring of one none (L = R = w), and
    # where the round forms its difference; the difference's terms and the received codes live for a round only.
    impl = LowPrecisionDecentralizedAlgorithm(hierarchical=False).reify(fake_context(world_size, 1, hierarchical=False))
    weights = impl.state.weights[0].gather()
    copies = _ring_copies(weights, impl.state)
    distinct = copies.distinct()
    assert len(distinct) == held
    assert all(tensor.shape == weights.shape and tensor.dtype == weights.dtype for tensor in distinct)
    assert len({tensor.untyped_storage().data_ptr() for tensor in distinct}) == held
    kept = [value for value in vars(copies).values() if isinstance(value, torch.Tensor)]
    assert all(any(value is tensor for tensor in [*distinct, copies.difference]) for value in kept)
    assert copies.difference.shape == weights.shape
    assert all(copies.difference.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in distinct)
