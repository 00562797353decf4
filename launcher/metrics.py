"""Live Prometheus metrics of a run (`output.metrics_port`): the driver serves them in Prometheus'
text format at http://<output.metrics_host>:<port>/metrics from the moment the results file is
opened until the run ends, with prometheus_client's own HTTP server (a daemon thread). Each run
has a registry of its own, so that runs in one process (the Python API, tests) do not share
counters.

Counters grow with each result as the results file gets it; gauges are set once per pass of the
controller's loop (at least once a second). A record's latency runs from when it was first dealt
to an engine to when its result reached the driver, a requeue after a replica failure included.
"""

from __future__ import annotations

import errno
import socket

from msinfer.launcher.errors import OutputError

# seconds: a short record on a CPU takes a fraction of one, a long one on a busy replica minutes
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, float("inf"))


def check_port(host: str, port: int) -> None:
    """OutputError, naming the key, where the port cannot be bound (in use, or a host that is not
    this machine's): checked by `plan` and before a run starts anything."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:     # the host's fault, not the port's
            raise OutputError(f"output.metrics_host {host}: the metrics endpoint cannot listen on {host}:{port} "
                              f"({e.strerror or e}); give an address of this machine (0.0.0.0: all of them), or "
                              f"leave output.metrics_host unset") from None
        raise OutputError(f"output.metrics_port {port}: the metrics endpoint cannot listen on {host}:{port} "
                          f"({e.strerror or e}); choose a free port, or leave output.metrics_port unset") from None


class JobMetrics:
    """The run's metrics and the server that answers /metrics."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
        r = self.registry = CollectorRegistry()
        # prometheus_client names a counter's sample <name>_total
        self.done = Counter("msinfer_records_done", "Records with a result line that is not an error", registry=r)
        self.failed = Counter("msinfer_records_failed", "Records whose result line is an error", registry=r)
        self.generated = Counter("msinfer_generated_tokens", "Tokens generated, all samples", registry=r)
        self.prompt = Counter("msinfer_prompt_tokens", "Prompt tokens of the records done", registry=r)
        self.cached = Counter("msinfer_cached_prompt_tokens",
                              "Prompt tokens of the records done found in the prefix cache", registry=r)
        self.cut = Counter("msinfer_records_cut", "Records done that stopped at their length limit (finish_reason "
                           "length): a max_new_tokens too low shows here", registry=r)
        self.restarts = Counter("msinfer_replica_restarts", "Replicas restarted after a failure", registry=r)
        self.rebalanced = Counter("msinfer_records_rebalanced", "Records a replica had queued at the job's tail, "
                                  "dealt to an idle one", registry=r)
        self.alive = Gauge("msinfer_replicas_alive", "Replicas running (not restarting)", registry=r)
        self.in_flight = Gauge("msinfer_records_in_flight", "Records dealt to the engines, no result yet", registry=r)
        self.kv = Gauge("msinfer_kv_cache_usage", "Share of the replica's KV cache blocks in use", ["replica"],
                        registry=r)
        self.latency = Histogram("msinfer_record_latency_seconds", "From a record's first dealing to its result",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.restarts_seen = self.rebalanced_seen = 0
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=r)
        except OSError:
            check_port(host, port)      # names the key
            raise
        self.address = f"http://{host}:{port}/metrics"

    def result(self, done) -> None:
        """One result line written (launcher.records.Done)."""
        if done.failed:
            self.failed.inc()
            return
        self.done.inc()
        self.generated.inc(done.completion_tokens)
        self.prompt.inc(done.prompt_tokens)
        self.cached.inc(done.cached_tokens)
        if done.cut:
            self.cut.inc()

    def update(self, controller) -> None:
        """The gauges, and the restarts and rebalanced counters, from the controller's state."""
        if controller is None:
            return
        slots = controller.slots
        self.alive.set(sum(1 for s in slots if s.starting is None))
        self.in_flight.set(sum(len(s.outstanding) for s in slots))
        for s in slots:
            self.kv.labels(replica=str(s.index)).set(s.kv_usage)
        if controller.restarts > self.restarts_seen:
            self.restarts.inc(controller.restarts - self.restarts_seen)
            self.restarts_seen = controller.restarts
        if controller.rebalanced > self.rebalanced_seen:
            self.rebalanced.inc(controller.rebalanced - self.rebalanced_seen)
            self.rebalanced_seen = controller.rebalanced

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
