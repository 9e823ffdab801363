"""Which CUDA toolkit a build uses (pure): one decision, made by hvdkit, shown in ``--plan``.

Horovod compiles CUDA support into its PyTorch extension whenever torch is a CUDA build and
torch can name a CUDA home (``torch.utils.cpp_extension.CUDA_HOME``), even for a CPU-collective
build. Left to torch, that home is whatever ``nvcc`` on PATH lives under, or /usr/local/cuda:
on a machine without a GPU that is often a prefix with an nvcc and no headers, and CMake fails
(``Could NOT find CUDAToolkit``). So hvdkit chooses the toolkit itself, from candidates in this
order: the nvidia wheels installed beside torch (they match torch's CUDA), ``$CUDA_HOME``,
/usr/local/cuda, then the prefix of ``nvcc`` on PATH; a candidate is usable only when it has
all of nvcc, ``cuda_runtime.h`` and libcudart, and the same CUDA major version as torch. The
chosen home is given to torch and CMake alike (see :mod:`hvdkit.horovod_build.remedies`).

Why not switch CUDA off for a CUDA torch instead: a Horovod extension without CUDA cannot take
a CUDA tensor at all, and a CUDA torch is installed to train on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdkit.horovod_build.versions import version_tuple


@dataclass(frozen=True)
class CudaCandidate:
    """A directory that may hold a CUDA toolkit, and what was found in it."""

    home: str
    source: str  # "nvidia wheels", "$CUDA_HOME", "/usr/local/cuda", "nvcc on PATH"
    version: str | None = None  # what its nvcc reports; None when nvcc does not run
    has_headers: bool = False
    has_cudart: bool = False

    def problem(self, torch_cuda: str | None) -> str | None:
        """Why this candidate cannot serve a build for ``torch_cuda``; None when it can."""
        missing = [
            what
            for what, ok in (
                ("a working bin/nvcc", self.version is not None),
                ("include/cuda_runtime.h", self.has_headers),
                ("lib/libcudart", self.has_cudart),
            )
            if not ok
        ]
        if missing:
            return f"missing {', '.join(missing)}"
        if torch_cuda and version_tuple(self.version or "")[:1] != version_tuple(torch_cuda)[:1]:
            return f"CUDA {self.version}, but torch is built for CUDA {torch_cuda}"
        return None


def choose_toolkit(
    candidates: tuple[CudaCandidate, ...], torch_cuda: str | None = None
) -> tuple[CudaCandidate | None, list[str]]:
    """The first usable candidate, and one line for each candidate passed over (or all of
    them, when none is usable)."""
    passed_over: list[str] = []
    for candidate in candidates:
        problem = candidate.problem(torch_cuda)
        if problem is None:
            return candidate, passed_over
        passed_over.append(f"{candidate.home} ({candidate.source}): {problem}")
    return None, passed_over


def toolkit_fix(torch_cuda: str | None, toolkit_wheels: str | None = None) -> str:
    """What makes a usable toolkit for ``torch_cuda``. CUDA >= 13's nvidia wheels share one
    prefix (``nvidia/cu13``), so pip can complete it: the ``cuda-toolkit`` meta-package
    torch >= 2.14 already depends on (``toolkit_wheels``, its installed version), with the
    compiler's extras, so nvcc matches torch's CUDA exactly. CUDA 12's wheels each have their
    own folder, which is no toolkit: those users need a full one as $CUDA_HOME."""
    parts = version_tuple(torch_cuda or "13.0") or (13, 0)
    if parts[0] >= 13:
        pin = toolkit_wheels or ".".join(map(str, (*parts[:2], "*")))
        return (
            f"pip install 'cuda-toolkit[nvcc,cccl]=={pin}' into this environment (nvcc and the "
            "CUDA headers as wheels; no GPU needed), or set CUDA_HOME to a full toolkit"
        )
    return f"install the CUDA {parts[0]} toolkit (NVIDIA's installer or package) and set CUDA_HOME"
