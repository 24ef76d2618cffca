"""The package asks for version ranges, not pins, so installing it into an environment that
already holds a torch and a megatron-core in range changes neither; this project's CPU pins
live in constraints-cpu.txt."""

import json
import os
import re
import shutil
import sys
import tempfile

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from launch import REPO, launch, run_python


def _requirements():
    code = ("import runpy, setuptools\n"
            "setuptools.setup = lambda **kw: print(repr(kw['install_requires']))\n"
            "runpy.run_path('setup.py')\n")
    out = run_python(code, cwd=REPO, timeout=60, check=True)
    return {r.name: r for r in map(Requirement, eval(out.stdout.strip().splitlines()[-1]))}


def test_torch_and_megatron_core_are_ranges_the_code_supports():
    from paci_megatron.patches import versions

    reqs = _requirements()
    torch, mcore = reqs["torch"].specifier, reqs["megatron-core"].specifier
    assert not any(spec.operator == "==" for r in reqs.values() for spec in r.specifier)
    # no upper bound on either: a newer torch or Megatron is the user's to bring
    assert not any(spec.operator in ("<", "<=", "~=", "===") for spec in (*torch, *mcore))
    for tested in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0", "3.0.0"):
        assert torch.contains(Version(tested))
    for container in ("2.11.0a0+git1234567", "2.15.0a0+79aa17489c.nv26.10"):
        assert torch.contains(Version(container), prereleases=True)  # as pip reads installed
    assert not torch.contains(Version("2.10.0"))
    assert str(mcore) == str(Requirement("x" + versions.MCORE_RANGE).specifier)
    assert all(Version(v) in mcore for v in versions.TESTED_MCORE_VERSIONS + ("0.21.0",))
    assert not mcore.contains(Version("0.16.0"))
    pins = open(os.path.join(REPO, "constraints-cpu.txt")).read()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M)
    pins = open(os.path.join(REPO, "constraints-py312.txt")).read()
    assert re.search(r"^torch==2\.14\.1$", pins, re.M)
    assert re.search(r"^megatron-core==0\.19\.2$", pins, re.M)


def _planned_installs(python, *extra):
    """What ``pip install -e REPO`` would install there (a dry run, nothing from an index)."""
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.json")
        proc = launch([python, "-m", "pip", "install", "--dry-run", "--quiet",
                       "--no-build-isolation", "--report", report, *extra, "-e", REPO],
                      cwd=REPO, timeout=300, env=_env_without_pip_config() if extra else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(report) as handle:
            return {item["metadata"]["name"]: item["metadata"]["version"]
                    for item in json.load(handle)["install"]}


def _env_without_pip_config():
    """No pip configuration: neither this machine's cap on torch nor its local wheels."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def test_installing_keeps_the_torch_and_megatron_core_already_there():
    assert set(_planned_installs(sys.executable)) == {"paci-megatron"}


def _stand_in(site, name, version):
    """A metadata-only installed distribution (what pip reads of an installed package)."""
    info = os.path.join(site, f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as handle:
        handle.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    open(os.path.join(info, "INSTALLER"), "w").write("pip\n")
    open(os.path.join(info, "RECORD"), "w").write("")


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """A virtual environment of this Python whose own packages come first: stand-ins put there
    shadow this environment's (pip reads the first of a name on the path), whose setuptools
    builds the editable metadata."""
    root = tmp_path_factory.mktemp("venv")
    launch([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)],
           check=True, timeout=300, stdout=None, stderr=None)
    python = str(root / "bin" / "python")
    site = launch([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  check=True, timeout=60).stdout.strip()
    if launch([python, "-c", "import setuptools, pip"], timeout=60).returncode != 0:
        pytest.skip("this Python's base has no setuptools to build the editable metadata "
                    "without an index (leg 2's 3.12); leg 1 runs it")
    return python, site


@pytest.mark.parametrize("torch_version,mcore_version", [
    ("2.14.1", "0.19.2"),                       # the newest stack CI leg 2 installs
    ("2.15.0", "0.19.2"),                       # a release newer than any tested
    ("2.15.0a0+79aa17489c.nv26.10", "0.20.0"),  # a container's build, with Megatron-LM main
    ("2.11.0a0+git1234567", "0.16.1"),          # an older container's build
])
def test_installing_beside_a_users_torch_and_megatron_core_keeps_both(bare_venv, torch_version,
                                                                      mcore_version):
    """Metadata-only stand-ins of the user's torch and megatron-core (and of the other
    requirements, so that nothing needs an index): pip plans to install this package alone,
    with no index, no local wheels and no machine cap in play."""
    python, site = bare_venv
    stand_ins = {"torch": torch_version, "megatron-core": mcore_version, "numpy": "2.4.6",
                 "packaging": "25.0", "psutil": "7.1.0", "sentencepiece": "0.2.1"}
    for name, version in stand_ins.items():
        _stand_in(site, name, version)
    try:
        planned = _planned_installs(python, "--no-index")
    finally:
        for entry in os.listdir(site):
            if any(entry.startswith(n.replace("-", "_") + "-") for n in stand_ins):
                shutil.rmtree(os.path.join(site, entry))
    assert set(planned) == {"paci-megatron"}, planned
