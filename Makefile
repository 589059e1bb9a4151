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

## test-fast: the unit layer only (the core in process: no launcher, no adapter; docs/testing.md),
## spread over the machine's CPUs by pytest-xdist
.PHONY: test-fast
test-fast: install
	python -m pytest -q -m unit -n auto tests

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

## cluster-up: two "hosts" (network namespaces dgc-hostA/B, veth 10.77.0.1/2, tc-shaped link at
## RATE=1gbit|100mbit, sshd in each); cluster-down removes all of it; cluster-demo trains the MNIST
## example with DGC across them (horovodrun -H hostA:1,hostB:1 over ssh, Gloo). Needs root.
## cluster-bench: benchmarks/synthetic_benchmark.py across them: ResNet-50 and LSTM shapes (synthetic
## compute), then ResNet-18 (real convolutions); Horovod dense, fp16, DGC and DDP dense, fp16, PowerSGD;
## last, 2 ranks per host (-H hostA:2,hostB:2): ResNet-50's shapes and the real ResNet-18 with dense,
## flat DGC and DGC(exchange="hierarchical"), the link's bytes per step both ways and the step time (--link-table;
## HIER_ARGS="--warmup-steps 1 --steps 3" for a short run).
RATE ?= 1gbit
.PHONY: cluster-up cluster-down cluster-demo cluster-bench
cluster-up: install
	RATE=$(RATE) DELAY=$(DELAY) bash scripts/cluster/up.sh
cluster-down:
	bash scripts/cluster/down.sh
cluster-demo: install
	@test -e /run/netns/dgc-hostA || $(MAKE) --no-print-directory cluster-up
	bash scripts/cluster/run.sh --gloo python examples/pytorch_mnist.py --compression dgc $(ARGS)
cluster-bench: install
	@test -e /run/netns/dgc-hostA || $(MAKE) --no-print-directory cluster-up
	bash scripts/cluster/run.sh --gloo python benchmarks/synthetic_benchmark.py --model resnet50 --markdown \
	    --bandwidth $$(cat $${DGC_CLUSTER_STATE:-/run/dgc-cluster}/rate) $(ARGS)
	bash scripts/cluster/run.sh --gloo python benchmarks/synthetic_benchmark.py --model lstm_lm --markdown \
	    --bandwidth $$(cat $${DGC_CLUSTER_STATE:-/run/dgc-cluster}/rate) $(ARGS)
	bash scripts/cluster/run.sh --gloo python benchmarks/synthetic_benchmark.py --model resnet18 --markdown \
	    --bandwidth $$(cat $${DGC_CLUSTER_STATE:-/run/dgc-cluster}/rate) $(ARGS)
	for m in resnet50 resnet18; do \
	    NP=4 HOSTS=hostA:2,hostB:2 bash scripts/cluster/run.sh --gloo python benchmarks/synthetic_benchmark.py \
	        --model $$m --compression none,dgc,dgc-hier --link-table --iface dgc0 \
	        --bandwidth $$(cat $${DGC_CLUSTER_STATE:-/run/dgc-cluster}/rate) $(ARGS) $(HIER_ARGS) || exit 1; \
	done

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

## docker-test: docker/Dockerfile built and run for real (scripts/docker/test.sh): the engine (installed
## and started if none answers; needs root then), a local Debian base image where the public one cannot
## be pulled, the build, then in the container `horovodrun --check-build` and `make demo`, and
## `horovodrun -H` over ssh across two containers on a Docker network. Removes its containers and
## network and stops the engine it started. DEMO_ARGS: the demo's ARGS; CLUSTER_ARGS (default --epochs 1).
.PHONY: docker-test
docker-test:
	bash scripts/docker/test.sh

## convergence: does DGC at 99.9% sparsity train as well as dense SGD? MNIST CNN and Shakespeare LSTM
## LM on a simulated cluster (dgc_horovod/simulate.py), N = 4 and 16 workers, 3 seeds: dense vs full DGC,
## the ablation ladder and two side studies -> docs/convergence.{md,png}, raw JSON in runs/convergence/.
## About 3 h with ARGS=--jobs 2 on this 2-core machine (2026-12-02: one seed of all 22 runs took 7,426 s of run time,
## two at a time). ARGS=--quick: the CI smoke run, < 2 min.
.PHONY: convergence
convergence: install
	python benchmarks/convergence.py $(ARGS)

## docs: regenerate docs/api.md from the docstrings and the DGC pipeline figure docs/dgc_pipeline.png
.PHONY: docs
docs: install
	TF_USE_LEGACY_KERAS=1 python scripts/gen_api_docs.py docs/api.md
	MPLBACKEND=Agg python scripts/draw_dgc_figure.py docs/dgc_pipeline.png
