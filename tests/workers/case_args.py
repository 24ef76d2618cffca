"""The command line of the case workers (``--out DIR`` and case names), shared by
paci_cases, precision_cases and reference_cases."""

import argparse
import faulthandler
import os
from typing import Callable, Iterable, Optional


def parse_case_args(cases: Iterable[str],
                    add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
                    ) -> argparse.Namespace:
    """Parse ``--out DIR CASE...`` (plus a worker's own flags), arm the hang watchdog and
    create the output folder. A hang prints every thread's stack and exits non-zero instead
    of waiting for the test's timeout (ranks staggered by a second, so one speaks first)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("cases", nargs="+", choices=sorted(cases))
    args = parser.parse_args()
    faulthandler.dump_traceback_later(
        float(os.environ.get("PACI_TEST_HANG_S", "240")) + int(os.environ.get("RANK", "0")),
        exit=True)
    os.makedirs(args.out, exist_ok=True)
    return args
