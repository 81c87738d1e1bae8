"""A permission error in relayd's words: the privileges the refused statement needs on the
object PostgreSQL names, read from the one list of what each statement needs
(`relayd/store/privileges.py`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from relayd.store.privileges import PRIVILEGE_ORDER, STATEMENTS, Kind, Obj

# PostgreSQL's words for a missing privilege and a missing ownership (SQLSTATE 42501). In
# another lc_messages they do not match, and the server's own message is shown as it is.
_DENIED = re.compile(r'^permission denied for (\w+) "?([^"]+)"?$')
_NOT_OWNER = re.compile(r'^must be owner of (\w+(?: \w+)?) "?([^"]+)"?$')


def explain_denial(statement: str, message: str) -> str:
    """PostgreSQL's refusal of `statement` for a missing privilege (SQLSTATE 42501), in one
    line: the privileges the statement needs on the object PostgreSQL names."""
    denied = _DENIED.match(message)
    if denied:
        kind, name = denied.groups()
        needed = _needed(statement, kind, name)
        if needed:
            return f"permission denied: needs {_words(needed)} on {kind} {name}"
    not_owner = _NOT_OWNER.match(message)
    if not_owner:
        kind, name = not_owner.groups()
        return f"permission denied: only the owner of {kind} {name} may run it"
    return f"{message} (SQLSTATE 42501)"


def _needed(statement: str, kind: str, name: str) -> tuple[str, ...]:
    """What `statement` needs on the object PostgreSQL named: from its own needs if they
    name the object, else from every statement's (a method may run several statements
    under one name)."""
    if kind == Kind.SCHEMA:
        return ("USAGE",)
    objects = [
        obj for obj in Obj if obj.kind == kind and (obj.value[1] == name or kind == Kind.DATABASE)
    ]
    if not objects and kind == Kind.TABLE:
        objects = [Obj.OUTBOX]  # any other table relayd reads is the outbox
    if not objects:
        return ()
    [obj] = objects
    own = STATEMENTS.get(statement, {}).get(obj)
    if own:
        return own
    found = {p for needs in STATEMENTS.values() for p in needs.get(obj, ())}
    return tuple(p for p in PRIVILEGE_ORDER if p in found)


def _words(privileges: Sequence[str]) -> str:
    if len(privileges) == 1:
        return privileges[0]
    return f"{', '.join(privileges[:-1])} and {privileges[-1]}"
