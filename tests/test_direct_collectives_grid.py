"""Every collective of the framework APIs, hvdkit.torch and hvdkit.tensorflow, x form x dtype x
op x shape, against numpy (issue 49): one 2-rank job per API runs its whole seeded grid
(tests/workers/torch_collectives_grid_worker.py and tf_collectives_grid_worker.py, which say
what each case expects; the grid itself is tests/collectives_grid.py). Also the 0-d refusals
that the grid found to be needed (a crash or an obscure error in Horovod), without processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import collectives_grid as grid
import pytest
from conftest import ROOT, horovodrun, results
from workers import tf_collectives_grid_worker as tf_worker
from workers import torch_collectives_grid_worker as torch_worker

WORKERS = {"torch": torch_worker, "tensorflow": tf_worker}


def np_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_each_grid_has_every_form_dtype_op_and_tensor_shape():
    per_form = {api: sum(len(grid.COLLECTIVES[c]) for c in w.FORMS.values())
                for api, w in WORKERS.items()}  # fmt: skip
    # torch: allreduce's five ops in four forms, reducescatter's two in two, allgather in two,
    # broadcast in two, alltoall; TensorFlow: allreduce's in three, reducescatter's in two,
    # allgather and broadcast in three each, alltoall.
    assert per_form == {"torch": 20 + 4 + 2 + 2 + 1, "tensorflow": 15 + 4 + 3 + 3 + 1}
    for api, worker in WORKERS.items():
        cases = worker.cases()
        assert len(cases) == per_form[api] * len(grid.DTYPES) * len(grid.TENSOR_SHAPES)
        assert len({case.name for case in cases}) == len(cases)
    assert len(torch_worker.cases()) == 1392 and len(tf_worker.cases()) == 1248


def test_a_grouped_case_draws_a_second_tensor_of_its_own():
    case = grid.Case("allgather", "int64", None, "small", "grouped_allgather")
    first, second = grid.plan(grid.SEED, case), grid.plan(grid.SEED, case, part=1)
    assert not any(np_equal(a, b) for a, b in zip(first.inputs, second.inputs, strict=True))
    again = grid.plan(grid.SEED, case, part=1)
    assert all(np_equal(a, b) for a, b in zip(second.inputs, again.inputs, strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("api", ["torch", "tensorflow"])
def test_every_collective_form_dtype_op_and_shape_matches_numpy(api, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")  # hvdkit.tensorflow's; torch's ignores it
    script = f"{'tf' if api == 'tensorflow' else 'torch'}_collectives_grid_worker.py"
    r = results(horovodrun(script, "--seed", str(grid.SEED), timeout=180))
    assert sorted(r) == [0, 1] and r[0]["api"] == api
    for rank in (0, 1):
        assert r[rank]["cases"] == len(WORKERS[api].cases())
        failures = r[rank]["failures"]
        shown = "\n".join(f"{f['case']}: {f['why']}\n  rerun: {f['repro']}" for f in failures)
        assert not failures, f"rank {rank}: {len(failures)} of {r[rank]['cases']} failed:\n{shown}"


TORCH_0D = [
    ("allgather", "the tensor", lambda hvd, t: hvd.allgather(t)),
    ("allgather_async", "the tensor", lambda hvd, t: hvd.allgather_async(t, name="x")),
    ("grouped_allgather", "tensors[1]",
     lambda hvd, t: hvd.grouped_allgather(tensors=[t.reshape(1), t])),
    ("grouped_allgather_async", "tensors[0]", lambda hvd, t: hvd.grouped_allgather_async([t])),
    ("alltoall", "the tensor", lambda hvd, t: hvd.alltoall(tensor=t)),
    ("alltoall_async", "the tensor", lambda hvd, t: hvd.alltoall_async(t, splits=None)),
]  # fmt: skip


@pytest.mark.parametrize("op, which, call", TORCH_0D, ids=[c[0] for c in TORCH_0D])
def test_torch_refuses_a_0d_tensor_where_horovod_crashes_or_fails_obscurely(op, which, call):
    """Horovod's alltoall segfaults on one; its allgather raises IndexError, its async forms
    HorovodInternalError (which elastic training answers with a reset). Refused before
    Horovod is reached: no init needed."""
    import torch

    import hvdkit.torch as hvd

    with pytest.raises(ValueError, match=rf"hvd\.{op}: {re.escape(which)} is 0-d") as caught:
        call(hvd, torch.tensor(1.5, dtype=torch.float64))
    said = str(caught.value)
    assert "(a scalar of dtype float64)" in said and "Fix: give it one" in said


@pytest.mark.timeout(180)
def test_tensorflow_refuses_a_0d_tensor_eagerly_in_tf_function_and_as_a_keras_variable():
    """In a fresh process (hvdkit.tensorflow needs Keras on TensorFlow): the refusal of each
    op, with keywords, a Keras variable, and while tracing; a tensor of unknown rank is left
    to Horovod."""
    script = textwrap.dedent("""
        import keras, tensorflow as tf
        import hvdkit.tensorflow as hvd

        def refused(call, text):
            try:
                call()
            except ValueError as exc:
                assert text in str(exc) and "Fix: give it" in str(exc), str(exc)
            else:
                raise AssertionError(f"not refused: {text}")

        x = tf.constant(2, tf.int64)
        refused(lambda: hvd.allgather(x),
                "hvd.allgather: the tensor is 0-d (a scalar of dtype int64)")
        refused(lambda: hvd.alltoall(tensor=x), "hvd.alltoall: the tensor is 0-d")
        refused(lambda: hvd.grouped_allgather(tensors=[tf.ones([1]), keras.Variable(1.0)]),
                "hvd.grouped_allgather: tensors[1] is 0-d (a scalar of dtype float32)")
        refused(lambda: tf.function(lambda t: hvd.alltoall(t))(x), "hvd.alltoall: the tensor")
        unknown = tf.function(lambda t: hvd.allgather(t),
                              input_signature=[tf.TensorSpec(None, tf.float32)])
        unknown.get_concrete_function()  # traced: the rank is unknown, Horovod's op decides
        print("OK")
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT,
                         env={**os.environ, "KERAS_BACKEND": "tensorflow",
                              "TF_CPP_MIN_LOG_LEVEL": "3"})  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
