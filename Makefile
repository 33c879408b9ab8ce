# podgate: `make run` starts it, `make test` checks it, `make bench` measures it.
# Every target bootstraps what it needs: Debian packages (as root) and a .venv.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# What podgate itself runs with (`make run`): namespaces, veths, CNI plugins, the OCI runtime,
# busybox for the sample images.
DEBS_RUN := iproute2 procps util-linux runc busybox-static containernetworking-plugins iptables
# What only the tests and benchmarks need: peers to compare with and to test against.
DEBS_TEST := socat containerd dnsmasq-base docker-registry
PYTEST_ARGS ?=
STATE_DIR ?= /var/lib/podgate
# The test environment is pinned: a green run is reproducible.
CONSTRAINTS := constraints.txt

FUZZ_RUNS ?= 1000000
# Seconds one input may take before libFuzzer calls it a hang.
FUZZ_HANG_SECONDS ?= 10

.PHONY: run test bench fuzz lint typecheck unit deps deps-run clean

define install_debs
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "warning: missing Debian packages:$$missing (run as root to install)"; fi; \
	fi
endef

$(VENV)/.run: pyproject.toml
	$(call install_debs,$(DEBS_RUN))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.test: pyproject.toml $(CONSTRAINTS) $(VENV)/.run
	$(call install_debs,$(DEBS_RUN) $(DEBS_TEST))
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	@touch $@

deps-run: $(VENV)/.run
deps: $(VENV)/.test

lint: deps
	$(VENV)/bin/ruff check src tests $(wildcard bench)
	$(VENV)/bin/ruff format --check src tests $(wildcard bench)
	$(VENV)/bin/lint-imports pyproject.toml

typecheck: deps
	$(VENV)/bin/mypy src

unit: deps
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck unit

run: deps-run
	$(VENV)/bin/podgate up --state-dir $(STATE_DIR)

bench: deps
	$(PY) -m bench $(BENCH_ARGS)

# Coverage-guided fuzzing (atheris) of every parser, FUZZ_RUNS inputs each; `make test` runs
# a bounded slice of the same targets (tests/fuzz/test_fuzz_slice.py).
fuzz: deps
	$(PY) -m pip install -q -e '.[test,fuzz]'
	@dir=$$(mktemp -d); trap 'rm -rf "$$dir"' EXIT; trap 'exit 1' INT TERM; \
	for t in $$($(PY) tests/fuzz/run_atheris.py --list); do \
	  echo "fuzz $$t: $(FUZZ_RUNS) inputs"; \
	  if ! $(PY) tests/fuzz/run_atheris.py $$t "$$dir/$$t" -runs=$(FUZZ_RUNS) \
	      -timeout=$(FUZZ_HANG_SECONDS) -rss_limit_mb=2048 -print_final_stats=1 \
	      -artifact_prefix=fuzz-crash-$$t- > "$$dir/$$t.log" 2>&1; then \
	    tail -40 "$$dir/$$t.log"; exit 1; fi; \
	  grep -E "^Done|stat::number_of_executed_units" "$$dir/$$t.log"; \
	done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
