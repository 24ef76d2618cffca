"""CPU/gloo patches: the guard runs before any patch (unit) and stock Megatron-Core schedules under torchrun (dist).

Three torchrun launches (1, 2 and 4 processes) cover: stock 1F1B at PP=2 and PP=4 training with
the same losses as no-pipelining PP=1 (same seed, layout-invariant init), tied embeddings at
PP=2 staying equal, interleaved PP=2 x VPP=2, bf16, TP=2 x PP=2, DP=2 x PP=2 with overlapped
grad reduce and the distributed optimizer, dropout reproducibility and activation recompute.
"""

import importlib.machinery
import importlib.util
import math
import sys
import types
import unittest.mock

import pytest

from launch import REPO, launch_together, results_by_case, run_python, run_torchrun

try:
    from paci_megatron.patches import cpu_gloo, release_check, versions
except ImportError:  # source checkout without setup.py install
    from patches import cpu_gloo, release_check, versions

WORKER = "tests/workers/stock_smoke.py"
LAUNCH_TIMEOUT = 150


# ------------------------------------------------------------------------------------------
# Version guard (no Megatron import, no processes)
# ------------------------------------------------------------------------------------------


def test_apply_checks_version_before_patching(monkeypatch):
    if cpu_gloo.torch.cuda.is_available():
        pytest.skip("apply_cpu_patches is a no-op with CUDA")
    monkeypatch.setattr(release_check, "installed_megatron_core_version", lambda: "0.15.0")
    applied_before = cpu_gloo.applied_cpu_patches()
    with pytest.raises(release_check.UnsupportedMegatronVersion):
        cpu_gloo.apply_cpu_patches()
    assert cpu_gloo.applied_cpu_patches() == applied_before


def _stand_in(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("te", [False, True])
def test_mtp_layers_build_without_transformer_engine_on_main(monkeypatch, te):
    """Megatron-LM main's MTP layer asks isinstance(module, Inference*Linear); without
    Transformer Engine those names are MagicMocks and the check raises, so no MTP model builds
    on CPU (the drop-in's MTP test on main failed with 'isinstance() arg 2 must be a type').
    The patch answers False there and leaves a real class (Transformer Engine present) alone."""
    inference = (type("InferenceColumnParallelLinear", (), {}) if te
                 else unittest.mock.MagicMock(spec=str))

    def check(module):
        return isinstance(module, (inference,))

    _stand_in(monkeypatch, "megatron.core.tensor_parallel.inference_layers",
              InferenceColumnParallelLinear=inference)
    mtp = _stand_in(monkeypatch, "megatron.core.transformer.multi_token_prediction",
                    is_inference_column_parallel_linear=check)
    if not te:
        with pytest.raises(TypeError, match="must be a type"):
            mtp.is_inference_column_parallel_linear(object())
    assert cpu_gloo.patch_mtp_inference_linear() is (not te)
    assert (mtp.is_inference_column_parallel_linear is check) is te
    assert mtp.is_inference_column_parallel_linear(object()) is False
    if te:
        assert mtp.is_inference_column_parallel_linear(inference()) is True


def test_the_inference_linear_patch_is_a_no_op_where_the_release_lacks_it(monkeypatch):
    """0.16-0.19 have no inference_layers module: nothing to patch."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("inference_layers")
                        else real(name, *a))
    assert cpu_gloo.patch_mtp_inference_linear() is False


def test_version_read_is_light_and_both_import_names_work():
    """Reading the version imports no megatron.core; patches imports as `patches` and as
    `paci_megatron.patches` (relative imports only)."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import patches\n"
        "v = patches.installed_megatron_core_version()\n"
        "assert 'megatron.core' not in sys.modules, 'megatron.core was imported'\n"
        "assert v == patches.check_megatron_core_version()\n"
        "try:\n"
        "    import paci_megatron.patches as p2\n"
        "    assert p2.TESTED_MCORE_VERSIONS == patches.TESTED_MCORE_VERSIONS\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "print(v)\n" % REPO
    )
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in versions.TESTED_MCORE_VERSIONS


_APPLY_CHECK = r"""
import sys
sys.path.insert(0, %(repo)r)
import torch
import patches
names = patches.apply_cpu_patches()
assert names == list(patches.CPU_PATCHES), names
assert patches.apply_cpu_patches() == names  # idempotent
try:  # the same file under its installed name must not patch twice
    import paci_megatron.patches as p2
    assert p2.apply_cpu_patches() == names
except ModuleNotFoundError:
    pass
# targeted: the process-wide torch.cuda is untouched
try:
    torch.cuda.current_device()
    raise SystemExit("torch.cuda.current_device was patched globally")
except (AssertionError, RuntimeError):
    pass
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mp_random
import megatron.core.optimizer.optimizer as mo
assert mo.clip_grad_by_total_norm_fp32._paci_cpu_wrapped
assert mo.FP32Optimizer.__init__._paci_cpu_wrapped
# the RNG tracker works on CPU and makes dropout reproducible
drop = torch.nn.Dropout(0.5)
def masks():
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside = drop(torch.ones(64))
    with tracker.fork():
        inside = drop(torch.ones(64))
    with tracker.fork():
        inside2 = drop(torch.ones(64))
    return outside, inside, inside2, drop(torch.ones(64))
m1, m2 = masks(), masks()
assert all(torch.equal(a, b) for a, b in zip(m1, m2))
assert not torch.equal(m1[0], m1[1]) and not torch.equal(m1[1], m1[2])
# fork leaves the default generator where it was: the outer stream continues unperturbed
torch.manual_seed(7)
ref = [drop(torch.ones(64)) for _ in range(2)]
assert torch.equal(ref[0], m1[0]) and torch.equal(ref[1], m1[3])
print("OK", ",".join(names))
"""


def test_apply_cpu_patches_in_a_fresh_process():
    """Idempotent, targeted (no global torch.cuda change), and the CPU RNG tracker works."""
    if cpu_gloo.torch.cuda.is_available():
        pytest.skip("apply_cpu_patches is a no-op with CUDA")
    out = run_python(_APPLY_CHECK % {"repo": REPO}, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-4000:]


# ------------------------------------------------------------------------------------------
# Stock schedules under torchrun
# ------------------------------------------------------------------------------------------


def _launch(nproc, cases):
    _, out, _ = run_torchrun(WORKER, ["--case", ",".join(cases)], nproc=nproc,
                             timeout=LAUNCH_TIMEOUT)
    results = results_by_case(out)
    missing = set(cases) - set(results)
    assert not missing, f"no RESULT for {missing}:\n{out[-4000:]}"
    for r in results.values():
        if "ms_per_iter" in r:
            print(f"{r['case']}: {r['ms_per_iter']} ms/iter, losses {r['losses'][0]:.4f} -> "
                  f"{r['losses'][-1]:.4f}")
    return results


@pytest.fixture(scope="module")
def one_proc():
    return _launch(1, ["pp1", "pp1_rope_rmsnorm", "moe_pp1"])


@pytest.fixture(scope="module")
def two_procs():
    return _launch(2, ["pp2", "vpp", "bf16", "pp2_untied_overlap", "dropout", "moe_pp2"])


@pytest.fixture(scope="module")
def four_procs():
    return _launch(4, ["pp4", "tp2pp2", "dp2pp2", "dp2pp2_bf16", "moe_ep2pp2_alltoall",
                       "moe_ep2pp2_allgather"])


def _assert_trains(result, min_drop=0.2):
    losses = result["losses"]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), result
    assert losses[-1] < losses[0] - min_drop, f"{result['case']}: loss did not go down {losses}"
    # forward_only evaluation after the 10 steps sees the trained model
    assert result["eval_loss"] < losses[0] - min_drop, result


@pytest.mark.dist
def test_no_pipelining_pp1_trains(one_proc):
    _assert_trains(one_proc["pp1"])
    _assert_trains(one_proc["pp1_rope_rmsnorm"])  # RoPE (inv_freq device), RMSNorm, untied


@pytest.mark.dist
@pytest.mark.parametrize("pp", [2, 4])
def test_stock_1f1b_matches_pp1(pp, one_proc, two_procs, four_procs):
    ref = one_proc["pp1"]["losses"]
    run = (two_procs if pp == 2 else four_procs)[f"pp{pp}"]
    _assert_trains(run)
    # step 0 measured bit-identical; later steps differ by float reduction order (~1e-7)
    assert run["losses"][0] == ref[0]
    assert max(abs(a - b) for a, b in zip(ref, run["losses"])) < 1e-4, (ref, run["losses"])


@pytest.mark.dist
def test_tied_embeddings_stay_equal_across_stages(two_procs, four_procs):
    for r in (two_procs["pp2"], two_procs["vpp"], two_procs["bf16"], four_procs["pp4"],
              four_procs["tp2pp2"], four_procs["dp2pp2"]):
        assert r["tied_diff"] == 0.0, r


@pytest.mark.dist
def test_interleaved_pp2_vpp2(one_proc, two_procs):
    r = two_procs["vpp"]
    _assert_trains(r)
    assert r["reads"] == [44, 44]  # one batch per micro-batch and chunk (10 train + 1 eval)
    # needs batch_p2p_comm=False on gloo; with it the result matches the unpipelined model
    assert abs(r["losses"][0] - one_proc["pp1"]["losses"][0]) < 1e-6
    assert max(abs(a - b) for a, b in zip(one_proc["pp1"]["losses"], r["losses"])) < 1e-4


@pytest.mark.dist
def test_bf16_and_untied_overlap_grad_reduce(one_proc, two_procs):
    _assert_trains(two_procs["bf16"])
    assert abs(two_procs["bf16"]["losses"][0] - one_proc["pp1"]["losses"][0]) < 1e-2
    _assert_trains(two_procs["pp2_untied_overlap"])
    assert two_procs["pp2_untied_overlap"]["tied_diff"] is None


@pytest.mark.dist
def test_tp2_pp2(one_proc, four_procs):
    r = four_procs["tp2pp2"]
    _assert_trains(r)
    assert abs(r["losses"][0] - one_proc["pp1"]["losses"][0]) < 1e-5


@pytest.mark.dist
def test_dp2_pp2_distributed_optimizer(four_procs):
    for name in ("dp2pp2", "dp2pp2_bf16"):
        r = four_procs[name]
        assert r["dp"] == 2
        _assert_trains(r)


@pytest.mark.dist
def test_dropout_reproducible_and_recompute_replays_rng(two_procs):
    r = two_procs["dropout"]
    (a, b, recompute, off), (ga, gb, grc, _) = r["losses"], r["grad_norms"]
    assert a == b and ga == gb, r  # same seed, same dropout masks
    assert recompute == a and grc == ga, r  # recompute replays the forward's RNG states
    assert a != off, r  # dropout is active


_GEMM_CHECK = r"""
import sys
sys.path.insert(0, %(repo)r)
import torch
from torch.overrides import TorchFunctionMode
import patches
from patches import low_precision_gemm
low_precision_gemm.native_low_precision_gemm = lambda dtype: %(native)s  # as on a CPU with(out) it
patches.apply_cpu_patches()
print("AGAIN", low_precision_gemm.patch_low_precision_gemm())  # nothing left to change
from megatron.core.tensor_parallel.layers import (
    linear_with_grad_accumulation_and_async_allreduce as linear)

class Matmuls(TorchFunctionMode):  # below the patch's mode: sees the GEMMs it runs
    seen = []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.bmm, torch.baddbmm):
            self.seen.append(args[0 if func is not torch.baddbmm else 1].dtype)
        return func(*args, **(kwargs or {}))

from megatron.core.tensor_parallel import layers
fn = layers.LinearWithGradAccumulationAndAsyncCommunication
patched = fn.__dict__["backward"].__func__
def recorded(ctx, grad):  # autograd runs backward outside the caller's modes: record there too
    with Matmuls():
        return patched(ctx, grad)
fn.backward = staticmethod(recorded)

torch.manual_seed(0)
x = torch.randn(6, 2, 64).bfloat16().requires_grad_()
w = torch.randn(96, 64).bfloat16().requires_grad_()
g = torch.randn(6, 2, 96).bfloat16()
with Matmuls():
    y = linear(x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
               sequence_parallel=False)
    y.backward(g)
f = lambda t: t.detach().float()
exact = {  # fp32 GEMMs rounded once to bf16, by hand
    "y": (f(x) @ f(w).t()).bfloat16(), "dx": (f(g) @ f(w)).bfloat16(),
    "dw": (f(g).reshape(-1, 96).t() @ f(x).reshape(-1, 64)).bfloat16()}
got = {"y": y, "dx": x.grad, "dw": w.grad}
print("DTYPES", sorted(set(str(d) for d in Matmuls.seen)), len(Matmuls.seen))
print("EXACT", all(torch.equal(got[k].detach(), exact[k]) for k in exact))

# core attention's scores (beta = 0, alpha the softmax scale) and context, and their grads
from megatron.core.transformer import dot_product_attention as dpa
q, k, v = (torch.randn(4, 8, 16).bfloat16().requires_grad_() for _ in range(3))
Matmuls.seen.clear()
with Matmuls():
    s = dpa.torch.baddbmm(torch.full((4, 8, 8), float("nan")).bfloat16(), q, k.transpose(1, 2),
                          beta=0.0, alpha=0.25)
    c = dpa.torch.bmm(s, v)
gc = torch.randn(4, 8, 16).bfloat16()
c.backward(gc)
gs = (f(gc) @ f(v).transpose(1, 2)).bfloat16()
exact = {"s": (f(q) @ f(k).transpose(1, 2) * 0.25).bfloat16(), "c": (f(s) @ f(v)).bfloat16(),
         "dv": (f(s).transpose(1, 2) @ f(gc)).bfloat16(),
         "dq": (f(gs) * 0.25 @ f(k)).bfloat16()}
got = {"s": s, "c": c, "dv": v.grad, "dq": q.grad}
print("ATTENTION", sorted(set(str(d) for d in Matmuls.seen)), len(Matmuls.seen))
print("ATTENTION EXACT", all(torch.equal(got[k].detach(), exact[k]) for k in exact))
Matmuls.seen.clear()
h = torch.randn(2, 4, 4).half()
with Matmuls():
    dpa.torch.bmm(h, h)
print("FP16", [str(d) for d in Matmuls.seen])
"""


NATIVE = ["False", "True", "dtype == torch.bfloat16"]


@pytest.fixture(scope="module")
def gemm_checks():
    """The check in a fresh process per case, the three side by side (each mostly imports)."""
    if cpu_gloo.torch.cuda.is_available():
        pytest.skip("apply_cpu_patches is a no-op with CUDA")
    runs = launch_together([[sys.executable, "-c", _GEMM_CHECK % {"repo": REPO, "native": n}]
                            for n in NATIVE], timeout=180)
    return dict(zip(NATIVE, runs))


@pytest.mark.parametrize("native", NATIVE)
def test_low_precision_gemm_runs_in_fp32_only_without_a_native_kernel(native, gemm_checks):
    """Without native bf16 GEMM (AVX2 CPUs, where oneDNN's bf16 path is 5-40x slower than
    fp32) the linear layer's three GEMMs and core attention's batched ones (and their
    gradients) run in fp32, rounded once to bf16: exactly the hand computation. With it (or
    with one for bf16 alone, the patch then on for fp16), the bf16 GEMMs are left alone."""
    out = gemm_checks[native]
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    dtype = "float32" if native == "False" else "bfloat16"
    assert f"DTYPES ['torch.{dtype}'] 3" in out.stdout, out.stdout
    assert f"ATTENTION ['torch.{dtype}'] 2" in out.stdout, out.stdout
    fp16 = "float16" if native == "True" else "float32"
    assert f"FP16 ['torch.{fp16}']" in out.stdout, out.stdout
    assert "AGAIN False" in out.stdout.splitlines(), out.stdout
    if native == "False":
        assert "\nEXACT True" in out.stdout and "ATTENTION EXACT True" in out.stdout, \
            out.stdout


@pytest.mark.dist
def test_stock_1f1b_trains_moe_on_cpu_at_p2_and_ep2(one_proc, two_procs, four_procs):
    """Megatron's MoE layers (alternating with dense ones; shared experts; sigmoid router
    with expert bias; aux loss) under stock 1F1B on CPU/gloo: P=2 is P=1 to float reduction
    order, and at P=2 x EP=2 (the experts split over the 2 data-parallel ranks of each stage,
    the distributed optimizer) both dispatchers route the same tokens to the same experts."""
    pp1, pp2 = one_proc["moe_pp1"], two_procs["moe_pp2"]
    a2a, gather = four_procs["moe_ep2pp2_alltoall"], four_procs["moe_ep2pp2_allgather"]
    for run in (pp1, pp2, a2a, gather):
        _assert_trains(run, min_drop=0.1)
    assert pp2["losses"][0] == pp1["losses"][0]
    assert max(abs(a - b) for a, b in zip(pp1["losses"], pp2["losses"])) < 1e-4
    assert a2a["dp"] == gather["dp"] == 2
    assert max(abs(a - b) for a, b in zip(a2a["losses"], gather["losses"])) < 1e-5
