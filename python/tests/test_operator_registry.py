"""Every operator registered under torch.ops.padmoe has a fake kernel (torch.compile), an autograd
rule or a stated reason it has none, and a public padmoe.torch function that reaches it
(docs/adding-an-operator.md lists every place an operator touches)."""

import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("padmoe.torch")

from padmoe.torch import _common  # noqa: E402


def registered_operators():
    return sorted(
        name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("padmoe::")
    )


def has_fake_kernel(qualname: str) -> bool:
    from torch._library.simple_registry import singleton

    entry = singleton.find(qualname)
    fake = getattr(entry, "fake_impl", None)
    return fake is not None and getattr(fake, "kernel", None) is not None


def has_autograd_kernel(qualname: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd")


def test_the_registry_names_every_operator():
    ops = registered_operators()
    assert len(ops) >= 20
    assert sorted(_common.OPERATORS) == ops, "add the operator to padmoe/torch/_common.py's OPERATORS"
    assert set(_common.NO_AUTOGRAD) <= set(ops)


@pytest.mark.parametrize("op", registered_operators())
def test_operator_has_fake_autograd_and_wrapper(op):
    qualname = f"padmoe::{op}"
    assert has_fake_kernel(qualname), f"{op}: no fake kernel (register one beside its wrapper)"
    if op in _common.NO_AUTOGRAD:
        assert _common.NO_AUTOGRAD[op].strip(), op
        assert not has_autograd_kernel(qualname), f"{op}: has an autograd kernel but is listed in NO_AUTOGRAD"
    else:
        assert has_autograd_kernel(qualname), f"{op}: no autograd kernel and no reason in NO_AUTOGRAD"
    wrapper = _common.OPERATORS[op]
    assert wrapper in pt.__all__ and callable(getattr(pt, wrapper)), f"{op}: no public wrapper {wrapper}"


def test_the_checks_can_fail():
    """The helpers above see a missing registration (so the test above is not vacuous)."""
    assert not has_fake_kernel("padmoe::no_such_operator")
    lib = torch.library.Library("padmoe_registry_probe", "FRAGMENT")
    lib.define("probe(Tensor x) -> Tensor")
    assert not has_fake_kernel("padmoe_registry_probe::probe")
    assert not has_autograd_kernel("padmoe_registry_probe::probe")
