"""Runs tests/torch_scenarios.py's cases, one after the other, in one multi-rank job: each case
a user's training script with hvdkit.torch's session (setup, shard, the loop, backward_and_step,
a validation loader, a save with the defaults and a resume), each rank keeping a ledger of the
sample ids it trained per epoch and validated per pass.

Usage: ``hvdkit run -np N -- python torch_scenario_worker.py CASES.json WORKDIR``, CASES a list
of ``{"id": ..., "case": {...}, "resume": bool}``: a case's first run (which stops after its
save when the resumed run is at another world size) or its resumed run (from the checkpoint
in ``WORKDIR/case-ID``). Each rank prints one ``CASE {...}`` line a case. A case that raises
prints its error and ends the job (the other ranks would wait in a collective for it): the
cases after it are not run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import hvdkit.torch as hvd
from hvdkit import preempt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the grammar
from case_loop import run_items  # beside this file
from torch_scenarios import (
    VALIDATION,
    Case,
    build,
    dataset,
    late_group,
    loss_of,
    make_scheduler,
    unfreeze,
    weights_of,
)  # fmt: skip


class Indexed(Dataset):
    def __init__(self, samples: int, seed: int = 5) -> None:
        self.x, self.y = dataset(samples, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Script:
    """One case as a user's script runs it, up to a save (then "preempted") or the end."""

    def __init__(self, case: Case, checkpoint: Path | None) -> None:
        self.case = case
        self.model, self.scale, optimizer = build(case)
        self.session = hvd.setup(
            self.model, optimizer, checkpoint=checkpoint, warmup_steps=case.warmup,
            backward_passes_per_step=case.accumulate, shard_optimizer=case.shard,
            compression=case.compression, elastic=case.elastic_kill > 0, commit_every=3,
        )  # fmt: skip
        late_group(case, self.session.optimizer, self.scale)
        self.data = Indexed(case.samples)
        self.loader = self.training_loader()
        exact = {"shuffle": False, "pad": False} if case.exact_validation else {}
        self.validation = self.session.shard(
            Indexed(VALIDATION, seed=7), batch_size=case.batch, **exact
        )
        self.length = len(self.loader)  # before the first pass: what a scheduler is built from

    def training_loader(self) -> Any:
        return self.session.shard(
            self.data, batch_size=self.case.batch, drop_last=self.case.drop_last,
            shuffle=self.case.shuffle, num_workers=self.case.workers,
        )  # fmt: skip

    def validate(self, ledger: dict[str, Any]) -> None:
        """A validation pass; its loss averaged over the ranks as Horovod's examples do (an
        elastic case's lost worker makes that collective fail here, between steps)."""
        rows: list[int] = []
        total = 0.0
        with torch.no_grad():
            for x, y, index in self.validation:
                if self.case.elastic_kill_in == "validation":
                    kill_if_due(self.case, self.session)
                total += loss_of(self.session.model, self.scale, x, y).item() * len(index)
                rows += index.tolist()
        ledger["validated"].append(rows)
        ledger["averages"].append(self.session.average(total, len(rows), name="validation"))


def run_case(case: Case, workdir: Path, resume: bool) -> dict[str, Any]:
    """One case's first run (``resume`` False: to the end, resuming in the same processes
    after its save when the size stays) or its resumed run at another size."""
    ledger: dict[str, Any] = {
        "trained": {}, "validated": [], "averages": [], "lens": [], "resets": [],
    }  # fmt: skip
    checkpoint = workdir / "ckpt.pt" if case.resume_at else None
    if not resume and checkpoint is not None:
        if checkpoint.exists() and hvd.rank() == 0:
            checkpoint.unlink()
        # Every rank looks for the file after rank 0 removed it.
        hvd.allreduce(torch.zeros(1), name="scenario.fresh")
    save_after = 0 if resume else case.resume_at
    while True:
        script = Script(case, checkpoint)
        session = script.session
        scheduler = make_scheduler(case, session.optimizer, script.length)
        if scheduler is not None:  # built after setup, from len(loader): given to the session
            session.scheduler = scheduler
        ledger["lens"].append(script.length)
        try:
            saved = run_epochs(script, scheduler, ledger, save_after)
        except preempt.Preempted:  # checkpointed at a step boundary, on every rank
            saved = True
        finally:
            if session._preempt is not None:  # the next case's session installs its own
                session._preempt.uninstall()
        if not saved:
            break
        if len(case.sizes) > 1:  # resumed by another job, at the other size
            ledger["stopped_at"] = session.step_count
            break
        save_after = 0  # resumed: to the end
    frozen = [p.grad is None for p in script.model.parameters() if not p.requires_grad]
    ledger.update(steps=session.step_count, weights=weights_of(script.model, script.scale),
                  frozen_without_grad=all(frozen))  # fmt: skip
    return ledger


def run_epochs(script: Script, scheduler: Any, ledger: dict[str, Any], save_after: int) -> bool:
    """The script's loop; True when it saved (with the defaults) and stopped mid-epoch (a
    preemption raises :class:`hvdkit.preempt.Preempted` once it has saved)."""
    case, session = script.case, script.session
    epochs = (
        session.epochs(case.epochs) if case.loop == "epochs" else range(session.epoch, case.epochs)
    )
    generation = 0
    for epoch in epochs:
        unfreeze(case, script.model, epoch)
        if case.loader_per_epoch:
            script.loader = script.training_loader()
        for k, (x, y, index) in enumerate(script.loader):
            if case.elastic_kill:
                generation = elastic_events(case, session, ledger, generation)
            ledger["trained"].setdefault(str(session.epoch), []).extend(index.tolist())
            if case.zero_grad == "model":
                session.model.zero_grad()
                if script.scale is not None and not session.position.micro_step:
                    script.scale.grad = None  # the script's own parameter, zeroed by the script
            else:
                session.optimizer.zero_grad(set_to_none=case.zero_grad == "optimizer")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.amp):
                loss = loss_of(session.model, script.scale, x, y)
            options = {"clip_grad_norm": case.clip} if case.clip is not None else {}
            session.backward_and_step(loss, **options)
            if case.scheduler == "onecycle":
                scheduler.step()
            # Every second batch, counted by the session (a worker that joins an elastic job
            # starts its own `k` at 0: by that, its collectives would not pair with rank 0's).
            done = session.step_count * case.accumulate + session.position.micro_step
            if case.validation == "inside" and done % 2 == 0:
                script.validate(ledger)
            if (
                save_after
                and epoch == 1
                and k + 1 >= save_after
                and not session.position.micro_step
            ):
                if case.stop == "save":
                    session.save()  # the defaults, inside the epoch
                    return True
                if session.rank == 0:  # as a scheduler's warning to one rank
                    os.kill(os.getpid(), signal.SIGUSR1)
                save_after = 0  # the job stops where the ranks agree, a step or two later
        if case.scheduler == "steplr":
            scheduler.step()
        if case.validation == "after":
            script.validate(ledger)
    return False


def elastic_events(case: Case, session: Any, ledger: dict[str, Any], generation: int) -> int:
    """Before a batch of an elastic case: a reset since the last one is logged ([step it went
    back to, size]); the worker on the second host may be killed (:func:`kill_if_due`); each
    step takes 0.3 s, so the killed host is back before training ends."""
    if session._elastic.generation != generation:
        generation = session._elastic.generation
        ledger["resets"].append([session.step_count, session.size])
    at_kill = session.step_count == case.elastic_kill and not session.position.micro_step
    if case.elastic_kill_in == "training" and at_kill:
        kill_if_due(case, session)
    time.sleep(0.3)
    return generation


def kill_if_due(case: Case, session: Any) -> None:
    """The worker on the second host kills itself (-9) once (a marker file says it happened),
    from step ``elastic_kill`` on."""
    marker = Path(os.environ["SCENARIO_KILL_MARKER"])
    second_host = os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1"
    if session.step_count >= case.elastic_kill and second_host and not marker.exists():
        marker.write_text(json.dumps({"step": session.step_count, "in": case.elastic_kill_in}))
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    items = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    hvd.init()
    preempt.INTERVAL_S = 0.0  # the ranks agree on a signal at every step: it stops within 2
    run_items(
        items, workdir, hvd.rank(),
        lambda item, where: run_case(Case(**item["case"]), where, item["resume"]),
    )  # fmt: skip


if __name__ == "__main__":
    main()
