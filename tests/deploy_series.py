"""The ``offloadd_*`` series the shipped dashboard and alert rules use.

``python -m tests.deploy_series`` prints them, one per line; the tests hold them against
what a real daemon exports (tests/integration/test_dashboard_series.py) and the dashboard's
queries against PromQL (tests/unit/test_deploy_manifests.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "offloadd-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "offloadd-rules.yaml"

SERIES = re.compile(r"\boffloadd_[a-z_]+\b")
# What a sample name adds to its family's name in the exposition (histograms, counters).
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets, variables, annotations."""
    if dashboard is None:
        dashboard = json.loads(DASHBOARD.read_text())
    queries: list[str] = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        queries += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    queries += [annotation["expr"] for annotation in dashboard["annotations"]["list"]]
    return queries


def rule_expressions() -> list[str]:
    """The ``expr`` of every rule in the rule file."""
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def series_in(texts: list[str]) -> set[str]:
    """The ``offloadd_*`` names the expressions name (label_values' and selectors alike)."""
    return {name for text in texts for name in SERIES.findall(text)}


def used_series() -> set[str]:
    """Every ``offloadd_*`` sample name the dashboard or the rules query."""
    return series_in(dashboard_queries()) | series_in(rule_expressions())


if __name__ == "__main__":
    print("\n".join(sorted(used_series())))
