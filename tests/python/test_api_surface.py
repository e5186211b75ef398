"""What the package says it exports is what it exports: every name in __all__ exists, every
public function and class there has a docstring, gradsync.Error is built, raised, pickled and
copied with its code; and the wire's enums the package restates (_native.py's DTYPES and
REDUCE_OPS, gradsync.h's gs_dtype and gs_reduce_op) name exactly the proto's values, read from
the .proto files themselves (c_api.cc checks gradsync.h against the generated code at compile
time too)."""
import ast
import copy
import inspect
import os
import pickle
import re
import sys

import pytest

from conftest import BUILD, ROOT

sys.path.insert(0, os.path.join(BUILD, "python"))

PROTO_DIR = os.path.join(ROOT, "proto", "gradsync", "v1")
NATIVE = os.path.join(ROOT, "client", "python", "gradsync", "_native.py")
HEADER = os.path.join(ROOT, "client", "gradsync.h")


# ---- __all__ and docstrings ----
def _modules():
    import gradsync
    import gradsync.elastic
    import gradsync.torch
    return [gradsync, gradsync.torch, gradsync.elastic]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["gradsync", "gradsync.torch", "gradsync.elastic"])
def test_every_name_in_all_exists_and_has_a_docstring(index):
    module = _modules()[index]
    assert len(set(module.__all__)) == len(module.__all__), module.__all__
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert (obj.__doc__ or "").strip(), f"{module.__name__}.{name} has no docstring"


@pytest.mark.parametrize("index", [0, 1, 2], ids=["gradsync", "gradsync.torch", "gradsync.elastic"])
def test_every_public_function_and_class_is_in_all_with_documented_public_methods(index):
    module = _modules()[index]
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        home = getattr(obj, "__module__", None)
        if home != module.__name__ and not (module.__name__ == "gradsync" and
                                            home in ("gradsync._native", "gradsync.elastic")):
            continue  # imported from elsewhere (torch, contextlib, gradsync itself, ...)
        assert name in module.__all__, f"{module.__name__}.{name} is public but not in __all__"
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                fn = member.fget if isinstance(member, property) else member
                if callable(fn):
                    assert (fn.__doc__ or "").strip(), f"{name}.{attr} has no docstring"


def test_docstrings_of_the_collectives_say_what_they_take():
    import gradsync
    doc = gradsync.all_reduce.__doc__
    for word in ("CPU", "CUDA", "buffer-protocol", "bfloat16", "no elements", "async_op",
                 "gradsync.Error"):
        assert word in doc, word
    for fn in (gradsync.broadcast, gradsync.all_gather, gradsync.reduce_scatter):
        assert "all_reduce" in fn.__doc__  # they refer to its list of operands


# ---- gradsync.Error ----
def test_error_carries_code_and_detail_through_pickle_and_copy():
    import gradsync
    e = gradsync.Error("FAILED_PRECONDITION", "the pack plan of Group(world) covers [0]")
    assert str(e) == "FAILED_PRECONDITION: the pack plan of Group(world) covers [0]"
    for other in (pickle.loads(pickle.dumps(e)), copy.copy(e), copy.deepcopy(e)):
        assert type(other) is gradsync.Error
        assert (other.code, other.detail, str(other)) == (e.code, e.detail, str(e))


def test_every_error_the_package_raises_is_built_with_code_and_detail():
    """Error takes (code, detail): a call with one argument would raise TypeError instead of
    the error it means. Every Error(...) call in the package's source is checked."""
    pkg = os.path.join(ROOT, "client", "python", "gradsync")
    calls = 0
    for fname in sorted(os.listdir(pkg)):
        if not fname.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(pkg, fname)).read(), fname)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Error":
                calls += 1
                assert len(node.args) == 2 and not node.keywords, \
                    f"{fname}:{node.lineno}: Error() takes (code, detail)"
                code = node.args[0]
                assert isinstance(code, ast.Name) or (  # _error's code, looked up by number
                    isinstance(code, ast.Constant) and re.fullmatch(r"[A-Z_]+", code.value)), \
                    f"{fname}:{node.lineno}: the code is a status name"
    assert calls >= 5


# ---- the wire's enums ----
def proto_enums(text):
    """{enum name: {value name: number}} of every enum block in a .proto file's text."""
    text = re.sub(r"//[^\n]*", "", text)
    enums = {}
    for name, body in re.findall(r"\benum\s+(\w+)\s*\{(.*?)\}", text, re.S):
        values = {}
        for value, number in re.findall(r"(\w+)\s*=\s*(-?\d+)\s*;", body):
            values[value] = int(number)
        enums[name] = values
    return enums


def all_proto_enums():
    enums = {}
    for fname in sorted(os.listdir(PROTO_DIR)):
        if fname.endswith(".proto"):
            enums.update(proto_enums(open(os.path.join(PROTO_DIR, fname)).read()))
    return enums


def native_tables(text):
    """The dict literals DTYPES and REDUCE_OPS of _native.py's source."""
    tables = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                getattr(node.targets[0], "id", None) in ("DTYPES", "REDUCE_OPS"):
            tables[node.targets[0].id] = ast.literal_eval(node.value)
    return tables


def header_enums(text):
    """{enum name: {constant: number}} of gradsync.h's enums."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return {name: {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}
            for name, body in re.findall(r"\benum\s+(\w+)\s*\{(.*?)\}", text, re.S)}


def wire_values(enum):
    """Every value of a proto enum but its *_UNSPECIFIED, by lower-case name."""
    return {k.lower(): v for k, v in enum.items() if not k.endswith("_UNSPECIFIED")}


# The package's restatements of each proto enum. OpKind has none: each op has its own function
# in the C ABI and in Python.
PAIRS = [("DType", "DTYPES", "gs_dtype", "GS_"), ("ReduceOp", "REDUCE_OPS", "gs_reduce_op", "GS_")]


def mismatches(proto, native, header):
    """What differs between the proto's enums and the package's tables (empty: they agree)."""
    out = []
    for enum, table, c_enum, prefix in PAIRS:
        want = wire_values(proto[enum])
        got = native.get(table)
        if got != want:
            out.append(f"_native.py {table} {got} != proto {enum} {want}")
        c_values = {k[len(prefix):].lower(): v for k, v in header.get(c_enum, {}).items()}
        if c_values != want:
            out.append(f"gradsync.h {c_enum} {c_values} != proto {enum} {want}")
    return out


def test_the_package_tables_and_gradsync_h_name_exactly_the_proto_enum_values():
    proto = all_proto_enums()
    assert set(wire_values(proto["DType"])) >= {"float32", "bfloat16", "int8"}
    assert wire_values(proto["ReduceOp"]) == {"sum": 1, "mean": 2, "min": 3, "max": 4}
    problems = mismatches(proto, native_tables(open(NATIVE).read()),
                          header_enums(open(HEADER).read()))
    assert problems == []


@pytest.mark.parametrize("edit", [
    ('"int8": 8', '"int8": 9'),                    # a wrong number
    (', "int8": 8}', '}'),                          # a value missing
    ('"max": 4}', '"max": 4, "median": 5}'),         # a value the proto lacks
])
def test_a_table_that_drifts_from_the_proto_is_caught(edit):
    text = open(NATIVE).read()
    assert edit[0] in text
    problems = mismatches(all_proto_enums(), native_tables(text.replace(edit[0], edit[1])),
                          header_enums(open(HEADER).read()))
    assert len(problems) == 1 and problems[0].startswith("_native.py"), problems


def test_a_proto_value_the_package_lacks_is_caught():
    text = open(os.path.join(PROTO_DIR, "types.proto")).read()
    assert "  INT8 = 8;\n" in text
    proto = all_proto_enums()
    proto.update(proto_enums(text.replace("  INT8 = 8;\n", "  INT8 = 8;\n  INT16 = 9;\n")))
    problems = mismatches(proto, native_tables(open(NATIVE).read()),
                          header_enums(open(HEADER).read()))
    assert len(problems) == 2, problems  # both _native.py and gradsync.h


def test_the_loaded_package_uses_the_tables_it_was_checked_on():
    from gradsync import _native
    assert native_tables(open(NATIVE).read()) == {"DTYPES": _native.DTYPES,
                                                  "REDUCE_OPS": _native.REDUCE_OPS}
    for name, code in _native.DTYPES.items():
        assert _native.dtype_size(name) > 0 and _native.dtype_code(name) == code
