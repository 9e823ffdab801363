"""Horovod's own parallel test suites and TensorFlow 2 examples through hvdkit: the yardstick
of issues 13 and 25.

Reads the suites from a Horovod source tree at tag v0.28.1 (a git checkout; nothing of it is
kept in this repository), switches the import to hvdkit, applies only the edits Keras 3 itself
forces (listed below, each with the error it avoids), and runs each file under
``horovodrun -np 2 --gloo`` in a temporary folder. Prints one line per suite with pytest's
counts. Needs ``mock`` and ``parameterized`` (Horovod's test dependencies).

    python tests/horovod_suites.py --horovod-src ~/src/horovod [--raw]

``--raw`` runs the same files against Horovod itself (only the Keras 3 edits), to compare.
``--examples`` runs Horovod's three TensorFlow 2 examples instead (``EXAMPLES``), each on Gloo
and MPI, and says whether the ranks ended with identical weights. ``--keras-examples`` runs its
Keras examples (``KERAS_EXAMPLES``) on Gloo under each Keras 3 backend (TensorFlow, torch, JAX),
with the same verdict and each run's seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TAG = "v0.28.1"

# suite file -> [(Horovod's import line, hvdkit's)]: the only edit to hvd calls.
SUITES = {
    "test_torch.py": [("import horovod.torch as hvd\n", "import hvdkit.torch as hvd\n")],
    "test_tensorflow.py": [
        ("import horovod.tensorflow as hvd\n", "import hvdkit.tensorflow as hvd\n"),
    ],
    "test_tensorflow2_keras.py": [
        ("import horovod.tensorflow.keras as hvd\n", "import hvdkit.keras as hvd\n"),
        ("import horovod.keras as hvd_keras\n", "import hvdkit.keras as hvd_keras\n"),
    ],
    "test_tensorflow2_keras_process_sets.py": [
        ("import horovod.tensorflow.keras as hvd\n", "import hvdkit.keras as hvd\n"),
    ],
}

# Files a suite imports, copied as they are.
HELPERS = {"test_tensorflow.py": ["base_test_tensorflow.py"]}

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
    ("tf.keras.layers.BatchNormalization(axis=1, fused=False)",
     "tf.keras.layers.BatchNormalization(axis=1)",
     "BatchNormalization: unrecognized keyword arguments: ['fused']"),
]  # fmt: skip

# Horovod's TensorFlow 2 examples: path -> (arguments, edits). The edits are only those forced
# on any user here: local data (no download), Keras 3 (optimizer.variables is a list, lr is
# learning_rate), and fewer steps.
LOCAL_MNIST = (
    "(lambda d: ((d.x_train, d.y_train), (d.x_test, d.y_test)))("
    "__import__('hvdkit.data', fromlist=['load_images']).load_images('mnist'))"
)
EXAMPLES = {
    "examples/tensorflow2/tensorflow2_mnist.py": ([], [
        ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", LOCAL_MNIST),
        ("opt.variables()", "opt.variables"),
        ("dataset.take(10000 // hvd.size())", "dataset.take(200 // hvd.size())"),
    ]),
    "examples/tensorflow2/tensorflow2_synthetic_benchmark.py": ([
        "--model", "MobileNetV2", "--batch-size", "8", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda",
    ], [("opt.variables()", "opt.variables")]),
    "examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py": ([], [
        ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", LOCAL_MNIST),
        ("opt.lr.assign", "opt.learning_rate.assign"),
    ]),
}  # fmt: skip

# Horovod's Keras examples: path -> (arguments, edits), as for EXAMPLES: local data, Keras 3
# (compile() has no experimental_run_tf_function, the optimizer's lr is learning_rate and
# keras.backend has no set_value), fewer steps, and the import. The same files run on every
# backend: their tf.keras is Keras 3 on KERAS_BACKEND.
KERAS_IMPORT = ("import horovod.tensorflow.keras as hvd\n", "import hvdkit.keras as hvd\n")
KERAS_EXAMPLES = {
    "examples/tensorflow2/tensorflow2_keras_mnist.py": ([], [
        ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", LOCAL_MNIST),
        (",\n                        experimental_run_tf_function=False)", ")"),
        ("steps_per_epoch=500 // hvd.size(), callbacks=callbacks, epochs=24",
         "steps_per_epoch=20 // hvd.size(), callbacks=callbacks, epochs=2"),
    ]),
    "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py": ([
        "--model", "MobileNetV3Small", "--batch-size", "8", "--num-batches-per-iter", "2",
        "--num-iters", "2", "--no-cuda",
    ], [
        (",\n              experimental_run_tf_function=False)", ")"),
    ]),
    "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py": ([], [
        ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", LOCAL_MNIST),
        (",\n                    experimental_run_tf_function=False)", ")"),
        ("tf.keras.backend.set_value(state.model.optimizer.lr,  0.001 * hvd.size())",
         "state.model.optimizer.learning_rate.assign(0.001 * hvd.size())"),
        ("steps_per_epoch=500 // hvd.size(),\n                    epochs=24-state.epoch",
         "steps_per_epoch=20 // hvd.size(),\n                    epochs=2-state.epoch"),
    ]),
}  # fmt: skip
# Horovod's Keras examples left out, and why.
KERAS_EXCLUDED = {
    path: "TF1 only (tf.ConfigProto, K.set_session(tf.Session(...))): no TensorFlow 2.21 runs it"
    for path in ("examples/keras/keras_mnist.py", "examples/keras/keras_mnist_advanced.py",
                 "examples/keras/keras_imagenet_resnet50.py")
}  # fmt: skip
KERAS_BACKENDS = ("tensorflow", "torch", "jax")

# Put before each example: at exit, each rank prints a digest of every Keras model's trainable
# weights (BatchNormalization's moving statistics follow each rank's data, as in Horovod).
DIGEST_AT_EXIT = """\
import atexit as _atexit, gc as _gc, hashlib as _hashlib, os as _os
def _hvdkit_digest():
    import keras
    weights = sorted(
        _hashlib.sha256(b"".join(
            keras.ops.convert_to_numpy(v).tobytes() for v in m.trainable_variables
        )).hexdigest()[:16]
        for m in _gc.get_objects() if isinstance(m, keras.Model)
    )
    rank = _os.environ.get("HOROVOD_RANK", _os.environ.get("OMPI_COMM_WORLD_RANK"))
    print(f"DIGEST {rank} {'/'.join(weights)}", flush=True)
_atexit.register(_hvdkit_digest)
"""


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
    if "keras" in name or "tensorflow" in name:
        for before, after, _why in KERAS3_EDITS:
            text = text.replace(before, after)
    return text


def port_example(args: argparse.Namespace, path: str, edits: list, root: Path) -> Path:
    """The example at ``path`` with ``edits`` applied, and the digest printer before it."""
    text = source(args.horovod_src, path)
    for before, after in edits:
        if before not in text:
            raise SystemExit(f"{path}: {before.strip()!r} not found: is this Horovod {TAG}?")
        text = text.replace(before, after)
    script = root / Path(path).name
    script.write_text(DIGEST_AT_EXIT + text)
    return script


def run_example(
    horovodrun: str,
    root: Path,
    script: Path,
    example_args: list[str],
    controller: str,
    keras_backend: str,
    log: Path | None = None,
) -> bool:
    """Run ``script`` on 2 ranks; print its exit code, whether the ranks' weights are equal,
    the last error and the seconds it took. True when it passed."""
    env = {**os.environ, "KERAS_BACKEND": keras_backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    started = time.monotonic()
    out = subprocess.run(
        [horovodrun, "-np", "2", "-H", "localhost:2", f"--{controller}", sys.executable,
         str(script), *example_args],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    seconds = time.monotonic() - started
    if log:
        log.mkdir(parents=True, exist_ok=True)
        name = f"{script.stem}.{controller}.{keras_backend}.log"
        (log / name).write_text(out.stdout + out.stderr)
    digests = dict(re.findall(r"DIGEST (\d) ([0-9a-f/]+)", out.stdout))
    identical = len(digests) == 2 and len(set(digests.values())) == 1
    errors = re.findall(
        r"^\[\d\]<std(?:err|out)>:(\w+(?:Error|Exception): .*)$", out.stderr + out.stdout, re.M
    )
    if out.returncode != 0:
        verdict = "failed"
    else:
        verdict = "ranks identical" if identical else f"ranks differ: {digests}"
    print(
        f"{script.name} ({controller}, {keras_backend}): exit {out.returncode}, {verdict}, "
        f"{seconds:.0f} s" + (f"; {errors[-1][:200]}" if errors else ""),
        flush=True,
    )
    return out.returncode == 0 and identical


def run_examples(args: argparse.Namespace, horovodrun: str, root: Path) -> int:
    failed = 0
    old, new = "import horovod.tensorflow as hvd\n", "import hvdkit.tensorflow as hvd\n"
    for path, (example_args, edits) in EXAMPLES.items():
        script = port_example(args, path, edits + ([] if args.raw else [(old, new)]), root)
        for controller in ("gloo", "mpi"):
            failed += not run_example(horovodrun, root, script, example_args, controller,
                                      "tensorflow", args.log)  # fmt: skip
    return 1 if failed else 0


def run_keras_examples(args: argparse.Namespace, horovodrun: str, root: Path) -> int:
    for path, why in KERAS_EXCLUDED.items():
        print(f"{Path(path).name}: excluded: {why}")
    failed = 0
    for path, (example_args, edits) in KERAS_EXAMPLES.items():
        script = port_example(args, path, edits + ([] if args.raw else [KERAS_IMPORT]), root)
        for keras_backend in KERAS_BACKENDS:
            failed += not run_example(horovodrun, root, script, example_args, "gloo",
                                      keras_backend, args.log)  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod-src", type=Path, required=True, help="a Horovod git checkout")
    parser.add_argument("--raw", action="store_true", help="run against Horovod, not hvdkit")
    parser.add_argument("--only", nargs="*", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--examples", action="store_true", help="the TF2 examples instead")
    parser.add_argument(
        "--keras-examples", action="store_true", help="the Keras examples on each Keras backend"
    )
    parser.add_argument("--log", type=Path, help="keep each run's whole output here")
    parser.add_argument("-k", dest="select", default=None, help="pytest's -k, to rerun a few")
    args = parser.parse_args(argv)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="horovod-suites-") as tmp:
        root = Path(tmp)
        if args.examples:
            return run_examples(args, horovodrun, root)
        if args.keras_examples:
            return run_keras_examples(args, horovodrun, root)
        (root / "utils").mkdir()
        (root / "parallel").mkdir()
        (root / "utils" / "common.py").write_text(source(args.horovod_src, "test/utils/common.py"))
        for name in args.only:
            text = port(source(args.horovod_src, f"test/parallel/{name}"), name, args.raw)
            (root / "parallel" / name).write_text(text)
            for helper in HELPERS.get(name, []):
                (root / "parallel" / helper).write_text(
                    source(args.horovod_src, f"test/parallel/{helper}")
                )
            env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
            out = subprocess.run(
                [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m",
                 "pytest", "-q", "-p", "no:cacheprovider", name,
                 *(["-k", args.select] if args.select else [])],
                cwd=root / "parallel", env=env, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            counts = re.findall(
                r"^\[0\]<stdout>:(=* ?\d+ (?:passed|failed).*?)=*$", out.stdout, re.M
            )
            failures = sorted(set(re.findall(r"^\[\d\]<stdout>:(?:FAILED|SUBFAIL) (\S+)",
                                             out.stdout, re.M)))  # fmt: skip
            if args.log:
                args.log.mkdir(parents=True, exist_ok=True)
                (args.log / f"{name}.log").write_text(out.stdout + out.stderr)
            summary = counts[-1] if counts else f"no summary (exit {out.returncode})"
            print(f"{name}: {summary}")
            for test in failures:
                print(f"  FAILED {test}")
            failed += out.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
