"""sql/queries.sql as the store reads it: every block once, each fragment in place, nothing
left unbound."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from relayd.models import OutboxTable
from relayd.store import load_queries

TABLE = OutboxTable.parse("app.outbox")


def test_every_placeholder_is_bound_and_fragments_are_not_statements() -> None:
    queries = load_queries(TABLE)
    assert "dead_letter_filters" not in queries  # a fragment is not sent on its own
    assert not [name for name, sql in queries.items() if re.search(r"@\w+@", sql)]
    for name in ("dlq_list", "dlq_page"):
        assert "strpos(lower(o.last_error), lower($8))" in queries[name], name


def _text(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    class Resource:
        def joinpath(self, _name: str) -> Resource:
            return self

        def read_text(self, encoding: str) -> str:
            return text

    monkeypatch.setattr(resources, "files", lambda _package: Resource())


def test_a_fragment_goes_where_a_statement_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _text(
        monkeypatch,
        "-- fragment: mine\n-- what it is\n($1::int IS NULL OR x = $1)\n\n"
        "-- name: one\n-- a statement\nSELECT 1 FROM @outbox@ AS o WHERE @mine@;\n",
    )
    where = "(($1::int IS NULL OR x = $1))"
    assert load_queries(TABLE) == {
        "one": f'-- a statement\nSELECT 1 FROM "app"."outbox" AS o WHERE {where};'
    }


@pytest.mark.parametrize(
    "text",
    [
        "-- name: one\nSELECT 1;\n-- name: one\nSELECT 2;\n",
        "-- fragment: one\nTRUE\n-- name: one\nSELECT 2;\n",
    ],
)
def test_a_name_used_twice_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    _text(monkeypatch, text)
    with pytest.raises(RuntimeError, match="names two blocks 'one'"):
        load_queries(TABLE)
