"""A sharded optimizer state above 2 GiB, saved and resumed at another world size (issue 51):
one parameter of 285 M elements, zeros, under Adam (2.3 GB of state), its gradient all ones.

    python zero_large_worker.py save   CHECKPOINT   # one step, session.save() (any -np)
    python zero_large_worker.py resume CHECKPOINT   # setup() resumes it, then one more step

``resume`` prints, per rank, the state's bytes, what the resume held at its peak beyond what
the rank keeps once resumed and stepped, whether its slices are the saved state (Adam's moments after one
step of gradient 1: 0.1 and 0.001 everywhere), and the weight after the second step (the same
everywhere, which the test compares with Adam on a small tensor).
"""

from __future__ import annotations

import json
import sys

import torch

import hvdkit.torch as hvd

ELEMENTS = (1 << 28) + (1 << 22)


def status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    mode, checkpoint = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.zeros(ELEMENTS))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = torch.optim.Adam([weight], lr=1e-3)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak (VmHWM) from here: the resume's, not the model's making
    before = status("VmRSS")
    session = hvd.setup(model, optimizer, shard_optimizer=True, checkpoint=checkpoint,
                        lr_scaling="none")  # fmt: skip
    peak = status("VmHWM")
    sharded = session.optimizer
    state = [v for entry in sharded._hvdkit_inner.state.values() for k, v in entry.items()
             if k != "step"]  # fmt: skip
    entries = list(sharded._hvdkit_inner.state.values())
    slices = {
        "exp_avg": all(torch.allclose(e["exp_avg"], torch.tensor(0.1)) for e in entries),
        "exp_avg_sq": all(torch.allclose(e["exp_avg_sq"], torch.tensor(0.001)) for e in entries),
        "step": sorted({float(e["step"]) for e in entries}),
    }
    sharded.zero_grad()
    weight.sum().backward()  # the gradient: ones
    sharded.step()  # the loaded state is let go here (kept until then for an elastic commit)
    after = status("VmRSS")  # what the rank keeps: weights, gradients, its slices
    if mode == "save":
        session.save()
    out = {
        "rank": hvd.rank(), "size": hvd.size(), "mode": mode,
        "state_bytes": 2 * 4 * ELEMENTS,
        "slice_bytes": sum(t.numel() * t.element_size() for t in state),
        "resume_extra_bytes": peak - after, "kept_bytes": after - before,
        "slices": slices, "weight": sorted({float(weight[0]), float(weight[-1]),
                                            float(weight[ELEMENTS // 2])}),
    }  # fmt: skip
    print("ZERO_LARGE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
