"""hvdkit.run (Horovod's ``horovod.run``) with real processes: a function, its closure and its
arguments shipped to 2 ranks, their values back in rank order, the ranks equal to one process
on the global batch; a rank's exception raised in the caller naming the rank; an elastic
job's results; and nothing left running after any of it. Each case is a script that calls
hvdkit.run, as a user's would (its functions live in ``__main__``, pickled by value)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEP = '''
import json, sys
import hvdkit

def step(rows, lr, *, seed, hello):
    """One SGD step of a small model on this rank's rows of one global batch."""
    import torch
    import hvdkit.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)
    part = rows // hvd.size()
    mine = slice(hvd.rank() * part, (hvd.rank() + 1) * part)
    torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    optimizer.step()
    print(f"{hello} from rank {hvd.rank()}", flush=True)
    return {"rank": hvd.rank(), "size": hvd.size(),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()]}
'''


def script(tmp_path, body: str, name: str = "job.py", timeout: float = 300, **popen):
    """Run ``body`` (after the shared definitions) as a script, in a working directory of its
    own."""
    path = tmp_path / name
    path.write_text(STEP + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)  # fmt: skip


def record(out: subprocess.CompletedProcess) -> dict:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("OUT "))
    return json.loads(line[4:])


def leftover_ranks() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if "hvdkit.launch.func_task" in ln]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_two_ranks_return_in_rank_order_and_match_one_process(tmp_path, controller):
    out = script(tmp_path, f"""
        greeting = "hello"  # a closure's value travels with the function
        def job(rows, lr, seed):
            return step(rows, lr, seed=seed, hello=greeting)
        two = hvdkit.run(job, args=(8, 0.5), kwargs={{"seed": 3}}, num_proc=2,
                         use_{controller}=True)
        one = hvdkit.run(lambda: step(8, 0.5, seed=3, hello="alone"))
        print("OUT " + json.dumps({{"two": two, "one": one}}), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = record(out)
    two, (one,) = r["two"], r["one"]
    assert [x["rank"] for x in two] == [0, 1] and {x["size"] for x in two} == {2}
    assert two[0]["weights"] == two[1]["weights"]  # the ranks agree exactly
    assert one["size"] == 1
    for ours, plain in zip(two[0]["weights"], one["weights"], strict=True):
        assert ours == pytest.approx(plain, abs=1e-6)  # and with one process on the batch
    # Only rank 0's output is shown; rank 1's is kept for a failure's message.
    assert "hello from rank 0" in out.stdout and "hello from rank 1" not in out.stdout
    assert not leftover_ranks()


def test_a_rank_that_raises_is_named_with_its_traceback_and_the_next_call_works(tmp_path):
    out = script(tmp_path, """
        def shape_check(expected):
            import hvdkit.torch as hvd
            hvd.init()
            if hvd.rank() == 1:
                raise ValueError(f"rank 1 expected {expected}")
            return hvd.rank()
        try:
            hvdkit.run(shape_check, args=(7,), num_proc=2, use_gloo=True)
        except hvdkit.RankError as error:
            caught = {"rank": error.rank, "text": str(error), "cause": repr(error.__cause__),
                      "runtime": isinstance(error, RuntimeError)}
        again = hvdkit.run(lambda: step(4, 0.1, seed=0, hello="again"), num_proc=2,
                           use_gloo=True)
        print("OUT " + json.dumps({"caught": caught, "again": [a["rank"] for a in again]}),
              flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = record(out)
    caught = r["caught"]
    assert caught["rank"] == 1 and caught["runtime"]
    assert caught["text"].startswith("rank 1 (host localhost) raised ValueError: rank 1 expected 7")
    assert "in shape_check\n" in caught["text"] and "func_task" not in caught["text"]
    assert caught["cause"] == "ValueError('rank 1 expected 7')"
    assert r["again"] == [0, 1]
    assert not leftover_ranks()


def test_bad_arguments_and_a_function_that_cannot_travel_fail_before_any_rank(tmp_path):
    out = script(tmp_path, """
        import threading
        said = []
        for kwargs in ({"num_proc": 2, "hosts": "localhost:2", "hostfile": "x"},
                       {"num_proc": 2, "use_mpi": True, "min_num_proc": 1}):
            try:
                hvdkit.run(print, **kwargs)
            except ValueError as error:
                said.append(str(error))
        lock = threading.Lock()
        try:
            hvdkit.run(lambda: lock.acquire(), num_proc=2)
        except ValueError as error:
            said.append(str(error))
        print("OUT " + json.dumps(said), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    hosts, elastic_mpi, lock = record(out)
    assert hosts == "Argument hosts and hostfile only allow one provided."
    assert "Horovod's elastic mode runs on Gloo only" in elastic_mpi
    assert "cannot be pickled for the ranks" in lock and "lock" in lock


def test_a_return_value_that_cannot_travel_back_is_named(tmp_path):
    out = script(tmp_path, """
        def make_lock():
            import threading
            return threading.Lock()
        try:
            hvdkit.run(make_lock, num_proc=2, use_gloo=True)
        except hvdkit.RankError as error:
            print("OUT " + json.dumps(str(error).splitlines()[0]), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert record(out).startswith("rank 0 (host localhost) raised TypeError: the function "
                                  "returned a lock, which cannot be sent back")  # fmt: skip
    assert not leftover_ranks()


def test_a_function_from_the_users_own_module_is_imported_on_each_rank(tmp_path):
    """A function defined in a module beside the script (not ``__main__``) travels by
    reference, as pickle sends it: each rank imports the module itself from the caller's
    working directory (its import-time pid is the rank's own), and the values equal the
    function called in the caller."""
    (tmp_path / "mytraining.py").write_text(textwrap.dedent("""
        import os

        IMPORTED_IN = os.getpid()  # where this module was imported

        def score(n, *, scale):
            return {"rank": int(os.environ.get("HOROVOD_RANK", -1)), "pid": os.getpid(),
                    "imported_in": IMPORTED_IN, "value": scale * sum(i * i for i in range(n))}
    """))  # fmt: skip
    out = script(tmp_path, """
        from mytraining import score
        two = hvdkit.run(score, args=(5,), kwargs={"scale": 3}, num_proc=2, use_gloo=True)
        print("OUT " + json.dumps({"two": two, "here": score(5, scale=3)}), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = record(out)
    assert [v["rank"] for v in r["two"]] == [0, 1]
    for v in r["two"]:
        assert v["imported_in"] == v["pid"] != r["here"]["pid"], v  # imported on the rank
        assert v["value"] == r["here"]["value"] == 90
    assert not leftover_ranks()


def test_the_elastic_form_returns_the_first_min_num_proc_values(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    out = script(tmp_path, f"""
        def train(epochs):
            import torch
            import hvdkit.torch as hvd

            hvd.init()
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters())
            state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

            @hvd.elastic.run
            def loop(state):
                for state.epoch in range(state.epoch, epochs):
                    x = torch.full((2, 4), float(hvd.rank() + state.epoch))
                    optimizer.zero_grad()
                    model(x).sum().backward()
                    optimizer.step()
                    state.commit()
                return [p.detach().flatten().tolist() for p in model.parameters()]

            return {{"rank": hvd.rank(), "weights": loop(state)}}

        def plain(epochs):
            # The oracle: one process, no Horovod. The loss is linear in x, so the ranks'
            # averaged gradient is the gradient at their inputs' mean (0.5 + epoch).
            import torch

            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for epoch in range(epochs):
                optimizer.zero_grad()
                model(torch.full((2, 4), 0.5 + epoch)).sum().backward()
                optimizer.step()
            return [p.detach().flatten().tolist() for p in model.parameters()]

        values = hvdkit.run(train, args=(3,), num_proc=2, min_num_proc=2,
                            hostfile={str(hostfile)!r})
        print("OUT " + json.dumps({{"values": values, "plain": plain(3)}}), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = record(out)
    values = r["values"]
    assert [v["rank"] for v in values] == [0, 1]
    assert values[0]["weights"] == values[1]["weights"]
    for got, want in zip(values[0]["weights"], r["plain"], strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert not leftover_ranks()


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_caller_killed_unannounced_leaves_no_rank(tmp_path, controller):
    """A notebook's kernel restarted, or ``hvdkit run`` killed -9: horovodrun sees its launcher
    gone and stops the job (SIGINT to its group, as the launcher's Ctrl-C would)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / "caller.py"
    path.write_text(textwrap.dedent(f"""
        import hvdkit
        def wait_forever():
            import os, time
            from hvdkit import rank_zero
            open(os.path.join({str(marks)!r}, str(rank_zero.rank())), "w").close()
            time.sleep(600)
        hvdkit.run(wait_forever, num_proc=2, use_{controller}=True)
    """))  # fmt: skip
    caller = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2:  # both ranks are in the function
            assert caller.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        assert len(leftover_ranks()) >= 2
        caller.kill()
        caller.wait()
        gone = time.monotonic() + 30
        while leftover_ranks() and time.monotonic() < gone:
            time.sleep(0.5)
        assert not leftover_ranks()
    finally:
        caller.kill()


def test_the_hang_doctor_names_a_rank_with_one_batch_fewer(tmp_path):
    """Issue 52's doctor through hvdkit.run: rank 1 leaves its loop a batch early; after
    ``stall_timeout`` the report says so, ``on_stall="stop"`` ends the job, and the caller
    gets a RuntimeError that points at the report."""
    out = script(tmp_path, f"""
        import cloudpickle
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import engine_fns  # the engines' test uses the same function
        cloudpickle.register_pickle_by_value(engine_fns)  # the ranks start without tests/
        try:
            hvdkit.run(engine_fns.one_batch_fewer, args=(3,), num_proc=2, use_gloo=True,
                       stall_timeout=4, on_stall="stop")
        except RuntimeError as error:
            print("OUT " + json.dumps(str(error)), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the hang doctor stopped the job" in record(out)
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("hvdkit run: diagnosis: ")]
    assert "rank 1 left the training loop" in line and "different numbers of batches" in line
    assert not leftover_ranks()


def test_a_tensorflow_custom_loop_matches_one_process(tmp_path):
    """TensorFlow through hvdkit.run: a DistributedGradientTape step on 2 ranks, each on its
    half of one global batch, against one process on all of it."""
    out = script(tmp_path, """
        def tape_step(rows):
            import os
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            import numpy as np
            import tensorflow as tf
            import hvdkit.tensorflow as hvd

            hvd.init()
            tf.keras.utils.set_random_seed(0)
            w = tf.Variable(np.linspace(-1, 1, 12).reshape(4, 3).astype("float32"))
            rng = np.random.default_rng(1)
            x = rng.normal(size=(rows, 4)).astype("float32")
            y = rng.normal(size=(rows, 3)).astype("float32")
            part = rows // hvd.size()
            mine = slice(hvd.rank() * part, (hvd.rank() + 1) * part)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(x[mine] @ w - y[mine]))
            (grad,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
            w.assign_sub(0.5 * grad)
            return {"rank": hvd.rank(), "w": w.numpy().ravel().tolist()}

        two = hvdkit.run(tape_step, args=(8,), num_proc=2, use_gloo=True)
        one = hvdkit.run(tape_step, args=(8,))
        print("OUT " + json.dumps({"two": two, "one": one}), flush=True)
    """)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = record(out)
    assert [x["rank"] for x in r["two"]] == [0, 1]
    assert r["two"][0]["w"] == r["two"][1]["w"]
    assert r["two"][0]["w"] == pytest.approx(r["one"][0]["w"], abs=1e-6)
    start = [-1 + 2 * i / 11 for i in range(12)]  # the weights before the step: it moved them
    assert r["two"][0]["w"] != pytest.approx(start, abs=1e-3)
