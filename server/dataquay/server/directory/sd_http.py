"""The directory's HTTP endpoints: Prometheus service discovery, its own
metrics, and a health probe.

* ``GET /sd``: the JSON that Prometheus' ``http_sd_configs`` reads, one target
  group per registered node's metrics endpoint, up or down::

      [{"targets": ["10.0.0.7:9470"],
        "labels": {"dataquay_node": "node7", "dataquay_state": "up"}}]

  ``dataquay_node`` and ``dataquay_state`` are ordinary labels, so Prometheus
  attaches them to every series scraped from that daemon and dashboards group
  by node with no relabeling rule (the daemon's own ``instance`` label is an
  address, which changes when a node is moved). A node whose lease ran out
  stays listed, with ``dataquay_state="down"``: Prometheus keeps scraping it,
  its ``up`` turns 0 and an alert can fire, where a target that vanished
  would only leave a stale series. A node comes back as ``"up"`` when it
  heartbeats again.
* ``GET /metrics``: Prometheus text of the directory itself.
* ``GET /healthz``: 200 while serving, 503 once shutdown began.

They are served by :class:`dataquay.server.http_server.HttpServer`, which
the daemon's /metrics shares, with its bounds on idle and oversized requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from dataquay.server.directory.records import Node
from dataquay.server.http_server import Answer, HttpServer, metrics_handler, text


def sd_targets(nodes: list[Node]) -> list[dict[str, object]]:
    """The http_sd_configs document for ``nodes`` (every registered one)."""
    return [
        {
            "targets": [n.info.metrics_address],
            "labels": {"dataquay_node": n.info.name, "dataquay_state": "up" if n.up else "down"},
        }
        for n in nodes
        if n.info.metrics_address
    ]


class HttpEndpoints(HttpServer):
    """Serves /sd, /metrics and /healthz.

    Args:
        nodes: every registered node, read at each /sd request.
        metrics: the registry /metrics exports.
        serving: False once shutdown began (/healthz answers 503).
    """

    def __init__(
        self, nodes: Callable[[], list[Node]], metrics: CollectorRegistry, serving: Callable[[], bool]
    ) -> None:
        def sd(_: Mapping[str, str]) -> Answer:
            return 200, "application/json", json.dumps(sd_targets(nodes())).encode(), {}

        def healthz(_: Mapping[str, str]) -> Answer:
            return text(200, "ok\n") if serving() else text(503, "stopping\n")

        super().__init__({"/sd": sd, "/metrics": metrics_handler(metrics), "/healthz": healthz}, "HTTP")
