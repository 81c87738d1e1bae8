"""relayd/store/sql/ as the store reads it: every block once, each fragment in place, nothing
left unbound."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import relayd.store
from relayd.core.rows import OutboxTable
from relayd.store import load_queries

TABLE = OutboxTable.parse("app.outbox")


def test_every_placeholder_is_bound_and_fragments_are_not_statements() -> None:
    queries = load_queries(TABLE)
    assert "dead_letter_filters" not in queries  # a fragment is not sent on its own
    assert not [name for name, sql in queries.items() if re.search(r"@\w+@", sql)]
    for name in ("dlq_list", "dlq_page"):
        assert "strpos(lower(o.last_error), lower($8))" in queries[name], name


def _files(tmp_path: Path, **texts: str) -> Path:
    """A directory of SQL files, by name."""
    for name, text in texts.items():
        (tmp_path / f"{name}.sql").write_text(text)
    return tmp_path


def test_a_fragment_goes_where_a_statement_names_it(tmp_path: Path) -> None:
    """A fragment of one file fills the placeholder of a statement of another."""
    directory = _files(
        tmp_path,
        a="-- fragment: mine\n-- what it is\n($1::int IS NULL OR x = $1)\n",
        b="-- name: one\n-- a statement\nSELECT 1 FROM @outbox@ AS o WHERE @mine@;\n",
    )
    where = "(($1::int IS NULL OR x = $1))"
    assert load_queries(TABLE, directory) == {
        "one": f'-- a statement\nSELECT 1 FROM "app"."outbox" AS o WHERE {where};'
    }


@pytest.mark.parametrize(
    "texts",
    [
        {"a": "-- name: one\nSELECT 1;\n-- name: one\nSELECT 2;\n"},
        {"a": "-- fragment: one\nTRUE\n-- name: one\nSELECT 2;\n"},
        {"a": "-- name: one\nSELECT 1;\n", "b": "-- name: one\nSELECT 2;\n"},
    ],
    ids=["one-file", "fragment-and-statement", "two-files"],
)
def test_a_name_used_twice_is_refused(tmp_path: Path, texts: dict[str, str]) -> None:
    """A second block of one name would silently replace the first: refused, naming both
    files."""
    with pytest.raises(RuntimeError, match=r"sql/\w\.sql names a block 'one', as sql/a\.sql does"):
        load_queries(TABLE, _files(tmp_path, **texts))


def test_each_files_statements_are_run_by_its_store_module() -> None:
    """relayd's SQL is one file per store module (`sql/cycle.sql` beside `cycle.py`), and
    every statement of a file is run by its module (which may read another's: `health.py`
    explains the claim)."""
    store = Path(relayd.store.__file__).parent
    files = sorted(path.stem for path in (store / "sql").glob("*.sql"))
    assert files == [
        "console",
        "cycle",
        "dead_letters",
        "health",
        "keys",
        "pauses",
        "sampling",
        "schema",
    ]
    for name in files:
        blocks = re.findall(r"^-- name: (\w+)", (store / "sql" / f"{name}.sql").read_text(), re.M)
        module = (store / f"{name}.py").read_text()
        assert blocks, name
        assert [block for block in blocks if f'"{block}"' not in module] == [], name


def test_the_daemon_sessions_plan_for_their_indexes_once() -> None:
    """`relayd run`'s sessions price sequential scans out and keep generic plans; an operator
    command's session keeps the planner's defaults."""
    daemon = relayd.store._server_settings(30.0, daemon=True)
    operator = relayd.store._server_settings(30.0, daemon=False)
    assert daemon["enable_seqscan"] == "off"
    assert daemon["plan_cache_mode"] == "force_generic_plan"
    assert "enable_seqscan" not in operator
    assert "plan_cache_mode" not in operator
