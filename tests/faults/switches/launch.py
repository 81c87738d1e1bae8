"""`python -m tests.faults.switches.launch ARGS`: `relayd ARGS` with the fault suite's
failpoints and mutant installed from outside (`failpoints.py`, `mutants.py` beside this), as
`RELAYD_TEST_FAILPOINTS` and `RELAYD_TEST_MUTANT` name them.

relayd itself reads neither variable: a production relay started with them set runs
unchanged. Only this launcher, which the fault suite starts instead of `relayd`, arms
anything. A malformed value exits 2 in one line naming the variable.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping

from relayd.core.errors import EXIT_USAGE
from tests.faults.switches import failpoints, mutants
from tests.faults.switches.patches import Patches


def install(environ: Mapping[str, str], patches: Patches) -> None:
    """Arm and install what `environ` names; `FailpointSpecError` or `MutantSpecError` if a
    value does not parse."""
    failpoints.arm(environ)
    mutant = mutants.selected(environ)
    if mutant is not None:
        mutants.install(mutant, patches)
        # Said where the fault suite reads a process's output: a relay that is broken on
        # purpose must never pass for a real one.
        sys.stderr.write(f"mutant {mutant}: installed\n")
        sys.stderr.flush()
    # Outermost: a failpoint's place is where the cycle reaches it, before a mutant's step
    # (`after_claim` comes before `mark_before_post` marks the rows).
    failpoints.install(patches)


def main() -> int:
    """Install, then run `python -m relayd` with this process's arguments (it exits)."""
    try:
        install(os.environ, Patches())
    except (failpoints.FailpointSpecError, mutants.MutantSpecError) as exc:
        env = failpoints.ENV if isinstance(exc, failpoints.FailpointSpecError) else mutants.ENV
        sys.stderr.write(f"relayd: config error: {env}: {exc}\n")
        return EXIT_USAGE
    runpy.run_module("relayd", run_name="__main__", alter_sys=True)
    raise AssertionError("python -m relayd returned without exiting")


if __name__ == "__main__":
    sys.exit(main())
