"""The local federation's Prometheus: Debian's `prometheus` server scraping every node, with
fedgate's recording and alert rules (infra/prometheus/rules.yml).

Its targets are files (Prometheus's file service discovery) written from the federation's
record, one per job: a region added or removed rewrites them and Prometheus reads them again
by itself.  What it scrapes:

  rabbitmq         each RabbitMQ node's prometheus plugin (/metrics: the node's totals, and
                   its federation links by status), labelled with its role and region
  rabbitmq_queues  the same nodes' per-queue depths (/metrics/detailed), only fedgate's own
                   queues and the federation links' (a gateway's device sessions dropped)
  router           each router's /metrics
  spark            the Spark job's /metrics (spark/metrics.py)
  kafka            each broker's JMX exporter agent (infra/local/kafka_metrics.py)
  dns, powerdns    the DNS server's gateway health checks (infra/dns/serve.py), PowerDNS's own
  prometheus       itself

Its data lives in the node's folder (`data/`, kept `prometheus_retention`); no Alertmanager
runs here: firing alerts are Prometheus's own (/api/v1/alerts, `fedgate console`).
"""

from __future__ import annotations

import json
import math
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from infra.local.layout import (
    ROLE_BACKEND,
    ROLE_DNS,
    ROLE_GATEWAY,
    ROLE_KAFKA,
    ROLE_ROUTER,
    ROLE_SPARK,
    NodeSpec,
    StateFiles,
)
from infra.local.nodes import Node, NodeError
from infra.local.settings import PROJECT_ROOT

PROMETHEUS = "/usr/bin/prometheus"
RULES = PROJECT_ROOT / "infra" / "prometheus" / "rules.yml"
#: the queues whose depths are kept: fedgate's own and the federation links' (a gateway also
#: holds a queue per device session, thousands of series that no alert reads)
KEPT_QUEUES = r"fedgate\..*|federation: .*"


def targets(specs: list[NodeSpec], host: str) -> dict[str, list[dict[str, Any]]]:
    """Per job, Prometheus's file service discovery entries for the federation's nodes."""
    rabbit = [
        {
            "targets": [f"{host}:{s.ports['prometheus']}"],
            "labels": {"node": s.name, "role": s.role, **({"region": s.region} if s.region else {})},
        }
        for s in specs
        if s.role in (ROLE_BACKEND, ROLE_GATEWAY)
    ]

    def own(role: str, port: str = "metrics") -> list[dict[str, Any]]:
        return [
            {"targets": [f"{host}:{s.ports[port]}"], "labels": {"node": s.name, "role": s.role}}
            for s in specs
            if s.role == role and port in s.ports
        ]

    return {
        "rabbitmq": rabbit,
        "rabbitmq_queues": rabbit,
        "router": own(ROLE_ROUTER),
        "spark": own(ROLE_SPARK),
        "kafka": own(ROLE_KAFKA),
        # the DNS server's gateway health checks, and PowerDNS's own figures
        "dns": own(ROLE_DNS),
        "powerdns": own(ROLE_DNS, "webserver"),
    }


def config(folder: Path, scrape_interval_s: int, self_address: str) -> dict[str, Any]:
    """prometheus.yml (JSON, which is YAML too)."""

    def job(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "job_name": name,
            "file_sd_configs": [{"files": [str(folder / "targets" / f"{name}.json")]}],
            **extra,
        }

    return {
        "global": {
            "scrape_interval": f"{scrape_interval_s}s",
            "evaluation_interval": f"{scrape_interval_s}s",
            "scrape_timeout": f"{max(1, min(scrape_interval_s - 1, 10))}s",
        },
        "rule_files": [str(RULES)],
        "scrape_configs": [
            job("rabbitmq"),
            job(
                "rabbitmq_queues",
                metrics_path="/metrics/detailed",
                params={"family": ["queue_coarse_metrics"]},
                metric_relabel_configs=[{"source_labels": ["queue"], "regex": KEPT_QUEUES, "action": "keep"}],
            ),
            job("router"),
            job("spark"),
            job("kafka"),
            job("dns"),
            job("powerdns"),
            {"job_name": "prometheus", "static_configs": [{"targets": [self_address]}]},
        ],
    }


class PrometheusApi:
    """Instant queries against a Prometheus's HTTP API (the console's, the tests')."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str, **params: str) -> Any:
        """GET /api/v1/`path`; its `data`."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=self.timeout) as r:
            return json.loads(r.read())["data"]

    def vector(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The samples of `expr` now; a NaN or infinite one (a quantile of no data) left out,
        as it means nothing and JSON cannot carry it."""
        samples = [(s["metric"], float(s["value"][1])) for s in self.get("query", query=expr)["result"]]
        return [(m, v) for m, v in samples if math.isfinite(v)]

    def by(self, expr: str, label: str) -> dict[str, float]:
        return {m.get(label, ""): v for m, v in self.vector(expr)}

    def scalar(self, expr: str) -> float | None:
        got = self.vector(expr)
        return got[0][1] if got else None


class PrometheusNode(Node):
    """Debian's Prometheus server, its config, targets and data in the node's folder."""

    @property
    def config_path(self) -> Path:
        return self.dir / "prometheus.yml"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.spec.ports['http']}"

    def preflight(self) -> None:
        if shutil.which(PROMETHEUS) is None:
            raise NodeError(
                f"{self.name}: {PROMETHEUS} is missing: `make setup` installs Debian's prometheus"
            )
        super().preflight()

    def prepare(self) -> None:
        """The config and the targets, from the federation's record (again at each region change)."""
        (self.dir / "targets").mkdir(parents=True, exist_ok=True)
        specs = list(StateFiles(self.settings.state_dir).recorded().values())
        for name, entries in targets(specs, self.host).items():
            path = self.dir / "targets" / f"{name}.json"
            tmp = path.with_suffix(".tmp")  # Prometheus watches the folder: never a half file
            tmp.write_text(json.dumps(entries, indent=1))
            tmp.replace(path)
        address = f"{self.host}:{self.spec.ports['http']}"
        self.config_path.write_text(
            json.dumps(config(self.dir, self.settings.prometheus_scrape_interval_s, address), indent=1)
        )

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        argv = [
            PROMETHEUS,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--storage.tsdb.retention.time={self.settings.prometheus_retention}",
            f"--web.listen-address={self.host}:{self.spec.ports['http']}",
            "--log.level=warn",
        ]
        return argv, self.base_env(), None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def reload(self) -> None:
        """A region added or removed: its targets rewritten (Prometheus reads them by itself)."""
        self.prepare()

    @property
    def client(self) -> PrometheusApi:
        return PrometheusApi(self.url, timeout=5)

    def api(self, path: str, **params: str) -> Any:
        """GET Prometheus's HTTP API (`path` after /api/v1/); its `data`."""
        return self.client.get(path, **params)

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return list(self.api("alerts")["alerts"])
