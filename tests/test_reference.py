"""Multi-process PACI equals its one-process reference (``mcore/reference.py``) bit for bit.

Five torchrun launches (tests/workers/reference_cases.py): the emulator with 1 and with 2
processes (tensor/data parallel stay real), the runtime with 2 and (twice) 4 processes; ``-m slow``
adds P = 4 x DP = 2 (8 processes) and P = 16 (16 processes, in CI's slow step). Every case
compares every micro-batch loss and, after every local step of every stage, the grad norm that
stage clipped with, its learning rate and a SHA-256 of its weights. The tied-embedding twins
(``*_stock``) compare PACI's first step with stock Megatron's (the flush baseline).
"""

import glob
import json
import math
import os

import pytest

from launch import run_torchrun

from paci_megatron.schedule import Op, plan_stream

pytestmark = pytest.mark.dist

WORKER = "tests/workers/reference_cases.py"
PP_ONLY = ["p2_a4", "p2_a2", "p2_bf16", "p2_distopt", "p2_drain_eval",
           "p4_a4", "p4_a1", "p4_bf16", "p4_recompute", "p4_eval_nodrain", "p4_drain_eval",
           "p4_auto", "p2_tied", "p2_tied_bf16", "p4_tied", "p4_bf16_predict", "p4_tied_bf16",
           "p4_tied_bf16_predict", "p4_bf16_predict_overlap", "p4_tied_bf16_lookahead",
           "p2_moe", "p4_moe_bf16_predict", "p4_moe_bias", "p4_uneven", "p2_layout_tied",
           "p2_mtp_bf16", "p2_mtp_bf16_predict", "p4_mtp_tied"]
# 2 emulator processes, 4 runtime ones
PARALLEL = ["p2_dp2", "p2_dp2_distopt", "p2_tp2", "p2_dp2_tied", "p2_dp2_tied_bf16_predict",
            "p2_dp2_distopt_bf16", "p2_dp2_distopt_bf16_predict", "p2_tp2_bf16_predict",
            "p2_dp2_distopt_bf16_lookahead", "p2_dp2_distopt_bf16_nadam", "p2_dp2_ep2_moe",
            "p2_dp2_ep2_moe_bf16", "p2_dp2_ep2_moe_allgather", "p2_dp2_ep2_moe_bias_distopt"]
# a loss scaler per stage; per-token loss
PRECISION = ["p2_fp16", "p2_per_token", "p2_fp16_predict", "p2_tied_fp16", "p2_fp16_moe",
             "p2_fp16_mtp"]
# tied embeddings with Megatron's realistic flags at DP=2: P=2 (4 runtime processes, launched
# apart) and P=4 (8 runtime processes, about a minute on 2 cores); 2 emulator processes
TIED_DP2 = ["p2_dp2_tied_distopt", "p2_dp2_tied_overlap", "p2_dp2_tied_distopt_bf16_overlap",
            "p2_dp2_tied_fp16_distopt_overlap"]
WIDE = ["p4_dp2_tied_distopt_bf16_overlap", "p4_dp2_tied_fp16_distopt_overlap"]
# the same at P=2, runtime only: PACI and the flush baseline (stock), one call each
STOCK_TWINS = ["p2_dp2_tied_overlap_stock", "p2_dp2_tied_distopt_bf16_stock",
               "p2_dp2_tied_fp16_distopt_stock"]
RUNTIME_P2 = [c for c in PP_ONLY if c.startswith("p2")] + PRECISION
RUNTIME_P4 = [c for c in PP_ONLY if c.startswith("p4")] + PARALLEL


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    twins = [c + suffix for c in STOCK_TWINS for suffix in ("", "_flush")]
    # the 4-process runtime cases in two launches: every case makes Megatron's process groups
    # again, and gloo keeps each group's threads until the process ends, so one launch of
    # 40 cases slowed to a time-out on a loaded machine
    launches = [("emulator", 1, PP_ONLY + PRECISION, 300),
                ("emulator", 2, PARALLEL + TIED_DP2, 540), ("runtime", 2, RUNTIME_P2, 300),
                ("runtime", 4, RUNTIME_P4, 840), ("runtime", 4, TIED_DP2 + twins, 600)]
    return run_cases(out, launches)


def run_cases(out, launches):
    """Run each (mode, processes, cases, timeout) launch into ``out``; returns a reader:
    ``load(case, mode)`` -> {"pp0tp0dp0": row, ...}."""
    for mode, nproc, cases, timeout in launches:
        run_torchrun(WORKER, ["--mode", mode, "--out", str(out), *cases], nproc=nproc,
                     timeout=timeout, env={"PACI_TEST_HANG_S": str(timeout - 30)})

    def load(case, mode):
        rows = {}
        for path in glob.glob(os.path.join(out, f"{case}.{mode}.*.json")):
            rows[path.split(f".{mode}.")[1][:-len(".json")]] = json.load(open(path))
        return rows

    return load


def _coords(cfg):
    return [f"pp{s}tp{t}dp{d}" for s in range(cfg["pp"]) for t in range(cfg["tp"])
            for d in range(cfg["dp"])]


@pytest.mark.parametrize("case", PP_ONLY + PARALLEL + PRECISION + TIED_DP2)
def test_runtime_equals_emulator_bit_for_bit(case, results):
    assert_bit_for_bit(case, results)


def assert_bit_for_bit(case, results):
    emulated, real = results(case, "emulator"), results(case, "runtime")
    cfg = next(iter(real.values()))["config"]
    assert sorted(emulated) == sorted(real) == sorted(_coords(cfg))
    steps_per_stage = sum(cfg["n"] // a for a in cfg["factors"] or [cfg["a"]] * cfg["calls"])
    for coord, r in real.items():
        e = emulated[coord]
        last = coord.startswith(f"pp{cfg['pp'] - 1}")
        per_mb = 2 if cfg["per_token"] else 1  # per-token: the loss sum and the token count
        assert len(r["losses"]) == (cfg["calls"] * cfg["n"] * per_mb if last else 0)
        assert r["losses"] == e["losses"]  # every micro-batch loss, as float hex
        assert len(r["steps"]) == steps_per_stage
        assert r["steps"] == e["steps"]  # per step: mb, success, grad norm, LR, weights SHA-256
        assert r["histogram"] == e["histogram"]  # drift of every micro-batch
        assert r.get("tied_histogram", {}) == e.get("tied_histogram", {})
        assert r["layers"] == e["layers"]  # the transformer layers the stage built


@pytest.mark.parametrize("case,layers", [("p4_uneven", [[1], [2, 3], [4, 5], [6]]),
                                         ("p2_layout_tied", [[1, 2, 3], [4]])])
def test_uneven_stages_hold_their_own_layers_in_both_modes(case, layers, results):
    """Each stage, in the runtime and in the emulator's stage of the same rank, built the
    transformer layers its split gives it (global numbers, as Megatron numbers them)."""
    for mode in ("runtime", "emulator"):
        rows = results(case, mode)
        assert [rows[f"pp{s}tp0dp0"]["layers"] for s in range(len(rows))] == layers, mode


@pytest.mark.parametrize("case,tied", [("p2_mtp_bf16", False), ("p4_mtp_tied", True),
                                       ("p2_fp16_mtp", False), ("p2_mtp_bf16_predict", False)])
def test_mtp_layers_and_the_embedding_copy_sit_on_the_last_stage(case, tied, results):
    """--mtp-num-layers at P > 1: the last stage builds the MTP layer and a copy of the word
    embedding, which is the weight it shares with stage 0 (tied or not): the tied exchange
    keeps it (its staleness and the copies after the drain: the test below); middle stages
    share nothing."""
    rows = results(case, "runtime")
    pp = rows["pp0tp0dp0"]["config"]["pp"]
    holds = [rows[f"pp{s}tp0dp0"]["holds"] for s in range(pp)]
    assert holds[0] == dict(mtp_layers=0, shares_embedding=True, shares=True)
    assert holds[-1] == dict(mtp_layers=1, shares_embedding=True, shares=True)
    assert holds[1:-1] == [dict(mtp_layers=0, shares_embedding=False, shares=False)] * (pp - 2)
    assert rows["pp0tp0dp0"]["config"]["tied"] is tied


@pytest.mark.parametrize("case,lag", [
    ("p2_tied", 2), ("p2_tied_bf16", 1), ("p4_tied", 2), ("p2_layout_tied", 1),
    ("p2_dp2_tied_distopt", 1), ("p2_dp2_tied_overlap", 1), ("p2_dp2_tied_distopt_bf16_overlap", 2),
    ("p2_tied_fp16", 1), ("p2_dp2_tied_fp16_distopt_overlap", 1),
    ("p2_mtp_bf16", 1), ("p4_mtp_tied", 2), ("p2_fp16_mtp", 1)])
def test_tied_weight_staleness_reaches_its_bound_and_no_more(case, lag, results):
    """The last stage's copy of the tied weight trails stage 0's by lag = ceil(P/a) steps:
    every micro-batch of group g used owner version max(0, g - lag) (so group g < lag is less
    stale), measured per micro-batch by the runtime and equal to the emulator's above; every
    stage's drift reaches its bound ceil((P-1-s)/a). After the final drain both copies are
    bit-identical on every data-parallel rank (with the distributed optimizer: its shard of
    the master copy, and the whole weight). The exchange holds at most L gradients in flight
    and L + 1 weights on the last stage, one weight in flight on stage 0."""
    rows = results(case, "runtime")
    cfg = rows["pp0tp0dp0"]["config"]
    streams = 1 + len(cfg["drain_after"] or ())
    for dp in range(cfg["dp"]):
        last = rows[f"pp{cfg['pp'] - 1}tp0dp{dp}"]
        # each stream (a drain starts a new one) has groups 0..lag-1 below the bound
        warm = {str(g): cfg["a"] * streams for g in range(lag)}
        assert last["tied_histogram"] == {
            **warm, str(lag): cfg["calls"] * cfg["n"] - lag * cfg["a"] * streams}
        # after the final drain both copies (and their optimizers' master copies) are equal
        digests = [rows[f"pp{s}tp0dp{dp}"]["tied_after_drain"] for s in range(cfg["pp"])]
        assert digests[0] is not None and digests[0] == digests[-1]
        assert digests[1:-1] == [None] * (cfg["pp"] - 2)
        for s in range(cfg["pp"]):
            assert rows[f"pp{s}tp0dp{dp}"]["max_drift"] == math.ceil((cfg["pp"] - 1 - s) / cfg["a"])
        assert last["tied_buffers"]["grads"] <= lag and last["tied_buffers"]["weights"] <= lag + 1
        assert rows[f"pp0tp0dp{dp}"]["tied_buffers"] == dict(grads=0, weights=1)
    if cfg["dp"] > 1 and cfg["dist_opt"]:  # each rank's shard: the ranks' digests differ
        assert rows["pp0tp0dp0"]["tied_after_drain"] != rows["pp0tp0dp1"]["tied_after_drain"]


@pytest.mark.parametrize("case", STOCK_TWINS)
def test_tied_gradient_is_stocks_sum_bit_for_bit(case, results):
    """Tied embeddings at DP=2 (all-reduce with --overlap-grad-reduce; the distributed
    optimizer's reduce-scatter with bf16 master shards; fp16 at equal scales): stage 0's first
    step takes group 0's gradient at the starting weights, as stock does, and PACI's sum of
    the two stages' reduced halves gives stock's weights after it on every data-parallel rank,
    bit for bit. (Before the halves were reduced apart, at DP=2 it differed.) The step moved
    the weights, and the second differs (PACI's drift)."""
    paci, stock = results(case, "runtime"), results(case + "_flush", "runtime")
    cfg = paci["pp0tp0dp0"]["config"]
    for dp in range(cfg["dp"]):
        ours, theirs = paci[f"pp0tp0dp{dp}"], stock[f"pp0tp0dp{dp}"]
        assert ours["initial_weights"] == theirs["initial_weights"]
        assert ours["steps"][0]["ok"] and ours["steps"][0]["weights"] != ours["initial_weights"]
        assert ours["steps"][0]["weights"] == theirs["steps"][0]["weights"]
        assert ours["steps"][1]["weights"] != theirs["steps"][1]["weights"]


def test_the_cases_exercise_drift_drain_and_distinct_weights(results):
    """Guards the comparison itself: stale micro-batches exist, the weights move at every
    step, and a drain really drops in-flight forwards (fewer drifted backwards)."""
    for case in PP_ONLY:
        rows = results(case, "runtime")
        first = rows["pp0tp0dp0"]
        assert first["max_drift"] >= 1 and first["histogram"].get("1", 0) > 0, case
        digests = [s["weights"] for s in first["steps"]]
        assert len(set(digests)) == len(digests), case
    # P=2, a=2: stage 0 runs F(m+1) before B(m) and steps after every odd m, so every even
    # m >= 2 has drift 1: 11 of 24 micro-batches. Each drain (after calls 2 and 4) drops the
    # in-flight forward of m = 8 and 16 and runs it again after the step: 9.
    assert results("p2_drain_eval", "runtime")["pp0tp0dp0"]["histogram"] == {"0": 15, "1": 9}


@pytest.mark.parametrize("case", ["p2_fp16", "p2_tied_fp16", "p2_fp16_moe", "p2_fp16_mtp"])
def test_fp16_case_has_stages_skipping_on_their_own(case, results):
    """The fp16 cases compare something: stage 0 and the last stage skip overflowing steps,
    at different steps (so their scales differ and received gradients are rescaled; tied: the
    last stage installs stage 0's weight after a step it skipped, and a weight stage 0 did not
    update after one it took), and both update."""
    rows = results(case, "runtime")
    last = rows["pp0tp0dp0"]["config"]["pp"] - 1
    ok = [[s["ok"] for s in rows[f"pp{st}tp0dp0"]["steps"]] for st in (0, last)]
    assert ok[0] != ok[1] and all(False in o and True in o for o in ok)


@pytest.mark.parametrize("case", ["p4_a4", "p2_dp2", "p2_tp2"])
def test_each_stage_clips_by_its_own_norm(case, results):
    """PACI clips each stage by that stage's gradient norm: the runtime's norms equal the
    emulator's, where every stage is alone in its optimizer, and clipping was active, so a
    global (cross-stage) norm would have given other weights."""
    real, emulated = results(case, "runtime"), results(case, "emulator")
    cfg = real["pp0tp0dp0"]["config"]
    norms = {c: [float.fromhex(s["grad_norm"]) for s in r["steps"]] for c, r in real.items()}
    for coord in real:
        assert norms[coord] == [float.fromhex(s["grad_norm"]) for s in emulated[coord]["steps"]]
        assert sum(n > cfg["clip"] for n in norms[coord]) >= len(norms[coord]) // 2
    stage_rows = [norms[f"pp{s}tp0dp0"] for s in range(cfg["pp"])]
    for step, per_stage in enumerate(zip(*stage_rows)):
        global_norm = math.sqrt(sum(n * n for n in per_stage))
        assert all(n < global_norm for n in per_stage), step


@pytest.mark.parametrize("case", ["p4_a1", "p4_bf16", "p4_bf16_predict"])
def test_backward_uses_the_current_weights(case, results):
    """Module by module (BackwardAudit, no saved-tensor hooks): every gradient a backward
    produced equals the vector-Jacobian product at the forward-time input with the weights as
    they were at backward time; where a step came in between, it differs from the one with
    the forward-time weights."""
    rows = results(case, "emulator")
    changed_total = 0
    for coord, row in rows.items():
        verdicts = row["audit"]
        assert verdicts, coord
        assert all(v["matches_current"] for v in verdicts), \
            [v for v in verdicts if not v["matches_current"]][:3]
        changed = [v for v in verdicts if v["weights_changed"]]
        changed_total += len(changed)
        if not coord.startswith("pp3"):  # stages with drift: every module saw a step
            assert {v["module"] for v in changed} == {v["module"] for v in verdicts}
        stale = sum(v["matches_forward_time"] for v in changed)
        if row["config"]["bf16"]:  # a small step can leave some bf16 gradients unchanged
            assert stale <= len(changed) // 4
        else:
            assert stale == 0
    assert changed_total > 0


PREDICTED = {"p4_bf16_predict": "p4_bf16", "p4_tied_bf16_predict": "p4_tied_bf16",
             "p4_bf16_predict_overlap": "p4_bf16",
             "p2_dp2_tied_bf16_predict": None, "p2_fp16_predict": "p2_fp16",
             "p2_dp2_distopt_bf16_predict": "p2_dp2_distopt_bf16", "p2_tp2_bf16_predict": None,
             "p4_moe_bf16_predict": None, "p2_mtp_bf16_predict": "p2_mtp_bf16"}


@pytest.mark.parametrize("case", sorted(PREDICTED))
def test_weight_prediction_moves_stale_forwards_and_restores_exactly(case, results):
    """Every stage but the last runs its stale forwards (drift up to its bound) on predicted
    weights, as the emulator does; the weights really moved on every one of them that had
    something to move by (an LR above the warm-up's 0 over its d steps, and moments or a
    gradient to fold), and on none else; after every forward each weight is again the cast
    of its fp32 main copy, bit for bit, and after every step, taken or skipped (fp16)."""
    real, emulated = results(case, "runtime"), results(case, "emulator")
    cfg = next(iter(real.values()))["config"]
    for coord, row in real.items():
        stage = int(coord[2:coord.index("tp")])
        bound = math.ceil((cfg["pp"] - 1 - stage) / cfg["a"])
        predicted = {int(k): v for k, v in row["predicted"].items()}
        assert row["predicted"] == emulated[coord]["predicted"]
        assert len(row["moves"]) == sum(predicted.values())
        if stage == cfg["pp"] - 1:
            assert predicted == {}
        else:
            assert predicted and max(predicted) == bound, (coord, predicted)
            assert [m["moved"] for m in row["moves"]] == [
                m["lr_sum"] > 0 and (m["updates"] > 0 or m["backwards"] > 0) for m in row["moves"]]
            folded = sum(m["moved"] and m["backwards"] > 0 for m in row["moves"])
            assert folded > 0 or cfg["a"] == 1  # a = 1: every stale forward follows a step
        assert len(row["restores"]) >= cfg["calls"] * cfg["n"] and all(row["restores"])
        assert len(row["true_after_step"]) == len(row["steps"]) and all(row["true_after_step"])


def first_moved_step(cfg, stage: int, steps) -> int:
    """The first local step of ``stage`` whose group has a forward that ran on moved weights,
    from the action lists and which steps updated (fp16 skips some). A stale forward (its
    backward after a step) moves the weights when the LRs of its d steps are not all the
    warm-up's 0 (an update was taken, or d > 1) and there is something to move by (the
    moments of an update, or a gradient of this group)."""
    plan = plan_stream("paci", cfg["pp"], cfg["a"], cfg["n"])
    version = updates = backwards = 0
    for k in range(cfg["calls"]):
        for act in plan.call(k)[stage]:
            if act.op is Op.STEP:
                updates += steps[version]["ok"]
                version += 1
                backwards = 0
            elif act.op is Op.BACKWARD:
                backwards += 1
            elif act.op is Op.FORWARD:
                ahead = plan.steps_before_backward(k, stage, act.mb)
                if ahead and (updates or (ahead > 1 and backwards)):
                    return version + ahead
    raise AssertionError("no forward on moved weights")


@pytest.mark.parametrize("case", [c for c, twin in sorted(PREDICTED.items()) if twin])
def test_weight_prediction_departs_from_plain_paci_at_stale_stages_only(case, results):
    """The twin is the same run without prediction. Stage 0 steps exactly as its twin up to
    the step that takes the first gradient of a forward on moved weights, computed from the
    lists (``first_moved_step``), and its weights differ from that step's first update on (an
    fp16 step that skips keeps the weights it had). The last stage never moves its weights:
    it departs only through its inputs."""
    predicted, plain = results(case, "runtime"), results(PREDICTED[case], "runtime")
    cfg = predicted["pp0tp0dp0"]["config"]
    first, twin = predicted["pp0tp0dp0"]["steps"], plain["pp0tp0dp0"]["steps"]
    k = first_moved_step(cfg, 0, first)
    assert 0 < k < len(first) - 2
    assert first[:k] == twin[:k]
    updated = next(i for i in range(k, len(first)) if first[i]["ok"])
    assert all(p["weights"] == t["weights"] for p, t in zip(first[k:updated], twin[k:updated]))
    assert all(p["weights"] != t["weights"] for p, t in zip(first[updated:], twin[updated:]))
    last = f"pp{cfg['pp'] - 1}tp0dp0"
    assert predicted[last]["predicted"] == {} and predicted[last]["losses"] != plain[last]["losses"]


@pytest.mark.parametrize("case,twin", [("p4_tied_bf16_lookahead", "p4_tied_bf16"),
                                       ("p2_dp2_distopt_bf16_lookahead", "p2_dp2_distopt_bf16")])
def test_lookahead_moves_the_stale_stages_and_evaluates_on_the_true_weights(case, twin, results):
    """--paci-lookahead (the runtime equals the emulator above). Against the same run without
    it: every stage's first step takes the twin's gradient (nothing looked ahead before it);
    on stages with drift the weights after it are the look-ahead (they differ from the
    twin's) and the next group's gradient differs; the last stage never looks ahead, so its
    first step is the twin's entirely. Every evaluation ran on the true weights and left the
    look-ahead as it was."""
    real, plain = results(case, "runtime"), results(twin, "runtime")
    cfg = real["pp0tp0dp0"]["config"]
    for coord, row in real.items():
        assert len(row["evaluated"]) == 2 * len(cfg["eval_after"] or ()) and all(row["evaluated"])
        steps, twin_steps = row["steps"], plain[coord]["steps"]
        assert steps[0]["grad_norm"] == twin_steps[0]["grad_norm"]
        if coord.startswith(f"pp{cfg['pp'] - 1}"):
            assert steps[0] == twin_steps[0]
        else:
            assert steps[0]["weights"] != twin_steps[0]["weights"]
            assert steps[1]["grad_norm"] != twin_steps[1]["grad_norm"]


def test_nadam_steps_otherwise_than_adam_once_the_learning_rate_is_above_0(results):
    """--optimizer nadam (the runtime equals the emulator above) against its Adam twin: the
    first step runs at the warm-up's lr 0 (a record's lr is the scheduler's after its step),
    where both leave the weights as they were; every later step of every stage lands
    elsewhere, with the same micro-batch order and drift."""
    nadam, adam = results("p2_dp2_distopt_bf16_nadam", "runtime"), \
        results("p2_dp2_distopt_bf16", "runtime")
    assert sorted(nadam) == sorted(adam)
    for coord, row in nadam.items():
        steps, twin = row["steps"], adam[coord]["steps"]
        assert len(steps) == len(twin) > 2
        assert steps[0]["weights"] == twin[0]["weights"]
        assert all(n["weights"] != a["weights"] for n, a in zip(steps[1:], twin[1:]))
        assert row["histogram"] == adam[coord]["histogram"]


@pytest.mark.parametrize("case", ["p2_dp2_ep2_moe", "p2_dp2_ep2_moe_bf16",
                                  "p2_dp2_ep2_moe_allgather"])
def test_with_experts_split_over_ep_every_rank_of_a_stage_clips_by_one_norm(case, results):
    """The experts of each MoE layer split over the stage's 2 data-parallel ranks (EP = 2):
    every rank of a stage steps with one grad norm (the dense part over tensor parallel, the
    experts' over expert-tensor x expert parallel, as Megatron's expert optimizer does within
    the stage), and clipping is active. Before the fix each EP rank clipped by its own; under
    bf16 it still did until 2026-12-07 (the expert optimizer's fp32 main copies lack the
    weights' ``allreduce`` mark, so its group fell back to tensor parallel), and the dense
    weights of the EP ranks drifted apart: a resume, which loads one copy, was not exact."""
    real = results(case, "runtime")
    cfg = real["pp0tp0dp0"]["config"]
    for stage in range(cfg["pp"]):
        norms = [real[f"pp{stage}tp0dp{d}"]["steps"] for d in range(cfg["dp"])]
        assert [s["grad_norm"] for s in norms[0]] == [s["grad_norm"] for s in norms[1]]
        assert max(float.fromhex(s["grad_norm"]) for s in norms[0]) > cfg["clip"]


@pytest.mark.parametrize("case", ["p4_moe_bias", "p2_dp2_ep2_moe_bias_distopt"])
def test_the_expert_bias_moves_by_the_rate_times_a_over_n_at_each_local_step(case, results):
    """Aux-loss-free balancing under PACI: each local step moves every expert's bias by
    exactly rate x a / N, up or down (``mcore/expert_bias.py``), so after S steps each bias
    is k x rate x a / N with |k| <= S, and the biases moved (the runtime's buffers, by hand;
    that they equal the emulator's after every step is the bit-for-bit test's)."""
    rows = {coord: row for coord, row in results(case, "runtime").items() if row["expert_bias"]}
    assert len(rows) >= 2  # the stages with MoE layers (--moe-layer-freq 2)
    for coord, row in rows.items():
        cfg = row["config"]
        per_step = cfg["moe"]["router_bias_update_rate"] * cfg["a"] / cfg["n"]
        steps = len(row["steps"])
        ks = [bias / per_step for layer in row["expert_bias"] for bias in layer]
        assert ks and all(abs(k - round(k)) < 0.05 and abs(round(k)) <= steps for k in ks), \
            (coord, ks)
        assert max(abs(k) for k in ks) >= 2, (coord, ks)  # moved, and more than once


@pytest.mark.slow  # about 2 min: 16 processes on 2 cores; in .ci/slow-tests
def test_a_sixteen_stage_pipeline_equals_its_emulator_bit_for_bit(tmp_path):
    """P = 16, a = 8, bf16, tied embeddings and the default prediction (issue 51): every
    micro-batch loss, every stage's steps (grad norm, LR, weights SHA-256) and every drift
    equal the one-process emulator's; drift is at its bound on every stage (2 on stages 0-6,
    1 on 7-14, 0 on the last) and the tied copy trails stage 0 by ceil(16/8) = 2 steps."""
    case = "p16_a8_bf16_predict"
    load = run_cases(tmp_path, [("emulator", 1, [case], 240), ("runtime", 16, [case], 420)])
    assert_bit_for_bit(case, load)
    rows = load(case, "runtime")
    assert [rows[f"pp{s}tp0dp0"]["max_drift"] for s in range(16)] == [2] * 7 + [1] * 8 + [0]
    assert max(int(k) for k in rows["pp15tp0dp0"]["tied_histogram"]) == 2
    predicted = [rows[f"pp{s}tp0dp0"]["predicted"] for s in range(16)]
    assert predicted[0] and not predicted[15]


@pytest.mark.slow  # 8 runtime processes (about 2 min); guarded at P = 2 x DP = 2 by default
def test_p4_by_dp2_tied_with_realistic_flags_equals_its_emulator(tmp_path):
    """The tied exchange with the distributed optimizer and the overlaps, in bf16 and fp16,
    at P = 4 x DP = 2 (lag 2). By default the same flags run at P = 2 x DP = 2 (TIED_DP2,
    lag 1 and 2) and tied P = 4 without DP (p4_tied*): this adds both at once."""
    load = run_cases(tmp_path, [("emulator", 2, WIDE, 540), ("runtime", 8, WIDE, 360)])
    for case in WIDE:
        assert_bit_for_bit(case, load)
        test_tied_weight_staleness_reaches_its_bound_and_no_more(case, 2, load)
    test_fp16_case_has_stages_skipping_on_their_own("p4_dp2_tied_fp16_distopt_overlap", load)
