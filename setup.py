"""paci-megatron: the PACI asynchronous pipeline schedule as a plugin for Megatron-Core."""

from setuptools import setup

setup(
    name="paci-megatron",
    version="0.1.0",
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
        "torch==2.13.0",
        "megatron-core==0.16.1",
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
        # what Megatron-LM's pretrain_gpt.py (tag core_v0.16.1) imports beyond megatron-core's
        # own requirements, for python -m paci_megatron.run: megatron/training imports six
        # (bert_tokenization), regex (gpt2_tokenization), yaml (yaml_arguments, initialize)
        # and pydantic (megatron/rl, via training.py) unconditionally; tensorboard for
        # --tensorboard-dir. Flag-specific extras (wandb, tiktoken, transformers, TE, Apex)
        # stay the user's choice, as in Megatron-LM.
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic", "tensorboard"],
        # Transformer Engine and Apex need CUDA; used only when importable
    },
)
