# dgc_horovod — every target installs what is missing first (scripts/install.sh; seconds when
# nothing changed), then runs inside the project's virtual environment .venv/.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
export PATH := $(VENV)/bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 3
NP ?= 2
HOROVODRUN := horovodrun -np $(NP) -H localhost:$(NP)

.PHONY: install test demo demo-none check-build clean-venv

install:
	@bash scripts/install.sh

## test: the whole suite (unit tests, and real `horovodrun -np 2` jobs over Gloo and MPI)
test: install
	python -m pytest -q tests

## demo: train the MNIST CNN with DGC on 2 ranks (real digits, a few minutes on 2 cores)
demo: install
	$(HOROVODRUN) --gloo python examples/pytorch_mnist.py --compression dgc $(ARGS)

## demo-none: the same run with dense allreduce, for comparison
demo-none: install
	$(HOROVODRUN) --gloo python examples/pytorch_mnist.py --compression none $(ARGS)

check-build: install
	horovodrun --check-build

## clean-venv: remove .venv (the built Horovod wheel stays cached in ~/.cache/dgc_horovod)
clean-venv:
	rm -rf $(VENV)
