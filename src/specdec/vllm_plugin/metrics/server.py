"""The plugin's own metrics endpoint: ``GET /metrics`` in Prometheus text, served by a small stdlib HTTP server on a
daemon thread of the process that drafts.

Why an endpoint of its own: vLLM 0.26 serves ``/metrics`` from the API server process, out of that process's own
Prometheus registry (it collects other processes' metric files only with ``--api-server-count`` > 1, not the
default, and only when the variable naming their folder is set before ``prometheus_client`` loads), and what reaches
that process from the engine is vLLM's fixed ``SchedulerStats``. The proposer lives in the engine-core process
(TP = 1) or a worker process (TP > 1), and neither vLLM's stat-logger plugins (API server side, fed only
``SchedulerStats``) nor a patch of those dataclasses (encoded field by field between the processes) carries counters
of its own there. So the process that drafts (TP rank 0) answers scrapes itself: ``metrics_port`` (0: off)
on ``metrics_host`` (loopback by default), plus the engine's local data-parallel rank so that several engines on one
host do not collide. A port that cannot be bound gives one warning and the engine goes on without the endpoint.

Every scrape reads the proposer's statistics afresh (``source``), on the server's thread: plain counters, read
without stopping the engine. The drafter's own gauges come from the last sample its thread took
(``metrics.drafter``).
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specdec import __version__
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.metrics.render import CONTENT_TYPE, render

logger = logging.getLogger(LOGGER_NAME)

METRICS_PATH = "/metrics"
SCRAPE_TRIES = 2  # the statistics are read while the engine updates them: a read that raced is tried again
POLL_S = 0.5  # serve_forever's shutdown poll


class MetricsServer:
    """``GET /metrics`` -> ``render(source(), info=info)`` on ``host:port`` (port 0: one the OS picks), served on
    a daemon thread from construction until ``close``. Raises ``OSError`` if the address cannot be bound."""

    def __init__(
        self,
        source: Callable[[], Mapping[str, Any]],
        *,
        host: str,
        port: int,
        info: Mapping[str, str] | None = None,
    ) -> None:
        self.source, self.info = source, dict(info) if info is not None else None
        server_cls = _Server6 if ":" in host else _Server4
        self.httpd = server_cls((host, port), _handler_for(self))
        self.host, self.port = host, int(self.httpd.server_address[1])
        self.closed = False
        self.stopped = threading.Event()  # set once closed and the port freed
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": POLL_S}, name="specdec-metrics", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    def scrape(self) -> str:
        """The current text (what a GET returns)."""
        for attempt in range(SCRAPE_TRIES):
            try:
                return render(self.source(), info=self.info)
            except RuntimeError:  # a dict resized while read (the engine thread updated it): read again
                if attempt == SCRAPE_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
        self.stopped.set()


class _Server4(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server4):
    address_family = socket.AF_INET6


def _handler_for(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != METRICS_PATH:
                self._send(404, f"specdec: only {METRICS_PATH} is served here\n")
                return
            try:
                body = server.scrape()
            except Exception as exc:  # noqa: BLE001 - a failed scrape is the scraper's error, never the engine's
                self._send(500, f"specdec: statistics unavailable ({type(exc).__name__}: {exc})\n")
                return
            self._send(200, body, CONTENT_TYPE)

        def _send(self, code: int, text: str, ctype: str = "text/plain; charset=utf-8") -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # scrapes are not logged
            pass

    return Handler


def drafter_label(drafter: Any) -> str:
    """The ``drafter`` option as one label value: 'suffix', 'suffix+model', ..."""
    if isinstance(drafter, Mapping):
        return str(drafter.get("name", "?"))
    if isinstance(drafter, (list, tuple)):
        return "+".join(drafter_label(d) for d in drafter)
    return str(drafter)


def start_exporter(
    options: Any, source: Callable[[], Mapping[str, Any]], *, vllm_config: Any, tp_rank: Callable[[], int]
) -> MetricsServer | None:
    """The endpoint of ``options.metrics_port`` / ``metrics_host`` (``SpecdecOptions``) for the engine of
    ``vllm_config``, on TP rank 0 only (``tp_rank()``, asked only where the endpoint is on), at port
    ``metrics_port`` + the engine's local data-parallel rank; None where it is off or cannot bind (one warning;
    never raises). ``source``: a bound method (the proposer's ``stats``), held weakly: the endpoint closes when
    its proposer is collected, if nobody closed it before."""
    if not options.metrics_port or tp_rank() != 0:
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    port = options.metrics_port + int(getattr(parallel, "data_parallel_rank_local", 0) or 0)
    info = {
        "drafter": drafter_label(options.drafter),
        "async_mode": options.async_mode if options.async_drafting else "off",
        "k": str(options.num_speculative_tokens),
        "version": __version__,
    }
    ref = weakref.WeakMethod(source)  # type: ignore[arg-type]
    try:
        server = MetricsServer(lambda: _read(ref), host=options.metrics_host, port=port, info=info)
    except (OSError, OverflowError) as exc:
        logger.warning(
            "specdec: metrics not served: cannot listen on %s:%d (%s); the engine goes on without them (set "
            "metrics_port to a free port, or 0)",
            options.metrics_host,
            port,
            exc,
        )
        return None
    weakref.finalize(source.__self__, _close_soon, server)  # type: ignore[attr-defined]
    logger.info("specdec: metrics on %s", server.url)
    return server


def _read(ref: weakref.WeakMethod) -> Mapping[str, Any]:
    method = ref()
    return method() if method is not None else {}


def _close_soon(server: MetricsServer) -> None:
    """Close from a thread of its own: a finalizer may run on the server's thread, which ``close`` waits for."""
    threading.Thread(target=server.close, name="specdec-metrics-close", daemon=True).start()
