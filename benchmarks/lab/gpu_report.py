"""Reading the GPU step-time lab's results: its report, the README's figures, the docs and the targets read them alike.

:func:`load_results` merges ``gpu_network_lab_nvlink*.json`` (further NVLink runs pool) and
``gpu_network_lab_sockets*.json`` (later sockets runs replace rows); :func:`report` writes ``gpu_network_lab.md``
and its chart, :func:`write_readme` the README's figures (``python benchmarks/suite.py --readme``). Nothing here
imports torch: the docs and the README's command read the results without it.
"""

import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

from lab.render import markdown_table, pyplot
from lab.results import RESULTS

log = logging.getLogger(__name__)

PEERS = ("ddp", "ddp_fp16", "ddp_powersgd_r1", "ddp_powersgd_r4", "ddp_powersgd_r8")
OURS = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "qadam",
    "async",
    "low_rank_r4",
    "low_rank_r8",
    "low_rank_r16",
    "low_rank_r32",
)
METHODS = PEERS + OURS
BUCKET_RUNS = "gpu_bucket_cap_"  # the stems of runs that compare bucket sizes (METHOD@MiB), kept out of the report
WARMUP_STEPS = 12  # untimed, unshaped: low_rank's 10 full-precision steps, PowerSGD's 10, qadam's warm-up
LR_FLOOR = 0.1  # the cosine schedule's last learning rate, as a fraction of the peak


def recorded_keywords(method: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The algorithm keywords a results row of ``method`` ran with (as :func:`algorithm_of` where not recorded)."""
    return (entry.get("rounds") or [entry])[0].get("algorithm_keywords", algorithm_of(method)[1])


def median_range(values: list[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of ``values``: how the lab records a figure over rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def split_bucket(method: str) -> tuple[str, float | None]:
    """``"bytegrad@100"`` -> ``("bytegrad", 100.0)``; ``"bytegrad"`` -> ``("bytegrad", None)`` (the default size)."""
    name, _, bucket = method.partition("@")
    return name, float(bucket) if bucket else None


def algorithm_of(method: str) -> tuple[str, dict[str, Any]]:
    """The algorithm name and keywords a method of ours runs."""
    if method.startswith("low_rank_r"):
        return "low_rank", {"rank": int(method.rsplit("_r", 1)[1]), "hierarchical": False}
    if method in ("bytegrad", "qadam", "low_precision_decentralized"):
        return method, {"hierarchical": False}
    if method == "async":
        return method, {"warmup_steps": WARMUP_STEPS - 2}
    return method, {}


def schedule_of(settings: dict[str, Any]) -> str:
    """The learning-rate schedule an NVLink run trained with, in words."""
    if settings.get("schedule", "constant") == "constant":
        return f"{settings['lr']:g}, constant"
    return (
        f"{settings['lr']:g} after a linear warm-up of {settings['lr_warmup']} steps, then a cosine decay to"
        f" {LR_FLOOR:g} of it at step {settings['train_steps']}"
    )


def bucket_comparison(run: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a run of bucket sizes: each method's median step per link in ms, with the rounds'
    range, and for a ``METHOD@MiB`` its ratio to ``METHOD`` at its default bucket size in the same run."""
    methods = run["methods"]
    links = list(dict.fromkeys(label for entry in methods.values() for label in entry["step_s"]))
    rows = []
    for method, entry in methods.items():
        base = methods.get(split_bucket(method)[0]) if "@" in method else None
        cells = []
        for label in links:
            figure = entry["step_s"].get(label)
            if figure is None:
                cells.append("")
                continue
            ratio = ""
            if base is not None and label in base["step_s"]:
                ratio = f" ({figure['median'] / base['step_s'][label]['median']:.2f}x)"
            cells.append(_step_cell(figure, ratio))
        rows.append([method, *cells])
    return ["method", *(f"{link} ms" for link in links)], rows


def write_bucket_comparison(path: Path) -> str:
    """Write ``path``'s run of bucket sizes as a table beside it (``.md``, see :func:`bucket_comparison`)."""
    run = json.loads(path.read_text())
    header, rows = bucket_comparison(run)
    lines = [
        f"Written by `{run['command']} --out {path.stem}` ({run['machine']['device']}, {run['rounds']} rounds,"
        f" {run['date'][:16]}). Median step per link in ms (ratio to the same method at its wrapper's default"
        " bucket size in this run) [rounds' min, max].",
        "",
        markdown_table(header, rows).rstrip("\n"),
    ]
    text = "\n".join(lines) + "\n"
    path.with_suffix(".md").write_text(text)
    return text


def load_results(results_dir: Path, cpu: bool = False) -> dict[str, Any]:
    """The regimes' results files, with the sockets supplements (``--out gpu_network_lab_sockets_NAME``) merged in."""
    suffix = "_cpu" if cpu else ""
    loaded: dict[str, Any] = {}
    for regime in ("nvlink", "sockets"):
        path = results_dir / f"gpu_network_lab_{regime}{suffix}.json"
        if path.exists():
            loaded[regime] = json.loads(path.read_text())
    # A later run of some methods alone adds them, or replaces their rows; its command is listed. Later by date,
    # whatever the run's name.
    paths = results_dir.glob(f"gpu_network_lab_sockets{suffix}_*.json") if "sockets" in loaded else ()
    runs = {path: json.loads(path.read_text()) for path in paths}
    supplements = sorted(runs, key=lambda path: (runs[path]["date"], path.name))
    if "sockets" in loaded:
        main = loaded["sockets"]
        # Each run's own rows, so that a ratio can read the peer timed in the same run (sockets_beside).
        main["runs"] = {f"gpu_network_lab_sockets{suffix}": dict(main["methods"])}
        if supplements:
            main["sources"] = {f"gpu_network_lab_sockets{suffix}": (main["date"], list(main["methods"]))}
            main["windows"] = {f"gpu_network_lab_sockets{suffix}": main.get("settings", {}).get("window", 1)}
    for path in supplements:
        extra = runs[path]
        loaded["sockets"]["runs"][path.stem] = dict(extra["methods"])
        loaded["sockets"]["methods"].update(extra["methods"])
        loaded["sockets"]["command"] += f"`, then `{extra['command']} --out {path.stem}"
        loaded["sockets"]["sources"][path.stem] = (extra["date"], list(extra["methods"]))
        loaded["sockets"]["windows"][path.stem] = extra.get("settings", {}).get("window", 1)
        for _, methods in list(loaded["sockets"]["sources"].values())[:-1]:
            methods[:] = [method for method in methods if method not in extra["methods"]]
    # Further NVLink runs (``--out gpu_network_lab_nvlink_NAME``: other seeds, more rounds) pool with the first.
    if "nvlink" in loaded:
        tag_rounds(loaded["nvlink"], f"gpu_network_lab_nvlink{suffix}")
    for path in sorted(results_dir.glob(f"gpu_network_lab_nvlink{suffix}_*.json")) if "nvlink" in loaded else []:
        pool_nvlink_run(loaded["nvlink"], tag_rounds(json.loads(path.read_text()), path.stem), path.stem)
    if not loaded:
        raise SystemExit(f"No results in {results_dir}: run the regimes first.")
    return loaded


# What must agree between NVLink runs for their rounds and curves to pool (the seed may differ).
POOLED_SETTINGS = (
    "batch",
    "context",
    "lr",
    "schedule",
    "lr_warmup",
    "train_steps",
    "eval_every",
    "timing_steps",
    "cpu",
)


def tag_rounds(run: dict[str, Any], stem: str) -> dict[str, Any]:
    """Mark each round row of an NVLink run with the run it came from (``"run"``: its file's stem); return ``run``."""
    for entry in run["methods"].values():
        for row in entry.get("rounds", []):
            row.setdefault("run", stem)
    return run


def nvlink_beside(loaded: dict[str, Any], method: str, base: str = "ddp") -> tuple[dict[str, float], ...] | None:
    """``method``'s and ``base``'s NVLink steps (:func:`median_range`) over the pooled runs that timed both, and
    ``{"runs": count}``; ``None`` if none did. A ratio to DDP so reads both sides from the same jobs."""
    methods = loaded.get("nvlink", {}).get("methods", {})
    rows = {name: methods.get(name, {}).get("rounds", []) for name in (method, base)}
    shared = {row.get("run") for row in rows[method]} & {row.get("run") for row in rows[base]}
    if not shared:
        return None
    ours, theirs = (
        median_range([row["step_s"]["nvlink"] for row in rows[name] if row.get("run") in shared])
        for name in (method, base)
    )
    return ours, theirs, {"runs": len(shared)}


def sockets_beside(loaded: dict[str, Any], method: str, label: str, base: str = "ddp") -> dict[str, float] | None:
    """``base``'s step at a sockets link in the run that ``method``'s row comes from; ``None`` if it did not time it.

    The sockets rows come from several runs (each row from the latest run of its method): a ratio reads the peer
    timed beside the method in that run, not the peer's own latest row, so that both met the same machine.
    """
    sockets = loaded.get("sockets", {})
    entry = sockets.get("methods", {}).get(method)
    if entry is None:
        return None
    for run in reversed(sockets.get("runs", {}).values()):  # the latest run that holds the method's row
        if run.get(method) is entry:
            return run.get(base, {}).get("step_s", {}).get(label)
    return None


def pool_nvlink_run(main: dict[str, Any], extra: dict[str, Any], stem: str) -> None:
    """Add a further NVLink run's rounds and loss curve to ``main``'s, method by method.

    Each method's step is then the median over every run's rounds, and its ``curve`` the mean of the runs' curves
    (``curves`` keeps each, for the spread over seeds). The runs must share their model, data and schedule, and each
    method its keywords; a run that differs is refused, naming what differs.
    """
    differing = [key for key in POOLED_SETTINGS if main["settings"].get(key) != extra["settings"].get(key)]
    if differing:
        raise SystemExit(f"{stem} cannot pool with the NVLink run: its settings differ in {', '.join(differing)}.")
    for method, entry in extra["methods"].items():
        base = main["methods"].get(method)
        if base is None:
            main["methods"][method] = entry
            continue
        if recorded_keywords(method, base) != recorded_keywords(method, entry):
            raise SystemExit(
                f"{stem} ran {method} with {recorded_keywords(method, entry)}, the NVLink run with"
                f" {recorded_keywords(method, base)}:"
                " pool only runs of the same keywords."
            )
        base["rounds"] = base["rounds"] + entry["rounds"]
        values = [row["step_s"]["nvlink"] for row in base["rounds"]]
        base["step_s"]["nvlink"] = median_range(values)
        curves = base.get("curves") or ([base["curve"]] if "curve" in base else [])
        curves += [entry["curve"]] if "curve" in entry else []
        if curves:
            base["curves"] = curves
            base["curve"] = [
                {"step": points[0]["step"], "val_loss": statistics.fmean(point["val_loss"] for point in points)}
                for points in zip(*curves, strict=True)
            ]
    main["rounds"] += extra["rounds"]
    main["command"] += f"`, then `{extra['command']} --out {stem}"


def links(loaded: dict[str, Any]) -> list[str]:
    """The links measured, in order: ``nvlink``, then the sockets' rates as walked."""
    labels: list[str] = []
    for regime, data in loaded.items():
        for entry in data["methods"].values():
            for label in entry["step_s"]:
                name = label if regime == "sockets" else "nvlink"
                if name not in labels:
                    labels.append(name)
    return labels


def step_of(loaded: dict[str, Any], method: str, label: str) -> dict[str, float] | None:
    """A method's step time at a link (median, min, max over rounds), ``None`` where not measured."""
    data = loaded.get("nvlink" if label == "nvlink" else "sockets")
    entry = None if data is None else data["methods"].get(method)
    return None if entry is None else entry["step_s"].get(label)


def step_table(loaded: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Median step per method and link, with its ratio to DDP's and the rounds' range, and launches per step."""
    labels = links(loaded)
    rows = []
    for method in (m for m in METHODS if any(m in data["methods"] for data in loaded.values())):
        cells = [method]
        for label in labels:
            value = step_of(loaded, method, label)
            if value is None:
                cells.append("")
                continue
            if method == "ddp":
                ratio = " (1.00x)"
            elif label == "nvlink":  # over the pooled runs that timed DDP too
                beside = nvlink_beside(loaded, method)
                ratio = (
                    " (no DDP in its runs)"
                    if beside is None
                    else f" ({beside[0]['median'] / beside[1]['median']:.2f}x)"
                )
            else:
                ddp = sockets_beside(loaded, method, label)
                ratio = " (no DDP in its run)" if ddp is None else f" ({value['median'] / ddp['median']:.2f}x)"
            cells.append(_step_cell(value, ratio))
        launches = loaded.get("sockets", {}).get("methods", {}).get(method, {}).get("launches_per_step")
        cells.append("" if launches is None else f"{launches:.0f}")
        rows.append(cells)
    return ["method", *(f"{label} ms (x DDP) [min, max]" for label in labels), "launches / step"], rows


def target_of(loaded: dict[str, Any]) -> tuple[float, int, float]:
    """The target validation loss (DDP's at two thirds of its run), the step it was reached, DDP's final loss."""
    curve = loaded["nvlink"]["methods"]["ddp"]["curve"]
    point = curve[max(0, math.ceil(len(curve) * 2 / 3) - 1)]
    return point["val_loss"], point["step"], curve[-1]["val_loss"]


def steps_to_target(loaded: dict[str, Any], method: str) -> int | None:
    """The step of a method's first evaluation at or under the target loss; ``None`` if it never got there."""
    target, _, _ = target_of(loaded)
    curve = loaded["nvlink"]["methods"][method].get("curve", [])
    return next((point["step"] for point in curve if point["val_loss"] <= target), None)


def seed_spread(entry: dict[str, Any]) -> tuple[int, str]:
    """How many seeds a method's NVLink entry averages (pooled runs keep each seed's curve in ``curves``), and their
    final losses' ``"[min, max]"`` (``""`` for a single seed)."""
    finals = [curve[-1]["val_loss"] for curve in entry.get("curves", [])]
    if len(finals) < 2:
        return 1, ""
    return len(finals), f"[{min(finals):.4f}, {max(finals):.4f}]"


def time_to_target_table(loaded: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Steps to the target times the median step at each link, and the final loss against DDP's."""
    labels = links(loaded)
    _, _, final_ddp = target_of(loaded)
    rows = []
    for method, entry in loaded["nvlink"]["methods"].items():
        curve = entry.get("curve", [])
        reached = steps_to_target(loaded, method)
        cells = [method, "not reached" if reached is None else str(reached)]
        for label in labels:
            value = step_of(loaded, method, label)
            if method == "async" and label != "nvlink":
                # Its averaging runs beside the steps at the link's pace: NVLink's curve is not the shaped link's.
                cells.append("n/a")
                continue
            cells.append("" if value is None or reached is None else f"{reached * value['median']:.1f}")
        final = curve[-1]["val_loss"] if curve else math.nan
        seeds, spread = seed_spread(entry)
        cells.append(f"{final:.4f} ({final / final_ddp:.3f}x)" + (f" {spread} over {seeds} seeds" if spread else ""))
        rows.append(cells)
    return ["method", "steps to target", *(f"{label} s" for label in labels), "final loss (x DDP)"], rows


def source_lines(sockets: dict[str, Any]) -> list[str]:
    """The report's list of the sockets runs: each run's date, its timing where it took its steps more than one at a
    time between synchronisations, and the rows it gives."""
    lines = []
    for stem, (date, methods) in sockets["sources"].items():
        window = sockets["windows"][stem]
        timing = f"; steps timed {window} at a time, back to back" if window > 1 else ""
        lines.append(f"- `{stem}` ({date[:16]}{timing}): {', '.join(methods)}")
    return lines


def report(results_dir: Path, cpu: bool) -> str:
    """Write ``gpu_network_lab.md`` and its chart from the regimes' results; return the markdown."""
    loaded = load_results(results_dir, cpu)
    commands = " and ".join(f"`{data['command']}`" for data in loaded.values())
    machines = ", ".join(
        # Pooled runs may time some methods only: the most rounds any method's figures pool.
        f"{name}: {data['machine']['device']}, up to"
        f" {max((len(entry.get('rounds', [])) for entry in data['methods'].values()), default=data['rounds'])}"
        " rounds a method"
        for name, data in loaded.items()
    )
    lines = [
        f"Written by `python benchmarks/gpu_network_lab.py --report` from the runs of {commands} ({machines}).",
        "",
        "Median step in ms over the rounds (ratio to DDP's median at the same link; over NVLink, both medians over the"
        " pooled runs that timed DDP too) [min, max over rounds]:",
        "",
        markdown_table(*step_table(loaded)).rstrip("\n"),
    ]
    sources = loaded.get("sockets", {}).get("sources", {})
    if sources:
        lines += [
            "",
            "The sockets columns (unshaped and shaped) come from these runs, each row from the last run of it:",
            "",
        ]
        lines += source_lines(loaded["sockets"])
    if "nvlink" in loaded and "ddp" in loaded["nvlink"]["methods"]:
        target, at_step, final_ddp = target_of(loaded)
        lines += [
            "",
            f"Time to the target validation loss {target:.4f} (DDP's at step {at_step}): the first evaluation at or",
            "under it, times the method's median step at each link, in seconds; and each method's final validation",
            f"loss against DDP's ({final_ddp:.4f}) at the same steps and seed. `async` averages beside the steps at",
            "the link's pace, so its NVLink curve says nothing of a shaped link (n/a).",
            f"Learning rate: {schedule_of(loaded['nvlink']['settings'])}.",
            "",
            markdown_table(*time_to_target_table(loaded)).rstrip("\n"),
        ]
    text = "\n".join(lines) + "\n"
    suffix = "_cpu" if cpu else ""
    (results_dir / f"gpu_network_lab{suffix}.md").write_text(text)
    chart(loaded, results_dir / f"gpu_network_lab{suffix}.png")
    return text


def _step_cell(figure: dict[str, float], ratio: str = "") -> str:
    """A step figure in ms: ``"median (ratio) [min, max]"`` (``ratio`` as given, with its leading space)."""
    return f"{figure['median'] * 1e3:.1f}{ratio} [{figure['min'] * 1e3:.1f}, {figure['max'] * 1e3:.1f}]"


def chart(loaded: dict[str, Any], path: Path) -> None:
    """Bar charts of the median step per method, one panel per link, with the rounds' range."""
    plt = pyplot()
    if plt is None:
        return
    labels = links(loaded)
    methods = [m for m in METHODS if any(m in data["methods"] for data in loaded.values())]
    figure, axes = plt.subplots(1, len(labels), figsize=(4 * len(labels), 5), squeeze=False)
    for axis, label in zip(axes[0], labels, strict=True):
        steps = {m: step for m in methods if (step := step_of(loaded, m, label)) is not None}
        names = list(steps)
        values = [steps[m]["median"] * 1e3 for m in names]
        below = [value - steps[m]["min"] * 1e3 for m, value in zip(names, values, strict=True)]
        above = [steps[m]["max"] * 1e3 - value for m, value in zip(names, values, strict=True)]
        axis.barh(names, values, xerr=[below, above])
        axis.invert_yaxis()
        axis.set_xscale("log")
        axis.set_xlabel("median step (ms, log)")
        axis.set_title(label)
    figure.suptitle("114M-parameter LM on two GPUs, bf16 (benchmarks/gpu_network_lab.py)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def interleaved_table(run: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of an interleaved NVLink run (``--interleave steps``): each method's median step in ms
    with its ratio to DDP's and the rounds' range, and the time until its step's call returned (host ms)."""
    methods = run["methods"]
    base = methods.get("ddp", {}).get("step_ms", {}).get("median")
    rows = []
    for method, entry in methods.items():
        step = entry["step_ms"]
        ratio = f" ({step['median'] / base:.2f}x)" if base else ""
        rows.append([method, f"{step['median']:.1f}{ratio} [{step['min']:.1f}, {step['max']:.1f}]",
                     f"{entry['host_ms']['median']:.1f}"])  # fmt: skip
    return ["method", "step ms (x ddp) [min, max]", "host ms"], rows


# ------------------------------------------------------------------------------------------------ the README's figures
# The README holds its algorithm table and chart between README_START and README_END; ``python benchmarks/suite.py
# --readme`` rewrites them from these results and ``tests/test_readme.py`` checks them, so a figure typed by hand
# fails. The table: each algorithm's time to DDP's target loss at 10 Gbit/s, against DDP's (a method without one gets
# its NVLink step against DDP's; one the lab has not run, "not measured yet"). The chart: the median step of every
# method and peer at each link.

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_CHART = "benchmarks/results/readme_step_time.png"
README_START = (
    "<!-- figures:start: written by `python benchmarks/suite.py --readme`, checked by tests/test_readme.py -->"
)
README_END = "<!-- figures:end -->"
HEADLINE_LINK = "10gbit"
# Methods that average beside the steps at the link's pace: their NVLink curve says nothing of a shaped link's.
BESIDE_THE_STEPS = ("async",)
NOT_MEASURED = "not measured yet"
# Where the README sends a reader for the methods the two-GPU lab has not run: the CPU labs' pages.
CPU_LABS_POINTER = (
    "the CPU network lab times them beside DDP, its fp16 and PowerSGD hooks and torchft's DiLoCo, down to"
    " 10 Mbit/s ([Which algorithm when](docs/source/choosing.md), [diloco](docs/source/algorithms/diloco.md))."
)
FINAL_LOSS_BAR = 1.01  # low_rank's row shows the fastest rank whose final loss is within 1% of DDP's
# The links of the chart, slowest first, as the lab labels them.
CHART_LINKS = (("1gbit", "1 Gbit/s"), ("10gbit", "10 Gbit/s"), ("25gbit", "25 Gbit/s"), ("unshaped", "TCP, unshaped"),
               ("nvlink", "NVLink"))  # fmt: skip
README_PEERS = (
    ("ddp", "DDP (torch)"),
    ("ddp_fp16", "DDP + fp16 hook (torch)"),
    ("ddp_powersgd_r8", "DDP + PowerSGD hook, rank 8 (torch)"),
)
# (algorithm, its lab method or None for low_rank's chosen rank, when to use it)
README_ALGORITHMS = (
    ("auto", "auto", "you do not know your link: measures link and model at start, picks the fastest to DDP's loss"),
    ("gradient_allreduce", "gradient_allreduce", "fast links (NVLink, InfiniBand); DDP's exact average, the default"),
    ("bytegrad", "bytegrad", "1-25 Gbit/s Ethernet; 8-bit gradients, DDP's loss"),
    ("decentralized", "decentralized", "many nodes where all-reduce latency binds; averages weights with peers"),
    ("low_precision_decentralized", "low_precision_decentralized", "slow links, decentralized at 8 bits"),
    ("qadam", "qadam", "Adam models on slow links; 8-bit momentum after a warm-up"),
    ("async", "async", "ranks of uneven speed; weights averaged on a timer beside the steps"),
    ("low_rank", None, "the slowest links (1-10 Gbit/s); rank-r gradient factors, PowerSGD-style"),
    ("diloco", "diloco", "links below 1 Gbit/s; syncs every H steps with an outer Nesterov optimizer"),
)


def time_to_target(loaded: dict[str, Any], method: str, link: str) -> float | None:
    """Seconds to DDP's target loss at ``link``: steps to the target times the median step there."""
    if method not in loaded.get("nvlink", {}).get("methods", {}) or (method in BESIDE_THE_STEPS and link != "nvlink"):
        return None
    reached = steps_to_target(loaded, method)
    step = step_of(loaded, method, link)
    return None if reached is None or step is None else reached * step["median"]


def final_loss_ratio(loaded: dict[str, Any], method: str) -> float:
    """Return ``method``'s mean final validation loss over DDP's on NVLink; infinite without its curve."""
    _, _, final_ddp = target_of(loaded)
    curve = loaded["nvlink"]["methods"].get(method, {}).get("curve", [])
    return curve[-1]["val_loss"] / final_ddp if curve else math.inf


def low_rank_method(loaded: dict[str, Any]) -> str | None:
    """The lab's ``low_rank_rK`` with the shortest time to the target at the headline link, of the ranks whose final
    loss is within 1% of DDP's; ``None`` where none is."""
    ranks = [m for m in loaded.get("nvlink", {}).get("methods", {}) if m.startswith("low_rank_r")]
    timed = {m: t for m in ranks if (t := time_to_target(loaded, m, HEADLINE_LINK)) is not None}
    close = [m for m in timed if final_loss_ratio(loaded, m) <= FINAL_LOSS_BAR]
    return min(close, key=timed.__getitem__) if close else None


def headline(loaded: dict[str, Any], method: str | None) -> str:
    """A method's figure for the table (see the module docstring)."""
    ddp = time_to_target(loaded, "ddp", HEADLINE_LINK)
    seconds = None if method is None else time_to_target(loaded, method, HEADLINE_LINK)
    if seconds is not None and ddp is not None:
        return f"{seconds:.0f} s ({seconds / ddp:.2f}x DDP)"
    beside = None if method is None else nvlink_beside(loaded, method)
    if beside is not None:
        return f"no time to loss at a shaped link; NVLink step {beside[0]['median'] / beside[1]['median']:.2f}x DDP"
    return NOT_MEASURED


def readme_markdown(loaded: dict[str, Any]) -> str:
    """The README's block between the markers."""
    low_rank = low_rank_method(loaded)
    target, at_step, _ = target_of(loaded)
    nvlink = loaded["nvlink"]
    lines = [
        README_START,
        "",
        f"Time to DDP's validation loss ({target:.3f}, DDP's at step {at_step}) at 10 Gbit/s: a 114M-parameter"
        f" GPT-style LM on two {nvlink['machine']['device']}s, NCCL over TCP shaped by `tc`, mean of"
        f" {_seeds(nvlink)} seeds (`python benchmarks/gpu_network_lab.py`; every link and the spread in"
        " [`gpu_network_lab.md`](benchmarks/results/gpu_network_lab.md)).",
        "",
        "| algorithm | when to use | time to DDP's loss, 10 Gbit/s |",
        "| --- | --- | --- |",
    ]
    pending = []
    for name, method, when in README_ALGORITHMS:
        chosen = low_rank if method is None else method
        label = f"`{name}`" + (f" (rank {chosen.removeprefix('low_rank_r')})" if method is None and chosen else "")
        figure = headline(loaded, chosen)
        if figure == NOT_MEASURED:
            pending.append(f"`{name}`")
        lines.append(f"| {label} | {when} | {figure} |")
    for method, label in README_PEERS:
        lines.append(f"| {label} | for comparison | {headline(loaded, method)} |")
    if pending:
        lines += [
            "",
            f"{' and '.join(pending)} {'have' if len(pending) > 1 else 'has'} no two-GPU run yet; {CPU_LABS_POINTER}",
        ]
    lines += [
        "",
        f"![Median step time per method against the link rate, log scale]({README_CHART})",
        "",
        README_END,
    ]
    return "\n".join(lines)


def _seeds(nvlink: dict[str, Any]) -> int:
    return max(len(entry.get("curves", [])) or 1 for entry in nvlink["methods"].values())


def chart_methods(loaded: dict[str, Any]) -> list[tuple[str, str]]:
    """(lab method, legend label) of every line of the chart: ours, then the peers."""
    low_rank = low_rank_method(loaded)
    ours = [(method, name) for name, method, _ in README_ALGORITHMS if method is not None]
    ranks = [low_rank] if low_rank is None or low_rank == "low_rank_r8" else ["low_rank_r8", low_rank]
    ours += [(method, f"low_rank (rank {method.removeprefix('low_rank_r')})") for method in ranks if method]
    lines = [*ours, *README_PEERS]
    return [(m, label) for m, label in lines if any(step_of(loaded, m, link) for link, _ in CHART_LINKS)]


def readme_chart(loaded: dict[str, Any], path: Path) -> None:
    """Draw the median step of every method against the link, slowest link first."""
    plt = pyplot()
    if plt is None:
        raise SystemExit("The README's chart needs matplotlib: pip install -r requirements/benchmarks.txt")

    figure, axis = plt.subplots(figsize=(9, 5.5))
    positions = range(len(CHART_LINKS))
    markers = "os^vDP*Xh<>p"
    for index, (method, label) in enumerate(chart_methods(loaded)):
        points = [(x, step_of(loaded, method, link)) for x, (link, _) in zip(positions, CHART_LINKS, strict=True)]
        xs = [x for x, step in points if step is not None]
        ys = [step["median"] * 1e3 for _, step in points if step is not None]
        peer = method.startswith("ddp")
        axis.plot(xs, ys, marker=markers[index % len(markers)], linestyle="--" if peer else "-", label=label)
    axis.set_xticks(list(positions), [label for _, label in CHART_LINKS])
    axis.set_yscale("log")
    axis.set_ylabel("median step (ms, log scale)")
    axis.set_xlabel("link between the two GPUs")
    axis.set_title("Step time against the link: 114M-parameter LM, two GPUs", fontsize=11)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the markers (the markers included) replaced by ``block``."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(
            f"README.md has no figures block: add the lines {README_START!r} and {README_END!r} where it goes."
        )
    return text[:start] + block + text[end + len(README_END) :]


def write_readme(results: Path = RESULTS, readme: Path = README, draw: bool = True) -> str:
    """Rewrite the README's figures block (and the chart, with ``draw``) from the results; return the block."""
    loaded = load_results(results)
    block = readme_markdown(loaded)
    readme.write_text(replace_block(readme.read_text(encoding="utf-8"), block), encoding="utf-8")
    if draw:
        readme_chart(loaded, ROOT / README_CHART)
    log.info(f"wrote the figures of {readme} and {README_CHART}")
    return block
