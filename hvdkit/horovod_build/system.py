"""Debian packages: which are installed, and installing the missing ones (as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable


def installed(package: str) -> bool:
    """Whether dpkg knows ``package`` as installed."""
    if shutil.which("dpkg-query") is None:
        return False
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and "install ok installed" in out.stdout


def apt_install(packages: list[str], log: Callable[[str], None] = print) -> None:
    """``apt-get install`` the missing ones among ``packages``; runs ``apt-get update`` once
    only when something is missing. Raises RuntimeError naming the packages on failure."""
    missing = [p for p in packages if not installed(p)]
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log(f"Installing Debian packages: {' '.join(missing)}")
    for argv in (
        ["apt-get", "update", "-q"],
        # Waits for another apt (unattended upgrades, a second build) rather than failing.
        [
            "apt-get",
            "install",
            "-y",
            "-q",
            "-o",
            "DPkg::Lock::Timeout=600",
            "--no-install-recommends",
            *missing,
        ],
    ):
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
            raise RuntimeError(
                f"`{' '.join(argv)}` failed (exit {out.returncode}):\n{tail}\n"
                f"Fix: install them by hand (apt-get install -y {' '.join(missing)}) and rerun."
            )
