"""The one CPU-capabilities reader (`llminfer.device`): the classes of CPU the benchmarks have run on, read from
/proc/cpuinfo texts in tests/fixtures/cpuinfo (written for these tests in Linux's format, with the flags each
class of CPU reports), and the kernels and reports asking it rather than the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llminfer import device
from llminfer.device import parse_cpuinfo

FIXTURES = Path(__file__).parents[1] / "fixtures" / "cpuinfo"


def fixture(name: str):
    return parse_cpuinfo((FIXTURES / f"{name}.txt").read_text())


@pytest.mark.parametrize("name, model, isa, logical, physical, bf16", [
    ("amd_epyc_avx2", "AMD EPYC", "avx2", 2, 2, False),
    ("amd_zen4_avx512_bf16", "AMD EPYC 9R14", "avx512_bf16", 2, 1, True),
    ("intel_xeon_avx512_bf16_vnni", "Intel(R) Xeon(R) Platinum 8380H CPU @ 2.90GHz", "avx512_bf16", 4, 2, True),
    ("intel_xeon_amx", "Intel(R) Xeon(R) Platinum 8488C", "amx", 4, 2, True),
    ("amd_zen5_avx512_bf16_avx_vnni", "AMD EPYC", "avx512_bf16", 2, 2, True),
])
def test_each_cpu_class_is_read_from_its_cpuinfo(name, model, isa, logical, physical, bf16):
    cpu = fixture(name)
    assert cpu.model == model and cpu.isa_level == isa
    assert cpu.logical_cpus == logical and cpu.physical_cores == physical
    assert cpu.bfloat16_in_hardware is bf16
    assert {"avx2", "fma"} <= cpu.flags and "bugs" not in cpu.flags and "spectre_v1" not in cpu.flags


def test_the_avx2_epyc_has_no_avx512_and_the_zen4_no_amx():
    epyc, zen4, cooper, sapphire = (fixture(n) for n in ("amd_epyc_avx2", "amd_zen4_avx512_bf16",
                                                         "intel_xeon_avx512_bf16_vnni", "intel_xeon_amx"))
    assert epyc.vector_flags() == ["avx", "avx2", "f16c", "fma"]
    assert "avx512f" in zen4.flags and "avx512_vnni" in zen4.flags and not zen4.flags & {"amx_tile", "amx_bf16"}
    assert "avx512_vnni" in cooper.flags and "amx_tile" not in cooper.flags
    assert {"amx_bf16", "amx_tile", "amx_int8"} <= set(sapphire.vector_flags())
    # the levels are ordered: each class sits where its flags put it
    order = [name for name, _ in device.ISA_LEVELS]
    assert [order.index(c.isa_level) for c in (epyc, zen4, sapphire)] == sorted(
        order.index(c.isa_level) for c in (epyc, zen4, sapphire))


@pytest.mark.parametrize("name, core, slug", [
    ("amd_epyc_avx2", "zen3", "cpu-amd-epyc-zen3"),                       # family 25, model 1
    ("amd_zen4_avx512_bf16", "zen4", "cpu-amd-epyc-9r14-zen4-avx512"),    # family 25, model 17
    ("amd_zen5_avx512_bf16_avx_vnni", "zen5", "cpu-amd-epyc-zen5-avx512"),  # family 26
    ("intel_xeon_amx", "sapphirerapids", "cpu-intel-xeon-platinum-8488c-sapphirerapids-avx512-amx"),
    ("intel_xeon_avx512_bf16_vnni", None, "cpu-intel-xeon-platinum-8380h-avx512"),  # model 85: by stepping
    ("arm_neoverse", None, "cpu-unknown"),
])
def test_a_report_is_named_by_the_cpus_class_its_name_core_and_width(name, core, slug):
    cpu = fixture(name)
    assert cpu.microarchitecture == core and device.cpu_slug(cpu) == slug
    assert json.loads(json.dumps(cpu.as_dict()))["microarchitecture"] == core


def test_parts_sold_under_one_name_get_different_files():
    def cpu(family, model, flags="avx2 fma"):
        return parse_cpuinfo(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\n"
                             f"model\t\t: {model}\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n")

    avx512 = "avx2 fma avx512f"
    slugs = [device.cpu_slug(c) for c in (cpu(23, 49), cpu(25, 1), cpu(25, 17, avx512), cpu(25, 0xA0, avx512),
                                          cpu(26, 2, avx512), cpu(27, 0))]
    assert slugs == ["cpu-amd-epyc-zen2", "cpu-amd-epyc-zen3", "cpu-amd-epyc-zen4-avx512",
                     "cpu-amd-epyc-zen4-avx512", "cpu-amd-epyc-zen5-avx512", "cpu-amd-epyc"]
    # the width alone still parts a CPU the table does not know
    assert device.cpu_slug(cpu(27, 0, avx512)) == "cpu-amd-epyc-avx512"
    # a name that already says the core gets it once
    named = parse_cpuinfo("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD Zen5 "
                          "test\nflags\t\t: avx2 fma\n")
    assert device.cpu_slug(named) == "cpu-amd-zen5-test"
    # a Xeon whose model number names no core (as a hypervisor may report it): parted by its AMX tiles
    def xeon(flags):
        return parse_cpuinfo("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel(R) "
                             f"Xeon(R) Processor\nflags\t\t: {flags}\n")

    assert [device.cpu_slug(xeon(f)) for f in (avx512, avx512 + " amx_tile amx_bf16")] == [
        "cpu-intel-xeon-avx512", "cpu-intel-xeon-avx512-amx"]


@pytest.mark.parametrize("flags, isa", [
    ("sse4_2 avx", "portable"),
    ("avx avx2", "portable"),                            # the vector loops need FMA too
    ("avx avx2 fma", "avx2"),
    ("avx2 fma avx512f avx512bw", "avx512"),
    ("avx2 fma avx512f avx512_vnni", "avx512_vnni"),     # a Cascade Lake: int8 dot products, no bfloat16
    ("avx2 fma avx512f avx512_vnni avx512_bf16", "avx512_bf16"),
    ("avx2 fma avx512f avx512_bf16 amx_tile amx_bf16", "amx"),
    ("avx2 fma avx512f amx_tile", "avx512"),             # AMX tiles without their bfloat16 instructions
])
def test_the_isa_level_is_the_highest_whose_flags_are_all_there(flags, isa):
    cpu = parse_cpuinfo(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n")
    assert cpu.isa_level == isa


def test_a_cpuinfo_without_x86_fields_gives_the_fallbacks():
    arm = parse_cpuinfo((FIXTURES / "arm_neoverse.txt").read_text(), fallback_model="aarch64")
    assert arm.model == "aarch64" and arm.flags == frozenset() and arm.isa_level == "portable"
    assert arm.logical_cpus == arm.physical_cores == 2 and not arm.bfloat16_in_hardware
    empty = parse_cpuinfo("", fallback_model="unknown", fallback_cpus=3)
    assert (empty.model, empty.logical_cpus, empty.physical_cores, empty.isa_level) == ("unknown", 3, 3, "portable")


def test_as_dict_is_json():
    cpu = fixture("intel_xeon_amx")
    data = json.loads(json.dumps(cpu.as_dict()))
    assert data["isa_level"] == "amx" and data["model"] == cpu.model and data["physical_cores"] == 2
    assert data["vector_flags"] == sorted(data["vector_flags"]) and "sse2" not in data["vector_flags"]


def test_this_machine_is_read_once_and_the_kernels_and_reports_ask_the_same_reader():
    from llminfer.bench import report
    from llminfer import cpu as cpu_kernels

    here = device.cpu_capabilities()
    assert device.cpu_capabilities() is here                       # read once
    assert here.logical_cpus >= 1 and here.physical_cores >= 1 and here.model
    assert cpu_kernels.choose_isa().level == here.isa_level or here.isa_level == "avx_vnni"   # the kernels' table
    machine = report.machine(torch.device("cpu"))
    assert machine["cpu"] == here.model and machine["cpu_isa"] == here.isa_level
    assert set(machine["cpu_vector_flags"]) <= here.flags            # every benchmark's one description


def test_a_machine_is_reported_as_its_cpuinfo_says(monkeypatch):
    from llminfer.bench import report

    monkeypatch.setattr(report, "cpu_capabilities", lambda: fixture("intel_xeon_amx"))
    assert report.machine(torch.device("cpu"))["cpu_isa"] == "amx"
    assert report.device_slug(torch.device("cpu")) == "cpu-intel-xeon-platinum-8488c-sapphirerapids-avx512-amx"
    flags = report.machine("cpu")["cpu_vector_flags"]
    assert {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "f16c"} <= set(flags)


def _cache_tree(root: Path, caches: dict[str, tuple[str, str]]) -> str:
    """A directory laid out as Linux's /sys/devices/system/cpu/cpu0/cache: index* folders with level and size."""
    for name, (level, size) in caches.items():
        (root / name).mkdir(parents=True)
        (root / name / "level").write_text(level + "\n")
        (root / name / "size").write_text(size + "\n")
    return str(root)


def test_last_level_cache_is_the_highest_levels_size(tmp_path):
    tree = _cache_tree(tmp_path, {"index0": ("1", "32K"), "index1": ("1", "32K"), "index2": ("2", "1024K"),
                                  "index3": ("3", "32768K")})
    assert device.last_level_cache_bytes(tree) == 32 << 20
    bigger = _cache_tree(tmp_path / "b", {"index0": ("2", "2M"), "index1": ("3", "105M"), "uevent": ("1", "9K")})
    assert device.last_level_cache_bytes(bigger) == 105 << 20
    # unreadable or odd entries are passed over; no cache files at all gives 0
    odd = _cache_tree(tmp_path / "c", {"index0": ("2", "512K"), "index1": ("x", "8M"), "index2": ("3", "lots")})
    assert device.last_level_cache_bytes(odd) == 512 << 10
    assert device.last_level_cache_bytes(str(tmp_path / "missing")) == 0


def test_last_level_cache_agrees_with_lscpu():
    """util-linux's lscpu reads the same files with its own parser (glibc's getconf is no reference: on a Zen 4
    guest it reports ten times the 32 MiB L3 that lscpu and the files give)."""
    import shutil
    import subprocess

    here = device.last_level_cache_bytes()
    lscpu = shutil.which("lscpu")
    if not Path("/sys/devices/system/cpu/cpu0/cache").is_dir() or lscpu is None:
        assert here >= 0                    # not Linux, or no lscpu: whatever the files give, never an error
        return
    out = subprocess.run([lscpu, "-B", "-C=LEVEL,ONE-SIZE"], capture_output=True, text=True).stdout.split("\n")[1:]
    rows = [tuple(int(v) for v in line.split()) for line in out if line.split() and line.split()[0].isdigit()]
    assert rows, "lscpu lists no caches on a Linux machine with cache files"
    assert here == max(rows)[1] > 0


@pytest.mark.parametrize("name, extra", [("intel_xeon_amx", False), ("intel_xeon_avx512_bf16_vnni", True),
                                         ("amd_zen4_avx512_bf16", True), ("amd_epyc_avx2", True)])
def test_llama_cpp_keeps_its_extra_buffers_except_on_an_amx_cpu_it_was_not_built_for(name, extra):
    """llama-cpp-python 0.3.36's AMX buffers crash in its first quantized decode on an AMX Xeon: a build of unknown
    options runs its plain CPU loops there; the peer's own build (AMX compiled out) and every other CPU keep the
    repacked layouts. The real /proc/cpuinfo of each class decides."""
    from llminfer.bench import llama_peer

    flags = fixture(name).flags
    assert llama_peer.extra_buffers(flags, None) is extra
    assert llama_peer.extra_buffers(flags, {"cmake_args": llama_peer.cmake_args(flags)}) is True
