"""Horovod's build matrix (frameworks, controllers, tensor ops), read in a child process.

A child process, because loading a Horovod extension that was built against another framework
version can abort the interpreter; the caller must survive to report it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

# A framework counts as built when its extension library exists: `horovod.torch` imports,
# and Horovod's own extension_available() can say yes, without the library it needs.
_SCRIPT = """
import json, os, sysconfig
import horovod
from horovod.common import util
root = os.path.dirname(horovod.__file__)
suffix = sysconfig.get_config_var("EXT_SUFFIX")
libs = {"torch": "torch/mpi_lib_v2", "tensorflow": "tensorflow/mpi_lib"}
print(json.dumps({
    "version": horovod.__version__,
    "frameworks": {n: os.path.exists(os.path.join(root, lib + suffix)) for n, lib in libs.items()},
    "controllers": {"mpi": bool(util.mpi_built()), "gloo": bool(util.gloo_built())},
    "ops": {"nccl": bool(util.nccl_built()), "ddl": bool(util.ddl_built()),
            "ccl": bool(util.ccl_built())},
}))
"""


@dataclass(frozen=True)
class BuildMatrix:
    """What the installed Horovod was built with."""

    version: str
    frameworks: dict[str, bool]
    controllers: dict[str, bool]
    ops: dict[str, bool]

    def missing(self, frameworks: tuple[str, ...], controllers: tuple[str, ...]) -> list[str]:
        """Requested pieces this build lacks."""
        return [f for f in frameworks if not self.frameworks.get(f)] + [
            c for c in controllers if not self.controllers.get(c)
        ]

    def describe(self) -> str:
        def marks(d: dict[str, bool]) -> str:
            return ", ".join(f"{k}{'' if v else ' (no)'}" for k, v in d.items())

        return (
            f"Horovod {self.version}: frameworks {marks(self.frameworks)}; "
            f"controllers {marks(self.controllers)}; GPU ops {marks(self.ops)}"
        )


class MatrixError(RuntimeError):
    """Horovod could not be imported or inspected."""


def read_matrix(python: str = sys.executable, timeout: float = 180) -> BuildMatrix:
    """The build matrix of the Horovod installed for ``python``."""
    try:
        out = subprocess.run(
            [python, "-c", _SCRIPT], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise MatrixError(f"inspecting Horovod took over {timeout:.0f} s") from exc
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-3:])
        raise MatrixError(tail or f"exit status {out.returncode}")
    return BuildMatrix(**json.loads(out.stdout.strip().splitlines()[-1]))
