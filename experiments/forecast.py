"""Forecast, before any training step, whether a config's run collapses (docs/FORECAST.md).

    python -m experiments.forecast --config configs/default.py[:ARGS] [--json OUT]

From the config and the theory at init alone (``postnorm.analysis.forecast``; the models fitted
by ``experiments.forecast_validation``, ``--model``), it prints the probability that the run
collapses by its last step (the project's rule), that it ends at the floor (loss >= 0.95 x
L_freq), the predicted onset step (the first diagnostic step with half the layers alike; none
when a collapse is not the likelier outcome) and the inputs, each with its share of the log-odds
of collapse. ``--json`` writes exactly ``p_collapse``, ``p_floor``, ``onset_step`` and ``inputs``.
"""

import json
import time

from absl import app, flags

from postnorm.analysis import forecast as fc
from postnorm.config import check_fields
from postnorm.errors import UserError, exit_on_error
from postnorm.files import write_json_atomic
from postnorm.sweep.plan import RunSpec, build_config
from postnorm.train.validate import check_model, check_opt, check_train

flags.DEFINE_string("config", None, "Config file and its arguments, e.g. "
                    "configs/default.py:pre,layers=24.")
flags.DEFINE_string("json", None, "Write the forecast here as JSON.")
flags.DEFINE_string("model", fc.MODEL_PATH, "The fitted models (experiments.forecast_validation's "
                    "model.json).")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS


class ForecastInputError(UserError):
    """A config file or model file that cannot be read."""


def load_models(path: str) -> dict:
    try:
        with open(path) as f:
            models = json.load(f)
        for key in ("collapse", "floor", "log_onset"):
            fc.Linear.from_json(models[key])
        if set(models["range"]) != set(fc.STEP0):
            raise KeyError(f"range holds {sorted(models['range'])}, not {list(fc.STEP0)}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ForecastInputError(f"--model={path} is not experiments.forecast_validation's "
                                 f"model.json ({type(err).__name__}: {err}); regenerate it with "
                                 "python -m experiments.forecast_validation") from err
    return models


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start = time.perf_counter()
    try:
        config = build_config(FLAGS.config, RunSpec("", ()))
    except (OSError, AttributeError) as err:
        raise ForecastInputError(f"--config={FLAGS.config}: {err}") from err
    check_fields(config)
    check_model(config)
    check_opt(config)
    check_train(config)
    result = fc.forecast_config(config, load_models(FLAGS.model))
    onset = result["onset_step"]
    print(f"p_collapse {result['p_collapse']:.3f}  p_floor {result['p_floor']:.3f}  onset step "
          f"{onset if onset is not None else 'none'}")
    for name, entry in sorted(result["inputs"].items(), key=lambda kv: -abs(kv[1]["log_odds"])):
        print(f"  {name:>22} = {entry['value']:<10.4g} log-odds {entry['log_odds']:+.3f}"
              + ("" if entry["in_fitted_range"] else "  (outside the fitted runs' range)"))
    print(f"({time.perf_counter() - start:.1f} s)")
    if FLAGS.json:
        write_json_atomic(FLAGS.json, result)


if __name__ == "__main__":
    app.run(exit_on_error(main))
