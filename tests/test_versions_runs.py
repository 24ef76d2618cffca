"""The runtime against its one-process reference on a few cases, as the second CI leg runs it
(Python 3.12 with the newest megatron-core 0.19.x; .ci/run): P=2 and P=4 bit for bit, tied
embeddings, bf16 with weight prediction. The same comparisons as tests/test_reference.py,
which runs every case in the default suite (so this file is skipped on megatron-core 0.16);
here three launches instead of four larger ones.
"""

import glob
import json
import os

import pytest

import test_reference as reference
from launch import run_torchrun

from paci_megatron.patches import release_check, versions

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    versions.minor_of(release_check.installed_megatron_core_version() or "") == "0.16",
    reason="on megatron-core 0.16 tests/test_reference.py runs every case (the default suite)")]

P2 = ["p2_a4", "p2_tied"]
P4 = ["p4_a4", "p4_tied_bf16", "p4_tied_bf16_predict"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    for mode, nproc, cases, timeout in (("emulator", 1, P2 + P4, 300), ("runtime", 2, P2, 240),
                                        ("runtime", 4, P4, 300)):
        run_torchrun(reference.WORKER, ["--mode", mode, "--out", str(out), *cases], nproc=nproc,
                     timeout=timeout, env={"PACI_TEST_HANG_S": str(timeout - 30)})

    def load(case, mode):
        rows = {}
        for path in glob.glob(os.path.join(out, f"{case}.{mode}.*.json")):
            rows[path.split(f".{mode}.")[1][:-len(".json")]] = json.load(open(path))
        assert rows, f"no {mode} results for {case}"
        return rows

    return load


@pytest.mark.parametrize("case", P2 + P4)
def test_runtime_equals_emulator_bit_for_bit(case, results):
    reference.test_runtime_equals_emulator_bit_for_bit(case, results)


@pytest.mark.parametrize("case,lag", [("p2_tied", 2), ("p4_tied_bf16", 2)])
def test_tied_weight_staleness_reaches_its_bound(case, lag, results):
    reference.test_tied_weight_staleness_reaches_its_bound_and_no_more(case, lag, results)


def test_weight_prediction_moves_stale_forwards_and_departs_from_plain_paci(results):
    reference.test_weight_prediction_moves_stale_forwards_and_restores_exactly(
        "p4_tied_bf16_predict", results)
    reference.test_weight_prediction_departs_from_plain_paci_at_stale_stages_only(
        "p4_tied_bf16_predict", results)


def test_the_cases_have_drift_and_moving_weights(results):
    for case in P2 + P4:
        first = results(case, "runtime")["pp0tp0dp0"]
        assert first["max_drift"] >= 1 and first["histogram"].get("1", 0) > 0, case
        digests = [s["weights"] for s in first["steps"]]
        assert len(set(digests)) == len(digests), case
