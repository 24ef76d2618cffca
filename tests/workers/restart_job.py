"""pretrain_gpt_paci.py with one fault injected on the first launch only, for the restart tests
(run under ``torchrun --max-restarts N``; later launches train undisturbed).

    PACI_TEST_FAULT=before_iteration:RANK:N    rank RANK SIGKILLs itself as iteration N starts
    PACI_TEST_FAULT=during_save:RANK:ITERATION rank RANK SIGKILLs itself inside the save of
                                               ITERATION (its iter_N.tmp exists, nothing written
                                               by this rank yet)
    PACI_TEST_FAULT=fast_clock:RANK:FACTOR     the training loop's clock runs FACTOR times too
                                               fast on rank RANK (time-based saves must still
                                               happen at the same iteration on every rank)

Prints ``PACI_TEST_KILLED <unix time>`` just before the kill and, on a restarted launch,
``PACI_TEST_FIRST_ITERATION <unix time>`` when the reporting rank finished its first iteration
after the resume (the restart time is the difference).
"""

import os
import signal
import sys
import time

from paci_megatron import training
from paci_megatron.arguments import parse_and_validate
from paci_megatron.mcore import checkpoint
from paci_megatron.restart import restart_count


def _say(line: str) -> None:
    """One write for the line and its newline: the ranks share torchrun's pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _kill_self() -> None:
    _say(f"PACI_TEST_KILLED {time.time():.3f}")
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(kind: str, rank: int, iteration: int) -> None:  # iteration: FACTOR for fast_clock
    if int(os.environ["RANK"]) != rank:
        return
    if kind == "before_iteration":
        original_step = training.train_step

        def train_step(job):
            if job.iteration + 1 == iteration:
                _kill_self()
            return original_step(job)

        training.train_step = train_step
    elif kind == "during_save":
        real = checkpoint.dist_checkpointing

        class DyingWriter:
            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def save(state, path, *args, **kwargs):
                if path.endswith(f"iter_{iteration:07d}.tmp"):
                    _kill_self()
                return real.save(state, path, *args, **kwargs)

        checkpoint.dist_checkpointing = DyingWriter()
    elif kind == "fast_clock":
        real, start = time.perf_counter, time.perf_counter()

        class FastClock:
            def __getattr__(self, name):
                return getattr(time, name)

            @staticmethod
            def perf_counter():
                return start + (real() - start) * iteration

        training.time = FastClock()
    else:
        raise ValueError(f"PACI_TEST_FAULT: unknown fault {kind!r}")


def _report_first_iteration() -> None:
    original_step = training.train_step
    seen = []

    def train_step(job):
        result = original_step(job)
        if job.reporter and not seen:
            seen.append(True)
            _say(f"PACI_TEST_FIRST_ITERATION {time.time():.3f}")
        return result

    training.train_step = train_step


def main() -> int:
    fault = os.environ.get("PACI_TEST_FAULT")
    if restart_count(os.environ) == 0 and fault:
        kind, rank, iteration = fault.split(":")
        _inject(kind, int(rank), int(iteration))
    else:
        _report_first_iteration()
    args, opts = parse_and_validate()
    return training.run(args, opts)


if __name__ == "__main__":  # the checkpoint writer's processes import this module again
    sys.exit(main())
