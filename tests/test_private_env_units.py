"""The pure parts of hvdkit.launch.private_env and hvdkit.launch.names. The exports and the
commands are run by a real ``sh`` here: quoting is only right if a shell reads it back."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess

import pytest

from hvdkit.launch import private_env
from hvdkit.launch.names import BadInputError, check_host, check_interfaces, check_port, is_inert

TRICKY = {
    "PLAIN": "value",
    "QUOTES": 'it\'s "quoted"',
    "SUBST": "$(touch {marker}) `touch {marker}` ${{HOME}}",
    "LINES": "one\ntwo\n",
    "EMPTY": "",
    "SPACES": "  a  b  ",
    "UNICODE": "naïve ✓",
}


def test_only_exportable_shell_names_are_forwarded_and_exclusions_apply():
    env = {"A": "1", "BASH_FUNC_f%%": "() { :; }", "OLDPWD": "/x", "a.b": "2", "TOKEN": "t"}
    kept, unusable = private_env.forwarded(
        env, lambda n: not n.startswith(("BASH_FUNC_", "OLDPWD")), leave_out=["TOKEN"]
    )
    assert kept == {"A": "1"} and unusable == ["a.b"]
    assert private_env.leave_out({"HVDKIT_ENV_EXCLUDE": "TOKEN, OTHER  THIRD"}) == [
        "TOKEN", "OTHER", "THIRD",
    ]  # fmt: skip
    assert private_env.leave_out({}) == []


def test_a_rank_gets_every_value_exactly_and_runs_nothing_from_them(tmp_path):
    marker = tmp_path / "ran"
    env = {k: v.format(marker=marker) for k, v in TRICKY.items()}
    file = tmp_path / "exports"
    file.write_bytes(private_env.exports(env))
    file.chmod(0o600)
    dump = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"
    names = " ".join([*env, "HOROVOD_RANK"])
    command = private_env.receiving(f"env HOROVOD_RANK=3 python3 -c {shlex.quote(dump)} {names}")
    out = subprocess.run(
        private_env.from_file(str(file), command), shell=True, capture_output=True, text=True,
        timeout=30, env={"PATH": os.environ["PATH"], "PLAIN": "the rank's own, overridden"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {**env, "HOROVOD_RANK": "3"}
    assert not marker.exists()  # no value was run as a command
    assert not file.exists()  # removed before the rank started
    assert "value" not in command and str(marker) not in command  # names and values stay off


def test_the_rank_reads_stdin_to_its_end_and_then_has_none(tmp_path):
    file = tmp_path / "exports"
    file.write_bytes(private_env.exports({"X": "1"}))
    command = private_env.receiving(
        "env python3 -c " + shlex.quote("import sys; print(repr(sys.stdin.read()))")
    )
    out = subprocess.run(private_env.from_file(str(file), command), shell=True,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "''", out


DUMP = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"


def bash_as_sh(tmp_path) -> str:
    """A directory whose ``sh`` is bash, as /bin/sh is on RHEL, Rocky and SUSE: bash, invoked
    as sh, runs in POSIX mode, where a failed assignment ends the shell."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "sh").symlink_to(bash)
    return str(directory)


def test_where_sh_is_bash_its_read_only_variables_do_not_stop_the_rank(tmp_path):
    """Issue 49, item 13: a user's exported UID (EUID, SHELLOPTS, BASHOPTS), read-only in
    bash, ended the rank's shell (`UID: readonly variable`) before the rank started. The rank's
    start command runs here under bash as sh, its environment fresh as a remote shell's."""
    bin_dir = bash_as_sh(tmp_path)
    env = {"UID": "4321", "EUID": "4321", "SHELLOPTS": "braceexpand:hashall", "BASHOPTS": "x",
           "PLAIN": "reached the rank"}  # fmt: skip
    file = tmp_path / "exports"
    file.write_bytes(private_env.exports(env))
    names = " ".join(env)
    command = private_env.receiving(f"env HOROVOD_RANK=0 python3 -c {shlex.quote(DUMP)} {names}")
    out = subprocess.run(
        [f"{bin_dir}/sh", "-c", private_env.from_file(str(file), command)], capture_output=True,
        text=True, timeout=30, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["PLAIN"] == "reached the rank"  # and the exports after UID's were made too
    assert got["UID"] in (str(os.getuid()), None)  # the shell's own (its user's), not 4321
    assert "readonly" not in out.stderr


@pytest.mark.parametrize("transport", ["stdin dropped", "stdin cut short"])
def test_a_rank_whose_exports_did_not_all_arrive_is_not_started(tmp_path, transport):
    """Issue 49, item 14: `kubectl exec` without -i, or `ssh -n`, gives the rank's shell an
    empty stdin; the rank ran without the user's environment. Now it is not started."""
    marker = tmp_path / "rank-ran"
    command = private_env.receiving(f"touch {shlex.quote(str(marker))}")
    exports = private_env.exports({"A": "1", "B": "two words"})
    given = b"" if transport == "stdin dropped" else exports[: exports.index(b"B=")]
    for shell in ["sh", f"{bash_as_sh(tmp_path)}/sh"]:
        out = subprocess.run([shell, "-c", command], input=given, capture_output=True,
                             timeout=30)  # fmt: skip
        assert out.returncode == 1 and not marker.exists(), out
        assert out.stderr.decode().startswith(
            "hvdkit: rank not started: its environment did not arrive on its stdin on host "
        )
        assert "kubectl exec -i" in out.stderr.decode()
    whole = subprocess.run(["sh", "-c", command], input=exports, capture_output=True, timeout=30)
    assert whole.returncode == 0 and marker.exists(), whole


def test_a_value_that_is_not_utf8_reaches_the_rank_as_its_bytes(tmp_path):
    """Issue 49, item 15: Python holds such a value with surrogate escapes; writing the exports
    raised UnicodeEncodeError in every rank start."""
    value = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    file = tmp_path / "exports"
    file.write_bytes(private_env.exports({"RAW": value}))
    show = "import os; print(os.environb[b'RAW'].hex())"
    command = private_env.receiving(f"python3 -c {shlex.quote(show)}")
    out = subprocess.run(private_env.from_file(str(file), command), shell=True,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == b"caf\xe9 \xff".hex(), out


@pytest.mark.parametrize(
    "name", ["node1", "gpu-a01.cluster", "10.0.0.7", "fe80::1", "host_2", "a" * 253]
)
def test_host_names_and_addresses_are_accepted(name):
    assert check_host(name, "hostfile:1") == name and is_inert(name)


@pytest.mark.parametrize(
    "name",
    ["$(id)", "a;b", "a b", "-oProxyCommand=x", "", "né", "a`b`", "fe80::1%eth0", "::1;x",
     "a" * 254, "host\n", "a|b", "a&", "~root", "[::1]"],
)  # fmt: skip
def test_anything_else_is_refused_naming_where_it_came_from(name):
    with pytest.raises(BadInputError, match=r"^PBS_NODEFILE:3: bad host name .*Fix: correct"):
        check_host(name, "PBS_NODEFILE:3")


def test_interfaces_and_ports():
    assert check_interfaces("eth0,ib0") == "eth0,ib0" and check_interfaces("enp0s3.100:1")
    for bad in ["eth0;id", "", "eth0,", "-x", "a b", "$(id)"]:
        with pytest.raises(BadInputError, match="--network-interface .*not interface names"):
            check_interfaces(bad)
    assert check_port("22", "--ssh-port") == 22 and check_port(65535, "x") == 65535
    for bad in ["0", "65536", "-1", "22;id", "", "２２", "1e3"]:
        with pytest.raises(BadInputError, match="--ssh-port .*not a TCP port. Fix"):
            check_port(bad, "--ssh-port")
