"""paci-megatron: the PACI asynchronous pipeline schedule as a plugin for Megatron-Core."""

from setuptools import setup

setup(
    name="paci-megatron",
    version="0.1.0",
    description="PACI: bubble-free asynchronous pipeline parallelism with bounded weight drift "
                "for NVIDIA Megatron-Core (--pipeline-schedule paci)",
    python_requires=">=3.10",
    # the repo-root folder patches/ ships as paci_megatron.patches
    packages=["paci_megatron", "paci_megatron.mcore", "paci_megatron.patches"],
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
        # Transformer Engine and Apex need CUDA; used only when importable
    },
)
