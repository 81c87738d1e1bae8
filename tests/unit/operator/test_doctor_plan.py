"""What `relayd doctor` says of the claim's plan, from the plan alone: it reads the claim
index, it scans the outbox (a fault once the table is analysed), or the planner only
guessed (a table never analysed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from relayd.operator.check import Verdict
from relayd.operator.doctor import _plan_finding
from relayd.store import Store
from tests.support import DEFAULT_TABLE


def _plan(*scans: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "Plan": {
                "Node Type": "ModifyTable",
                "Relation Name": "outbox",
                "Plans": [
                    {"Node Type": kind, "Index Name": where}
                    if kind.startswith("Index")
                    else {"Node Type": kind, "Relation Name": where}
                    for kind, where in scans
                ],
            }
        }
    ]


# `_plan_finding` reads only the store's table.
STORE = cast(Store, SimpleNamespace(table=DEFAULT_TABLE))

INDEX = ("Index Scan", "outbox_relayd_claim")
SEQ = ("Seq Scan", "outbox")


@pytest.mark.parametrize(
    ("scans", "analysed", "verdict", "words"),
    [
        ((INDEX,), True, Verdict.OK, "reads its index outbox_relayd_claim"),
        ((SEQ,), True, Verdict.FAIL, "does not read its index"),
        ((INDEX, SEQ), True, Verdict.FAIL, "a sequential scan on every claim"),
        ((SEQ,), False, Verdict.WARN, "not analysed yet, so the plan shown is a guess"),
        ((INDEX, SEQ), False, Verdict.WARN, "ANALYZE relayd.outbox"),
    ],
)
def test_the_claim_plan_verdict(
    scans: tuple[tuple[str, str], ...], analysed: bool, verdict: Verdict, words: str
) -> None:
    finding = _plan_finding(_plan(*scans), STORE, analysed=analysed)
    assert finding.verdict is verdict
    assert words in finding.detail
