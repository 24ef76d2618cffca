"""Uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers,
--account-for-embedding/loss-in-pipeline-split, --pipeline-model-parallel-layout): each
stage's layer count against Megatron-Core's own placement, and every bad combination refused
at the command line with the flag and the fix named. No process is started."""

import pytest
import torch

from messages import error_line, names_flag
from paci_megatron.arguments import parse_and_validate
from paci_megatron.flag import ConfigError
from paci_megatron.layer_split import LayerSplit, expand_layout
from paci_megatron.restart import describe_mismatch, run_fingerprint

BASE = ["--untie-embeddings-and-output-weights"]
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"

SPLITS = [  # (layers, stages, split, each stage's transformer layers)
    (6, 3, LayerSplit(), (2, 2, 2)),
    (6, 3, LayerSplit(first=1, last=1), (1, 4, 1)),
    (6, 3, LayerSplit(first=2), (2, 2, 2)),
    (7, 3, LayerSplit(last=1), (3, 3, 1)),
    (4, 2, LayerSplit(first=1, last=3), (1, 3)),
    (5, 2, LayerSplit(first=1), (1, 4)),
    (10, 4, LayerSplit(first=2, last=2), (2, 3, 3, 2)),
    (4, 3, LayerSplit(embedding=True, loss=True), (1, 2, 1)),
    (5, 3, LayerSplit(embedding=True), (1, 2, 2)),
    (5, 3, LayerSplit(loss=True), (2, 2, 1)),
    (4, 1, LayerSplit(embedding=True, loss=True), (4,)),
    (6, 3, LayerSplit(layout="Et|tttt|tL"), (1, 4, 1)),
    (4, 4, LayerSplit(layout="E|tt|tt|L"), (0, 2, 2, 0)),
    (7, 4, LayerSplit(layout="Et,|(tt|)*2ttL"), (1, 2, 2, 2)),
    (5, 3, LayerSplit(layout="Et*2|t|ttL"), (2, 1, 2)),
]


def _megatron_placement(num_layers, stages, split):
    """Megatron-Core 0.16.1's own answer: per pipeline rank, the transformer layers its
    builder makes and their offset, from a TransformerConfig with the split's fields."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=stages, pipeline_dtype=torch.float32,
                               **split.config_fields())
    saved = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    counts, offsets = [], []
    try:
        for rank in range(stages):  # a layout reads the rank from parallel_state
            parallel_state.set_pipeline_model_parallel_rank(rank)
            counts.append(get_num_layers_to_build(config, pp_rank=rank))
            offsets.append(get_transformer_layer_offset(config, pp_rank=rank))
    finally:
        parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK = saved
    return tuple(counts), offsets


@pytest.mark.parametrize("num_layers,stages,split,expected", SPLITS)
def test_each_stage_gets_the_layers_megatron_core_places_there(num_layers, stages, split,
                                                               expected):
    counts = split.layers_per_stage(num_layers, stages)
    assert counts == expected
    theirs, offsets = _megatron_placement(num_layers, stages, split)
    assert theirs == counts
    # one run of layers after another: stage s starts where stage s-1 ended
    assert offsets == [sum(counts[:s]) for s in range(stages)]


@pytest.mark.parametrize("text", ["Et|tttt|tL", "Et*3|(tt|)*2,tL", "E|t|*2tL", "(Et|)*1t*2L",
                                  "E,t,|,t,L"])
def test_layout_expansion_equals_megatron_cores_parser(text):
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    letter = {"embedding": "E", "decoder": "t", "loss": "L"}
    theirs = "|".join("".join(letter[layer.name] for layer in stage)
                      for stage in PipelineParallelLayerLayout.parse_str_to_list(text))
    assert expand_layout(text) == theirs


def test_layout_groups_may_nest():
    assert expand_layout("E(t(t)*2|)*2L") == "Ettt|ttt|L"


def test_the_validator_fills_in_each_stages_layers():
    args, _ = parse_and_validate(BASE + ["--num-layers", "6", FIRST, "1", LAST, "1"],
                                 world_size=3)
    assert args.layers_per_stage == [1, 4, 1]
    args, _ = parse_and_validate(BASE + ["--num-layers", "6", LAYOUT, "Et|tttt|tL"],
                                 world_size=3)
    assert args.layers_per_stage == [1, 4, 1]
    args, _ = parse_and_validate(BASE + ["--num-layers", "6"], world_size=3)
    assert args.layers_per_stage == [2, 2, 2]


@pytest.mark.parametrize("world,argv,flags,match", [
    (4, ["--num-layers", "7", FIRST, "1", LAST, "1"], ["--num-layers", FIRST, LAST],
     "leaves 5 layers for the 2 other stages"),
    (3, ["--num-layers", "6", FIRST, "6"], ["--num-layers", FIRST], "leaves 0 layers"),
    (2, ["--num-layers", "4", FIRST, "1", LAST, "1"], [FIRST, LAST], "must add up to"),
    (1, ["--num-layers", "4", FIRST, "1"], [FIRST, "--pipeline-model-parallel-size"], "> 1"),
    (3, ["--num-layers", "6", FIRST, "1", EMBEDDING], [FIRST, EMBEDDING], "drop"),
    (3, ["--num-layers", "6", LAYOUT, "Et|tttt|tL", LAST, "1"], [LAYOUT, LAST], "drop"),
    (3, ["--num-layers", "6", EMBEDDING], ["--num-layers", EMBEDDING,
                                           "--pipeline-model-parallel-size"], "7 is not divisible"),
    (3, ["--num-layers", "7"], ["--num-layers", "--pipeline-model-parallel-size", FIRST],
     "not divisible"),
    (2, ["--num-layers", "6", LAYOUT, "Et|tttt|tL"], [LAYOUT, "--pipeline-model-parallel-size"],
     "has 3 stages"),
    (3, ["--num-layers", "6", LAYOUT, "Et|t|t|t|t|tL"],
     [LAYOUT, "--num-layers-per-virtual-pipeline-stage"], "virtual stages"),
    (3, ["--num-layers", "4", LAYOUT, "Et|tttt|tL"], [LAYOUT, "--num-layers"], "holds 6"),
    (3, ["--num-layers", "6", LAYOUT, "Et|ttxt|tL"], [LAYOUT], "unknown letter(s) x"),
    (3, ["--num-layers", "6", LAYOUT, "tE|tttt|tL"], [LAYOUT], "must open the first stage"),
    (3, ["--num-layers", "6", LAYOUT, "Et|tttt|LtL"], [LAYOUT], "once each"),
    (3, ["--num-layers", "6", LAYOUT, "Ettt||tttL"], [LAYOUT], "stage 1 holds no transformer"),
    (3, ["--num-layers", "6", LAYOUT, "Et|tttt|tmL"], [LAYOUT], "MTP"),
    (3, ["--num-layers", "6", LAYOUT, "E(t|tttt|tL"], [LAYOUT], "never closed"),
    (3, ["--num-layers", "6", LAYOUT, "Et)|tttt|tL"], [LAYOUT], "closes no"),
    (3, ["--num-layers", "6", LAYOUT, "Et*|tttt|tL"], [LAYOUT], "needs a count"),
    (3, ["--num-layers", "6", LAYOUT, "*Et|tttt|tL"], [LAYOUT], "repeats nothing"),
    (3, ["--num-layers", "6", LAYOUT, "||"], [LAYOUT], "is empty"),
    (3, ["--pipeline-schedule", "interleaved", "--num-layers", "6", FIRST, "2",
         "--num-layers-per-virtual-pipeline-stage", "1"],
     [FIRST, "--num-layers-per-virtual-pipeline-stage"], "not supported"),
])
def test_bad_splits_are_refused_naming_the_flags(world, argv, flags, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(BASE + argv, world_size=world)
    assert exit_info.value.code == 2
    err = error_line(capsys.readouterr().err)
    assert match in err and all(names_flag(err, flag) for flag in flags), err


def test_layer_split_raises_config_error_below_the_parser():
    """build.py asks the same object for the same check (a ValueError, with the flag)."""
    with pytest.raises(ConfigError, match=FIRST):
        LayerSplit(first=5).layers_per_stage(4, 2)


def _fingerprint(argv, world):
    args, cfg = parse_and_validate(BASE + argv, world_size=world)
    return run_fingerprint(vars(args), cfg)


def test_moving_layers_between_stages_reshards_like_a_new_p():
    even = _fingerprint(["--num-layers", "6"], 3)
    uneven = _fingerprint(["--num-layers", "6", FIRST, "1", LAST, "1"], 3)
    assert even["layers_per_stage"] == [2, 2, 2] and uneven["layers_per_stage"] == [1, 4, 1]
    assert describe_mismatch(even, uneven) == []  # the sharded checkpoint reshards
    dist = dict(even, use_distributed_optimizer=True)
    (line,) = describe_mismatch(dist, dict(uneven, use_distributed_optimizer=True))
    assert line.startswith("transformer layers per stage (")
    assert names_flag(line, FIRST) and "checkpoint [2, 2, 2], this run [1, 4, 1]" in line
    assert "keep its layers per stage" in line
    # a new P moves the layers too: its own line says so, once
    other_p = dict(dist, pipeline_model_parallel_size=2, layers_per_stage=[3, 3])
    assert [m.split(":")[0] for m in describe_mismatch(dist, other_p)] == [
        "--pipeline-model-parallel-size"]
    # a checkpoint from before the split was recorded is not checked on it
    old = {k: v for k, v in dist.items() if k != "layers_per_stage"}
    assert describe_mismatch(old, dict(uneven, use_distributed_optimizer=True)) == []


def test_compare_times_the_stage_with_the_most_layers_and_skips_interleaving(capsys):
    """compare's one-stage timing model drops the split's flags and takes the layers of the
    stage that sets the pace; interleaving takes no uneven stages, so that run is left out."""
    from paci_megatron.tools.compare import build_parser, paced_by, plan_runs, timing_flags

    flags = ["--num-layers", "8", FIRST, "1", LAST, "1", "--hidden-size", "64"]
    assert timing_flags(flags, 3) == ["--hidden-size", "64", "--num-layers", "3",
                                      "--pipeline-model-parallel-size", "1",
                                      "--pipeline-schedule", "1f1b"]
    assert timing_flags([f"{LAYOUT}=Et|tttt|tL", EMBEDDING, LOSS], 4)[:2] == ["--num-layers",
                                                                              "4"]
    args, _ = parse_and_validate(BASE + ["--num-layers", "8", FIRST, "1", LAST, "1"],
                                 world_size=4)
    assert paced_by(args) == 3  # 1/3/3/1
    even, _ = parse_and_validate(BASE + ["--num-layers", "8"], world_size=4)
    assert paced_by(even) == 2
    compare_args = build_parser().parse_args(["--out", "x"])
    names = [s.name for s in plan_runs(compare_args, flags + ["--pipeline-model-parallel-size",
                                                               "4"])]
    assert names == ["1f1b", "paci", "paci-a1"]
    assert f"skipping interleaved: uneven stages ({FIRST})" in capsys.readouterr().out
    assert "interleaved" in [s.name for s in plan_runs(compare_args, ["--num-layers", "8"])]


# --- each stage at its own pace: the cost lines' and compare's projection ------------------

def test_an_uneven_pipeline_runs_at_its_slowest_stages_pace():
    """P = 4, a = M = 8, forward 1, backward 2. PACI has no bubble, so a call takes the
    slowest stage's work: 8 x 3 x 2 = 48 with stage 2 twice as slow, and a faster stage 0
    changes nothing (24). 1F1B's flush crosses stage 0 once on its critical path (the first
    forward, the last backward): at half pace it saves 1.5 of the even 33 = (M + P - 1) x 3."""
    from paci_megatron.simulate import Costs, seconds_per_call

    def per_call(kind, scale):
        return seconds_per_call(kind, 4, 8, 8, Costs(1.0, 2.0, stage_scale=scale))

    assert per_call("paci", ()) == per_call("paci", (1.0,) * 4) == 24.0
    assert per_call("paci", (1.0, 1.0, 2.0, 1.0)) == 48.0
    assert per_call("paci", (0.5, 1.0, 1.0, 1.0)) == 24.0
    assert per_call("flush", ()) == 33.0
    assert per_call("flush", (0.5, 1.0, 1.0, 1.0)) == 31.5
    assert per_call("flush", (1.0, 1.0, 2.0, 1.0)) > 48.0


def test_the_cost_lines_take_each_stages_measured_forward():
    """The end-of-run projection (throughput.projected_throughput) reads each stage's own
    forward time (``stage_forward_ms``, every stage times its forwards); a stage that timed
    none leaves every stage at the mean pace."""
    from paci_megatron.simulate import Costs, seconds_per_call
    from paci_megatron.throughput import projected_throughput, stage_scale

    def rows(forwards):
        return [{"stage": s, "steps": 1, "histogram": {0: 8}, "stage_forward_ms": f}
                for s, f in enumerate(forwards)]

    assert stage_scale([10.0, 10.0, 20.0, 10.0]) == (0.8, 0.8, 1.6, 0.8)
    assert stage_scale([10.0, None, 20.0, 10.0]) == ()
    uneven = Costs(1.0, 2.0, stage_scale=(0.8, 0.8, 1.6, 0.8))
    expect = seconds_per_call("flush", 4, 8, 8, uneven) / seconds_per_call("paci", 4, 8, 8,
                                                                            uneven)
    assert projected_throughput(rows([10.0, 10.0, 20.0, 10.0])) == (expect, expect)
    assert expect < 33.0 / 24.0  # the bubble PACI saves is smaller than the even one
    assert projected_throughput(rows([10.0, None, 20.0, 10.0])) == (33.0 / 24.0, 33.0 / 24.0)


def test_compare_projects_each_stage_at_its_layers_share():
    """compare times a stage of the largest stage's layers and runs each stage at its share:
    1/4/1 at P = 3, M = a = 8 (forward 1, backward 2). PACI's iteration is the middle stage's
    work, 24; 1F1B's adds to it only stage 0's first forward and last backward (0.25 + 0.5),
    not the even ramp's 6: the projected gain is 24.75 / 24, not 30 / 24."""
    from paci_megatron.simulate import Costs
    from paci_megatron.tools import tta
    from paci_megatron.tools.compare import stage_scale

    assert stage_scale([2, 2, 2]) == () and stage_scale([1, 4, 1]) == (0.25, 1.0, 0.25)
    uneven = tta.RunShape("paci", 3, 8, 8, stage_scale=stage_scale([1, 4, 1]))
    assert tta.seconds_per_iteration(uneven, Costs(1.0, 2.0)) == (24.75, 24.0)
    assert tta.seconds_per_iteration(tta.RunShape("paci", 3, 8, 8), Costs(1.0, 2.0)) == \
        (30.0, 24.0)
