"""The public API's docstring examples run as doctests (8 simulated CPU devices, from
conftest), so each Args/Returns example stays true."""

import dataclasses
import doctest
import enum
import inspect

import pytest

import layers
import selector
from checks import jax_start
from checks import targets as compile_targets
from layers import grouped_matmul
from selector import block_arrays, targets, traits


def _public(package) -> dict:
    """Every public name a package exports (its __all__, or the names its __init__
    re-exports), constants left out (they cannot carry a docstring)."""
    names = getattr(package, "__all__", None) or [
        n
        for n in vars(package)
        if not n.startswith("_") and not inspect.ismodule(getattr(package, n))
    ]
    found = {f"{package.__name__}.{n}": getattr(package, n) for n in names}
    return {k: v for k, v in found.items() if callable(v)}


# The public API (every name `selector` and `layers` export) and the helpers whose
# examples the guides lean on.
PUBLIC = {
    **_public(selector),
    **_public(layers),
    "selector.targets.Target": targets.Target,
    "selector.traits.traits": traits.traits,
    "selector.block_arrays.block_arrays": block_arrays.block_arrays,
    "selector.traits.jax_release": traits.jax_release,
    "layers.gmm": grouped_matmul.gmm,
    "checks.jax_start.prepare_process": jax_start.prepare_process,
    "checks.jax_start.start_for": jax_start.start_for,
    "checks.targets.gpu_target_config": compile_targets.gpu_target_config,
}


def _what_it_needs(obj) -> tuple[str, ...]:
    """Function: Args (when it takes any) and Returns. Dataclass: Attributes or Args.
    Enum: each member named. Exception or other class: a description."""
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return tuple(f"`{m.value}`" for m in obj)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return ("Attributes:",) if "Attributes:" in (obj.__doc__ or "") else ("Args:",)
    if inspect.isclass(obj):
        return ()
    takes = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    return (*(("Args:",) if takes else ()), "Returns")


def test_every_public_name_is_covered():
    assert len(PUBLIC) >= 40, sorted(PUBLIC)


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_docstring_has_args_returns_and_a_running_example(name, jax_cpu8):
    obj = PUBLIC[name]
    doc = obj.__doc__ or ""
    missing = [part for part in _what_it_needs(obj) if part not in doc]
    assert doc.strip() and not missing, f"{name}'s docstring lacks {missing}"
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
    examples = [t for t in tests if t.examples]
    assert examples, f"{name} has no example"
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS
        | doctest.IGNORE_EXCEPTION_DETAIL
        | doctest.NORMALIZE_WHITESPACE
    )
    for test in examples:
        runner.run(test)
    assert runner.failures == 0, f"{name}: {runner.failures} example(s) failed (output above)"
