"""The supported megatron-core releases (patches/versions.py) and what differs between them:
the version guard, the backward_step adapter, the schedule hook's 0.19 parameter, the
Megatron-LM pairing check, and the CPU patches that only newer releases need. Unit tests,
one process; the installed megatron-core is whichever this environment has (the default
suite: 0.16.1 on Python 3.11; the second CI leg: 0.19.x on Python 3.12)."""

import inspect
import sys
import types
import warnings

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from paci_megatron.patches import cpu_gloo, cpu_stand_ins, megatron_lm, release_check, versions


def _guard(monkeypatch, fake):
    monkeypatch.setattr(release_check, "installed_megatron_core_version", lambda: fake)
    monkeypatch.setattr(release_check, "_WARNED", set())
    return release_check.check_megatron_core_version()


# --- the table and the guard ------------------------------------------------------------------

def test_the_table_is_inside_the_range_and_ordered():
    spec = SpecifierSet(versions.MCORE_RANGE)
    assert all(Version(v) in spec for v in versions.TESTED_MCORE_VERSIONS)
    assert [r.minor for r in versions.RELEASES] == ["0.16", "0.17", "0.18", "0.19", "0.20"]
    assert all(versions.minor_of(v) == r.minor for r in versions.RELEASES for v in r.tested)
    tags = [r.megatron_lm_tag for r in versions.RELEASES]
    assert all(t.startswith(f"core_v{r.minor}.") for t, r in zip(tags[:-1], versions.RELEASES))
    assert tags[-1] == "main" and not versions.RELEASES[-1].on_index
    assert all(len(r.megatron_lm_commit) == 40 for r in versions.RELEASES)
    assert versions.NEWEST_TESTED == "0.20.0" and versions.NEWEST_ON_INDEX == "0.19.2"


def test_the_table_names_the_commits_of_the_shared_sources():
    """Each row's commit is the one ../shared/megatron-lm/README.md names for its folder."""
    import os
    import re

    readme = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "megatron-lm",
                          "README.md")
    if not os.path.isfile(readme):
        pytest.skip("no ../shared/megatron-lm")
    named = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{40})` \|", open(readme).read(), re.M))
    assert {r.megatron_lm_tag: r.megatron_lm_commit for r in versions.RELEASES} == named


@pytest.mark.parametrize("version", ["0.16.1", "0.16.2", "0.17.0", "0.17.1", "0.18.0", "0.18.2",
                                     "0.19.0", "0.19.2", "0.19.7", "0.20.0"])
def test_every_release_of_a_tested_minor_runs_without_a_warning(monkeypatch, version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _guard(monkeypatch, version) == version


@pytest.mark.parametrize("version", ["0.21.0", "0.20.1rc0", "0.19.3rc1", "1.0.0"])
def test_a_newer_or_pre_release_runs_with_one_warning_naming_the_newest_tested(monkeypatch,
                                                                                version):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _guard(monkeypatch, version) == version
        assert release_check.check_megatron_core_version() == version  # once a process
    assert len(caught) == 1 and caught[0].category is release_check.UntestedMegatronVersion
    message = str(caught[0].message)
    assert version in message and versions.NEWEST_TESTED in message
    assert versions.RELEASES[-1].megatron_lm_commit[:12] in message


@pytest.mark.parametrize("version", ["0.15.3", "0.16.0", "0.16.1rc0", "not-a-version", None])
def test_older_unreadable_or_missing_is_refused_naming_the_range_and_the_tested_pairs(
        monkeypatch, version):
    with pytest.raises(release_check.UnsupportedMegatronVersion) as err:
        _guard(monkeypatch, version)
    message = str(err.value)
    assert (version or "not installed") in message and versions.MCORE_RANGE in message
    assert all(r.megatron_lm_tag in message for r in versions.RELEASES)
    assert "pip install megatron-core==" in message
    assert isinstance(err.value, RuntimeError)


@pytest.mark.parametrize("version", sorted(versions.REFUSED))
def test_a_yanked_release_is_refused_with_its_reason(monkeypatch, version):
    with pytest.raises(release_check.UnsupportedMegatronVersion) as err:
        _guard(monkeypatch, version)
    assert f"megatron-core {version} is installed" in str(err.value)
    assert "yanked" in str(err.value)


def test_the_fix_fits_this_python_and_names_a_release_pip_can_install(monkeypatch):
    with pytest.raises(release_check.UnsupportedMegatronVersion) as err:
        _guard(monkeypatch, "0.15.0")
    if sys.version_info < (3, 12):
        assert "pip install megatron-core==0.16.1" in str(err.value)
        assert "need Python 3.12" in str(err.value)
    else:
        assert "pip install megatron-core==0.19.2" in str(err.value)


def test_the_installed_release_is_a_tested_one():
    assert release_check.check_megatron_core_version() in versions.TESTED_MCORE_VERSIONS


# --- backward_step: one adapter for both signatures -----------------------------------------------

def test_the_adapter_follows_the_installed_signature():
    from megatron.core.pipeline_parallel import schedules

    from paci_megatron.mcore import compat

    params = list(inspect.signature(schedules.backward_step).parameters)
    assert compat.BACKWARD_STEP_TAKES_MODEL_TYPE == ("model_type" in params)
    minor = versions.minor_of(release_check.installed_megatron_core_version())
    assert compat.BACKWARD_STEP_TAKES_MODEL_TYPE == (minor == "0.16")


@pytest.mark.parametrize("takes_model_type", [True, False])
def test_the_adapter_calls_either_signature(monkeypatch, takes_model_type):
    from paci_megatron.mcore import compat

    calls = []
    if takes_model_type:
        def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
            calls.append((input_tensor, output_tensor, output_tensor_grad, model_type, config))
            return "grad"
    else:
        def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
            calls.append((input_tensor, output_tensor, output_tensor_grad, config))
            return "grad"
    monkeypatch.setattr(compat, "mcore_schedules", types.SimpleNamespace(
        backward_step=backward_step))
    monkeypatch.setattr(compat, "BACKWARD_STEP_TAKES_MODEL_TYPE", takes_model_type)
    assert compat.backward_step("x", "y", "dy", "TYPE", "CONFIG") == "grad"
    assert calls == [("x", "y", "dy", "TYPE", "CONFIG") if takes_model_type
                     else ("x", "y", "dy", "CONFIG")]


def test_the_adapter_runs_megatrons_backward_on_the_installed_release():
    """The gradient the adapter's backward leaves is autograd's (a last stage: no input, no
    output gradient)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig

    from paci_megatron.mcore import compat

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    x = torch.tensor([0.5, 0.25, 4.0])
    loss = (w * x).sum()
    assert compat.backward_step(None, loss, None, ModelType.encoder_or_decoder, config) is None
    assert torch.equal(w.grad, x)


# --- get_forward_backward_func ---------------------------------------------------------------------

def test_the_hook_takes_019s_schedule_pg_collection_and_refuses_a_multi_module_one():
    from megatron.core.pipeline_parallel import schedules

    from paci_megatron.patches.schedule_hook import install_forward_backward_func

    def paci(**kwargs):
        return "paci"

    uninstall = install_forward_backward_func(paci)
    try:
        assert schedules.get_forward_backward_func() is paci
        assert schedules.get_forward_backward_func(2, None) is paci
        assert schedules.get_forward_backward_func(schedule_pg_collection=object()) is paci
        try:
            from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
            multi = MultiModuleProcessGroupCollection.__new__(MultiModuleProcessGroupCollection)
        except ImportError:  # 0.16: no such collection; a stand-in of that name
            multi = type("MultiModuleProcessGroupCollection", (), {})()
        with pytest.raises(NotImplementedError, match="--pipeline-schedule 1f1b"):
            schedules.get_forward_backward_func(schedule_pg_collection=multi)
    finally:
        uninstall()
    assert getattr(schedules.get_forward_backward_func, "paci_hooked", False) is False


# --- Megatron-LM: the checkout's release and the patched functions' parameters ------------------------

@pytest.mark.parametrize("checkout,mcore,refused", [
    ("0.16.1", "0.16.1", None),
    ("0.19.1", "0.19.2", None),  # the tag core_v0.19.0 reads 0.19.1
    ("0.19.0", "0.16.1", "needs the megatron-core of its own minor release"),
    ("0.17.1", "0.19.2", "needs the megatron-core of its own minor release"),
    ("0.20.0", "0.20.0", None),  # Megatron-LM main with its own megatron-core
    ("0.21.0", "0.21.0", None),  # newer: runs (the megatron-core guard warns)
    ("0.20.0", "0.19.2", "pip install --no-deps of it"),
    ("0.15.0", "0.16.1", "supports the tested pairs"),
])
def test_a_checkout_pairs_with_the_megatron_core_of_its_release(checkout, mcore, refused):
    from paci_megatron.patches.megatron_lm import version

    if refused is None:
        version._check_pair("/x", checkout, mcore)
        return
    with pytest.raises(megatron_lm.UnsupportedMegatronLM, match=refused) as err:
        version._check_pair("/x", checkout, mcore)
    assert checkout in str(err.value)


def test_a_patched_function_must_keep_the_parameters_its_patch_uses():
    from paci_megatron.patches.megatron_lm.version import _mismatch

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None, pg_collection=None):
        pass

    def old_parse_args(extra_args_provider=None, ignore_unknown_args=False):
        pass

    def new_parse_args(ignore_unknown_args=False, extra_args_provider=None):
        pass

    assert _mismatch(train_step, ([], ["optimizer", "opt_param_scheduler"])) is None
    assert "['opt_param_scheduler']" in _mismatch(old_parse_args, ([], ["opt_param_scheduler"]))
    needed = (["extra_args_provider", "ignore_unknown_args"], [])
    assert _mismatch(old_parse_args, needed) is None
    assert "start with" in _mismatch(new_parse_args, needed)


# --- CPU patches that newer releases need ------------------------------------------------------------

def test_the_cpu_stand_in_has_a_current_stream_that_waits_for_nothing():
    cuda = cpu_stand_ins.CpuCuda()
    stream = cuda.current_stream()
    assert stream.wait_event(object()) is None and stream.wait_stream(stream) is None
    assert cuda.current_device() == torch.device("cpu")


def test_grad_norm_groups_patch_only_where_the_release_has_them():
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    has = "has_grad_norm_group" in MegatronOptimizer.__dict__
    minor = versions.minor_of(release_check.installed_megatron_core_version())
    assert has == (minor == "0.19")
    if torch.cuda.is_available():
        pytest.skip("the CPU patches are a no-op with CUDA")
    cpu_gloo.apply_cpu_patches()
    assert getattr(MegatronOptimizer.__dict__.get("has_grad_norm_group"), "_paci_cpu_wrapped",
                   False) == has
