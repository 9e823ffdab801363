"""Under Gloo, the user's environment reaches each rank on its stdin, never on a command line.

Horovod 0.28.1's Gloo launcher starts every rank, static or elastic, local or over ssh, as
``env NAME=VALUE ... python train.py`` with every exportable variable of the launching shell in
that one string: in ``ps`` on the launching host (and in the ssh process and the remote shell
for another host) for the whole run, and in ``--verbose``'s log. Installed into horovodrun's
process by :mod:`hvdkit.launch.horovodrun`, this module keeps Horovod's own placement variables
(``HOROVOD_RANK``, the rendezvous address...) on the command line and moves the rest:

- the variables are written as ``export NAME='VALUE'`` lines to a file that only this user can
  read (mode 0600 in a 0700 directory), one file per rank start;
- the rank's shell opens that file as its stdin and removes it before it starts anything, so
  the file exists for milliseconds, and a remote rank's stdin is ssh's, which carries it to the
  other host inside the encrypted connection;
- a POSIX ``sh`` at the rank's end reads stdin, exports what it read and runs the rank with
  ``/dev/null`` as stdin (what Horovod gives ranks anyway). Nothing but ``sh`` and ``cat`` is
  needed on the remote host;
- the exports end with a line that marks them complete: a rank whose stdin was dropped or cut
  short on the way (``kubectl exec`` without ``-i``, ``ssh -n``) is not started, rather than
  started without the user's environment;
- a variable the rank's shell holds read-only (bash's ``UID``, ``EUID``, ``SHELLOPTS``,
  ``BASHOPTS`` where ``/bin/sh`` is bash) keeps the shell's value instead of failing the start.

The pure parts (what is forwarded, the exports text, the commands) are functions of their
arguments, for unit tests; :func:`install` is the only part that touches Horovod.
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hvdkit import envvars

ARRIVED = "hvdkit_env_arrived"
"""The shell variable (not exported) that the exports' last line sets."""
NOT_ARRIVED = (
    "hvdkit: rank not started: its environment did not arrive on its stdin on host "
    "$(uname -n) (stdin dropped on the way: kubectl exec without -i, ssh -n?). Fix: make what "
    "starts ranks there pass stdin on (Kubeflow's /etc/mpi/kubexec.sh: kubectl exec -i)"
)
# In POSIX mode (bash as /bin/sh) an error of a special builtin such as export, a read-only
# variable's, ends the shell; run through `command`, it fails that one export alone.
RECEIVE = (
    f'{ARRIVED}=; command eval "$(cat)" 2>/dev/null; '
    f'if [ "${ARRIVED}" != 1 ]; then echo "{NOT_ARRIVED}" >&2; exit 1; fi; '
    f'unset {ARRIVED}; exec "$@" </dev/null'
)
"""What the rank's ``sh -c`` runs: export the variables read from stdin and, if they all
arrived, run the rank."""
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def forwarded(
    env: Mapping[str, str], exportable: Callable[[str], bool], leave_out: Iterable[str] = ()
) -> tuple[dict[str, str], list[str]]:
    """The variables each rank receives (Horovod's ``exportable`` rule, less the names in
    ``leave_out``), and the names dropped because a shell cannot export them."""
    left_out = set(leave_out)
    kept, unusable = {}, []
    for name, value in env.items():
        if not exportable(name) or name in left_out:
            continue
        if _IDENTIFIER.fullmatch(name):
            kept[name] = value
        else:
            unusable.append(name)
    return kept, unusable


def leave_out(environ: Mapping[str, str]) -> list[str]:
    """The names ``HVDKIT_ENV_EXCLUDE`` (comma- or space-separated) keeps from the ranks."""
    return [n for n in re.split(r"[,\s]+", environ.get(envvars.ENV_EXCLUDE, "")) if n]


def exports(env: Mapping[str, str]) -> bytes:
    """The stdin bytes: one ``command export NAME='VALUE'`` per variable (names are
    identifiers, values quoted for sh), then the line that says they all arrived. A value
    that is not UTF-8 (Python holds its bytes as surrogate escapes) is passed on as its
    bytes."""
    lines = [f"command export {name}={shlex.quote(value)}\n" for name, value in env.items()]
    return "".join([*lines, f"{ARRIVED}=1\n"]).encode("utf-8", "surrogateescape")


def receiving(command: str) -> str:
    """``command`` (Horovod's ``env HOROVOD_...=... python train.py``, values of the user's
    variables left out) run after the exports on stdin."""
    return f"sh -c {shlex.quote(RECEIVE)} hvdkit-env {command}"


def from_file(path: str, command: str) -> str:
    """The shell string that starts ``command`` with the file at ``path`` as its stdin, the
    file removed first (for a remote rank ``command`` is the ssh command)."""
    quoted = shlex.quote(path)
    return f"exec <{quoted} && rm -f {quoted} && exec {command}"


class _Channel:
    """The private files of one horovodrun process."""

    def __init__(self) -> None:
        self.data = b""
        self.directory: str | None = None
        self.count = 0
        self.verbose = False

    def write(self) -> str:
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="hvdkit-env-")  # mode 0700
            atexit.register(shutil.rmtree, self.directory, True)
        self.count += 1
        path = os.path.join(self.directory, str(self.count))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(self.data)
        return path


def install() -> None:
    """Make Horovod's Gloo launcher (static and elastic) pass the environment privately
    (Horovod 0.28.1's ``gloo_run`` names; checked here, so a Horovod without them fails the
    launch rather than leaking)."""
    from horovod.runner import gloo_run
    from horovod.runner.common.util import env as env_util
    from horovod.runner.common.util import safe_shell_exec

    needed = ("_exec_command_fn", "_slot_info_to_command_fn", "create_slot_env_vars")
    for name in (*needed, "safe_shell_exec"):
        if not hasattr(gloo_run, name):
            raise RuntimeError(f"hvdkit: horovod.runner.gloo_run has no {name}; cannot launch")
    channel = _Channel()
    exec_command_fn = gloo_run._exec_command_fn

    def exec_command_fn_noting_verbose(settings: Any) -> Any:
        channel.verbose = bool(settings.verbose)
        return exec_command_fn(settings)

    def slot_info_to_command_fn(run_command: str, env: Mapping[str, str]) -> Any:
        kept, unusable = forwarded(
            {**env, "PYTHONUNBUFFERED": "1"}, env_util.is_exportable, leave_out(env)
        )
        channel.data = exports(kept)
        if channel.verbose:
            print(
                f"hvdkit: {len(kept)} variable(s) forwarded to each rank on its stdin (not on "
                f"its command line): {' '.join(sorted(kept))}",
                flush=True,
            )
        if unusable:
            print(
                f"hvdkit: not forwarded (not shell variable names): {' '.join(sorted(unusable))}",
                file=sys.stderr,
                flush=True,
            )

        def slot_info_to_command(slot_info: Any) -> str:
            placement = gloo_run.create_slot_env_vars(slot_info)
            assignments = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in placement.items())
            return receiving(f"env {assignments} {run_command}")

        return slot_info_to_command

    def execute(command: str, *args: Any, **kwargs: Any) -> int:
        return safe_shell_exec.execute(from_file(channel.write(), command), *args, **kwargs)

    class _SafeShellExec:
        """gloo_run's view of ``safe_shell_exec``: its ``execute`` gives stdin."""

        def __getattr__(self, name: str) -> Any:
            return getattr(safe_shell_exec, name)

    shim = _SafeShellExec()
    shim.execute = execute  # type: ignore[attr-defined]
    gloo_run._exec_command_fn = exec_command_fn_noting_verbose
    gloo_run._slot_info_to_command_fn = slot_info_to_command_fn
    gloo_run.safe_shell_exec = shim
