"""Sphinx extension: tables and charts computed at build time from the traffic model and the benchmark results.

Nothing measured is typed into the pages. Each directive reads ``benchmarks/results/*.json`` (or evaluates
``benchmarks/lab/traffic.py``) when the documentation is built, and names the command that wrote the results.

Directives:

``traffic-table``
    Megabytes one rank sends per step, per algorithm, for several model sizes (option ``:ranks:``).
``wire-time-table``
    Milliseconds those bytes take on links of several speeds, for one model size (options ``:parameters:``,
    ``:ranks:``).
``codec-break-even``
    The measured codec throughput and the link speed below which ``bytegrad`` pays off, from
    ``codec_throughput_*.json``.
``codec-paths``
    Each fast path the codec keeps beside its torch reference, with its measured speed-up over the reference,
    from ``codec_throughput_*.json`` and ``low_rank_host_cost_cpu.json``.
``benchmark-table``
    A summary of one results file (argument: its name without ``.json``). ``network_lab``, ``lm_step_time``,
    ``chaos``, ``step_breakdown`` (the GPU lab's interleaved NVLink runs) and ``bucket_cap`` (its runs of bucket
    sizes) read the file named by
    ``:results:``; ``convergence``, ``targets`` and ``time_to_accuracy`` read
    ``convergence_cpu.json``, ``targets.json`` and ``time_to_accuracy_cpu.json``. ``time_to_accuracy`` also
    shows its chart, and, while its results file is missing, the command that writes it.

The charts ``_generated/codec_break_even.png``, ``_generated/convergence_cpu.png``, ``_generated/targets.png`` and
``_generated/time_to_accuracy_cpu.png`` are drawn from the same results when the build starts (the last three by
the scripts' own chart functions: ``targets.png`` by ``benchmarks/suite.py``'s, the others by
``benchmarks/convergence.py``'s).
"""

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from lab import traffic

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
GENERATED = Path(__file__).resolve().parents[1] / "_generated"

# Representative link speeds in Gbit/s, by regime.
LINKS: tuple[tuple[str, float], ...] = (
    ("1 Gbit/s", 1.0),
    ("10 Gbit/s", 10.0),
    ("25 Gbit/s", 25.0),
    ("100 Gbit/s (IB)", 100.0),
    ("NVLink ~3.6 Tbit/s", 3600.0),
)

# (label, algorithm, keywords for traffic.wire_bytes)
VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("gradient_allreduce", "gradient_allreduce", {}),
    ("bytegrad", "bytegrad", {}),
    ("decentralized (all)", "decentralized", {}),
    ("decentralized (shift_one)", "decentralized", {"peer_selection_mode": "shift_one"}),
    ("low_precision_decentralized", "low_precision_decentralized", {}),
    ("qadam (warm-up)", "qadam", {"warmup": True}),
    ("qadam (after warm-up)", "qadam", {}),
)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None = None) -> nodes.table:
    """Return a docutils table with a header row; cells are plain text."""
    table_node = nodes.table(classes=["lb-generated"])
    if caption:
        table_node += nodes.title(text=caption)
    group = nodes.tgroup(cols=len(header))
    table_node += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    head += _row(header)
    body = nodes.tbody()
    group += body
    for cells in rows:
        body += _row(cells)
    return table_node


def _row(cells: Sequence[str]) -> nodes.row:
    row = nodes.row()
    for text in cells:
        entry = nodes.entry()
        entry += nodes.paragraph(text=text)
        row += entry
    return row


def _source_note(commands: Sequence[str], files: str) -> nodes.paragraph:
    """Return "Measured by `cmd`; `cmd` (files)." with the commands as literals (no smart quotes)."""
    note = nodes.paragraph(classes=["lb-source"])
    note += nodes.Text("Measured by ")
    for index, command in enumerate(commands):
        if index:
            note += nodes.Text("; ")
        note += nodes.literal(text=command)
    note += nodes.Text(" (results in ")
    note += nodes.literal(text=files)
    note += nodes.Text(").")
    return note


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"benchmark results {path} not found; run the benchmark that writes it")
    return json.loads(path.read_text(encoding="utf-8"))


def _size(parameters: int) -> str:
    return f"{parameters / 1e9:g}B" if parameters >= 1e9 else f"{parameters / 1e6:g}M"


class TrafficTable(SphinxDirective):
    """Bytes per rank per step, per algorithm, for several model sizes."""

    option_spec = {"ranks": directives.positive_int, "parameters": directives.unchanged}  # noqa: RUF012

    def run(self) -> list[nodes.Node]:
        """Build the table."""
        ranks = self.options.get("ranks", 8)
        sizes = [int(float(s)) for s in self.options.get("parameters", "25e6,350e6,7e9").split(",")]
        header = ["algorithm", *[f"{_size(p)} parameters" for p in sizes], "ratio"]
        base = traffic.wire_bytes("gradient_allreduce", sizes[-1], ranks)
        rows = []
        for label, name, kwargs in VARIANTS:
            sent = [traffic.wire_bytes(name, p, ranks, **kwargs) for p in sizes]
            rows.append([label, *[_megabytes(b) for b in sent], f"{sent[-1] / base:.2f}"])
        caption = (
            f"Bytes each rank sends per step among {ranks} peers, and the ratio to gradient_allreduce"
            " (computed by traffic.wire_bytes)"
        )
        return [table(header, rows, caption)]


class WireTimeTable(SphinxDirective):
    """Milliseconds on the wire per step, per algorithm and link speed."""

    option_spec = {"ranks": directives.positive_int, "parameters": directives.unchanged}  # noqa: RUF012

    def run(self) -> list[nodes.Node]:
        """Build the table."""
        ranks = self.options.get("ranks", 8)
        parameters = int(float(self.options.get("parameters", "350e6")))
        header = ["algorithm", *[name for name, _ in LINKS]]
        rows = []
        for label, name, kwargs in VARIANTS:
            sent = traffic.wire_bytes(name, parameters, ranks, **kwargs)
            rows.append([label, *[_milliseconds(traffic.wire_seconds(sent, speed)) for _, speed in LINKS]])
        caption = (
            f"Time on the wire per step for {_size(parameters)} parameters among {ranks} peers"
            " (bandwidth only: latency, codec time and overlap with backward are left out)"
        )
        return [table(header, rows, caption)]


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e10 else f"{nbytes / 1e6:,.0f} MB"


def _milliseconds(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


KEPT_BACKENDS = ("torch", "native", "triton")  # results files may still hold rows of backends since removed


def _codec_rows() -> list[tuple[str, str, dict[str, Any]]]:
    # (device, command, result) for each eager, single-chunk codec measurement in every codec results file.
    found = []
    for path in sorted(RESULTS.glob("codec_throughput_*.json")):
        data = _load(path.stem)
        device = "CPU" if data["settings"].get("cpu") else data["machine"].get("device", "GPU")
        for result in data.get("rows", data.get("results")):
            if result["mode"] == "eager" and result["chunks"] == 1 and result["backend"] in KEPT_BACKENDS:
                found.append((device, data["command"], result))
    return found


class CodecBreakEven(SphinxDirective):
    """Measured codec throughput and the link speed below which compression pays off."""

    def run(self) -> list[nodes.Node]:
        """Build the table from every ``codec_throughput_*.json``."""
        rows = []
        commands = []
        for device, command, result in _codec_rows():
            if command not in commands:
                commands.append(command)
            gbyte = result["input_gbps"]
            rows.append(
                [
                    f"{device}, {result['backend']}",
                    f"{result['size_mb']} MB",
                    f"{gbyte:,.1f} GB/s",
                    f"{traffic.break_even_gbit(gbyte):,.0f} Gbit/s",
                ]
            )
        header = ["device, codec backend", "buffer", "codec throughput (fp32 in)", "bytegrad pays off below"]
        note = _source_note(commands, "benchmarks/results/codec_throughput_*.json")
        return [table(header, rows, "Codec speed and the break-even link speed"), note]


# Each fast path of the codec: (label, results file, backend timed in it, device type the path serves).
CODEC_PATHS: tuple[tuple[str, str, str], ...] = (
    ("C++ kernels (native), CPU tensors", "codec_throughput_cpu", "native"),
    ("Triton kernels, CUDA tensors", "codec_throughput_gpu", "triton"),
)


class CodecPaths(SphinxDirective):
    """Each fast path the codec keeps, and its measured speed-up over the torch reference."""

    def run(self) -> list[nodes.Node]:
        """Build the table from the codec's and low_rank's host-cost results."""
        header, rows, commands, files = _codec_paths()
        note = _source_note(commands, ", ".join(f"benchmarks/results/{file}" for file in files))
        return [table(header, rows, "The codec's fast paths against its torch reference"), note]


def _codec_paths() -> tuple[list[str], list[list[str]], list[str], list[str]]:
    """Header, rows, commands and results files of the ``codec-paths`` table."""
    rows, commands, files = [], [], []
    for label, name, backend in CODEC_PATHS:
        data = _load(name)
        commands.append(data["command"])
        files.append(f"{name}.json")
        timed = {
            (r["size_mb"], r["backend"]): r["input_gbps"]
            for r in data.get("rows", data.get("results"))
            if r["mode"] == "eager" and r["chunks"] == 1
        }
        sizes = sorted({size for size, timed_backend in timed if timed_backend == backend})
        gains = [timed[size, backend] / timed[size, "torch"] for size in sizes if (size, "torch") in timed]
        device = data["machine"].get("device", "CPU") if name.endswith("gpu") else "CPU"
        rows.append(
            [
                label,
                f"{device}, {sizes[0]}-{sizes[-1]} MiB, compress + decompress",
                f"{min(gains):.1f}x-{max(gains):.1f}x",
            ]
        )
    host = _load("low_rank_host_cost_cpu")
    commands.append(host["command"])
    files.append("low_rank_host_cost_cpu.json")
    median = {(r["task"], r["rank"], r["form"], r["setting"]): r["median_s"] for r in host["results"]}
    gains = [t / median[(*key[:3], "qr_native")] for key, t in median.items() if key[3] == "qr_torch"]
    rows.append(
        [
            "C++ kernels for low_rank's segment messages (SegmentLayout), CPU",
            "one low_rank bucket's host time, every task and rank",
            f"{min(gains):.1f}x-{max(gains):.1f}x",
        ]
    )
    header = ["path", "measured on", "speed-up over the torch reference"]
    return header, rows, commands, files


def _engine_overhead() -> tuple[list[str], list[list[str]], list[str]]:
    rows, commands = [], []
    for path in sorted(RESULTS.glob("engine_overhead_*.json")):
        data = _load(path.stem)
        commands.append(data["command"])
        step = data["median_step_ms"]
        rows.append(
            [
                f"{data['device']} x{data['settings']['devices']}",
                f"{data['parameters'] / 1e6:,.1f}M",
                f"{step['torch_ddp']:.2f} ms",
                f"{step['bagua_gradient_allreduce']:.2f} ms",
                f"{data['ratio_bagua_to_ddp']:.3f}",
            ]
        )
    header = ["devices", "parameters", "torch DDP", "gradient_allreduce", "ratio"]
    return header, rows, commands


def _fused_optimizer() -> tuple[list[str], list[list[str]], list[str]]:
    rows, commands = [], []
    for path in sorted(RESULTS.glob("fused_optimizer_*.json")):
        data = _load(path.stem)
        commands.append(data["command"])
        # Files before the lab's schema nest the rows by optimizer, and name the device at the top.
        by_optimizer = data.get("results", {})
        for row in data.get("rows", []):
            by_optimizer.setdefault(row["optimizer"], {})[row["variant"]] = row
        device = data.get("device") or data["machine"]["device"]
        for optimizer, variants in by_optimizer.items():
            cells = [device, optimizer]
            for variant in ("for_loop", "foreach", "torch_fused", "fuse_step", "fuse_step+torch_fused"):
                cells.append(f"{variants[variant]['median_ms']:.2f} ms" if variant in variants else "-")
            rows.append(cells)
    header = ["device", "optimizer", "for-loop", "foreach", "fused=True", "fuse_step", "fuse_step + fused"]
    return header, rows, commands


def _sampler_balance() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("sampler_balance")
    rows = []
    results = data.get("results") or {row["layout/sampler"]: row for row in data["rows"]}
    for name, result in results.items():
        summary = result["summary"]
        rows.append(
            [
                name,
                f"{summary['mean_step_s'] * 1e3:.1f} ms",
                f"{summary['idle_fraction'] * 100:.1f} %",
                f"{summary['mean_work_gap_tokens']:.1f}",
            ]
        )
    header = ["batches / sampler", "mean step", "idle time of a rank", "work gap between ranks (tokens)"]
    return header, rows, [data["command"]]


def _cached_dataset() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("cached_dataset")
    rows = []
    variants = data.get("variants") or {row["dataset"]: row for row in data["rows"]}
    for name, result in variants.items():
        epochs = ", ".join(f"{t:.2f} s" for t in result["epoch_s"])
        rows.append([name, epochs, f"{result['last_epoch_speedup_vs_plain']:.1f}x"])
    return ["dataset", "epoch times", "last epoch vs plain"], rows, [data["command"]]


def _startup_time() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("startup_time")
    environments = {row["environment"]: row for row in data.get("rows", [])} or data
    rows = [
        [
            f"{environments['baseline']['median_ms']:.2f} ms",
            f"{environments['with_hook']['median_ms']:.2f} ms",
            f"{data['overhead_median_ms']:.2f} ms",
            ", ".join(data["heavy_modules_imported"]) or "none",
        ]
    ]
    header = ["python -c pass", "with the hook", "added", "torch / Lightning imported"]
    # The file before the lab's schema recorded no command; the script has moved since.
    return header, rows, [data.get("command", "python benchmarks/micro/startup_time.py")]


def _network_lab(results: str = "network_lab_cpu") -> tuple[list[str], list[list[str]], list[str]]:
    # Every layout the lab writes (network_lab_cpu, network_lab_cpu_2x2, ...) has the lab's own table.
    data = _load(results)
    header, rows = _benchmark_module("network_lab").table(data)
    return header, rows, [data["command"]]


def _step_breakdown(results: str) -> tuple[list[str], list[list[str]], list[str]]:
    # An interleaved NVLink run of the GPU lab: each method's step against DDP's, and its host time.
    data = _load(results)
    header, rows = _gpu_report().interleaved_table(data)
    return header, rows, [data["command"]]


def _bucket_cap(results: str) -> tuple[list[str], list[list[str]], list[str]]:
    # The GPU lab's run of bucket sizes (METHOD@MiB), each variant against its method at the default size.
    data = _load(results)
    header, rows = _gpu_report().bucket_comparison(data)
    return header, rows, [data["command"] + f" --out {results}"]


def _chaos(results: str) -> tuple[list[str], list[list[str]], list[str]]:
    # The harness's own table of counts per algorithm and layout (files before the lab's schema call them summary).
    data = _load(results)
    header, rows = _benchmark_module("robustness").summary_table(data.get("rows") or data["summary"], strong="")
    return header, rows, data["command"].split(" ; ")


def _lm_step_time(results: str) -> tuple[list[str], list[list[str]], list[str]]:
    # One GPU or two, one regime column per regime run; the device and the repeats are part of what was measured.
    data = _load(results)
    header, rows = _benchmark_module("lm_step_time").table(data)
    machine, settings = data["machine"], data["settings"]
    where = f"{settings['devices']} x {machine['device']}, torch {machine['torch']}"
    return header, rows, [f"{data['command']} ({where}, batch {settings['batch']})"]


def _benchmark_module(script: str) -> Any:
    """A script of ``benchmarks/`` as a module, for its chart and table functions (one place computes a figure)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_lb_benchmark_{script}", RESULTS.parent / f"{script}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_report() -> Any:
    """``benchmarks/lab/gpu_report.py``, which reads the GPU lab's results as its report and the README read them."""
    import sys

    if str(RESULTS.parent) not in sys.path:
        sys.path.insert(0, str(RESULTS.parent))
    from lab import gpu_report

    return gpu_report


def _gpu_lab_commands(loaded: dict[str, Any]) -> list[str]:
    return [f"{data['command']} ({data['machine']['device']} x 2, {data['rounds']} rounds)" for data in loaded.values()]


def _gpu_network_lab() -> tuple[list[str], list[list[str]], list[str]]:
    lab = _gpu_report()
    loaded = lab.load_results(RESULTS)
    header, rows = lab.step_table(loaded)
    return header, rows, _gpu_lab_commands(loaded)


def _gpu_time_to_target() -> tuple[list[str], list[list[str]], list[str]]:
    lab = _gpu_report()
    loaded = lab.load_results(RESULTS)
    header, rows = lab.time_to_target_table(loaded)
    target, at_step, _ = lab.target_of(loaded)
    header[1] = f"steps to {target:.4f} (DDP's at step {at_step})"
    return header, rows, _gpu_lab_commands(loaded)


def _convergence() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("convergence_cpu")
    header, rows = _benchmark_module("convergence").table(data)
    return header, rows, [data["command"]]


def _time_to_accuracy() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("time_to_accuracy_cpu")
    rates = list(data["settings"]["rates"]) if data["settings"]["lab"] else []
    by_key = {(r["task"], r["layout"], r["rate"], r["method"]): r for r in data["combined"]}
    rows = []
    for key in dict.fromkeys((r["task"], r["layout"], r["method"]) for r in data["combined"]):
        task, layout, method = key
        cells = [task, layout, method]
        first = by_key[(task, layout, rates[0] if rates else None, method)]
        steps = first["steps_to_target"]
        cells.append(f"{steps:.0f}" if steps is not None else first["status"])
        for rate in rates:
            row = by_key[(task, layout, rate, method)]
            if "time_to_target_s" in row:
                cells.append(f"{row['time_to_target_s']:.3g} s")
            else:
                cells.append(row["status"] if row["status"] != "reached" else "-")
        for rate in rates:
            row = by_key[(task, layout, rate, method)]
            cell = f"{row['overhead_s'] * 1e3:.1f} ms" if "overhead_s" in row else "-"
            if row.get("overhead_vs_powersgd") is not None:
                cell += f" ({row['overhead_vs_powersgd']:.2f}x)"
            cells.append(cell)
        rows.append(cells)
    header = ["task", "layout", "method", "steps to target"]
    header += [f"time to target, {rate}" for rate in rates] + [f"overhead / step, {rate}" for rate in rates]
    return header, rows, [data["command"]]


def _targets() -> tuple[list[str], list[list[str]], list[str]]:
    data = _load("targets")
    rows = []
    for target in data["targets"]:
        figure = target["measured"]
        if figure is None:
            shown = "-"
        elif "points" in target["bar"]:
            shown = f"{figure:+.2f} points"
        else:
            shown = f"{figure:.3f}x"
        rows.append([target["target"], target["bar"], shown, target["status"], target["detail"], target["source"]])
    # The suite's command first, then the commands that wrote the files it read (shown as literals, not prose).
    commands = list(dict.fromkeys([data["command"], *(t["command"] for t in data["targets"] if t.get("command"))]))
    return ["target", "bar", "measured", "status", "detail", "results file"], rows, commands


BENCHMARKS: dict[str, Callable[..., tuple[list[str], list[list[str]], list[str]]]] = {
    "convergence": _convergence,
    "targets": _targets,
    "network_lab": _network_lab,
    "engine_overhead": _engine_overhead,
    "fused_optimizer": _fused_optimizer,
    "sampler_balance": _sampler_balance,
    "cached_dataset": _cached_dataset,
    "startup_time": _startup_time,
    "time_to_accuracy": _time_to_accuracy,
    "lm_step_time": _lm_step_time,
    "gpu_network_lab": _gpu_network_lab,
    "gpu_time_to_target": _gpu_time_to_target,
    "chaos": _chaos,
    "step_breakdown": _step_breakdown,
    "bucket_cap": _bucket_cap,
}
# Kinds whose results the project has not measured yet: a missing file shows the command that writes it.
NOT_YET_MEASURED = {"time_to_accuracy": ("time_to_accuracy_cpu", "sudo python benchmarks/convergence.py --timed")}
# Kinds whose results files are named after another kind's.
RESULT_STEMS = {"gpu_time_to_target": "gpu_network_lab"}
# Kinds whose function reads the results file named by the ``:results:`` option (a stem in benchmarks/results/).
TAKES_RESULTS_FILE = {"network_lab", "lm_step_time", "chaos", "step_breakdown", "bucket_cap"}


class BenchmarkTable(SphinxDirective):
    """A summary table of one benchmark's results files; ``:results: stem`` picks the file where a kind allows."""

    required_arguments = 1
    option_spec = {"results": directives.unchanged_required}  # noqa: RUF012

    def run(self) -> list[nodes.Node]:
        """Build the table for the benchmark named by the argument."""
        name = self.arguments[0]
        if name not in BENCHMARKS:
            raise self.error(f"Unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}.")
        results = self.options.get("results")
        if results is not None and name not in TAKES_RESULTS_FILE:
            raise self.error(f"Benchmark {name!r} takes no :results: option.")
        if name in NOT_YET_MEASURED and not (RESULTS / f"{NOT_YET_MEASURED[name][0]}.json").is_file():
            stem, command = NOT_YET_MEASURED[name]
            note = nodes.paragraph(classes=["lb-source"])
            note += nodes.Text(f"Not measured yet: benchmarks/results/{stem}.json is written by ")
            note += nodes.literal(text=command)
            note += nodes.Text(".")
            return [note]
        header, rows, commands = BENCHMARKS[name]() if results is None else BENCHMARKS[name](results)
        stem = RESULT_STEMS.get(name, name)
        for path in RESULTS.glob(f"{stem}*.json"):
            self.env.note_dependency(str(path))
        files = f"benchmarks/results/{stem}*.json" if results is None else f"benchmarks/results/{results}.json"
        found: list[nodes.Node] = [table(header, rows), _source_note(commands, files)]
        if name in NOT_YET_MEASURED and (GENERATED / f"{NOT_YET_MEASURED[name][0]}.png").is_file():
            # A leading slash: relative to the source folder, from any page.
            found.append(nodes.image(uri=f"/_generated/{NOT_YET_MEASURED[name][0]}.png", alt=f"{name} chart"))
        return found


def draw_codec_chart(app: Sphinx) -> None:
    """Draw the break-even link speed of every codec measurement against the buffer size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = {}
    for device, _command, result in _codec_rows():
        label = f"{device}, {result['backend']}"
        series.setdefault(label, []).append((result["size_mb"], traffic.break_even_gbit(result["input_gbps"])))
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=f"codec on {label}")
    for name, speed in LINKS:
        ax.axhline(speed, color="grey", linewidth=0.8, linestyle="--")
        ax.annotate(
            name,
            (1.0, speed),
            xycoords=("axes fraction", "data"),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color="dimgrey",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bucket size handed to the codec (MB)")
    ax.set_ylabel("bytegrad pays off below (Gbit/s)")
    ax.set_title("Link speed below which 8-bit compression saves time", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    GENERATED.mkdir(exist_ok=True)
    fig.savefig(GENERATED / "codec_break_even.png")
    plt.close(fig)


def draw_benchmark_charts(app: Sphinx) -> None:
    """Draw the convergence, targets, time-to-accuracy and GPU lab charts from their JSON with the scripts' charts."""
    charts = (("convergence", "convergence_cpu"), ("suite", "targets"), ("convergence", "time_to_accuracy_cpu"))
    for script, name in charts:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            continue
        GENERATED.mkdir(exist_ok=True)
        _benchmark_module(script).chart(_load(name), GENERATED / f"{name}.png")
    if (RESULTS / "gpu_network_lab_sockets.json").is_file() or (RESULTS / "gpu_network_lab_nvlink.json").is_file():
        lab = _gpu_report()
        GENERATED.mkdir(exist_ok=True)
        lab.chart(lab.load_results(RESULTS), GENERATED / "gpu_network_lab.png")


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directives and the chart."""
    app.add_directive("traffic-table", TrafficTable)
    app.add_directive("wire-time-table", WireTimeTable)
    app.add_directive("codec-break-even", CodecBreakEven)
    app.add_directive("codec-paths", CodecPaths)
    app.add_directive("benchmark-table", BenchmarkTable)
    app.connect("builder-inited", draw_codec_chart)
    app.connect("builder-inited", draw_benchmark_charts)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
