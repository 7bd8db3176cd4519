"""Fills the generated tables of the performance records from data/benchmarks/*.json.

Each record (docs/performance/<cpu-class>.md, its index README.md, and the repository's README.md) keeps its prose
by hand; a table drawn from a report sits between `<!-- generated: KIND SLUG -->` and `<!-- end generated -->`,
and this script rewrites what is between them. The output depends only on the JSON files: run it after a new
record (`.venv/bin/python docs/performance/build.py`); `--check` exits 1, naming the files, where one is stale.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "data" / "benchmarks"
RECORDS = Path(__file__).resolve().parent
BLOCK = re.compile(r"(<!-- generated: (?P<kind>[\w-]+)(?: (?P<slug>[\w-]+))? -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.S)

# The decode benchmark's formats, each beside the llama.cpp type that reads about as many bytes a weight.
FORMATS = [("fp32", "fp32", "F32"), ("bf16", "bf16", "BF16"), ("int8", "int8", "Q8_0"),
           ("int4", "int4, groups of 32", "Q4_0"), ("int4a8", "int4a8 (W4A8)", "Q4_0")]
WEIGHT_DTYPES = [("float32", "fp32"), ("bfloat16", "bf16"), ("int8", "int8"), ("int4", "int4"), ("int4a8", "W4A8")]
REAL_FORMATS = [("q4_1", "Q4_1 as stored"), ("f32", "F32"), ("bf16", "BF16")]
# The CPU classes in the order the records were made: the AVX2 EPYC first.
CLASSES = ["cpu-amd-epyc", "cpu-amd-epyc-zen4-avx512", "cpu-amd-epyc-zen5-avx512", "cpu-intel-xeon-avx512-amx"]
CLASS_NAMES = {"cpu-amd-epyc": "AMD EPYC, AVX2 (no AVX-512)", "cpu-amd-epyc-zen4-avx512": "AMD EPYC Zen 4, AVX-512",
               "cpu-amd-epyc-zen5-avx512": "AMD EPYC Zen 5, AVX-512", "cpu-intel-xeon-avx512-amx": "Intel Xeon, AVX-512 and AMX"}


def load(name: str) -> dict:
    """Returns one report of data/benchmarks/ as a dict."""
    return json.loads((BENCHMARKS / name).read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    """Returns a markdown table, one line a row, no blank line inside."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def ratio(value: float | None) -> str:
    """Returns a ratio as the records print it, e.g. 1.24×; a dash where the report has none."""
    return "—" if value is None else f"{value:.2f}×"


def ms(seconds: float) -> str:
    """Returns seconds as whole milliseconds."""
    return f"{seconds * 1e3:.0f}"


def decode_table(slug: str) -> str:
    """Returns decode by precision against llama.cpp (and transformers) from decode-<slug>.json."""
    report = load(f"decode-{slug}.json")
    contenders, ratios = report["contenders"], report["ratios"]
    rows = []
    for precision, label, peer_type in FORMATS:
        ours, peer = contenders[f"llminfer fast {precision}"], contenders[f"llama.cpp {peer_type}"]
        theirs = contenders.get(f"transformers {precision}")
        rows.append([label, f"{ours['tokens_per_s']:.1f}", f"{ours['mbu']:.2f}",
                     f"{peer_type} {peer['tokens_per_s']:.1f} ({peer['mbu']:.2f})",
                     ratio(ratios[f"{precision} / llama.cpp {peer_type}"]),
                     f"{ms(ours['ttft_median_s'])} / {ms(peer['ttft_median_s'])} ms",
                     ratio(ratios.get(f"prefill {precision} / llama.cpp {peer_type}")),
                     f"{theirs['tokens_per_s']:.1f}" if theirs else "—",
                     ratio(ratios.get(f"{precision} / transformers {precision}"))])
    return table(["precision", "llminfer fast, tokens/s", "MBU", "llama.cpp, tokens/s (MBU)", "ratio",
                  "TTFT, llminfer / llama.cpp", "prefill ratio", "transformers, tokens/s", "ratio"], rows)


def prefill_table(slug: str) -> str:
    """Returns the 128-token prefill by path (ms, MFU in brackets) from decode-<slug>.json."""
    by_precision = load(f"decode-{slug}.json")["prefill"]["by_precision"]
    rows = []
    for precision, _, _ in FORMATS:
        run = by_precision[precision]
        rows.append([precision, f"{run['measured_path']} {ms(run['chosen_s'])} ({run['chosen_mfu']:.2f})"]
                    + [f"{ms(run[f'{path}_s'])} ({run[f'{path}_mfu']:.2f})" for path in ("blocked", "torch", "plain")]
                    + [ratio(run["chosen_over_plain"])])
    return table(["precision", "chosen path", "blocked", "torch's matmul", "the plain model", "plain / chosen"], rows)


def loops_table(slug: str) -> str:
    """Returns each format's decode loops as timed on its own decode steps (ms, the chosen one in bold)."""
    matvec = load(f"decode-{slug}.json")["kernels"].get("matvec")
    if not matvec:
        return "This record predates the decode loops' timing in the report.\n"
    rows = []
    for dtype, label in WEIGHT_DTYPES:
        loops = matvec[dtype]
        cells = [f"**{level} {seconds * 1e3:.1f}**" if level == loops["level"] else f"{level} {seconds * 1e3:.1f}"
                 for level, seconds in loops["median_s"].items()]
        rows.append([label, ", ".join(cells)])
    return table(["format", "decode loops, ms for the steps of one generation (chosen in bold)"], rows)


def agreement(rounds: list[dict], new_tokens: int) -> str:
    """Returns how many greedy tokens llminfer and llama.cpp shared, over the rounds."""
    if all(entry["same"] for entry in rounds):
        return f"all {new_tokens}, every round"
    prefixes = sorted({entry["common_prefix"] for entry in rounds})
    if len(prefixes) == 1:
        return f"the first {prefixes[0]} in every round"
    return f"the first {prefixes[0]}–{prefixes[-1]}"


def real_table(slug: str) -> str:
    """Returns the real model's own GGUF file against llama.cpp from decode-real-<slug>.json."""
    report = load(f"decode-real-{slug}.json")
    contenders, new_tokens = report["contenders"], report["settings"]["new_tokens"]
    rows = []
    for fmt, label in REAL_FORMATS:
        ours, peer = contenders[f"llminfer {fmt}"], contenders[f"llama.cpp {fmt}"]
        rows.append([label, f"{ours['tokens_per_s']:.1f} ({ours['mbu']:.2f})",
                     f"{peer['tokens_per_s']:.1f} ({peer['mbu']:.2f})",
                     ratio(report["ratios"][f"llminfer {fmt} / llama.cpp {fmt}"]),
                     agreement(report["token_agreement"][fmt], new_tokens)])
    return table(["format", "llminfer, tokens/s (MBU)", "llama.cpp, tokens/s (MBU)", "ratio", "same tokens?"], rows)


def ceilings_table(slug: str) -> str:
    """Returns the ceilings, decode contenders and targets of the prefill/decode report <slug>.json."""
    report = load(f"{slug}.json")
    ceilings = report["ceilings"]
    first = table(["ceiling, measured in the run", "median"], [
        [f"copy bandwidth ({ceilings['copy_bandwidth']['what']}, bytes read + written)",
         f"{ceilings['copy_bandwidth']['rate'] / 1e9:.1f} GB/s"],
        [f"matrix-vector bandwidth ({ceilings['matvec_bandwidth']['what']})",
         f"{ceilings['matvec_bandwidth']['rate'] / 1e9:.1f} GB/s"],
        [f"matmul rate ({ceilings['matmul_flops']['what']})", f"{ceilings['matmul_flops']['rate'] / 1e9:.0f} GFLOP/s"]])
    names = [("llminfer (cache)", "llminfer, KV cache"), ("transformers (cache)", "transformers `generate`, with its cache"),
             ("llminfer (no cache)", "llminfer, no cache (recompute)"),
             ("transformers (no cache)", "transformers `generate`, no cache")]
    second = table(["decode, batch 1, same weights", "tokens/s", "ms per token"],
                   [[label, f"{report['contenders'][key]['tokens_per_s']:.1f}",
                     ms(report['contenders'][key]['token_s'])] for key, label in names])
    third = table(["figure", "measured", "target"],
                  [[target["figure"], f"**{target['value']:.2f}**",
                    f"≥ {target['target']} ({'met' if target['met'] else 'missed'})"] for target in report["targets"]])
    return "\n".join([first, second, third])


def recompute_table(slug: str) -> str:
    """Returns one new token's time with the cache against recomputation, by context, from <slug>.json."""
    def secs(value: float) -> str:
        return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"

    rows = [[str(point["context_len"]), secs(point["cached_s"]), secs(point["recompute_s"]),
             f"{point['speedup']:.1f}×", f"{point['flop_speedup']:.0f}×", f"{point['roofline_speedup']:.1f}×"]
            for point in load(f"{slug}.json")["scaling"]]
    return table(["context", "with cache", "recompute", "speedup", "FLOP ratio", "roofline prediction"], rows)


def engine_table(slug: str) -> str:
    """Returns the batching policies' throughput and the engine's decode against one request, from engine-*.json."""
    policies = load(f"engine-{slug}.json")
    engine = load(f"engine-decode-{slug}.json")
    rows = [[f"{name} batching", f"{value:.0f} tokens/s"] for name, value in policies["median_throughput_tok_s"].items()]
    rows += [["continuous over sequential / over static",
              f"{policies['ratios']['continuous_over_sequential']:.2f}× / {policies['ratios']['continuous_over_static']:.2f}×"],
             [f"the engine decoding {engine['settings']['requests']} requests ({engine['engine_kernel']} kernels) / one "
              "fast request", f"{engine['engine_tokens_per_s']:.1f} / {engine['single_tokens_per_s']:.1f} tokens/s "
                              f"({engine['ratio']:.2f}×)"]]
    return table(["engine (chapters 05–06)", "measured"], rows)


def serve_table(slug: str) -> str:
    """Returns llminfer's server beside vLLM's by dtype and concurrency, from serve-vs-vllm-<slug>.json."""
    report = load(f"serve-vs-vllm-{slug}.json")
    rows = []
    for dtype, label in (("float32", "fp32"), ("bfloat16", "bf16")):
        for level in report["settings"]["concurrency"]:
            ours, theirs = (report["points"][server][dtype][str(level)] for server in ("llminfer", "vllm"))
            rows.append([label, str(level), f"{ours['output_throughput']:.1f}", f"{theirs['output_throughput']:.1f}",
                         ratio(report["ratios"][dtype][str(level)]["output_throughput"])]
                        + [f"{ms(point['ttft_p50_s'])} ({ms(point['ttft_p90_s'])}) ms" for point in (ours, theirs)]
                        + [f"{point['tpot_p50_s'] * 1e3:.1f} ms" for point in (ours, theirs)])
    return table(["dtype", "concurrency", "llminfer tok/s", "vLLM tok/s", "ratio", "TTFT p50 (p90), llminfer", "vLLM",
                  "TPOT p50, llminfer", "vLLM"], rows)


def glance_table(_slug: str | None = None, link_prefix: str = "docs/performance/") -> str:
    """Returns one row per CPU class: decode and prefill against llama.cpp, and the real file's Q4_1, with links."""
    rows = []
    for slug in CLASSES:
        ratios = load(f"decode-{slug}.json")["ratios"]
        real = load(f"decode-real-{slug}.json")["ratios"]["llminfer q4_1 / llama.cpp q4_1"]
        decode = " / ".join(ratio(ratios[f"{p} / llama.cpp {t}"]) for p, _, t in FORMATS)
        prefill = " / ".join(ratio(ratios.get(f"prefill {p} / llama.cpp {t}")) for p, _, t in FORMATS[:2])
        rows.append([f"[{CLASS_NAMES[slug]}]({link_prefix}{slug}.md)", decode, prefill, ratio(real)])
    return table(["CPU class (2 cores)", "decode vs llama.cpp: fp32 / bf16 / int8 / int4 / W4A8",
                  "prefill vs llama.cpp: fp32 / bf16", "real file, Q4_1"], rows)


GENERATORS = {"decode": decode_table, "prefill": prefill_table, "loops": loops_table, "real": real_table,
              "ceilings": ceilings_table, "recompute": recompute_table, "engine": engine_table, "serve": serve_table}


def render(text: str, link_prefix: str) -> str:
    """Returns the text with every generated block rewritten from the reports."""
    def fill(match: re.Match) -> str:
        kind, slug = match["kind"], match["slug"]
        if kind == "glance":
            body = glance_table(link_prefix=link_prefix)
        elif kind in GENERATORS:
            body = GENERATORS[kind](slug)
        else:
            raise SystemExit(f"unknown generated block {kind!r}; known: glance, {', '.join(GENERATORS)}")
        return match.group(1) + body + match.group(5)
    return BLOCK.sub(fill, text)


def targets() -> list[tuple[Path, str]]:
    """Returns the files that hold generated blocks, each with the prefix its links to the records take."""
    files = [(path, "") for path in sorted(RECORDS.glob("*.md"))]
    return files + [(REPO_ROOT / "README.md", "docs/performance/")]


def main(argv: list[str] | None = None) -> int:
    """Rewrites (or with --check, compares) every generated block; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, prefix in targets():
        text = path.read_text()
        new = render(text, prefix)
        if new != text:
            stale.append(path.relative_to(REPO_ROOT).as_posix())
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run .venv/bin/python docs/performance/build.py", file=sys.stderr)
        return 1
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
