"""Every metric the dashboard and the recording rules read is one the server defines (a renamed metric
fails here, before a panel goes blank or a rule records nothing)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from prometheus_client import REGISTRY

from samrollout.metrics import definitions, drafter

ROOT = Path(__file__).resolve().parents[1]
READERS = [ROOT / "deploy" / "grafana" / "dashboards" / "samrollout.json", ROOT / "deploy" / "prometheus" / "rules.yml"]
NAME = re.compile(r"\bsamrollout_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
# The drafter's collector exports its families only once the proposer reported: read their names from its source.
COLLECTED = re.compile(r'(Counter|Histogram)MetricFamily\(f"\{m\.P\}(\w+)"')


def _series_names() -> set[str]:
    """Every series name the server's samrollout metrics can export (a counter's _total, a histogram's parts)."""
    families = [(metric.name, metric.type) for metric in REGISTRY.collect() if metric.name.startswith(definitions.P)]
    families += [(definitions.P + name, kind.lower()) for kind, name in COLLECTED.findall(inspect.getsource(drafter))]
    return {name + suffix for name, kind in families for suffix in SUFFIXES.get(kind, ("",))}


def test_the_dashboard_and_the_rules_read_only_metrics_the_server_defines() -> None:
    exported = _series_names()
    for reader in READERS:
        read = set(NAME.findall(reader.read_text()))
        assert read, f"{reader.name} reads no samrollout metric: the pattern is stale"
        unknown = sorted(read - exported)
        assert not unknown, f"{reader.relative_to(ROOT)} reads metrics the server does not define: {unknown}"
