"""Generated scenarios for hvdkit.torch's session (issue 49): a grammar of what users vary, the
one-process oracle, and the sample ledger's checks. Pure: no Horovod, no hvdkit.

A :class:`Case` is one training script's choices: the optimizer, its param groups (an empty
one, per-group LR and weight decay), frozen and tied parameters, a parameter outside the model,
how gradients are zeroed, accumulation, clipping, warmup, a scheduler built from
``len(loader)``, ZeRO, the loader's batch size, ``drop_last`` and shuffle, a validation loader
iterated inside or after the epoch, ``session.epochs()`` or a ``range()`` loop, and a save with
the defaults in the middle of an epoch followed by a resume. :func:`cases` draws them with
Hypothesis (seeded); tests/workers/torch_scenario_worker.py runs a list of them in one job;
:func:`oracle` computes what one plain process trains on the same global batches, from the
case alone; :func:`check` compares the two and the ledger of samples each rank trained.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

FEATURES, CLASSES, VALIDATION = 6, 3, 23
FUZZ_WORKERS = "HVDKIT_SCENARIO_WORKERS"
LR = {"sgd": 0.05, "sgd_momentum": 0.05, "sgd_nesterov": 0.05, "adam": 0.01, "adamw": 0.01,
      "rmsprop": 0.005, "adagrad": 0.05}  # fmt: skip


@dataclass(frozen=True)
class Case:
    optimizer: str = "sgd"
    groups: str = "one"  # "one", "decay_split", "empty_group", "per_layer"
    frozen: bool = False  # the first layer's weight frozen, still in the optimizer
    unfreeze: bool = False  # ... and trainable again from the second epoch on
    tied: bool = False  # one layer applied twice
    outside: bool = False  # a learnable logit scale outside the model, in the optimizer
    late_group: bool = False  # ... added by add_param_group after setup, in a group of its own
    zero_grad: str = "optimizer"  # "optimizer", "optimizer_keep" (set_to_none=False), "model"
    accumulate: int = 1
    clip: float | None = None
    amp: bool = False  # bf16 autocast of the forward pass
    compression: str = "none"  # "fp16": gradients sent and summed in float16
    warmup: int = 0
    scheduler: str = "none"  # "none", "onecycle" (total_steps from len(loader)), "steplr"
    shard: bool = False
    samples: int = 41
    batch: int = 4
    drop_last: bool = False
    shuffle: bool = True
    workers: int = 0  # the training loader's worker processes
    loader_per_epoch: bool = False  # the training loader made anew at each epoch's start
    validation: str = "none"  # "none", "inside" (every 2 batches), "after" (each epoch)
    exact_validation: bool = False  # shard(..., shuffle=False, pad=False): each sample once
    loop: str = "epochs"  # "epochs": session.epochs(n); "range": for epoch in range(...)
    resume_at: int = 0  # >0: stop after this many batches of the second epoch, then resume
    stop: str = "save"  # "save": save() with the defaults, stop; "preempt": SIGUSR1 to rank 0
    size: int = 2  # ranks of the first run
    elastic_kill: int = 0  # >0: an elastic session on two hosts, one killed -9 at this step
    # "validation": killed in the first validation pass after that step instead (between
    # passes, with validation="after"), where no training collective is under way
    elastic_kill_in: str = "training"
    resume_size: int = 0  # ranks of the resumed run (0: the same, in the same processes)
    epochs: int = 2

    @property
    def sizes(self) -> list[int]:
        """The world size of each run: the resumed one's too, where it is another size."""
        other = self.resume_at and self.resume_size not in (0, self.size)
        return [self.size, self.resume_size] if other else [self.size]

    def reproducer(self, seed: int | None = None) -> str:
        """One line that runs this case again (tests/test_torch_scenarios.py)."""
        where = f"seed {seed}: " if seed is not None else ""
        spec = json.dumps(asdict(self))
        return f"{where}HVDKIT_SCENARIO='{spec}' pytest tests/test_torch_scenarios.py -k one_case"


def elastic_cases(seed: int, count: int) -> list[Case]:
    """``count`` cases with an elastic kill (each a job of its own: the worker that rejoins
    starts the script anew): no stop and resume (elastic sessions recover instead), no group
    added after setup (a joiner adds it after the state it joins with), two ranks, six epochs
    so that the killed host is back before the end."""
    out: list[Case] = []
    for case in reversed(cases(seed, count * 4)):  # Hypothesis draws the simplest first
        # Every other case with a validation loader (by the seed, so that CI's one case
        # varies too) loses its worker in a validation pass.
        odd = (seed + len(out)) % 2
        where = "validation" if case.validation != "none" and odd else "training"
        case = Case(**{**asdict(case), "resume_at": 0, "resume_size": 0, "size": 2,
                       "late_group": False, "workers": 0, "epochs": 6,
                       "elastic_kill": 5, "elastic_kill_in": where})  # fmt: skip
        # Enough steps after the kill at step 5 for the killed host to be back (a cooldown
        # of 1-2 s and a new process, at 0.3 s a step) before training ends.
        steps = case.epochs * -(-batches_per_epoch(case, 2) // case.accumulate)
        if len(out) < count and case not in out and steps >= 30:
            out.append(case)
    return out


def cases(seed: int, count: int) -> list[Case]:
    """``count`` cases drawn by Hypothesis from the grammar, reproducibly from ``seed``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    drawn: list[Case] = []
    strategy = st.builds(
        Case,
        optimizer=st.sampled_from(sorted(LR)),
        groups=st.sampled_from(["one", "decay_split", "empty_group", "per_layer"]),
        frozen=st.booleans(),
        unfreeze=st.booleans(),
        tied=st.booleans(),
        outside=st.booleans(),
        late_group=st.booleans(),
        zero_grad=st.sampled_from(["optimizer", "optimizer_keep", "model"]),
        accumulate=st.integers(1, 3),
        clip=st.sampled_from([None, 0.5]),
        amp=st.booleans(),
        compression=st.sampled_from(["none", "none", "fp16"]),
        warmup=st.sampled_from([0, 3]),
        scheduler=st.sampled_from(["none", "onecycle", "steplr"]),
        shard=st.booleans(),
        samples=st.integers(17, 45),
        batch=st.integers(2, 6),
        drop_last=st.booleans(),
        shuffle=st.booleans(),
        # Loader worker processes only in campaigns (make fuzz): a CI run under load once
        # timed out in a job holding such a case (not reproduced in 3 reruns alone).
        workers=st.sampled_from([0, 0, 0, 0, 0, 2] if os.environ.get(FUZZ_WORKERS) else [0]),
        loader_per_epoch=st.booleans(),
        validation=st.sampled_from(["none", "inside", "after"]),
        exact_validation=st.booleans(),
        loop=st.sampled_from(["epochs", "range"]),
        resume_at=st.sampled_from([0, 0, 1, 3]),
        stop=st.sampled_from(["save", "preempt"]),
        size=st.sampled_from([2, 2, 2, 1]),
        elastic_kill=st.just(0),  # drawn by elastic_cases(): a job each
        resume_size=st.sampled_from([0, 0, 1, 2]),
        epochs=st.just(2),
    )

    @hypothesis_seed(seed)
    @settings(max_examples=count * 3, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def collect(case: Case) -> None:
        if case.late_group and case.resume_at:
            # hvdkit refuses to resume a checkpoint whose param groups differ from those at
            # setup(): a group added after it cannot be resumed (documented).
            case = Case(**{**asdict(case), "resume_at": 0})
        if len(case.sizes) > 1 and case.scheduler == "onecycle":
            # OneCycleLR's total_steps, from len(loader) at the first size, is too few for
            # the batches at another: the script itself would fail (torch refuses the step).
            case = Case(**{**asdict(case), "scheduler": "steplr"})
        fits = all(batches_per_epoch(case, n) > 0 for n in case.sizes)
        if len(drawn) < count and case not in drawn and fits:
            drawn.append(case)

    collect()
    return drawn


# --- what the worker and the oracle build alike -------------------------------------------


def dataset(samples: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


class Model(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(FEATURES, FEATURES)
        self.second = torch.nn.Linear(FEATURES, CLASSES)
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if self.tied:
            h = torch.tanh(self.first(h))  # the same weights twice
        return self.second(h)


def build(case: Case) -> tuple[Model, torch.Tensor | None, torch.optim.Optimizer]:
    """The model, the parameter outside it (or None) and the optimizer, as the user's script
    makes them (frozen weights still handed to the optimizer, as ``model.parameters()``).
    With ``late_group`` the outside parameter is not in it yet: :func:`late_group` adds it."""
    model = Model(case.tied)
    if case.frozen:
        model.first.weight.requires_grad_(False)
    scale = torch.nn.Parameter(torch.tensor(1.5)) if case.outside else None
    weights = [model.first.weight, model.second.weight]
    biases = [model.first.bias, model.second.bias]
    extra = [scale] if scale is not None and not case.late_group else []
    lr = LR[case.optimizer]
    if case.groups == "one":
        groups: list[dict[str, Any]] = [{"params": [*model.parameters(), *extra]}]
    elif case.groups == "decay_split":
        groups = [{"params": weights, "weight_decay": 0.05},
                  {"params": [*biases, *extra], "weight_decay": 0.0}]  # fmt: skip
    elif case.groups == "empty_group":  # a decay/no-decay split with nothing on one side
        groups = [{"params": [*weights, *biases, *extra], "weight_decay": 0.01},
                  {"params": [], "weight_decay": 0.0}]  # fmt: skip
    else:
        groups = [{"params": list(model.first.parameters())},
                  {"params": list(model.second.parameters()), "lr": lr * 0.5}]  # fmt: skip
        if extra:
            groups.append({"params": extra, "lr": lr * 2})
    return model, scale, make_optimizer(case.optimizer, groups, lr)


def late_group(case: Case, optimizer: torch.optim.Optimizer, scale: torch.Tensor | None) -> None:
    if case.late_group and scale is not None:
        optimizer.add_param_group({"params": [scale], "lr": LR[case.optimizer] * 2})


def unfreeze(case: Case, model: Model, epoch: int) -> None:
    """Fine-tuning's second phase: the frozen weight trains from the second epoch on."""
    if case.frozen and case.unfreeze and epoch >= 1:
        model.first.weight.requires_grad_(True)


def make_optimizer(name: str, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "sgd_nesterov":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr)
    return torch.optim.Adagrad(groups, lr=lr)


def make_scheduler(case: Case, optimizer: torch.optim.Optimizer, batches: int) -> Any:
    """The scheduler as a script builds it, from ``len(loader)`` (``batches``); an elastic
    case's for its epochs at one rank (OneCycleLR refuses a step past its total), which a
    worker that lost its peer runs at."""
    if case.elastic_kill:
        batches = batches_per_epoch(case, 1)
    if case.scheduler == "onecycle":
        lr = LR[case.optimizer]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[g["lr"] * 2 for g in optimizer.param_groups] or lr,
            total_steps=case.epochs * batches,
            cycle_momentum=case.optimizer in ("sgd_momentum", "sgd_nesterov", "adam", "adamw"),
        )  # fmt: skip
    if case.scheduler == "steplr":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return None


def loss_of(model: Model, scale: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)
    return F.cross_entropy(logits * scale if scale is not None else logits, y)


def weights_of(model: Model, scale: torch.Tensor | None) -> list[float]:
    tensors = [p.detach().reshape(-1) for p in model.parameters()]
    if scale is not None:
        tensors.append(scale.detach().reshape(-1))
    return [float(f"{w:.9g}") for w in torch.cat(tensors).tolist()]


# --- the oracle -----------------------------------------------------------------------------


def epoch_order(samples: int, epoch: int, case: Case) -> list[int]:
    """An epoch's order of the whole dataset: ``DistributedSampler``'s permutation."""
    if case.shuffle:
        return torch.randperm(samples, generator=torch.Generator().manual_seed(epoch)).tolist()
    return list(range(samples))


def rank_batches(order: list[int], done: int, size: int, case: Case) -> list[list[list[int]]]:
    """Each rank's batches of what is left of an epoch after ``done`` samples, ``[rank][batch]
    -> rows``: cut to a multiple of ``size`` (``drop_last``) or padded with the epoch's first
    samples, split as ``DistributedSampler`` splits, then batched by the loader."""
    rest = order[done:]
    if case.drop_last:
        rest = rest[: len(rest) - len(rest) % size]
    elif rest and len(rest) % size:
        rest += (order * size)[: size - len(rest) % size]
    out = []
    for rank in range(size):
        rows = rest[rank::size]
        cut = len(rows) - len(rows) % case.batch if case.drop_last else len(rows)
        out.append([rows[k : k + case.batch] for k in range(0, cut, case.batch)])
    return out


def batches_per_epoch(case: Case, size: int) -> int:
    return len(rank_batches(list(range(case.samples)), 0, size, case)[0])


def reduce(grads: list[torch.Tensor], case: Case) -> torch.Tensor:
    """The ranks' gradients of one parameter as Horovod averages them: with
    ``compression="fp16"`` each is sent in float16 and the sum rounded to it (nothing is sent
    at one rank)."""
    if case.compression == "fp16" and len(grads) > 1:
        total = torch.stack([g.half().float() for g in grads]).sum(0).half().float()
    else:
        total = torch.stack(grads).sum(0)
    return total / len(grads)


def oracle(case: Case, segments: list[tuple[int, int | None]]) -> dict[str, Any]:
    """One plain process: each step's gradient is the mean over ranks of each rank's gradient
    (its mean loss), summed over the step's passes; the LR in force is the schedule's times
    the warmup multiplier towards the world size; the epoch's leftover passes step on their
    own. ``segments``: ``(size, last step)`` of each run, the last one's step None."""
    x, y = dataset(case.samples)
    model, scale, opt = build(case)
    late_group(case, opt, scale)
    scheduler = make_scheduler(case, opt, batches_per_epoch(case, segments[0][0]))
    every = [p for g in opt.param_groups for p in g["params"]]
    step = passes = 0
    summed: list[list[torch.Tensor]] = []  # [rank][parameter], over the step's passes
    trained: dict[int, list[int]] = {}
    runs = list(segments)

    def optimizer_step() -> None:
        nonlocal step, passes
        size = len(summed)
        for i, p in enumerate(every):
            p.grad = reduce([rank[i] for rank in summed], case) if p.requires_grad else None
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in every if p.requires_grad], case.clip)
        factor = 1 + (size - 1) * min(1.0, step / case.warmup) if case.warmup else size
        saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] *= factor
        opt.step()
        for g, lr in zip(opt.param_groups, saved, strict=True):
            g["lr"] = lr
        summed.clear()
        step, passes = step + 1, 0

    for epoch in range(case.epochs):
        unfreeze(case, model, epoch)
        order, done = epoch_order(case.samples, epoch, case), 0
        trained[epoch] = []
        stopped = True
        while stopped:  # a pass: from the epoch's start, or from where a stopped run left it
            stopped = False
            size = runs[0][0]
            per_rank = rank_batches(order, done, size, case)
            for k in range(len(per_rank[0])):
                if not summed:
                    summed.extend([torch.zeros_like(p) for p in every] for _ in range(size))
                for r in range(size):
                    rows = per_rank[r][k]
                    trained[epoch] += rows
                    for p in every:
                        p.grad = None
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.amp):
                        loss = loss_of(model, scale, x[rows], y[rows])
                    loss.backward()
                    for acc, p in zip(summed[r], every, strict=True):
                        if p.grad is not None:
                            acc += p.grad
                done += case.batch * size
                passes += 1
                if passes == case.accumulate:
                    optimizer_step()
                if case.scheduler == "onecycle":
                    scheduler.step()
                if runs[0][1] is not None and runs[0][1] == step and not passes:
                    runs.pop(0)
                    # An elastic reset at a pass's last step came after the pass ended (a
                    # commit is taken at the next batch): the epoch is over, its drop_last
                    # tail left out. A save there was inside the pass: it goes on.
                    stopped = not (case.elastic_kill and k == len(per_rank[0]) - 1)
                    break
        if passes:
            optimizer_step()
            if runs[0][1] is not None and runs[0][1] == step:  # stopped at the epoch's last step
                runs.pop(0)
        if case.scheduler == "steplr":
            scheduler.step()
    return {"weights": weights_of(model, scale), "steps": step, "trained": trained}


# --- the checks -----------------------------------------------------------------------------


def coverage_problems(case: Case, sizes: list[int], epoch_rows: list[int],
                      samples: int | None = None) -> list[str]:  # fmt: skip
    """What is wrong with one epoch's trained rows over all ranks and runs: every sample once,
    plus the sampler's padding (fewer repeats than ranks, each run), or, with ``drop_last``,
    each at most once and fewer left out than a batch of every rank."""
    samples = case.samples if samples is None else samples
    counts = Counter(epoch_rows)
    missing = sorted(set(range(samples)) - set(counts))
    repeats = sum(c - 1 for c in counts.values())
    problems = []
    if case.drop_last:
        if repeats:
            problems.append(f"{repeats} repeats with drop_last")
        if len(missing) >= sum(n * (case.batch + 1) for n in sizes):
            problems.append(f"{len(missing)} samples never trained")
    else:
        if missing:
            problems.append(f"samples never trained: {missing}")
        if repeats >= sum(sizes):
            problems.append(f"{repeats} repeats, padding is fewer than {sum(sizes)}")
    return problems


def check(case: Case, runs: list[dict[int, dict[str, Any]]]) -> list[str]:
    """Everything wrong with one case's result (``runs``: each run's records by rank): an error
    on a rank, ranks that differ, ``len(loader)``, the ledger (each epoch's samples, each
    validation pass's), the steps and weights against :func:`oracle` (to
    tests/workers/tolerance.py's path tolerance)."""
    from workers.tolerance import max_difference, paths_close

    errors = [f"run {n}, rank {r}: {v['error']}" for n, ranks in enumerate(runs)
              for r, v in sorted(ranks.items()) if v.get("error")]  # fmt: skip
    if errors:
        return errors
    # A preemption asked for at the last steps may come after training ended: one run.
    sizes = case.sizes if "stopped_at" in runs[0].get(0, {}) else case.sizes[:1]
    if [sorted(ranks) for ranks in runs] != [list(range(n)) for n in sizes]:
        return [f"results from ranks {[sorted(ranks) for ranks in runs]}, sizes {sizes}"]
    problems = []
    final = runs[-1]
    if len({json.dumps(v["weights"]) for v in final.values()}) != 1:
        problems.append("the ranks' weights differ")
    for size, ranks in zip(sizes, runs, strict=True):
        if len({json.dumps(v["averages"]) for v in ranks.values()}) != 1:
            problems.append(f"the validation losses session.average gave differ at {size} ranks")
        lens = {n for v in ranks.values() for n in v["lens"]}
        if lens != {batches_per_epoch(case, size)}:
            problems.append(f"len(loader) at {size} ranks {sorted(lens)}, "
                            f"expected {batches_per_epoch(case, size)}")  # fmt: skip
        for number, passes in enumerate(zip(*(v["validated"] for v in ranks.values()),
                                            strict=True)):  # fmt: skip
            rows = [i for rank_rows in passes for i in rank_rows]
            full = Case(**{**asdict(case), "drop_last": False})
            found = coverage_problems(full, [size], rows, VALIDATION)
            if case.exact_validation and len(rows) != VALIDATION:
                found.append(f"{len(rows) - VALIDATION} samples more than once")
            problems += [f"validation pass {number} at {size} ranks: {p}" for p in found]
    segments = [(size, ranks[0].get("stopped_at")) for size, ranks in zip(sizes, runs, strict=True)]
    expected = oracle(case, segments[:-1] + [(segments[-1][0], None)])
    for epoch in range(case.epochs):
        rows = [
            i for ranks in runs for v in ranks.values() for i in v["trained"].get(str(epoch), [])
        ]
        problems += [f"epoch {epoch}: {p}" for p in coverage_problems(case, sizes, rows)]
        if Counter(rows) != Counter(expected["trained"][epoch]):
            problems.append(f"epoch {epoch}: trained other samples than the oracle")
    if not case.unfreeze and not all(v["frozen_without_grad"] for v in final.values()):
        problems.append("a frozen parameter has a gradient")
    if final[0]["steps"] != expected["steps"]:
        problems.append(f"{final[0]['steps']} optimizer steps, the oracle {expected['steps']}")
    elif not paths_close(final[0]["weights"], expected["weights"], steps=expected["steps"]):
        difference = max_difference(final[0]["weights"], expected["weights"])
        problems.append(f"weights differ from the oracle's by {difference:.3g}")
    return problems


def check_elastic(case: Case, ranks: dict[int, dict[str, Any]]) -> list[str]:
    """One elastic case's result: the survivor went back to a commit at 1 rank, then took in
    the rejoined worker at 2; both end identical and equal to one run that changed size at
    those steps (the oracle); each epoch trained every sample (the work after the last commit
    is trained again, so repeats are not counted)."""
    from workers.tolerance import max_difference, paths_close

    errors = [f"rank {r}: {v['error']}" for r, v in sorted(ranks.items()) if v.get("error")]
    if errors:
        return errors
    if sorted(ranks) != [0, 1]:
        return [f"results from ranks {sorted(ranks)}"]
    problems = []
    if len({json.dumps(v["weights"]) for v in ranks.values()}) != 1:
        problems.append("the ranks' weights differ")
    survivor = max(ranks.values(), key=lambda v: len(v["resets"]))
    resets = survivor["resets"]
    if [size for _, size in resets] != [1, 2]:
        return problems + [f"resets {resets}: expected one to 1 rank, then one to 2"]
    (lost_at, _), (joined_at, _) = resets
    expected = oracle(case, [(2, lost_at), (1, joined_at), (2, None)])
    # The killed worker's ledger is gone: the epochs after the one the new worker joined in.
    joiner = min(ranks.values(), key=lambda v: len(v["resets"]))
    joined_epoch = min((int(e) for e in joiner["trained"]), default=case.epochs)
    for epoch in range(joined_epoch + 1, case.epochs):
        missing = set(range(case.samples))
        missing -= {i for v in ranks.values() for i in v["trained"].get(str(epoch), [])}
        if missing and not case.drop_last:
            problems.append(f"epoch {epoch}: samples never trained: {sorted(missing)}")
    if survivor["steps"] != expected["steps"]:
        problems.append(f"{survivor['steps']} optimizer steps, the oracle {expected['steps']}")
    elif not paths_close(survivor["weights"], expected["weights"], steps=expected["steps"]):
        difference = max_difference(survivor["weights"], expected["weights"])
        problems.append(f"weights differ from the oracle's by {difference:.3g}")
    return problems
