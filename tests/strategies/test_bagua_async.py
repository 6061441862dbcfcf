"""The ``async`` algorithm through BaguaStrategy: a Lightning fit on real processes, with validation inside fit."""

import pytest

from tests.distributed import assert_ranks_identical
from tests.strategies.test_bagua import load_ranks, param_bytes, run_script

WARMUP_STEPS = 2
STEPS = 6
# Validation after training batches 3 and 6; with pause_for_validation=True the first pauses averaging mid-fit,
# then training resumes.
ARGS = (
    *(
        "--algorithm",
        "async",
        "--kwargs",
        f'{{"sync_interval_ms": 1, "warmup_steps": {WARMUP_STEPS}, "pause_for_validation": true}}',
    ),
    *("--max-steps", str(STEPS), "--val-check-interval", "3"),
)


def check_async_fit(results: list[dict]) -> None:
    # Fitting ended with abort(), whose final average leaves the replicas identical bit for bit.
    assert_ranks_identical(results)
    for result in results:
        assert result["seen"]["fit_model"] == "BaguaDistributedDataParallel"
        # Validation ran inside fit, on the wrapped model, and the model is unwrapped afterwards.
        assert result["seen"]["validate_model"] == "BaguaDistributedDataParallel"
        assert result["model_after_fit"] == "Regression"
        assert set(result["bytes_by_op"]) == {"all_reduce"}
        # The warm-up's gradients, then at least the averages that pause for validation (after batches 3 and 6)
        # and end training; stop-code negotiations add 4 bytes each.
        assert result["bytes_by_op"]["all_reduce"] >= (WARMUP_STEPS + 3) * param_bytes()
        assert result["train_loss"] < 1.0


def test_async_fits_with_validation_inside_fit_on_cpu(tmp_path):
    run_script(tmp_path, "--devices", "2", *ARGS)
    check_async_fit(load_ranks(tmp_path, 2))


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_async_fits_on_two_gpus(tmp_path, precision):
    run_script(tmp_path, "--accelerator", "gpu", "--devices", "2", "--precision", precision, *ARGS)
    check_async_fit(load_ranks(tmp_path, 2))


class _RecordingImpl:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def start(self) -> None:
        self.calls.append("start")

    def stop(self, wait: bool = True) -> None:
        self.calls.append(f"stop(wait={wait})")


@pytest.mark.parametrize(("pause", "expected"), [(False, []), (True, ["stop(wait=True)", "start"])])
def test_validation_inside_fit_leaves_background_work_alone_unless_asked(monkeypatch, pause, expected):
    # lightning-bagua 0.1.0 made no sync around validation; pause_for_validation=True asks for one.
    from lightning_bagua import BaguaStrategy

    calls: list[str] = []
    strategy = BaguaStrategy(algorithm="async", pause_for_validation=pause)
    monkeypatch.setattr(strategy, "_algorithm_impl", lambda: _RecordingImpl(calls))
    strategy.on_validation_start()
    strategy.on_validation_end()
    assert calls == expected
    assert strategy.pause_for_validation is pause


def test_fabric_refuses_pause_for_validation_with_what_to_do_instead():
    from lightning_bagua.strategies.fabric import BaguaStrategy

    with pytest.raises(TypeError, match=r"Trainer's validation inside fit.*stop\(\)` and `\.start\(\)"):
        BaguaStrategy(algorithm="async", pause_for_validation=True)
