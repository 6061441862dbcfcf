"""The ``diloco`` algorithm through BaguaStrategy: Lightning fits on real processes, checked to have really run it."""

import pytest
import torch

from tests.strategies.test_bagua import load_ranks, run_script

SYNC_EVERY = 2
KWARGS = f'{{"sync_every": {SYNC_EVERY}, "hierarchical": false, "quantization": "uint8"}}'


@pytest.mark.parametrize(
    ("extra", "steps"),
    [
        (("--accumulate", "2", "--precision", "bf16-mixed", "--val-check-interval", "3"), 6),
        (("--manual",), 7),
    ],
    ids=["accumulate-bf16-validation-ends-on-sync", "manual-ends-past-sync"],
)
def test_diloco_fits_and_trains_local_replicas(tmp_path, extra, steps):
    run_script(tmp_path, "--algorithm", "diloco", "--kwargs", KWARGS, "--max-steps", str(steps), *extra)
    results = load_ranks(tmp_path, 2)
    states = [result["state"] for result in results]
    if steps % SYNC_EVERY:
        # The replicas differ between syncs: they trained locally.
        assert any(not torch.equal(states[0][key], states[1][key]) for key in states[0])
    else:
        # The last step is a sync step, and its sync ran with its optimizer step: the replicas are θ_outer.
        for key in states[0]:
            torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0, msg=key)
    for result in results:
        assert result["seen"]["fit_model"] == "BaguaDistributedDataParallel"
        assert result["model_after_fit"] == "Regression"
        # Only the outer exchanges crossed between the ranks: no gradient was all-reduced.
        assert set(result["bytes_by_op"]) == {"all_gather"}
        assert result["calls"]["all_gather"] >= 2
        validated = result["seen"].get("validated_in_fit", [])
        assert len(validated) == (steps * 2 // 3 if "--val-check-interval" in extra else 0)  # every 3rd of 12 batches
    # Validation inside fit saw θ_outer, the same on every rank, while the ranks' training replicas differed (at a
    # validation right after a sync they are θ_outer too, so not at every one).
    first, second = (result["seen"].get("validated_in_fit", []) for result in results)
    for shown, other in zip(first, second, strict=True):
        torch.testing.assert_close(shown["shown"], other["shown"], rtol=0, atol=0)
    if first:
        assert any(not torch.equal(shown["local"], other["local"]) for shown, other in zip(first, second, strict=True))
        assert any(not torch.equal(shown["shown"], shown["local"]) for shown in first)
    if first and not steps % SYNC_EVERY:
        # The last validation came right after the last step, a sync step: it saw that sync's θ_outer, which every
        # rank's model holds after fit.
        final = torch.cat([value.flatten() for key, value in states[0].items() if key.endswith(("weight", "bias"))])
        for last in (first[-1], second[-1]):
            torch.testing.assert_close(last["shown"], final, rtol=0, atol=0)
