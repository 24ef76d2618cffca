"""pretrain_gpt_paci.py, or Megatron-LM's pretrain_gpt.py through the drop-in, with every
torch.distributed collective counted.

    torchrun --standalone --nproc-per-node P tests/workers/count_collectives.py <training flags>
    torchrun ... tests/workers/count_collectives.py --drop-in path/to/pretrain_gpt.py <flags>

Before Megatron is imported, each collective of ``torch.distributed`` is wrapped; a call counts
when its group holds two or more ranks of this rank's pipeline group (so it spans stages) and
it runs between the end of iteration 1 and the start of the last iteration (the steady state).
Every rank prints ``RESULT {json}`` with its count and, for the first few, the function, the
group's ranks and the caller.
"""

import inspect
import json
import os
import sys
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "gather", "gather_object", "broadcast", "broadcast_object_list", "barrier",
               "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "scatter", "scatter_object_list")


class Counter:
    def __init__(self):
        self.on = False
        self.calls = []
        self._pipeline = None

    def pipeline_ranks(self):
        if self._pipeline is None:
            from megatron.core import parallel_state

            group = parallel_state.get_pipeline_model_parallel_group()
            self._pipeline = set(dist.get_process_group_ranks(group))
        return self._pipeline

    def wrap(self, name, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            if self.on:
                group = signature.bind(*args, **kwargs).arguments.get("group")
                ranks = set(dist.get_process_group_ranks(group or dist.group.WORLD))
                if len(ranks & self.pipeline_ranks()) > 1:
                    caller = traceback.format_stack(limit=4)[0].strip().splitlines()[0]
                    self.calls.append({"fn": name, "ranks": sorted(ranks), "caller": caller})
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn
        return counted

    def install(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self.wrap(name, getattr(dist, name)))


def mark_steady_state(training, counter):
    """Counting starts once iteration 1 returned and stops as the last iteration starts."""
    original = training.train_step

    def train_step(job):
        if job.iteration == job.args.train_iters - 1:
            counter.on = False
        result = original(job)
        if job.iteration == 1:
            counter.on = True
        return result

    training.train_step = train_step


def result_line(counter) -> str:
    rank = int(os.environ.get("RANK", "0"))
    return "RESULT " + json.dumps({"rank": rank, "count": len(counter.calls),
                                   "calls": counter.calls[:5]})


def drop_in(argv, counter):
    """The drop-in: counting starts with iteration 2's optimizer report (Megatron-LM's
    train_step; iteration 1's training log barriers all ranks for its timer, as at every
    --log-interval) and stops at the drain that ends training."""
    from paci_megatron import run
    from paci_megatron.patches.megatron_lm import hooks

    step, finish = hooks.LocalStepOptimizer.step, hooks.PaciTrainingHooks.finish

    def counted_step(self):
        counter.on = counter.on or self._paci_steps_before > 0  # from iteration 2 on
        return step(self)

    def counted_finish(self):
        counter.on = False
        print(result_line(counter), flush=True)
        return finish(self)

    hooks.LocalStepOptimizer.step = counted_step
    hooks.PaciTrainingHooks.finish = counted_finish
    return run.main(argv)


def main(argv):
    counter = Counter()
    counter.install()
    if argv and argv[0] == "--drop-in":
        return drop_in(argv[1:], counter)
    from paci_megatron import training

    mark_steady_state(training, counter)
    # training.finish destroys the process groups, so the result is printed before exiting
    original_finish = training.finish

    def finish(job):
        counter.on = False
        print(result_line(counter), flush=True)
        return original_finish(job)

    training.finish = finish
    pause_while_saving(training, counter)
    return training.main(argv)


def pause_while_saving(training, counter):
    """A checkpoint drains and gathers the stages' tables (documented): not the steady state,
    so a run may save at --save-interval and still be counted around it."""
    original = training.save

    def save(job):
        counting, counter.on = counter.on, False
        try:
            return original(job)
        finally:
            counter.on = counting

    training.save = save


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
