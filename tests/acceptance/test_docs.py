"""Every example in the documentation is run: the README, docs/ and deploy/README.md.

Each fenced block names its language, and each language is run its own way:

- `python`: every block of a page, in order, in one namespace (a page's examples build on
  each other), against the test's PostgreSQL, with what the page leaves to the reader
  prepared beforehand (`conn`, `dsn`, an `orders` table, SQLAlchemy's `engine`, a tracer, a
  signed delivery's `body` and `headers`);
- `sql`: in a transaction rolled back, on a migrated outbox; a `relayd grants` script is the
  command's own output;
- `toml`: loaded as a configuration (the files it names stand in the test's directory);
- `json`: parsed; an envelope is checked as the relay checks a row;
- `sh`: each `relayd` command parses (its subcommand and flags exist), each `make` target
  exists, each `pip install` names what the repository builds, and every other program is one
  of the known ones (a new one is added here on purpose);
- `text`: output shown, never run.

Only what names this machine is changed (a configuration's path, the DSN). The README's quick
starts are run whole, servers and all, by test_quickstart.py.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from relayd.cli import build_parser
from relayd.core import __version__
from relayd.core.envelope import DomainEvent, Envelope
from relayd.producer import uuid7
from relayd.settings import load_settings
from tests.support import Database, clear_relayd_env, run_relayd

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LANGUAGES = {"python", "sql", "toml", "json", "sh", "text"}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(language: str | None = None) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            block = Block(page, line, match.group(1), match.group(2))
            if language is None or block.language == language:
                found.append(block)
    return found


def _ids(found: list[Block]) -> list[str]:
    return [str(block) for block in found]


def test_every_block_names_a_language_run_here() -> None:
    """An unlabeled block would escape every test below: output is labeled `text`."""
    unknown = [
        f"{block}: {block.language!r}" for block in blocks() if block.language not in LANGUAGES
    ]
    assert unknown == []


# --- sh ----------------------------------------------------------------------------------

# Programs a documented command may run besides relayd, make and pip (what the docs install
# and deploy with); their arguments are theirs.
OTHER_PROGRAMS = {
    "echo", "export", "ls", "cp", "install", "python3", "systemctl", "systemd-creds",
    "systemd-run", "systemd-analyze", "journalctl", "docker", "kubectl", "promtool", "curl",
    "nats-server", "psql", "head", "base64", "cat",
}  # fmt: skip


def _commands(text: str) -> Iterator[list[str]]:
    """Each command of a shell block: continuations joined, comments and `&` dropped, the
    parts of `a && b` and `a | b` apart. A multi-line quoted argument is one word."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    command: list[str] = []
    for token in lexer:
        if token in {";", "&", "&&", "|", "||"}:
            if command:
                yield command
            command = []
        else:
            command.append(token)
    if command:
        yield command


def _lines(text: str) -> Iterator[list[str]]:
    """Each line's commands (a newline ends a command unless quoted or continued)."""
    joined = text.replace("\\\n", " ")
    buffer = ""
    for line in joined.splitlines():
        buffer = f"{buffer}\n{line}" if buffer else line
        try:
            shlex.split(buffer, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        yield from _commands(buffer)
        buffer = ""
    assert not buffer, f"an unterminated command: {buffer!r}"


def _program(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, flags=re.MULTILINE))


def _check_relayd(parser: argparse.ArgumentParser, arguments: list[str], where: str) -> None:
    """The command line parses: argparse exits 2 on an unknown command or flag (0 for
    `--help` and `--version`)."""
    code: object = 0
    try:
        parser.parse_args(arguments)
    except SystemExit as exc:
        code = exc.code
    assert code == 0, where


def _check_pip(arguments: list[str], where: str) -> None:
    """What `pip install` is given exists: the clone (`.`), a wheel `make dist` builds (at
    this version), or a package of its own; never `relayd` from an index (it is not
    published there). Extras are relayd's."""
    assert arguments[:1] == ["install"], where
    for requirement in (a for a in arguments[1:] if not a.startswith("-")):
        name, _, extras = requirement.partition("[")
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in _extras(), f"{where}: no extra {extra!r} in pyproject.toml"
        if name in {".", "-e"}:
            continue
        if name.endswith(".whl"):
            assert re.fullmatch(
                rf"(.*/)?relayd-{re.escape(__version__)}-py3-none-any\.whl", name
            ), f"{where}: {name} is not the wheel `make dist` builds"
            continue
        assert not name.startswith("relayd"), f"{where}: {requirement} is on no package index"


@pytest.mark.parametrize("block", blocks("sh"), ids=_ids(blocks("sh")))
def test_every_documented_command_exists(block: Block) -> None:
    parser = build_parser()
    for line in _lines(block.text):
        command = list(line)
        while command and re.fullmatch(r"[A-Z_]+=.*", command[0]):  # VAR=value command
            command = command[1:]
        if not command:
            continue
        program, arguments = _program(command[0]), command[1:]
        where = f"{block}: {shlex.join(command)}"
        if program == "relayd":
            _check_relayd(parser, arguments, where)
        elif program == "make":
            assert set(arguments) <= _makefile_targets(), where
        elif program in {"pip", "pip3"}:
            _check_pip(arguments, where)
        elif program == "python" and arguments[:2] == ["-m", "pip"]:
            _check_pip(arguments[2:], where)
        else:
            assert program in OTHER_PROGRAMS or program.startswith("python"), (
                f"{where}: {program} is not a program the docs are known to use"
            )


# --- json ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block", blocks("json"), ids=_ids(blocks("json")))
def test_every_json_example_parses_and_envelopes_are_valid(block: Block) -> None:
    value = json.loads(block.text)
    if isinstance(value, dict) and {"id", "type", "args"} <= value.keys():
        envelope = Envelope.parse(block.text, value["id"])
        if "version" in envelope.meta:
            DomainEvent.of(envelope)


# --- toml ---------------------------------------------------------------------------------

# What a file a configuration names must hold to load, by key.
_FILE_TEXT = {
    "dsn_file": "postgresql://relayd@db.internal:5432/app\n",
    "secret_file": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    "token_file": "t0ken\n",
    "password_file": "p4ssword\n",
    "ca_file": "read when connecting\n",
}


@pytest.mark.parametrize("block", blocks("toml"), ids=_ids(blocks("toml")))
def test_every_toml_example_loads_as_a_configuration(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tomllib.loads(block.text)
    text = block.text
    for key, path in re.findall(r'^\s*([a-z_]+_file)\s*=\s*"([^"]+)"', text, re.MULTILINE):
        stand_in = tmp_path / f"{key}-{len(list(tmp_path.iterdir()))}"
        stand_in.write_text(_FILE_TEXT[key])
        text = text.replace(f'"{path}"', f'"{stand_in}"')
    config = tmp_path / "relayd.toml"
    config.write_text(text)
    clear_relayd_env(monkeypatch)
    load_settings(config)


# --- sql ----------------------------------------------------------------------------------

_GRANTS = re.compile(r"^-- relayd grants --role (\w+):")


@pytest.mark.parametrize("block", blocks("sql"), ids=_ids(blocks("sql")))
async def test_every_sql_example_runs(
    block: Block, database: Database, conn: asyncpg.Connection, cli_env: dict[str, str]
) -> None:
    grants = _GRANTS.match(block.text)
    if grants is not None:
        code, out, err = await run_relayd(
            "grants",
            "--role",
            grants.group(1),
            env=cli_env | {"RELAYD_DATABASE__DSN": database.dsn},
        )
        assert code == 0, err
        assert block.text == out, f"{block} is not what `relayd grants` prints"
        return
    transaction = conn.transaction()
    await transaction.start()
    try:
        if "$1" not in block.text:
            await conn.execute(block.text)
        else:  # a statement for a driver, its parameters given
            event_id = str(uuid7())
            job = json.dumps({"id": event_id, "type": "order.updated", "args": [{}]})
            for statement in filter(str.strip, _statements(block.text)):
                await conn.fetch(statement, event_id, job)
    finally:
        await transaction.rollback()


def _statements(text: str) -> list[str]:
    """The statements of a block without comments (none holds a `;` in a string)."""
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    return [statement for statement in code.split(";")]


# --- python -------------------------------------------------------------------------------

PYTHON_PAGES = sorted({block.page for block in blocks("python")})
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # noqa: S105 - the docs' example secret


async def _prepared(database: Database, conn: asyncpg.Connection, tmp_path: Path) -> dict[str, Any]:
    """What the pages leave to the reader: a connection and its DSN, a table of orders with
    order 42, SQLAlchemy's model of it, the relay's configuration file, a tracer, and one
    signed webhook delivery."""
    import psycopg  # noqa: PLC0415 - the drivers the examples use
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine  # noqa: PLC0415
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415
    from sqlalchemy.orm import DeclarativeBase, Session  # noqa: PLC0415

    from relayd.sinks.webhook.signing import parse_secrets, signature_header  # noqa: PLC0415

    await conn.execute("CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL)")
    await conn.execute("INSERT INTO orders VALUES (42, 'new')")

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __table__ = Table(
            "orders",
            MetaData(),
            Column("id", Integer, primary_key=True),
            Column("status", String, nullable=False),
        )

    config = tmp_path / "config.toml"
    config.write_text("[sink]\nkind = 'ojs'\n")
    alchemy = database.dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    body = json.dumps({"type": "order.paid", "timestamp": "2024-05-01T12:00:00Z", "data": {}})
    message_id, timestamp = str(uuid7()), int(datetime.now(UTC).timestamp())
    headers = {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(
            parse_secrets(SECRET), message_id, timestamp, body.encode()
        ),
    }
    return {
        "conn": conn,
        "dsn": database.dsn,
        "psycopg": psycopg,
        "Session": Session,
        "AsyncSession": AsyncSession,
        "Order": Order,
        "engine": create_engine(alchemy),
        "async_engine": create_async_engine(alchemy),
        "tracer": TracerProvider().get_tracer("docs"),
        "request_id": str(uuid7()),
        "changed_at": datetime.now(UTC),
        "config_path": str(config),
        "body": body,
        "headers": headers,
    }


async def _run(code: str, namespace: dict[str, Any], where: str) -> None:
    """Run a block as a module body with top-level `await` (as in an async function)."""
    compiled = compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)  # noqa: S307 - the documentation's own example
    if asyncio.iscoroutine(result):
        await result


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=[str(p.relative_to(ROOT)) for p in PYTHON_PAGES])
async def test_every_python_example_runs(
    page: Path, database: Database, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    namespace = await _prepared(database, conn, tmp_path)
    namespace["data"] = None
    try:
        for block in (b for b in blocks("python") if b.page == page):
            code = block.text.replace("/etc/relayd/config.toml", namespace["config_path"])
            if "AsyncSession(engine)" in code:  # the asynchronous example's engine
                code = code.replace("AsyncSession(engine)", "AsyncSession(async_engine)")
            if namespace.get("OrderUpdatedV1") is not None and namespace["data"] is None:
                namespace["data"] = namespace["OrderUpdatedV1"](order_id=42, status="paid")
            await _run(code, namespace, str(block))
    finally:
        namespace["engine"].dispose()
        await namespace["async_engine"].dispose()
    if any("append(" in b.text for b in blocks("python") if b.page == page):  # they reached it
        assert await conn.fetchval("SELECT count(*) FROM relayd.outbox") >= 1


# --- links --------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MENTION = re.compile(r"\b((?:docs|deploy|examples)/[\w./-]+\.(?:md|toml|yml|yaml|json|service))")


def _anchors(page: Path) -> set[str]:
    """A page's anchors: GitHub's slug of each heading, and each `<a id="...">`."""
    text = _FENCE.sub("", page.read_text())
    found = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def test_every_link_and_anchor_resolves() -> None:
    """Every relative link of the pages reaches a file of the repository and, with a
    `#fragment`, an anchor of that page."""
    broken = []
    for page in PAGES:
        text = _FENCE.sub("", page.read_text())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert broken == []


def test_every_file_the_code_and_configuration_names_exists() -> None:
    """`docs/...`, `deploy/...` and `examples/...` named in the package, the examples, the
    deployment files and the tests' docstrings exist (a page split or renamed leaves none
    behind)."""
    sources = [
        *ROOT.joinpath("relayd").rglob("*.py"),
        *ROOT.joinpath("relayd").rglob("*.sql"),
        *ROOT.joinpath("deploy").rglob("*.*"),
        *ROOT.joinpath("examples").glob("*.toml"),
        ROOT / "config.example.toml",
        *PAGES,
    ]
    missing = sorted(
        f"{source.relative_to(ROOT)}: {name}"
        for source in sources
        if source.suffix in {".py", ".sql", ".md", ".toml", ".yml", ".yaml", ".service"}
        for name in _MENTION.findall(source.read_text(errors="replace"))
        if not (ROOT / name.split("#")[0]).exists()
    )
    assert missing == []


def test_every_test_the_docs_name_exists() -> None:
    """A test named as proof (`tests/...py::test_name`, or a file) is in the suite: a proof
    renamed or deleted leaves no claim behind."""
    named = re.compile(r"`(tests/[\w/]+\.py)(?:::(test_\w+))?")
    missing = []
    for page in PAGES:
        for path, test in named.findall(page.read_text()):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
            elif test and not re.search(rf"def {test}\(", source.read_text()):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{test}")
    assert missing == []
