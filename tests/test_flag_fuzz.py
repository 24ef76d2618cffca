"""Every value-taking flag of pretrain_gpt_paci.py, tried with bad values: each is refused
with the flag named (exit code 2, argparse style), before any process group exists."""

import pytest

from messages import error_line, names_flag
from paci_megatron.arguments import build_parser, parse_and_validate
from paci_megatron.config import REMOVED_FLAGS

BASE = ["--untie-embeddings-and-output-weights"]
BAD_VALUES = ["-1", "0", "abc", "", "1e400"]

# values that are legitimate for a flag (a name, a path to create, a seed of 0, ...)
ACCEPTED = {
    ("--seed", "0"), ("--lr", "0"), ("--min-lr", "0"), ("--weight-decay", "0"),
    ("--hidden-dropout", "0"), ("--attention-dropout", "0"), ("--clip-grad", "0"),
    ("--lr-warmup-iters", "0"), ("--adam-beta1", "0"), ("--adam-beta2", "0"),
    ("--paci-lookahead", "0"), ("--moe-aux-loss-coeff", "0"), ("--moe-z-loss-coeff", "0"),
    ("--moe-router-bias-update-rate", "0"),  # a bias that stays put
    ("--mtp-loss-scaling-factor", "0"),  # MTP layers trained for nothing: Megatron-LM takes it
    ("--save", "abc"), ("--save", "0"), ("--save", "-1"), ("--save", "1e400"),
    # a missing --load directory starts from scratch (Megatron-LM's --save DIR --load DIR)
    ("--load", "abc"), ("--load", "0"), ("--load", "-1"), ("--load", "1e400"),
    ("--metrics-file", "abc"), ("--metrics-file", "0"), ("--metrics-file", "-1"),
    ("--metrics-file", "1e400"),
    ("--tensorboard-dir", "abc"), ("--tensorboard-dir", "0"), ("--tensorboard-dir", "-1"),
    ("--tensorboard-dir", "1e400"),
}


def test_names_flag_needs_the_whole_flag():
    assert names_flag("error: argument --lr: must be >= 0", "--lr")
    assert names_flag("--lr 5 is too large", "--lr")
    assert names_flag("(--lr)", "--lr")
    assert not names_flag("--min-lr 1 is above", "--lr")
    assert not names_flag("--lr-warmup-iters must be >= 0", "--lr")
    assert not names_flag("lr must be >= 0", "--lr")
    assert error_line("usage: x [--lr LR] [--min-lr MIN_LR]\nx: error: --min-lr 1 is above") \
        == "--min-lr 1 is above"


def _value_flags():
    for action in build_parser()._actions:
        if action.option_strings and action.nargs != 0 and action.dest != "help":
            yield action.option_strings[0]


FLAGS = sorted(set(_value_flags()))


def test_the_table_covers_the_flags():
    assert len(FLAGS) >= 45 and "--paci-accumulation-factor" in FLAGS


@pytest.mark.parametrize("flag", FLAGS)
def test_bad_values_are_refused_with_the_flag_named(flag, capsys):
    accepted = []
    for value in BAD_VALUES:
        if (flag, value) in ACCEPTED:
            continue
        try:
            parse_and_validate(BASE + [flag, value], world_size=2)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            accepted.append(value)
            continue
        err = capsys.readouterr().err
        assert names_flag(error_line(err), flag), (flag, value, err)
        assert "Traceback" not in err
    assert not accepted, f"{flag} accepted {accepted}"


@pytest.mark.parametrize("argv,flags,match", [
    (["--fp16", "--initial-loss-scale", "1000"], ["--initial-loss-scale"], "power of two"),
    (["--fp16", "--min-loss-scale", "4096", "--initial-loss-scale", "1024"],
     ["--min-loss-scale", "--initial-loss-scale"], "above"),
    (["--fp16", "--bf16"], ["--fp16", "--bf16"], "exclusive"),
    (["--pipeline-schedule", "paci", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-layers", "4"], ["--pipeline-schedule", "--num-layers-per-virtual-pipeline-stage"],
     "virtual"),
    (["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size"], "3 must divide"),
    (["--save-interval", "5"], ["--save-interval", "--save"], "needs"),
    (["--save-interval-minutes", "5"], ["--save-interval-minutes", "--save"], "needs"),
    (["--recompute-granularity", "full"], ["--recompute-granularity", "--recompute-method"],
     "needs"),
    (["--mock-data", "--data-path", "x"], ["--mock-data", "--data-path"], "exclusive"),
    (["--min-lr", "1", "--lr", "0.1"], ["--min-lr", "--lr"], "above"),
])
def test_inconsistent_combinations_are_refused(argv, flags, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(BASE + argv, world_size=2)
    assert exit_info.value.code == 2
    err = error_line(capsys.readouterr().err)
    assert match in err and all(names_flag(err, flag) for flag in flags), err


@pytest.mark.parametrize("removed", [r.name for r in REMOVED_FLAGS])
@pytest.mark.parametrize("value", [[], ["1"]])
def test_a_removed_flag_stops_the_parse_naming_what_replaced_it(removed, value, capsys):
    """0.2.0 took these methods out: given, with or without a value, each flag stops the
    parse (exit 2) with the release that removed it and the flag to use instead."""
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(BASE + ["--pipeline-schedule", "paci", removed, *value], world_size=2)
    assert exit_info.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert names_flag(line, removed) and "removed in paci-megatron 0.2.0" in line
    assert any(names_flag(line, f) for f in ("--no-paci-weight-prediction", "--save")), line
