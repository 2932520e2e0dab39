"""Preemption: notice that the machine is going away and ask the loop to stop.

A signal handler (or a cloud-notice poller) only records the request; the training
loop reads it at a step boundary, where all ranks vote so that they stop at the same
step even when only one of them was told.

Cloud notices come from the instance metadata service of the machine, polled in a
background thread by one process per node (local rank 0); the vote at the next step
boundary carries the request to every other rank, on this node and on the others.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..config import NoticeSource, PreemptionConfig
from ..runtime.exit_codes import INTERRUPTED as INTERRUPTED_EXIT
from . import early

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopRequest:
    source: str          # "SIGTERM", "SIGUSR1", "aws-notice", ...
    wall_time: float     # when it arrived (time.time(), comparable across ranks)
    detail: str = ""     # what a notice said, e.g. "terminate at 2026-11-29T10:00:00Z"


class PreemptionWatch:
    """Collects stop requests from signals and notice pollers; thread- and signal-safe."""

    def __init__(self, signals: list[str]) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        if signal.SIGINT not in self.signals:
            self.signals.append(signal.SIGINT)
        self._first: StopRequest | None = None
        self._count = 0
        self._lock = threading.RLock()  # a second signal may land inside the handler
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        for sig in early.take(self.signals):  # came while the command was importing
            self.request(sig.name, "arrived while the command was starting")

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        # Only record: anything heavier inside a handler can deadlock with the loop.
        name = signal.Signals(signum).name
        if name == "SIGINT" and self._first is not None and self._first.source == "SIGINT":
            self._second_interrupt()
        self.request(name)

    @staticmethod
    def _second_interrupt() -> None:
        """A second Ctrl-C: leave at once, without the final save (the newest committed
        checkpoint stays the one to resume from; nothing torn ever counts)."""
        os.write(2, b"second Ctrl-C: exiting now without a final save; the newest committed "
                    b"checkpoint stays the one to resume from\n")
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(INTERRUPTED_EXIT)

    def request(self, source: str, detail: str = "") -> None:
        """Ask for a stop; later requests are counted but change nothing."""
        with self._lock:
            self._count += 1
            if self._first is None:
                self._first = StopRequest(source, time.time(), detail)

    @property
    def requested(self) -> StopRequest | None:
        return self._first

    @property
    def count(self) -> int:
        return self._count


# ----------------------------------------------------------- cloud notices --

DEFAULT_METADATA_URLS = {
    NoticeSource.aws: "http://169.254.169.254",
    NoticeSource.gcp: "http://metadata.google.internal",
    NoticeSource.azure: "http://169.254.169.254",
}
HTTP_TIMEOUT_S = 2.0  # a metadata service answers in milliseconds; never stall the poller

# Seconds from a cloud's preemption notice to the machine going away (AWS: two minutes;
# GCP: 30 s; Azure: at least 30 s). The copy-time checklist flags a longer grace period
# from the same table (the template's includes/clouds.jinja; its tests compare both).
NOTICE_WINDOW_S: dict[NoticeSource, float] = {
    NoticeSource.aws: 120.0, NoticeSource.gcp: 30.0, NoticeSource.azure: 30.0,
}


def effective_grace_s(cfg: PreemptionConfig) -> float:
    """The grace period to plan the stop against: ``grace_period_s``, but never more than
    the configured cloud's notice window, after which the machine is gone anyway."""
    window = NOTICE_WINDOW_S.get(NoticeSource(cfg.notice_source))
    return cfg.grace_period_s if window is None else min(cfg.grace_period_s, window)


class MetadataError(OSError):
    """The metadata service answered, but not in a way that tells notice or no notice."""


class NoticeChecker:
    """Asks one cloud's metadata service whether this machine is about to be preempted.

    ``check()`` returns a short description of the notice, or None when there is none,
    and raises OSError (urllib's errors included) when the service cannot be asked.
    """

    source = "notice"

    def __init__(self, base_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Metadata addresses are link-local: an HTTP proxy from the environment
        # (http_proxy, ...) cannot reach them, so never use one.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def check(self) -> str | None:
        raise NotImplementedError

    def _call(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, body) of one request; HTTP error statuses are returned, not raised."""
        request = urllib.request.Request(self.base_url + path, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read()


class AwsNotice(NoticeChecker):
    """EC2 spot interruption notice through IMDSv2 (about two minutes ahead)."""

    source = "aws-notice"
    TOKEN_TTL_S = 21600  # the longest IMDSv2 allows; renewed well before it runs out
    ACTION_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, base_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        super().__init__(base_url, timeout_s)
        self._token: str | None = None
        self._token_expires = 0.0

    def _fresh_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_expires:
            status, body = self._call(
                "PUT", "/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
            if status != 200:
                raise MetadataError(f"IMDSv2 token request answered HTTP {status}")
            self._token = body.decode().strip()
            self._token_expires = time.monotonic() + self.TOKEN_TTL_S / 2
        return self._token

    def check(self) -> str | None:
        status, body = self._call("GET", self.ACTION_PATH,
                                  {"X-aws-ec2-metadata-token": self._fresh_token()})
        if status == 401:  # token expired or revoked: one retry with a new one
            self._token = None
            status, body = self._call("GET", self.ACTION_PATH,
                                      {"X-aws-ec2-metadata-token": self._fresh_token()})
        if status == 404:
            return None  # no interruption scheduled
        if status != 200:
            raise MetadataError(f"{self.ACTION_PATH} answered HTTP {status}")
        try:
            notice = json.loads(body)
            return f"{notice['action']} at {notice['time']}"
        except (ValueError, KeyError, TypeError):
            # A 200 on this path is the notice itself, even if its body is odd.
            return body.decode(errors="replace").strip() or "instance-action"


class GcpNotice(NoticeChecker):
    """Compute Engine spot/preemptible VMs: ``instance/preempted`` turns TRUE (30 s ahead)."""

    source = "gcp-notice"
    PATH = "/computeMetadata/v1/instance/preempted"

    def check(self) -> str | None:
        status, body = self._call("GET", self.PATH, {"Metadata-Flavor": "Google"})
        if status != 200:
            raise MetadataError(f"{self.PATH} answered HTTP {status}")
        return "instance preempted" if body.decode().strip().upper() == "TRUE" else None


class AzureNotice(NoticeChecker):
    """Azure Scheduled Events: a ``Preempt`` event for this VM (at least 30 s ahead)."""

    source = "azure-notice"
    EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, base_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        super().__init__(base_url, timeout_s)
        self._vm_name: str | None = None

    def _name(self) -> str | None:
        # Events for every VM of an availability set or scale-set placement group reach
        # all of them; the Resources field says which VMs an event is for.
        if self._vm_name is None:
            status, body = self._call("GET", self.NAME_PATH, {"Metadata": "true"})
            if status == 200:
                self._vm_name = body.decode().strip()
        return self._vm_name

    def check(self) -> str | None:
        status, body = self._call("GET", self.EVENTS_PATH, {"Metadata": "true"})
        if status != 200:
            raise MetadataError(f"scheduled events answered HTTP {status}")
        try:
            events = json.loads(body).get("Events", [])
        except (ValueError, AttributeError) as exc:
            raise MetadataError(f"scheduled events: unreadable answer ({exc})") from None
        for event in events:
            if event.get("EventType") != "Preempt":
                continue
            resources = event.get("Resources") or []
            name = self._name() if resources else None
            # Unknown own name: better to stop needlessly than to be killed unsaved.
            if name is None or name in resources:
                return f"Preempt not before {event.get('NotBefore') or 'unknown time'}"
        return None


CHECKERS: dict[NoticeSource, type[NoticeChecker]] = {
    NoticeSource.aws: AwsNotice, NoticeSource.gcp: GcpNotice, NoticeSource.azure: AzureNotice,
}


class NoticePoller:
    """Polls a NoticeChecker in a daemon thread and turns a notice into a stop request.

    Network trouble never stops training: the first failure of a run of failures is
    logged as a warning, the rest quietly, and polling goes on.
    """

    def __init__(self, checker: NoticeChecker, watch: PreemptionWatch, interval_s: float) -> None:
        self.checker = checker
        self.watch = watch
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{checker.source}-poller",
                                        daemon=True)  # never keeps the process alive
        self.polls = 0
        self.failures = 0

    def start(self) -> NoticePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        # At most one request in flight, bounded by its timeout (three for AWS: token,
        # notice, and the retry with a new token).
        self._thread.join(timeout=3 * self.checker.timeout_s + 1)
        if self.failures:
            log.info("preemption notices: %d of %d polls of %s failed", self.failures,
                     self.polls, self.checker.base_url)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            self.polls += 1
            try:
                detail = self.checker.check()
            except Exception as exc:  # noqa: BLE001 - whatever goes wrong, training goes on
                self.failures += 1
                if not failing:
                    log.warning("cannot read preemption notices from %s (%s); training "
                                "goes on, retrying every %g s quietly",
                                self.checker.base_url, _reason(exc), self.interval_s)
                failing = True
            else:
                if failing:
                    log.info("preemption notices readable again from %s", self.checker.base_url)
                failing = False
                if detail is not None:
                    log.warning("preemption notice (%s): %s", self.checker.source, detail)
                    self.watch.request(self.checker.source, detail)
                    return  # one notice is enough; the loop takes it from here
            self._stop.wait(self.interval_s)


def _reason(exc: Exception) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


def start_notice_poller(cfg: PreemptionConfig, watch: PreemptionWatch,
                        local_rank: int) -> NoticePoller | None:
    """Start polling the configured cloud's notices on local rank 0; None elsewhere.

    One process per node is enough: the notice is about the machine, and the vote at
    the next step boundary tells every rank.
    """
    source = NoticeSource(cfg.notice_source)
    if source == NoticeSource.none or local_rank != 0:
        return None
    checker = CHECKERS[source](cfg.metadata_url or DEFAULT_METADATA_URLS[source])
    log.info("polling %s preemption notices at %s every %g s", source.value, checker.base_url,
             cfg.poll_interval_s)
    return NoticePoller(checker, watch, cfg.poll_interval_s).start()


__all__ = [
    "NOTICE_WINDOW_S", "AwsNotice", "AzureNotice", "GcpNotice", "MetadataError", "NoticeChecker",
    "NoticePoller", "PreemptionWatch", "StopRequest", "effective_grace_s", "start_notice_poller",
]
