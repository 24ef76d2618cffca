"""The package asks for version ranges, not pins, so installing it into an environment that
already holds a torch and a megatron-core in range changes neither; this project's CPU pins
live in constraints-cpu.txt."""

import json
import os
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version

from launch import REPO


def _requirements():
    code = ("import runpy, setuptools\n"
            "setuptools.setup = lambda **kw: print(repr(kw['install_requires']))\n"
            "runpy.run_path('setup.py')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)
    return {r.name: r for r in map(Requirement, eval(out.stdout.strip().splitlines()[-1]))}


def test_torch_and_megatron_core_are_ranges_the_code_supports():
    from paci_megatron.patches import cpu_gloo

    reqs = _requirements()
    torch, mcore = reqs["torch"].specifier, reqs["megatron-core"].specifier
    assert not any(spec.operator == "==" for r in reqs.values() for spec in r.specifier)
    for tested in ("2.11.0", "2.12.1", "2.13.0"):
        assert Version(tested) in torch
    assert Version("2.14.0") not in torch and Version("2.10.0") not in torch
    assert str(mcore) == str(Requirement("x" + cpu_gloo.MCORE_RANGE).specifier)
    assert all(Version(v) in mcore for v in cpu_gloo.SUPPORTED_MCORE_VERSIONS)
    pins = open(os.path.join(REPO, "constraints-cpu.txt")).read()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M)


def test_installing_keeps_the_torch_and_megatron_core_already_there(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                    "--no-build-isolation", "--report", str(report), "-e", REPO],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    planned = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert planned == {"paci-megatron"}, planned
