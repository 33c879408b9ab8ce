# podgate: `make run` starts it, `make test` checks it, `make bench` measures it.
# Every target bootstraps what it needs: Debian packages (as root) and a .venv.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEBS := socat iproute2 procps util-linux containerd runc busybox-static containernetworking-plugins dnsmasq-base iptables docker-registry
PYTEST_ARGS ?=
STATE_DIR ?= /var/lib/podgate

.PHONY: run test bench lint typecheck unit deps clean

deps: $(STAMP)

$(STAMP): pyproject.toml
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "warning: missing Debian packages:$$missing (run as root to install)"; fi; \
	fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

lint: deps
	$(VENV)/bin/ruff check src tests $(wildcard bench)
	$(VENV)/bin/ruff format --check src tests $(wildcard bench)

typecheck: deps
	$(VENV)/bin/mypy src

unit: deps
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck unit

run: deps
	$(VENV)/bin/podgate up --state-dir $(STATE_DIR)

bench: deps
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
