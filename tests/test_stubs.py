"""The type stubs of the extension module (python/powerinfer_rs/_core.pyi) against the module
itself, both ways: every public name and class member of the one is in the other, properties are
properties, exceptions derive from the classes the stub names, and each function's arguments
(names, kinds, defaults) are those of the `__text_signature__` PyO3 gives it."""

import ast
import inspect
from pathlib import Path

import powerinfer_rs
import pytest
from powerinfer_rs import _core

STUB = Path(powerinfer_rs.__file__).with_name("_core.pyi")

# what every class has that a stub does not spell out
IMPLICIT_MEMBERS = {"__new__", "__doc__", "__module__", "__weakref__", "__dict__"}


def parse(text: str) -> dict[str, ast.stmt]:
    """The stub's top-level definitions by name: classes, functions and annotated variables."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def stub_members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def decorators(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d) for d in fn.decorator_list}


def public_names(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def name_problems(stub: dict[str, ast.stmt]) -> list[str]:
    problems = [f"{n}: in the module, not in the stub" for n in public_names(_core) - set(stub)]
    problems += [f"{n}: in the stub, not in the module" for n in set(stub) - public_names(_core)]
    for name, node in stub.items():
        real = getattr(_core, name, None)
        if real is None:
            continue
        if isinstance(node, ast.ClassDef) != isinstance(real, type):
            problems.append(f"{name}: a class in only one of the stub and the module")
        elif isinstance(node, ast.FunctionDef) != inspect.isbuiltin(real):
            problems.append(f"{name}: a function in only one of the stub and the module")
        elif (
            isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) != type(real).__name__
        ):
            problems.append(
                f"{name}: annotated {ast.unparse(node.annotation)}, is a {type(real).__name__}"
            )
    return sorted(problems)


def member_problems(stub: dict[str, ast.stmt]) -> list[str]:
    problems = []
    for name, node in stub.items():
        real = getattr(_core, name, None)
        if not isinstance(node, ast.ClassDef) or not isinstance(real, type):
            continue
        bases = [ast.unparse(b) for b in node.bases] or ["object"]
        if bases != [b.__name__ for b in real.__bases__]:
            problems.append(
                f"{name}: derives from {[b.__name__ for b in real.__bases__]}, stub says {bases}"
            )
        members = stub_members(node)
        real_members = set(vars(real)) - IMPLICIT_MEMBERS
        stub_names = set(members) - {"__init__"}
        problems += [
            f"{name}.{m}: in the module, not in the stub" for m in real_members - stub_names
        ]
        problems += [
            f"{name}.{m}: in the stub, not in the module" for m in stub_names - real_members
        ]
        for m in stub_names & real_members:
            is_property = inspect.isdatadescriptor(vars(real)[m])
            if is_property != ("property" in decorators(members[m])):
                kind = "a property" if is_property else "a method"
                problems.append(f"{name}.{m}: is {kind} in the module, not in the stub")
    return sorted(problems)


def stub_parameters(fn: ast.FunctionDef, is_method: bool) -> list[tuple[str, str, str | None]]:
    """(name, kind, default as source or None) per argument, without a method's `self`."""
    a = fn.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs]
    positional += [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [(p.arg, kind, d and ast.unparse(d)) for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [
        (p.arg, "KEYWORD_ONLY", d and ast.unparse(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out[1:] if is_method else out


def compare_signature(where: str, fn: ast.FunctionDef, real, is_method: bool) -> list[str]:
    if getattr(real, "__text_signature__", None) is None:
        return []  # PyO3 gives none (exceptions): nothing to compare
    params = list(inspect.signature(real).parameters.values())
    if is_method and params and params[0].name == "self":
        params = params[1:]
    stub = stub_parameters(fn, is_method)
    want = [p.name for p in params]
    if [s[0] for s in stub] != want:
        return [f"{where}: arguments {want}, stub says {[s[0] for s in stub]}"]
    problems = []
    for p, (_, kind, default) in zip(params, stub):
        if p.kind.name != kind:
            problems.append(f"{where}({p.name}): {p.kind.name}, stub says {kind}")
        if p.default is inspect.Parameter.empty:
            if default is not None:
                problems.append(f"{where}({p.name}): required, stub gives default {default}")
        elif default is None:
            problems.append(f"{where}({p.name}): defaults to {p.default!r}, stub has no default")
        # a default PyO3 cannot print reads `...`: only its presence can be checked
        elif p.default is not Ellipsis and ast.literal_eval(default) != p.default:
            problems.append(f"{where}({p.name}): defaults to {p.default!r}, stub says {default}")
    return problems


def signature_problems(stub: dict[str, ast.stmt]) -> list[str]:
    problems = []
    for name, node in stub.items():
        real = getattr(_core, name, None)
        if isinstance(node, ast.FunctionDef) and inspect.isbuiltin(real):
            problems += compare_signature(name, node, real, is_method=False)
        elif isinstance(node, ast.ClassDef) and isinstance(real, type):
            for m, fn in stub_members(node).items():
                if m == "__init__":
                    problems += compare_signature(f"{name}()", fn, real, is_method=True)
                elif not inspect.isdatadescriptor(vars(real).get(m)) and m in vars(real):
                    problems += compare_signature(f"{name}.{m}", fn, vars(real)[m], True)
    return sorted(problems)


@pytest.fixture(scope="module")
def stub():
    return parse(STUB.read_text())


def test_stub_names_are_the_module_names(stub):
    assert name_problems(stub) == []


def test_stub_classes_have_the_module_members(stub):
    assert member_problems(stub) == []


def test_stub_arguments_are_the_module_arguments(stub):
    assert signature_problems(stub) == []


def test_the_check_finds_what_an_incomplete_stub_lacks():
    """The checks against a stub with a name dropped, one invented, a member and an argument
    missing and a default changed: each is reported."""
    broken = STUB.read_text()
    for old, new in [
        ("def simd_level() -> str: ...", "def simd_levels() -> str: ..."),
        ("    def take_capture(", "    def take_captured("),
        ("    @property\n    def report(", "    def report("),
        ("top_k: int = 40,", "top_k: int = 41,"),
        (", all_logits: bool = False)", ")"),
        ("class GpuError(RuntimeError)", "class GpuError(ValueError)"),
    ]:
        assert broken.count(old) == 1, old
        broken = broken.replace(old, new)
    # what the intact stub already gets wrong (nothing, if the other tests pass) stays out
    intact = parse(STUB.read_text())
    stub = parse(broken)
    new_problems = lambda check: sorted(set(check(stub)) - set(check(intact)))
    assert new_problems(name_problems) == [
        "simd_level: in the module, not in the stub",
        "simd_levels: in the stub, not in the module",
    ]
    assert new_problems(member_problems) == [
        "GpuError: derives from ['RuntimeError'], stub says ['ValueError']",
        "GpuModel.report: is a property in the module, not in the stub",
        "Session.take_capture: in the module, not in the stub",
        "Session.take_captured: in the stub, not in the module",
    ]
    assert new_problems(signature_problems) == [
        "Sampler()(top_k): defaults to 40, stub says 41",
        "Session.eval: arguments ['tokens', 'all_logits'], stub says ['tokens']",
    ]
