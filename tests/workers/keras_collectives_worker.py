"""Run under horovodrun by tests/test_keras_collectives.py (KERAS_BACKEND set by the test):
Horovod's Keras collectives on the active backend, each checked against the value by hand."""

from __future__ import annotations

import json
import sys

import keras
import numpy as np

import hvdkit.keras as hvd


def arr(value) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def main() -> None:
    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first])
    me, n = hvd.rank(), hvd.size()
    checks = {}
    x = np.arange(4, dtype="float32") + 10 * me  # rank 0: 0..3, rank 1: 10..13
    total = sum(np.arange(4, dtype="float32") + 10 * r for r in range(n))
    checks["allreduce_average"] = np.allclose(arr(hvd.allreduce(x)), total / n)
    checks["allreduce_sum"] = np.allclose(arr(hvd.allreduce(x, average=False)), total)
    checks["allreduce_op_scale"] = np.allclose(
        arr(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)), total
    )
    checks["allreduce_number"] = float(arr(hvd.allreduce(float(me + 1), op=hvd.Sum))) == 3.0
    gathered = arr(hvd.allgather(np.full((me + 1, 2), me, dtype="float32")))  # uneven rows
    checks["allgather"] = gathered.shape == (3, 2) and (gathered[0] == 0).all() and (gathered[1:] == 1).all()
    checks["broadcast"] = np.allclose(arr(hvd.broadcast(x, root_rank=1)), np.arange(4) + 10)
    checks["reducescatter"] = np.allclose(
        arr(hvd.reducescatter(x, op=hvd.Sum)), np.array_split(total, n)[me]
    )
    received, splits = hvd.alltoall(np.array([me, me, me], dtype="float32"),
                                    splits=np.array([1, 2] if me == 0 else [2, 1], dtype="int32"))  # fmt: skip
    # rank 0 gets 1 row from itself and 2 from rank 1; rank 1 gets 2 from rank 0, 1 from itself
    expected = [0.0, 1.0, 1.0] if me == 0 else [0.0, 0.0, 1.0]
    checks["alltoall"] = arr(received).tolist() == expected and arr(splits).tolist() == ([1, 2] if me == 0 else [2, 1])
    if me == 0:
        checks["process_set"] = float(arr(hvd.allreduce(np.array([5.0], "float32"), op=hvd.Sum, process_set=first))[0]) == 5.0
    else:
        checks["process_set"] = not first.included()
    # A dynamic set ({1}, needs HOROVOD_DYNAMIC_PROCESS_SETS=1): added, used, removed; global
    # ops go on afterwards.
    late = hvd.add_process_set([1])
    if late.included():
        checks["dynamic_set"] = float(arr(hvd.allreduce(np.array([7.0], "float32"), op=hvd.Sum, process_set=late))[0]) == 7.0
    else:
        checks["dynamic_set"] = late.size() == 1 and me == 0
    hvd.remove_process_set(late)
    checks["dynamic_set_removed"] = late.process_set_id is None and float(
        arr(hvd.allreduce(np.array([1.0], "float32"), op=hvd.Sum, name="after.remove"))[0]
    ) == float(n)
    checks["queries"] = hvd.is_initialized() and hvd.cross_size() == 1 and hvd.gloo_built()
    hvd.start_timeline(sys.argv[1] + f".{me}")
    hvd.allreduce(x, name="timed")
    hvd.stop_timeline()
    hvd.allreduce(np.zeros(1, "float32"), name="barrier")  # keep every rank in until here
    print("RESULT " + json.dumps({"rank": me, "checks": {k: bool(v) for k, v in checks.items()},
                                  "backend": keras.config.backend()}), flush=True)  # fmt: skip
    hvd.shutdown()
    assert not hvd.is_initialized()


if __name__ == "__main__":
    main()
