"""Checkpoint seams of issue 38, one process each (tests/test_seams.py runs it twice: save,
then resume): ``extra`` values, the AMP GradScaler's state, a mismatched model's error, and a
Keras model whose layers changed. Prints one RESULT line."""

from __future__ import annotations

import argparse
import json
import os


def emit(**values):
    print("RESULT " + json.dumps({"rank": 0, **values}), flush=True)


def torch_job(args) -> None:
    import numpy as np
    import torch

    import hvdkit.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, args.hidden), torch.nn.Linear(args.hidden, 1))
    session = hvd.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint=args.checkpoint
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.ones(2, 4)
    if args.mode == "save":
        session.optimizer.zero_grad()
        loss = session.model(x).sum() * float("inf")  # an overflow: the scale halves
        session.backward_and_step(loss, scaler=scaler)
        session.save(best=np.float64(0.5), count=np.int64(3))
        emit(scale=scaler.get_scale())
    else:
        session.optimizer.zero_grad()
        scale_given = scaler.get_scale()
        session.backward_and_step(session.model(x).sum(), scaler=scaler)
        emit(resumed=session.resumed, scale_before=scale_given, scale=scaler.get_scale())


def keras_job(args) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    import hvdkit.keras as hvd

    names = ["encoder", "decoder"] if args.mode == "save" else ["new_adapter", "encoder"]
    model = keras.Sequential(
        [keras.Input((4,))] + [keras.layers.Dense(4, name=name) for name in names]
    )
    session = hvd.setup(model, keras.optimizers.SGD(0.1), checkpoint=args.checkpoint)
    if args.mode == "save":
        import numpy as np

        model.compile(optimizer=session.optimizer, loss="mse")
        session.fit(np.ones((8, 4), "float32"), np.ones((8, 4), "float32"), epochs=1, verbose=0)
    emit(epoch=session.epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=["torch", "keras"])
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--hidden", type=int, default=3)
    args = parser.parse_args()
    (torch_job if args.job == "torch" else keras_job)(args)


if __name__ == "__main__":
    main()
