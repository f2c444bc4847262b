# One Makefile: CI, hooks and people all call these targets.
SHELL := /bin/bash
VENV ?= .venv
# pyproject asks for Python 3.11: python3.11 where it is installed beside another python3.
SYSTEM_PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CACHE := .cache
KAFKA_LIBS := $(CACHE)/kafka/libs
SPARK_JARS := $(CACHE)/spark/jars
STAMP_PY := $(VENV)/.installed
STAMP_KAFKA := $(KAFKA_LIBS)/.fetched
STAMP_SPARK := $(SPARK_JARS)/.fetched
STAMP_APT := $(CACHE)/.apt
STAMP_FUZZ := $(VENV)/.fuzz-installed
STAMP_CONTAINERS := $(CACHE)/.containers
FUZZ_RUNS ?= 10000

.PHONY: setup run test test-unit test-integration test-alerts fuzz chaos bench lint fmt up down report clean proto go \
	images compose-test test-py313

setup: $(STAMP_PY) $(STAMP_KAFKA) $(STAMP_APT)

$(STAMP_PY): pyproject.toml
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev,spark,faust]'
	touch $@

# Maven may come from apt (below): the jars are fetched after it. KSB's partition assignor, a
# broker plugin, is built from infra/kafka/assignor into the same directory.
ASSIGNOR_SRC := infra/kafka/assignor/pom.xml $(shell find infra/kafka/assignor/src -name '*.java')
$(STAMP_KAFKA): infra/kafka/pom.xml $(ASSIGNOR_SRC) | $(STAMP_APT)
	mkdir -p $(KAFKA_LIBS)
	mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies \
	    -DincludeScope=runtime -DoutputDirectory=$(abspath $(KAFKA_LIBS))
	mvn -q -B -f infra/kafka/assignor/pom.xml package
	cp infra/kafka/assignor/target/ksb-kafka-assignor.jar $(KAFKA_LIBS)/
	touch $@

$(STAMP_SPARK): infra/spark/pom.xml | $(STAMP_APT)
	mkdir -p $(SPARK_JARS)
	mvn -q -B -f infra/spark/pom.xml dependency:copy-dependencies \
	    -DincludeScope=runtime -DoutputDirectory=$(abspath $(SPARK_JARS))
	touch $@

# Debian packages, each installed when its command is missing: redis-server (the stack's locks and
# timers), maven (fetches the Kafka and Spark jars; brings a Java runtime), prometheus (panel
# checks), kcat (protocol example), chromium (the report's headless-browser test). Non-interactive,
# also through sudo (which would drop a DEBIAN_FRONTEND set in front of it).
$(STAMP_APT):
	mkdir -p $(CACHE)
	@missing=""; for b in redis-server:redis-server mvn:maven prometheus:prometheus kcat:kcat chromium:chromium; do \
	    command -v $${b%%:*} >/dev/null || missing="$$missing $${b##*:}"; done; \
	if [ -n "$$missing" ]; then \
	    echo "installing with apt:$$missing"; \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing </dev/null; \
	fi
	touch $@

# Containers (README "docker-compose"): Debian's podman 4.3 with runc, and debootstrap for the base
# images, installed when missing as above; podman-compose comes with the venv (pyproject's dev
# extra). Podman reads infra/images/containers.conf (CONTAINERS_CONF, set by devtools.containers).
$(STAMP_CONTAINERS):
	mkdir -p $(CACHE)
	@missing=""; for b in podman:podman runc:runc debootstrap:debootstrap; do \
	    command -v $${b%%:*} >/dev/null || missing="$$missing $${b##*:}"; done; \
	if [ -n "$$missing" ]; then \
	    echo "installing with apt:$$missing"; \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing </dev/null; \
	fi
	touch $@

# Every image docker-compose.yml runs, built here: stand-ins for the base images it names (no
# image registry is reachable) from Debian's packages and the project's jars, then the KSB and
# Kafka images from their Dockerfiles (devtools/containers/images.py).
images: setup $(STAMP_CONTAINERS)
	$(PY) -m devtools.containers.images

# The project's docker-compose.yml, up on podman and checked (tests/compose): every service
# healthy, the order client's dialogs exactly once and in order, a dispatcher killed, Redis
# restarted, Prometheus's targets, the Spark job's SLA output, nothing left after `down -v`.
compose-test: images
	COMPOSE_TEST=1 $(PY) -m pytest tests/compose -p no:cacheprovider $(PYTEST_ARGS)

# The unit suite on Python 3.13 (Debian 13), in a container (devtools/containers/py313.py).
test-py313: setup $(STAMP_CONTAINERS)
	$(PY) -m devtools.containers.py313 $(PYTEST_ARGS)

# Everything the demo starts, the Spark audit job included, is set up first.
run: setup $(STAMP_SPARK)
	$(PY) -m devtools.demo

test: setup $(STAMP_SPARK) test-alerts
	$(PY) -m pytest $(PYTEST_ARGS)

# KSB's Prometheus alert rules against their unit tests (promtool comes with Debian's prometheus).
test-alerts: $(STAMP_APT)
	promtool check rules infra/prometheus/alerts.yml
	promtool test rules infra/prometheus/alerts.test.yml

test-unit: $(STAMP_PY)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup $(STAMP_SPARK)
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# Long mode of the reliability checks (docs/reliability.md): hypothesis feeds 10,000 inputs to
# each decoder and the reference model runs more and longer sequences against the engine; then
# atheris runs FUZZ_RUNS inputs per decoder. No Kafka: everything here is pure. The long reference
# model takes about 3 minutes alone, more beside other work: past pyproject's 300 s per test.
fuzz: $(STAMP_FUZZ)
	$(PY) -m pytest tests/fuzz tests/model --long --timeout 1800 $(PYTEST_ARGS)
	$(PY) -m tests.fuzz.run_atheris --runs $(FUZZ_RUNS)

$(STAMP_FUZZ): $(STAMP_PY)
	$(PIP) install -q -e '.[fuzz]'
	touch $@

# The bench's Spark audit section needs the Kafka connector's jars, as the demo and the tests do.
bench: setup $(STAMP_SPARK)
	$(PY) -m bench $(BENCH_ARGS)

# The chaos harness (docs/reliability.md): rounds of cross-instance traffic while a seeded
# schedule kills and pauses every service and reader, Kafka and Redis, and cuts the link; exits 1
# naming the seed of any round that broke an invariant. CHAOS_ARGS passes options through:
# make chaos CHAOS_ARGS='--rounds 2 --messages 2000 --seed 42'
chaos: setup
	$(PY) -m devtools.chaos $(CHAOS_ARGS)

lint: $(STAMP_PY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(STAMP_PY)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Start / stop only the embedded stack (Kafka + Redis) in the background, state under var/.
# Secured by default; SECURITY=tls for SASL_SSL, SECURITY=plaintext for a development stack without
# authentication (or KSB_STACK_SECURITY, which the tests, the demo and the benchmarks read too).
up: setup
	$(PY) -m devtools.localstack up $(if $(SECURITY),--security $(SECURITY))

down:
	$(PY) -m devtools.localstack down

report: setup $(STAMP_SPARK)
	$(PY) -m ksb.spark.report

clean:
	rm -rf var $(CACHE) infra/kafka/assignor/target

# The queue service's API (proto/) as Python (generated code and typed stubs) and as Go (the
# client in clients/go), committed, so an install or a `go build` needs no protoc;
# tests/unit/test_proto.py fails when they are not current. The Go plugins, pinned, are installed
# into .cache/go/bin the first time (about 40 s); without a Go toolchain only Python is made.
PROTO := proto/ksb/api/queue/v1/queue.proto
GO ?= go
GO_BIN := $(abspath $(CACHE))/go/bin
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
STAMP_GO_PLUGINS := $(GO_BIN)/.plugins-$(PROTOC_GEN_GO_VERSION)-$(PROTOC_GEN_GO_GRPC_VERSION)
GO_PACKAGE := Mksb/api/queue/v1/queue.proto=ksb/clients/go/api/queue/v1;queuev1
proto: $(STAMP_PY)
	$(PY) -m grpc_tools.protoc -I proto --python_out=shared --grpc_python_out=shared \
	    --mypy_out=shared --mypy_grpc_out=shared \
	    --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy \
	    --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc $(PROTO)
	@if command -v $(GO) >/dev/null; then $(MAKE) --no-print-directory proto-go; \
	else echo "no Go toolchain: clients/go/api not regenerated (tests/unit/test_proto.py will say so)"; fi

.PHONY: proto-go
proto-go: $(STAMP_PY) $(STAMP_GO_PLUGINS)
	$(PY) -m grpc_tools.protoc -I proto \
	    --plugin=protoc-gen-go=$(GO_BIN)/protoc-gen-go \
	    --plugin=protoc-gen-go-grpc=$(GO_BIN)/protoc-gen-go-grpc \
	    --go_out=clients/go --go_opt='module=ksb/clients/go,$(GO_PACKAGE)' \
	    --go-grpc_out=clients/go --go-grpc_opt='module=ksb/clients/go,$(GO_PACKAGE)' $(PROTO)

$(STAMP_GO_PLUGINS):
	mkdir -p $(GO_BIN)
	GOBIN=$(GO_BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(GO_BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	touch $@

# The Go client (clients/go, docs/protocol.md "RECEIVE through the queue service"): vet, its
# tests, and the `ksbgo` command in build/. Its modules come from the Go proxy on first use.
go:
	cd clients/go && $(GO) vet ./... && $(GO) test ./... && $(GO) build -o ../../build/ksbgo ./cmd/ksbgo
