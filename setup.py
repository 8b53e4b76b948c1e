"""mergecomp: compressed data-parallel training for PyTorch.

torch is required but deliberately loose (>=2.1): a torch the user already has is kept.
On a machine without torch, `make setup` installs one explicitly before this package so
that pip never resolves a multi-GB CUDA build by accident.
"""
from setuptools import find_packages, setup

setup(
    name="mergecomp",
    version="0.1.0",
    description="Compressed data-parallel training for PyTorch: gradient compressors, "
                "fused and overlapped communication, a compression scheduler",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mergecomp", "mergecomp.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "tqdm", "pyyaml"],
    extras_require={
        "horovod": ["horovod"],
        "plots": ["matplotlib"],
        "test": ["pytest"],
    },
    entry_points={
        # Third-party packages register components in these groups, e.g.
        # [mergecomp.compressors] mycomp = mypkg.module:MyCompressor
    },
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
