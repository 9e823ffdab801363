"""Turn chosen remedies into a concrete build: environment, compiler wrapper, extra headers.

:func:`make_recipe` is pure (it only computes paths and text); :meth:`Recipe.materialize`
writes the files into a scratch directory that lives only as long as the build.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hvdkit import envvars
from hvdkit.horovod_build.config import BuildConfig, BuildEnv
from hvdkit.horovod_build.remedies import Remedy

_OLD_STANDARDS = ("c++11", "c++14", "gnu++11", "gnu++14")
_CXX17 = ("c++17", "gnu++17")
GIB_PER_JOB = 3.0
"""TensorFlow's translation units peak near 2-3 GiB each in cc1plus."""


def compile_jobs(env: BuildEnv, cfg: BuildConfig, environ: dict[str, str]) -> int:
    """Parallel jobs: asked for, else as many as both cores and memory allow."""
    if cfg.jobs:
        return cfg.jobs
    if environ.get(envvars.BUILD_JOBS, "").isdigit():
        return max(1, int(environ[envvars.BUILD_JOBS]))
    return max(1, min(env.cpu_count, int(env.memory_gib // GIB_PER_JOB)))


def wrapper_script(
    real_compiler: str,
    cxx_std: str | None,
    force_includes: tuple[str, ...],
    torch_cxx_std: str | None = None,
    torch_include_dir: str | None = None,
    drop_debug_info: bool = False,
) -> str:
    """A POSIX sh compiler wrapper: rewrites old -std flags to ``cxx_std`` and, in a unit
    whose arguments name ``torch_include_dir``, to ``torch_cxx_std`` (C++17 flags too);
    force-includes headers; with ``drop_debug_info``, leaves out ``-g`` flags."""
    note = "# Written by hvdkit build-horovod; see hvdkit/horovod_build/remedies.py."
    lines = ["#!/bin/sh", note, ""]
    rules: list[str] = []  # the cases of one pass over the arguments
    if cxx_std:
        lines.append(f"std={cxx_std}")
        if torch_cxx_std and torch_include_dir:
            # A C++17 flag is rewritten only in a unit that includes torch (then to C++20).
            pattern = f"*{shlex.quote(torch_include_dir)}*"
            lines += [
                "for arg; do",
                f'  case "$arg" in {pattern}) std={torch_cxx_std} ;; esac',
                "done",
            ]
        cases = "|".join(f"-std={s}" for s in _OLD_STANDARDS)
        rules.append(f'    {cases}) set -- "$@" "-std=$std" ;;')
        if torch_cxx_std and torch_include_dir:
            cxx17 = "|".join(f"-std={s}" for s in _CXX17)
            rules.append(
                f'    {cxx17}) if [ "$std" = {torch_cxx_std} ]; then set -- "$@" "-std=$std";'
                ' else set -- "$@" "$arg"; fi ;;'
            )
    if drop_debug_info:
        rules.append("    -g|-g[0-9]|-ggdb*|-gdwarf*) ;;")
    if rules:
        lines += ["for arg; do", "  shift", '  case "$arg" in', *rules,
                  '    *) set -- "$@" "$arg" ;;', "  esac", "done"]  # fmt: skip
    argv = [shlex.quote(real_compiler)] + [f"-include {shlex.quote(h)}" for h in force_includes]
    lines.append(f'exec {" ".join(argv)} "$@"')
    return "\n".join(lines) + "\n"


@dataclass
class Recipe:
    """The files and environment of one build, relative to a scratch directory."""

    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    executables: tuple[str, ...] = ()
    symlinks: dict[str, str] = field(default_factory=dict)

    def materialize(self, workdir: Path) -> dict[str, str]:
        """Write the files and links under ``workdir``; return the build environment."""
        for rel, text in self.files.items():
            path = workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if rel in self.executables:
                path.chmod(0o755)
        for rel, target in self.symlinks.items():
            path = workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(target)
        return {k: v.replace("{workdir}", str(workdir)) for k, v in self.env.items()}


def make_recipe(
    env: BuildEnv, cfg: BuildConfig, remedies: list[Remedy], environ: dict[str, str]
) -> Recipe:
    """The build for ``cfg`` on ``env`` with ``remedies`` applied. ``{workdir}`` in values
    stands for the scratch directory."""
    build_env = {
        "HOROVOD_WITHOUT_MXNET": "1",
        "MAKEFLAGS": f"-j{compile_jobs(env, cfg, environ)}",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")]),
    }
    for name, flag in (("torch", "PYTORCH"), ("tensorflow", "TENSORFLOW")):
        build_env[f"HOROVOD_WITH{'' if name in cfg.frameworks else 'OUT'}_{flag}"] = "1"
    for name in ("gloo", "mpi"):
        build_env[f"HOROVOD_WITH{'' if name in cfg.controllers else 'OUT'}_{name.upper()}"] = "1"
    if env.cmake:
        build_env["HOROVOD_CMAKE"] = env.cmake
    recipe = Recipe(env=build_env)
    cxx_std = next((r.cxx_std for r in remedies if r.cxx_std), None)
    torch_std = next((r.torch_cxx_std for r in remedies if r.torch_cxx_std), None)
    includes = tuple(h for r in remedies for h in r.force_includes)
    drop_debug_info = not cfg.debug_info
    if (cxx_std or includes or drop_debug_info) and env.compiler:
        recipe.files["bin/c++"] = wrapper_script(
            env.compiler, cxx_std, includes, torch_std, env.torch_include_dir, drop_debug_info
        )
        recipe.executables += ("bin/c++",)
        build_env["CXX"] = "{workdir}/bin/c++"
    forwards = [pair for r in remedies for pair in r.forward_headers]
    for rel, target in forwards:
        recipe.files[f"include/{rel}"] = f'#include "{target}"\n'
    if forwards:
        build_env["CPLUS_INCLUDE_PATH"] = os.pathsep.join(
            filter(None, ["{workdir}/include", environ.get("CPLUS_INCLUDE_PATH")])
        )
    for remedy in remedies:
        build_env.update(remedy.env)
    prepend = [p for r in remedies for p in r.path_prepend]
    nvcc_std = next((r.nvcc_std for r in remedies if r.nvcc_std), None)
    if nvcc_std and env.cuda_home:
        # CMake takes $HOROVOD_CUDA_HOME/bin/nvcc as the CUDA compiler; the real nvcc still
        # reports its own toolkit root, so headers and libraries come from the real toolkit.
        recipe.files["cuda/bin/nvcc"] = wrapper_script(f"{env.cuda_home}/bin/nvcc", nvcc_std, ())
        recipe.executables += ("cuda/bin/nvcc",)
        build_env["HOROVOD_CUDA_HOME"] = "{workdir}/cuda"
        prepend.insert(0, "{workdir}/cuda/bin")
    if prepend:
        build_env["PATH"] = os.pathsep.join([*prepend, build_env["PATH"]])
    for rel, target in (link for r in remedies for link in r.symlinks):
        recipe.symlinks[rel] = target
    return recipe
