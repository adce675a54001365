"""The public API's docstring examples run as doctests (8 simulated CPU devices, from
conftest), so each Args/Returns example stays true."""

import doctest

import pytest

import layers
import selector
from layers import grouped_matmul
from selector import targets, traits

PUBLIC = {
    "selector.compose": selector.compose,
    "selector.to_config": selector.to_config,
    "selector.resolve": selector.resolve,
    "selector.validate": selector.validate,
    "selector.search": selector.search,
    "selector.from_maxtext": selector.from_maxtext,
    "selector.targets.Target": targets.Target,
    "selector.traits.traits": traits.traits,
    "selector.traits.jax_release": traits.jax_release,
    "layers.MoEBlock": layers.MoEBlock,
    "layers.Layout": layers.Layout,
    "layers.gmm": grouped_matmul.gmm,
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_docstring_has_args_returns_and_a_running_example(name, jax_cpu8):
    obj = PUBLIC[name]
    doc = obj.__doc__ or ""
    assert "Args:" in doc and ("Returns" in doc or "returns" in doc), name
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
