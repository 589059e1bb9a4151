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

## demo-tf: the TensorFlow 2 examples with DGC on 2 ranks (GradientTape loop, then Keras model.fit)
.PHONY: demo-tf
demo-tf: install
	TF_USE_LEGACY_KERAS=1 $(HOROVODRUN) --gloo python examples/tensorflow2_mnist.py --compression dgc $(ARGS)
	TF_USE_LEGACY_KERAS=1 $(HOROVODRUN) --gloo python examples/tensorflow2_keras_mnist.py --compression dgc $(ARGS)

## bench: wire bytes, compress cost and collectives per step (benchmarks/; ratios side by side)
.PHONY: bench
bench: install
	python benchmarks/wire.py
	python benchmarks/compress_cost.py
	python benchmarks/collectives.py

check-build: install
	horovodrun --check-build

## clean-venv: remove .venv (the built Horovod wheel stays cached in ~/.cache/dgc_horovod)
clean-venv:
	rm -rf $(VENV)

## docker: build the CPU and the GPU image (docker/Dockerfile, docker/Dockerfile.gpu); needs a
## Docker engine with BuildKit. Both run scripts/install.sh, like `make install`.
DOCKER ?= docker
.PHONY: docker
docker:
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make docker: no Docker engine answers ('$(DOCKER) info' failed); start one, or build on a machine that has one" >&2; exit 1; }
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile -t dgc_horovod:cpu .
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile.gpu -t dgc_horovod:gpu .

## docs: regenerate docs/api.md from the docstrings and the DGC pipeline figure docs/dgc_pipeline.png
.PHONY: docs
docs: install
	TF_USE_LEGACY_KERAS=1 python scripts/gen_api_docs.py docs/api.md
	MPLBACKEND=Agg python scripts/draw_dgc_figure.py docs/dgc_pipeline.png
