"""Numbers the docs cite, against the committed outputs of the commands beside them."""

import json
import re

from tests.reliability_helpers import REPO

EARLY_WARNING = REPO / "docs" / "figures" / "early_warning"


def test_the_early_warning_table_matches_its_replays():
    """docs/DIAGNOSTICS.md's detector table: persistence 3 from the replay's JSON, persistence 2
    from its markdown totals line."""
    rows = json.loads((EARLY_WARNING / "replay_leaderboard_partial.json").read_text())["runs"]
    finished = [r for r in rows if r["finished"]]
    collapsing = [r for r in finished if r["collapsed"]]
    quiet = [r for r in finished if not r["collapsed"]]
    leads = [r["lead_steps"] for r in collapsing]
    assert (len(finished), len(collapsing), len(quiet)) == (12, 3, 9)
    assert not any(r["missed"] for r in collapsing)
    assert (min(leads), max(leads)) == (160, 170)
    assert sum(r["false_alarm"] for r in quiet) == 0
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    assert "| 3 (the default) | 3 of 3 | 160–170 steps (16–17 intervals) | 0 |" in doc
    totals = (EARLY_WARNING / "replay_leaderboard_partial_persistence2.md").read_text()
    assert re.search(r"3 collapsing runs: 3 warned before the collapse step, lead time "
                     r"160-180 steps; 9 runs that did not collapse: 2 false alarms", totals)
    alarms = [line for line in totals.splitlines() if line.endswith("| yes |")]
    assert sorted(line.split(" | ")[0].strip("| ") + " " + line.split(" | ")[2]
                  for line in alarms) == ["periln 0.003", "sandwich 0.003"]
    assert "| 2 | 3 of 3 | 160–180 steps (16–18 intervals) | 2: sandwich and Peri-LN at lr 3e-3 |" \
        in doc
