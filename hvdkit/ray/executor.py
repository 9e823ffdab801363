"""``RayExecutor``: Horovod 0.28.1's ``horovod.ray.RayExecutor`` on today's Ray.

The driver places one actor per rank (a placement group: PACK for ``num_workers``, one bundle
per machine with ``num_hosts``), asks each which Ray node it is on, plans the Horovod world
from that (:mod:`hvdkit.engines.world`; a Ray node is a Horovod host, as in Horovod), serves the
Gloo rendezvous itself (:mod:`hvdkit.engines.rendezvous`) and sets each actor's ``HOROVOD_*``
variables before the function runs and calls ``hvd.init()``.

Where hvdkit differs from Horovod: a rank whose function raises, or whose actor dies, stops
the job (its actors are killed, so no rank waits forever in a collective) and
:class:`WorkerError` names the rank; Horovod re-raises and leaves the others waiting. More
workers than the cluster's CPUs (or GPUs), or a cluster that does not answer, fail at
``start()`` within seconds, not after ``placement_group_timeout_s``. ``callbacks`` are
accepted and unused, as in Horovod's non-elastic executor. Elastic training on Ray
(``min_workers``/``max_workers``, ``ElasticRayExecutor``) is not provided.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdkit.engines import interpreter, world
from hvdkit.engines.checks import answers, pickled, require
from hvdkit.engines.rendezvous import Rendezvous, iface_holding
from hvdkit.launch import hang_doctor


def _ray() -> Any:
    return require("ray", "hvdkit.ray", "ray")


class WorkerError(RuntimeError):
    """A rank's function raised, or its actor died; every other rank was stopped."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class MiniSettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's ``MiniSettings``)."""

    nics: set | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False


class BaseHorovodWorker:
    """The actor behind each rank: holds the ``executable_cls`` instance, if any, and runs
    functions with the rank's ``HOROVOD_*`` environment."""

    executable = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def node_id(self) -> str:
        return _ray().get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def node_ip(self) -> str:
        return _ray().util.get_node_ip_address()

    def iface(self) -> str | None:
        """The network interface holding this node's address, for Gloo."""
        return iface_holding(self.node_ip())

    def get_gpu_ids(self) -> list[int]:
        return _ray().get_gpu_ids()

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
    ) -> None:
        if executable_cls:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        return func(self.executable)

    def set_queue(self, queue: Any) -> None:
        """Horovod's hook for its callbacks' log queue; kept, unused: actors' output reaches
        the driver through Ray's own log forwarding."""
        self.queue = queue


def _connect(ray: Any) -> None:
    """ray.init() as Horovod's users rely on (a local cluster, or RAY_ADDRESS), failing at once
    when a named cluster does not answer."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "")
    if address.startswith("ray://"):
        raise RuntimeError(
            f"RAY_ADDRESS={address}: hvdkit.ray does not run through the Ray Client. Fix: run "
            "the driver on a node of the cluster, or submit it with `ray job submit`"
        )
    if ":" in address and not answers(address):
        raise ConnectionError(
            f"no Ray cluster answers at RAY_ADDRESS={address}. Fix: start it (`ray start "
            "--head`), correct the address, or unset RAY_ADDRESS to start a local Ray"
        )
    ray.init()


class RayExecutor:
    """Runs a function on ``num_workers`` Horovod ranks, one Ray actor each.

    Args are Horovod's: ``settings`` (from :meth:`create_settings`), ``num_workers`` or
    ``num_hosts`` x ``num_workers_per_host``, ``cpus_per_worker``, ``use_gpu``,
    ``gpus_per_worker``, ``use_current_placement_group``. The elastic arguments
    (``min_workers`` and the rest) raise :class:`NotImplementedError`.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: int = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: int = 100,
        nics: set | None = None,
    ) -> MiniSettings:
        """Settings for :class:`RayExecutor`: ``timeout_s`` for Gloo's rendezvous,
        ``placement_group_timeout_s`` for placing the actors, ``nics`` the interfaces Gloo may
        use. ``ssh_str`` is written to ``ssh_identity_file`` (kept for Horovod's signature;
        actors need no ssh)."""
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            with open(os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(ssh_str)
        return MiniSettings(
            ssh_identity_file=ssh_identity_file,
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )

    def __init__(
        self,
        settings: MiniSettings,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: int = 1,
        use_gpu: bool = False,
        gpus_per_worker: int | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: list[int] | None = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        _ray()
        if min_workers is not None or max_workers is not None:
            raise NotImplementedError(
                "RayExecutor(min_workers=, max_workers=): elastic training on Ray is not in "
                "hvdkit. Fix: give num_workers for a fixed-size job, or run elastic jobs with "
                "`hvdkit run --min-np N --max-np M --host-discovery-script ...`"
            )
        if num_workers is not None and num_hosts is not None:
            raise ValueError("RayExecutor: give num_workers, or num_hosts, not both")
        if num_workers is None and num_hosts is None:
            raise ValueError(
                "RayExecutor: give num_workers (or num_hosts and num_workers_per_host)"
            )
        count = num_workers if num_workers is not None else (num_hosts or 0) * num_workers_per_host
        if count < 1 or cpus_per_worker <= 0:
            raise ValueError(
                f"RayExecutor: {count} workers of {cpus_per_worker} CPUs each: both must be "
                "positive"
            )
        self.settings = settings
        self.num_workers = count
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        self._placement_group: Any = None
        self._own_placement_group = False
        self._rendezvous: Rendezvous | None = None
        # The hang doctor (HVDKIT_STALL_TIMEOUT, HVDKIT_ON_STALL): set at start().
        self._hang = hang_doctor.engine_config("RayExecutor")
        self._hang_folder: Path | None = None
        self._hang_reported = False  # a report names the folder: keep its notes
        self._hosts: dict[int, str] = {}

    # -- start --------------------------------------------------------------------------------

    def _check_resources(self, ray: Any) -> None:
        total = ray.cluster_resources()
        wanted = {"CPU": self.num_workers * self.cpus_per_worker}
        if self.use_gpu:
            wanted["GPU"] = self.num_workers * self.gpus_per_worker
        for name, amount in wanted.items():
            if total.get(name, 0) < amount:
                per = self.cpus_per_worker if name == "CPU" else self.gpus_per_worker
                raise RuntimeError(
                    f"RayExecutor(num_workers={self.num_workers}, {name.lower()}s_per_worker="
                    f"{per}) needs {amount} {name}s, but the Ray cluster has "
                    f"{total.get(name, 0):g} (ray.cluster_resources()). Fix: fewer workers or "
                    f"{name}s per worker, or add nodes to the cluster"
                )
        if self.num_hosts:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive < self.num_hosts:
                raise RuntimeError(
                    f"RayExecutor(num_hosts={self.num_hosts}) needs {self.num_hosts} Ray nodes, "
                    f"but the cluster has {alive}. Fix: num_workers= instead, or add nodes"
                )

    def _place(self, ray: Any) -> list[tuple[Any, int]]:
        """The placement group and bundle index for each worker."""
        from ray.util.placement_group import get_current_placement_group, placement_group

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            self._placement_group = current
            return [(current, i) for i in range(self.num_workers)]
        if self.num_hosts:
            per = self.num_workers_per_host
            bundle = {"CPU": self.cpus_per_worker * per}
            if self.use_gpu:
                bundle["GPU"] = self.gpus_per_worker * per
            group = placement_group([bundle] * self.num_hosts, strategy="STRICT_SPREAD")
            slots = [(group, i // per) for i in range(self.num_workers)]
        else:
            bundle = {"CPU": self.cpus_per_worker}
            if self.use_gpu:
                bundle["GPU"] = self.gpus_per_worker
            group = placement_group([bundle] * self.num_workers, strategy="PACK")
            slots = [(group, i) for i in range(self.num_workers)]
        self._placement_group, self._own_placement_group = group, True
        timeout = self.settings.placement_group_timeout_s
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._release(ray)
            raise TimeoutError(
                f"RayExecutor: the {self.num_workers} workers were not placed within "
                f"placement_group_timeout_s={timeout} (bundles {bundle}). Fix: free or add "
                "resources, or a larger placement_group_timeout_s"
            ) from None
        return slots

    def _check_worker_python(self, ray: Any, slots: list[tuple[Any, int]]) -> None:
        """Runs :func:`hvdkit.engines.interpreter.probe` in each bundle of the placement group
        (no resources of its own): a node whose Python (the cluster's, or ``runtime_env``'s)
        cannot import hvdkit is said in one line with the fix, rather than as each actor dying
        with ModuleNotFoundError."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(interpreter.probe)
        refs = [
            probe.options(num_cpus=0, max_retries=0, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=group,
                                                 placement_group_bundle_index=index))).remote()
            for group, index in {index: (group, index) for group, index in slots}.values()
        ]  # fmt: skip
        timeout = self.settings.placement_group_timeout_s
        try:
            reports = [row for rows in ray.get(refs, timeout=timeout) for row in rows]
        except ray.exceptions.GetTimeoutError:
            self._release(ray)
            raise TimeoutError(
                f"RayExecutor: the Ray workers' Python did not start within "
                f"placement_group_timeout_s={timeout}. Fix: check the nodes' Python and the "
                "job's runtime_env (ray.init(runtime_env=...)), or a larger "
                "placement_group_timeout_s"
            ) from None
        except ray.exceptions.RayError as exc:
            self._release(ray)
            raise RuntimeError(
                f"RayExecutor: the Ray workers could not run Python: "
                f"{interpreter.reason(str(exc))}. Fix: {interpreter.ray_fix(sys.executable)}"
            ) from None
        pythons = interpreter.lacking(reports)
        if pythons:
            self._release(ray)
            raise RuntimeError(
                interpreter.lacking_message("RayExecutor", "Ray workers", pythons,
                                            interpreter.ray_fix(sys.executable))
            )  # fmt: skip

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict | None = None,
    ) -> None:
        """Places the actors, forms the Horovod world and creates ``executable_cls`` (with
        its arguments) in each actor; ``extra_env_vars`` are set in every actor first."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _connect(ray)
        self._release(ray)  # a second start() replaces the workers of the first
        self._check_resources(ray)
        slots = self._place(ray)
        self._check_worker_python(ray, slots)
        actor = ray.remote(BaseHorovodWorker)
        self.workers = [
            actor.options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
            ).remote(world_rank=rank, world_size=self.num_workers)
            for rank, (group, index) in enumerate(slots)
        ]
        try:
            nodes = self._gather([w.node_id.remote() for w in self.workers])
            if self.settings.nics:
                ifaces: list[str | None] = [sorted(self.settings.nics)[0]] * len(nodes)
            else:
                ifaces = self._gather([w.iface.remote() for w in self.workers])
            plan = world.plan(nodes, "Ray")
            self._rendezvous = Rendezvous(plan)
            address = ray.util.get_node_ip_address()
            timeout = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(self.settings.timeout_s)}
            self._hang_folder, hang_env = hang_doctor.engine_folder(self._hang)
            hosts = self._gather([w.hostname.remote() for w in self.workers])
            self._hosts = dict(enumerate(hosts))
            self._gather([
                w.update_env_vars.remote({**slot.env(address, self._rendezvous.port, iface),
                                          **timeout, **hang_env, **(extra_env_vars or {})})
                for w, slot, iface in zip(self.workers, plan, ifaces, strict=True)
            ])  # fmt: skip
            args = (executable_cls, executable_args, executable_kwargs)
            self._gather([w.start_executable.remote(*args) for w in self.workers])
        except BaseException:
            self._release(ray)
            raise

    # -- running ------------------------------------------------------------------------------

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's result in rank order; the first failure stops every rank."""
        ray = _ray()
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                self._release(ray)
                raise WorkerError(
                    rank,
                    f"rank {rank}'s function raised {type(exc.cause).__name__}; every other "
                    f"rank was stopped (they would wait for it in a collective). Its "
                    f"traceback:\n{exc}",
                ) from exc.cause
            except ray.exceptions.RayActorError as exc:
                self._release(ray)
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise WorkerError(
                    rank,
                    f"rank {rank}'s Ray actor died ({why}); every other rank was stopped. "
                    "Start the executor again to rerun (resume from a checkpoint, if the "
                    "function keeps one)",
                ) from exc
        return results

    def _watched(self, refs: list[Any]) -> list[Any]:
        """:meth:`_gather` of a function's calls, under the hang doctor: a stall is reported
        on this process's stderr, and with ``HVDKIT_ON_STALL=stop`` every rank is stopped."""
        ray = _ray()
        watch = hang_doctor.watching(self._hang, self._hang_folder, dict(self._hosts),
                                     lambda: self._stop_for_stall(ray))  # fmt: skip
        with watch as doctor:
            try:
                return self._gather(refs)
            except WorkerError:
                if doctor is not None and doctor.stopped:
                    raise RuntimeError(
                        "RayExecutor: the hang doctor stopped every rank (HVDKIT_ON_STALL="
                        "stop); its report above says which ranks waited, which were missing "
                        "and where each was. Start the executor again to rerun"
                    ) from None
                raise
            finally:
                if doctor is not None:
                    self._hang_reported |= bool(doctor.reports)

    def _stop_for_stall(self, ray: Any) -> None:
        self._hang_reported = True  # the doctor reports before it stops the job
        self._release(ray)

    def _started(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first (or again, after a failure)")

    @staticmethod
    def _picklable(fn: Any, payload: Any, what: str) -> None:
        from ray import cloudpickle

        pickled(cloudpickle.dumps, fn, payload, f"RayExecutor.{what}")

    def execute(self, fn: Callable[[Any], Any], callbacks: list | None = None) -> list[Any]:
        """``fn(executable)`` on every rank; the results in rank order."""
        self._started()
        self._picklable(fn, fn, "execute")
        return self._watched([w.execute.remote(fn) for w in self.workers])

    def run(
        self,
        fn: Callable[..., Any],
        args: list | None = None,
        kwargs: dict | None = None,
        callbacks: list | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        self._started()
        self._picklable(fn, (fn, args, kwargs), "run")
        return self._watched(self.run_remote(fn, args, kwargs))

    def run_remote(
        self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None
    ) -> list[Any]:
        """As :meth:`run`, but returns the ObjectRefs (``ray.get`` them) without waiting."""
        self._started()
        call = _Call(fn, list(args or []), dict(kwargs or {}))
        return [w.execute.remote(call) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._started()
        return _ray().get(self.workers[0].execute.remote(fn))

    def shutdown(self) -> None:
        """Stops the actors, the placement group and the rendezvous server."""
        self._release(_ray())

    def _release(self, ray: Any) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._placement_group is not None and self._own_placement_group:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
        self._placement_group, self._own_placement_group = None, False
        if self._rendezvous is not None:
            self._rendezvous.stop()
            self._rendezvous = None
        if self._hang_folder is not None and not self._hang_reported:
            shutil.rmtree(self._hang_folder, ignore_errors=True)  # nothing to look at
        self._hang_folder = None


@dataclass
class _Call:
    """``fn(*args, **kwargs)``, ignoring the executable (what ``run`` sends each actor)."""

    fn: Callable[..., Any]
    args: list
    kwargs: dict

    def __call__(self, executable: Any) -> Any:
        return self.fn(*self.args, **self.kwargs)
