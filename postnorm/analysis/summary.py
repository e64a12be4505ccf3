"""Summary of a finished run from its ``metrics.jsonl``: loss against L_freq and gradient decay."""

import sys

import numpy as np

from postnorm.analysis.collapse import lfreq_of, loss_and_floor_at, train_loss_and_floor
from postnorm.files import dumps
from postnorm.workdir.metrics import MetricsFileError, layer_series, read_metrics


def summarize(workdir: str, early_layers: int = 4, tail: int = 3) -> dict:
    """Final loss (mean of the last ``tail`` logged steps) against L_freq and against the same
    batches' frequency floor, the held-out loss at every evaluation (``eval_curve``: [step,
    loss] pairs, the validation split), and the change of ||dL/dX|| at the attention input of
    the early layers and of the last layer, from the first diagnostic step to the last."""
    records = read_metrics(workdir)
    train = train_loss_and_floor(records)
    lfreq = lfreq_of(records)
    final_loss, final_floor = loss_and_floor_at(train, train[-1][0], tail)
    evals = [r for r in records if "eval/loss" in r]
    eval_floor = evals[-1].get("eval/freq_floor") if evals else None
    summary = {
        "workdir": workdir,
        "final_step": train[-1][0],
        "final_train_loss": final_loss,
        "final_eval_loss": evals[-1]["eval/loss"] if evals else None,
        "lfreq": lfreq,
        "train_loss_over_lfreq": final_loss / lfreq,
        "final_train_floor": final_floor,
        "train_loss_over_floor": final_loss / final_floor,
        "eval_floor": eval_floor,
        "eval_loss_over_floor": evals[-1]["eval/loss"] / eval_floor if eval_floor else None,
        "eval_curve": [[int(r["step"]), float(r["eval/loss"])] for r in evals],
    }
    series = layer_series(records)
    if "dldx_norm_attn" in series:
        steps, grad_LxS = series["dldx_norm_attn"]
        first, last = grad_LxS[:, 0], grad_LxS[:, -1]
        summary["diag_steps"] = [int(steps[0]), int(steps[-1])]
        summary["dldx_first_over_last_early_layers"] = (first[:early_layers]
                                                        / last[:early_layers]).tolist()
        summary["dldx_first_over_last_last_layer"] = float(first[-1] / last[-1])
        _, tsim_LxS = series["tsim_attn"]
        summary["fraction_of_layers_tsim_ge_0.99"] = float(np.mean(tsim_LxS[:, -1] >= 0.99))
    return summary


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        print(f"usage: python -m postnorm.analysis.summary WORKDIR [WORKDIR ...]\n{__doc__}",
              file=sys.stderr)
        sys.exit(2)
    for workdir in argv[1:]:
        try:
            print(dumps(summarize(workdir), indent=2))
        except MetricsFileError as err:
            print(f"postnorm: error: {err}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
