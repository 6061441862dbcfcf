"""Kill ranks of distributed jobs and check what follows: the robustness lab, one subcommand per question.

``chaos``: kill a random worker at a random moment (``mid_step``, ``collective``, ``checkpoint_save``, ``restart``)
of an elastic job, ``robustness.py chaos-job`` (:func:`chaos_job`, a small Trainer fit with a checkpoint every 5 steps
and ``ckpt_path="last"``) under ``torchrun --max-restarts``, found by its marker files (:class:`Markers`). Then every
``.ckpt`` left must load, and every rank's final weights must match the cached undisturbed job's: bit for bit
(synchronous algorithms, ``diloco``), within 1e-5 (decentralized ones), or, for ``async``, a final loss within the
spread of several seeds. Results: ``benchmarks/results/chaos_<device>.json`` and ``.md`` (``--name``); ``--merge``
pools the reports of runs made side by side.

``dead-rank``: time the exit of ``tests/strategies/scripts/fit_script.py`` (2 Gloo processes) under each launcher
after its rank 1 SIGKILLs itself mid-epoch, until no process of the job is left. Results:
``benchmarks/results/dead_rank_exit.json``. The fault-tolerance page documents both; for instance
``.venv/bin/python benchmarks/robustness.py chaos --kills 4 --algorithms gradient_allreduce async --layouts 2``.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab.harness import free_port
from lab.jobs import REPO, Job, job_env, kill_all, live_processes, torchrun
from lab.render import markdown_table
from lab.results import RESULTS, new_report, write_report

SCRIPT = Path(__file__).resolve()
ALGORITHMS = ("ddp", "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "low_rank",
              "qadam", "async", "diloco")  # fmt: skip
# Compared bit for bit: the synchronous ones, and diloco, whose replicas differ but whose schedule is deterministic.
BIT_EXACT = frozenset({"ddp", "gradient_allreduce", "bytegrad", "low_rank", "qadam", "diloco"})
NEAR_TOLERANCE = 1e-5
KINDS = ("mid_step", "collective", "checkpoint_save", "restart")
LAYOUTS = ("2", "4", "2x2")
# The job: 96 samples of 8 features in batches of 4 per rank, 3 epochs, a checkpoint every 5 steps.
SAMPLES, FEATURES, BATCH, EPOCHS, CHECKPOINT_EVERY = 96, 8, 4, 3, 5
# The job's `ModelCheckpoint(save_last=...)`: "true" saves last.ckpt, "link" links it to the newest checkpoint.
SAVE_LAST_CHOICES = ("true", "link")
MAX_RESTARTS = 3
STEP_SLEEP_S = 0.01
SAVE_DELAY_S = 0.3
STRAGGLE_S = 2.0
# async's final loss in this short job follows its averaging rounds' timing: undisturbed jobs of one seed end as far
# apart as jobs of different seeds, so the reference spread needs more than a few of them.
ASYNC_SEEDS = 6
_RENDEZVOUS_FAILED = "The connection to the C10d store has failed"

# dead-rank: the job, its launchers, and when which rank dies.
FIT_SCRIPT = REPO / "tests" / "strategies" / "scripts" / "fit_script.py"
LAUNCHERS = ("lightning", "lightning_bagua.launch", "torchrun")
KILLED_RANK = 1
# Epochs of 3 steps and 4 epochs; rank 1 dies at step 8, in the middle of the third epoch.
TRAINING_ARGS = ("--max-steps", "-1", "--max-epochs", "4", "--limit-train-batches", "3")
KILL_AT_STEP = 8
# A job still alive this long after the death counts as hung (the bound).
EXIT_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Layout:
    """How many torchrun agents (nodes) and how many workers each."""

    name: str
    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        """Return the number of workers in all."""
        return self.nodes * self.per_node

    @classmethod
    def parse(cls, name: str) -> "Layout":
        """Return ``"4"`` as one node of 4 workers and ``"2x2"`` as 2 nodes of 2."""
        nodes, _, per_node = name.rpartition("x")
        return cls(name, int(nodes or 1), int(per_node))


@dataclass
class Kill:
    """One SIGKILL: the moment aimed at, the victim, and whether the kill landed where it was aimed."""

    kind: str
    rank: int
    pid: int
    landed: bool
    detail: str


@dataclass
class Run:
    """One disturbed job and what the checks found."""

    algorithm: str
    layout: str
    kind: str
    index: int
    kills: list[Kill] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)
    hang: bool = False
    seconds: float = 0.0
    restarts: int = 0
    exact: bool = False
    comparison: str = ""
    checkpoints: int = 0
    torn: list[str] = field(default_factory=list)
    leftover_partials: int = 0
    last_markers: dict[int, str] = field(default_factory=dict)
    log_tail: str = ""


def steps_per_job(layout: Layout) -> int:
    """Return how many optimizer steps each rank takes in the whole job."""
    return SAMPLES // BATCH // layout.world_size * EPOCHS


def algorithm_keywords(algorithm: str, nodes: int) -> dict[str, Any]:
    """Return ``BaguaStrategy``'s algorithm keywords for the job on ``nodes`` nodes."""
    keywords: dict[str, Any] = {}
    if algorithm == "async":
        keywords["sync_interval_ms"] = 5
    if algorithm == "low_rank":
        keywords["warmup_steps"] = 1
    if algorithm == "diloco":
        # Periods shorter than the checkpoint interval, with an exchange in flight across step boundaries.
        keywords.update(sync_every=4, fragments=2, fragment_sync_delay=1, error_feedback=True)
    # On one node, hierarchical would reduce the node at full precision: flat, the compressed exchanges run.
    if algorithm in ("low_rank", "low_precision_decentralized", "diloco") and nodes == 1:
        keywords["hierarchical"] = False
    return keywords


def agent_commands(
    layout: Layout, algorithm: str, out: Path, device: str, seed: int, save_last: str, extra: list[str]
) -> list[list[str]]:
    """Return one torchrun command per node of ``layout``, all meeting at one rendezvous on 127.0.0.1."""
    endpoint = f"127.0.0.1:{free_port()}"
    job_id = f"chaos-{uuid.uuid4().hex[:8]}"
    script = [str(SCRIPT), "chaos-job", "--out", str(out), "--algorithm", algorithm, "--device", device,
              "--seed", str(seed), "--save-last", save_last, *extra]  # fmt: skip
    agent = torchrun("--nnodes", str(layout.nodes), "--nproc-per-node", str(layout.per_node), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", endpoint, "--rdzv-id", job_id, "--local-addr", "127.0.0.1",
                     "--max-restarts", str(MAX_RESTARTS), "--monitor-interval", "0.1")  # fmt: skip
    return [[*agent, *script] for _ in range(layout.nodes)]


def launch(commands: list[list[str]], out: Path) -> Job:
    """Start a job's torchrun agents, logging to ``out/log.txt``, with the repository's own sources ahead."""
    return Job(commands, out / "log.txt", job_env([REPO / "src", REPO]))


def worker_pids(job: Job) -> dict[int, int]:
    """Return ``{rank: pid}`` for the live worker processes whose parent is one of the ``job``'s torchrun agents."""
    agents = {process.pid for process in job.processes}
    return {int(env["RANK"]): pid for pid, parent, env in live_processes() if parent in agents and "RANK" in env}


class Markers:
    """The job's marker files, ``<restart> <phase> <step> <time>`` lines, one file per rank: a rank of the job
    writes its own (``rank``), the harness reads them all."""

    def __init__(self, directory: Path, rank: int | None = None) -> None:
        self.directory, self.rank = directory, rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def write(self, phase: str, step: int) -> None:
        """Append this rank's progress, flushed at once so that the harness sees it as it happens."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / f"rank{self.rank}.log").open("a") as file:
            file.write(f"{self.restart} {phase} {step} {time.time():.4f}\n")

    def lines(self) -> list[tuple[int, int, str, int]]:
        """Return every marker line so far as ``(rank, restart, phase, step)``."""
        found = []
        for path in sorted(self.directory.glob("rank*.log")):
            rank = int(path.stem[4:])
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4:  # a line still being written is skipped until it is whole
                    found.append((rank, int(parts[0]), parts[1], int(parts[2])))
        return found

    def reached(self, phase: str, step: int = -1, restart: int | None = None) -> bool:
        """Return whether some rank wrote ``phase`` at ``step`` or later (in launch ``restart``, if given)."""
        return any(p == phase and s >= step and (restart is None or r == restart) for _, r, p, s in self.lines())

    def last(self, rank: int) -> str:
        """Return ``rank``'s latest marker as text, for the record of a kill."""
        own = [f"restart {r} {p} {s}" for k, r, p, s in self.lines() if k == rank]
        return own[-1] if own else "nothing yet"


def kill_rank(job: Job, kind: str, rank: int | None, rng: random.Random, markers: Markers, detail: str) -> Kill | None:
    """SIGKILL one live worker (``rank``, or one at random) and return the record of it."""
    workers = worker_pids(job)
    if rank is None or rank not in workers:
        if not workers:
            return None
        rank = rng.choice(sorted(workers))
    pid = workers[rank]
    state = markers.last(rank)
    kill_all([pid])
    return Kill(kind, rank, pid, True, f"{detail}; rank {rank} was at: {state}")


def partial_files(directory: Path) -> list[Path]:
    """Return the temporary files of checkpoint saves in progress (or killed) in ``directory``."""
    return list(directory.glob(".*.partial")) if directory.exists() else []


def aim_and_kill(
    job: Job, kind: str, layout: Layout, out: Path, rng: random.Random, deadline: float, straggler: int
) -> list[Kill]:
    """Wait for the moment of ``kind`` and kill a worker there (for ``collective``, one that waits for the
    ``straggler``); return the kills (none if the moment never came)."""
    markers = Markers(out / "markers")
    steps = steps_per_job(layout)
    kills: list[Kill] = []
    if kind == "collective":
        if job.wait_for(lambda: markers.reached("straggle"), deadline):
            # The straggler sleeps STRAGGLE_S; the others reach the collective it holds up within a step or two.
            time.sleep(min(0.5, STRAGGLE_S / 4))
            others = [r for r in range(layout.world_size) if r != straggler]
            kill = kill_rank(job, kind, rng.choice(others), rng, markers, f"rank {straggler} straggling")
            kills += [kill] if kill else []
        return kills
    target = rng.randrange(1, steps - 2)
    if kind == "checkpoint_save":
        ckpt = out / "ckpt"
        # The first save at or after the target step; the job holds it open for SAVE_DELAY_S, marking its start
        # (Lightning's own checkpoint IO, under ddp, writes no .partial file to watch for).
        if job.wait_for(lambda: markers.reached("save", target), deadline):
            names = ", ".join(p.name for p in partial_files(ckpt)) or "no .partial file"
            kill = kill_rank(job, kind, None, rng, markers, f"in the save of step {target} or later ({names})")
            kills += [kill] if kill else []
        return kills
    # mid_step, and the first kill of restart.
    if not job.wait_for(lambda: markers.reached("step", target, restart=0), deadline):
        return kills
    time.sleep(rng.uniform(0, STEP_SLEEP_S))
    first = kill_rank(
        job, "mid_step" if kind == "mid_step" else "restart_trigger", None, rng, markers, f"in step {target}"
    )
    if first is None:
        return kills
    kills.append(first)
    if kind != "restart":
        return kills
    # torchrun stops the other workers and starts new ones: wait for a new set, then kill one as it starts up.
    old = set(worker_pids(job).values()) | {first.pid}

    def restarted() -> bool:
        current = worker_pids(job)
        return len(current) == layout.per_node * layout.nodes and not (set(current.values()) & old)

    if job.wait_for(restarted, deadline):
        time.sleep(rng.uniform(0, 2.0))
        landed = not markers.reached("fit_start", restart=1) and not markers.reached("step", restart=1)
        kill = kill_rank(job, kind, None, rng, markers, "as the restarted workers start up")
        if kill:
            kill.landed = landed
            if not landed:
                kill.detail += " (late: a restarted worker had begun fitting)"
            kills.append(kill)
    return kills


def load_checkpoints(directory: Path) -> tuple[int, list[str]]:
    """Load every ``.ckpt`` in ``directory`` as Lightning does; return how many and the names of those that fail."""
    torn = []
    paths = sorted(directory.glob("*.ckpt")) if directory.exists() else []
    for path in paths:
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            if path.is_symlink():  # `save_last="link"`'s last.ckpt naming a checkpoint that is gone: no checkpoint
                torn.append(f"{path.name}: a link to {os.readlink(path)}, which is gone")
            continue  # otherwise removed by ModelCheckpoint between the listing and the load: not torn
        except Exception as error:  # whatever stops a load makes it useless
            torn.append(f"{path.name}: {type(error).__name__}: {str(error)[:200]}")
    return len(paths), torn


def read_finals(out: Path, world_size: int) -> list[dict[str, Any]] | None:
    """Return every rank's final record, or None when some rank did not finish."""
    paths = [out / "final" / f"rank{rank}.pt" for rank in range(world_size)]
    if not all(path.exists() for path in paths):
        return None
    return [torch.load(path, weights_only=True) for path in paths]


def cache_key(algorithm: str, layout: Layout, device: str, seed: int, save_last: str) -> str:
    """Return a key that changes with the configuration, the job's script and the library's sources."""
    digest = hashlib.sha256(SCRIPT.read_bytes())
    for path in sorted((REPO / "src").rglob("*.py")):
        digest.update(path.read_bytes())
    digest.update(f"{algorithm}/{layout.name}/{device}/{seed}/{MAX_RESTARTS}/{save_last}".encode())
    return f"{algorithm}-{layout.name}-{device}-{seed}-{digest.hexdigest()[:16]}"


def undisturbed(
    algorithm: str, layout: Layout, device: str, seed: int, save_last: str, cache: Path, timeout_s: float
) -> list[dict[str, Any]]:
    """Return the final records of the undisturbed job, running it once and caching it."""
    path = cache / f"{cache_key(algorithm, layout, device, seed, save_last)}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    print(f"{algorithm} {layout.name}: undisturbed job, seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="chaos-reference-") as directory:
        out = Path(directory)
        job = launch(agent_commands(layout, algorithm, out, device, seed, save_last, []), out)
        hang = job.finish(time.monotonic() + timeout_s)
        finals = read_finals(out, layout.world_size)
        if hang or finals is None or any(job.returncodes):
            failed = f"the undisturbed {algorithm} job on {layout.name} failed ({job.returncodes})"
            raise RuntimeError(f"{failed}:\n{job.output()[-4000:]}")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(finals, path)
    return finals


def compare(algorithm: str, finals: list[dict[str, Any]], references: list[list[dict[str, Any]]]) -> tuple[bool, str]:
    """Compare a disturbed job's final records with the undisturbed job's (several seeds for ``async``)."""
    reference = references[0]
    if algorithm == "async":
        losses = [f["loss"] for ref in references for f in ref]
        low, high = min(losses), max(losses)
        spread, loss, own = high - low, finals[0]["loss"], reference[0]["loss"]
        seeds = f"undisturbed {own:.6f} at the same seed, [{low:.6f}, {high:.6f}] over {len(references)}"
        return low - spread <= loss <= high + spread, f"loss {loss:.6f}, {seeds}"
    steps = [f["global_step"] for f in finals]
    if steps != [f["global_step"] for f in reference]:
        return False, f"steps {steps} against {[f['global_step'] for f in reference]}"
    worst = 0.0
    for final, expected in zip(finals, reference, strict=True):
        for key, value in expected["state"].items():
            if algorithm in BIT_EXACT and not torch.equal(final["state"][key], value):
                difference = (final["state"][key] - value).abs().max().item()
                parted = first_parting(final.get("trace", []), expected.get("trace", []))
                return False, f"{key} differs by {difference:.3e} (must be bit-identical){parted}"
            worst = max(worst, (final["state"][key].double() - value.double()).abs().max().item())
    if algorithm not in BIT_EXACT and worst > NEAR_TOLERANCE:
        return False, f"max difference {worst:.3e} > {NEAR_TOLERANCE}"
    return True, "bit-identical" if worst == 0 else f"max difference {worst:.3e}"


def disturbed_run(
    algorithm: str, layout: Layout, kind: str, index: int, device: str, seed: int, save_last: str,
    rng: random.Random, references: list[list[dict[str, Any]]], timeout_s: float, work: Path,
) -> Run:  # fmt: skip
    """Launch the job, kill a worker at a moment of ``kind``, and check what it ends with."""
    run = Run(algorithm, layout.name, kind, index)
    out = work / f"{algorithm}-{layout.name}-{index}-{kind}"
    out.mkdir(parents=True)
    # Only the job whose saves are aimed at holds them open: the others need not be slower.
    extra = ["--slow-saves"] if kind == "checkpoint_save" else []
    straggler = -1
    if kind == "collective":
        straggler = rng.randrange(layout.world_size)
        step = rng.randrange(1, steps_per_job(layout) - 2)
        extra += ["--straggle-rank", str(straggler), "--straggle-step", str(step)]
    job = launch(agent_commands(layout, algorithm, out, device, seed, save_last, extra), out)
    deadline = job.started + timeout_s
    run.kills = aim_and_kill(job, kind, layout, out, rng, deadline, straggler)
    # Checkpoints as the kill left them, before a restart writes new ones over them.
    count, torn = load_checkpoints(out / "ckpt")
    run.hang = job.finish(deadline)
    run.returncodes = job.returncodes
    run.seconds = round(time.monotonic() - job.started, 1)
    later_count, later_torn = load_checkpoints(out / "ckpt")
    run.checkpoints = max(count, later_count)
    run.torn = sorted(set(torn) | set(later_torn))
    run.leftover_partials = len(partial_files(out / "ckpt"))
    restarts = [r for _, r, _, _ in Markers(out / "markers").lines()]
    run.restarts = max(restarts, default=0)
    finals = read_finals(out, layout.world_size)
    if run.hang:
        run.comparison = f"hang: still running after {timeout_s:.0f} s"
    elif finals is None or any(run.returncodes):
        run.comparison = f"failed: exit codes {run.returncodes}"
    else:
        run.exact, run.comparison = compare(algorithm, finals, references)
    if run.hang or not run.exact or run.torn:
        # Where each rank got to, with its launch's restart count: agents that disagree on it show here.
        markers = Markers(out / "markers")
        run.last_markers = {rank: markers.last(rank) for rank in range(layout.world_size)}
        run.log_tail = job.output()[-3000:]
    return run


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    """Return one row of counts per algorithm and layout."""
    rows = []
    for key in dict.fromkeys((r.algorithm, r.layout) for r in runs):
        group = [r for r in runs if (r.algorithm, r.layout) == key]
        kills = [k for r in group for k in r.kills]
        rows.append({
            "algorithm": key[0], "layout": key[1], "runs": len(group), "kills": len(kills),
            "kills_by_kind": dict(Counter(k.kind for k in kills)),
            "kills_missed_aim": sum(not k.landed for k in kills) + sum(not r.kills for r in group),
            "restarts": sum(r.restarts for r in group), "exact": sum(r.exact for r in group),
            "not_exact": sum(not r.exact and not r.hang for r in group),
            "torn_checkpoints": sum(len(r.torn) for r in group),
            "leftover_partials": sum(r.leftover_partials for r in group), "hangs": sum(r.hang for r in group),
        })  # fmt: skip
    return rows


def summary_table(rows: list[dict[str, Any]], strong: str = "**") -> tuple[list[str], list[list[str]]]:
    """Header and rows of the counts per algorithm and layout, and a total row (its cells in ``strong``) where there
    are several."""
    header = ["algorithm", "layout", "runs", "kills", *KINDS, "missed aim", "restarts", "exact", "not exact",
              "torn ckpts", "leftover .partial", "hangs"]  # fmt: skip
    cells: list[list[str]] = []
    totals: list[int] = []
    for row in rows:
        counts = [row["runs"], row["kills"], *(row["kills_by_kind"].get(kind, 0) for kind in KINDS)]
        counts += [row[key] for key in ("kills_missed_aim", "restarts", "exact", "not_exact", "torn_checkpoints")]
        counts += [row.get("leftover_partials", 0), row["hangs"]]
        cells.append([row["algorithm"], row["layout"], *map(str, counts)])
        totals = [a + b for a, b in zip(totals, counts, strict=True)] if totals else counts
    if len(rows) > 1:
        cells.append([f"{strong}all{strong}", "", *(f"{strong}{count}{strong}" for count in totals)])
    return header, cells


def markdown(report: dict[str, Any]) -> str:
    """Return the report as a Markdown page: the command, the settings, then the counts per algorithm and layout."""
    machine = report["machine"]
    lines = [
        f"# Chaos: {report['name']} ({report['device']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Date: {report['date']}. Machine: {machine['platform']}, {machine['cpu_count']} CPUs, "
        f"torch {machine['torch']}.",
        "",
        markdown_table(*summary_table(report["rows"])),
        "`restart` kills follow a `mid_step` kill in the same run (counted as `restart_trigger`).",
        "",
    ]
    problems = [r for r in report["runs"] if not r["exact"] or r["hang"] or r["torn"]]
    if problems:
        lines += ["## Runs that did not end exact", ""]
        for run in problems:
            lines.append(
                f"- {run['algorithm']} {run['layout']} run {run['index']} ({run['kind']}): {run['comparison']}"
                f"; torn: {run['torn'] or 'none'}; last markers: {run['last_markers'] or 'not kept'}"
            )
    return "\n".join(lines) + "\n"


def first_parting(trace: list[dict[str, Any]], expected: list[dict[str, Any]]) -> str:
    """Say at which step of the resumed attempt the job first parted from the undisturbed one, and in what."""
    reference = {entry["step"]: entry for entry in expected}
    for entry in trace:
        other = reference.get(entry["step"])
        if other is None:
            return f"; resumed at step {entry['step']}, which the undisturbed job never started"
        parted = [key for key in entry if key != "step" and entry[key] != other[key]]
        if parted:
            return f"; first parted at step {entry['step']} (resumed at {trace[0]['step']}) in {', '.join(parted)}"
    return f"; every traced step started alike (resumed at {trace[0]['step']})" if trace else ""


def merge_reports(paths: list[Path], out: Path, name: str) -> int:
    """Write the runs of several reports (``paths``, of one device) as one report ``name`` in ``out``, with each
    report's command; return 1 if a merged run hung, tore a checkpoint or did not end exact."""
    reports = [json.loads(path.read_text()) for path in paths]
    devices = {report["device"] for report in reports}
    if len(devices) != 1:
        raise ValueError(f"--merge takes reports of one device, got {sorted(devices)} from {[str(p) for p in paths]}")
    runs = [run for report in reports for run in report["runs"]]
    merged = {
        **{key: value for key, value in reports[0].items() if key != "summary"},
        "command": " ; ".join(report["command"] for report in reports),
        "name": name,
        "date": max(report["date"] for report in reports),
        "settings": {**reports[0]["settings"], "parts": [report["settings"] for report in reports]},
        # Each input's own run: its name, its day (the code it tested) and the algorithms it covered.
        "merged_from": [
            {"name": r["name"], "date": r["date"], "algorithms": sorted({run["algorithm"] for run in r["runs"]})}
            for r in reports
        ],
        "rows": summarize([Run(**{**run, "kills": [Kill(**kill) for kill in run["kills"]]}) for run in runs]),
        "runs": runs,
    }
    write_report(out, name, merged, markdown(merged))
    print(f"wrote {out / name}.json and .md from {len(reports)} reports")
    return int(any(r["hang"] or r["torn"] or not r["exact"] for r in runs))


def chaos(args: argparse.Namespace, command: str) -> int:
    """Run the campaign (or ``--merge`` reports), record ``command`` with the results; return 1 when some run hung,
    tore a checkpoint or ended off its undisturbed job."""
    if args.merge:
        return merge_reports(args.merge, args.out, args.name or f"chaos_{args.device}")
    layouts = [Layout.parse(name) for name in args.layouts]
    if args.device == "cuda":
        # One GPU per worker on this host: NCCL refuses two ranks on one GPU.
        layouts = [layout for layout in layouts if layout.world_size <= torch.cuda.device_count()]
    rng = random.Random(args.seed)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as directory:
        work = Path(directory)
        for layout in layouts:
            for algorithm in args.algorithms:
                seeds = [args.seed + i for i in range(ASYNC_SEEDS if algorithm == "async" else 1)]
                references = [undisturbed(algorithm, layout, args.device, s, args.save_last, args.cache,
                                          args.timeout_s) for s in seeds]  # fmt: skip
                for index in range(args.kills):
                    kind = rng.choice(args.kinds)
                    print(f"{algorithm} {layout.name} #{index} {kind}: started", flush=True)
                    for attempt in (work, work / "again"):
                        run = disturbed_run(
                            algorithm, layout, kind, index, args.device, args.seed, args.save_last, rng, references,
                            args.timeout_s, attempt,
                        )  # fmt: skip
                        # Another job took the rendezvous port between free_port() and the agent's bind: the job
                        # never started, so nothing was tested. Once more, on a fresh port and folder.
                        if run.kills or _RENDEZVOUS_FAILED not in run.log_tail or attempt != work:
                            break
                        print(f"{algorithm} {layout.name} #{index}: the agent's rendezvous failed; again", flush=True)
                    kills = "; ".join(f"{k.kind} rank {k.rank}{'' if k.landed else ' (missed aim)'}" for k in run.kills)
                    status = "HANG" if run.hang else "exact" if run.exact else "NOT EXACT"
                    outcome = f"restarts {run.restarts}; {status} ({run.comparison}); torn {len(run.torn)}"
                    outcome += f"; {run.seconds} s"
                    print(f"{algorithm} {layout.name} #{index} {kind}: {kills or 'no kill'}; {outcome}", flush=True)
                    runs.append(run)
    settings = {"kills_per_configuration": args.kills, "algorithms": args.algorithms, "layouts": args.layouts,
                "kinds": args.kinds, "seed": args.seed, "timeout_s": args.timeout_s, "max_restarts": MAX_RESTARTS,
                "samples": SAMPLES, "batch": BATCH, "epochs": EPOCHS, "checkpoint_every": CHECKPOINT_EVERY,
                "save_last": args.save_last, "save_delay_s": SAVE_DELAY_S, "straggle_s": STRAGGLE_S,
                "async_seeds": ASYNC_SEEDS, "near_tolerance": NEAR_TOLERANCE}  # fmt: skip
    benchmark = "SIGKILL a random worker at a random moment of an elastic torchrun job; count exact finishes"
    report = new_report(benchmark, settings, summarize(runs), command=command)
    name = args.name or f"chaos_{args.device}"
    report.update(device=args.device, name=name, runs=[asdict(run) for run in runs])
    write_report(args.out, name, report, markdown(report))
    print(f"wrote {args.out / name}.json and .md")
    return int(any(r.hang or r.torn or not r.exact for r in runs))


# ------------------------------------------------------------------------------------------------ the chaos job


class SlowToPickle:
    """A checkpoint entry that takes ``delay_s`` to pickle and loads as an empty ``OrderedDict``.

    ``torch.save`` pickles it while the checkpoint's file is open, so the save lasts long enough for the harness to
    kill a rank inside it; ``weights_only`` loading accepts ``OrderedDict``. It writes a ``save`` marker as it starts:
    with Lightning's own checkpoint IO (``ddp``) there is no ``.partial`` file to watch for.
    """

    def __init__(self, delay_s: float, markers: "Markers", step: int) -> None:
        self.delay_s, self.markers, self.step = delay_s, markers, step

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        self.markers.write("save", self.step)
        time.sleep(self.delay_s)
        return collections.OrderedDict, ()


def fingerprint(*tensors: torch.Tensor) -> str:
    """Return a short digest of the tensors' bytes."""
    digest = hashlib.sha1()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def chaos_job(args: argparse.Namespace) -> int:
    """Fit once as a rank of the job ``chaos`` kills, resuming from ``last.ckpt`` where there is one; write this
    rank's final state and return 0 (a fit that fails raises)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bagua import BaguaStrategy, QAdamOptimizer

    out = Path(args.out)
    rank = int(os.environ["RANK"])
    markers = Markers(out / "markers", rank)
    markers.write("setup", -1)
    # The straggle happens once per job, whatever the restarts: the file outlives the process.
    straggled = out / "markers" / "straggled"
    trace: list[dict[str, Any]] = []

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))

        def on_train_start(self) -> None:
            markers.write("fit_start", self.global_step)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            markers.write("step", self.global_step)
            # What each step starts from, so that the harness can name the first step where a resumed job parts
            # from the undisturbed one, and what parted first: the batch, a generator or the weights.
            trace.append(
                {
                    "step": self.global_step,
                    "batch": fingerprint(batch[0]),
                    "weights": fingerprint(*self.parameters()),
                    "torch_rng": fingerprint(torch.get_rng_state()),
                    "cuda_rng": fingerprint(torch.cuda.get_rng_state()) if args.device == "cuda" else "",
                    "python_rng": hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:12],
                }
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            # Room for a kill to land inside the step rather than in Lightning's bookkeeping between steps.
            time.sleep(STEP_SLEEP_S)
            scale = 1 + 0.1 * random.random()
            return scale * nn.functional.mse_loss(self.net(inputs), targets)

        def on_before_backward(self, loss: torch.Tensor) -> None:
            chosen = self.global_rank == args.straggle_rank and self.global_step == args.straggle_step
            if chosen and not straggled.exists():
                straggled.write_text(str(self.global_step))
                markers.write("straggle", self.global_step)
                time.sleep(STRAGGLE_S)
            markers.write("backward", self.global_step)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if args.slow_saves:
                checkpoint["chaos_save_delay"] = SlowToPickle(SAVE_DELAY_S, markers, self.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if args.algorithm == "qadam":
                return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=5)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    generator = torch.Generator().manual_seed(1000 + args.seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dataset = TensorDataset(inputs, targets)

    pl.seed_everything(args.seed, verbose=False)
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    keywords = algorithm_keywords(args.algorithm, nodes)
    strategy: Any = "ddp" if args.algorithm == "ddp" else BaguaStrategy(algorithm=args.algorithm, **keywords)
    save_last: bool | Literal["link"] = True if args.save_last == "true" else "link"
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=CHECKPOINT_EVERY, save_last=save_last)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=nodes, strategy=strategy, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=True, callbacks=[checkpoint],
    )  # fmt: skip
    model = Regression()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last")

    model.eval()
    with torch.no_grad():
        net = model.net.cpu()
        loss = nn.functional.mse_loss(net(inputs), targets).item()
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    result = {
        "state": {key: value.detach().cpu().clone() for key, value in model.state_dict().items()},
        "loss": loss,
        "global_step": trainer.global_step,
        "restart_count": markers.restart,
        "trace": trace,
    }
    torch.save(result, final / f"rank{rank}.pt")
    markers.write("done", trainer.global_step)
    return 0


# ------------------------------------------------------------------------------------------------ dead rank


@dataclass
class JobResult:
    """One job's outcome: its exit status, output, and the seconds from the rank's death to the last exit."""

    returncode: int | None
    output: str
    death_to_exit_s: float | None
    leftover_pids: list[int]


def launcher_command(launcher: str, port: int, max_restarts: int = 0) -> list[str]:
    """Return the command that starts the 2-process job under ``launcher``, up to the script."""
    if launcher == "lightning_bagua.launch":
        return [sys.executable, "-m", "lightning_bagua.launch", "--nproc_per_node", "2", "--master_port", str(port),
                "--max_restarts", str(max_restarts)]  # fmt: skip
    if launcher == "torchrun":
        return torchrun("--nproc-per-node", "2", "--master-port", str(port), "--max-restarts", str(max_restarts))
    if launcher != "lightning" or max_restarts:
        raise ValueError(f"Cannot launch with {launcher!r}, {max_restarts} restarts (Lightning's launcher has none).")
    return [sys.executable]


def run_job(
    launcher: str,
    workdir: Path,
    kill: bool = True,
    max_restarts: int = 0,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 240.0,
    script: Path = FIT_SCRIPT,
    training_args: tuple[str, ...] = TRAINING_ARGS,
) -> JobResult:
    """Run the job under ``launcher`` in ``workdir``; rank 1 kills itself once at step 8 when ``kill``.

    The marker file rank 1 writes before dying keeps a restarted rank 1 alive, so ``max_restarts=1`` finishes.
    ``script`` may be another job taking the same ``--out``, ``--devices`` and ``--kill-*`` options (the Fabric
    job of the tests), with its own ``training_args``.
    """
    port = free_port()
    marker = workdir / "death.json"
    command = [*launcher_command(launcher, port, max_restarts), str(script), "--out", str(workdir / "out"),
               "--devices", "2", *training_args, *extra_args]  # fmt: skip
    if kill:
        command += ["--kill-rank", str(KILLED_RANK), "--kill-at-step", str(KILL_AT_STEP), "--kill-marker", str(marker)]
    job = Job([command], workdir / "output.log", job_env(MASTER_PORT=str(port)))
    # What the launcher started gets a moment to exit after it; what is still there then was left behind.
    job.finish(time.monotonic() + timeout_s, grace_s=5)
    death = json.loads(marker.read_text())["time"] if marker.exists() else None
    return JobResult(
        returncode=job.returncodes[0],
        output=job.output(),
        death_to_exit_s=None if death is None or max_restarts else job.exited - death,
        leftover_pids=job.leftovers,
    )


def dead_rank(args: argparse.Namespace, command: str) -> int:
    """Run every launcher ``--repeats`` times, write the death-to-exit figures with ``command``; return 0 (a job
    that does not fail as expected raises)."""
    rows = []
    for launcher in LAUNCHERS:
        seconds = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as directory:
                result = run_job(launcher, Path(directory), timeout_s=EXIT_DEADLINE_S + 120)
            if result.death_to_exit_s is None or result.returncode == 0 or result.leftover_pids:
                raise RuntimeError(f"{launcher}: the job did not fail as expected:\n{result.output[-4000:]}")
            seconds.append(round(result.death_to_exit_s, 3))
            print(f"{launcher}: {seconds[-1]:.2f} s from rank {KILLED_RANK}'s death to the job's exit", flush=True)
        median = round(statistics.median(seconds), 3)
        rows.append({"launcher": launcher, "death_to_exit_s": seconds, "median_s": median, "max_s": max(seconds)})
    job = f"tests/strategies/scripts/fit_script.py {' '.join(TRAINING_ARGS)}, gradient_allreduce, gloo, CPU"
    settings = {"job": job, "killed_rank": KILLED_RANK, "kill_at_step": KILL_AT_STEP, "repeats": args.repeats}
    benchmark = "seconds from one rank's SIGKILL (mid-epoch) to the exit of the whole 2-process job"
    report = new_report(benchmark, settings, rows, command=command)
    print(f"wrote {write_report(args.out, 'dead_rank_exit', report)}")
    return 0


# ------------------------------------------------------------------------------------------------ the command line


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand that ``argv`` (by default this process's arguments) names; return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="subcommand", required=True)
    # What the campaign and its job (the job that `chaos` launches under torchrun, one process per rank) share.
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--seed", type=int, default=0)
    save_last = "the job's ModelCheckpoint(save_last=...): a checkpoint saved as last.ckpt, or a link to the newest"
    shared.add_argument("--save-last", choices=SAVE_LAST_CHOICES, default="true", help=save_last)
    shared.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    campaign = commands.add_parser("chaos", parents=[shared], help="kill ranks at random moments; count exact ends")
    campaign.add_argument("--kills", type=int, default=4, help="disturbed runs per algorithm and layout")
    campaign.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    campaign.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    campaign.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    campaign.add_argument("--timeout-s", type=float, default=240.0, help="a run still going after this is a hang")
    campaign.add_argument("--name", default=None, help="results file stem (default chaos_<device>)")
    campaign.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lightning_bagua_chaos_cache")
    merge = "write one report (--name, --out) from these reports' runs instead of running jobs (jobs run side by side)"
    campaign.add_argument("--merge", nargs="+", type=Path, default=None, help=merge)
    exits = commands.add_parser("dead-rank", help="time a job's exit after a rank's SIGKILL, per launcher")
    exits.add_argument("--repeats", type=int, default=3)
    job = commands.add_parser("chaos-job", parents=[shared], help="(internal) the job chaos kills, under torchrun")
    job.add_argument("--algorithm", required=True)
    job.add_argument("--straggle-rank", type=int, default=-1)
    job.add_argument("--straggle-step", type=int, default=-1)
    job.add_argument("--slow-saves", action="store_true", help=f"hold each checkpoint save open {SAVE_DELAY_S} s")
    for subcommand, out in ((campaign, RESULTS), (exits, RESULTS), (job, None)):
        subcommand.add_argument("--out", type=Path, default=out, required=out is None)
    args = parser.parse_args(argv)
    if args.subcommand == "chaos-job":
        return chaos_job(args)
    run = chaos if args.subcommand == "chaos" else dead_rank
    return run(args, shlex.join(["python", "benchmarks/robustness.py", *argv]))


if __name__ == "__main__":
    sys.exit(main())
