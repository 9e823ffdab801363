"""The CPU image for real: built with whichever engine exists (tests/containers.py), then
``hvdkit doctor`` and a 2-rank Keras MNIST run inside it as the non-root user, and two
containers as two hosts (each in its own network namespace, sshd started by the image's
helper) reduced across by ``hvdkit run --hostfile``: the multi-node recipe of
docs/guides/docker.md; and the
Kubeflow MPIJob example run as the MPI Operator runs it, training to equal weights."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, results
from containers import (
    GPU_TAG,
    TAG,
    TORCH_ONLY,
    TORCH_TAG,
    Engine,
    base_image,
    build,
    find_engine,
    image_size,
)
from netns import SUBNET, TwoHosts, ensure_tools

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(3000)]
SSH_PORT = "2222"


@pytest.fixture(scope="module")
def engine_base() -> tuple[Engine, str, str]:
    """The engine, the base image and how it was had (pulled or made from Debian)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a container engine, network namespaces)")
    engine = find_engine()
    if isinstance(engine, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"the image test must run in CI: {engine}")
        pytest.skip(engine)
    return (engine, *base_image(engine))


def built(
    engine_base: tuple[Engine, str, str],
    tag: str,
    build_args: tuple[str, ...],
    dockerfile: str = "docker/Dockerfile.cpu",
) -> Engine:
    engine, base, how = engine_base
    seconds, argv = build(engine, base, tag, build_args, dockerfile)
    size = image_size(engine, tag)
    print(f"\n[image] {tag}: {engine.name} build from {base} ({how}): {seconds:.0f} s, "
          f"{size / 2**30:.2f} GiB\n[image] {engine.name} {' '.join(argv)}")  # fmt: skip
    return engine


@pytest.fixture(scope="module")
def image(engine_base) -> Engine:
    return built(engine_base, TAG, ())


@pytest.fixture(scope="module")
def torch_image(engine_base) -> Engine:
    return built(engine_base, TORCH_TAG, TORCH_ONLY)


@pytest.fixture(scope="module")
def gpu_image(engine_base) -> Engine:
    return built(engine_base, GPU_TAG, (), "docker/Dockerfile.gpu")


def test_image_passes_doctor_and_trains_keras_mnist_as_non_root(image):
    who = image.run(TAG, flags=("--entrypoint", "id"))
    assert who.returncode == 0 and "uid=1000(hvdkit)" in who.stdout, who.stderr
    # The image's gate already ran the whole doctor, allreduces included, as uid 1000 during
    # this build (the build fails otherwise); here the installed versions and build matrix are
    # checked again as the image runs, without repeating the four allreduce launches.
    doctor = image.run(TAG, "doctor", "--no-allreduce", flags=("--network", "host"), timeout=300)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    assert "PASS  Horovod build: Horovod 0.28.1" in doctor.stdout, doctor.stdout
    out = image.run(
        TAG, "run", "-np", "2", "--hostfile", "hostfiles/localhost", "--", "python",
        "examples/keras_mnist.py", "--epochs", "10",
        flags=("--network", "host"), timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out.stdout).group(1))
    print(f"[image] keras_mnist in the image, 2 ranks, 10 epochs: test accuracy {accuracy}")
    assert accuracy > 0.90  # the docs' "about 0.95" on the digits fallback


class ContainerHosts(TwoHosts):
    """tests/netns.py's two hosts, with the image's sshd (``start-sshd``, as uid 1000, port
    2222) in a container in each namespace in place of this machine's sshd."""

    def __init__(self, tmp: Path, engine: Engine) -> None:
        super().__init__(tmp)
        self.engine = engine
        self.containers: list[str] = []

    def ssh_dir(self, name: str) -> Path:
        """A copy of the shared key pair, owned by the image's user (sshd checks modes)."""
        directory = self.tmp / f"ssh-{name}"
        directory.mkdir(mode=0o700)
        shutil.copy(self.tmp / "id", directory / "id_ed25519")
        shutil.copy(self.tmp / "id.pub", directory / "authorized_keys")
        (directory / "config").write_text(
            f"Host *\n  Port {SSH_PORT}\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
        )
        for path in (directory, *directory.iterdir()):
            os.chown(path, 1000, 1000)
            path.chmod(0o700 if path.is_dir() else 0o600)
        return directory

    def container_flags(self, ns: str, name: str) -> tuple[str, ...]:
        # Gloo resolves each host's own name: give the container one that resolves to its
        # namespace's address. The tests' workers at the path the image runs scripts from.
        addr = self.hosts.get(ns, f"{SUBNET}.1")
        return ("--network", f"ns:/run/netns/{ns}", "--name", name,
                "--hostname", name, "--add-host", f"{name}:{addr}",
                "-v", f"{self.ssh_dir(name)}:/home/hvdkit/.ssh", "-e", f"SSH_PORT={SSH_PORT}",
                "-v", f"{ROOT / 'tests'}:/opt/hvdkit/tests:ro")  # fmt: skip

    def start_sshd(self, ns: str) -> None:
        name = f"hvdkit-sshd-{ns}"
        out = self.engine(
            "run", "-d", *self.engine.run_flags, *self.container_flags(ns, name),
            "--entrypoint", "start-sshd", TAG,
        )  # fmt: skip
        self.containers.append(name)
        self.sshd_pids[ns] = 0
        assert out.returncode == 0

    def stop_sshd(self, ns: str) -> None:
        self.sshd_pids.pop(ns, None)

    def down(self) -> None:
        for name in self.containers:
            self.engine("rm", "-f", "-t", "2", name, check=False)
        super().down()


def test_two_containers_reduce_as_two_hosts_over_ssh(image, tmp_path):
    """The launching container and the two "hosts" each in a network namespace of
    tests/netns.py; the hosts run the image's sshd with the user's keys mounted (the recipe of
    docs/guides/docker.md). The allreduce is right on both ranks, each in its own host. (Training across
    such containers to equal weights: the MPIJob test below.)"""
    reason = ensure_tools()
    if reason:
        pytest.fail(reason) if os.environ.get("CI") == "true" else pytest.skip(reason)
    hosts = ContainerHosts(tmp_path, image)
    try:
        hosts.up()
        hostfile = tmp_path / "cluster"
        hostfile.write_text("".join(f"{addr} slots=1\n" for addr in hosts.hosts.values()))
        hostfile.chmod(0o644)
        launch = ("run", "--hostfile", "hostfiles/cluster", "--ssh-port", SSH_PORT,
                  "--network-interface", "hvd0", "--gloo", "--", "python")  # fmt: skip

        def launcher(name: str) -> tuple[str, ...]:
            return (*hosts.container_flags(hosts.launcher, name),
                    "-v", f"{hostfile}:/opt/hvdkit/hostfiles/cluster:ro")  # fmt: skip

        allreduce = image.run(
            TAG, *launch, "tests/workers/launch_worker.py", flags=launcher("hvdkit-launch-1")
        )
    finally:
        hosts.down()
    assert allreduce.returncode == 0, allreduce.stdout[-3000:] + allreduce.stderr[-3000:]
    sums = results(allreduce)
    assert sums[0]["sum"] == sums[1]["sum"] == 3.0
    assert sums[0]["netns"] != sums[1]["netns"]  # each rank in its own "host"
    print("[image] two containers as two hosts: allreduce 3.0 on both")


MPIJOB = ROOT / "examples" / "mpijob_pytorch_mnist.yaml"


class OperatorPods(ContainerHosts):
    """What the Kubeflow MPI Operator makes of examples/mpijob_pytorch_mnist.yaml, on
    tests/netns.py's hosts: worker pods named ``<job>-worker-<i>`` running the manifest's
    worker command, one key pair mounted read-only at ``sshAuthMountPath`` in every pod as the
    operator mounts its Secret (root-owned ``id_rsa``, ``id_rsa.pub``, ``authorized_keys``,
    mode 0644 off /root), and the launcher's ``/etc/mpi/hostfile``."""

    def __init__(self, tmp: Path, engine: Engine, job: dict) -> None:
        super().__init__(tmp, engine)
        self.job = job
        name, spec = job["metadata"]["name"], job["spec"]
        self.mount = spec["sshAuthMountPath"]
        self.worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        count = spec["mpiReplicaSpecs"]["Worker"]["replicas"]
        # The operator's hostfile names each worker by its DNS name under the job's headless
        # service (mpi-operator's newConfigMap); the launcher pod is `<job>-launcher`.
        self.names = [f"{name}-worker-{i}.{name}.default.svc" for i in range(count)]
        self.launcher_name = f"{name}-launcher"
        self.slots = spec.get("slotsPerWorker", 1)

    def operator_secret(self) -> Path:
        directory = self.tmp / "operator-ssh"
        if not directory.exists():
            directory.mkdir()
            subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-N", "", "-f",
                            str(directory / "id_rsa")], check=True)  # fmt: skip
            shutil.copy(directory / "id_rsa.pub", directory / "authorized_keys")
            for path in directory.iterdir():
                path.chmod(0o644)
        return directory

    def hostfile_path(self) -> Path:
        path = self.tmp / "mpi-hostfile"
        path.write_text("".join(f"{n} slots={self.slots}\n" for n in self.names))
        path.chmod(0o644)
        return path

    def container_flags(self, ns: str, name: str) -> tuple[str, ...]:
        addrs = list(self.hosts.values())
        dns = tuple(f"--add-host={n}:{a}" for n, a in zip(self.names, addrs, strict=True))
        return ("--network", f"ns:/run/netns/{ns}", "--name", name, "--hostname", name,
                *dns, "-v", f"{self.operator_secret()}:{self.mount}:ro",
                "-v", f"{ROOT / 'tests'}:/opt/hvdkit/tests:ro")  # fmt: skip

    def start_sshd(self, ns: str) -> None:
        i = list(self.hosts).index(ns)
        name = self.names[i].split(".")[0]
        command = self.worker["command"]
        out = self.engine("run", "-d", *self.engine.run_flags, *self.container_flags(ns, name),
                          "--env=K_MPI_JOB_ROLE=worker", "--entrypoint", command[0], TAG,
                          *command[1:])  # fmt: skip
        self.containers.append(name)
        self.sshd_pids[ns] = 0
        assert out.returncode == 0, out.stderr


def test_the_mpijob_manifest_trains_as_the_operator_runs_it(image, tmp_path):
    """examples/mpijob_pytorch_mnist.yaml's launcher arguments and worker command, run as the
    MPI Operator runs them (its Secret read-only, its hostfile, the pods' DNS names): `hvdkit
    run` takes the hosts from /etc/mpi/hostfile, the workers' sshd takes the operator's key,
    the example reaches the docs' accuracy, and a training run ends equal on both ranks."""
    reason = ensure_tools()
    if reason:
        pytest.fail(reason) if os.environ.get("CI") == "true" else pytest.skip(reason)
    import yaml

    job = yaml.safe_load(MPIJOB.read_text())
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    args = list(launcher["args"])
    args[args.index("--epochs") + 1] = "3"  # shorter than the manifest's 5, for CI's time
    pods = OperatorPods(tmp_path, image, job)
    try:
        pods.up()
        # The launcher's environment as the operator sets it for Open MPI (ompiEnvVars).
        operator_env = {"K_MPI_JOB_ROLE": "launcher", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                        "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                        "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                        "OMPI_MCA_orte_set_default_slots": str(pods.slots)}  # fmt: skip
        flags = (*pods.container_flags(pods.launcher, pods.launcher_name),
                 "-v", f"{pods.hostfile_path()}:/etc/mpi/hostfile:ro",
                 *(f"--env={k}={v}" for k, v in operator_env.items()))  # fmt: skip
        example = image.run(TAG, *args, flags=flags, timeout=600)
        cut = args.index("--")
        trained = image.run(TAG, *args[:cut], "--", "python", "tests/workers/torch_worker.py",
                            "train", "--epochs", "2", flags=flags)  # fmt: skip
    finally:
        pods.down()
    for out in (example, trained):
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = example.stdout + example.stderr
    assert "hosts from the Kubernetes MPIJob allocation" in text, text[-2000:]
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", text).group(1))
    weights = results(trained)
    assert sorted(weights) == [0, 1] and weights[0]["params"] == weights[1]["params"]
    print(f"\n[image] MPIJob manifest as the operator runs it, 2 worker pods, 3 epochs: test "
          f"accuracy {accuracy}; weights {weights[0]['params'][:16]} on both ranks")  # fmt: skip
    assert accuracy > 0.90


@pytest.mark.extra  # a second image build with its own Horovod compile: ~9 min cold
def test_pytorch_only_image_is_smaller_and_trains_like_one_process(image, torch_image):
    """``--build-arg FRAMEWORKS=torch --build-arg KERAS_BACKEND=torch``: no TensorFlow, Horovod
    built for PyTorch only, Keras on its torch backend; what a PyTorch-only user pulls."""
    full, small = image_size(image), image_size(torch_image, TORCH_TAG)
    print(f"[image] PyTorch only: {small / 2**30:.2f} GiB, full: {full / 2**30:.2f} GiB "
          f"({small / full:.2f})")  # fmt: skip
    doctor = torch_image.run(TORCH_TAG, "doctor", flags=("--network", "host"), timeout=300)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    for line in ("SKIP  TensorFlow: not installed", "backend torch (KERAS_BACKEND)",
                 "PASS  allreduce PyTorch / gloo", "PASS  allreduce PyTorch / mpi"):  # fmt: skip
        assert line in doctor.stdout, doctor.stdout
    # Built without KERAS_BACKEND=torch, Keras would look for TensorFlow: the gate says so.
    unset = torch_image.run(TORCH_TAG, "doctor", "--no-allreduce",
                            flags=("-e", "KERAS_BACKEND="), timeout=300)  # fmt: skip
    assert unset.returncode != 0, unset.stdout
    assert "FAIL  Keras" in unset.stdout and "export KERAS_BACKEND=torch" in unset.stdout
    local = ("--network", "host", "-v", f"{ROOT / 'tests'}:/opt/hvdkit/tests:ro")
    launch = ("run", "-np", "2", "--hostfile", "hostfiles/localhost", "--", "python")
    step = torch_image.run(TORCH_TAG, *launch, "tests/workers/torch_worker.py", "one_step",
                           flags=local, timeout=300)  # fmt: skip
    trained = torch_image.run(TORCH_TAG, *launch, "tests/workers/torch_worker.py", "train",
                              "--epochs", "2", flags=local, timeout=300)  # fmt: skip
    mnist = torch_image.run(TORCH_TAG, *launch, "examples/keras_mnist.py", "--epochs", "10",
                            flags=("--network", "host"), timeout=900)  # fmt: skip
    for out in (step, trained, mnist):
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # One step on 2 ranks == one process on the global batch with the LR x 2.
    assert all(r["diff"] < 1e-6 and r["moved"] > 1e-3 for r in results(step).values())
    weights = results(trained)
    assert weights[0]["params"] == weights[1]["params"]
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", mnist.stdout).group(1))
    print(f"[image] PyTorch only: one step = one process (diff "
          f"{max(r['diff'] for r in results(step).values()):.1e}), weights equal, "
          f"keras_mnist on the torch backend {accuracy}")  # fmt: skip
    assert accuracy > 0.90
    assert small < 0.6 * full


@pytest.mark.extra
@pytest.mark.gpu_image  # `make image-gpu`: 2.7 GB of CUDA wheels and a NCCL compile, ~25 min cold
def test_gpu_image_builds_without_a_gpu_and_says_what_it_skipped(gpu_image):
    """docker/Dockerfile.gpu on this machine (no GPU, no registry): the Debian-made base plus
    pip's CUDA wheels. Its gate ran doctor as it was built; here doctor reports the NCCL build
    and the NCCL it loads, says the GPU checks were skipped and why, and 2 ranks on CPU tensors
    (the NCCL build's Gloo and MPI paths) end equal to one process and to each other."""
    doctor = gpu_image.run(GPU_TAG, "doctor", flags=("--network", "host"), timeout=600)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    text = doctor.stdout
    assert "PASS  Horovod build: Horovod 0.28.1" in text and "GPU ops nccl, " in text, text
    assert re.search(r"PASS  NCCL: 2\.30\.7 loaded from \S+/nvidia/nccl/lib/libnccl\.so", text)
    assert "SKIP  GPUs: none visible" in text, text
    assert "PASS  allreduce PyTorch / gloo" in text and "PASS  allreduce PyTorch / mpi" in text
    # What only the compile needed is gone: pip's nvcc and the C++ headers.
    left = gpu_image.run(
        GPU_TAG, "-c", "for p in nvidia/cu13/bin/nvcc torch/include nvidia/nccl/lib/libnccl.so.2; "
        "do test -e .venv/lib/python3*/site-packages/$p && echo present: $p; done",
        flags=("--entrypoint", "bash"),
    )  # fmt: skip
    assert left.stdout.split("\n")[:-1] == ["present: nvidia/nccl/lib/libnccl.so.2"], left.stdout
    local = ("--network", "host", "-v", f"{ROOT / 'tests'}:/opt/hvdkit/tests:ro")
    launch = ("run", "-np", "2", "--hostfile", "hostfiles/localhost", "--", "python")
    outs = {
        mode: gpu_image.run(GPU_TAG, *launch, "tests/workers/torch_worker.py", mode, *extra,
                            flags=local, timeout=600)  # fmt: skip
        for mode, extra in (("one_step", ()), ("train", ("--epochs", "2")))
    }
    for out in outs.values():
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    step, weights = results(outs["one_step"]), results(outs["train"])
    assert all(r["diff"] < 1e-6 and r["moved"] > 1e-3 for r in step.values())
    assert weights[0]["params"] == weights[1]["params"]
    print(f"[image] GPU image without a GPU: NCCL build, GPU checks skipped; 2 ranks: one step "
          f"= one process (diff {max(r['diff'] for r in step.values()):.1e}), weights equal")
