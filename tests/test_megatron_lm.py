"""Megatron-LM's own pretrain_gpt.py, unchanged, through ``python -m paci_megatron.run``.

The end-to-end tests need Megatron-LM checkouts (the tags of ``patches/versions.py``), named
by the environment variable MEGATRON_LM_PATH, and are skipped without it. It is a list
(``os.pathsep`` between entries); each entry is a checkout, or ``CHECKOUT@SITE`` where SITE is
a folder holding the megatron-core of that checkout's release (``pip install --no-deps
--target SITE megatron-core==X``), put first on the path of every process launched for it.
Every end-to-end test runs once per entry; an entry whose release differs from the
megatron-core it would run with is skipped, saying so. They run 2 pipeline stages on
CPU/gloo with mock data, for the stock ``1f1b`` schedule and for ``paci``. The unit tests at
the top need no checkout.
"""

import argparse
import math
import os
import re
import subprocess
import sys
import textwrap
import types
from typing import List, NamedTuple, Optional

import pytest

from launch import (REPO, checkpoint_of_iteration, kill_tree, launch, megatron_lm_args,
                    run_python, run_torchrun, same_tensors, start, torchrun_cmd)

from paci_megatron import run as paci_run
from paci_megatron.patches import megatron_lm, release_check, versions

class Checkout(NamedTuple):
    """One MEGATRON_LM_PATH entry: a Megatron-LM checkout and the megatron-core it runs with."""

    root: str
    site: str  # "" for the installed megatron-core

    @property
    def script(self) -> str:
        return os.path.join(self.root, "pretrain_gpt.py")

    @property
    def pythonpath(self) -> str:
        return os.pathsep.join(p for p in (REPO, self.site, os.environ.get("PYTHONPATH", ""))
                               if p)

    def mcore_version(self) -> Optional[str]:
        if not self.site:
            return release_check.installed_megatron_core_version()
        return megatron_lm.megatron_lm_checkout_version(self.site)  # same file, same fields


def checkouts() -> List[Checkout]:
    found = []
    for entry in os.environ.get("MEGATRON_LM_PATH", "").split(os.pathsep):
        if entry:
            root, _, site = entry.partition("@")
            found.append(Checkout(os.path.abspath(root), os.path.abspath(site) if site else ""))
    return found


@pytest.fixture(scope="module", params=checkouts() or [None],
                ids=lambda c: os.path.basename(c.root) if c else "no-checkout")
def checkout(request) -> Checkout:
    """Each MEGATRON_LM_PATH entry in turn (skips without one, or where its release is not
    that of the megatron-core it would run with)."""
    found = request.param
    if found is None or not os.path.isfile(found.script):
        pytest.skip("MEGATRON_LM_PATH names no Megatron-LM checkout with pretrain_gpt.py "
                    f"(tested tags: {', '.join(r.megatron_lm_tag for r in versions.RELEASES)})")
    mlm, mcore = megatron_lm.megatron_lm_checkout_version(found.root), found.mcore_version()
    if mlm is None or mcore is None or versions.minor_of(mlm) != versions.minor_of(mcore):
        pytest.skip(f"{found.root} is Megatron-LM {mlm}, but it would run with megatron-core "
                    f"{mcore}: give it a megatron-core of its release (CHECKOUT@SITE)")
    return found


def _has_rampup() -> bool:
    from paci_megatron.mcore.compat import has_batch_size_rampup

    return has_batch_size_rampup()


needs_rampup = pytest.mark.skipif(not _has_rampup(), reason="megatron-core 0.18 removed the "
                                  "batch-size ramp-up (--rampup-batch-size is refused there)")

# A tiny GPT on CPU: the local (non-Transformer-Engine) layers and no fused kernels.
CPU_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
]
MODEL_FLAGS = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    "--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights",
]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?learning rate: (\S+) \|.*?"
                       r"lm loss: (\S+) \|.*?grad norm: (\S+) \|")
TIED = re.compile(r"> PACI tied embedding: staleness max (\d+) \(bound (\d+)\), histogram "
                  r"\{[^}]*\}; stage 0 and last stage copies (\w+) after the drain")
DRIFT = re.compile(r"> PACI stage (\d+): max drift (\d+) \(bound (\d+)\), histogram \{[^}]*\}, "
                   r"local steps (\d+)")


# --- unit tests (no checkout needed) --------------------------------------------------------

def test_paci_flags_default_to_stock():
    args = paci_run.parse_paci_arguments(["--num-layers", "4", "--lr", "1e-3"])
    assert args.pipeline_schedule == "1f1b"
    assert args.paci_accumulation_factor is None and args.paci_max_drift is None
    args = paci_run.parse_paci_arguments(
        ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "8", "--seq-length", "9"])
    assert (args.pipeline_schedule, args.paci_accumulation_factor) == ("paci", 8)
    with pytest.raises(SystemExit):
        paci_run.parse_paci_arguments(["--pipeline-schedule", "gpipe"])
    with pytest.raises(SystemExit):
        paci_run.parse_paci_arguments(["--paci-accumulation-factor", "0"])


@pytest.mark.parametrize("overrides,message", [
    (dict(num_layers_per_virtual_pipeline_stage=1), "virtual pipeline stages"),
    # M goes 2, 4, 6, 8 (data-parallel size 1 at P=2 on 2 ranks): a=4 divides neither 2 nor 6
    pytest.param(dict(rampup_batch_size=[4, 4, 100], paci_accumulation_factor=4),
                 "--paci-accumulation-factor 4 must divide every number of micro-batches per "
                 "iteration that --rampup-batch-size goes through [2, 4, 6, 8] (not [2, 6])",
                 marks=needs_rampup),
    (dict(step_batch_size_schedule="0:4 64:8"), "--step-batch-size-schedule"),
    (dict(rerun_mode="report_determinism_stats"), "--rerun-mode"),
    (dict(apply_layernorm_1p=True), "--apply-layernorm-1p"),
    (dict(fp16=True, initial_loss_scale=1000.0, min_loss_scale=1.0, loss_scale=None),
     "--initial-loss-scale 1000: --pipeline-schedule paci with --fp16 needs a power of two"),
    (dict(pipeline_schedule="1f1b", paci_accumulation_factor=4), "only applies to"),
    (dict(pipeline_schedule="interleaved"), "--num-layers-per-virtual-pipeline-stage"),
    # MoE options whose collectives span stages, or that gloo cannot run
    (dict(num_experts=4, flextron=True), "does not support --flextron"),
    (dict(num_experts=4, moe_expert_rank_capacity_factor=1.5),
     "--moe-expert-rank-capacity-factor: Megatron-LM then wraps"),
    (dict(num_experts=4, overlap_moe_expert_parallel_comm=True),
     "--overlap-moe-expert-parallel-comm"),
    (dict(num_experts=4, expert_tensor_parallel_size=2, distributed_backend="gloo"),
     "--expert-tensor-parallel-size > 1 does not run on gloo"),
    (dict(num_experts=4, tensor_model_parallel_size=2, world_size=4, distributed_backend="gloo"),
     "--expert-tensor-parallel-size > 1 does not run on gloo"),
])
def test_bad_flag_combinations_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        paci_run.validate_flags(megatron_lm_args(**overrides))


@needs_rampup
def test_rampup_and_overlapped_param_gather_are_accepted():
    paci_run.validate_flags(megatron_lm_args(rampup_batch_size=[4, 4, 100]))  # a follows M
    paci_run.validate_flags(megatron_lm_args(rampup_batch_size=[4, 4, 100],
                                           paci_accumulation_factor=2))
    paci_run.validate_flags(megatron_lm_args(overlap_param_gather=True))


def test_tied_embeddings_take_the_realistic_flags_under_paci():
    """Megatron-LM's default, tied embeddings, with the distributed optimizer, both overlaps
    and fp16 (tied.py: the reduced gradient and the master shards travel)."""
    cfg = paci_run.validate_flags(megatron_lm_args(
        untie_embeddings_and_output_weights=False, use_distributed_optimizer=True,
        overlap_grad_reduce=True, overlap_param_gather=True, fp16=True,
        initial_loss_scale=2.0 ** 32, min_loss_scale=1.0, loss_scale=None))
    assert cfg is not None and cfg.schedule == "paci"


def test_rampup_is_refused_where_megatron_core_no_longer_ramps(monkeypatch):
    from paci_megatron.mcore import compat

    monkeypatch.setattr(compat, "has_batch_size_rampup", lambda: False)
    with pytest.raises(ValueError, match=r"--rampup-batch-size 4 4 100: the installed "
                                         r"megatron-core no longer ramps the batch size"):
        paci_run.validate_flags(megatron_lm_args(rampup_batch_size=[4, 4, 100]))


def test_fp16_and_per_token_loss_are_accepted_under_paci():
    paci_run.validate_flags(megatron_lm_args(fp16=True, initial_loss_scale=2.0 ** 32,
                                           min_loss_scale=1.0, loss_scale=None))
    paci_run.validate_flags(megatron_lm_args(calculate_per_token_loss=True))


def test_moe_is_accepted_under_paci_with_its_stage_local_parts():
    """MoE at P > 1: the expert bias, fp16 and expert parallelism with the distributed
    optimizer pass the drop-in's validator (what cannot stay within a stage is refused in
    test_bad_flag_combinations_are_refused)."""
    cfg = paci_run.validate_flags(megatron_lm_args(
        num_experts=4, moe_router_enable_expert_bias=True, fp16=True,
        expert_model_parallel_size=2, world_size=4, use_distributed_optimizer=True))
    assert cfg is not None and cfg.shape.num_stages == 2


def test_stock_schedules_are_not_checked():
    paci_run.validate_flags(megatron_lm_args(pipeline_schedule="1f1b",
                                           untie_embeddings_and_output_weights=False,
                                           num_layers_per_virtual_pipeline_stage=2,
                                           fp16=True))  # stock Megatron's own fp16
    paci_run.validate_flags(megatron_lm_args(pipeline_schedule="interleaved",
                                           num_layers_per_virtual_pipeline_stage=1))
    paci_run.validate_flags(megatron_lm_args())
    paci_run.validate_flags(megatron_lm_args(untie_embeddings_and_output_weights=False))  # tied
    paci_run.validate_flags(megatron_lm_args(use_distributed_optimizer=True,
                                           overlap_grad_reduce=True))  # untied: not checked


def test_nadam_is_one_more_choice_of_megatron_lms_optimizer_flag():
    """--optimizer nadam parses in a parser with Megatron-LM's --optimizer, is checked as
    nadam (the look-ahead refused, the default prediction off, also when the runtime checks
    again after Megatron-LM has it as adam), and reaches Megatron-LM as adam."""
    from paci_megatron.config import resolve

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"])
    paci_run.add_arguments(parser)
    assert parser.parse_args(["--optimizer", "sgd"]).optimizer == "sgd"
    with pytest.raises(SystemExit):
        parser.parse_args(["--optimizer", "adamw"])
    parsed = parser.parse_args(["--optimizer", "nadam", "--pipeline-schedule", "paci"])
    assert paci_run.requested_optimizer(["--lr", "1", "--optimizer=nadam"]) == "nadam"
    assert paci_run.requested_optimizer(["--lr", "1"]) is None
    with pytest.raises(ValueError, match="--paci-lookahead 2 follows Adam's and SGD's steps, "
                                         "not --optimizer nadam"):
        paci_run.check_and_adapt(megatron_lm_args(optimizer=parsed.optimizer, paci_lookahead=2.0,
                                                  bf16=True))
    args = megatron_lm_args(optimizer=parsed.optimizer, bf16=True)
    before = paci_run.check_and_adapt(args)
    assert (args.optimizer, args.paci_optimizer) == ("adam", "nadam")
    after = resolve(args, paci_run.megatron_lm_layout(args))
    assert before.notes == after.notes
    assert "not --optimizer nadam" in " ".join(after.notes)
    adam = megatron_lm_args(bf16=True)
    paci_run.check_and_adapt(adam)
    assert adam.optimizer == "adam" and not hasattr(adam, "paci_optimizer")


def test_train_step_sees_the_local_steps():
    record = types.SimpleNamespace
    runtime = types.SimpleNamespace(steps=[record(update_successful=True, grad_norm=9.0)])
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.5}], zero_grad=lambda: "zeroed")
    proxy = megatron_lm.LocalStepOptimizer(optimizer, runtime, steps_before=1)
    with pytest.raises(RuntimeError, match="no local step"):
        proxy.step()
    runtime.steps += [record(update_successful=True, grad_norm=1.5),
                      record(update_successful=True, grad_norm=2.5)]
    assert proxy.step() == (True, 2.5, None)
    runtime.steps.append(record(update_successful=False, grad_norm=float("nan")))
    assert proxy.step()[0] is False  # one skipped local step: the iteration counts as skipped
    assert proxy.param_groups == [{"lr": 0.5}] and proxy.zero_grad() == "zeroed"

    calls = []
    scheduler = types.SimpleNamespace(step=lambda increment: calls.append(increment), num_steps=7)
    local = megatron_lm.LocalStepScheduler(scheduler)
    local.step(increment=64)
    assert calls == [] and local.num_steps == 7


def test_checkout_version_is_read_as_text(tmp_path):
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    assert megatron_lm.megatron_lm_checkout_version(str(tmp_path)) is None
    (core / "package_info.py").write_text(textwrap.dedent("""\
        MAJOR = 0
        MINOR = 20
        PATCH = 0
        PRE_RELEASE = ''
        import subprocess as _subprocess  # newer checkouts ask git for a suffix
    """))
    assert megatron_lm.megatron_lm_checkout_version(str(tmp_path)) == "0.20.0"


def test_other_megatron_lm_versions_are_refused(tmp_path):
    """A checkout whose megatron/core/package_info.py says 0.15.0 stops with the versions
    that work (run in a subprocess: it changes sys.path and imports megatron.core)."""
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core").mkdir()
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 15\nPATCH = 0\nPRE_RELEASE = ''\n")
    code = textwrap.dedent(f"""
        from paci_megatron.patches import megatron_lm
        megatron_lm.prepare_import_path({str(tmp_path)!r})
        try:
            megatron_lm.check_megatron_lm()
        except megatron_lm.UnsupportedMegatronLM as exc:
            print("REFUSED", exc)
    """)
    out = run_python(code, cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "version 0.15.0" in out.stdout
    assert all(r.megatron_lm_tag in out.stdout for r in versions.RELEASES)


# --- Megatron-LM's pretrain_gpt.py end to end -----------------------------------------------

def run_pretrain_gpt(checkout, extra, cwd, timeout=300, nproc=2, model_flags=MODEL_FLAGS):
    """torchrun ``nproc`` processes of ``-m paci_megatron.run pretrain_gpt.py``; (rc, stdout,
    stderr). On a timeout both workers and torchrun are killed (torchrun starts each worker in
    a session of its own)."""
    cmd = torchrun_cmd("paci_megatron.run", [checkout.script, *CPU_FLAGS, *model_flags, *extra],
                       nproc=nproc, module=True)
    env = dict(os.environ, PYTHONPATH=checkout.pythonpath)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    done = launch(cmd, cwd=cwd, env=env, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def _ok(checkout, extra, cwd, **kwargs):
    rc, out, err = run_pretrain_gpt(checkout, extra, cwd, **kwargs)
    assert rc == 0, f"exit code {rc}\n--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
    return out


def iterations(out):
    return [dict(zip(("iteration", "of", "lr", "loss", "grad_norm"), m.groups()))
            for m in ITERATION.finditer(out)]


def assert_resumes_exactly(resumed, uninterrupted):
    """The logged iterations of a resumed run against the same iterations of the run that
    was not interrupted: equal learning rates and grad norms, and an equal loss at the first.
    Megatron-LM does not reset its loss sums after a run's first logged iteration, so the
    next loss it logs is the mean of both: compared as such, to the printed precision."""
    assert [(r["lr"], r["grad_norm"]) for r in resumed] == \
        [(r["lr"], r["grad_norm"]) for r in uninterrupted]
    assert resumed[0]["loss"] == uninterrupted[0]["loss"]
    first, second = (float(r["loss"]) for r in uninterrupted[:2])
    assert float(resumed[1]["loss"]) == pytest.approx((first + second) / 2, rel=2e-6)


def resume_against_straight(checkout, flags, tmp_path):
    """``flags`` (with --save-interval 2) run twice: interrupted at iteration 2 and resumed
    with --load, and straight through. Asserts the resumed run goes on exactly as the straight
    one; returns the outputs (interrupted, resumed, straight)."""
    for sub in ("half", "straight"):
        (tmp_path / sub).mkdir()
    save = ["--save", str(tmp_path / "c")]
    half = _ok(checkout, [*flags, *save, "--exit-interval", "2"], tmp_path / "half")
    resumed = _ok(checkout, [*flags, *save, "--load", str(tmp_path / "c")], tmp_path / "half")
    straight = _ok(checkout, [*flags, "--save", str(tmp_path / "s")], tmp_path / "straight")
    whole = iterations(straight)
    assert [r["iteration"] for r in iterations(resumed)] == ["3", "4"], resumed[-3000:]
    assert iterations(half) == whole[:2]
    assert_resumes_exactly(iterations(resumed), whole[2:])
    return half, resumed, straight


def drift(out):
    return {int(m.group(1)): dict(max=int(m.group(2)), bound=int(m.group(3)),
                                  steps=int(m.group(4))) for m in DRIFT.finditer(out)}


@pytest.fixture(scope="module")
def stock_run(checkout, tmp_path_factory):
    return _ok(checkout, ["--pipeline-schedule", "1f1b"], tmp_path_factory.mktemp("stock"))


@pytest.mark.dist
def test_stock_1f1b_is_untouched(checkout, stock_run):
    out = stock_run
    assert "with --pipeline-schedule 1f1b" in out and "hooks: none" in out
    rows = iterations(out)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert "PACI" not in out  # no runtime, no drain, no drift report
    assert "validation loss at iteration 2" in out


@pytest.mark.dist
def test_paci_one_local_step_per_iteration(checkout, stock_run, tmp_path):
    """a = micro-batches per iteration (the default): the first iteration's forwards all run
    on the initial weights, so its loss equals stock 1F1B's; the LR schedule is the same."""
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci"], tmp_path)
    assert rc == 0, f"exit code {rc}\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
    assert "hooks: setup_model_and_optimizer, train_step, save_checkpoint, train" in out
    # Megatron-Core's and Megatron-LM's per-module fallback warnings: one line from rank 0
    assert "not installed. Falling back to" not in out + err, err[-3000:]
    assert (out + err).count("are not installed: Megatron-Core uses its local torch") == 1
    rows, stock = iterations(out), iterations(stock_run)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    assert rows[0]["loss"] == stock[0]["loss"]
    assert [r["lr"] for r in rows] == [r["lr"] for r in stock]
    assert "validation loss at iteration 2" in out  # evaluation without a drain
    assert drift(out) == {0: dict(max=1, bound=1, steps=4), 1: dict(max=0, bound=0, steps=4)}


@pytest.mark.dist
def test_weight_prediction_and_the_default_reach_megatron_lms_run(checkout, tmp_path):
    """Through the drop-in, in bf16: the default run differs from the paper's plain PACI
    exactly when the default is not plain PACI; --paci-weight-prediction (the default's method,
    so then the same run: not launched twice) is announced and changes the run from its
    second iteration on (the first has no optimizer state to predict from)."""
    from test_entry_point import default_is_plain_paci, plain_paci_flags

    plain = ["--pipeline-schedule", "paci", "--bf16", *plain_paci_flags()]
    runs = {"plain": plain, "default": ["--pipeline-schedule", "paci", "--bf16"]}
    if default_is_plain_paci():
        runs["predict"] = [*plain[:3], "--paci-weight-prediction"]
    out = {}
    for name, flags in runs.items():
        (tmp_path / name).mkdir()
        out[name] = _ok(checkout, flags, tmp_path / name)
    out.setdefault("predict", out["default"])
    assert "stale forwards on predicted weights" in out["predict"]
    rows = {name: [r["loss"] for r in iterations(text)] for name, text in out.items()}
    assert len(rows["plain"]) == 4 and rows["predict"][0] == rows["plain"][0]
    assert rows["predict"][2:] != rows["plain"][2:]
    assert drift(out["predict"]) == drift(out["plain"])
    assert (rows["default"] != rows["plain"]) == (not default_is_plain_paci())
    # the end of the run says what the prediction cost (the stage that predicts) and no more
    assert "> PACI stage 0: weight prediction on" in out["predict"]
    assert "> PACI: weight prediction's cost leaves" in out["predict"]
    assert "weight prediction's cost" not in out["plain"]


@pytest.mark.dist
def test_paci_accumulation_factor_and_checkpoints(checkout, stock_run, tmp_path):
    """a = 2 of 4 micro-batches: two local steps per stage and iteration; checkpoints at
    iterations 2 and 4, each after a drain."""
    out = _ok(checkout, ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "2",
               "--save", str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path)
    rows, stock = iterations(out), iterations(stock_run)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    assert [r["lr"] for r in rows] == [r["lr"] for r in stock]
    assert out.count("drained the pipeline before saving a checkpoint") == 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert drift(out) == {0: dict(max=1, bound=1, steps=8), 1: dict(max=0, bound=0, steps=8)}


def test_the_listed_default_differences_with_megatron_lm_are_all_there_are(checkout):
    """Every flag pretrain_gpt_paci.py shares with Megatron-LM has Megatron-LM's default, or is
    in arguments.MEGATRON_LM_DEFAULT_DIFFERENCES (which docs/megatron-lm.md lists); run in a
    subprocess (it imports Megatron-LM's training code)."""
    code = textwrap.dedent(f"""
        import argparse
        from paci_megatron.arguments import MEGATRON_LM_DEFAULT_DIFFERENCES, build_parser
        from paci_megatron.patches import megatron_lm
        megatron_lm.prepare_import_path({checkout.root!r})
        from megatron.training import arguments as mlm
        parser = argparse.ArgumentParser(allow_abbrev=False)
        for name in sorted(n for n in dir(mlm) if n.startswith("_add_") and n.endswith("_args")):
            parser = getattr(mlm, name)(parser)
        theirs = {{a.dest: a.default for a in parser._actions if a.option_strings}}
        ours = {{a.dest: a.default for a in build_parser()._actions if a.option_strings}}
        differ = sorted(d for d in set(ours) & set(theirs) if d != "help" and ours[d] != theirs[d])
        print("DIFFER", differ, sorted(MEGATRON_LM_DEFAULT_DIFFERENCES))
    """)
    out = run_python(code, cwd=REPO, timeout=120,
                     env={**os.environ, "PYTHONPATH": checkout.pythonpath})
    line = next(l for l in out.stdout.splitlines() if l.startswith("DIFFER"))
    differ, listed = eval(line[len("DIFFER "):].replace("] [", "], ["))
    assert differ == listed
    docs = open(os.path.join(REPO, "docs", "megatron-lm.md")).read()
    assert all(f"`--{d.replace('_', '-')}`" in docs for d in listed)


@pytest.mark.dist
def test_drain_before_eval_and_resume_through_the_drop_in(checkout, tmp_path):
    """Flags that came to the drop-in with the one flag table: --paci-drain-before-eval, and
    a --load that continues the local-step count. a = 2 of 4: 2 steps an iteration. The
    resumed run goes on exactly as the one that was not interrupted."""
    flags = ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "2",
             "--paci-drain-before-eval", "--save-interval", "2"]
    first, second, _ = resume_against_straight(checkout, flags, tmp_path)
    assert "drained the pipeline before evaluation" in first
    assert drift(first)[0]["steps"] == 2 * 2
    assert drift(second) == {0: dict(max=1, bound=1, steps=4 * 2),
                             1: dict(max=0, bound=0, steps=4 * 2)}


@pytest.mark.dist
def test_nadam_trains_and_resumes_through_the_drop_in(checkout, stock_run, tmp_path):
    """--optimizer nadam in Megatron-LM's run: under stock 1F1B the first iteration's loss is
    Adam's (same weights, same batch) and the next ones are not (NAdam stepped, as its
    start-up line, printed once NAdam is in place, says); under PACI it trains, and a run
    resumed from its iteration-2 checkpoint goes on exactly as the uninterrupted run (which
    drains at the same save), dropout included (the CPU patch ``data_loader_seed``)."""
    nadam = ["--optimizer", "nadam"]
    (tmp_path / "stock").mkdir()
    stock = _ok(checkout, ["--pipeline-schedule", "1f1b", *nadam], tmp_path / "stock")
    rows, adam = iterations(stock), iterations(stock_run)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], stock[-3000:]
    assert rows[0]["loss"] == adam[0]["loss"] and rows[1]["loss"] != adam[1]["loss"]
    assert [r["lr"] for r in rows] == [r["lr"] for r in adam]
    paci = ["--pipeline-schedule", "paci", *nadam, "--save-interval", "2"]
    half, resumed, straight = resume_against_straight(checkout, paci, tmp_path)
    for out in (stock, half, resumed, straight):
        assert "hooks: get_megatron_optimizer" in out
        assert out.count("> paci_megatron.run: optimizer nadam (torch's NAdam in Megatron-Core's "
                         "Adam wrappers, momentum decay 0.004): betas (0.9, 0.999)") == 1, out
    assert iterations(straight)[0]["loss"] == rows[0]["loss"]
    assert drift(straight) == {0: dict(max=1, bound=1, steps=4), 1: dict(max=0, bound=0, steps=4)}


@pytest.mark.dist
def test_paci_accepts_tied_embeddings(checkout, tmp_path):
    """Megatron-LM's default, tied input/output embeddings, under PACI at P=2 with a = 1
    (the last stage's copy trails stage 0's by ceil(P/a) = 2 steps): it trains, the tied
    weight's staleness reaches that bound, after the final drain both copies are equal, and
    every stage made its start-up exchange."""
    flags = [f for f in MODEL_FLAGS if f != "--untie-embeddings-and-output-weights"]
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci",
                                               "--paci-accumulation-factor", "1", "--save",
                                               str(tmp_path / "ckpt"), "--save-interval", "2"],
                                    tmp_path, model_flags=flags)
    assert rc == 0, f"exit code {rc}\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
    rows = iterations(out)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert drift(out) == {0: dict(max=1, bound=1, steps=16), 1: dict(max=0, bound=0, steps=16)}
    assert TIED.search(out).groups() == ("2", "2", "identical"), out[-3000:]
    # the start-up exchange ran through the drop-in too, on both communicators it uses
    assert out.count("start-up exchange pipeline+embedding") == 2, out[-3000:]


MOE_FLAGS = ["--num-layers", "4", "--moe-layer-freq", "2", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-shared-expert-intermediate-size", "64", "--moe-token-dispatcher-type",
             "alltoall", "--disable-bias-linear", "--bf16"]
MOE_LINE = re.compile(r"> PACI stage (\d+) MoE \((\d+) MoE layers, mean over (\d+) iterations\): "
                      r"load_balancing_loss (\S+)")


@pytest.mark.dist
def test_a_moe_gpt_trains_under_paci_through_the_drop_in(checkout, tmp_path):
    """Dense and MoE layers mixed (4 experts top-2, sigmoid scores with the expert bias, a
    shared expert, the alltoall dispatcher), bf16, a = 2 of 4 micro-batches, the default
    prediction: PACI trains with drift at its bound; the MoE metrics are reported stage by
    stage over each stage's own MoE layer (the iteration log shows the last stage's, every
    iteration; the end of the run every stage's); stock 1F1B runs the same model as the
    baseline."""
    for sub in ("paci", "stock"):
        (tmp_path / sub).mkdir()
    at = MODEL_FLAGS.index("--num-layers")
    flags = MODEL_FLAGS[:at] + MODEL_FLAGS[at + 2:] + MOE_FLAGS
    paci = _ok(checkout, ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "2"],
               tmp_path / "paci", model_flags=flags)
    stock = _ok(checkout, ["--pipeline-schedule", "1f1b"], tmp_path / "stock", model_flags=flags)
    rows = iterations(paci)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], paci[-3000:]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert drift(paci) == {0: dict(max=1, bound=1, steps=8), 1: dict(max=0, bound=0, steps=8)}
    logged = re.findall(r"iteration\s+\d+/.*?load_balancing_loss: (\S+) \|", paci)
    assert len(logged) == 4 and all(0.5 < float(v) < 2.0 for v in logged), paci[-3000:]
    ends = {int(m[0]): (int(m[1]), int(m[2]), float(m[3])) for m in MOE_LINE.findall(paci)}
    assert set(ends) == {0, 1} and all(e[:2] == (1, 4) for e in ends.values()), ends
    # the last stage's mean over the run, of the values it logged (0.19 logs iteration 2 as
    # the mean of iterations 1 and 2: it keeps its sums over its first log interval)
    assert min(map(float, logged)) - 1e-6 <= ends[1][2] <= max(map(float, logged)) + 1e-6
    assert len(iterations(stock)) == 4 and "PACI" not in stock
    assert "load_balancing_loss" in stock


MTP_FLAGS = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
MTP_LOSS = re.compile(r"iteration\s+\d+/.*?mtp_1 loss: (\S+) \|")


@pytest.mark.dist
def test_mtp_trains_under_paci_through_the_drop_in(checkout, tmp_path):
    """--mtp-num-layers 1 at P = 2, untied, a = 4 of 4 micro-batches: the MTP layer and its copy
    of the embedding on the last stage, kept by the tied exchange (stock all-reduces the copy's
    gradient with stage 0's at every step). PACI trains with drift at its bound; the copy
    trails stage 0's by ceil(P/a) = 1 step and equals it after the final drain; the MTP loss
    is in every iteration's log line (the last stage's, reported within it), and the first
    iteration's, before any step, is stock 1F1B's."""
    for sub in ("paci", "stock"):
        (tmp_path / sub).mkdir()
    flags = MODEL_FLAGS + MTP_FLAGS
    paci = _ok(checkout, ["--pipeline-schedule", "paci"], tmp_path / "paci", model_flags=flags)
    stock = _ok(checkout, ["--pipeline-schedule", "1f1b"], tmp_path / "stock", model_flags=flags)
    rows = iterations(paci)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], paci[-3000:]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert drift(paci) == {0: dict(max=1, bound=1, steps=4), 1: dict(max=0, bound=0, steps=4)}
    assert TIED.search(paci).groups() == ("1", "1", "identical"), paci[-3000:]
    logged = {name: MTP_LOSS.findall(out) for name, out in (("paci", paci), ("stock", stock))}
    assert len(logged["paci"]) == len(logged["stock"]) == 4, paci[-3000:]
    assert all(0.0 < float(v) < 10.0 for v in logged["paci"])
    assert logged["paci"][0] == logged["stock"][0]
    assert iterations(paci)[0]["loss"] == iterations(stock)[0]["loss"]


@pytest.mark.dist
def test_fp16_with_per_token_loss_trains_through_the_drop_in(checkout, tmp_path):
    """Megatron-LM's own fp16 optimizer and per-token loss under PACI at P=2: each stage's
    scaler and skip decision, the scale and the token count carried with each gradient."""
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci", "--fp16",
                                     "--initial-loss-scale", "256", "--loss-scale-window", "2",
                                     "--calculate-per-token-loss"], tmp_path)
    assert rc == 0, f"exit code {rc}\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
    rows = iterations(out)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert drift(out) == {0: dict(max=1, bound=1, steps=4), 1: dict(max=0, bound=0, steps=4)}


@pytest.mark.dist
def test_paci_accumulation_factor_must_divide(checkout, tmp_path):
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci",
                                     "--paci-accumulation-factor", "3"], tmp_path)
    assert rc != 0
    assert "--paci-accumulation-factor 3 must divide the number of micro-batches" in out + err


@pytest.mark.dist
def test_a_bad_megatron_lm_flag_prints_one_error_line_once(checkout, tmp_path):
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci", "--hidden-size",
                                               "abc"], tmp_path)
    assert rc != 0
    errors = [line for line in (out + err).splitlines() if ": error: " in line]
    assert len(errors) == 1 and "--hidden-size" in errors[0], out[-3000:] + err[-3000:]
    assert "usage:" not in out + err


# what each release's pretrain_gpt.py imports at start-up from the [megatron-lm] extra (its
# union); tensorboard is there for --tensorboard-dir
STARTUP_IMPORTS = {"0.16": ("six", "regex", "pyyaml", "pydantic"), "0.17": ("pyyaml",),
                   "0.18": ("pyyaml",), "0.19": (), "0.20": ()}


EXTRA_MODULES = {"six": "six", "regex": "regex", "pyyaml": "yaml", "pydantic": "pydantic"}


@pytest.mark.parametrize("without", [None, *EXTRA_MODULES])
def test_the_megatron_lm_extra_is_what_pretrain_gpt_imports(checkout, without):
    """pretrain_gpt.py imports through the hooks with only what ``pip install -e
    ".[megatron-lm]"`` brings (a fresh site folder, ``python -S``; nothing is installed), and
    not without each package of the extra its release imports at start-up, with an error
    naming the extra. The packages it does not import at start-up are left out together, in
    the one launch that checks the import: without all of them it still starts (so without
    any one), and a fresh install with the whole extra has more than that launch had."""
    release = versions.minor_of(megatron_lm.megatron_lm_checkout_version(checkout.root))
    needed = STARTUP_IMPORTS[release]
    if without is not None and without not in needed:
        pytest.skip(f"{release}'s pretrain_gpt.py does not import {without} at start-up: "
                    "left out in the [None] case's launch, with every other such package")
    left_out = [name for name in EXTRA_MODULES if name not in needed] if without is None \
        else [without]
    worker = os.path.join(REPO, "tests", "workers", "clean_env_import.py")
    cmd = [sys.executable, worker, checkout.script, "--without", ",".join(left_out)]
    proc = launch(cmd, timeout=600, env={**os.environ, "PYTHONPATH": checkout.pythonpath})
    if without is None:
        assert "\nIMPORTED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        refused = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED")]
        assert refused and f"imports {EXTRA_MODULES[without]!r}, which is not installed" \
            in refused[0] and '".[megatron-lm]"' in refused[0], \
            proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.dist
def test_a_killed_rank_restarts_through_the_drop_in(checkout, tmp_path):
    """torchrun --max-restarts 1 with --save DIR --load DIR from the first launch: DIR is
    empty then (Megatron-LM starts from scratch); rank 1 is SIGKILLed as iteration 4 starts,
    torchrun restarts both workers, they load iteration 2 and train on to the end. (The shared
    rendezvous store would hand the restarted workers the dead ones' keys: see the README.)"""
    ckpt = str(tmp_path / "ckpt")
    worker = os.path.join(REPO, "tests", "workers", "megatron_lm_restart.py")
    flags = [flag if flag != "4" or prev != "--train-iters" else "6"
             for prev, flag in zip([""] + MODEL_FLAGS, MODEL_FLAGS)]
    cmd = torchrun_cmd(worker, [checkout.script, *CPU_FLAGS, *flags, "--pipeline-schedule",
                                "paci", "--save", ckpt, "--load", ckpt, "--save-interval", "2"],
                       nproc=2, launcher_args=["--max-restarts", "1"])
    marker = f"{os.getpid()}-{id(tmp_path)}"  # names the processes this launch starts
    env = dict(os.environ, PYTHONPATH=checkout.pythonpath,
               PACI_TEST_FAULT="before_iteration:1:4", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PACI_TEST_LAUNCH=marker)
    # Files, not pipes: the killed rank's checkpoint writer (megatron-core's multiprocessing
    # Manager, from 0.17 on) outlives it and would hold a pipe open after torchrun exits.
    with open(tmp_path / "out.txt", "w") as out_file, open(tmp_path / "err.txt", "w") as err_file:
        proc = start(cmd, cwd=tmp_path, env=env, stdout=out_file, stderr=err_file)
        timed_out = False
        try:
            proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            proc.wait()
        finally:
            _kill_launched(marker)
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert not timed_out, f"timed out after 400 s: {out[-4000:]}\n{err[-4000:]}"
    assert proc.returncode == 0, f"{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
    assert out.count("PACI_TEST_KILLED") == 1
    assert "could not find the metadata file" in out  # the first launch: nothing to load yet
    assert "> paci_megatron.run: restart 1 of this job" in out
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 2", out)
    done = [int(r["iteration"]) for r in iterations(out)]
    assert done == [1, 2, 3, 3, 4, 5, 6], out[-3000:]  # 3 again after the resume, then on
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]


def _kill_launched(marker: str) -> None:
    """SIGKILL what is left of one launch: the processes whose environment carries its
    PACI_TEST_LAUNCH marker (orphans of a killed rank included)."""
    import psutil

    left = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PACI_TEST_LAUNCH") == marker:
                proc.kill()
                left.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    psutil.wait_procs(left, timeout=10)


# --- data parallelism, the distributed optimizer, overlaps, batch-size ramp-up -----------------

@pytest.fixture(scope="module")
def dp2_runs(checkout, tmp_path_factory):
    """P=2 x DP=2 under PACI (a=2 of 4 micro-batches), plain optimizer and distributed optimizer
    with --overlap-grad-reduce and --overlap-param-gather; no clipping (fp32: the two must agree
    bit for bit)."""
    flags = ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "2",
             "--micro-batch-size", "1", "--clip-grad", "0"]
    overlaps = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    return {name: _ok(checkout, flags + extra, tmp_path_factory.mktemp(name), nproc=4,
                      timeout=600)
            for name, extra in (("plain", []), ("overlapped", overlaps))}


@pytest.mark.dist
def test_dp2_distributed_optimizer_with_overlaps_equals_plain(checkout, dp2_runs):
    plain, overlapped = iterations(dp2_runs["plain"]), iterations(dp2_runs["overlapped"])
    assert [r["iteration"] for r in plain] == ["1", "2", "3", "4"], dp2_runs["plain"][-3000:]
    assert [(r["loss"], r["lr"]) for r in overlapped] == [(r["loss"], r["lr"]) for r in plain]
    assert float(plain[-1]["loss"]) < float(plain[0]["loss"])
    for out in dp2_runs.values():
        assert drift(out) == {0: dict(max=1, bound=1, steps=8), 1: dict(max=0, bound=0, steps=8)}


# global batch 4 (M=2) for the first 32 samples, then 8 (M=4); Megatron-LM wants sample-based
# training with a ramp: 8 iterations of 4 samples and 4 of 8
_AT = MODEL_FLAGS.index("--train-iters")
RAMP_FLAGS = MODEL_FLAGS[:_AT] + MODEL_FLAGS[_AT + 2:] + [
    "--train-samples", "64", "--rampup-batch-size", "4", "4", "32", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def ramp_runs(checkout, tmp_path_factory):
    return {schedule: _ok(checkout, ["--pipeline-schedule", schedule],
                          tmp_path_factory.mktemp(schedule),
                          model_flags=RAMP_FLAGS, timeout=600)
            for schedule in ("1f1b", "paci")}


def _ramps(checkout) -> bool:
    """Whether the checkout's release still ramps the batch size (0.18 and later ignore the flag)."""
    return versions.minor_of(megatron_lm.megatron_lm_checkout_version(checkout.root)) < "0.18"


@pytest.mark.dist
def test_rampup_batch_size_is_refused_where_megatron_no_longer_ramps(checkout, tmp_path):
    if _ramps(checkout):
        pytest.skip("this release ramps the batch size (the next test)")
    rc, out, err = run_pretrain_gpt(checkout, ["--pipeline-schedule", "paci"], tmp_path,
                                    model_flags=RAMP_FLAGS)
    assert rc != 0 and "megatron-core no longer ramps the batch size" in out + err


@pytest.mark.dist
def test_rampup_batch_size_drains_where_the_batch_grows(checkout, request):
    if not _ramps(checkout):
        pytest.skip("megatron-core 0.18 and later ignore --rampup-batch-size (the test above)")
    ramp_runs = request.getfixturevalue("ramp_runs")
    paci, stock = iterations(ramp_runs["paci"]), iterations(ramp_runs["1f1b"])
    assert [r["iteration"] for r in paci] == [str(i) for i in range(1, 13)], \
        ramp_runs["paci"][-3000:]
    assert ramp_runs["paci"].count("(--rampup-batch-size), accumulation factor 4; drained") == 1
    # LR by samples: the same after every iteration as stock 1F1B's one step per iteration
    assert [r["lr"] for r in paci] == [r["lr"] for r in stock]
    assert paci[0]["loss"] == stock[0]["loss"]  # a = M: iteration 1 runs on the initial weights
    # one local step per iteration (a follows M), drift within the bound
    assert drift(ramp_runs["paci"]) == {0: dict(max=1, bound=1, steps=12),
                                        1: dict(max=0, bound=0, steps=12)}


# --- checkpoints both ways ------------------------------------------------------------------

PACI_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--lr", "1e-3", "--vocab-size", "128", "--untie-embeddings-and-output-weights",
              "--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo",
              "--log-interval", "1", "--make-vocab-size-divisible-by", "128"]
@pytest.mark.dist
def test_a_megatron_lm_checkpoint_loads_and_trains_under_paci(checkout, tmp_path):
    """Megatron-LM's own pretrain_gpt.py (stock 1F1B) writes a checkpoint at iteration 4;
    pretrain_gpt_paci.py --pipeline-schedule paci loads it (saying what it cannot take: the RNG
    states and fp16 scaler in Megatron-LM's layout) and saves it again: every model weight and
    every optimizer moment is the same tensor, bit for bit; then PACI trains on from it."""
    _ok(checkout, ["--save", str(tmp_path / "mlm"), "--save-interval", "4"], tmp_path)
    flags = PACI_SHAPE + ["--pipeline-schedule", "paci", "--lr-decay-style", "linear",
                          "--load", str(tmp_path / "mlm")]
    env = {"PYTHONPATH": checkout.pythonpath}  # the megatron-core Megatron-LM ran with
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", flags + [
        "--train-iters", "4", "--save", str(tmp_path / "paci")], nproc=2, timeout=240, env=env)
    assert "not taken from the checkpoint: Megatron-LM's RNG states" in out
    assert "loaded checkpoint from" in out and "at iteration 4 (32 samples consumed" in out
    found = same_tensors(tmp_path / "mlm" / "iter_0000004", tmp_path / "paci" / "iter_0000004",
                          "29613")
    assert found["total"] > 40 and found["same"] == found["total"], found  # weights, moments
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", flags + [
        "--train-iters", "6", "--override-opt_param-scheduler"], nproc=2, timeout=240, env=env)
    assert re.search(r"iteration\s+6/\s+6 \|", out)


@pytest.mark.dist
def test_a_paci_checkpoint_resumes_in_megatron_lms_pretrain_gpt(checkout, tmp_path):
    """pretrain_gpt_paci.py --pipeline-schedule paci trains 4 iterations and saves (after its
    drain); Megatron-LM's pretrain_gpt.py with stock 1F1B loads it and trains on. Megatron-LM
    refuses a checkpoint whose LR schedule differs from its flags: ours defaults to cosine,
    Megatron-LM to linear, so the flag is given (docs/megatron-lm.md lists such defaults)."""
    run_torchrun("pretrain_gpt_paci.py", PACI_SHAPE + [
        "--pipeline-schedule", "paci", "--train-iters", "4", "--lr-decay-style", "linear",
        "--save", str(tmp_path / "paci")], nproc=2, timeout=240,
        env={"PYTHONPATH": checkout.pythonpath})
    flags = list(MODEL_FLAGS) + ["--load", str(tmp_path / "paci"), "--override-opt_param-scheduler"]
    flags[flags.index("--train-iters") + 1] = "6"
    rc, out, err = run_pretrain_gpt(checkout, flags, tmp_path, model_flags=[])
    assert rc == 0, out[-4000:] + err[-4000:]
    assert [r["iteration"] for r in iterations(out)] == ["5", "6"], out[-3000:]
    # and evaluates it without training (Megatron-LM's --skip-train takes the model only)
    rc, out, err = run_pretrain_gpt(checkout, flags + ["--skip-train", "--no-load-optim"], tmp_path,
                                    model_flags=[])
    assert rc == 0, out[-4000:] + err[-4000:]
    assert iterations(out) == [] and re.search(r"validation loss at iteration 4 .*lm loss", out)


def _with(flags, **values):
    """``flags`` with each ``--name value`` of ``values`` (name_with_underscores) set."""
    flags = list(flags)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in flags:
            flags[flags.index(flag) + 1] = str(value)
        else:
            flags += [flag, str(value)]
    return flags


@pytest.mark.dist
def test_checkpoints_reshard_from_megatron_lm_through_paci_and_back(checkout, tmp_path):
    """On the newest tag: Megatron-LM's pretrain_gpt.py writes at P=2; pretrain_gpt_paci.py
    loads it at P=4 and saves it again (every weight and moment the same tensor), trains on
    under PACI and saves; Megatron-LM loads that at P=1 x DP=2 and trains on. (The drop-in on
    CPU runs no tensor parallelism; pretrain_gpt_paci.py's own TP resharding is
    tests/test_reshard.py.)"""
    if versions.release_of(megatron_lm.megatron_lm_checkout_version(checkout.root)) \
            != versions.RELEASES[-1]:
        pytest.skip(f"the resharding round trip runs on {versions.RELEASES[-1].megatron_lm_tag}")
    shape = dict(num_layers=4, make_vocab_size_divisible_by=64)
    _ok(checkout, ["--save", str(tmp_path / "mlm"), "--save-interval", "4"], tmp_path,
        model_flags=_with(MODEL_FLAGS, **shape))
    env = {"PYTHONPATH": checkout.pythonpath}
    paci = _with(PACI_SHAPE, pipeline_model_parallel_size=4, **shape) + [
        "--pipeline-schedule", "paci", "--lr-decay-style", "linear", "--save",
        str(tmp_path / "paci")]
    run_torchrun("pretrain_gpt_paci.py", paci + ["--load", str(tmp_path / "mlm"),
                                                 "--train-iters", "4"],
                 nproc=4, timeout=300, env=env)
    found = same_tensors(tmp_path / "mlm" / "iter_0000004", tmp_path / "paci" / "iter_0000004",
                         "29614")
    assert found["total"] > 40 and found["same"] == found["total"], found  # layers stacked
    _, out, _ = run_torchrun("pretrain_gpt_paci.py", paci + [
        "--load", str(tmp_path / "paci"), "--train-iters", "6", "--override-opt_param-scheduler"],
        nproc=4, timeout=300, env=env)
    assert re.search(r"iteration\s+6/\s+6 \|", out) and "saved checkpoint at iteration 6" in out
    flags = _with(MODEL_FLAGS, pipeline_model_parallel_size=1, train_iters=8, **shape) + [
        "--load", str(tmp_path / "paci"), "--override-opt_param-scheduler",
        "--no-load-rng"]  # DP=2; the RNG states are per rank of the old layout
    out = _ok(checkout, [], tmp_path, model_flags=flags)
    rows = iterations(out)
    assert [r["iteration"] for r in rows] == ["7", "8"], out[-3000:]
    assert all(math.isfinite(float(r["loss"])) for r in rows)


@pytest.mark.dist
def test_uneven_stages_train_under_paci_through_the_drop_in(checkout, tmp_path):
    """Issue 51: Megatron-LM's own first/last-stage flags at P = 3 (six layers split 1/4/1)
    under PACI at a = 1: it trains, every stage's drift reaches its bound (2, 1, 0), and each
    stage reports its own forward time, which the end-of-run projection takes as its pace."""
    flags = _with(MODEL_FLAGS, num_layers=6, pipeline_model_parallel_size=3)
    out = _ok(checkout, ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "1",
                         "--decoder-first-pipeline-num-layers", "1",
                         "--decoder-last-pipeline-num-layers", "1"],
              tmp_path, nproc=3, model_flags=flags)
    rows = iterations(out)
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4"], out[-3000:]
    assert drift(out) == {s: dict(max=b, bound=b, steps=16) for s, b in enumerate((2, 1, 0))}
    paces = re.findall(r"> PACI stage \d+: max drift .*, forward (\d+\.\d\d) ms", out)
    assert len(paces) == 3 and all(float(ms) > 0 for ms in paces), out[-3000:]


@pytest.mark.dist
@pytest.mark.slow  # 16 processes, 2 launches: guarded by the P = 16 emulator case and P <= 4
def test_sixteen_stages_train_and_resume_through_the_drop_in(checkout, tmp_path):
    """Issue 51: Megatron-LM's own pretrain_gpt.py at P = 16 (a layer a stage), a = 8 of 16
    micro-batches, tied embeddings: drift at its bound on every stage, and a run resumed from
    the checkpoint of iteration 2 goes on as the uninterrupted one."""
    flags = [f for f in _with(MODEL_FLAGS, num_layers=16, pipeline_model_parallel_size=16,
                              micro_batch_size=1, global_batch_size=16)
             if f != "--untie-embeddings-and-output-weights"]
    paci = ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "8"]
    for sub in ("straight", "resumed"):
        (tmp_path / sub).mkdir()
    straight = _ok(checkout, [*paci, "--save", str(tmp_path / "s"), "--save-interval", "2"],
                   tmp_path / "straight", nproc=16, timeout=600, model_flags=flags)
    start_at = checkpoint_of_iteration(tmp_path / "s", 2, tmp_path / "b")
    resumed = _ok(checkout, [*paci, "--load", start_at], tmp_path / "resumed",
                  nproc=16, timeout=600, model_flags=flags)
    bounds = [2] * 7 + [1] * 8 + [0]
    assert drift(straight) == {s: dict(max=b, bound=b, steps=8) for s, b in enumerate(bounds)}
    assert TIED.search(straight).groups() == ("2", "2", "identical"), straight[-3000:]
    whole = iterations(straight)
    assert [r["iteration"] for r in iterations(resumed)] == ["3", "4"], resumed[-3000:]
    assert_resumes_exactly(iterations(resumed), whole[2:])


def deepseek_shaped_flags():
    """Issue 50's DeepSeek-V3-shaped tiny config at P = 4 x EP = 2 (8 processes), untied."""
    at = MODEL_FLAGS.index("--num-layers")
    flags = _with(MODEL_FLAGS[:at] + MODEL_FLAGS[at + 2:] + MOE_FLAGS, num_layers=8,
                  pipeline_model_parallel_size=4, micro_batch_size=1, global_batch_size=16,
                  moe_router_bias_update_rate=0.01)
    return flags + ["--expert-model-parallel-size", "2", *MTP_FLAGS]


@pytest.mark.dist
@pytest.mark.slow  # 8 processes, 2 launches: guarded at P = 2 by the MoE and MTP drop-in tests
def test_a_deepseek_shaped_moe_trains_through_the_drop_in(checkout, tmp_path):
    """Issue 50: MoE with the expert bias and a shared expert, one MTP layer, untied embeddings
    (as DeepSeek-V3; Megatron-Core cannot checkpoint tied + MTP at P > 1), bf16 and the
    distributed optimizer at P = 4 x EP = 2 (8 processes) through Megatron-LM's own
    pretrain_gpt.py: drift at its bound on every stage, the MTP layer's embedding copy at its
    lag and identical after the drain, the MTP loss logged, and stock 1F1B runs the same config
    as the baseline. Its resume is the next test (on CPU the save needs the distributed
    optimizer off: docs/moe.md)."""
    flags = deepseek_shaped_flags() + ["--use-distributed-optimizer"]
    for sub in ("paci", "stock"):
        (tmp_path / sub).mkdir()
    run = _ok(checkout, ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "4"],
              tmp_path / "paci", nproc=8, timeout=900, model_flags=flags)
    stock = _ok(checkout, ["--pipeline-schedule", "1f1b"], tmp_path / "stock", nproc=8,
                timeout=900, model_flags=flags)
    assert drift(run) == {s: dict(max=b, bound=b, steps=8) for s, b in enumerate((1, 1, 1, 0))}
    assert TIED.search(run).groups() == ("1", "1", "identical"), run[-3000:]
    assert len(MTP_LOSS.findall(run)) == 4, run[-3000:]
    assert [r["iteration"] for r in iterations(run)] == ["1", "2", "3", "4"]
    assert [r["iteration"] for r in iterations(stock)] == ["1", "2", "3", "4"]
    assert "PACI" not in stock and len(MTP_LOSS.findall(stock)) == 4


@pytest.mark.dist
@pytest.mark.slow  # 8 processes, 2 launches: guarded by tests/test_moe.py's P = 2 x EP = 2 resume
def test_a_deepseek_shaped_moe_resumes_exactly_through_the_drop_in(checkout, tmp_path):
    """Issue 50: the config above (the plain optimizer, whose CPU checkpoint Megatron-Core
    writes and reads) under paci, saved at iterations 2 and 4, and resumed from iteration 2's
    checkpoint: its iterations 3 and 4 log as the straight run's, and its checkpoint of
    iteration 4 equals the straight run's tensor for tensor (weights, Adam moments, the
    routers' expert bias). Before 792d428 every EP rank clipped by its own experts' norm and
    360 of 384 tensors differed."""
    flags = deepseek_shaped_flags()
    paci = ["--pipeline-schedule", "paci", "--paci-accumulation-factor", "4"]
    for sub in ("straight", "resumed", "b"):
        (tmp_path / sub).mkdir()
    straight = _ok(checkout, [*paci, "--save", str(tmp_path / "s"), "--save-interval", "2"],
                   tmp_path / "straight", nproc=8, timeout=900, model_flags=flags)
    start_at = checkpoint_of_iteration(tmp_path / "s", 2, tmp_path / "b")
    resumed = _ok(checkout, [*paci, "--load", start_at, "--save", str(tmp_path / "r"),
                             "--save-interval", "2"],
                  tmp_path / "resumed", nproc=8, timeout=900, model_flags=flags)
    assert [r["iteration"] for r in iterations(resumed)] == ["3", "4"], resumed[-3000:]
    assert_resumes_exactly(iterations(resumed), iterations(straight)[2:])
    found = same_tensors(tmp_path / "s" / "iter_0000004", tmp_path / "r" / "iter_0000004",
                         "29641")
    assert found["total"] > 300 and found["same"] == found["total"], found
