"""The README's measured figures: its algorithm table and its chart, written from the GPU network lab's results.

The README holds them between two markers (``<!-- figures:start ... -->`` and ``<!-- figures:end -->``); this
script rewrites what lies between, and ``tests/test_readme.py`` checks that the README holds what it writes, so a
figure typed by hand fails the suite. The figures come from the files ``python benchmarks/gpu_network_lab.py
--report`` reads (``benchmarks/results/gpu_network_lab_nvlink*.json`` and ``gpu_network_lab_sockets*.json``), read
by the same functions (:mod:`lab.gpu_report`), so that the README and ``gpu_network_lab.md`` never disagree.

- The table: each algorithm's time to DDP's target validation loss at 10 Gbit/s (steps to the target times its
  median step there), against DDP's; a method timed but without a time to the target (``async``, whose averaging
  runs on a timer beside the steps) gets its NVLink step against DDP's; a method the lab has not run yet (``auto``,
  ``diloco``) reads "not measured yet" until a lab run adds it.
- The chart (``benchmarks/results/readme_step_time.png``, needs matplotlib): the median step of every method and of
  the peers at each link, from 1 Gbit/s to NVLink.

Run it (``python benchmarks/suite.py --readme`` does the same)::

    python benchmarks/readme_figures.py
"""

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab.gpu_report import load_results, nvlink_beside, step_of, steps_to_target, target_of
from lab.render import pyplot
from lab.results import RESULTS

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHART = "benchmarks/results/readme_step_time.png"
START = "<!-- figures:start: written by `python benchmarks/suite.py --readme`, checked by tests/test_readme.py -->"
END = "<!-- figures:end -->"
HEADLINE_LINK = "10gbit"
# Methods that average beside the steps at the link's pace: their NVLink curve says nothing of a shaped link's.
BESIDE_THE_STEPS = ("async",)
FINAL_LOSS_BAR = 1.01  # low_rank's row shows the fastest rank whose final loss is within 1% of DDP's
# The links of the chart, slowest first, as the lab labels them.
CHART_LINKS = (("1gbit", "1 Gbit/s"), ("10gbit", "10 Gbit/s"), ("25gbit", "25 Gbit/s"), ("unshaped", "TCP, unshaped"),
               ("nvlink", "NVLink"))  # fmt: skip
PEERS = (
    ("ddp", "DDP (torch)"),
    ("ddp_fp16", "DDP + fp16 hook (torch)"),
    ("ddp_powersgd_r8", "DDP + PowerSGD hook, rank 8 (torch)"),
)
# (algorithm, its lab method or None for low_rank's chosen rank, when to use it)
ALGORITHMS = (
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


def _time_to_target(loaded: dict[str, Any], method: str, link: str) -> float | None:
    """Seconds to DDP's target loss at ``link``: steps to the target times the median step there."""
    if method not in loaded.get("nvlink", {}).get("methods", {}) or (method in BESIDE_THE_STEPS and link != "nvlink"):
        return None
    reached = steps_to_target(loaded, method)
    step = step_of(loaded, method, link)
    return None if reached is None or step is None else reached * step["median"]


def _final_loss_ratio(loaded: dict[str, Any], method: str) -> float:
    _, _, final_ddp = target_of(loaded)
    curve = loaded["nvlink"]["methods"].get(method, {}).get("curve", [])
    return curve[-1]["val_loss"] / final_ddp if curve else math.inf


def low_rank_method(loaded: dict[str, Any]) -> str | None:
    """The lab's ``low_rank_rK`` with the shortest time to the target at the headline link, of the ranks whose final
    loss is within 1% of DDP's; ``None`` where none is."""
    ranks = [m for m in loaded.get("nvlink", {}).get("methods", {}) if m.startswith("low_rank_r")]
    timed = {m: t for m in ranks if (t := _time_to_target(loaded, m, HEADLINE_LINK)) is not None}
    close = [m for m in timed if _final_loss_ratio(loaded, m) <= FINAL_LOSS_BAR]
    return min(close, key=timed.__getitem__) if close else None


def headline(loaded: dict[str, Any], method: str | None) -> str:
    """A method's figure for the table (see the module docstring)."""
    ddp = _time_to_target(loaded, "ddp", HEADLINE_LINK)
    seconds = None if method is None else _time_to_target(loaded, method, HEADLINE_LINK)
    if seconds is not None and ddp is not None:
        return f"{seconds:.0f} s ({seconds / ddp:.2f}x DDP)"
    beside = None if method is None else nvlink_beside(loaded, method)
    if beside is not None:
        return f"no time to loss at a shaped link; NVLink step {beside[0]['median'] / beside[1]['median']:.2f}x DDP"
    return "not measured yet"


def markdown(loaded: dict[str, Any]) -> str:
    """The README's block between the markers."""
    low_rank = low_rank_method(loaded)
    target, at_step, _ = target_of(loaded)
    nvlink = loaded["nvlink"]
    lines = [
        START,
        "",
        f"Time to DDP's validation loss ({target:.3f}, DDP's at step {at_step}) at 10 Gbit/s: a 114M-parameter"
        f" GPT-style LM on two {nvlink['machine']['device']}s, NCCL over TCP shaped by `tc`, mean of"
        f" {_seeds(nvlink)} seeds (`python benchmarks/gpu_network_lab.py`; every link and the spread in"
        " [`gpu_network_lab.md`](benchmarks/results/gpu_network_lab.md)).",
        "",
        "| algorithm | when to use | time to DDP's loss, 10 Gbit/s |",
        "| --- | --- | --- |",
    ]
    for name, method, when in ALGORITHMS:
        chosen = low_rank if method is None else method
        label = f"`{name}`" + (f" (rank {chosen.removeprefix('low_rank_r')})" if method is None and chosen else "")
        lines.append(f"| {label} | {when} | {headline(loaded, chosen)} |")
    for method, label in PEERS:
        lines.append(f"| {label} | for comparison | {headline(loaded, method)} |")
    lines += [
        "",
        f"![Median step time per method against the link rate, log scale]({CHART})",
        "",
        END,
    ]
    return "\n".join(lines)


def _seeds(nvlink: dict[str, Any]) -> int:
    return max(len(entry.get("curves", [])) or 1 for entry in nvlink["methods"].values())


def chart_methods(loaded: dict[str, Any]) -> list[tuple[str, str]]:
    """(lab method, legend label) of every line of the chart: ours, then the peers."""
    low_rank = low_rank_method(loaded)
    ours = [(method, name) for name, method, _ in ALGORITHMS if method is not None]
    ranks = [low_rank] if low_rank is None or low_rank == "low_rank_r8" else ["low_rank_r8", low_rank]
    ours += [(method, f"low_rank (rank {method.removeprefix('low_rank_r')})") for method in ranks if method]
    lines = [*ours, *PEERS]
    return [(m, label) for m, label in lines if any(step_of(loaded, m, link) for link, _ in CHART_LINKS)]


def chart(loaded: dict[str, Any], path: Path) -> None:
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
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no figures block: add the lines {START!r} and {END!r} where it goes.")
    return text[:start] + block + text[end + len(END) :]


def write_readme(results: Path = RESULTS, readme: Path = README, draw: bool = True) -> str:
    """Rewrite the README's figures block (and the chart, with ``draw``) from the results; return the block."""
    loaded = load_results(results)
    block = markdown(loaded)
    readme.write_text(replace_block(readme.read_text(encoding="utf-8"), block), encoding="utf-8")
    if draw:
        chart(loaded, ROOT / CHART)
    log.info(f"wrote the figures of {readme} and {CHART}")
    return block


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS), help="where the lab's results JSON files are read")
    parser.add_argument("--no-chart", action="store_true", help="rewrite the table only (no matplotlib needed)")
    args = parser.parse_args(argv)
    write_readme(Path(args.results), draw=not args.no_chart)


if __name__ == "__main__":
    main()
