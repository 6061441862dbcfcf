"""The codec's CPU kernels (``_cpu.cpp``), built by torch's C++ extension tooling on first use.

``torch.utils.cpp_extension.load`` compiles the source with the C++ compiler torch finds (``$CXX``, else ``c++``)
and ninja, into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``),
rebuilds it when the source or flags change, and lets one process build while the others wait. Before torch
2.14 that lock is a file whose mere existence blocks, so a lock that a killed build left behind is removed once it
is older than any build takes; from 2.14 it is an advisory lock, which the kernel releases with its holder, and its
file stays after every build: it is left alone. The build is named by a digest of
this CPU's feature flags and the source's path, so that two checkouts never rebuild over each other's build: it
targets the widest vectors the CPU has (``-march=native``; AVX-512 halves the quantising loop's time against
AVX2), so a cache shared by different machines never hands one the others' instructions. Each build records
beside it a digest of its inputs (the source's bytes, the flags, torch's and Python's versions): a process that
finds the record current loads the library directly, without importing torch's tooling (it imports setuptools, a
quarter of a second) or running ninja; any other reaches torch's loader, which checks and rebuilds.

The kernels work on float32; float16 and bfloat16 are converted around them with torch's ops, which is exact
going in (the reference upcasts first too) and rounds once coming out, as the reference does. Without a compiler
or ninja, or with ``LIGHTNING_BAGUA_NATIVE_CODEC=0``, :func:`available` is ``False`` and the codec runs the
reference's torch ops, which write the same bytes.
"""

import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DISABLE_ENV",
    "available",
    "compress",
    "decode",
    "decode_add",
    "decode_sum",
    "decode_sum_segments",
    "encode_segments",
    "kernels",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "LIGHTNING_BAGUA_NATIVE_CODEC"
SOURCE = Path(__file__).with_name("_cpu.cpp")

# No contraction of a multiply and an add into one rounding, nor any reassociation: the reference's float32
# operations. (-fno-math-errno and -fno-trapping-math only let nearbyint inline and vectorise.)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-march=native"]
# A build takes under a minute on a loaded two-core machine; a lock older than this is a dead build's.
_STALE_LOCK_S = 300.0


def _cpu_features() -> str:
    """The CPU's architecture and, on Linux, its feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return f"{platform.machine()} {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@functools.cache
def _ops() -> Any:
    """``torch.ops.lightning_bagua_codec`` (an operator namespace) once built and loaded, else ``None``."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.debug("The codec's CPU kernels are turned off by %s=0.", DISABLE_ENV)
        return None
    name = _build_name()
    build_directory = _extensions_root() / name
    stamp, inputs = build_directory / f"{name}.built.json", _build_inputs_digest()
    if _load_built(stamp, inputs):
        return torch.ops.lightning_bagua_codec
    # Importing torch's extension tooling imports setuptools, a quarter of a second: only a build needs it.
    from torch.utils import cpp_extension

    try:
        build_directory.mkdir(parents=True, exist_ok=True)
        if _locks_by_existence(cpp_extension):
            _clear_stale_lock(build_directory / "lock")
        library = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=_FLAGS,
            build_directory=str(build_directory),
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as error:
        log.debug("The codec's CPU kernels could not be built or loaded (%s); using torch's ops.", error)
        return None
    _write_stamp(stamp, inputs, str(library))
    return torch.ops.lightning_bagua_codec


def _build_name() -> str:
    """The build's name: one per CPU and per source file, so that two checkouts never rebuild over each other."""
    digest = hashlib.sha256(f"{_cpu_features()}|{SOURCE.resolve()}".encode()).hexdigest()[:12]
    return f"lightning_bagua_codec_{digest}"


def _extensions_root() -> Path:
    """Where builds go: ``$TORCH_EXTENSIONS_DIR``, else a per-Python folder of ``~/.cache/torch_extensions``.

    The folder is named "cpu" whatever torch was built for (these are CPU kernels), and given to torch explicitly,
    so that the lock's path is known.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def _build_inputs_digest() -> str:
    """What a build depends on beyond its name: the source's bytes, the flags, torch's and Python's versions."""
    inputs = "|".join([*_FLAGS, torch.__version__, sys.version])
    return hashlib.sha256(SOURCE.read_bytes() + inputs.encode()).hexdigest()


def _load_built(stamp: Path, inputs: str) -> bool:
    """Load the library a build of these inputs recorded in ``stamp``, if there is one; whether it loaded.

    torch's loader runs ninja to check a build even when it is current, after importing its tooling: the stamp
    lets a process that finds its build current skip both.
    """
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    library = recorded.get("library") if isinstance(recorded, dict) else None
    if not isinstance(library, str) or recorded.get("inputs") != inputs:
        return False
    try:
        torch.ops.load_library(library)
    except (OSError, RuntimeError) as error:
        log.debug("The codec's recorded build %s did not load (%s); building it again.", library, error)
        return False
    return True


def _write_stamp(stamp: Path, inputs: str, library: str) -> None:
    """Record that ``library`` was built from ``inputs``: written whole, so a reader never sees half of it."""
    partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps({"inputs": inputs, "library": library}))
        os.replace(partial, stamp)
    except OSError as error:
        log.debug("The codec's build could not be recorded in %s (%s): the next process checks it again.", stamp, error)


def _locks_by_existence(cpp_extension: Any) -> bool:
    """Whether torch's loader locks a build by its lock file's existence (``FileBaton``, torch before 2.14).

    torch 2.14 holds an advisory lock (``filelock``) instead: its file outlives every build, and waiting for it to
    go would stall each process that reaches the loader until the file looks stale.
    """
    return hasattr(cpp_extension, "FileBaton")


def _clear_stale_lock(lock: Path) -> None:
    """Wait for a build another process holds; remove its lock when it is older than any build takes.

    torch's extension loader waits on this lock without a deadline, and a process killed while building leaves
    it behind: every later process would wait forever.
    """
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return  # released while we looked
        if age > _STALE_LOCK_S:
            log.warning(
                "Removing %s, left %.0f s ago by a build of the codec's CPU kernels that did not finish.", lock, age
            )
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call)."""
    return _ops() is not None


def kernels() -> Any:
    """The loaded operators; raises ``RuntimeError`` saying why when they cannot be built."""
    ops = _ops()
    if ops is None:
        raise RuntimeError(
            "The codec's 'native' backend needs a C++ compiler and ninja to build its kernels on first use"
            f" (torch.utils.cpp_extension), and {DISABLE_ENV} not 0. Install them, or use backend='torch' or 'auto'."
        )
    return ops


@torch.no_grad()
def compress(tensor: Tensor, num_chunks: int, length: int, eps: float, header_bytes: int) -> Tensor:
    """Encode the contiguous 1-D CPU ``tensor`` (``numel >= 1``) into ``(num_chunks, header_bytes + length)`` rows."""
    encoded = torch.empty((num_chunks, header_bytes + length), dtype=torch.uint8)
    kernels().compress(tensor.float(), num_chunks, length, eps, header_bytes, encoded)
    return encoded


@torch.no_grad()
def decode(encoded: Tensor, out: Tensor, numel: int, eps: float, header_bytes: int) -> None:
    """Decode the first ``numel`` elements of ``encoded`` (row-major, padding included) into the flat ``out``."""
    if out.dtype == torch.float32:
        kernels().decode(encoded, out, numel, eps, header_bytes, False)
        return
    decoded = torch.empty(numel, dtype=torch.float32)
    kernels().decode(encoded, decoded, numel, eps, header_bytes, False)
    out[:numel].copy_(decoded)


@torch.no_grad()
def decode_add(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out += decoded`` for the first ``out.numel()`` elements of ``encoded``, decoded in ``out``'s dtype."""
    if out.dtype == torch.float32:
        kernels().decode(encoded, out, out.numel(), eps, header_bytes, True)
        return
    # The reference adds values rounded to out's dtype first.
    decoded = torch.empty(out.numel(), dtype=out.dtype)
    decode(encoded, decoded, out.numel(), eps, header_bytes)
    out.add_(decoded)


@torch.no_grad()
def decode_sum(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out = row_0 + row_1 + ...`` (in this order, in float32) over the first ``out.numel()`` codes of every row."""
    kernels().decode_sum(encoded, out, eps, header_bytes)


@torch.no_grad()
def encode_segments(
    flat: Tensor, start: Tensor, real: Tensor, length: Tensor, offset: Tensor, eps: float, header_bytes: int,
    message: Tensor,
) -> None:  # fmt: skip
    """Write row ``r`` (header, then ``length[r]`` codes of ``flat[start[r]:]``) at byte ``offset[r]`` of ``message``.

    ``flat`` is contiguous float32; the index tensors are int64, one entry per row, and every ``real[r] >= 1``: the
    codes are those of ``real[r]`` elements, padded with the last one's code.
    """
    kernels().encode_segments(flat, start, real, length, offset, eps, header_bytes, message)


@torch.no_grad()
def decode_sum_segments(
    messages: Tensor, start: Tensor, real: Tensor, offset: Tensor, eps: float, header_bytes: int, out: Tensor
) -> None:
    """``out[start[r] : start[r] + real[r]]`` = row ``r``'s decoded codes summed over ``messages``' rows, in order.

    ``messages`` is ``(participants, bytes)`` uint8 with contiguous rows; row ``r`` of a message is at its byte
    ``offset[r]``; ``out`` is contiguous float32.
    """
    kernels().decode_sum_segments(messages, start, real, offset, eps, header_bytes, out)
