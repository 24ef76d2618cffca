"""Import Megatron-LM's pretrain_gpt.py (through paci_megatron.run's hooks) as on a fresh
install of ``paci-megatron[megatron-lm]``, without installing anything.

    python tests/workers/clean_env_import.py PRETRAIN_GPT [--without NAME[,NAME...]]

The distributions such an install brings (this repository's ``install_requires`` and the
``megatron-lm`` extra, their requirements recursively from the installed metadata, and the
pip/setuptools of a new virtual environment) are linked into a temporary folder; the import
then runs in ``python -S`` (no site-packages, no .pth files) with only that folder on the
path, which also holds this repository's package laid out as installed. ``--without NAMES``
leaves those packages (a comma-separated list) out of the extra, to see that one is needed
or that none of them is. Prints ``IMPORTED`` or ``REFUSED
<error>``.
"""

import argparse
import importlib
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FRESH_VENV = ("pip", "setuptools")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup_requirements(extra: str):
    """install_requires + extras_require[extra] of this repository's setup.py (run with
    setuptools.setup replaced by a recorder: the ranges are computed, not literals)."""
    import runpy

    import setuptools

    recorded, real = {}, setuptools.setup
    setuptools.setup = lambda **kwargs: recorded.update(kwargs)
    try:
        runpy.run_path(os.path.join(REPO, "setup.py"))
    finally:
        setuptools.setup = real
    return list(recorded["install_requires"]) + list(recorded["extras_require"][extra])


def closure(requirements):
    """The installed distributions a pip install of ``requirements`` would bring."""
    from packaging.requirements import Requirement

    todo, found = [(Requirement(r), "") for r in requirements], {}
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # not installed here (an optional marker-only dependency)
        key = _norm(req.name)
        extras = sorted(req.extras)
        if (key, tuple(extras)) in found:
            continue
        found[(key, tuple(extras))] = dist
        for sub in dist.requires or []:
            for e in extras or [""]:
                todo.append((Requirement(sub), e))
    return {key: dist for (key, _), dist in found.items()}


def link_site(dists, folder: str) -> None:
    """Symlink each distribution's top-level files and folders (and its metadata) here."""
    for dist in dists.values():
        for path in dist.files or []:
            top = path.parts[0]
            if top == ".." or top == "__pycache__":
                continue
            source = os.path.join(str(dist.locate_file("")), top)
            target = os.path.join(folder, top)
            if os.path.exists(source) and not os.path.lexists(target):
                os.symlink(source, target)


def link_package(folder: str) -> None:
    """This repository's package laid out as an install lays it out (setup.py maps
    ``paci_megatron.patches`` to the top-level ``patches/``)."""
    package = os.path.join(folder, "paci_megatron")
    os.mkdir(package)
    source = os.path.join(REPO, "paci_megatron")
    for name in os.listdir(source):
        if name not in ("__pycache__", "patches"):
            os.symlink(os.path.join(source, name), os.path.join(package, name))
    os.symlink(os.path.join(REPO, "patches"), os.path.join(package, "patches"))


def child(script: str) -> None:
    try:
        from paci_megatron import run

        run.install([], script)
        sys.argv = [script]
        importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    except Exception as exc:  # what a user on a fresh install would see
        print(f"REFUSED {type(exc).__name__}: {exc}", flush=True)
        return
    print("IMPORTED", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--without", default="")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args.script)
    left_out = {_norm(name) for name in args.without.split(",") if name}
    requirements = [r for r in setup_requirements("megatron-lm")
                    if _norm(re.split(r"[<>=!~\[; ]", r)[0]) not in left_out]
    dists = closure(requirements + list(FRESH_VENV))
    with tempfile.TemporaryDirectory(prefix="fresh_site_") as folder:
        link_site(dists, folder)
        link_package(folder)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(PYTHONPATH=folder, PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-S", os.path.abspath(__file__), "--child",
                               args.script], env=env, capture_output=True, text=True,
                              timeout=600, cwd=folder)
    print(f"DISTRIBUTIONS {sorted(dists)}")
    sys.stdout.write(proc.stdout)
    if "IMPORTED" not in proc.stdout and "REFUSED" not in proc.stdout:
        print(f"REFUSED exit {proc.returncode}: {proc.stderr[-3000:]}")


if __name__ == "__main__":
    main()
