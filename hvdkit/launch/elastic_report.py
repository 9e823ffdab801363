"""What an elastic job's driver says, in hvdkit's words: installed into horovodrun's own
process by :mod:`hvdkit.launch.horovodrun` when the job is elastic.

Horovod's elastic driver logs its decisions at INFO level (hidden) and, when it gives up,
ends with a traceback or "failed to activate new hosts" that names neither the lost host nor
the reason. Here each lost host is reported when it is left out, each reset with the new
size, and a failed job ends with one line naming the reason and the hosts lost (the runner
prints it in place of guessing a rank).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = "hvdkit elastic: "
RESEND_AFTER = 1.0  # s after a worker registers its notification service (resend_host_changes)
SUMMARY = "hvdkit run: elastic job stopped: "


def _status(code: int) -> str:
    if code > 128 and code - 128 in signal.valid_signals():
        return f"status {code} ({signal.Signals(code - 128).name})"
    if code < 0 and -code in signal.valid_signals():
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


@dataclass
class Report:
    """What the driver did, for the closing line."""

    min_np: int | None = None
    timeout: int | None = None
    lost: dict[str, str] = field(default_factory=dict)  # host -> why
    reason: str | None = None

    cooldown: tuple[int, int] | None = None
    stall_timeout: float = 30.0

    def say(self, text: str) -> None:
        print(PREFIX + text, file=sys.stderr, flush=True)

    def summary(self) -> str:
        lost = ", ".join(f"{host} ({why})" for host, why in self.lost.items()) or "none"
        return f"{SUMMARY}{self.reason or 'a worker failed'}. Hosts lost: {lost}."


def _safely(action: Any) -> None:
    """Run a reporting ``action``; a failure to report must never stop the driver (a
    raising hook in a driver thread leaves the job hanging)."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - reporting is best effort
        print(f"{PREFIX}(could not report: {type(exc).__name__}: {exc})", file=sys.stderr)


def install(report: Report) -> None:
    """Wrap the driver's methods that decide (Horovod 0.28.1's names; checked on import)."""
    from horovod.runner.elastic import constants
    from horovod.runner.elastic.discovery import HostManager
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import WorkerStateRegistry

    handle_exit = ElasticDriver._handle_worker_exit
    activate = ElasticDriver._activate_workers
    resume = ElasticDriver.resume
    stop = ElasticDriver.stop
    wait = ElasticDriver.wait_for_available_slots
    blacklist = HostManager.blacklist
    init = ElasticDriver.__init__

    def driver_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

        def note() -> None:
            report.min_np, report.timeout = self._min_num_proc, self._timeout
            report.cooldown = kwargs.get("cooldown_range")

        _safely(note)

    def handle_worker_exit(self: Any, slot_info: Any, exit_code: int, timestamp: Any) -> None:
        def note() -> None:
            # After stop() the driver terminates the rest itself: those are not losses.
            if (
                exit_code != 0
                and not self.finished()
                and self.has_rank_assignment(slot_info.hostname, slot_info.local_rank)
            ):
                report.lost.setdefault(
                    slot_info.hostname, f"rank {slot_info.rank} exited with {_status(exit_code)}"
                )

        _safely(note)
        handle_exit(self, slot_info, exit_code, timestamp)

    def host_blacklist(self: Any, host: str) -> None:
        def note() -> None:
            if self.is_blacklisted(host):
                return
            after = (
                "for {}..{} s, then tried again".format(*report.cooldown)
                if report.cooldown
                else "for the rest of the job"
            )
            why = report.lost.get(host, "a worker failed")
            report.say(f"host {host} failed ({why}); left out {after}")

        _safely(note)
        blacklist(self, host)

    def activate_workers(self: Any, min_num_proc: int) -> None:
        activate(self, min_num_proc)

        def note() -> None:
            hosts = ", ".join(f"{h}:{len(s)}" for h, s in self.host_assignments.items())
            report.say(f"{self.world_size()} process(es) on {hosts}")

        _safely(note)

    def driver_resume(self: Any) -> None:
        try:
            resume(self)
        except Exception as exc:

            def note(exc: Exception = exc) -> None:
                slots = self._host_manager.current_hosts.count_available_slots()
                report.reason = (
                    f"{slots} slot(s) left, below --min-np {self._min_num_proc}, for "
                    f"{self._timeout} s (--elastic-timeout)"
                    if "Timed out" in str(exc)
                    else f"could not restart the workers ({type(exc).__name__}: {exc})"
                )

            _safely(note)
            raise

    def wait_for_slots(self: Any, min_num_proc: int, min_hosts: int = 1) -> Any:
        try:
            return wait(self, min_num_proc, min_hosts=min_hosts)
        except Exception as exc:

            def note(exc: Exception = exc) -> None:
                if "Timed out" not in str(exc) or report.reason is not None:
                    return
                hosts = self._host_manager.current_hosts
                found = ", ".join(hosts.available_hosts) or "none"
                report.reason = (
                    f"no start within {self._timeout} s (--elastic-timeout): Horovod's elastic "
                    f"driver waits for {min_hosts} hosts to compare their network interfaces "
                    f"when --network-interface is not given, and found {found}. Fix: "
                    "--network-interface IFACE (the interface the ranks talk over, e.g. eth0)"
                    if min_hosts > 1
                    else f"no start within {self._timeout} s (--elastic-timeout): "
                    f"{hosts.count_available_slots()} slot(s) found on {found}, below "
                    f"the {min_num_proc} process(es) to start"
                )

            _safely(note)
            raise

    def driver_stop(self: Any, error_message: str | None = None) -> None:
        def note() -> None:
            if not error_message or report.reason is not None:
                return
            prefix = constants.RESET_LIMIT_EXCEEDED_MESSAGE.split("{")[0]
            report.reason = (
                f"--reset-limit {error_message.rsplit(':', 1)[-1].strip()} exceeded "
                f"(the job was reset {self._worker_registry._reset_count} time(s) and "
                "needed another)"
                if error_message.startswith(prefix)
                else error_message
            )

        _safely(note)
        stop(self, error_message)

    watch_stalls(report, WorkerStateRegistry, ElasticDriver)
    resend_host_changes(ElasticDriver)
    keep_listed_order(HostManager)
    ElasticDriver.__init__ = driver_init
    ElasticDriver._handle_worker_exit = handle_worker_exit
    ElasticDriver._activate_workers = activate_workers
    ElasticDriver.resume = driver_resume
    ElasticDriver.stop = driver_stop
    ElasticDriver.wait_for_available_slots = wait_for_slots
    HostManager.blacklist = host_blacklist


def keep_listed_order(manager: Any) -> None:
    """Hosts new to the job take ranks in the order the hostfile or discovery lists them, as in
    a static job. Horovod keeps the hosts it has first (their ranks stay) but appends new ones
    from a set, whose order changes from run to run: the hostfile's first host was rank 0 in
    only some runs."""
    listed: list[str] = []  # the hosts in the order the last discovery listed them
    init = manager.__init__

    def manager_init(self: Any, discovery: Any, *args: Any, **kwargs: Any) -> None:
        find = discovery.find_available_hosts_and_slots

        def found() -> dict[str, int]:
            slots = find()
            listed[:] = list(slots)
            return dict(slots)

        discovery.find_available_hosts_and_slots = found
        init(self, discovery, *args, **kwargs)

    def order_available_hosts(available_hosts: Any, prev_host_assignment_order: Any) -> list:
        kept = [host for host in prev_host_assignment_order if host in available_hosts]
        rank = {host: i for i, host in enumerate(listed)}
        new = sorted(set(available_hosts) - set(kept), key=lambda h: (rank.get(h, len(rank)), h))
        return kept + new

    manager.__init__ = manager_init
    manager.order_available_hosts = staticmethod(order_available_hosts)


def resend_host_changes(driver: Any) -> None:
    """A host change reaches a worker that restarted its process.

    The driver tells rank 0's notification service of a host change once, when discovery
    sees it. A worker that restarts its process at a reset (Keras on JAX,
    :mod:`hvdkit.elastic_restart`) has no service for the seconds its restart takes, and the
    one it then registers never hears of a change made meanwhile: a host that came back then
    never rejoins. So a second after a worker registers its service (the worker adds its
    listener just after registering: a message sent at once would find none), a change still
    pending is sent again. Horovod's own check sends nothing while the assignments it would
    make are the ones in force."""
    from horovod.runner.elastic.discovery import HostUpdateResult

    register = driver.register_worker_server

    def register_worker_server(self: Any, host: str, slot: int, *args: Any) -> None:
        register(self, host, slot, *args)

        def resend() -> None:
            with self._wait_hosts_cond:  # as the discovery thread sends it
                if not self.finished():
                    self._notify_workers_host_changes(
                        self._host_manager.current_hosts, HostUpdateResult.mixed
                    )

        timer = threading.Timer(RESEND_AFTER, _safely, args=(resend,))
        timer.daemon = True
        timer.start()

    driver.register_worker_server = register_worker_server


def watch_stalls(report: Report, registry: Any, driver: Any) -> None:
    """Count a worker that stopped answering as failed, so the job goes on without it.

    Horovod's driver learns that a worker failed only when its process exits. A stopped
    (SIGSTOP, a frozen VM) or hung worker stays alive: the others' collective times out
    (``HOROVOD_GLOO_TIMEOUT_SECONDS``), they register again for a new rendezvous, and the
    driver's barrier waits for the missing one for ever. Here, ``report.stall_timeout`` s after
    the first worker registers in a round, each assigned worker that has not registered is
    recorded as failed: its host is blacklisted (Horovod then terminates its process) and the
    others go on. A worker started less than ``stall_timeout`` s before that first
    registration is still starting, and is left to start."""
    start_worker = driver._start_worker_process
    record = registry._record_state

    def start_worker_process(self: Any, slot_info: Any) -> None:
        def note() -> None:
            started = self.__dict__.setdefault("_hvdkit_started", {})
            started[(slot_info.hostname, slot_info.local_rank)] = time.monotonic()

        _safely(note)
        start_worker(self, slot_info)

    def record_state(self: Any, host: str, slot: int, state: str) -> Any:
        def note() -> None:
            round_id = self._rendezvous_id
            if getattr(self, "_hvdkit_watched", None) != round_id:
                self._hvdkit_watched = round_id  # one timer per round
                args = (self, round_id, time.monotonic())
                timer = threading.Timer(report.stall_timeout, fail_missing, args)
                timer.daemon = True
                timer.start()

        with self._lock:
            _safely(note)
        return record(self, host, slot, state)

    def fail_missing(self: Any, round_id: int, first: float) -> None:
        def missing() -> list[tuple[str, int, int]]:
            started = getattr(self._driver, "_hvdkit_started", {})
            with self._lock:
                if self._rendezvous_id != round_id or self._driver.finished():
                    return []
                return [
                    (slot.hostname, slot.local_rank, slot.rank)
                    for slots in self._driver.host_assignments.values()
                    for slot in slots
                    if (slot.hostname, slot.local_rank) not in self._states
                    and started.get((slot.hostname, slot.local_rank), first)
                    < first - report.stall_timeout
                ]

        stalled: list[tuple[str, int, int]] = []
        _safely(lambda: stalled.extend(missing()))
        for host, local_rank, rank in stalled:
            report.lost.setdefault(
                host,
                f"rank {rank} stopped answering: not back {report.stall_timeout:g} s after the "
                "others (--stall-timeout)",
            )
            # record_failure waits at the driver's barrier, as the worker's own thread would.
            threading.Thread(
                target=self.record_failure, args=(host, local_rank), daemon=True
            ).start()

    driver._start_worker_process = start_worker_process
    registry._record_state = record_state


def check_discovery(report: Report) -> None:
    """Read each output of the discovery script with hvdkit's parser, which checks every host
    name (:mod:`hvdkit.launch.names`) and line: horovodrun splits the lines itself and hands the
    names, unchecked, to its ssh commands. Output with a bad line is refused as a whole, as a
    failing script is (the driver keeps the hosts it had and runs the script again), and said
    once per distinct error."""
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    from hvdkit.launch.elastic import ElasticError, parse_discovery_output

    said: set[str] = set()

    def find_available_hosts_and_slots(self: Any) -> dict[str, int]:
        text = self._execute_discovery_script()
        source = f"--host-discovery-script {self._discovery_script}"
        try:
            hosts = parse_discovery_output(text, source, self._default_slots)
        except ElasticError as exc:
            if str(exc) not in said:
                said.add(str(exc))
                report.say(f"{exc}; this output is ignored (hosts kept as they were)")
            raise RuntimeError(str(exc)) from None
        return {host.name: host.slots for host in hosts}

    HostDiscoveryScript.find_available_hosts_and_slots = find_available_hosts_and_slots
