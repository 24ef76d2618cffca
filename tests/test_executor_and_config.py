"""In-process tests: the executor with fake handlers, in-place steps under autograd, the data
replay, and flag validation (no process groups)."""

import sys

import pytest
import torch

from paci_megatron.arguments import ConfigError, build_parser, parse_and_validate, validate
from paci_megatron.autograd_versions import keep_version_counters
from paci_megatron.executor import (
    DriftBoundExceeded,
    DriftStats,
    ExecutionError,
    ReplayIterator,
    StageExecutor,
)
from paci_megatron.registry import SCHEDULES_BY_NAME
from paci_megatron.schedule import drift_bound, plan_stream


class FakeHandlers:
    def __init__(self):
        self.log = []

    def forward(self, mb):
        self.log.append(f"F{mb}")

    def backward(self, mb):
        self.log.append(f"B{mb}")

    def communicate(self, actions):
        self.log.append("+".join(map(str, actions)))

    def reduce(self, mb):
        self.log.append(f"R{mb}")

    def step(self, mb):
        self.log.append(f"T{mb}")


def test_executor_runs_the_plan_and_fuses_adjacent_communication():
    plan = plan_stream("paci", 4, 2, 4)
    handlers = FakeHandlers()
    drift = DriftStats(stage=1, bound=drift_bound(4, 1, 2))
    ex = StageExecutor(1, handlers, drift)
    for k in range(3):
        ex.run(plan.call(k)[1])
    assert "SF3+RB1" in handlers.log  # Megatron's send_forward_recv_backward pair
    assert [x for x in handlers.log if x.startswith("T")] == ["T1", "T3", "T5", "T7", "T9", "T11"]
    assert handlers.log.index("R3") + 1 == handlers.log.index("T3")  # the group's R, then T
    assert drift.max == 1 and drift.version == 6
    assert sorted(drift.fwd_version) == [12, 13]  # P-1-s = 2 forwards still in flight


def test_drift_guard_names_stage_microbatch_and_versions():
    plan = plan_stream("paci", 4, 1, 2)
    ex = StageExecutor(0, FakeHandlers(), DriftStats(stage=0, bound=2))  # true bound is 3
    with pytest.raises(DriftBoundExceeded, match=r"stage 0: micro-batch \d+ ran forward on weight "
                                                 r"version \d+ and backward on version \d+"):
        for k in range(4):
            ex.run(plan.call(k)[0])


def test_failed_action_reports_stage_action_and_context():
    class Broken(FakeHandlers):
        def backward(self, mb):
            raise RuntimeError("boom")

    ex = StageExecutor(2, Broken(), DriftStats(stage=2, bound=None))
    with pytest.raises(ExecutionError, match=r"stage 2 failed at B0: RuntimeError: boom") as err:
        ex.run(plan_stream("paci", 4, 4, 4).call(0)[2])
    assert "[B0]" in str(err.value)


def test_inplace_step_breaks_autograd_without_the_guard():
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(layer.parameters(), lr=0.5)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_backward_after_guarded_step_uses_the_new_weights():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(layer.parameters(), lr=0.5)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)  # forward with the old weights; x and W are saved
    old_w = layer.weight.detach().clone()
    layer(torch.randn(2, 4)).sum().backward()  # another micro-batch's gradient
    with keep_version_counters(list(layer.parameters())):
        opt.step()
    new_w = layer.weight.detach().clone()
    assert not torch.equal(new_w, old_w)
    grad_out = torch.randn(2, 3)
    y.backward(grad_out)
    assert torch.equal(x.grad, grad_out @ new_w)  # the current weights, not a stash
    assert not torch.allclose(x.grad, grad_out @ old_w)


def test_replay_iterator_serves_dropped_items_again_in_order():
    it = ReplayIterator(iter(range(100)))
    for mb in range(5):
        it.current = mb
        next(it)
    it.release(0)
    it.release(1)
    assert it.rewind([4, 2, 3]) == 3
    it.current = 7
    assert [next(it) for _ in range(4)] == [2, 3, 4, 5]


# --- flags --------------------------------------------------------------------------------

def _validate(argv, world=2):
    args = build_parser().parse_args(argv)
    return args, validate(args, world)


def test_defaults_are_consistent():
    args, opts = _validate(["--untie-embeddings-and-output-weights"])
    assert args.pipeline_model_parallel_size == 2 and args.num_microbatches == 8
    assert opts.accumulation == 8 and args.pipeline_schedule == "paci"


@pytest.mark.parametrize("argv,match", [
    (["--paci-accumulation-factor", "0"], "--paci-accumulation-factor must be >= 1"),
    (["--pipeline-schedule", "gpipe"], "invalid choice: 'gpipe'"),
])
def test_bad_values_are_refused_by_the_parser(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_and_validate(["--untie-embeddings-and-output-weights"] + argv, world_size=2)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--paci-accumulation-factor", "3"], "--paci-accumulation-factor 3 must divide"),
    (["--num-layers", "3"], "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--paci-accumulation-factor", "1", "--paci-max-drift", "0"],
     "--paci-max-drift 0 is below the theoretical bound"),
    (["--global-batch-size", "7"], "--global-batch-size 7 is not divisible"),
    (["--pipeline-schedule", "1f1b", "--paci-max-drift", "2"],
     "--paci-max-drift only applies to --pipeline-schedule paci, not 1f1b"),
    (["--pipeline-schedule", "interleaved"], "--num-layers-per-virtual-pipeline-stage"),
])
def test_bad_configuration_is_named(argv, match):
    with pytest.raises(ConfigError, match=match):
        _validate(["--untie-embeddings-and-output-weights"] + argv)


def test_paci_accepts_tied_embeddings_across_stages():
    args, _ = _validate([])  # tied is the default: PACI exchanges the tied weight itself
    assert not args.untie_embeddings_and_output_weights
    _validate([], world=4)
    # with the distributed optimizer, the overlaps and fp16 (data-parallel size 2)
    args, _ = _validate(["--use-distributed-optimizer", "--overlap-grad-reduce",
                         "--overlap-param-gather", "--fp16"], world=4)
    assert args.use_distributed_optimizer and args.fp16


def test_registry_is_open_and_names_known_schedules():
    assert SCHEDULES_BY_NAME.names() == ["1f1b", "interleaved", "paci"]
    assert SCHEDULES_BY_NAME.get("1f1b").make(None) is None  # stock Megatron, untouched


def test_entry_point_rejects_bad_flags_before_starting():
    from launch import launch

    proc = launch(
        [sys.executable, "pretrain_gpt_paci.py", "--paci-accumulation-factor", "0",
         "--untie-embeddings-and-output-weights"],
        timeout=120, env={"WORLD_SIZE": "2", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert proc.returncode == 2
    assert "--paci-accumulation-factor must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
