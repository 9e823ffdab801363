"""Horovod 0.28.1's public API against hvdkit's: every public name of the installed Horovod's
``horovod.torch``, ``horovod.tensorflow`` (and its ``elastic``), ``horovod.tensorflow.keras``
and its ``callbacks`` must exist in hvdkit's
twin and accept the same arguments (Horovod's positional order, every keyword), unless the
allow-list below says why not. A script that only switches its import must not meet a
``TypeError`` or an ``AttributeError`` Horovod would not raise."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import types

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# (Horovod's module, hvdkit's, whether positional order is checked too)
PAIRS = [
    ("horovod.torch", "hvdkit.torch", True),
    ("horovod.tensorflow", "hvdkit.tensorflow", True),
    ("horovod.tensorflow.elastic", "hvdkit.tensorflow.elastic", True),
    ("horovod.tensorflow.keras", "hvdkit.keras", True),
    ("horovod.tensorflow.keras.callbacks", "hvdkit.keras.callbacks", True),
    # Horovod's module for standalone Keras 2 (under Keras 3, `import keras` is that package).
    # hvdkit.keras serves it too, by keyword: its positional order differs from
    # horovod.tensorflow.keras's (DistributedOptimizer's 9th is num_groups there,
    # backward_passes_per_step here; BestModelCheckpoint has no save_weights_only), and one
    # function has one order, so hvdkit follows horovod.tensorflow.keras's.
    ("horovod.keras", "hvdkit.keras", False),
    ("horovod.keras.callbacks", "hvdkit.keras.callbacks", False),
]

# name in Horovod's module -> why hvdkit does not offer it (keep this short).
ALLOWED = {
    "horovod.tensorflow.keras.is_version_greater_equal_than": (
        "a helper Horovod imports from horovod.common.util into the module, not API"
    ),
    "horovod.tensorflow.keras.callbacks.is_version_greater_equal_than": (
        "a helper Horovod imports from horovod.common.util into the module, not API"
    ),
}


def public(module: types.ModuleType) -> list[str]:
    return sorted(
        n for n in dir(module)
        if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)
    )  # fmt: skip


def signature(obj: object) -> inspect.Signature | None:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins and C extensions
        return None


def incompatibility(
    theirs: inspect.Signature, ours: inspect.Signature, positional_order: bool = True
) -> str | None:
    """Why a call that Horovod's signature accepts could fail on ours, or None."""
    kinds = inspect.Parameter
    ours_params = ours.parameters
    if any(p.kind is kinds.VAR_KEYWORD for p in ours_params.values()):
        return None
    positional = [
        n for n, p in theirs.parameters.items()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    ours_positional = [
        n for n, p in ours_params.items()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    missing = [
        n for n, p in theirs.parameters.items()
        if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) and n not in ours_params
    ]  # fmt: skip
    if missing:
        return f"missing parameters {missing}"
    if positional_order and ours_positional[: len(positional)] != positional:
        return f"positional parameters {ours_positional} where Horovod has {positional}"
    required = [
        n for n, p in ours_params.items()
        if p.default is p.empty and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        and (n not in theirs.parameters or theirs.parameters[n].default is not p.empty)
    ]  # fmt: skip
    if required:
        return f"parameters {required} are required here but optional (or absent) in Horovod"
    return None


@pytest.mark.parametrize("theirs_name, ours_name, positional_order", PAIRS)
def test_horovods_public_api_is_all_here(theirs_name, ours_name, positional_order):
    theirs = importlib.import_module(theirs_name)
    ours = importlib.import_module(ours_name)
    problems = []
    for name in public(theirs):
        if f"{theirs_name}.{name}" in ALLOWED:
            continue
        if not hasattr(ours, name):
            problems.append(f"{name}: missing")
            continue
        a, b = getattr(theirs, name), getattr(ours, name)
        if not callable(a):
            continue
        sig_a, sig_b = signature(a), signature(b)
        if sig_a is None:
            continue
        if sig_b is None:
            problems.append(f"{name}: no inspectable signature here")
            continue
        why = incompatibility(sig_a, sig_b, positional_order)
        if why:
            problems.append(f"{name}: {why}")
    assert not problems, f"{ours_name} vs {theirs_name}:\n  " + "\n  ".join(problems)


def test_the_allow_list_names_only_what_horovod_has():
    for key in ALLOWED:
        module, _, name = key.rpartition(".")
        assert hasattr(importlib.import_module(module), name), key


def test_the_compatibility_rule_itself():
    def horovod_like(tensor, average=None, name=None, op=None): ...
    def drops_op(tensor, average=None, name=None): ...
    def reordered(tensor, name=None, average=None, op=None): ...
    def extra_required(tensor, average=None, name=None, op=None, *, model): ...
    def superset(tensor, average=None, name=None, op=None, *, process_set=None): ...

    s = inspect.signature
    assert incompatibility(s(horovod_like), s(superset)) is None
    assert "missing parameters ['op']" in incompatibility(s(horovod_like), s(drops_op))
    assert "positional" in incompatibility(s(horovod_like), s(reordered))
    assert incompatibility(s(horovod_like), s(reordered), positional_order=False) is None
    assert "required" in incompatibility(s(horovod_like), s(extra_required))


# hvdkit.ray and hvdkit.spark against horovod.ray and horovod.spark.run (Horovod 0.28.1).
ENGINE_ALLOWED = {
    "horovod.ray.ElasticRayExecutor": "elastic training on Ray is not offered (docs/guides/ray-spark.md)",
}


def test_ray_api_matches_horovods():
    pytest.importorskip("ray", reason="Ray is not installed: make engines")
    theirs, ours = importlib.import_module("horovod.ray"), importlib.import_module("hvdkit.ray")
    problems = []
    for name in public(theirs):
        if f"horovod.ray.{name}" in ENGINE_ALLOWED:
            continue
        if not hasattr(ours, name):
            problems.append(f"{name}: missing")
            continue
        a, b = getattr(theirs, name), getattr(ours, name)
        members = [m for m in dir(a) if not m.startswith("_")] if inspect.isclass(a) else []
        for label, x, y in [(name, a, b)] + [(f"{name}.{m}", getattr(a, m), getattr(b, m, None))
                                             for m in members if callable(getattr(a, m))]:  # fmt: skip
            if y is None:
                problems.append(f"{label}: missing")
                continue
            why = incompatibility(signature(x), signature(y))
            if why:
                problems.append(f"{label}: {why}")
    assert not problems, "hvdkit.ray vs horovod.ray:\n  " + "\n  ".join(problems)


def test_spark_run_matches_horovods():
    """horovod.spark does not import beside today's pyarrow, so its signature is read from
    the installed source."""
    import ast

    spec = importlib.util.find_spec("horovod")
    source = os.path.join(os.path.dirname(spec.origin), "spark", "runner.py")
    tree = ast.parse(open(source).read())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    namespace: dict = {}
    exec(f"def run({ast.unparse(node.args)}): pass", namespace)
    import hvdkit.spark

    assert incompatibility(inspect.signature(namespace["run"]),
                           inspect.signature(hvdkit.spark.run)) is None  # fmt: skip
    assert list(inspect.signature(hvdkit.spark.run).parameters) == list(
        inspect.signature(namespace["run"]).parameters
    )


def test_engine_allow_list_names_only_what_horovod_has():
    pytest.importorskip("ray", reason="Ray is not installed: make engines")
    for key in ENGINE_ALLOWED:
        module, _, name = key.rpartition(".")
        assert hasattr(importlib.import_module(module), name), key
