"""``python -m paci_megatron.run SCRIPT ...`` with one rank SIGKILLed as it starts its N-th
training iteration, on the first launch only (run under ``torchrun --max-restarts``).

    PACI_TEST_FAULT=before_iteration:RANK:N
"""

import os
import signal
import sys

from paci_megatron import run
from paci_megatron.restart import restart_count


def _kill_at(iteration: int) -> None:
    from megatron.training import training

    original, calls = training.train_step, [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == iteration:
            print("PACI_TEST_KILLED", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    training.train_step = train_step


def main() -> None:
    kind, rank, iteration = os.environ["PACI_TEST_FAULT"].split(":")
    first_launch = restart_count(os.environ) == 0
    if kind == "before_iteration" and first_launch and os.environ["RANK"] == rank:
        start = run.run_as_main

        def run_as_main(script: str) -> None:  # after paci_megatron.run installed its hooks
            _kill_at(int(iteration))
            start(script)

        run.run_as_main = run_as_main
    run.main(sys.argv[1:])


if __name__ == "__main__":
    main()
