"""``auto``: the decision from figures, its checks, and real Gloo processes measuring, deciding and resuming."""

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import (
    Algorithm,
    AutoAlgorithm,
    AutoFigures,
    BaguaDistributedDataParallel,
    ByteGradAlgorithm,
    GradientAllReduceAlgorithm,
    LowRankAlgorithm,
)
from lightning_bagua.engine.algorithms import _auto_factors
from lightning_bagua.engine.algorithms import auto as auto_module
from lightning_bagua.engine.algorithms.auto import AutoImpl, decide, describe_algorithm
from tests.distributed import run_processes

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results"
FEATURES = 32
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, FEATURES, generator=generator), torch.randn(8, 1, generator=generator)


def train(model: BaguaDistributedDataParallel, rank: int, steps: int, first: int = 0) -> None:
    optimizer = model.bagua_optimizers[0]
    for step in range(first, first + steps):
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def wrap(algorithm: Algorithm | str, ranks_per_node: int | None = None) -> BaguaDistributedDataParallel:
    module = make_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    return BaguaDistributedDataParallel(
        module, optimizers=[optimizer], algorithm=algorithm, ranks_per_node=ranks_per_node
    )


def figures_for(step_ms: dict[str, float]) -> AutoFigures:
    return AutoFigures(step_s={label: ms / 1e3 for label, ms in step_ms.items()})


FLAT = [
    GradientAllReduceAlgorithm(),
    ByteGradAlgorithm(hierarchical=False),
    LowRankAlgorithm(rank=16, hierarchical=False),
]


# -- the decision from figures --------------------------------------------------------------------------------------


BYTEGRAD_STEPS = _auto_factors.STEPS_TO_TARGET["bytegrad"]
LOW_RANK_STEPS = _auto_factors.STEPS_TO_TARGET["low_rank_r16"]


def test_the_pick_weighs_step_time_by_the_steps_to_ddps_loss():
    # low_rank's step is the shortest, but its extra steps to DDP's loss make it slower there than bytegrad.
    assert LOW_RANK_STEPS > BYTEGRAD_STEPS, "the figures below assume low_rank needs more steps than bytegrad"
    low_rank_ms = 6.0 * BYTEGRAD_STEPS / LOW_RANK_STEPS * 1.01
    assert low_rank_ms < 6.0
    figures = figures_for(
        {
            "gradient_allreduce": 10.0,
            "bytegrad(hierarchical=False)": 6.0,
            "low_rank(rank=16, hierarchical=False)": low_rank_ms,
        }
    )
    index, reason, predicted, factors = decide(FLAT, figures)
    assert index == 1
    assert predicted["bytegrad(hierarchical=False)"] == pytest.approx(6.0e-3 * BYTEGRAD_STEPS)
    assert predicted["low_rank(rank=16, hierarchical=False)"] == pytest.approx(low_rank_ms * 1e-3 * LOW_RANK_STEPS)
    assert factors["gradient_allreduce"] == 1.0
    assert f"{0.6 * BYTEGRAD_STEPS:.3g}x" in reason
    assert f"{BYTEGRAD_STEPS:.4g}x" in reason
    assert decide(FLAT, figures) == (index, reason, predicted, factors)  # deterministic


def test_nothing_faster_falls_back_to_gradient_allreduce():
    figures = figures_for(
        {
            "gradient_allreduce": 10.0,
            "bytegrad(hierarchical=False)": 10.0 / BYTEGRAD_STEPS * 1.01,
            "low_rank(rank=16, hierarchical=False)": 10.0 / LOW_RANK_STEPS * 1.01,
        }
    )
    index, reason, _, _ = decide(FLAT, figures)
    assert index == 0
    assert "nothing measured" in reason
    # An exact tie goes to gradient_allreduce too, and so do candidates left untimed.
    tie = {"gradient_allreduce": 10.0, "bytegrad(hierarchical=False)": 10.0 / BYTEGRAD_STEPS}
    assert decide(FLAT, figures_for(tie))[0] == 0
    assert decide(FLAT, figures_for({"bytegrad(hierarchical=False)": 1.0}))[0] == 0


def test_gradient_allreduce_lost_by_its_link_bound_gives_way_to_the_best_timed():
    figures = figures_for({"bytegrad(hierarchical=False)": 6.0, "low_rank(rank=16, hierarchical=False)": 5.0})
    figures.skipped["gradient_allreduce"] = "even at its link bound, 1x steps of 90.0 ms each lose to ..."
    index, reason, predicted, _ = decide(FLAT, figures)
    assert index == 2
    assert set(predicted) == {"bytegrad(hierarchical=False)", "low_rank(rank=16, hierarchical=False)"}
    assert "gradient_allreduce's gradients alone take longer over the link" in reason


def test_candidates_follow_the_layout():
    auto = AutoAlgorithm()
    assert [describe_algorithm(c) for c in auto.candidates_for(1, 4)] == [
        "gradient_allreduce",
        "bytegrad(hierarchical=False)",
        "low_rank(rank=16, hierarchical=False)",
    ]
    assert [describe_algorithm(c) for c in auto.candidates_for(2, 2)] == [
        "gradient_allreduce",
        "gradient_allreduce(hierarchical=True)",
        "bytegrad(hierarchical=False)",
        "bytegrad(hierarchical=True)",
        "low_rank(rank=16, hierarchical=False)",
        "low_rank(rank=16, hierarchical=True)",
    ]
    narrowed = AutoAlgorithm(candidates=[LowRankAlgorithm(rank=32, hierarchical=False)])
    assert [describe_algorithm(c) for c in narrowed.candidates_for(2, 2)] == [
        "gradient_allreduce",
        "low_rank(rank=32, hierarchical=False)",
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"candidates": ["qadam"]},
            ValueError,
            r"'qadam' is not a candidate.*gradient_allreduce, bytegrad, low_rank.*"
            r"\(async, decentralized, diloco, low_precision_decentralized, qadam\)",
        ),
        ({"candidates": ["bytegrad", "nope"]}, ValueError, r"'nope' is an unknown candidate"),
        (
            {"candidates": "bytegrad"},
            TypeError,
            r"must be a list of names or algorithms, got 'bytegrad'.*\['bytegrad'\]",
        ),
        ({"candidates": {"bytegrad"}}, TypeError, r"must be a list of names or algorithms, got \{'bytegrad'\}"),
        ({"candidates": [LowRankAlgorithm(rank=8)]}, ValueError, r"rank 8.*rank >= 16"),
        ({"max_trial_steps": 0}, ValueError, r"`max_trial_steps` must be at least 1, got 0"),
        ({"max_trial_steps": 3}, ValueError, r"max_trial_steps=3.*at least 4"),
        ({"trial_steps": -1}, ValueError, r"`trial_steps` must be at least 1"),
        ({"trial_steps": 2.5}, TypeError, r"`trial_steps` must be an int"),
        ({"min_trial_s": -1}, ValueError, r"`min_trial_s` must be a number of seconds >= 0, got -1"),
        ({"min_trial_s": "1s"}, ValueError, r"`min_trial_s` must be .* got '1s'.*Pass 0"),
        ({"run_steps": 0}, ValueError, r"`run_steps` must be at least 1, got 0"),
        ({"run_steps": 1e3}, TypeError, r"`run_steps` must be an int"),
    ],
)
def test_bad_input_fails_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        Algorithm.init("auto", **kwargs)


def test_factors_match_the_results_files():
    """Every factor is the largest steps-to-target ratio to DDP's over the CPU and GPU tables, to three digits."""
    ratios: dict[str, list[float]] = {}
    rows = json.loads((RESULTS / "time_to_accuracy_cpu.json").read_text())["combined"]
    ddp = {(row["task"], row["layout"]): row["steps_to_target"] for row in rows if row["method"] == "ddp"}
    for row in rows:
        method = row["method"].split(":")[0]
        if row["steps_to_target"] is not None and method != "ddp":
            ratios.setdefault(method, []).append(row["steps_to_target"] / ddp[row["task"], row["layout"]])
    table = (RESULTS / "gpu_network_lab.md").read_text()
    gpu = dict(re.findall(r"^\| (\w+) \| (\d+) \|", table, flags=re.MULTILINE))
    for method, steps in gpu.items():
        if method not in ("ddp", "gradient_allreduce"):
            ratios.setdefault(method, []).append(int(steps) / int(gpu["ddp"]))
    for method, factor in _auto_factors.STEPS_TO_TARGET.items():
        if method == "gradient_allreduce":
            continue
        assert factor == pytest.approx(max(ratios[method]), rel=1e-3), method


# -- real processes ---------------------------------------------------------------------------------------------------


# Given links, so that no collective times them; with _time_every_candidate no candidate is skipped.
SLOW_LINK = AutoFigures(
    links={"all": {"latency_s": 1e-3, "bandwidth_Bps": 1e3}},
    compress_s={
        describe_algorithm(candidate): 0.0
        for layout in ((1, 2), (2, 2))
        for candidate in AutoAlgorithm().candidates_for(*layout)
    },
)


def _time_every_candidate() -> None:
    """In this process, make every candidate's lower bound zero: none is skipped, whatever the machine's load."""
    AutoImpl._bound = lambda self, index: (0.0, "compute")  # type: ignore[method-assign]


def _measure_and_train(
    rank: int, world_size: int, ranks_per_node: int | None, steps: int, figures: AutoFigures | None = None
) -> dict[str, Any]:
    if figures is not None:
        _time_every_candidate()
    model = wrap(AutoAlgorithm(trial_steps=1, max_trial_steps=12, figures=figures), ranks_per_node)
    train(model, rank, steps)
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    decision = impl.decision
    result = {
        "label": None if decision is None else decision.label,
        "decision": None if decision is None else decision.to_dict(),
        "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "saved": model.bagua_state_dict(),
        "ops": sorted(model.communication_counter.bytes_by_op),
    }
    model.close()
    return result


# Given links alone: the compression work is timed.
SLOW_LINK_ONLY = AutoFigures(links=SLOW_LINK.links)


@pytest.mark.parametrize(
    ("world_size", "ranks_per_node", "figures"), [(2, None, None), (2, None, SLOW_LINK), (4, 2, SLOW_LINK_ONLY)]
)
def test_every_rank_gets_the_same_pick_and_weights(world_size, ranks_per_node, figures):
    results = run_processes(_measure_and_train, world_size, ranks_per_node, 16, figures)
    labels = {result["label"] for result in results}
    assert len(labels) == 1, labels
    assert None not in labels
    decision = results[0]["decision"]
    assert decision["layout"] == ([2, 2] if ranks_per_node else [1, 2])
    assert "gradient_allreduce" in decision["figures"]["step_s"]
    assert decision["trial_steps"] <= 12
    # What measuring cost beyond the pick's pace: the link timing at least, and never more than it took.
    assert 0 < decision["excess_s"] <= decision["measure_s"]
    if figures is None:
        assert set(decision["figures"]["links"]) == {"all"}
    if figures is SLOW_LINK_ONLY:
        # A method's flat and hierarchical forms do the same compression work, timed once for both.
        compress_s = decision["figures"]["compress_s"]
        for method in ("bytegrad", "low_rank(rank=16"):
            flat, hierarchical = (compress_s[label] for label in sorted(compress_s) if label.startswith(method))
            assert flat == hierarchical > 0, compress_s
    # Every candidate was timed or skipped with a reason; those timed really ran (their collectives are counted).
    step_s, skipped = decision["figures"]["step_s"], decision["figures"]["skipped"]
    expected = AutoAlgorithm().candidates_for(*decision["layout"])
    assert {describe_algorithm(c) for c in expected} == set(step_s) | set(skipped), decision
    if figures is not None:
        assert set(step_s) == set(expected_labels := {describe_algorithm(c) for c in expected}), expected_labels
        assert len(results[0]["ops"]) > 1, results[0]["ops"]  # the compressed candidates' collectives ran
    for result in results[1:]:
        for name, tensor in result["state"].items():
            torch.testing.assert_close(tensor, results[0]["state"][name], **TOLERANCE)


# Each candidate's step from its forward to its optimizer step's end, in ms.
ACTIVE_MS = dict(zip([describe_algorithm(c) for c in FLAT], [5.0, 4.0, 3.0], strict=True))


def _measured_around_pauses(rank: int, world_size: int) -> dict[str, Any]:
    """Measure on a clock the loop drives: each step takes its candidate's ``ACTIVE_MS`` and the time to the next
    forward 1 ms; after every fifth step a validation loop of 2 s runs, and step 6 pauses 2 s inside (a garbage
    collection of the whole process)."""
    _time_every_candidate()
    now = [0.0]
    auto_module._clock = lambda: now[0]  # type: ignore[attr-defined]
    given = AutoFigures(links=SLOW_LINK.links, compress_s=dict.fromkeys(ACTIVE_MS, 0.0))
    model = wrap(AutoAlgorithm(trial_steps=3, min_trial_s=0, run_steps=1000, figures=given))
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    optimizer = model.bagua_optimizers[0]
    step = 0
    while impl.decision is None:
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        now[0] += ACTIVE_MS[impl.labels[impl._trying]] / 1e3 + (2.0 if step == 6 else 0.0)
        optimizer.step()  # a plain loop: the optimizer's step hook marks the end
        now[0] += 2.0 if step % 5 == 4 else 1e-3
        step += 1
    decision = impl.decision.to_dict()
    model.close()
    return decision


def test_validation_between_trial_steps_and_pauses_within_them_are_no_measuring_cost():
    # Four steps each (one settles the switch), in bound order: gradient_allreduce (steps 0-3), bytegrad (4-7),
    # low_rank (8-11). Counted as they came, the pauses in and after bytegrad's steps would make its steps 0.5 s
    # and spend the allowance of 5% of 1,000 steps before low_rank could run.
    results = run_processes(_measured_around_pauses, 2)
    assert results[0] == results[1]
    decision = results[0]
    step_ms = {label: active + 1.0 for label, active in ACTIVE_MS.items()}
    assert decision["figures"]["step_s"] == pytest.approx({k: v / 1e3 for k, v in step_ms.items()}, rel=1e-9)
    assert decision["figures"]["skipped"] == {}
    assert decision["label"] == LOW_RANK_LABEL
    assert decision["trial_steps"] == 12
    # bytegrad's paused step counts as four of its 4 ms steps: its four steps, with their usual 1 ms gaps, 32 ms.
    spent_ms = {"gradient_allreduce": 4 * 6.0, BYTEGRAD_LABEL: 4 + 4 + 16 + 4 + 4 * 1.0, LOW_RANK_LABEL: 4 * 4.0}
    assert decision["measure_s"] == pytest.approx(sum(spent_ms.values()) / 1e3, rel=1e-9)
    per_step = {label: spent / 4 for label, spent in spent_ms.items()}
    expected = _excess_ms({"gradient_allreduce": 4, BYTEGRAD_LABEL: 4}, per_step, LOW_RANK_LABEL)
    assert decision["excess_s"] == pytest.approx(expected / 1e3, rel=1e-9)


INJECTED = figures_for(
    {"gradient_allreduce": 10.0, "bytegrad(hierarchical=False)": 9.0, "low_rank(rank=16, hierarchical=False)": 5.0}
)


def _injected_against_named(rank: int, world_size: int) -> dict[str, Any]:
    auto = wrap(AutoAlgorithm(figures=INJECTED))
    named = wrap(LowRankAlgorithm(rank=16, hierarchical=False))
    impl = auto.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    assert impl.decision is not None
    train(auto, rank, 14)
    train(named, rank, 14)
    result = {
        "label": impl.decision.label,
        "trial_steps": impl.decision.trial_steps,
        "auto": dict(auto.module.state_dict()),
        "named": dict(named.module.state_dict()),
    }
    auto.close()
    named.close()
    return result


def test_injected_figures_pick_at_once_and_train_as_the_named_pick():
    for result in run_processes(_injected_against_named, 2):
        assert result["label"] == "low_rank(rank=16, hierarchical=False)"
        assert result["trial_steps"] == 0
        for name, tensor in result["auto"].items():
            torch.testing.assert_close(tensor, result["named"][name], rtol=0, atol=0)


def _resume(rank: int, world_size: int, saved: dict[str, Any], ranks_per_node: int | None) -> dict[str, Any]:
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_bagua").addHandler(handler)
    model = wrap("auto", ranks_per_node)
    model.load_bagua_state_dict(saved)
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    result = {"label": None if impl.decision is None else impl.decision.label, "warnings": warnings}
    model.close()
    return result


def test_a_resume_keeps_the_pick_and_a_changed_layout_decides_again():
    results = run_processes(_measure_and_train, 4, 2, 16, SLOW_LINK)
    label = results[0]["label"]
    same = run_processes(_resume, 4, results[0]["saved"], 2)
    assert [result["label"] for result in same] == [label] * 4
    assert not same[0]["warnings"]
    changed = run_processes(_resume, 4, results[0]["saved"], 1)
    assert [result["label"] for result in changed] == [None] * 4
    assert any("decides again" in warning and "2x2" in warning for warning in changed[0]["warnings"])


def test_resize_state_keeps_the_decision_so_the_load_decides_again():
    class _Groups:
        rank, world_size = 0, 2

    impl = AutoImpl.__new__(AutoImpl)
    impl.context = type("Context", (), {"groups": _Groups()})()  # type: ignore[assignment]
    saved = [{"version": 1, "decision": {"world_size": 4}, "state": {"steps": 3}}] * 4
    assert impl.resize_state(saved)["decision"] == {"world_size": 4}
    assert impl.resize_state([]) == {}


BYTEGRAD_LABEL, LOW_RANK_LABEL = "bytegrad(hierarchical=False)", "low_rank(rank=16, hierarchical=False)"


def wide_model() -> nn.Module:
    """A model whose matrices low_rank factors at rank 16 (``make_model``'s are too small for its 8-bit factors)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512))


def _trial_plan(
    rank: int,
    world_size: int,
    step_ms: dict[str, float],
    bandwidth: float,
    run_steps: int | None = None,
    start_up_ms: float = 0.0,
    codec_load_ms: float = 0.0,
    later_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The plan rank 0 makes, each candidate it runs taking ``step_ms[label]`` a step: what it times, and skips.

    Each rank works it out from the same figures, as rank 0 does alone in training; the link timing took
    ``start_up_ms``, and loading the codec ``codec_load_ms``. A candidate in ``later_ms`` takes that much a step
    once timed longer than its first trial (its median over all its timed steps).
    """
    module = wide_model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    model = BaguaDistributedDataParallel(module, optimizers=[optimizer], algorithm=AutoAlgorithm(run_steps=run_steps))
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    impl._figures = AutoFigures(
        links={"all": {"latency_s": 0.0, "bandwidth_Bps": bandwidth}},
        gradient_bytes={"float32": sum(p.numel() * 4 for p in model.module.parameters())},
        compress_s=dict.fromkeys(impl.labels, 0.0),
    )
    impl._queue, impl._close, impl._times, impl._trial_steps = None, None, {}, 0
    impl._start_up_s, impl._codec_load_s, impl._spent, impl._trying = start_up_ms / 1e3, codec_load_ms / 1e3, {}, -1
    plan = []
    index, steps = impl._next_trial()
    while index >= 0:
        label = impl.labels[index]
        done = len(impl._times.get(index, []))
        ran = steps - done + (index != impl._trying)  # the first step after a switch is not timed
        impl._trial_steps += ran
        ms = step_ms[label] if steps == impl.auto.trial_steps else (later_ms or {}).get(label, step_ms[label])
        impl._spent.setdefault(index, []).extend([ms / 1e3] * ran)
        impl._trying, impl._timed_steps = index, steps
        impl._times[index] = [ms / 1e3] * steps
        impl._figures.step_s[label] = ms / 1e3
        plan.append((label, steps))
        index, steps = impl._next_trial()
    chosen, reason, _, _ = decide(impl.candidates, impl._figures)
    result = {
        "plan": plan,
        "steps": impl._trial_steps,
        "skipped": dict(impl._figures.skipped),
        "pick": impl.labels[chosen],
        "reason": reason,
        "excess_ms": impl._excess_s() * 1e3,
    }
    model.close()
    return result


EVERY_STEP_2_MS = dict.fromkeys(["gradient_allreduce", BYTEGRAD_LABEL, LOW_RANK_LABEL], 2.0)


def test_short_steps_are_timed_longer_where_the_candidates_are_close():
    # A fast link: the fewest bytes first, each candidate for its 3 timed steps. 2 ms steps: 0.25 s would take 125
    # of them; all three are within 1.5x of the best, so they share the 36 steps left of 48: gradient_allreduce, on
    # trial, goes on for 12 more; the others pay an untimed step after their switch.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12)
    assert result["plan"] == [
        (LOW_RANK_LABEL, 3),
        (BYTEGRAD_LABEL, 3),
        ("gradient_allreduce", 3),
        ("gradient_allreduce", 15),
        (BYTEGRAD_LABEL, 14),
        (LOW_RANK_LABEL, 14),
    ]
    assert result["steps"] == 48
    assert result["pick"] == "gradient_allreduce"  # a tie in step time: the others need more steps
    (result,) = run_processes(_trial_plan, 1, dict.fromkeys(EVERY_STEP_2_MS, 100.0), 1e12)
    assert [steps for _, steps in result["plan"]] == [3, 3, 3]  # 3 steps of 100 ms fill min_trial_s already
    # gradient_allreduce's 6.9 ms is more than 1.5x bytegrad's 4.1 ms x 1.065: no noise of a few steps brings it
    # level, so only the two close ones are timed longer, the best first.
    step_ms = {"gradient_allreduce": 6.9, BYTEGRAD_LABEL: 4.1, LOW_RANK_LABEL: 5.0}
    (result,) = run_processes(_trial_plan, 1, step_ms, 1e12)
    assert result["plan"][3:] == [(BYTEGRAD_LABEL, 20), (LOW_RANK_LABEL, 20)]
    assert result["pick"] == BYTEGRAD_LABEL


def _excess_ms(steps: dict[str, int], step_ms: dict[str, float], best: str, start_up_ms: float = 0.0) -> float:
    """What trial steps cost beyond the best candidate's pace: each step's time less the best one's for its progress."""
    pace = step_ms[best] * FACTORS[best]
    return start_up_ms + sum(count * max(step_ms[label] - pace / FACTORS[label], 0.0) for label, count in steps.items())


FACTORS = {"gradient_allreduce": 1.0, BYTEGRAD_LABEL: BYTEGRAD_STEPS, LOW_RANK_LABEL: LOW_RANK_STEPS}


def test_a_known_run_length_bounds_what_measuring_costs_beyond_the_best_pace():
    # 230 steps of 2 ms: 5% is 23 ms. Candidates this close cost little to time: the same 48 steps as an unknown
    # length, and what they cost beyond gradient_allreduce's pace, low_rank's and bytegrad's 16 steps each making
    # less progress, is 5.5 ms.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12, 230)
    assert result["steps"] == 48
    expected = _excess_ms({LOW_RANK_LABEL: 16, BYTEGRAD_LABEL: 16}, EVERY_STEP_2_MS, "gradient_allreduce")
    assert result["excess_ms"] == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(5.51, abs=0.01)
    # The link timing took 15 ms: low_rank's longer steps fit the 8 ms left (12 more at 0.22 ms each), and
    # bytegrad's 0.92 ms of excess per step leaves no room for one more after them.
    step_ms = {**EVERY_STEP_2_MS, BYTEGRAD_LABEL: 2.8}
    (result,) = run_processes(_trial_plan, 1, step_ms, 1e12, 230, 15.0)
    assert result["plan"] == [
        (LOW_RANK_LABEL, 3),
        (BYTEGRAD_LABEL, 3),
        ("gradient_allreduce", 3),
        ("gradient_allreduce", 15),
        (LOW_RANK_LABEL, 14),
    ]
    expected = _excess_ms({LOW_RANK_LABEL: 16, BYTEGRAD_LABEL: 4}, step_ms, "gradient_allreduce", 15.0)
    assert result["excess_ms"] == pytest.approx(expected, rel=1e-9)
    assert expected <= 0.05 * 230 * 2.0
    # A link timing of 30 ms has spent the allowance: gradient_allreduce, the fallback, still runs and is timed
    # longer at no cost (it is the best), and bytegrad is skipped, with why.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12, 230, 30.0)
    assert result["plan"] == [(LOW_RANK_LABEL, 3), ("gradient_allreduce", 3), ("gradient_allreduce", 23)]
    assert result["skipped"] == {
        BYTEGRAD_LABEL: "past the allowance of 23.0 ms beyond the best candidate's steps (5% of 230 steps of 2.0 ms):"
        " measuring had cost 30.0 ms"
    }
    assert result["pick"] == "gradient_allreduce"
    # Loading the codec took 300 ms: no cost of timing the compressing candidates, which would pay it anyway if
    # picked; once gradient_allreduce is the best it is measuring's, and leaves no room to time them longer.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12, 230, 0.0, 300.0)
    assert result["plan"] == [
        (LOW_RANK_LABEL, 3),
        (BYTEGRAD_LABEL, 3),
        ("gradient_allreduce", 3),
        ("gradient_allreduce", 15),
    ]
    expected = _excess_ms({LOW_RANK_LABEL: 4, BYTEGRAD_LABEL: 4}, EVERY_STEP_2_MS, "gradient_allreduce", 300.0)
    assert result["excess_ms"] == pytest.approx(expected, rel=1e-9)
    # Where bytegrad is the best, the loading is its own cost: the close ones are timed longer within 5%.
    step_ms = {"gradient_allreduce": 3.0, BYTEGRAD_LABEL: 2.0, LOW_RANK_LABEL: 3.0}
    (result,) = run_processes(_trial_plan, 1, step_ms, 1e12, 230, 0.0, 300.0)
    assert result["plan"][3:] == [("gradient_allreduce", 20), (BYTEGRAD_LABEL, 21)]  # low_rank is 1.59x off
    assert result["pick"] == BYTEGRAD_LABEL
    expected = _excess_ms({LOW_RANK_LABEL: 4, "gradient_allreduce": 21}, step_ms, BYTEGRAD_LABEL)
    assert result["excess_ms"] == pytest.approx(expected, rel=1e-9)
    assert expected <= 0.05 * 230 * 2.0
    # 100 steps: measuring takes at most 25 of them, however cheap.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12, 100)
    assert result["steps"] == 25
    assert [steps for _, steps in result["plan"]] == [3, 3, 3, 7, 6, 7]
    # 20 steps: never fewer than the first candidate's and gradient_allreduce's 4 steps each.
    (result,) = run_processes(_trial_plan, 1, EVERY_STEP_2_MS, 1e12, 20)
    assert result["plan"] == [(LOW_RANK_LABEL, 3), ("gradient_allreduce", 3)]
    assert result["skipped"] == {BYTEGRAD_LABEL: "past the budget of 8 measuring steps"}
    assert result["pick"] == "gradient_allreduce"


def test_a_slow_link_times_the_fewest_bytes_first_and_skips_what_its_link_bound_loses():
    # At this bandwidth DDP's gradients take 90 ms. low_rank sends the fewest bytes (its 8-bit factors and the exact
    # biases, 3% of the gradient bytes) and runs first. Once it measures 20 ms (22.5 ms to DDP's loss with its
    # 1.125x steps), bytegrad's link bound, its extra steps of one byte per element (22.5 ms each), cannot win, and
    # gradient_allreduce's 90 ms of bytes cannot either: neither runs a step, and low_rank is the pick.
    assert LOW_RANK_STEPS == 1.125, "the 20 ms below give low_rank 22.5 ms per DDP step at 1.125x steps"
    numel = sum(p.numel() for p in wide_model().parameters())
    bandwidth = 4 * numel / 0.090
    step_ms = {"gradient_allreduce": 100.0, BYTEGRAD_LABEL: 30.0, LOW_RANK_LABEL: 20.0}
    (result,) = run_processes(_trial_plan, 1, step_ms, bandwidth)
    assert result["plan"] == [(LOW_RANK_LABEL, 3), (LOW_RANK_LABEL, 13)]  # 13 steps of 20 ms fill min_trial_s
    assert result["steps"] == 14
    assert re.fullmatch(
        re.escape(f"even at its link bound, {BYTEGRAD_STEPS:.4g}x steps of 22.5 ms each lose to {LOW_RANK_LABEL}'s")
        + r" 22\.5 ms per DDP step",
        result["skipped"][BYTEGRAD_LABEL],
    ), result["skipped"]
    assert result["skipped"]["gradient_allreduce"].startswith("even at its link bound, 1x steps of 90.0 ms each")
    assert result["pick"] == LOW_RANK_LABEL
    assert "gradient_allreduce's gradients alone take longer over the link" in result["reason"]
    # A link fast enough that gradient_allreduce could win: it runs, and wins on its measured step.
    (result,) = run_processes(_trial_plan, 1, {**step_ms, "gradient_allreduce": 21.0}, bandwidth * 10)
    assert ("gradient_allreduce", 12) in result["plan"]  # 12 steps of 21 ms fill min_trial_s
    assert result["pick"] == "gradient_allreduce"


def test_a_bound_that_lost_to_the_first_figures_is_held_against_the_final_ones():
    # The slow link above. low_rank's first 3 steps take 20 ms, 22.5 ms per DDP step: bytegrad's link bound
    # (23.96 ms) loses, and it is skipped. Timed longer, low_rank takes 24 ms a step, 27 ms per DDP step: bytegrad's
    # bound now wins, so it goes on trial (an untimed step and 3), and at 22.6 ms a step (24.07 per DDP step) it is
    # the best: both are close, so bytegrad is timed longer (12 steps fill min_trial_s), and low_rank has enough.
    numel = sum(p.numel() for p in wide_model().parameters())
    bandwidth = 4 * numel / 0.090
    step_ms = {"gradient_allreduce": 100.0, BYTEGRAD_LABEL: 22.6, LOW_RANK_LABEL: 20.0}
    (result,) = run_processes(_trial_plan, 1, step_ms, bandwidth, None, 0.0, 0.0, {LOW_RANK_LABEL: 24.0})
    assert result["plan"] == [(LOW_RANK_LABEL, 3), (LOW_RANK_LABEL, 13), (BYTEGRAD_LABEL, 3), (BYTEGRAD_LABEL, 12)]
    assert result["pick"] == BYTEGRAD_LABEL
    # gradient_allreduce's bytes lose still; its reason names the best in the final figures, as the log line does.
    assert result["skipped"] == {
        "gradient_allreduce": f"even at its link bound, 1x steps of 90.0 ms each lose to {BYTEGRAD_LABEL}'s 24.1 ms"
        " per DDP step"
    }
    # Where low_rank's longer timing holds its first figure, bytegrad's bound still loses: it is not timed.
    (result,) = run_processes(_trial_plan, 1, step_ms, bandwidth, None, 0.0, 0.0, {LOW_RANK_LABEL: 20.0})
    assert result["plan"] == [(LOW_RANK_LABEL, 3), (LOW_RANK_LABEL, 13)]
    assert set(result["skipped"]) == {"gradient_allreduce", BYTEGRAD_LABEL}


@pytest.mark.parametrize(
    ("latency_s", "bandwidth", "large", "sizes"),
    [
        # 10 Mbit/s: 64 KiB already takes 8x the 4 KiB message; a gradient-sized one would cost a step per call.
        (1e-3, 1.25e6, 4 * 1024**2, [4096, 65536]),
        # An unshaped link stays latency-bound up to the gradients' size, which ends the growth.
        (5e-5, 1e10, 4 * 1024**2, [4096, 65536, 262144, 1048576, 4194304]),
        (5e-5, 1e10, 100_000, [4096, 65536, 100_000]),
        # Gradients smaller than the first step of the growth are the larger message themselves.
        (5e-5, 1e10, 38_440, [4096, 38_440]),
    ],
)
def test_link_timing_grows_its_message_only_until_bandwidth_binds(monkeypatch, latency_s, bandwidth, large, sizes):
    timed: list[int] = []

    def all_reduce_s(group: Any, size: int, device: torch.device, connect: bool = False) -> float:
        timed.append(size)
        return latency_s + size / bandwidth

    monkeypatch.setattr(auto_module, "_all_reduce_s", all_reduce_s)
    figures = auto_module._time_link(None, large, torch.device("cpu"))  # type: ignore[arg-type]
    assert timed == sizes
    torch.testing.assert_close(figures["latency_s"], latency_s, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(figures["bandwidth_Bps"], bandwidth, rtol=1e-6, atol=0.0)


def test_a_link_whose_bytes_cost_nothing_measurable_reads_as_such(monkeypatch):
    # Noise made every larger message as quick as the 4 KiB one: no bandwidth can be fitted, and none is made up.
    times = iter([2e-4, 1.9e-4, 2e-4, 1.8e-4, 1.9e-4])
    monkeypatch.setattr(auto_module, "_all_reduce_s", lambda *args, **kwargs: next(times))
    figures = auto_module._time_link(None, 4 * 1024**2, torch.device("cpu"))  # type: ignore[arg-type]
    assert figures == {"latency_s": 2e-4, "bandwidth_Bps": math.inf}
    decision = auto_module.AutoDecision(
        GradientAllReduceAlgorithm(), "gradient_allreduce", "nothing was faster.", AutoFigures(links={"all": figures}),
        {}, {}, world_size=2, layout=(1, 2),
    )  # fmt: skip
    assert "Links: all bandwidth beyond what the timed sizes resolve, 0.20 ms." in decision.summary()


def test_a_decision_that_measured_nothing_says_so_without_empty_parts():
    decision = auto_module.AutoDecision(
        GradientAllReduceAlgorithm(), "gradient_allreduce", "one rank has nothing to communicate.", AutoFigures(),
        {}, {}, world_size=1, layout=(1, 1),
    )  # fmt: skip
    assert decision.summary() == (
        "Bagua auto picked gradient_allreduce: one rank has nothing to communicate. Nothing was measured."
    )


def _link_figures(rank: int, world_size: int) -> dict[str, float]:
    return auto_module._time_link(dist.group.WORLD, 4 * 1024**2, torch.device("cpu"))


def test_every_rank_reads_the_same_link_figures():
    # Each rank times its own calls; the sizes they go on to, and so the figures, must agree or they would deadlock.
    first, second = run_processes(_link_figures, 2)
    assert first == second
    assert first["bandwidth_Bps"] > 0
    assert first["latency_s"] >= 0


def _world_of_one(rank: int, world_size: int) -> dict[str, Any]:
    model = wrap("auto")
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    assert impl.decision is not None
    _, hook = impl.communication_hook()
    train(model, rank, 2)
    result = {"label": impl.decision.label, "hook": hook.__name__, "trial_steps": impl.decision.trial_steps}
    model.close()
    return result


def test_one_rank_picks_gradient_allreduce_at_once_with_its_own_hook():
    (result,) = run_processes(_world_of_one, 1)
    assert result == {"label": "gradient_allreduce", "hook": "gradient_allreduce_hook", "trial_steps": 0}


def _pick_against_named(rank: int, world_size: int, forced: int | None) -> dict[str, Any]:
    """Measure for real, then train on; the same steps from the same weights with the pick named directly.

    ``forced`` overrides the measured pick with that candidate, so that every candidate's hand-over is checked
    whatever the machine's load makes the measurement pick.
    """
    if forced is not None:
        import lightning_bagua.engine.algorithms.auto as auto_module

        measured = auto_module.decide
        auto_module.decide = lambda candidates, figures: (forced, *measured(candidates, figures)[1:])
    _time_every_candidate()
    model = wrap(AutoAlgorithm(trial_steps=1, max_trial_steps=12, figures=SLOW_LINK))
    impl = model.bagua_algorithm_impl
    assert isinstance(impl, AutoImpl)
    step = 0
    while impl.decision is None:
        before = {key: value.clone() for key, value in model.module.state_dict().items()}
        train(model, rank, 1, first=step)
        step += 1
    assert impl.decision is not None
    # The pick ran from the forward of step `step - 1` on, which started from `before`.
    named_module = make_model()
    named_module.load_state_dict(before)
    optimizer = torch.optim.SGD(named_module.parameters(), lr=0.05)
    picked = impl.decision.algorithm
    keywords = {key: getattr(picked, key) for key in picked.keywords()}
    named = BaguaDistributedDataParallel(
        named_module, optimizers=[optimizer], algorithm=Algorithm.init(picked.name, **keywords)
    )
    if not isinstance(picked, LowRankAlgorithm):
        # DDP reorders a bucket's gradients after its first backward, and bytegrad's chunks (each with its own
        # range) follow that order; the trials already reordered auto's buckets. A backward without an optimizer
        # step reorders the reference's too and leaves these stateless algorithms as they were.
        inputs, targets = batch_for(rank, step - 1)
        nn.functional.mse_loss(named(inputs), targets).backward()
        optimizer.zero_grad()
    train(model, rank, 12, first=step)
    train(named, rank, 13, first=step - 1)
    result = {"label": impl.decision.label, "auto": model.module.state_dict(), "named": named.module.state_dict()}
    model.close()
    named.close()
    return result


@pytest.mark.parametrize("forced", [None, 0, 1, 2], ids=["measured", "gradient_allreduce", "bytegrad", "low_rank"])
def test_training_after_a_measured_pick_is_the_pick_named_directly(forced):
    results = run_processes(_pick_against_named, 2, forced)
    assert results[0]["label"] == results[1]["label"]
    if forced is not None:
        assert results[0]["label"] == describe_algorithm(FLAT[forced])
    for result in results:
        for name, tensor in result["auto"].items():
            torch.testing.assert_close(tensor, result["named"][name], **TOLERANCE)


def test_the_decision_reads_as_log_line_metrics_and_checkpoint():
    auto = AutoAlgorithm(figures=INJECTED)
    candidates = auto.candidates_for(1, 2)
    index, reason, predicted, factors = decide(candidates, INJECTED)
    from lightning_bagua.engine import AutoDecision

    decision = AutoDecision(candidates[index], describe_algorithm(candidates[index]), reason, INJECTED, predicted,
                            factors, world_size=2, layout=(1, 2), trial_steps=9, measure_s=0.5,
                            excess_s=0.02)  # fmt: skip
    assert decision.summary().startswith("Bagua auto picked low_rank(rank=16, hierarchical=False): it reaches")
    assert decision.summary().endswith(
        "Measuring took 9 steps and 0.50 s on rank 0, 0.02 s more than the pick would have taken."
    )
    metrics = decision.metrics()
    assert metrics["bagua/auto/excess_s"] == pytest.approx(0.02)
    assert metrics["bagua/auto/picked/low_rank(rank=16, hierarchical=False)"] == 1.0
    assert metrics["bagua/auto/predicted_s/gradient_allreduce"] == pytest.approx(10e-3)
    restored = AutoDecision.from_dict(decision.to_dict())
    assert restored.algorithm == LowRankAlgorithm(rank=16, hierarchical=False)
    assert restored.to_dict() == decision.to_dict()


@pytest.mark.parametrize("package", ["lightning.pytorch", "lightning.fabric"])
def test_strategies_take_auto_by_name_and_check_its_keywords_at_construction(package):
    import importlib

    import torch.distributed as dist

    registry = importlib.import_module(f"{package}.strategies")
    strategy_cls = importlib.import_module(
        "lightning_bagua.strategies.bagua" if package == "lightning.pytorch" else "lightning_bagua.strategies.fabric"
    ).BaguaStrategy
    assert isinstance(strategy_cls(algorithm="auto").algorithm, AutoAlgorithm)
    assert isinstance(strategy_cls.auto(trial_steps=2).algorithm, AutoAlgorithm)
    assert isinstance(strategy_cls().algorithm, GradientAllReduceAlgorithm)  # "bagua" keeps gradient_allreduce
    names = registry.StrategyRegistry if package == "lightning.pytorch" else registry.STRATEGY_REGISTRY
    assert "bagua_auto" in names
    with pytest.raises(ValueError, match="'qadam' is not a candidate"):
        strategy_cls(algorithm="auto", candidates=["qadam"])
    with pytest.raises(ValueError, match="`max_trial_steps` must be at least 1, got 0"):
        strategy_cls(algorithm="auto", max_trial_steps=0)
    assert not dist.is_initialized()
