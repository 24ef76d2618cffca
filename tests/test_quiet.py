"""Noise per rank: the fallback-warning filter is precise, and a bad flag under torchrun prints
one error line, once, without the usage text."""

import subprocess
import sys

import pytest

from launch import REPO, run_torchrun
from messages import error_messages, names_flag


def test_only_the_fallback_warnings_are_silenced():
    code = ("import warnings, paci_megatron\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to "
            "Torch optimizers.')\n"
            "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "warnings.warn('Transformer Engine is not installed. Falling back to X')\n"
            "warnings.warn('Apex is not installed here, some other warning')\n")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
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
