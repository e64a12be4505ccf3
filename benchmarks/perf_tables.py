"""The number tables of docs/PERFORMANCE.md, written from the committed benchmark JSON.

    python -m benchmarks.perf_tables [--out_dir results/perf/tables]

Times nothing: every table reads JSON files in results/perf that a benchmark script printed
(``benchmarks.bench``: ``variants -> <variant> -> programs -> <program> -> median_s, mfu,
memory, ...``; ``torch_reference``, ``attention_core`` and ``diag_overhead`` their own records;
a file of several runs keeps each under a key). ``TABLES`` declares each table once: its name,
the files it reads, its rows (a label and the key its cells look up) and its columns (a title
and a function of the loaded files and the row's key). Writes ``<name>.md`` per table;
docs/PERFORMANCE.md includes each verbatim.
"""

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

from absl import app, flags

from postnorm.files import make_output_dir, write_bytes_atomic

PERF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "results", "perf")


Files = dict[str, Any]  # file name in results/perf -> its JSON
Cell = Callable[[Files, Any], str]  # (the table's files, a row's key) -> the cell's text


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    files: tuple[str, ...]  # the JSON files in results/perf its cells read (and see)
    label: str  # the title of the row labels' column
    rows: tuple[tuple[str, Any], ...]  # (label, the key its cells look up)
    columns: tuple[tuple[str, Cell], ...]  # (title, cell)


def render(table: Table, perf_dir: str = PERF_DIR) -> str:
    """The markdown table, from the JSON files in ``perf_dir``."""
    files = {}
    for name in table.files:
        with open(os.path.join(perf_dir, name)) as f:
            files[name] = json.load(f)
    lines = [_line([table.label, *(title for title, _ in table.columns)]),
             "|" + "---|" * (len(table.columns) + 1)]
    lines += [_line([label, *(cell(files, key) for _, cell in table.columns)])
              for label, key in table.rows]
    return "\n".join(lines) + "\n"


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _at(files: Files, file: str, keys: tuple = ()) -> Any:
    value = files[file]
    for key in keys:
        value = value[key]
    return value


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB"


# ---- benchmarks.bench records ----

@dataclasses.dataclass(frozen=True)
class Run:
    """One bench run: its file and, where the file holds several, the keys down to it."""
    file: str
    keys: tuple = ()

    def variants(self, files: Files) -> dict:
        return _at(files, self.file, self.keys)["variants"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """A row of one variant of a bench run; ``program`` where the columns do not name one."""
    run: Run
    name: str
    program: str = "train"

    def record(self, files: Files, program: str | None = None) -> dict:
        return self.run.variants(files)[self.name]["programs"][program or self.program]


def _vs_first(files: Files, run: Run, name: str) -> str:
    """The variant's train step over the run's first variant's; the first's own median."""
    variants = run.variants(files)
    train = variants[name]["programs"]["train"]
    if name == next(iter(variants)):
        return f"{train['median_s']:.3f} s"
    return f"{train['time_vs_first_variant']:.3f}"


def vs_first(*runs: Run) -> Cell:
    """Row key: a variant name. Its train step against its run's first variant, per run."""
    return lambda files, name: ", ".join(_vs_first(files, run, name) for run in runs)


def temporaries(run: Run) -> Cell:
    """Row key: a variant name. XLA's temporaries of its train step."""
    return lambda files, name: _gb(Variant(run, name).record(files)["memory"][
        "temp_size_in_bytes"])


def mfu_per_run(*runs: Run) -> Cell:
    """Row key: a variant name. Its train step's MFU, per run."""
    return lambda files, name: ", ".join(
        f"{Variant(run, name).record(files)['mfu']:.1%}" for run in runs)


def compile_range(*groups: tuple[Run, ...]) -> Cell:
    """Row key: a variant name. The range of its train step's compile time per group of runs."""
    def one(files: Files, runs: tuple[Run, ...], name: str) -> str:
        times = [Variant(run, name).record(files)["compile_s"] for run in runs]
        return f"{min(times):.1f}–{max(times):.1f} s"
    return lambda files, name: " / ".join(one(files, runs, name) for runs in groups)


def step(program: str | None = None) -> Cell:
    """Row key: a Variant. Its median, and its ratio to the run's first variant's."""
    def cell(files: Files, variant: Variant) -> str:
        record = variant.record(files, program)
        ratio = record["time_vs_first_variant"]
        return f"{record['median_s']:.3f} s" + ("" if ratio == 1.0 else f" ({ratio:.2f}×)")
    return cell


def mfu(program: str | None = None) -> Cell:
    """Row key: a Variant. MFU against the matmul peak (GFLOP/s) measured in the same run."""
    def cell(files: Files, variant: Variant) -> str:
        peak = _at(files, variant.run.file, variant.run.keys)["peak"]["gflop_s"]
        return f"{variant.record(files, program)['mfu']:.1%} of {peak:.1f}"
    return cell


def value(key: str, text: str, program: str | None = None) -> Cell:
    """Row key: a Variant. One value of its program's record, formatted by ``text``."""
    return lambda files, variant: text.format(variant.record(files, program)[key])


def xla_memory(files: Files, variant: Variant) -> str:
    return _gb(variant.record(files)["memory"]["peak_estimate_bytes"])


def process_rss(files: Files, variant: Variant) -> str:
    return _gb(_at(files, variant.run.file, variant.run.keys)["rss_peak_bytes"])


# ---- benchmarks.torch_reference, attention_core and diag_overhead records ----
# Row key of the torch and diag tables: (file, keys) of a record; the torch tables' rows may
# name a second record, for a column of another run.

def torch_step(side: str) -> Cell:
    """One side's (``jax``, ``torch``) median step and MFU of its own framework's peak."""
    def cell(files: Files, records: tuple) -> str:
        result = _at(files, *records[0])[side]
        return f"{result['median_s']:.3f} s, {result['mfu']:.1%} of {result['peak_gflop_s']:.1f}"
    return cell


def torch_ratio(which: int = 0) -> Cell:
    return lambda files, records: f"{_at(files, *records[which])['torch_time_vs_jax']:.3f}"


def torch_compile(files: Files, records: tuple) -> str:
    record = _at(files, *records[0])
    return f"{record['jax']['compile_s']:.1f} s, {record['torch']['first_call_s']:.1f} s"


def diag_ratio(key: str) -> Cell:
    return lambda files, record: f"{_at(files, *record)[key]:.3f}"


def core_ms(file: str, pass_: str, which: int = 0) -> Cell:
    """Row key: attention_core kernel names (one per shape). Median ms per call."""
    return lambda files, kernels: f"{files[file]['median_ms'][kernels[which]][pass_]:.2f}"


# ---- cells of one table each ----

def _builds_core(kernel: str) -> Cell:
    """Row key: (attention_core file, bench file) of one build."""
    return lambda files, key: ", ".join(
        f"{files[key[0]]['median_ms'][kernel][p]:.2f}" for p in ("forward", "forward_backward"))


def _builds_step(name: str) -> Cell:
    def cell(files: Files, key: tuple) -> str:
        variant = files[key[1]]["variants"][name]
        chose = f" (`{variant['model']['attention']}`)" if name == "post" else ""
        return f"{variant['programs']['train']['median_s']:.3f} s{chose}"
    return cell


def _builds_ratio(files: Files, key: tuple) -> str:
    cpu, blocked = (files[key[1]]["variants"][f"post,model.attention={kernel}"]["programs"][
        "train"]["median_s"] for kernel in ("cpu", "blocked"))
    return f"{cpu / blocked:.2f}"


def _width12(files: Files, key: tuple) -> str:
    """Row key: (file, ((label, variant), ...))."""
    file, variants = key
    return ", ".join(f"{label} {_vs_first(files, Run(file), name)}" for label, name in variants)


def _cache_at_start(files: Files, runs: tuple[str, ...]) -> str:
    text = files["compilation_cache.json"]["runs"][runs[0]]["cache_at_start"]
    found = re.search(r"\((\d+) compiled programs\)", text)
    return f"{found.group(1)} programs" if found else text


def _cache_runs(key: str, text: str, scale: float = 1.0) -> Cell:
    """Row key: the run names of compilation_cache.json."""
    return lambda files, runs: ", ".join(
        text.format(files["compilation_cache.json"]["runs"][run][key] * scale) for run in runs)


# ---- the tables ----

INTEL_DEFAULT = ("intel_cpu_kernel_default_variants_1core.json",
                 "intel_cpu_kernel_default_variants.json")
INTEL_SETTINGS = ("intel_default_variants_1core.json", "intel_default_variants.json")
INTEL_TORCH = ("eager_1core", "compiled_1core", "eager", "compiled", "unrolled")
INTEL_CORE = ("intel_cpu_kernel_attention_core_1core.json",
              "intel_cpu_kernel_attention_core.json",
              "intel_cpu_kernel_attention_core_width12.json")
INTEL_BUILDS = ("intel_attention_core_tiled.json", "intel_default_kernels_auto.json",
                "intel_attention_core_tiled_avx2_code.json",
                "intel_default_kernels_auto_avx2_code.json")
INTEL_PAPER = ("intel_cpu_kernel_width12.json", "intel_cpu_kernel_compile_depth.json",
               "intel_cpu_kernel_paper_forward.json")
AMD_PROGRAMS = "xla_options_programs.json"
AMD_DIAG = ("diag_overhead_region_analysis.json", "diag_overhead_unrolled.json")
AMD_UNROLLED = "default_unrolled.json"
AMD_TORCH = "torch_reference_xla_options.json"
AMD_XLA = "xla_options_default.json"
AMD_PAPER = ("xla_options_width12.json", "paper_forward.json")
WIDTH12 = ("width12_attention.json", "width12_block.json", "width12_unroll.json")

XLA_DEFAULTS = " | xla: defaults"
REGION_ANALYSIS = " | xla: xla_cpu_copy_insertion_use_region_analysis=true"
TORCH_COLUMNS = (("JAX train step, MFU of peak GFLOP/s", torch_step("jax")),
                 ("PyTorch step", torch_step("torch")),
                 ("PyTorch time / JAX time", torch_ratio()),
                 ("compile: JAX, PyTorch's first call", torch_compile))
PAPER_COLUMNS = (("time", value("median_s", "{:.3f} s")), ("MFU of peak GFLOP/s", mfu()),
                 ("tokens/s", value("tokens_per_s", "{:,.0f}")), ("XLA memory", xla_memory),
                 ("compile", value("compile_s", "{:.1f} s")),
                 ("peak RSS of the process", process_rss))
DIAG_COLUMNS = (("diagnostic step / train step: time", diag_ratio("diag_over_train_time")),
                ("peak memory", diag_ratio("diag_over_train_peak_memory")),
                ("train step timed again / train step", diag_ratio("train_again_over_train_time")))


def _intel_torch(name: str) -> tuple:
    """The `cpu` kernel's record, then the `blocked` one's."""
    return ((f"intel_cpu_kernel_torch_{name}.json", ()), (f"intel_torch_reference_{name}.json", ()))


def _rounds(file: str, key: str) -> tuple[Run, ...]:
    """The two bench runs listed under ``key`` in the file."""
    return tuple(Run(file, (key, i)) for i in range(2))


TABLES = (
    # ---- Intel host ----
    Table("intel_default", INTEL_DEFAULT, "default config", tuple(
        (f"{cores}, `{kernel}`", Variant(Run(file), f"model.attention={kernel}"))
        for cores, file in zip(("one core", "both cores"), INTEL_DEFAULT, strict=True)
        for kernel in ("cpu", "blocked")), (
        ("train step", step("train")), ("MFU of peak GFLOP/s", mfu("train")),
        ("diagnostic step", step("diag")), ("forward", step("forward")),
        ("train-step compile", value("compile_s", "{:.1f} s", "train")))),
    Table("intel_settings", INTEL_SETTINGS, "variant", (
        ("`blocked`, 32-row blocks, remat `full` (the first)", "model.attention_block=32"),
        ("64-row blocks", "model.attention_block=64"),
        ("16-row blocks", "model.attention_block=16"), ("`einsum`", "model.attention=einsum"),
        ("`xla`", "model.attention=xla"), ("remat `dots`", "model.remat=dots"),
        ("remat `dots_no_batch`", "model.remat=dots_no_batch"),
        ("remat `none`", "model.remat=none")), (
        ("one core: train step vs the first", vs_first(Run(INTEL_SETTINGS[0]))),
        ("both cores", vs_first(Run(INTEL_SETTINGS[1]))),
        ("temporaries", temporaries(Run(INTEL_SETTINGS[0]))))),
    Table("intel_torch", tuple(f for name in INTEL_TORCH for f, _ in _intel_torch(name)),
          "default config", (
              ("one core, eager", _intel_torch("eager_1core")),
              ("one core, `torch.compile`", _intel_torch("compiled_1core")),
              ("both cores, eager", _intel_torch("eager")),
              ("both cores, `torch.compile`", _intel_torch("compiled")),
              ("both cores, `torch.compile`; JAX remat `none`, unrolled",
               _intel_torch("unrolled"))),
          (*TORCH_COLUMNS[:3], ("with `blocked`", torch_ratio(1)), TORCH_COLUMNS[3])),
    Table("intel_attention_core", INTEL_CORE, "kernel", (
        ("`cpu`", ("cpu", "cpu")),
        ("`blocked`, 32-row blocks (128 at paper width)", ("blocked:32", "blocked:128")),
        ("PyTorch `scaled_dot_product_attention`, causal", ("torch_sdpa", "torch_sdpa"))), (
        ("one core: forward (ms)", core_ms(INTEL_CORE[0], "forward")),
        ("fwd + bwd", core_ms(INTEL_CORE[0], "forward_backward")),
        ("both cores: forward", core_ms(INTEL_CORE[1], "forward")),
        ("fwd + bwd", core_ms(INTEL_CORE[1], "forward_backward")),
        ("paper width, both cores: forward", core_ms(INTEL_CORE[2], "forward", 1)),
        ("fwd + bwd", core_ms(INTEL_CORE[2], "forward_backward", 1)))),
    Table("intel_kernel_builds", INTEL_BUILDS, "both cores", (
        ("AVX-512 build", INTEL_BUILDS[:2]), ("AVX2 build (`haswell`)", INTEL_BUILDS[2:])), (
        ("core `cpu`: fwd, fwd + bwd (ms)", _builds_core("cpu")),
        ("core `blocked`", _builds_core("blocked:32")),
        ("step `blocked`", _builds_step("post,model.attention=blocked")),
        ("step `auto` (chose)", _builds_step("post")),
        ("step `einsum`", _builds_step("post,model.attention=einsum")),
        ("step `cpu`", _builds_step("post,model.attention=cpu")),
        ("`cpu` / `blocked`", _builds_ratio))),
    Table("intel_paper_width", INTEL_PAPER, "program", (
        ("width 12, train, `cpu`", Variant(Run(INTEL_PAPER[0]), "model.attention=cpu")),
        ("width 12, train, `blocked`", Variant(Run(INTEL_PAPER[0]), "model.attention=blocked")),
        ("width 12, train, 12 layers", Variant(Run(INTEL_PAPER[1]), "model.n_layers=12")),
        ("width 12, train, 48 layers", Variant(Run(INTEL_PAPER[1]), "model.n_layers=48")),
        ("paper forward, `blocked`",
         Variant(Run(INTEL_PAPER[2]), "model.attention=blocked", "forward")),
        ("paper forward, `cpu`", Variant(Run(INTEL_PAPER[2]), "model.attention=cpu", "forward"))),
        PAPER_COLUMNS),
    # ---- AMD host ----
    Table("amd_default", (AMD_PROGRAMS,), "program, default XLA options", tuple(
        (label, Variant(Run(AMD_PROGRAMS), REGION_ANALYSIS, program)) for label, program in (
            ("train step", "train"), ("diagnostic step", "diag"), ("forward", "forward"))), (
        ("median", value("median_s", "{:.3f} s")), ("MFU of peak GFLOP/s", mfu()),
        ("tokens/s", value("tokens_per_s", "{:,.0f}")),
        ("compile", value("compile_s", "{:.1f} s")),
        ("time vs XLA's defaults", value("time_vs_first_variant", "{:.3f}")))),
    Table("amd_diag_overhead", AMD_DIAG, "default config, `blocked`", (
        ("region analysis", (AMD_DIAG[0], ())),
        ("XLA's defaults, remat `full`, scanned", (AMD_DIAG[1], ("full_scanned",))),
        ("XLA's defaults, remat `none`, unrolled", (AMD_DIAG[1], ("none_unrolled",)))),
        DIAG_COLUMNS),
    Table("amd_unrolled", (AMD_UNROLLED,), "train step, XLA's defaults", (
        ("`full`, scanned", "model.remat=full"), ("`none`, scanned", "model.remat=none"),
        ("`none`, unrolled", "model.remat=none,model.scan_unroll=48")), (
        ("one core: vs `full`", vs_first(*_rounds(AMD_UNROLLED, "one_core"))),
        ("MFU", mfu_per_run(*_rounds(AMD_UNROLLED, "one_core"))),
        ("both cores", vs_first(*_rounds(AMD_UNROLLED, "both_cores"))),
        ("MFU", mfu_per_run(*_rounds(AMD_UNROLLED, "both_cores"))),
        ("compile, one core / both", compile_range(
            _rounds(AMD_UNROLLED, "one_core"), _rounds(AMD_UNROLLED, "both_cores"))),
        ("temporaries", temporaries(Run(AMD_UNROLLED, ("one_core", 0)))))),
    Table("amd_torch", (AMD_TORCH,), "`blocked`, `torch.compile`, tcmalloc", (
        ("one core", ((AMD_TORCH, ("one_core_region_analysis",)),)),
        ("both cores", ((AMD_TORCH, ("both_cores_region_analysis",)),))), TORCH_COLUMNS),
    Table("amd_xla_options", (AMD_XLA,), "`blocked`, XLA options", (
        ("XLA's defaults (the first)", XLA_DEFAULTS),
        ("copy-insertion region analysis (the default)", REGION_ANALYSIS),
        ("concurrency-optimised scheduler",
         " | xla: xla_cpu_enable_concurrency_optimized_scheduler=true")), (
        ("one core: train step vs the first, two rounds",
         vs_first(*(Run(AMD_XLA, (f"one_core_round_{i}",)) for i in (1, 2)))),
        ("both cores", vs_first(*(Run(AMD_XLA, (f"both_cores_round_{i}",)) for i in (1, 2)))),
        ("temporaries", temporaries(Run(AMD_XLA, ("one_core_round_1",)))))),
    Table("amd_paper_width", AMD_PAPER, "program", (
        ("width 12, train, XLA's defaults", Variant(Run(AMD_PAPER[0]), XLA_DEFAULTS)),
        ("width 12, train, region analysis", Variant(Run(AMD_PAPER[0]), REGION_ANALYSIS)),
        ("paper forward, `blocked`",
         Variant(Run(AMD_PAPER[1]), "model.attention=blocked", "forward")),
        ("paper forward, `einsum`",
         Variant(Run(AMD_PAPER[1]), "model.attention=einsum", "forward"))),
        PAPER_COLUMNS),
    Table("amd_width12_settings", WIDTH12, "run", (
        ("attention", (WIDTH12[0], (
            ("`einsum` + remat `dots_no_batch`", "model.attention=einsum"),
            ("`blocked` + `dots_no_batch`", "model.attention=blocked"),
            ("`blocked` + `dots` (the default)", "model.attention=blocked,model.remat=dots")))),
        ("attention block", (WIDTH12[1], tuple(
            (f"{n}:", f"model.attention_block={n}") for n in (128, 64, 256)))),
        ("layer loop", (WIDTH12[2], (("one layer per scan iteration", "model.scan_unroll=1"),
                                     ("two", "model.scan_unroll=2"))))),
        (("train step vs the run's first", _width12),)),
    Table("amd_compilation_cache", ("compilation_cache.json",), "run (20 steps)", (
        ("default, empty cache", ("cold",)), ("default, cache filled above", ("warm1", "warm2")),
        ("default, no cache", ("none1", "none2")),
        ("unrolled (`model.remat=none,model.scan_unroll=48`), empty cache", ("ucold",)),
        ("unrolled, cache filled above", ("uwarm",)), ("unrolled, no cache", ("unone",))), (
        ("cache at start", _cache_at_start), ("wall time", _cache_runs("wall_s", "{:.1f} s")),
        ("peak RSS", _cache_runs("peak_rss_kib", "{:.2f} GB", 1024 / 1e9)))),
)


def write_tables(out_dir: str, perf_dir: str = PERF_DIR) -> dict[str, str]:
    """Every table, written to ``<out_dir>/<name>.md``; their texts by name."""
    texts = {table.name: render(table, perf_dir) for table in TABLES}
    for name, text in texts.items():
        write_bytes_atomic(os.path.join(out_dir, f"{name}.md"), text.encode())
    return texts


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    make_output_dir(FLAGS.out_dir, "--out_dir")
    for name in write_tables(FLAGS.out_dir):
        print(os.path.join(FLAGS.out_dir, f"{name}.md"))


if __name__ == "__main__":
    # defined here, not on import: the tests import the tables beside other commands' flags
    flags.DEFINE_string("out_dir", "results/perf/tables", "Directory for the markdown tables.")
    FLAGS = flags.FLAGS
    app.run(main)
