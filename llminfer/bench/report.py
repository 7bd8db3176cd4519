"""The benchmark's report: the machine, the JSON, the terminal table and the plot. Chapter 04."""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from .. import __version__
from ..device import cpu_capabilities, cpu_slug, free_memory_bytes
from .figures import paired_ratio, utilisation

__all__ = ["load_average", "machine", "device_slug", "assemble", "table", "plot", "write", "TARGETS"]

WEIGHTS_NOTE = ("The weights are random (N(0, 0.02^2), seeded), not a trained checkpoint: no weights can be "
                "downloaded here, and none are needed, because every kernel does the same work whatever the values "
                "are (dense matmuls, a fixed number of tokens: greedy decoding runs exactly new_tokens steps, EOS "
                "is not used). Timing depends on the shape, the dtype and the lengths only.")

# (figure, target, device type, dtype): the goals the benchmark is judged by.
TARGETS = [
    ("decode tokens/s, llminfer (cache) / transformers (cache)", 1.2, "cpu", "float32"),
    ("decode MBU vs matvec bandwidth", 0.8, "cpu", "float32"),
    ("prefill MFU vs matmul rate", 0.7, "cpu", "float32"),
    ("decode tokens/s, llminfer (CUDA graphs) / transformers (cache)", 1.5, "cuda", "bfloat16"),
    ("decode MBU vs copy bandwidth, llminfer (CUDA graphs)", 0.6, "cuda", "bfloat16"),
]


def load_average() -> list[float] | None:
    """Returns the 1, 5 and 15 minute load averages (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(device: torch.device) -> dict:
    """Returns a description of the machine: processor or GPU, cores, memory, versions."""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    cpu = cpu_capabilities()
    info = {"cpu": cpu.model, "cpu_microarchitecture": cpu.microarchitecture, "cpu_family": cpu.family,
            "cpu_model_number": cpu.model_number, "cpu_isa": cpu.isa_level, "cpu_vector_flags": cpu.vector_flags(),
            "cpu_cores": os.cpu_count(), "cpu_physical_cores": cpu.physical_cores,
            "torch_threads": torch.get_num_threads(),
            "memory_available_gib": round(free_memory_bytes("cpu") / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers_version,
            "llminfer": __version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def device_slug(device: torch.device) -> str:
    """Returns the file name stem for device: e.g. 'nvidia-h200', or the CPU's class ('cpu-amd-epyc-zen4-avx512',
    from `llminfer.device.cpu_slug`)."""
    if device.type != "cuda":
        return cpu_slug(cpu_capabilities())
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def _ratio(contenders: dict, mine: str, theirs: str) -> dict | None:
    if mine not in contenders or theirs not in contenders:
        return None
    # each repeat ran both contenders back to back: their ratio compares like with like on a busy machine
    return paired_ratio(contenders[mine]["repeat_medians_s"], contenders[theirs]["repeat_medians_s"])


def assemble(*, settings, device, dtype, cfg, ceilings, prefill, contenders, decode, scaling, hf_note,
             elapsed_s, load_before) -> dict:
    """Returns the JSON-ready report, the ratios and the verdict on each target."""
    dtype_name = str(dtype).removeprefix("torch.")
    for entry in contenders.values():
        entry["repeat_medians_s"] = [round(x, 6) for x in entry["repeat_medians_s"]]
    ratios = {
        "decode_vs_transformers_cache": _ratio(contenders, "llminfer (cache)", "transformers (cache)"),
        "decode_vs_transformers_no_cache": _ratio(contenders, "llminfer (cache)", "transformers (no cache)"),
        "cache_vs_no_cache": _ratio(contenders, "llminfer (cache)", "llminfer (no cache)"),
        "graphs_vs_transformers_cache": _ratio(contenders, "llminfer (CUDA graphs)", "transformers (cache)"),
    }
    graphs = contenders.get("llminfer (CUDA graphs)")
    graph_mbu = None
    if graphs:
        graph_mbu = utilisation(decode[0]["bytes_per_step"] / graphs["token_s"], ceilings["copy_bandwidth"].rate,
                                "CUDA-graph decode MBU against the copy bandwidth")
    values = [(ratios["decode_vs_transformers_cache"] or {}).get("paired_median"), decode[0]["mbu_matvec"],
              prefill["mfu"], (ratios["graphs_vs_transformers_cache"] or {}).get("paired_median"), graph_mbu]
    targets = []
    for (name, goal, device_type, target_dtype), value in zip(TARGETS, values):
        if device_type == device.type and target_dtype == dtype_name:
            targets.append({"figure": name, "target": goal, "value": value,
                            "met": None if value is None else bool(value >= goal)})
    slim = {name: {k: v for k, v in entry.items() if k not in ("latencies_s", "token_ids")}
            for name, entry in contenders.items()}
    same = None
    if "transformers (cache)" in contenders:
        same = contenders["transformers (cache)"]["token_ids"] == contenders["llminfer (cache)"]["token_ids"]
    return {
        "schema": 1, "device_name": device_slug(device), "machine": machine(device),
        "shape": {"name": settings.shape or ("llama-3.2-1b" if device.type == "cuda" else "smollm2-135m"),
                  "n_params": cfg.n_params(), **{k: getattr(cfg, k) for k in (
                      "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim",
                      "tie_embeddings")}},
        "dtype": dtype_name, "weights": WEIGHTS_NOTE,
        "settings": {key: value for key, value in asdict(settings).items() if key != "out"},
        "ceilings": {name: ceiling.as_dict() for name, ceiling in ceilings.items()},
        "prefill": prefill, "decode": decode, "contenders": slim, "ratios": ratios, "scaling": scaling,
        "targets": targets, "transformers": hf_note, "same_greedy_tokens_as_transformers": same,
        "llminfer_weight_layout": ("decode: wide weights column-major (Transformer.use_decode_layout)"
                                   if settings.decode_layout and device.type == "cpu" else "row-major, as loaded"),
        "contention": {"load_average_before": load_before, "load_average_after": load_average(),
                       "cpu_cores": os.cpu_count()},
        "elapsed_s": elapsed_s,
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def table(report: dict) -> str:
    """Returns the report as a plain-text table for the terminal."""
    ceilings, prefill = report["ceilings"], report["prefill"]
    who = report["machine"].get("gpu") or f"{report['machine']['cpu']} ({report['machine']['torch_threads']} threads)"
    lines = [f"llminfer bench: {report['shape']['name']} shape, {report['dtype']}, on {who}",
             f"load average before/after: {report['contention']['load_average_before']} / "
             f"{report['contention']['load_average_after']}; llminfer weights: {report['llminfer_weight_layout']}", "",
             "ceiling                 rate        measured on",
             f"copy bandwidth      {_si(ceilings['copy_bandwidth']['rate'], 'B/s'):>12}   "
             f"{ceilings['copy_bandwidth']['what']}",
             f"matvec bandwidth    {_si(ceilings['matvec_bandwidth']['rate'], 'B/s'):>12}   "
             f"{ceilings['matvec_bandwidth']['what']}",
             f"matmul rate         {_si(ceilings['matmul_flops']['rate'], 'FLOP/s'):>12}   "
             f"{ceilings['matmul_flops']['what']}", "",
             f"prefill of {prefill['prompt_len']} tokens: {prefill['tokens_per_s']:.0f} tokens/s, "
             f"{_si(prefill['flop_per_s'], 'FLOP/s')}, MFU {prefill['mfu']:.2f} of the matmul rate measured alongside "
             f"({prefill['mfu_vs_run_ceiling']:.2f} of the run's median)", "",
             "decode contender            tokens/s   ms/token   TTFT ms   tokens"]
    for name, entry in report["contenders"].items():
        lines.append(f"{name:<26} {entry['tokens_per_s']:>9.1f} {1e3 * entry['token_s']:>10.1f} "
                     f"{1e3 * entry['ttft_median_s']:>9.1f} {entry['new_tokens']:>8}")
    lines += ["", "batch   tokens/s   bytes/token   MBU (matvec alongside)   MBU (matvec, run)   MBU (copy, run)"]
    for row in report["decode"]:
        lines.append(f"{row['batch_size']:>5} {row['tokens_per_s']:>10.1f} {_si(row['bytes_per_token'], 'B'):>13} "
                     f"{row['mbu_matvec']:>24.2f} {row['mbu_matvec_vs_run_ceiling']:>19.2f} {row['mbu_copy']:>17.2f}")
    lines += ["", "context   cached ms   recompute ms   speedup   FLOP prediction   roofline prediction"]
    for row in report["scaling"]:
        lines.append(f"{row['context_len']:>7} {1e3 * row['cached_s']:>11.1f} {1e3 * row['recompute_s']:>14.1f} "
                     f"{row['speedup']:>9.1f} {row['flop_speedup']:>17.1f} {row['roofline_speedup']:>21.1f}")
    lines += ["", "target                                                        value   goal   met"]
    for target in report["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:.2f}"
        lines.append(f"{target['figure']:<60} {value:>7} {target['target']:>6}   {target['met']}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    """Draws contenders, the batch sweep and the context scaling into one PNG; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_b, ax_s) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(report["contenders"])
    speeds = [report["contenders"][n]["tokens_per_s"] for n in names]
    ax_c.barh(names, speeds, color=["tab:blue" if n.startswith("llminfer") else "tab:gray" for n in names])
    ax_c.set_xlabel("decode tokens/s (batch 1, median)")
    ax_c.invert_yaxis()
    batches = [row["batch_size"] for row in report["decode"]]
    ax_b.plot(batches, [row["tokens_per_s"] for row in report["decode"]], "o-", label="tokens/s")
    ax_b.set_xscale("log", base=2)
    ax_b.set_xlabel("batch size")
    ax_b.set_ylabel("decode tokens/s")
    twin = ax_b.twinx()
    twin.plot(batches, [row["mbu_matvec"] for row in report["decode"]], "s--", color="tab:orange")
    twin.set_ylabel("MBU (of matvec bandwidth)", color="tab:orange")
    twin.set_ylim(0, 1.1)
    contexts = [row["context_len"] for row in report["scaling"]]
    ax_s.plot(contexts, [1e3 * r["cached_s"] for r in report["scaling"]], "o-", label="with cache")
    ax_s.plot(contexts, [1e3 * r["recompute_s"] for r in report["scaling"]], "o-", label="recompute")
    ax_s.plot(contexts, [1e3 * r["cached_s"] * r["flop_speedup"] for r in report["scaling"]], ":",
              color="tab:orange", label="cached x FLOP ratio")
    ax_s.set_xscale("log", base=2)
    ax_s.set_yscale("log")
    ax_s.set_xlabel("context length (tokens)")
    ax_s.set_ylabel("ms per new token")
    ax_s.legend(fontsize=8)
    who = report["machine"].get("gpu") or report["machine"]["cpu"]
    fig.suptitle(f"llminfer bench: {report['shape']['name']} shape, {report['dtype']}, {who}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report: dict, folder: Path) -> tuple[Path, Path]:
    """Writes <folder>/<device-name>.json and .png; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{report['device_name']}.json"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return json_path, plot(report, folder / f"{report['device_name']}.png")
