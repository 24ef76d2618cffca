"""Noise per rank: the fallback-warning filter is precise, and a bad flag under torchrun prints
one error line, once, without the usage text."""

import argparse

import pytest

from launch import REPO, run_python, run_torchrun
from messages import error_messages, names_flag


def test_only_the_fallback_warnings_are_silenced():
    code = ("import warnings, paci_megatron\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to "
            "Torch optimizers.')\n"
            "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "warnings.warn('Transformer Engine is not installed. Falling back to X')\n"
            "warnings.warn('Apex is not installed here, some other warning')\n")
    proc = run_python(code, python_flags=["-W", "always"], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Falling back to" not in proc.stderr
    assert "Apex is not installed here, some other warning" in proc.stderr


@pytest.mark.dist
def test_a_bad_flag_prints_one_error_line_once():
    code, out, err = run_torchrun("pretrain_gpt_paci.py", ["--num-layers", "abc"], nproc=2,
                                  timeout=120, check=False)
    assert code != 0
    messages = error_messages(out + err)
    assert len(messages) == 1 and names_flag(messages[0], "--num-layers"), out + err[-3000:]
    assert "usage:" not in out + err


@pytest.mark.parametrize("where", ["paci", "megatron_lm"])
def test_a_silent_rank_waits_for_local_rank_0_to_print(where, monkeypatch, capsys):
    """torchrun stops every rank once one exits: a rank that leaves the error line to local
    rank 0 must not exit first (it sleeps, and torchrun stops it when local rank 0 exits),
    or local rank 0 may be stopped before it printed (a bad --pipeline-schedule once exited 2
    with no message at all). Local rank 0 prints and exits at once."""
    from paci_megatron import arguments, quiet
    from paci_megatron import run as paci_run
    from paci_megatron.patches.megatron_lm import parser as mlm_parser

    slept = []
    monkeypatch.setattr(quiet.time, "sleep", slept.append)
    if where == "paci":
        parser = arguments.build_parser()
    else:  # the drop-in's parser, with the exit paci_megatron.run gives it
        parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
        parser.add_argument("--num-layers", type=int)
        mlm_parser._one_line_errors(parser, paci_run.exit_after_local_rank0)
    for local_rank, waits in (("1", [quiet.REPORTER_WAIT_S]), ("0", [])):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        slept.clear()
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--num-layers", "abc"])
        assert exit_.value.code == 2 and slept == waits
        err = capsys.readouterr().err
        assert (": error: argument --num-layers: " in err and "'abc'" in err) \
            == (local_rank == "0"), err
    assert quiet.REPORTER_WAIT_S >= 10  # longer than local rank 0's start-up lag under load
