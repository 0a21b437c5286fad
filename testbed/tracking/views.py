"""Saved MLflow views: what the printed `MLflow charts:` link opens.

MLflow's chart view shows only the first 10 runs of an experiment unless the user picks
"Show all runs" (a 12-point comparison showed 10 points, a capacity search 10 of its 32 probes),
and its three charts a row cut titles and run names at a 1,600 px window. Neither can be set by
URL parameters, but MLflow 3 opens a saved view by key: the link's `viewStateShareKey=<key>`
loads the experiment tag `mlflow.sharedViewState.<key>`, an envelope `{name, createdAt,
updatedAt, state}` whose `state` is the runs page's UI state as JSON (what "Views -> Save as new
view" writes). The views written here show every run, put the `headline` section (and, for a
capacity search, the `capacity` section) first, two charts a row, and optionally group the runs
(a capacity search: one group per grid point, its probes inside, each group's first bar the
capacity the command printed).

`isDirty: true` keeps MLflow from replacing the listed charts by its generated ones; charts of the
other metrics are appended by MLflow itself, in their own sections.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

TAG_PREFIX = "mlflow.sharedViewState."
# logged once more under `headline/` (testbed/tracking/tracker.run_metrics): the first charts a newcomer sees
HEADLINE_METRICS = ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s", "slo_attainment")
ALL_RUNS = "testbed-all-runs"  # every experiment's view (written by Tracker when it opens one)
HEADLINE_SECTION = "headline"


@dataclass(frozen=True)
class View:
    """One saved view: its key (the link's viewStateShareKey), the chart sections shown first with
    their metric keys, and an optional grouping of runs by a tag (`group_by`, with `aggregate`:
    min, average or max, how a group's bar is computed)."""

    key: str
    sections: tuple[tuple[str, tuple[str, ...]], ...]
    group_by: str | None = None
    aggregate: str = "max"
    columns: int = 2  # charts per row: three cut the titles at 1,600 px
    card_height: int = 420  # pixels: 13 bars stay readable
    # the run list's filter and order (MLflow search syntax): with an order other than the start
    # time MLflow lists nested runs flat, one row and one bar each, instead of under their parent
    search_filter: str = ""
    order_by: str | None = None
    order_asc: bool = False

    def state(self) -> dict:
        charts, sections = [], []
        for name, keys in self.sections:
            sid = f"autogen-{name}"
            sections.append({"uuid": sid, "name": name, "display": True, "isReordered": False,
                             "columns": self.columns, "cardHeight": self.card_height})
            charts += [{"deleted": False, "type": "BAR", "uuid": f"autogen-{key}", "metricSectionId": sid,
                        "isGenerated": True, "metricKey": key, "dataAccessKey": key} for key in keys]
        state: dict = {"runsHiddenMode": "SHOW_ALL", "compareRunsMode": "CHART", "isDirty": True,
                       "compareRunCharts": charts, "compareRunSections": sections, "useGroupedValuesInCharts": True}
        if self.order_by:
            state.update(searchFilter=self.search_filter, orderByKey=self.order_by, orderByAsc=self.order_asc)
        if self.group_by:
            state["groupBy"] = {"aggregateFunction": self.aggregate,
                                "groupByKeys": [{"mode": "tag", "groupByData": self.group_by}]}
            state["groupsExpanded"] = {}
        return state

    def tag(self, now_ms: int | None = None) -> tuple[str, str]:
        """(experiment tag key, value) that MLflow's UI reads for this view."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        envelope = {"name": self.key, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(self.state())}
        return TAG_PREFIX + self.key, json.dumps(envelope)


def headline_view(headline: Sequence[str], key: str = ALL_RUNS) -> View:
    return View(key, ((HEADLINE_SECTION, tuple(f"{HEADLINE_SECTION}/{m}" for m in headline)),))


def study_view(study: str, objective: str, maximize: bool) -> View:
    """A tuning study: its trials are runs nested under the study's run, which MLflow shows
    collapsed (the chart view then charted the study run's `best.*` alone). Here the trials only
    (tag `testbed.kind=trial`), best objective first: every trial is a bar of the headline charts."""
    return View(f"testbed-study-{study}", headline_view(HEADLINE_METRICS).sections,
                search_filter="tags.`testbed.kind` = 'trial'", order_by=f"metrics.`{objective}`", order_asc=not maximize)


CAPACITY = View("testbed-capacity", (("capacity", ("capacity/req_s",)),
                                     *headline_view(HEADLINE_METRICS).sections), group_by="capacity.label")
"""A capacity search: its runs grouped by grid point (tag `capacity.label`, e.g. `gllm`); the
first chart is `capacity/req_s`, logged only by each point's summary run (tag
`testbed.kind=capacity-point`): the capacity the command printed, one bar per point. (Before,
each passing probe logged its rate and the group's max was shown: the easiest window's
capacity, gLLM 1.47 where the command printed 1.06.) Other charts show each group's max."""


def view_link(base: str, experiment_id: str, key: str) -> str:
    """`base` is the UI's root URL; `workflowType=machine_learning` skips MLflow 3's GenAI view
    (which lists no runs), `compareRunsMode=CHART` opens the chart view."""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&compareRunsMode=CHART&viewStateShareKey={key}")
