"""paci-megatron: the PACI asynchronous pipeline schedule as a plugin for Megatron-Core."""

import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
# torch: no upper bound, as megatron-core itself (torch>=2.6): no known break is named in a
# newer release, and a bound would make pip replace a user's torch (and its CUDA) with ours.
# The lower bound is the oldest torch the code ran on (2.11 on an H200; 2.13 and 2.14.1 on CPU
# in CI), written 2.11.0a0 so that a container's pre-release build of it (2.11.0a0+git...)
# is inside: pip keeps an installed pre-release that a range admits, and PyPI publishes no
# torch pre-releases for it to pick instead (tests/test_install.py checks both with pip).
# megatron-core: from the oldest release the patches support (patches/versions.py,
# MCORE_RANGE), with no upper bound either: Megatron-LM main (0.20.0, pip install -e of a
# checkout) and newer releases install beside us and run with a warning naming the newest
# tested release (patches/release_check.check_megatron_core_version). pip picks 0.16.x on Python
# 3.10/3.11 (0.17 and later require 3.12). A machine's exact pins are constraints-*.txt.
TORCH_RANGE = ">=2.11.0a0"
with open(os.path.join(HERE, "patches", "versions.py")) as handle:
    MCORE_RANGE = re.search(r'^MCORE_RANGE = "([^"]+)"', handle.read(), re.M).group(1)

setup(
    name="paci-megatron",
    version="0.2.0",
    description="PACI: bubble-free asynchronous pipeline parallelism with bounded weight drift "
                "for NVIDIA Megatron-Core (--pipeline-schedule paci)",
    python_requires=">=3.10",
    # the repo-root folder patches/ ships as paci_megatron.patches
    packages=["paci_megatron", "paci_megatron.features", "paci_megatron.mcore",
              "paci_megatron.tools", "paci_megatron.patches",
              "paci_megatron.patches.megatron_lm"],
    package_dir={"paci_megatron.patches": "patches"},
    py_modules=[],
    install_requires=[
        "torch" + TORCH_RANGE,
        "megatron-core" + MCORE_RANGE,
        "numpy",
        "packaging",
        "psutil",  # megatron's dist_checkpointing writer dies without it (see CPU notes)
        "sentencepiece",  # tokenizer for real data (preprocess_data, --tokenizer-model)
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "sentencepiece", "tensorboard", "matplotlib"],
        "bench": ["matplotlib"],
        "data": ["sentencepiece"],
        "tensorboard": ["tensorboard"],
        # what Megatron-LM's pretrain_gpt.py imports beyond megatron-core's own requirements,
        # for python -m paci_megatron.run, on every supported tag (the union): core_v0.16.1's
        # megatron/training imports six (bert_tokenization), regex (gpt2_tokenization), yaml
        # (yaml_arguments, initialize) and pydantic (megatron/rl, via training.py)
        # unconditionally; core_v0.17.1 and core_v0.18.2 only yaml; core_v0.19.0 none of them
        # (tests/test_megatron_lm.py, STARTUP_IMPORTS); tensorboard for --tensorboard-dir.
        # Flag-specific extras (wandb, tiktoken, transformers, TE, Apex) stay the user's
        # choice, as in Megatron-LM.
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic", "tensorboard"],
        # Transformer Engine and Apex need CUDA; used only when importable
    },
)
