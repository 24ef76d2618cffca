"""The test tiers, and the fast tier's guard.

- ``fast``: every test that is neither ``dist`` nor ``slow`` and is not in the deny-list
  ``NOT_FAST`` below: the pure core, config, flags, plans, the NCCL and cost models, formulas;
  no process launched, no torch.compile (``python -m pytest -m fast tests``).
- the default suite (``-m "not slow"``, pytest.ini): ``fast``, ``NOT_FAST`` and ``dist``.
- ``slow``: long end-to-end runs, run on their own.

The guard: while a ``fast`` test (its fixtures included) runs, starting a process (through
tests/launch.py, ``subprocess``, ``os.fork``/``os.posix_spawn``/``os.system`` or
``multiprocessing``) raises ``launch.ProcessRefused``; a test that caught that error and went
on fails all the same.
"""

import gc
import multiprocessing.process
import os
import subprocess

import pytest

import launch

HERE = os.path.dirname(os.path.abspath(__file__))

# The deny-list: tests neither dist nor slow that are not fast, each with why (it calls
# torch.compile, runs pip or launches a process, or is pure but long). "FILE::TEST" (every parametrization),
# "FILE::TEST[ID]" (one) or "FILE" (all of it).
NOT_FAST = {
    "test_bench_overhead.py::test_quick_run_reports_both_arms_and_clocks":
        "its report fixture runs bench_overhead --quick in a process",
    "test_bench_overhead.py::test_both_arms_compute_the_same_losses": "the same report",
    "test_bench_overhead.py::test_profile_names_paci_parts": "the same report",
    "test_cpu_patches.py::test_version_read_is_light_and_both_import_names_work":
        "a fresh interpreter (what an import pulls in)",
    "test_cpu_patches.py::test_apply_cpu_patches_in_a_fresh_process": "a fresh interpreter",
    "test_cpu_patches.py::test_low_precision_gemm_runs_in_fp32_only_without_a_native_kernel":
        "a fresh interpreter that patches Megatron-Core",
    "test_data.py::test_training_is_deterministic_and_model_is_reused":
        "preprocess_data --workers 2 starts a multiprocessing pool",
    "test_data.py::test_cli_prints_training_flags": "python -m ...preprocess_data",
    "test_data.py::test_cli_error_exit_code_without_traceback": "python -m ...preprocess_data",
    "test_depth.py::test_every_deep_plan_passes_its_start_up_checks_with_drift_at_the_bound":
        "pure, but P = 17..32 take about a minute on 2 cores",
    "test_eager_groups.py::test_a_second_set_up_shuts_the_first_ones_groups_down":
        "sets up gloo process groups and Megatron's parallel state in this process",
    "test_executor_and_config.py::test_entry_point_rejects_bad_flags_before_starting":
        "runs pretrain_gpt_paci.py",
    "test_install.py": "pip install --dry-run, a venv, setup.py read in a fresh interpreter",
    "test_megatron_lm.py::test_other_megatron_lm_versions_are_refused":
        "a fresh interpreter (the check changes sys.path)",
    "test_megatron_lm.py::test_the_listed_default_differences_with_megatron_lm_are_all_there_are":
        "a fresh interpreter importing Megatron-LM (skipped without MEGATRON_LM_PATH)",
    "test_megatron_lm.py::test_the_megatron_lm_extra_is_what_pretrain_gpt_imports":
        "a fresh interpreter importing pretrain_gpt.py (skipped without MEGATRON_LM_PATH)",
    "test_quiet.py::test_only_the_fallback_warnings_are_silenced":
        "python -W always -c 'import paci_megatron'",
    "test_training.py::test_bad_input_fails_before_training":
        "torchrun pretrain_gpt_paci.py, 7-35 s each",
    "test_weight_prediction.py::test_the_fused_kernel_equals_the_plain_pass_to_bf16_rounding":
        "torch.compile (inductor runs g++)",
    "test_weight_prediction.py::test_the_restore_is_megatrons_cast_bit_for_bit_and_in_place[fused]":
        "torch.compile",
    "test_weight_prediction.py::test_after_start_up_nothing_compiles_and_an_unmet_variant_runs_plain":
        "torch.compile (aot_eager)",
    "test_weight_prediction.py::test_a_predicted_forward_has_no_host_sync_and_a_few_operators[fused]":
        "torch.compile",
    "test_weight_prediction.py::test_the_fused_kernel_allocates_no_full_size_temporary":
        "torch.compile in a fresh interpreter",
}


def _key(item) -> str:
    """``FILE::TEST[ID]`` of an item, FILE relative to tests/."""
    path = os.path.relpath(str(item.path), HERE).replace(os.sep, "/")
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    return f"{path}::{rest}" if rest else path


def _not_fast(key: str) -> bool:
    bare = key.split("[", 1)[0]
    return any(entry in (key, bare) or bare.startswith(entry + "::") for entry in NOT_FAST)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    modules = {}
    for item in items:
        modules.setdefault(_key(item).split("::", 1)[0], item)
        if not (item.get_closest_marker("dist") or item.get_closest_marker("slow")
                or _not_fast(_key(item))):
            item.add_marker(pytest.mark.fast)
    # a NOT_FAST entry must name a test of its file (a renamed test would turn fast silently)
    for entry in NOT_FAST:
        path, _, name = entry.partition("::")
        item = modules.get(path)
        if name and item is not None and getattr(item, "module", None) is not None \
                and not hasattr(item.module, name.split("::", 1)[0].split("[", 1)[0]):
            raise pytest.UsageError(f"tests/conftest.py NOT_FAST: {entry} names no test")


class _Guard:
    """Process creation refused, and each refusal recorded, while installed."""

    def __init__(self):
        self.refused = []
        self._saved = []

    def _refuse(self, how):
        def refuse(*args, **kwargs):
            self.refused.append(how)
            raise launch.ProcessRefused(how)
        return refuse

    def _patch(self, owner, name, value):
        if hasattr(owner, name):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def install(self):
        guard = self

        class RefusedPopen(subprocess.Popen):
            def __init__(self, args, *rest, **kwargs):
                self._child_created = False  # what Popen.__del__ reads
                guard.refused.append(f"subprocess.Popen({args!r})")
                raise launch.ProcessRefused(f"subprocess.Popen({args!r})"[:200])

        self._patch(subprocess, "Popen", RefusedPopen)
        for name in ("start", "launch", "run_python", "run_torchrun"):
            self._patch(launch, name, self._refuse(f"launch.{name}"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            self._patch(os, name, self._refuse(f"os.{name}"))
        self._patch(multiprocessing.process.BaseProcess, "start",
                    self._refuse("multiprocessing.Process.start"))

    def uninstall(self):
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


_GUARD = pytest.StashKey()


def _guarded(item):
    """Run one phase of a fast test under the guard; a refusal it swallowed fails it."""
    if item.get_closest_marker("fast") is None:
        return (yield)
    guard = item.stash.setdefault(_GUARD, _Guard())
    guard.install()
    try:
        result = yield
    except BaseException as exc:  # a failure, or a skip that a refusal may have caused
        guard.uninstall()
        refused, guard.refused = guard.refused, []
        if refused and not isinstance(exc, launch.ProcessRefused):
            raise launch.ProcessRefused(", ".join(refused)[:500]) from exc
        raise
    guard.uninstall()
    if guard.refused:
        refused, guard.refused = guard.refused, []
        raise launch.ProcessRefused(", ".join(refused)[:500])
    return result


_FROZEN_FOR = []  # the module whose first test froze the heap last


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """At each test module's first test: collect, then freeze what survives (gc.freeze), so
    the collector no longer walks the suite's long-lived heap (Megatron's and torch's modules,
    earlier modules' fixtures). The pure plan checks ran 1.6x slower late in the suite than
    alone, the time spent in full collections over objects that never die."""
    if _FROZEN_FOR[-1:] != [item.module]:
        gc.collect()
        gc.freeze()
        _FROZEN_FOR[:] = [item.module]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # fixtures of every scope that this test sets up
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.fixture
def fast_guard(request):
    """The guard of this fast test (None outside the fast tier): a test of the guard itself
    clears ``refused`` of the refusals it caused on purpose."""
    return request.node.stash.get(_GUARD, None)
