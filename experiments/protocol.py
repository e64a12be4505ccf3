"""The long-horizon protocol's report (docs/PROTOCOL.md), from its archive alone.

    python -m experiments.protocol [--archive results/protocol/runs] [--out_dir results/protocol]
    python -m experiments.protocol --measure_corpus     # corpus.json, from the prepared data

Reads the plan of every variant of ``configs/sweeps/protocol.py`` as the archive now sets it
and each planned run's record (matched by config digest, ``postnorm.sweep.archive``; a run not
archived yet is ``missing``), and writes to --out_dir (``postnorm.sweep.protocol_table``):

* ``bracket.md``: per method the held-out loss at step 300 at each rate, clipped then
  unclipped, then at step 3,000 for the survival methods that train at no rate in 300 steps
  (the long bracket); its long-run rate (``protocol_table.long_run_choice``; the rate tried
  next while at an open edge) and the largest rate at which it trains (no collapse, loss under
  0.95 x L_freq); ``bracket.png``: the rate-sensitivity curves;
* ``calibration.md``: Post-Norm against Pre-Norm at 12 layers per rate, seed-paired;
* ``survival.md``: each method at 48 layers against the reference (the better of Pre-Norm and a
  stably trained Post-Norm), seed-paired, beside its verdict on the 300-step screen
  (``results/leaderboard/leaderboard.json``, 48 layers, lr 1e-3, warmup 20);
* ``width.md``: the same at d = 128, with the step time over d = 64's;
* ``unplanned.md``: the archived runs no variant plans now (runs of an earlier plan: a bracket
  of another horizon, a survival run whose method's long-run rate was chosen again or is not
  settled), kept in the archive and in no table;
* ``curves.png``: the held-out loss curves of the long runs, mean over seeds;
* ``protocol.json``: all of it, each gap with the run ids it pairs.

Each table opens with its scope (depth, width, steps, epochs of the training split, seeds).
``--measure_corpus`` loads the default config's data (building it if needed) and writes
``corpus.json``: the training split's target tokens and L_freq, which the epochs are counted
against; the report checks every record's L_freq against it.
"""

import json
import math
import os

import matplotlib
import numpy as np
from absl import app, flags

from configs.sweeps import protocol
from postnorm.analysis.figures import save_figure
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_json_atomic
from postnorm.sweep.archive import archived_runs, read_archive
from postnorm.sweep.plan import RunSpec, build_config
from postnorm.sweep.protocol_table import (
    bracket_entries,
    bracket_markdown,
    bracket_title,
    brackets,
    calibration_entries,
    calibration_markdown,
    compared_entries,
    compared_markdown,
    epochs,
    step_time_ratios,
    unplanned_markdown,
    unsettled_markdown,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREEN = os.path.join(REPO, "results", "leaderboard", "leaderboard.json")
SCREEN_CELL = {"layers": 48, "lr": 0.001, "warmup": 20}
NOT_PLANNED = {
    "survival": "Not planned yet: a method's survival runs are planned once its long-run "
                "rate from the clipped bracket is settled.",
    "width": "Not planned yet: the width step is planned once every survival run is archived."}
ORDER = tuple(dict.fromkeys((*protocol.BRACKET_METHODS, *protocol.SURVIVAL_METHODS)))

flags.DEFINE_string("archive", protocol.ARCHIVE, "The protocol's archive of run records.")
flags.DEFINE_string("out_dir", os.path.dirname(protocol.ARCHIVE), "Where the report goes.")
flags.DEFINE_bool("measure_corpus", False, "Write corpus.json from the prepared data and stop.")
FLAGS = flags.FLAGS


class ProtocolReportError(UserError):
    """A corpus measure missing or not the records' corpus."""


def measure_corpus(out_dir: str) -> dict:
    from postnorm.data.lm_data import load_data

    config = build_config(protocol.BASE_CONFIG, RunSpec("", ()))
    data = load_data(config.data, seed=config.seed)
    corpus = {"lfreq": data.lfreq, "train_tokens": int(data.unigram_counts.sum()),
              "num_docs": data.info["num_docs"], "fingerprint": data.fingerprint,
              "seq_len": data.seq_len}
    write_json_atomic(os.path.join(out_dir, "corpus.json"), corpus)
    return corpus


def read_corpus(out_dir: str) -> dict:
    path = os.path.join(out_dir, "corpus.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ProtocolReportError(f"{path} cannot be read ({err}); write it with python -m "
                                  "experiments.protocol --measure_corpus") from err


def planned_rows(variant: str, archive: str, corpus: dict) -> list[dict]:
    """One row per run ``variant`` plans, from its archived record where there is one."""
    runs = protocol.planned_runs(variant, archive)
    configs = [run.config for run in runs]
    rows = []
    for run, config, record in zip(runs, configs, archived_runs(archive, configs), strict=True):
        result = record["result"] if record else {}
        if result and not math.isclose(result["lfreq"], corpus["lfreq"], rel_tol=1e-9):
            raise ProtocolReportError(
                f"{archive}/{run.run_id}.json has L_freq {result['lfreq']}, corpus.json "
                f"{corpus['lfreq']}: the run trained on another corpus; rewrite corpus.json "
                "(--measure_corpus) where the runs' data is prepared")
        done = result.get("status") == "done"
        rows.append({
            "variant": variant, "method": run.method, "run_id": run.run_id, "lr": run.lr,
            "clipped": run.clipped, "seed": run.seed, "steps": config.train.steps,
            "layers": config.model.n_layers, "d_model": config.model.d_model,
            "epochs": epochs(config.train.steps, config.data.batch_size, config.data.seq_len,
                             corpus["train_tokens"]),
            "status": result.get("status", "missing"),
            "loss": result.get("final_eval_loss") if done else None,
            "collapsed": bool(result.get("collapse", {}).get("collapsed")) if done else None,
            "curve": result.get("eval_curve", []), "wall_s": result.get("wall_s"),
            "train_steps": result.get("train_steps"), "lfreq": corpus["lfreq"]})
    return rows


def scope(rows: list[dict]) -> str:
    """One line: the depths, widths, steps, epochs and seeds of ``rows``, and how many are in."""
    def values(key: str, spec: str = "") -> str:
        return ", ".join(format(v, spec) for v in sorted({r[key] for r in rows}))
    done = sum(r["status"] != "missing" for r in rows)
    return (f"{values('layers')} layers, d = {values('d_model')}, {values('steps', ',')} steps "
            f"of 16 × 128 tokens ({values('epochs', '.2f')} epochs of the training split), "
            f"seed{'s' if len({r['seed'] for r in rows}) > 1 else ''} {values('seed')}; "
            f"{done} of {len(rows)} planned runs archived.")


def screen_verdicts(path: str = SCREEN) -> dict[str, str]:
    """Per method its 300-step screen's verdict in ``SCREEN_CELL``: the runs that collapsed, the
    seed-paired gap of the fresh-batch loss to Pre-Norm's and its verdict."""
    with open(path) as f:
        board = json.load(f)
    def in_cell(entry: dict) -> bool:
        return all(entry[k] == v for k, v in SCREEN_CELL.items())
    out = {}
    for cell in filter(in_cell, board["cells"]):
        out[cell["method"]] = f"collapsed {cell['collapsed']}/{cell['done']}"
    for gap in filter(in_cell, board["paired"]):
        out[gap["method"]] += f"; {gap['mean']:+.3f} vs pre, {gap['verdict']}"
    return out


def unplanned_records(archive: str, rows: dict[str, list[dict]]) -> list[dict]:
    """The records in ``archive`` of runs no variant plans now, by their run id."""
    planned = {r["run_id"] for variant_rows in rows.values() for r in variant_rows}
    out = []
    for entry in read_archive(archive):
        result = entry["result"]
        if entry["run_id"] in planned:
            continue
        done = result["status"] == "done"
        out.append({"run_id": entry["run_id"], "status": result["status"],
                    "loss": result.get("final_eval_loss") if done else None,
                    "collapsed": bool(result["collapse"]["collapsed"]) if done else None})
    return out


def unsettled_methods(survival_rows: list[dict]) -> list[str]:
    """The survival methods with no survival run planned: their long-run rate is not settled."""
    planned = {r["method"] for r in survival_rows}
    return [m for m in protocol.SURVIVAL_METHODS if m not in planned]


def plot_bracket(entries: list[dict], lfreq: float, path: str) -> None:
    panels = brackets(entries)
    screen_steps = min(steps for _, steps in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), sharex=True,
                             sharey=True, squeeze=False)
    for ax, (clipped, steps) in zip(axes[0], panels, strict=True):
        for e in sorted((e for e in entries if (e["clipped"], e["steps"]) == (clipped, steps)),
                        key=lambda e: ORDER.index(e["method"])):
            points = [(lr, loss, c) for lr, loss, c in
                      zip(e["rates"], e["loss"], e["collapsed"], strict=True) if loss is not None]
            if not points:
                continue
            lrs, losses, collapsed = zip(*points, strict=True)
            (line,) = ax.plot(lrs, losses, marker="o", label=e["method"])
            hit = [(x, y) for x, y, c in points if c]
            if hit:
                ax.plot(*zip(*hit, strict=True), "x", color="red", ms=10)
        ax.axhline(lfreq, color="k", ls="--", lw=1, label="L_freq")
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_title(bracket_title(clipped, steps, screen_steps), fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    axes[0][0].set_ylabel("held-out loss at the bracket's last step (nats); red x: collapsed")
    fig.suptitle("Learning-rate bracket, 48 layers, d = 64, seed 0")
    save_figure(fig, path, dpi=110, bbox_inches="tight")


def plot_curves(groups: dict[str, list[dict]], lfreq: float, path: str) -> None:
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], groups.items(), strict=True):
        by_line: dict[str, list[dict]] = {}
        for r in rows:
            if r["status"] == "done":
                label = (f"{r['method']} lr {r['lr']:g}" if title.startswith("calibration")
                         else r["method"])
                by_line.setdefault(label, []).append(r)
        for label, runs in sorted(by_line.items()):
            steps = sorted(set.intersection(*({s for s, _ in r["curve"]} for r in runs)))
            mean = [np.mean([dict(r["curve"])[s] for r in runs]) for s in steps]
            ax.plot(steps, mean, marker=".", label=f"{label} ({len(runs)} seeds)")
        ax.axhline(lfreq, color="k", ls="--", lw=1, label="L_freq")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats), mean over seeds")
        if by_line:
            ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110, bbox_inches="tight")


def report(archive: str, out_dir: str) -> dict:
    corpus = read_corpus(out_dir)
    rows = {v: planned_rows(v, archive, corpus) for v in protocol.VARIANTS}
    bracket = bracket_entries(rows["bracket"] + rows["long_bracket"] + rows["stress"])
    calibration = calibration_entries(rows["calibration"])
    survival = compared_entries(rows["survival"], ORDER)
    width = compared_entries(rows["width"], ORDER)
    costs = {m: f"{r:.2f}×" for m, r in step_time_ratios(rows["width"], rows["survival"]).items()}
    screen = screen_verdicts()
    tables = {
        "bracket": bracket_markdown(bracket, ORDER, corpus["lfreq"]),
        "calibration": calibration_markdown(calibration),
        "survival": compared_markdown(survival, {"300-step screen (48 layers, lr 1e-3)": screen})
        + unsettled_markdown(unsettled_methods(rows["survival"])),
        "width": compared_markdown(width, {"step time / d = 64": costs}),
    }
    for name, table in tables.items():
        runs = rows[name] + (rows["long_bracket"] + rows["stress"] if name == "bracket" else [])
        text = f"{scope(runs)}\n\n{table}" if runs else f"{NOT_PLANNED[name]}\n"
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(text)
    plot_bracket(bracket, corpus["lfreq"], os.path.join(out_dir, "bracket.png"))
    plot_curves({"calibration (12 layers)": rows["calibration"],
                 "survival (48 layers)": rows["survival"], "width (d = 128)": rows["width"]},
                corpus["lfreq"], os.path.join(out_dir, "curves.png"))
    unplanned = unplanned_records(archive, rows)
    with open(os.path.join(out_dir, "unplanned.md"), "w") as f:
        f.write(unplanned_markdown(unplanned))
    result = {"corpus": corpus, "bracket": bracket, "calibration": calibration,
              "survival": survival, "width": width, "unplanned": unplanned,
              "scope": {v: scope(r) for v, r in rows.items() if r}}
    write_json_atomic(os.path.join(out_dir, "protocol.json"), result)
    return result


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    make_output_dir(FLAGS.out_dir, "--out_dir")
    if FLAGS.measure_corpus:
        print(measure_corpus(FLAGS.out_dir))
        return
    result = report(FLAGS.archive, FLAGS.out_dir)
    for name, entries in result.items():
        if name in ("bracket", "calibration", "survival", "width", "unplanned"):
            print(f"{name}: {len(entries)} entries -> {FLAGS.out_dir}/{name}.md")


if __name__ == "__main__":
    app.run(exit_on_error(main))
