"""Fuzzing the launch parsers (issue 39): hostfiles, ``-H``, Slurm node lists and task counts,
PBS and LSF, an MPIJob's hostfile and a discovery script's output, with Hypothesis.

On any input a parser returns hosts that make a valid plan, or raises its own error (a
ValueError subclass) whose message names where the input came from; never another exception,
a hang or a huge allocation, and never a host name a shell would read specially. Each test
mixes fully random text (control characters, any code point, shell metacharacters) with
near-valid input (real-looking names, counts and brackets with junk spliced in), so both the
refusals and the accepted plans are exercised, and prints how many inputs it tried.

Each run draws 1,000 inputs a parser with a seed of its own (Hypothesis's default), so every
CI tries other ones; ``HVDKIT_FUZZ_EXAMPLES=20000`` runs longer. A failure prints the
falsifying input and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdkit.launch.allocation import (
    MAX_HOSTS,
    Allocation,
    AllocationError,
    detect,
    expand_counts,
    expand_nodelist,
    lsf,
    mpijob,
    pbs,
    slurm,
)
from hvdkit.launch.elastic import ElasticError, parse_discovery_output
from hvdkit.launch.hostfile import (
    MAX_SLOTS,
    Host,
    HostfileError,
    parse_hostfile_text,
    parse_hosts_arg,
)
from hvdkit.launch.names import (
    BadInputError,
    check_host,
    check_interfaces,
    check_port,
    is_inert,
)
from hvdkit.launch.plan import LaunchConfig, LaunchError, build_plan

pytestmark = pytest.mark.timeout(600)

EXAMPLES = int(os.environ.get("HVDKIT_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the checkout; a failure prints its blob instead
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
COMMAND = ("python", "t.py")
PLAN_NP = 20_000  # processes planned at most per input: bigger allocations plan a prefix

TALLY: dict[str, Counter[str]] = {}

# -- strategies ---------------------------------------------------------------------------------

META = ";|&$()`<>'\"\\ \n*?[]{}~#!%"
ODD = "\t\r\x00\x1b\x7f\x85\xa0\u2028\u0661\xb2\xe9\xdf\uff10"  # controls, unicode digits, ...
SYNTAX = ",:=.-_x"
junk_char = st.one_of(st.sampled_from(list(META + ODD + SYNTAX)), st.characters())
junk = st.text(junk_char, min_size=1, max_size=3)
any_text = st.text(max_size=60)  # every code point but surrogates, controls included
meta_text = st.text(
    st.sampled_from(list(META + ODD + SYNTAX + "abn01239[]()")), max_size=40
)  # mostly the characters the formats give meaning to


@st.composite
def spliced(draw, base: st.SearchStrategy[str]) -> str:
    """``base``'s text with up to 3 insertions, deletions or replacements of junk (none: the
    near-valid input stays valid, so accepted plans are exercised too)."""
    text = draw(base)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        piece = draw(junk)
        how = draw(st.sampled_from(["insert", "delete", "replace"]))
        if how == "insert":
            text = text[:at] + piece + text[at:]
        elif how == "delete":
            text = text[:at] + text[at + len(piece) :]
        else:
            text = text[:at] + piece + text[at + len(piece) :]
    return text


def fuzzed(valid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Random text, or ``valid``'s text as is or spliced (the near-valid half weighs more)."""
    return st.one_of(any_text, meta_text, valid, spliced(valid), spliced(valid))


hostname = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z0-9]{1,6}){0,2}", fullmatch=True)
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
odd_name = st.sampled_from(
    ["localhost", "a", "node01", "-oProxyCommand=id", "x" * 254, "fe80::1%eth0", "::", "."]
)
host = st.one_of(hostname, hostname, st.sampled_from(["a", "b", "c"]), ipv4, ipv6, odd_name)
long_digits = st.integers(4290, 4400).map(lambda n: "9" * n)  # past int()'s 4300 digits
count = st.one_of(
    st.integers(1, 8).map(str),
    st.integers(1, 8).map(str),
    st.integers(1, 8).map(str),
    st.integers(0, 10**30).map(str),
    st.sampled_from(["0", "-1", "01", "+2", " 2", "1e3", "", "\xb2", "\u0661", "\uff13"]),
    long_digits,
)
comment = st.sampled_from(["", "", "  # note", "#", " #$(id)"])

good_count = st.integers(1, 8).map(str)
hostfile_line = st.one_of(
    st.builds(lambda h, c: f"{h} slots={c}", hostname, good_count),
    st.builds(lambda h, c: f"{h}:{c}", hostname, good_count),
    st.builds(lambda h, c: f"{h} slots={c} max_slots=8", ipv4, good_count),
    st.builds(lambda h, c, k: f"{h} slots={c}{k}", host, count, comment),
    st.builds(lambda h, c, k: f"{h}:{c}{k}", host, count, comment),
    st.builds(lambda h, k: f"{h}{k}", host, comment),
    st.builds(lambda h, c, m: f"{h} slots={c} max_slots={m}", host, count, count),
    st.builds(lambda h, c: f"[{h}]:{c}", ipv6, count),
    st.sampled_from(["# comment", "", "   "]),
)
hostfile_text = st.lists(hostfile_line, max_size=8).map("\n".join)
hosts_arg = st.lists(
    st.one_of(
        hostname,
        st.builds(lambda h, c: f"{h}:{c}", hostname, good_count),
        host,
        st.builds(lambda h, c: f"{h}:{c}", host, count),
        st.builds(lambda h, c: f"[{h}]:{c}", ipv6, count),
    ),
    min_size=1,
    max_size=6,
).map(",".join)
slots_per_host = st.one_of(st.none(), st.integers(1, 16), st.integers(-2, 0), st.integers())

# Slurm: a compressed node list, and task counts that agree with it (before the junk).
range_low = st.one_of(st.integers(0, 120), st.integers(0, 10**12))
range_span = st.one_of(
    st.integers(0, 4),
    st.integers(0, 4),
    st.integers(0, 4),
    st.integers(0, 4),
    st.integers(-3, -1),  # reversed
    st.integers(10**4, 10**5),  # thousands of hosts: under or just over the cap
    st.integers(10**9, 10**12),  # a typo's billions: refused before anything is listed
)


@st.composite
def slurm_range(draw) -> tuple[str, int]:
    """``01-04`` (zero padded or not) and how many names it gives."""
    low = draw(range_low)
    span = draw(range_span)
    width = draw(st.integers(0, 4))
    if span == 0 and draw(st.booleans()):
        return str(low).zfill(width), 1
    high = max(low + span, 0)
    return f"{str(low).zfill(width)}-{str(high).zfill(width)}", max(high - low + 1, 0)


@st.composite
def slurm_item(draw) -> tuple[str, int]:
    """``gpu-a``, ``node[01-04,07]`` or ``r[1-2]-n[1-2]``, and how many names it gives."""
    text, size = draw(hostname), 1
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        ranges = draw(st.lists(slurm_range(), min_size=1, max_size=3))
        text += "[" + ",".join(r for r, _ in ranges) + "]" + draw(st.sampled_from(["", "-n"]))
        size *= sum(n for _, n in ranges)
    return text, size


def compressed(counts: list[tuple[int, int]]) -> str:
    """``4(x2),2`` from [(4, 2), (2, 1)]."""
    return ",".join(f"{c}(x{k})" if k > 1 else str(c) for c, k in counts if k > 0)


task = st.one_of(st.integers(1, 8), st.integers(1, 10**6))


@st.composite
def slurm_env(draw) -> dict[str, str]:
    items = draw(st.lists(slurm_item(), min_size=1, max_size=4))
    nodes = sum(n for _, n in items)
    nodelist = ",".join(text for text, _ in items)
    split = draw(st.integers(0, min(nodes, 10**7)))
    runs = [(draw(task), split), (draw(task), nodes - split)]
    if draw(st.integers(0, 4)) == 0:
        runs[0] = (runs[0][0], runs[0][1] + draw(st.integers(-2, 2)))  # disagrees
    counts = compressed(runs) or "1"
    ntasks = str(sum(c * k for c, k in runs))
    valid = {
        draw(st.sampled_from(["SLURM_JOB_NODELIST", "SLURM_NODELIST"])): nodelist,
        draw(st.sampled_from(["SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"])): counts,
        draw(st.sampled_from(["SLURM_NTASKS", "SLURM_NPROCS"])): ntasks,
        "SLURM_CPUS_PER_TASK": draw(st.sampled_from(["1", "2", "4"])),
        "SLURM_GPUS_ON_NODE": draw(st.sampled_from(["4", "a100:2", "0"])),
        "SLURM_JOB_ID": "4242",
    }
    env = {}
    whole = draw(st.integers(0, 2)) == 0  # a third as Slurm sets them, the rest fuzzed
    for name, value in valid.items():
        choice = 0 if whole else draw(st.integers(0, 9))
        if choice < 5:
            env[name] = value
        elif choice < 7:
            env[name] = draw(spliced(st.just(value)))
        elif choice < 9:
            env[name] = draw(st.one_of(any_text, meta_text, count))
    # The other variables, sometimes set too (SLURM_NODELIST beside SLURM_JOB_NODELIST...).
    for name in ("SLURM_NODELIST", "SLURM_JOB_CPUS_PER_NODE", "SLURM_NPROCS"):
        if name not in env and draw(st.integers(0, 5)) == 0:
            env[name] = draw(fuzzed(st.just(nodelist if "NODE" in name else counts)))
    return env


per_slot_text = st.lists(
    st.one_of(host, st.sampled_from(["a", "b", "cn01.cluster"]), comment), max_size=10
).map("\n".join)
mcpu_hosts = st.lists(st.tuples(host, count), min_size=1, max_size=5).map(
    lambda pairs: " ".join(f"{h} {c}" for h, c in pairs)
)
path = st.one_of(
    st.sampled_from(["/var/spool/pbs/aux/77.pbs", "/tmp/lsf.hosts", "/etc/mpi/hostfile"]),
    meta_text.filter(bool),
)


@st.composite
def files(draw, text: st.SearchStrategy[str]) -> tuple[Callable[[str], str], bool]:
    """A ``read`` callable giving ``text`` (or failing as an unreadable file does), and what
    ``exists`` answers."""
    content = draw(text)
    fails = draw(st.integers(0, 9)) == 0

    def read(_path: str) -> str:
        if fails:
            raise PermissionError(13, "Permission denied")
        return content

    return read, draw(st.sampled_from([True, True, True, False]))


# -- the properties -----------------------------------------------------------------------------


def attempt(label: str, call: Callable[[], object], errors: tuple[type, ...], places):
    """``call()``'s result, or None when it raised one of ``errors`` with a message that says
    where the input came from (one of ``places``). Any other exception fails the test."""
    tally = TALLY[label]
    tally["calls"] += 1
    try:
        result = call()
    except errors as exc:
        tally["refused"] += 1
        message = str(exc)
        assert message.strip(), f"{type(exc).__name__} with an empty message"
        assert any(place in message for place in places), (
            f"the message does not say where the input came from ({places}): {message!r}"
        )
        assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__), (
            f"raised while handling {exc.__context__!r}: a wrapped error, not the parser's own"
        )
        if f"lists more than {MAX_HOSTS}" in message:
            tally["capped"] += 1  # a huge range or repeat count, refused before it is listed
        return None
    tally["accepted" if result is not None else "no allocation"] += 1
    return result


def check_hosts(
    label: str, hosts, *, empty: bool = False, unique: bool = True, plan: bool = True
) -> None:
    """Every accepted host is inert in a shell, has a positive whole number of slots, is listed
    once, and the hosts make a plan whose argv carries nothing a shell reads specially."""
    assert isinstance(hosts, list | tuple), hosts
    assert hosts or empty, "accepted, but no hosts"
    for h in hosts:
        assert isinstance(h, Host), h
        assert isinstance(h.name, str) and is_inert(h.name), f"accepted host name {h.name!r}"
        assert check_host(h.name, "fuzz") == h.name
        # Bounded too: build_plan lists every rank, so host:99999999999 would never finish.
        assert type(h.slots) is int and 1 <= h.slots <= MAX_SLOTS, f"{h.name}: {h.slots!r}"
        assert h.max_slots is None or (type(h.max_slots) is int and h.max_slots >= h.slots)
    names = [h.name for h in hosts]
    if unique:
        assert len(set(names)) == len(names), f"a host listed twice: {names[:20]}"
    if plan and hosts:
        check_plan(label, list(hosts))


def check_plan(label: str, hosts: list[Host]) -> None:
    total = sum(h.slots for h in hosts)
    np = None if total <= PLAN_NP else PLAN_NP
    wanted = total if np is None else np
    used, left = [], wanted
    for h in hosts:
        if left > 0:
            used.append((h, min(h.slots, left)))
            left -= min(h.slots, left)
    config = LaunchConfig(command=COMMAND, controller="gloo", np=np)
    try:
        plan = build_plan(config, hosts, available=("gloo",), environ={})
    except LaunchError as exc:
        ipv6 = [h for h, _ in used if h.is_ipv6]
        assert ipv6, f"plan refused: {exc}"
        assert "IPv6" in str(exc) and str(exc).startswith(ipv6[0].source), str(exc)
        TALLY[label]["plan refused"] += 1
        return
    assert not any(h.is_ipv6 for h, _ in used), "an IPv6 literal reached horovodrun's -H"
    TALLY[label]["planned"] += 1
    argv = plan.argv
    assert tuple(argv[-len(COMMAND) :]) == COMMAND
    listed = argv[argv.index("-H") + 1]
    assert listed.split(",") == [f"{h.name}:{n}" for h, n in used]
    for word in argv[: -len(COMMAND)]:
        if word != listed:
            assert is_inert(word), f"argv word {word!r}"
    assert all(is_inert(item) for item in listed.split(",")), listed
    assert len(plan.ranks) == wanted


def run_fuzz(label: str, fuzz: Callable[[], None], capsys, reach: tuple[str, ...] = ()) -> None:
    """Run one Hypothesis test, print how many inputs it tried, and check that it reached
    both the refusals and the accepted plans."""
    TALLY[label] = Counter()
    start = time.perf_counter()
    fuzz()
    took = time.perf_counter() - start
    t = TALLY[label]
    extra = "".join(
        f", {t[k]} {k}" for k in ("no allocation", "planned", "plan refused", "capped") if t[k]
    )
    with capsys.disabled():
        print(
            f"\n[fuzz] {label}: {t['inputs']} inputs ({t['calls']} parser calls): "
            f"{t['refused']} refused with a clear error, {t['accepted']} accepted{extra} "
            f"({took:.1f} s)"
        )
    assert t["inputs"] >= EXAMPLES // 2
    for path in ("refused", "accepted", *reach):
        assert t[path], f"{label}: no input was {path}: {dict(t)}"


# -- the tests ----------------------------------------------------------------------------------


def test_hostfile_text(capsys):
    @FUZZ
    @given(text=fuzzed(hostfile_text), per_host=slots_per_host)
    def fuzz(text, per_host):
        TALLY["hostfile"]["inputs"] += 1
        hosts = attempt(
            "hostfile",
            lambda: parse_hostfile_text(text, "<fuzz-hostfile>", per_host),
            (HostfileError,),
            ("<fuzz-hostfile>", "--slots-per-host"),
        )
        if hosts is not None:
            check_hosts("hostfile", hosts)

    run_fuzz("hostfile", fuzz, capsys)


def test_hosts_arg(capsys):
    @FUZZ
    @given(text=fuzzed(hosts_arg), per_host=slots_per_host)
    def fuzz(text, per_host):
        TALLY["-H"]["inputs"] += 1
        hosts = attempt(
            "-H",
            lambda: parse_hosts_arg(text, per_host),
            (HostfileError,),
            ("-H", "--slots-per-host"),
        )
        if hosts is not None:
            check_hosts("-H", hosts)

    run_fuzz("-H", fuzz, capsys)


def test_slurm_node_lists_and_task_counts(capsys):
    @FUZZ
    @given(env=slurm_env(), nodelist=fuzzed(slurm_item().map(lambda i: i[0])), counts=count)
    def fuzz(env, nodelist, counts):
        TALLY["slurm"]["inputs"] += 1
        names = attempt("slurm", lambda: expand_nodelist(nodelist), (AllocationError,), ("SLURM_",))
        if names is not None:
            assert 0 < len(names) <= MAX_HOSTS and all(is_inert(n) for n in names), names[:5]
        numbers = attempt("slurm", lambda: expand_counts(counts), (AllocationError,), ("SLURM_",))
        if numbers is not None:
            assert 0 < len(numbers) <= MAX_HOSTS
            assert all(type(n) is int and 1 <= n <= MAX_SLOTS for n in numbers)
        allocation = attempt("slurm", lambda: slurm(env), (AllocationError,), ("SLURM_",))
        if allocation is not None:
            check_allocation("slurm", allocation)

    run_fuzz("slurm", fuzz, capsys, reach=("capped", "planned"))


def check_allocation(label: str, allocation: Allocation) -> None:
    assert isinstance(allocation, Allocation)
    check_hosts(label, allocation.hosts)
    assert allocation.slots == sum(h.slots for h in allocation.hosts)
    assert allocation.describe()
    gpus = allocation.gpus_per_node
    assert gpus is None or (type(gpus) is int and gpus >= 0)


def test_pbs_nodefile(capsys):
    @FUZZ
    @given(nodefile=path, job=any_text, io=files(fuzzed(per_slot_text)))
    def fuzz(nodefile, job, io):
        TALLY["pbs"]["inputs"] += 1
        read, _ = io
        env = {"PBS_NODEFILE": nodefile, "PBS_JOBID": job}
        allocation = attempt(
            "pbs", lambda: pbs(env, read), (AllocationError,), (nodefile, "PBS_NODEFILE")
        )
        if allocation is not None:
            check_allocation("pbs", allocation)

    run_fuzz("pbs", fuzz, capsys)


def test_lsf_hostfile_and_mcpu_hosts(capsys):
    @FUZZ
    @given(
        hostfile=st.one_of(st.none(), path),
        mcpu=fuzzed(mcpu_hosts),
        io=files(fuzzed(per_slot_text)),
    )
    def fuzz(hostfile, mcpu, io):
        TALLY["lsf"]["inputs"] += 1
        read, _ = io
        env = {"LSB_MCPU_HOSTS": mcpu, "LSB_JOBID": "9"}
        if hostfile is not None:
            env["LSB_DJOB_HOSTFILE"] = hostfile
        places = ("LSB_MCPU_HOSTS", "LSB_DJOB_HOSTFILE") + ((hostfile,) if hostfile else ())
        allocation = attempt("lsf", lambda: lsf(env, read), (AllocationError,), places)
        if allocation is not None:
            check_allocation("lsf", allocation)

    run_fuzz("lsf", fuzz, capsys)


def test_mpijob_hostfile(capsys):
    @FUZZ
    @given(hostfile=st.one_of(st.none(), path), io=files(fuzzed(hostfile_text)))
    def fuzz(hostfile, io):
        TALLY["mpijob"]["inputs"] += 1
        read, exists = io
        env = {} if hostfile is None else {"OMPI_MCA_orte_default_hostfile": hostfile}
        where = hostfile or "/etc/mpi/hostfile"
        allocation = attempt(
            "mpijob", lambda: mpijob(env, read, lambda _: exists), (HostfileError,), (where,)
        )
        if allocation is not None:
            check_allocation("mpijob", allocation)

    run_fuzz("mpijob", fuzz, capsys)


SCHEDULER_VARIABLES = (
    "SLURM_JOB_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS",
    "PBS_NODEFILE",
    "LSB_DJOB_HOSTFILE",
    "LSB_MCPU_HOSTS",
    "OMPI_MCA_orte_default_hostfile",
)
FILE_VARIABLES = ("PBS_NODEFILE", "LSB_DJOB_HOSTFILE", "OMPI_MCA_orte_default_hostfile")


def test_detect_on_mixed_environments(capsys):
    """Every scheduler's variables at once, as a copied environment may have them."""

    @FUZZ
    @given(
        env=st.dictionaries(
            st.sampled_from(SCHEDULER_VARIABLES),
            st.one_of(meta_text, count, hosts_arg, mcpu_hosts, path),
        ),
        io=files(fuzzed(st.one_of(per_slot_text, hostfile_text))),
    )
    def fuzz(env, io):
        TALLY["detect"]["inputs"] += 1
        read, exists = io
        files_named = [v for k, v in env.items() if k in FILE_VARIABLES]
        allocation = attempt(
            "detect",
            lambda: detect(env, read, lambda _: exists),
            (HostfileError,),  # AllocationError, or an MPIJob hostfile's HostfileError
            ("SLURM_", "LSB_", "PBS_NODEFILE", "/etc/mpi/hostfile", *files_named),
        )
        if allocation is not None:
            check_allocation("detect", allocation)

    run_fuzz("detect", fuzz, capsys)


def test_discovery_output(capsys):
    discovery_lines = st.lists(
        st.one_of(
            host,
            st.builds(lambda h, c: f"{h}:{c}", host, count),
            st.sampled_from(["", "  ", "a slots=2"]),
        ),
        max_size=8,
    ).map("\n".join)

    @FUZZ
    @given(text=fuzzed(discovery_lines), default=slots_per_host)
    def fuzz(text, default):
        TALLY["discovery"]["inputs"] += 1
        hosts = attempt(
            "discovery",
            lambda: parse_discovery_output(text, "script", default),
            (ElasticError,),
            ("script: output line", "--slots-per-host"),
        )
        if hosts is not None:
            assert not any(h.is_ipv6 for h in hosts)
            # Horovod's discovery keeps the last line of a host printed twice: not refused.
            check_hosts("discovery", hosts, empty=True, unique=False, plan=False)
            check_hosts("discovery", list({h.name: h for h in hosts}.values()), empty=True)

    run_fuzz("discovery", fuzz, capsys)


def test_names_port_interfaces_and_hosts(capsys):
    @FUZZ
    @given(
        text=fuzzed(st.one_of(host, st.just("eth0,ib0"), st.integers(0, 70000).map(str))),
        number=st.one_of(st.integers(), st.integers(-1, 70000), long_digits),
    )
    def fuzz(text, number):
        TALLY["names"]["inputs"] += 1
        for value in (text, number):
            port = attempt(
                "names", lambda v=value: check_port(v, "--ssh-port"), (BadInputError,),
                ("--ssh-port",),
            )  # fmt: skip
            if port is not None:
                assert type(port) is int and 1 <= port <= 65535 and is_inert(str(port))
        name = attempt(
            "names", lambda: check_host(text, "-H item 1"), (BadInputError,), ("-H item 1",)
        )
        if name is not None:
            assert name == text and is_inert(name)
        nics = attempt(
            "names",
            lambda: check_interfaces(text),
            (BadInputError,),
            ("--network-interface",),
        )
        if nics is not None:
            assert nics == text and all(is_inert(n) and n for n in nics.split(","))

    run_fuzz("names", fuzz, capsys)
