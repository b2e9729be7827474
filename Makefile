# fedgate -- make targets are thin wrappers around the `fedgate` command.
# `make help` lists them.

SHELL := /bin/bash
VENV ?= .venv
FEDGATE := $(VENV)/bin/fedgate
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  make %-10s %s\n", $$1, $$2}'

setup: ## install RabbitMQ, Java, the Python venv and the Kafka/Spark jars (idempotent)
	@bash infra/setup/setup.sh

up: setup ## start the local federation (backend, gateways, Kafka); PROFILE=ha: no single point of failure
	@$(if $(PROFILE),FEDGATE_PROFILE=$(PROFILE) ,)$(FEDGATE) up

down: ## stop the local federation; leaves no process behind
	@if [ -x $(FEDGATE) ]; then $(FEDGATE) down; else echo "nothing to stop (no $(VENV))"; fi

status: ## nodes, ports, state, connections and queue depths (JSON=1 for --json)
	@$(FEDGATE) status $(if $(JSON),--json,)

command: ## what the router did with a command, step by step: make command ID=<id printed by send> [WAIT=30]
	@$(FEDGATE) command "$(ID)" $(if $(WAIT),--wait --timeout $(WAIT),)

console: ## the fleet console in the browser (http://127.0.0.1:<port base + 7>, admin credentials)
	@$(FEDGATE) console

presence: ## where devices are connected (DEVICE=<id> for one)
	@$(FEDGATE) presence $(DEVICE)

send: ## send a message to a device through the router: make send DEVICE=d TOPIC=t PAYLOAD=p [RETAIN=1]
	@$(FEDGATE) send "$(DEVICE)" "$(TOPIC)" '$(PAYLOAD)' $(if $(RETAIN),--retain,)

gateway: ## add a region: make gateway REGION=local-ap, or REGION=eu-west-1 [AUTO_APPROVE=1] (Terraform)
	@$(FEDGATE) gateway add "$(REGION)" $(if $(AUTO_APPROVE),--auto-approve,)

gateway-destroy: ## remove a region: make gateway-destroy REGION=local-ap (or eu-west-1 [AUTO_APPROVE=1])
	@$(FEDGATE) gateway remove "$(REGION)" $(if $(AUTO_APPROVE),--auto-approve,)

regions: ## the regions (local and cloud), their gateways and state
	@$(FEDGATE) regions

query: ## Spark SQL over the analysts' tables: make query SQL="SELECT ..." (or SQL=top-talkers)
	@$(FEDGATE) query "$(SQL)"

count-now: ## count what the Spark job landed in the aggregates now, not at its next minute
	@$(FEDGATE) count-now

recompute: ## rebuild the aggregates from raw: make recompute SINCE=2026-11-20 UNTIL=2026-11-21
	@$(FEDGATE) recompute --since "$(SINCE)" --until "$(UNTIL)"

army: up ## simulated devices, counted end to end: make army DEVICES=2000 RATE=2000 DURATION=60 [ARGS="--commands 50 --storm-at 20"] [JSON=1]
	@$(FEDGATE) army --devices $(or $(DEVICES),1000) --rate $(or $(RATE),1000) --duration $(or $(DURATION),30) $(ARGS) $(if $(JSON),--json,)

demo: setup ## the whole federation on this machine with devices sending and receiving
	@$(FEDGATE) demo

cloud-rehearsal: setup ## boot the backend module's nodes from their Terraform-rendered cloud-init on 3 network namespaces: one cluster?
	@$(FEDGATE) cloud-rehearsal $(if $(JSON),--json,)

release: setup ## the fedgate release the cloud instances install: a wheel and the Spark jars archive -> build/release/ (infra/terraform/modules/fedgate-service)
	@$(VENV)/bin/python -m infra.cloud.release build/release

spark-package: ## the Spark job packaged for spark-submit -> build/spark/ (prints the submit command)
	@$(VENV)/bin/python -m spark.package

# -n: one pytest-xdist worker per lane (tests/conftest.py LANES)
test: setup ## unit and integration tests against real RabbitMQ and Kafka
	@FEDGATE_REQUIRE_RUNTIME=1 $(VENV)/bin/python -m pytest -n 6 $(PYTEST_ARGS)

unit: venv ## unit tests only (no brokers; on the venv alone, what needs Java, the jars or Terraform skips with the reason)
	@$(VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

bench: setup ## benchmarks side by side with references -> bench/results/ (QUICK=1: shorter; BENCH=spark,router,cost,army,ha,scale; BENCH_KEEP=1 keeps the logs)
	@QUICK=$(QUICK) BENCH=$(BENCH) BENCH_KEEP=$(BENCH_KEEP) $(VENV)/bin/python -m bench

venv: ## the Python virtualenv alone (no root, no brokers): what make lint needs
	@bash infra/setup/setup.sh --venv-only

lint: venv ## ruff format --check, ruff check, mypy
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/mypy

clean: down ## stop everything and delete the local state (all broker data)
	@if [ -x $(FEDGATE) ]; then $(FEDGATE) down --purge; fi

.PHONY: help setup up down status presence console send gateway gateway-destroy regions query count-now recompute army demo cloud-rehearsal release spark-package test unit bench venv lint clean
