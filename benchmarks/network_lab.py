"""CPU network lab: the step time of every method on Gloo ranks in network-namespace hosts over ``tc``-shaped links.

Each host is a network namespace (:func:`lab.harness.lab_hosts`); ranks of one host talk unshaped, every collective
that leaves it crosses a link of the chosen rate. Per rate the ranks start once and time every (round, method)
with a fresh model, methods round-robin and rotated each round; a method's step is its slowest rank's median after
the warm-up, and the report gives the median over the rounds [min, max], the payload per step and the first steps.
A method that fails is recorded with its error and the rest goes on. Methods: ``single`` (no communication),
DDP and torch's hooks, every engine algorithm (``:flat`` / ``:hierarchical`` with several ranks per host), and by
name ``ddp_adam``, ``diloco_h<H>`` and ``torchft_diloco_h<H>``; the model is an MLP or, with ``--task``, a
convergence task's network. The Performance page documents the options. Run it as root::

    python benchmarks/network_lab.py                         # 100 Mbit/s, 1 Gbit/s, 10 Gbit/s and unshaped
    python benchmarks/network_lab.py --rates 1gbit --steps 5 --rounds 2 --methods ddp bytegrad   # a quick look
    python benchmarks/network_lab.py --ranks-per-host 2 --rates 1gbit 100mbit          # 4 ranks, 2 nodes x 2
    python benchmarks/network_lab.py --check-links 100 10000   # single messages over each link, two bucket sizes

It writes ``benchmarks/results/network_lab_cpu.{json,md,png}``; other layouts write ``network_lab_cpu_<hosts>x<ranks
per host>.*``, ``--no-local-world-size`` adds ``_hosts`` and ``--task`` adds ``_<task>``.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The labs are scripts, not a package: their folder goes on the path for the shared harness (the task networks too).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import (
    BURST_US,
    bits_per_second,
    check_links,
    headline,
    interleaved,
    lab_hosts,
    links_table,
    require_lab_tools,
    result_lines,
)
from lab.jobs import job_env
from lab.methods import (
    ALGORITHM_VARIANTS,
    DILOCO_METHODS,
    LOW_RANK_RANKS,
    TORCHFT_FLAT_NOTE,
    TORCHFT_METHODS,
    TORCHFT_NOTE,
    diloco_period,
    engine_algorithm,
    extra_low_rank_methods,
    layout_variants,
    split_rank,
    torchft_settings,
)
from lab.models import random_batch, task_loss, task_model
from lab.render import markdown_table, pyplot
from lab.results import stamp, write_report

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
# DDP, with torch's fp16 and PowerSGD hooks; ``ddp_powersgd`` is rank 1, ``ddp_powersgd_r<k>`` rank k.
DDP_METHODS = ("ddp", "ddp_fp16", "ddp_powersgd", *(f"ddp_powersgd_r{rank}" for rank in LOW_RANK_RANKS if rank > 1))
ADAM_METHODS = ("ddp_adam",)  # DDP with Adam: what qadam is compared with
EXTRA_METHODS = (*ADAM_METHODS, "ddp_powersgd_r1")  # accepted, not in the default list
RATES = ("100mbit", "1gbit", "10gbit", "unshaped")
TASKS = ("mlp", "digits", "charlm", "bytemlp")  # mlp: the lab's own model (--width, --depth)
FAILURE_GRACE_S = 20  # how long the other ranks may take to report after one rank failed
HOOK_WARMUP = 2  # uncompressed steps of PowerSGD and low_rank before they compress (inside the untimed warm-up)


def all_methods(ranks_per_host: int = 1) -> list[str]:
    """Every method; with several ranks per host, hierarchical-capable algorithms as ``:flat`` and ``:hierarchical``.

    An algorithm that takes ``rank`` (``low_rank``) runs at every rank of ``LOW_RANK_RANKS``, as ``name_r<k>``.
    """
    from lightning_bagua.engine import available_algorithms
    from lightning_bagua.engine.algorithms.base import algorithm_class

    methods = ["single", *DDP_METHODS]
    stems = [(name, name) for name in available_algorithms()]
    stems += [(stem, name) for stem, (name, _) in ALGORITHM_VARIANTS.items() if name in available_algorithms()]
    for stem, name in stems:
        ranked = "rank" in algorithm_class(name).keywords()
        for each in [f"{stem}_r{rank}" for rank in LOW_RANK_RANKS] if ranked else [stem]:
            methods += layout_variants(each, ranks_per_host)
    return methods


def known_methods(ranks_per_host: int = 1) -> list[str]:
    """The methods the lab accepts: the default ones, the extra ones, and the hierarchical variants at any layout."""
    extra = [*extra_low_rank_methods(), *DILOCO_METHODS]
    variants = [f"{method}:{variant}" for method in extra for variant in ("flat", "hierarchical")]
    known = [*all_methods(ranks_per_host), *EXTRA_METHODS, *extra, *all_methods(2), *variants, *TORCHFT_METHODS]
    return list(dict.fromkeys(known))


def layout_name(hosts: int, ranks_per_host: int, from_hosts: bool = False, task: str = "mlp") -> str:
    """The result files' stem: the two-rank lab of the lab's own MLP keeps its original name."""
    stem = "network_lab_cpu" if (hosts, ranks_per_host) == (2, 1) else f"network_lab_cpu_{hosts}x{ranks_per_host}"
    stem = f"{stem}_hosts" if from_hosts else stem
    return stem if task == "mlp" else f"{stem}_{task}"


# ------------------------------------------------------------------------------------------------ one rank


def build_model(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The model to time and its loss: the lab's own MLP, or a convergence task's network (same seed every time)."""
    torch.manual_seed(0)
    if args.task != "mlp":
        return task_model(args.task), task_loss
    layers = [layer for _ in range(args.depth) for layer in (nn.Linear(args.width, args.width), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(args.width, 1)), nn.functional.mse_loss


def wrap(
    method: str, model: nn.Module, warmup: int, run_steps: int | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """Return the wrapped model, its optimizer, the engine's communication counter and the DDP hook's state.

    The counter is ``None`` outside the engine; the hook state is PowerSGD's (``None`` for other methods).
    ``run_steps`` is the run's length auto bounds its measuring by, as the Trainer tells it.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, QAdamOptimizer

    base = method.partition(":")[0]
    if base == "qadam":
        # Measured after its warm-up, in the compressed phase that the algorithm is chosen for.
        optimizer: torch.optim.Optimizer = QAdamOptimizer(model.parameters(), lr=1e-4, warmup_steps=warmup)
    elif base in ADAM_METHODS:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if method == "single":
        return model, optimizer, None, None
    peer_settings = torchft_settings(method)
    if peer_settings is not None:  # torchft's DiLoCo, one replica per rank: its counter counts what it all-reduced
        from lab import torchft_peer

        peer = torchft_peer.torchft_diloco(model, optimizer, **peer_settings)
        return peer, optimizer, peer.communication_counter, None
    name, rank = split_rank(base)
    if name in ("ddp", "ddp_fp16", "ddp_powersgd", "ddp_adam"):
        ddp = DistributedDataParallel(model, bucket_cap_mb=10)
        state = None
        if name == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "ddp_powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank or 1, start_powerSGD_iter=HOOK_WARMUP
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, optimizer, None, state
    name, keywords = engine_algorithm(method, HOOK_WARMUP, run_steps)
    wrapped = BaguaDistributedDataParallel(model, optimizers=[optimizer], algorithm=Algorithm.init(name, **keywords))
    return wrapped, optimizer, wrapped.communication_counter, None


def time_method(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """Train a fresh model with ``method`` for the warm-up and the timed steps; return this rank's figures."""
    from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageImpl
    from lightning_bagua.engine.algorithms.auto import AutoImpl
    from lightning_bagua.engine.algorithms.diloco import DiLoCoImpl

    model, loss_function = build_model(args)
    wrapped, optimizer, counter, hook_state = wrap(method, model, args.warmup, args.run_steps)
    generator = torch.Generator().manual_seed(args.rank)
    if args.task == "mlp":
        inputs = torch.randn(args.batch, args.width, generator=generator)
        targets = torch.randn(args.batch, 1, generator=generator)
    else:
        inputs, targets = random_batch(args.task, args.batch, generator)
    times: list[float] = []
    bytes_before = 0
    impl = getattr(wrapped, "bagua_algorithm_impl", None)  # the engine's algorithm; None outside the engine
    # async averages on a timer, not per step: its bytes are counted per averaging round, from its first one on.
    averaging = impl if isinstance(impl, AsyncModelAverageImpl) else None
    bytes_before_rounds = 0

    def train_step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_function(wrapped(inputs), targets)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    # auto: its measuring steps come first, and their time is its own (reported beside the pick's step).
    auto = impl if isinstance(impl, AutoImpl) else None
    warmup, trial_s, trial_steps = args.warmup, 0.0, 0
    # Every step before the timed ones, auto's trials included: a run pays its first steps (connections, first
    # allocations, a hook's full-precision warm-up) at their own cost, whichever method it runs.
    start_times: list[float] = []
    if auto is not None:
        while auto.decision is None:
            start_times.append(train_step())
            trial_s += start_times[-1]
            trial_steps += 1
            if trial_steps > auto.auto.max_trial_steps + 1:
                raise RuntimeError(f"auto made no pick in {trial_steps} steps")
        pick = auto.decision.algorithm
        # The pick's own full-precision warm-up (low_rank's) is not its step.
        warmup = max(warmup, getattr(pick, "warmup_steps", 0) + 1)
    # diloco communicates once a period: its step is timed over whole periods (the timed steps a multiple of H).
    period = impl.config.sync_every if isinstance(impl, DiLoCoImpl) else 1
    peer_settings = torchft_settings(method)
    if peer_settings is not None:
        period = peer_settings["sync_every"]
    timed_steps = -(-args.steps // period) * period
    for step in range(warmup + timed_steps):
        if step == warmup:
            bytes_before = counter.bytes_sent if counter is not None else 0
        if averaging is not None and step == averaging.warmup_steps:
            bytes_before_rounds = counter.bytes_sent
        elapsed = train_step()
        (times if step >= warmup else start_times).append(elapsed)
    if hook_state is not None and hook_state.iter <= hook_state.start_powerSGD_iter:
        raise RuntimeError(f"{method}: PowerSGD never compressed (iteration {hook_state.iter})")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = split_rank(method.partition(":")[0])[0]
    if counter is not None:
        bytes_per_step: float | None = (counter.bytes_sent - bytes_before) / timed_steps
    elif name in ("ddp", "ddp_adam"):
        bytes_per_step = parameter_bytes
    elif name == "ddp_fp16":
        bytes_per_step = parameter_bytes / 2
    else:
        bytes_per_step = None  # PowerSGD's payload depends on the layer shapes; not counted here
    # The node layout the engine used (from LOCAL_WORLD_SIZE, or found from the hosts without it).
    groups = getattr(wrapped, "communication_groups", None)
    layout = None if groups is None else [groups.layout.num_nodes, groups.layout.ranks_per_node, groups.layout.source]
    close = getattr(wrapped, "close", None)  # the engine's wrapper stops its communication threads
    if close is not None:
        close()
    # Closing stops the loop after a round on every rank and averages once more, exactly: every round is counted.
    averaging_rounds = None if averaging is None else averaging.rounds
    bytes_per_round = None
    if averaging_rounds:
        bytes_per_round = (counter.bytes_sent - bytes_before_rounds) / averaging_rounds
    return {
        "rank": args.rank,
        "method": method,
        # For diloco the mean over whole sync periods, which carries the syncs: a median would leave them out.
        "median_s": statistics.median(times) if period == 1 else statistics.fmean(times),
        "step_statistic": "median" if period == 1 else f"mean over {timed_steps // period} periods of {period}",
        "mean_s": statistics.fmean(times),
        "bytes_per_step": bytes_per_step,
        "parameter_bytes": parameter_bytes,
        "averaging_rounds": averaging_rounds,
        "bytes_per_round": bytes_per_round,
        "engine_layout": layout,
        "powersgd_iter": None if hook_state is None else hook_state.iter,
        # auto: the steps and seconds it measured for, its pick and the figures behind it.
        "start_steps_s": start_times,
        "auto_trial_steps": trial_steps if auto is not None else None,
        "auto_trial_s": trial_s if auto is not None else None,
        "auto_decision": None if auto is None or auto.decision is None else auto.decision.to_dict(),
        # torchft: why it sends full precision, the layout it ran, and its committed syncs.
        **({} if peer_settings is None else {"note": TORCHFT_NOTE, "torchft_syncs": wrapped.syncs}),
        "torchft_settings": peer_settings,
    }


def worker(args: argparse.Namespace) -> None:
    """Time every (round, method) of ``--schedule`` in order, one RESULT line each; a failure ends the worker.

    ``single`` steps each rank's model without communication, all ranks at once, as the methods do: the
    no-communication limit under the same load. A barrier separates the methods, so every rank starts the next
    one together.
    """
    torch.set_num_threads(1)
    os.environ.update(
        {"MASTER_ADDR": args.master, "MASTER_PORT": str(args.port), "RANK": str(args.rank)}
        | {"WORLD_SIZE": str(args.world_size)}
    )
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    for index, method in json.loads(args.schedule):
        try:
            result = time_method(args, method)
        except Exception as error:  # reported, then the worker ends: its peers' collectives fail with it
            failure = {"rank": args.rank, "round": index, "method": method, "error": f"{type(error).__name__}: {error}"}
            print("FAILED " + json.dumps(failure), flush=True)
            os._exit(3)  # no clean-up that could wait on peers stuck in the failed collective
        print("RESULT " + json.dumps({"round": index, **result}), flush=True)
        dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the lab


def worker_command(
    args: argparse.Namespace, schedule: list[tuple[int, str]], rank: int, master: str, port: int
) -> list[str]:
    """Return the command of rank ``rank``'s worker: this script with ``--worker`` and the lab's settings."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--schedule", json.dumps(schedule)]
    command += ["--rank", str(rank), "--master", master, "--port", str(port), "--task", args.task]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.run_steps is not None:
        command += ["--run-steps", str(args.run_steps)]
    command += ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    return [*command, "--timeout", str(args.timeout), "--world-size", str(args.hosts * args.ranks_per_host)]


def _tail(outputs: list[str]) -> str:
    """The last lines of every rank's output that are not RESULT lines: where a crash shows."""
    lines = [line for output in outputs for line in output.splitlines()[-15:] if not line.startswith("RESULT ")]
    return "\n".join(lines)[-3000:]


def launch(args: argparse.Namespace, hosts: list[tuple[str, str, str]], schedule: list[tuple[int, str]]) -> list[str]:
    """Run one worker per rank in its host's namespace through ``schedule``; return each rank's output."""
    port = random.randrange(20000, 60000)
    with ExitStack() as stack:
        processes, logs = [], []
        for rank in range(len(hosts) * args.ranks_per_host):
            # Consecutive ranks share a host, as a launcher numbers them: hierarchical algorithms see the hosts.
            namespace, interface, _ = hosts[rank // args.ranks_per_host]
            local = {"LOCAL_WORLD_SIZE": str(args.ranks_per_host), "LOCAL_RANK": str(rank % args.ranks_per_host)}
            if args.no_local_world_size:
                local = {}  # a plain env:// launcher: the engine finds the hosts itself
            command = ["ip", "netns", "exec", namespace, *worker_command(args, schedule, rank, hosts[0][2], port)]
            # Output to a file, not a pipe: nothing blocks on a full pipe while another rank is waited for.
            logs.append(stack.enter_context(tempfile.TemporaryFile(mode="w+")))
            processes.append(
                subprocess.Popen(
                    command,
                    env=job_env([ROOT / "src"], GLOO_SOCKET_IFNAME=interface, **local),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            # Every collective has the --timeout; the whole schedule may take that long per entry at most. Once a rank
            # has failed, the others get a grace period to report, then are ended: a peer of a failed collective may
            # wait in a call without a timeout (torch's PowerSGD hook on Gloo does).
            deadline = time.monotonic() + args.timeout * (len(schedule) + 1)
            failed_at = None
            while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
                if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                    break
                time.sleep(0.2)
        finally:
            for process in processes:
                process.kill()
                process.wait()
        outputs = []
        for log_file in logs:
            log_file.seek(0)
            outputs.append(log_file.read())
        return outputs


def measure(
    args: argparse.Namespace, rate: str, methods: list[str], hosts: list[tuple[str, str, str]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time ``methods`` interleaved over ``args.rounds`` rounds at ``rate``; return the rows and the failures.

    The workers run the whole schedule in one launch. A method that fails ends that launch: it is recorded as a
    failure with its error and dropped, and the rest of the schedule runs in a fresh launch.
    """
    schedule = interleaved(methods, args.rounds)
    done: dict[tuple[int, str], list[dict[str, Any]]] = {}
    failures: list[dict[str, Any]] = []
    while schedule:
        outputs = launch(args, hosts, schedule)
        ranks = len(outputs)
        by_entry: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for output in outputs:
            for result in result_lines(output, "RESULT"):
                by_entry.setdefault((result["round"], result["method"]), []).append(result)
        for results in by_entry.values():
            results.sort(key=lambda r: r["rank"])
        finished = {entry for entry, results in by_entry.items() if len(results) == ranks}
        done.update({entry: by_entry[entry] for entry in finished})
        remaining = [entry for entry in schedule if entry not in finished]
        if remaining:
            # The ranks run the schedule in order: the first entry some rank did not finish is the one that failed.
            # A rank that raised says so; one that aborted inside Gloo (PowerSGD's size mismatch) prints no line.
            reported = [f for output in outputs for f in result_lines(output, "FAILED")]
            method = reported[0]["method"] if reported else remaining[0][1]
            error = reported[0]["error"] if reported else "a worker ended without a result:\n" + _tail(outputs)
            print(f"{rate:>9} {method:>28}: FAILED {headline(error)}", flush=True)
            failures.append({"rate": rate, "method": method, "round": remaining[0][0], "error": error[-3000:]})
            remaining = [entry for entry in remaining if entry[1] != method]
        schedule = remaining
    rows = []
    failed_methods = {failure["method"] for failure in failures}
    for method in methods:
        rounds = [done[(index, method)] for index in range(args.rounds) if (index, method) in done]
        if not rounds or method in failed_methods:  # a method that failed in any round is shown as failed
            continue
        # The slower rank sets the pace of synchronous training: each round counts its slowest rank's median.
        per_round = [max(r["median_s"] for r in results) for results in rounds]
        quartiles = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
        first = rounds[0][0]
        by_rank = list(zip(*rounds, strict=True))  # per rank: its result of every round
        rows.append(
            {
                "rate": rate,
                "method": method,
                "median_step_s": statistics.median(per_round),
                "min_step_s": min(per_round),
                "max_step_s": max(per_round),
                "q1_step_s": quartiles[0],
                "q3_step_s": quartiles[2],
                "rounds_step_s": per_round,
                "per_rank_median_s": [statistics.median(r["median_s"] for r in ranked) for ranked in by_rank],
                "bytes_per_step": first["bytes_per_step"],
                "parameter_bytes": first["parameter_bytes"],
                # Per round, each untimed first step at its slowest rank's time: what a run pays before its pace.
                "start_steps_s": [
                    [max(times) for times in zip(*(r["start_steps_s"] for r in results), strict=True)]
                    for results in rounds
                ],
                # async: the averaging rounds of the first round's rank 0, and the bytes it sent per round.
                "averaging_rounds": first.get("averaging_rounds"),
                "bytes_per_round": first.get("bytes_per_round"),
                # [nodes, ranks per node, where that came from] as the engine saw it; None outside the engine.
                "engine_layout": first.get("engine_layout"),
                # torchft: why it sends full precision (and, with several ranks per host, runs flat), what it ran.
                **(
                    {
                        "note": first["note"] if args.ranks_per_host == 1 else f"{first['note']}; {TORCHFT_FLAT_NOTE}",
                        "torchft_settings": first["torchft_settings"],
                        "torchft_syncs": [results[0]["torchft_syncs"] for results in rounds],
                    }
                    if first.get("torchft_settings")
                    else {}
                ),
                # auto, per round: the pick (rank 0's, every rank's alike) and its measuring time (slowest rank).
                **(
                    {
                        "auto_picks": [results[0]["auto_decision"]["label"] for results in rounds],
                        "auto_trial_steps": [results[0]["auto_trial_steps"] for results in rounds],
                        "auto_trial_s": [max(r["auto_trial_s"] for r in results) for results in rounds],
                        "auto_decisions": [results[0]["auto_decision"] for results in rounds],
                    }
                    if first.get("auto_decision")
                    else {}
                ),
            }
        )
        print(f"{rate:>9} {method:>28}: {rows[-1]['median_step_s'] * 1e3:9.1f} ms"
              f" [{rows[-1]['min_step_s'] * 1e3:.1f}, {rows[-1]['max_step_s'] * 1e3:.1f}]", flush=True)  # fmt: skip
    return rows, failures


def describe(hosts: int, ranks_per_host: int, from_hosts: bool = False) -> str:
    """Say in words how many ranks the layout has and over which links they talk."""
    without = ", no LOCAL_WORLD_SIZE (the engine reads the layout from the hosts)" if from_hosts else ""
    if (hosts, ranks_per_host) == (2, 1):
        return f"two Gloo ranks over a shaped veth link{without}"
    link = "a shaped veth link" if hosts == 2 else "shaped links to a bridge"
    return f"{hosts * ranks_per_host} Gloo ranks, {hosts} hosts x {ranks_per_host}, over {link}{without}"


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table of a report: a row per method, its step at every rate (ms [min, max], ratio to DDP's), its payload.

    The documentation's ``network_lab`` table is this one.
    """
    rates, results = report["settings"]["rates"], report["results"]
    by_key = {(r["rate"], r["method"]): r for r in results}
    failed = {(f["rate"], f["method"]) for f in report.get("failures", [])}
    rows = []
    for method in report["settings"]["methods"]:
        cells = [method]
        for rate in rates:
            row, ddp = by_key.get((rate, method)), by_key.get((rate, "ddp"))
            if row is None:
                cells.append("failed" if (rate, method) in failed else "")
                continue
            ratio = f" ({row['median_step_s'] / ddp['median_step_s']:.2f}x)" if ddp else ""
            spread = f"[{row['min_step_s'] * 1e3:.1f}, {row['max_step_s'] * 1e3:.1f}]"
            cells.append(f"{row['median_step_s'] * 1e3:.1f} {spread}{ratio}")
        row = next((by_key[(rate, method)] for rate in rates if (rate, method) in by_key), None)
        if row is not None and row.get("bytes_per_round") is not None:  # async: per averaging round, not per step
            cells.append(f"{row['bytes_per_round'] / 1e6:.2f} per round")
        else:
            cells.append("" if row is None or row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}")
        rows.append(cells)
    return ["method", *rates, "payload MB/step"], rows


def markdown(report: dict[str, Any]) -> str:
    """Return the report's table with the sentences that say what it shows and what wrote it."""
    settings = report["settings"]
    hosts, ranks_per_host = settings["hosts"], settings["ranks_per_host"]
    from_hosts = settings.get("no_local_world_size", False)
    lines = [
        f"Median step time in ms over {settings['rounds']} interleaved rounds [min, max] (ratio of the medians to"
        f" DDP's at the same rate), {describe(hosts, ranks_per_host, from_hosts)}; task {settings['task']}.",
        f"Written by `{report['command']}`;"
        f" the numbers are in `{layout_name(hosts, ranks_per_host, from_hosts, settings['task'])}.json`.",
        "",
        markdown_table(*table(report)),
    ]
    lines += [f"{f['method']} at {f['rate']} failed: {headline(f['error'])}\n" for f in report.get("failures", [])]
    return "\n".join(lines + auto_measuring_lines(report))


def auto_measuring_lines(report: dict[str, Any]) -> list[str]:
    """auto's measuring per rate: its picks, its steps, and what they cost beyond its pick's pace.

    Per round, the cost is the measuring steps' time less as many steps at that round's median step (the pick's,
    once decided), and the share is that over ``--run-steps`` steps at the same median: the run auto was told.
    """
    rows = [row for row in report["results"] if row.get("auto_picks")]
    if not rows:
        return []
    run_steps = report["settings"].get("run_steps")
    table = []
    for row in rows:
        extra = [
            seconds - steps * step
            for seconds, steps, step in zip(
                row["auto_trial_s"], row["auto_trial_steps"], row["rounds_step_s"], strict=True
            )
        ]
        picks = {label: row["auto_picks"].count(label) for label in dict.fromkeys(row["auto_picks"])}
        share = "-"
        if run_steps:
            shares = [cost / (run_steps * step) for cost, step in zip(extra, row["rounds_step_s"], strict=True)]
            share = f"{statistics.median(shares):.1%} [{min(shares):.1%}, {max(shares):.1%}]"
        table.append([
            row["rate"], ", ".join(f"{label} x{count}" for label, count in picks.items()),
            f"{statistics.median(row['auto_trial_steps']):g}", f"{statistics.median(row['auto_trial_s']):.3g}",
            f"{statistics.median(extra):.3g} [{min(extra):.3g}, {max(extra):.3g}]", share,
        ])  # fmt: skip
    told = f"the {run_steps} steps it was told (--run-steps)" if run_steps else "a run of unknown length"
    return [
        "",
        f"auto's measuring, per rate over the {report['settings']['rounds']} rounds: its picks, its measuring steps"
        " and their seconds (medians; the slowest rank's), what they took beyond as many steps at its pick's median"
        f" step in the same round (median [min, max], in s), and that as a share of {told} at that step.",
        "",
        markdown_table(["rate", "picks", "steps", "seconds", "beyond the pick's pace", "share of the run"], table),
    ]


def chart(results: list[dict[str, Any]], rates: list[str], methods: list[str], path: Path, title: str) -> bool:
    """Draw every method's median step at every rate to ``path``; return whether matplotlib was there to draw it."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(methods))
    by_key = {(r["rate"], r["method"]): r for r in results}
    # tab20 keeps up to 20 methods apart (the default cycle repeats after 10, as with the :flat/:hierarchical pairs).
    colours = plt.get_cmap("tab20").colors
    for i, method in enumerate(methods):
        values = [by_key[(rate, method)]["median_step_s"] * 1e3 if (rate, method) in by_key else 0.0 for rate in rates]
        colour = colours[i % len(colours)]
        axis.bar([x + i * width for x in range(len(rates))], values, width, label=method, color=colour)
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(rates))], rates)
    axis.set_yscale("log")
    axis.set_ylabel("median step time (ms, log scale)")
    axis.set_title(f"{title[0].upper()}{title[1:]} (benchmarks/network_lab.py)")
    # Below the plot, where it hides no bar.
    axis.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def lab_report(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Measure every method at every rate of ``args`` and return the report (settings, machine, results)."""
    require_lab_tools("network_lab.py")
    if args.hosts < 2 or args.ranks_per_host < 1:
        raise SystemExit("The lab needs at least two hosts and one rank per host.")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}.")
    known = known_methods(args.ranks_per_host)
    methods = args.methods or all_methods(args.ranks_per_host)
    # diloco at any period by name: diloco_h<H>, with :flat or :hierarchical; torchft_diloco_h<H> likewise.
    by_name = {m for m in methods if diloco_period(m.partition(":")[0]) is not None or torchft_settings(m) is not None}
    unknown = sorted(set(methods) - set(known) - by_name)
    if unknown:
        raise SystemExit(f"Unknown methods {unknown}; choose from {known}.")
    for rate in args.rates:
        if rate != "unshaped":
            bits_per_second(rate)
    results, failures = [], []
    started = time.perf_counter()
    for rate in args.rates:
        with lab_hosts(rate, args.hosts, args.burst_us) as hosts:
            rows, failed = measure(args, rate, methods, hosts)
        results += rows
        failures += failed
    return {
        "benchmark": (
            f"{describe(args.hosts, args.ranks_per_host, args.no_local_world_size)}, one network namespace per host,"
            " tc-shaped; methods interleaved (round-robin, rotated each round)"
        ),
        **stamp(command),
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in {"worker", "rank", "master", "port", "schedule", "world_size", "argv", "out"}
        }
        | {"methods": methods, "hook_warmup_steps": HOOK_WARMUP},
        "total_wall_s": time.perf_counter() - started,
        "results": results,
        "failures": failures,
    }


def orchestrate(args: argparse.Namespace) -> None:
    """Run the link check or the lab, write its results (unless ``--no-save``) and print its table."""
    command = "python benchmarks/network_lab.py " + " ".join(args.argv)
    if args.check_links is not None:
        report = check_links(args.rates, args.check_links or [args.burst_us], command)
        stem, table = "network_lab_links", links_table(report)
    else:
        report = lab_report(args, command)
        stem = layout_name(args.hosts, args.ranks_per_host, args.no_local_world_size, args.task)
        table = markdown(report)
    if not args.no_save:
        write_report(Path(args.out), stem, report, table)
        if args.check_links is None:
            title = describe(args.hosts, args.ranks_per_host, args.no_local_world_size)
            chart(report["results"], args.rates, report["settings"]["methods"], Path(args.out) / f"{stem}.png", title)
    print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the lab's options (``argv``, else this process's), keeping them as given in ``argv`` for the command."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates (100mbit, 1gbit, ...) or unshaped")
    parser.add_argument("--methods", nargs="+", default=None, help="default: all")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (more than 2)")
    parser.add_argument("--run-steps", type=int, default=None, help="the run length auto is told (its run_steps)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the methods (default: 5)")
    parser.add_argument("--task", default="mlp", choices=TASKS, help="the model: the lab's MLP or a convergence task's")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (1024 and depth 2: 2.1M parameters)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=600, help="seconds a collective may take")
    parser.add_argument("--hosts", type=int, default=2, help="network namespaces (more than 2: joined by a bridge)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks per host: LOCAL_WORLD_SIZE, unshaped")
    parser.add_argument("--no-local-world-size", action="store_true", help="the engine finds the hosts itself")
    parser.add_argument("--burst-us", type=float, default=BURST_US, help="each link's token bucket, in us of its time")
    parser.add_argument(
        "--check-links",
        nargs="*",
        type=float,
        default=None,
        metavar="BURST_US",
        help="time single messages over each rate's link, with each bucket given (default: --burst-us), and write"
        " network_lab_links.*; no training",
    )
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    if args.warmup <= HOOK_WARMUP:
        parser.error(f"--warmup must exceed {HOOK_WARMUP} (PowerSGD and low_rank compress after it), got {args.warmup}")
    for burst_us in [args.burst_us, *(args.check_links or [])]:
        if not burst_us > 0:
            parser.error(
                f"a link's bucket must be a positive number of microseconds (e.g. {BURST_US:g}), got {burst_us:g}"
            )
    args.argv = arguments
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        orchestrate(arguments)
