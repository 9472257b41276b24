"""Every public name of ``gradbuilder`` resolves (they are imported on first use), and every
gradbuilder exception is one class, defined in gradbuilder.errors, whatever module names it."""

import importlib

import pytest

import gradbuilder


@pytest.mark.parametrize("name", gradbuilder.__all__)
def test_every_public_name_resolves(name):
    assert getattr(gradbuilder, name) is not None
    assert name in dir(gradbuilder)


@pytest.mark.parametrize("name", ["DistributedError", "ExportError", "MissingDependencyError"])
def test_the_exception_hierarchy_lives_in_errors(name):
    errors = importlib.import_module("gradbuilder.errors")
    cls = getattr(gradbuilder, name)
    assert cls is getattr(errors, name) and cls.__module__ == "gradbuilder.errors"
    assert issubclass(cls, errors.GradBuilderError)


def test_the_old_homes_name_the_same_classes():
    from gradbuilder.compat import MissingDependencyError
    from gradbuilder.errors import ExportError as Defined

    assert MissingDependencyError is gradbuilder.MissingDependencyError
    assert issubclass(MissingDependencyError, ImportError)
    ortmodule = pytest.importorskip("gradbuilder.ortmodule")
    assert ortmodule.ExportError is Defined
