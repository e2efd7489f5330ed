"""`kvrouter --workers N`: N router processes accepting on one port (SO_REUSEPORT), to use every core.

The parent validates the configuration (as a single router does), then starts N worker processes (spawned, so
none inherits the parent's threads) and supervises them: a worker that dies is started again after
``restart_delay_s``; SIGTERM/SIGINT is passed on, and each worker drains its in-flight requests within
``shutdown_grace_s`` as a single router would; SIGHUP is passed on too (every worker reloads replicas.yaml).
The kernel spreads new connections over the workers' listening sockets. Each worker is a complete router with
its own index and load book; they share their load (through Redis with ``--redis-url``, else over Unix
datagrams in a private directory the supervisor makes: kvrouter/server/local_loadplane.py), and they should share
one view of the engines' caches: with ``--redis-url`` every worker follows
the relay's streams in Redis (the intended set-up); without it each worker subscribes to every engine's ZMQ
publisher itself, which works only when the engines bind (a router that binds its own endpoint,
``kv_events.bind``, cannot be repeated N times).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import FrameType

from kvrouter.config import ConfigError, FleetConfig, ModelsConfig, Settings

log = logging.getLogger("kvrouter.server.workers")


def check_workers(settings: Settings, fleet: FleetConfig | ModelsConfig) -> None:
    if settings.port == 0:
        raise ConfigError("setting 'workers' (--workers / KVROUTER_WORKERS): needs a fixed --port, not 0")
    fleets = fleet.models if isinstance(fleet, ModelsConfig) else [fleet]
    binding = [r.name for f in fleets for r in f.replicas if r.kv_events is not None and r.kv_events.bind]
    if settings.redis_url is None and binding:
        raise ConfigError(
            "setting 'workers' (--workers / KVROUTER_WORKERS): replicas "
            f"{', '.join(binding)} have kv_events.bind, which one process only can do; "
            "set --redis-url (and run `kvrouter relay`) to share their events between workers"
        )


def worker_main(settings: Settings, fleet: FleetConfig | ModelsConfig, number: int) -> int:
    """One worker: a complete router on the shared port."""
    import asyncio

    from kvrouter.server.fleets import build_router_app
    from kvrouter.server.serving import loop_factory, serve
    from kvrouter.server.worker_metrics import WORKER_METRICS, WorkerMetrics

    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[w{number}]: %(message)s"
    )
    app = build_router_app(settings, fleet)
    if settings.workers_dir is not None:
        # A scrape of the shared port holds every worker's metrics (kvrouter/server/worker_metrics.py).
        worker_metrics = WorkerMetrics(settings.workers_dir, number, settings.workers)
        app[WORKER_METRICS] = worker_metrics
        app.cleanup_ctx.append(worker_metrics.context)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(serve(app, settings, fleet))


class Supervisor:
    def __init__(self, settings: Settings, fleet: FleetConfig | ModelsConfig, *, restart_delay_s: float = 1.0) -> None:
        self.settings = settings
        self.fleet = fleet
        self.restart_delay_s = restart_delay_s
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[multiprocessing.process.BaseProcess | None] = [None] * settings.workers
        self.stopping = False

    def _start(self, number: int) -> None:
        process = self.context.Process(
            target=worker_main, args=(self.settings, self.fleet, number), name=f"kvrouter-worker-{number}"
        )
        process.start()
        self.workers[number] = process

    def _stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _reload_signal(self, signum: int, frame: FrameType | None) -> None:
        # Each worker re-reads replicas.yaml on SIGHUP (kvrouter.admin.api); the parent only passes it on.
        for process in self.workers:
            if process is not None and process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGHUP)

    def run(self) -> int:
        shared_dir = None
        if self.settings.redis_url is None and self.settings.load_share and self.settings.load_share_dir is None:
            # Without Redis the workers share load over Unix datagrams in a directory only this user can enter.
            shared_dir = Path(tempfile.mkdtemp(prefix="kvrouter-load-"))
            self.settings = self.settings.model_copy(update={"load_share_dir": shared_dir})
        # Each worker's metrics socket, so a scrape of the port holds every worker's (mkdtemp: mode 0700).
        workers_dir = Path(tempfile.mkdtemp(prefix="kvrouter-workers-"))
        self.settings = self.settings.model_copy(update={"workers_dir": workers_dir})
        try:
            return self._supervise()
        finally:
            shutil.rmtree(workers_dir, ignore_errors=True)
            if shared_dir is not None:
                shutil.rmtree(shared_dir, ignore_errors=True)

    def _supervise(self) -> int:
        signal.signal(signal.SIGTERM, self._stop_signal)
        signal.signal(signal.SIGINT, self._stop_signal)
        signal.signal(signal.SIGHUP, self._reload_signal)
        for number in range(len(self.workers)):
            self._start(number)
        log.info("kvrouter: %d workers on port %d", len(self.workers), self.settings.port)
        while not self.stopping:
            time.sleep(0.2)
            for number, process in enumerate(self.workers):
                if process is not None and not process.is_alive() and not self.stopping:
                    log.warning("worker %d exited with %s; starting it again", number, process.exitcode)
                    time.sleep(self.restart_delay_s)
                    self._start(number)
        return self._stop_all()

    def _stop_all(self) -> int:
        alive = [p for p in self.workers if p is not None and p.is_alive()]
        for process in alive:
            process.terminate()  # SIGTERM: the worker drains in-flight requests
        deadline = time.monotonic() + self.settings.shutdown_grace_s + 5.0
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        log.info("kvrouter: all workers stopped")
        return 0


def run_workers(settings: Settings, fleet: FleetConfig | ModelsConfig) -> int:
    return Supervisor(settings, fleet).run()
