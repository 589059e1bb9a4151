"""Packaging for dgc_horovod: Deep Gradient Compression as a Horovod compression plugin."""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "dgc_horovod", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    LONG_DESCRIPTION = f.read()

setup(
    name="dgc_horovod",
    version=_version(),
    description="Deep Gradient Compression (Lin et al., ICLR 2018) as a Horovod compression plugin",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["dgc_horovod", "dgc_horovod.*"]),
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1", "horovod==0.28.1"],
        "tensorflow": ["tensorflow-cpu>=2.16", "horovod==0.28.1"],
        "test": ["pytest", "mpi4py", "tqdm", "mlxtend"],
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
