"""The end of a training run: its plots and ``report.html`` written, and a closing summary of a
few lines (the collapse verdict, layers alike, loss against L_freq and the floor, the early
layers' gradient fall, where the outputs are) for ``main.py`` to print last."""

import os

import jax
import numpy as np
from absl import logging

from postnorm.analysis.collapse import DEFAULT_RULE, CollapseRule, detect_collapse
from postnorm.analysis.figures import render_run_plots
from postnorm.analysis.report import VANISHING_FACTOR, write_report
from postnorm.analysis.summary import summarize
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import MetricsFileError, layer_series, read_metrics


def _verdict(records: list[dict], rule: CollapseRule) -> list[str]:
    """The collapse rule's verdict and the layers alike at the last diagnostic step."""
    series = layer_series(records)
    if "tsim_attn" not in series:
        return ["collapse: not assessed (no per-layer diagnostics: diag.every)"]
    collapse = detect_collapse(records, rule)
    criterion = (f"rule: >= {rule.layer_fraction:.0%} of the layers at tsim >= "
                 f"{rule.tsim_threshold} and the loss within {rule.loss_rtol:.0%} of its "
                 "batches' floor")
    verdict = (f"collapse: yes, from step {collapse.collapse_step} (window "
               f"{list(collapse.window)}; {criterion})" if collapse.collapsed
               else f"collapse: no ({criterion})")
    steps_S, tsim_LxS = series["tsim_attn"]
    alike = int(np.sum(tsim_LxS[:, -1] >= rule.tsim_threshold))
    return [verdict, f"layers alike at step {int(steps_S[-1])}: {alike} of {tsim_LxS.shape[0]} "
                     f"(tsim >= {rule.tsim_threshold})"]


def _gradient_fall(numbers: dict, rule: CollapseRule) -> list[str]:
    """||dL/dX|| of the early layers, first diagnostic step over last (as the report's
    vanishing-gradient warning)."""
    if "dldx_first_over_last_early_layers" not in numbers:
        return []
    ratio = numbers["dldx_first_over_last_early_layers"]
    low, high = min(ratio), max(ratio)
    first, last = numbers["diag_steps"]
    if low >= 1:
        change = f"fell {low:.3g}x to {high:.3g}x"
    elif high <= 1:
        change = f"grew {1 / high:.3g}x to {1 / low:.3g}x"
    else:
        change = f"changed by a factor (first / last) of {low:.3g} to {high:.3g}"
    flag = f" (vanishing: over {VANISHING_FACTOR:g}x)" if low > VANISHING_FACTOR else ""
    return [f"early-layer gradient: ||dL/dX|| of layers 0-{len(ratio) - 1} {change} from step "
            f"{first} to {last}{flag}"]


def closing_summary(workdir: str, plots: list[str] | None, report: str | None,
                    rule: CollapseRule = DEFAULT_RULE) -> list[str]:
    """The summary's lines; ``plots`` and ``report`` are the outputs written (None: failed)."""
    records = read_metrics(workdir)
    numbers = summarize(workdir, early_layers=rule.early_layers, tail=rule.loss_smoothing)
    loss = (f"loss: {numbers['final_train_loss']:.4f} = {numbers['train_loss_over_lfreq']:.4f} "
            f"x L_freq ({numbers['lfreq']:.4f}) = {numbers['train_loss_over_floor']:.4f} x its "
            f"batches' floor (train, last {rule.loss_smoothing} logged steps)")
    if numbers["final_eval_loss"] is not None:
        loss += (f"; eval {numbers['final_eval_loss']:.4f} = "
                 f"{numbers['final_eval_loss'] / numbers['lfreq']:.4f} x L_freq")
    failed = "not written (the error above says why)"
    if plots is None:
        where = [f"plots: {failed}"]
    else:
        names = ", ".join(os.path.splitext(os.path.basename(p))[0] for p in plots)
        where = [f"plots: {Workdir(workdir).plots}{os.sep} ({names})"]
    where.append(f"report: {report or failed}")
    head = f"== done: step {numbers['final_step']} in {os.path.abspath(workdir)}"
    return [head, *_verdict(records, rule), loss, *_gradient_fall(numbers, rule), *where]


def finish_run(workdir: str) -> list[str]:
    """Writes the plots and the report of a run that has just trained (process 0; a failure is
    logged, not raised: the run itself is complete and checkpointed) and returns the closing
    summary's lines (none on other processes)."""
    if jax.process_index() != 0:
        return []
    plots = report = None
    try:
        plots = render_run_plots(workdir)
    except (OSError, MetricsFileError) as err:
        logging.error("the run finished, but its plots could not be written (%s); fix that, "
                      "then run main.py --mode=plots --workdir %s", err, workdir)
    try:
        report = write_report(workdir)
    except (OSError, MetricsFileError) as err:
        logging.error("the run finished, but its report could not be written (%s); fix that, "
                      "then run main.py --mode=report --workdir %s", err, workdir)
    try:
        return closing_summary(workdir, plots, report)
    except MetricsFileError as err:
        logging.error("the run finished, but its metrics could not be summarised (%s)", err)
        return []
