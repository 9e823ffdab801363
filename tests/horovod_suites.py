"""Horovod's own parallel test suites through hvdkit: the yardstick of issue 13.

Reads the suites from a Horovod source tree at tag v0.28.1 (a git checkout; nothing of it is
kept in this repository), switches the import to hvdkit, applies only the edits Keras 3 itself
forces (listed below, each with the error it avoids), and runs each file under
``horovodrun -np 2 --gloo`` in a temporary folder. Prints one line per suite with pytest's
counts. Needs ``mock`` and ``parameterized`` (Horovod's test dependencies).

    python tests/horovod_suites.py --horovod-src ~/src/horovod [--raw]

``--raw`` runs the same files against Horovod itself (only the Keras 3 edits), to compare.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TAG = "v0.28.1"

# suite file -> [(Horovod's import line, hvdkit's)]: the only edit to hvd calls.
SUITES = {
    "test_torch.py": [("import horovod.torch as hvd\n", "import hvdkit.torch as hvd\n")],
    "test_tensorflow2_keras.py": [
        ("import horovod.tensorflow.keras as hvd\n", "import hvdkit.keras as hvd\n"),
        ("import horovod.keras as hvd_keras\n", "import hvdkit.keras as hvd_keras\n"),
    ],
    "test_tensorflow2_keras_process_sets.py": [
        ("import horovod.tensorflow.keras as hvd\n", "import hvdkit.keras as hvd\n"),
    ],
}

# The edits Keras 3 forces on any script (not on hvd calls): (old, new, the error without it).
KERAS3_EDITS = [
    ("lr=0.0001", "learning_rate=0.0001", "Argument(s) not recognized: {'lr': ...}"),
    ("optimizer.lr.numpy()", "optimizer.learning_rate.numpy()", "no attribute 'lr'"),
    (",\n                      experimental_run_tf_function=False)", ")",
     "compile() got an unexpected keyword argument"),
    ("keras.losses.mean_squared_error", "keras.losses.MeanSquaredError()",
     "module 'keras.losses' has no attribute 'mean_squared_error'"),
    ("keras.layers.ThresholdedReLU(0.5)", "keras.layers.ReLU(threshold=0.5)",
     "no attribute 'ThresholdedReLU'"),
    (", input_length=10)", ")", "Embedding: unrecognized keyword arguments ['input_length']"),
    ("super().__init__(name=name, **kwargs)",
     "super().__init__(name=name, learning_rate=0.1, **kwargs)",
     "Optimizer.__init__() missing 1 required positional argument: 'learning_rate'"),
    ("def update_step(self, gradient, variable):",
     "def update_step(self, gradient, variable, learning_rate):",
     "update_step() takes 3 positional arguments but 4 were given"),
    (",\n                    experimental_aggregate_gradients=False)", ")",
     "apply_gradients() got an unexpected keyword argument"),
    ("var.ref()", "id(var)", "'Variable' object has no attribute 'ref'"),
]  # fmt: skip


def source(repo: Path, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{TAG}:{path}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def port(text: str, name: str, raw: bool) -> str:
    for old, new in [] if raw else SUITES[name]:
        if old not in text:
            raise SystemExit(f"{name}: {old.strip()!r} not found: is this Horovod {TAG}?")
        text = text.replace(old, new)
    if "keras" in name:
        for before, after, _why in KERAS3_EDITS:
            text = text.replace(before, after)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod-src", type=Path, required=True, help="a Horovod git checkout")
    parser.add_argument("--raw", action="store_true", help="run against Horovod, not hvdkit")
    parser.add_argument("--only", nargs="*", default=list(SUITES), choices=list(SUITES))
    args = parser.parse_args(argv)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="horovod-suites-") as tmp:
        root = Path(tmp)
        (root / "utils").mkdir()
        (root / "parallel").mkdir()
        (root / "utils" / "common.py").write_text(source(args.horovod_src, "test/utils/common.py"))
        for name in args.only:
            text = port(source(args.horovod_src, f"test/parallel/{name}"), name, args.raw)
            (root / "parallel" / name).write_text(text)
            env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
            out = subprocess.run(
                [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m",
                 "pytest", "-q", "-p", "no:cacheprovider", name],
                cwd=root / "parallel", env=env, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            counts = re.findall(r"^\[0\]<stdout>:(=* ?\d+ (?:passed|failed).*?)=*$", out.stdout, re.M)
            failures = re.findall(r"^\[0\]<stdout>:FAILED (\S+)", out.stdout, re.M)
            print(f"{name}: {counts[-1] if counts else 'no summary (exit ' + str(out.returncode) + ')'}")
            for test in failures:
                print(f"  FAILED {test}")
            failed += out.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
