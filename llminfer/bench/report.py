"""The report of every `python -m llminfer.bench` subcommand: the machine, the load, and one writer. Chapter 04.

    machine(device)       the processor (model, class, flags, cores) or GPU, memory, versions: one description
    device_slug(device)   the file name stem of a machine's records, e.g. 'cpu-amd-epyc-zen4-avx512'
    load_average()        the 1, 5 and 15 minute load averages
    publish(report, folder, stem, table=, plot=)   prints the table, writes <stem>.json (and <stem>.png)

Machines differ by more than most effects measured here, so every report names the CPU, its flags and the load.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from ..device import cpu_capabilities, cpu_slug, free_memory_bytes

__all__ = ["load_average", "machine", "device_slug", "llama_cpp_version", "finite", "publish"]


def load_average() -> list[float] | None:
    """Returns the 1, 5 and 15 minute load averages (None where the OS does not say). Chapter 04."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(device: torch.device | str = "cpu") -> dict:
    """Returns a description of the machine: processor (model, class, vector flags, cores) or GPU, memory,
    versions; from `llminfer.device.cpu_capabilities`, the one reader of the CPU. Chapter 04."""
    device = torch.device(device)
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    cpu = cpu_capabilities()
    info = {"cpu": cpu.model, "cpu_microarchitecture": cpu.microarchitecture, "cpu_family": cpu.family,
            "cpu_model_number": cpu.model_number, "cpu_isa": cpu.isa_level, "cpu_vector_flags": cpu.vector_flags(),
            "cpu_class": cpu_slug(cpu), "cpu_cores": os.cpu_count(), "cpu_physical_cores": cpu.physical_cores,
            "torch_threads": torch.get_num_threads(),
            "memory_available_gib": round(free_memory_bytes("cpu") / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers_version,
            "llminfer": __version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def device_slug(device: torch.device | str = "cpu") -> str:
    """Returns the file name stem for device: e.g. 'nvidia-h200', or the CPU's class ('cpu-amd-epyc-zen4-avx512',
    from `llminfer.device.cpu_slug`). Chapter 04."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_slug(cpu_capabilities())
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def llama_cpp_version() -> str | None:
    """The llama.cpp peer's version and build options (`llama_peer.build_note`), None where it is absent."""
    from .llama_peer import build_note

    return build_note()


def finite(value):
    """Returns value with every NaN and infinity as None, so that its JSON is standard. Chapter 04."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def publish(report: dict, folder: str | Path, stem: str, table: Callable[[dict], str] | None = None,
            plot: Callable[[dict], object] | None = None, stream=None) -> list[Path]:
    """Prints table(report), writes <folder>/<stem>.json and, with plot (report -> a matplotlib Figure),
    <stem>.png beside it; returns the paths written. The one report writer of the benchmarks. Chapter 04."""
    stream = stream or sys.stdout
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if table is not None:
        print(table(report), file=stream)
    json_path = folder / f"{stem}.json"
    json_path.write_text(json.dumps(finite(report), indent=1, default=str, ensure_ascii=False) + "\n")
    paths = [json_path]
    if plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = plot(report)
        paths.append(folder / f"{stem}.png")
        figure.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(figure)
    if table is not None:
        print(f"\nwrote {' and '.join(str(p) for p in paths)}", file=stream)
    return paths
