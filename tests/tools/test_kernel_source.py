"""The kernels' source: no warp collective or block barrier is the operand of a short-circuit
or conditional operator. `valid && __match_any_sync(kFull, x)` runs the collective in the
lanes where valid holds only; the others never arrive and the warp waits for them forever,
past every kernel deadline (AFDEP_RAW_META's receive hung so on a GPU). Such calls are
statements of their own whose results are combined afterwards, or sit inside an `if` whose
condition every thread shares."""

import pathlib
import re

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "kernels"
COLLECTIVE = (r"__(?:(?:match_any|match_all|shfl(?:_up|_down|_xor)?|ballot|all|any|reduce_\w+)"
              r"_sync|syncwarp|syncthreads(?:_and|_or|_count)?)")
# a collective right after &&, || or ?, or after a ternary's ':' (opening parentheses and a
# negation between them allowed, and line breaks), in code with comments removed
GUARDED = re.compile(r"(?:&&|\|\||\?|[^:]:(?!:))[\s(!]*" + COLLECTIVE + r"\s*\(")


def _code(text: str) -> str:
    """``text`` without comments, with every line kept (line numbers stay)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def guarded_collectives(text: str):
    """(line number, line) of each collective that is an operand of &&, ||, ?: in ``text``
    (the line the collective's name is on)."""
    code = _code(text)
    lines = code.split("\n")
    found = []
    for m in GUARDED.finditer(code):
        at = m.end() - 1  # the call's parenthesis, on the collective's line
        i = code.count("\n", 0, at)
        found.append((i + 1, lines[i].strip()))
    return found


def test_the_check_finds_guarded_collectives():
    bad = [
        "const bool first = valid && (__match_any_sync(kFull, e32) & m) == 0;",
        "ok = ok || __any_sync(kFull, x);",
        "int v = lane < k ? __shfl_sync(kFull, a, 0) : 0;",
        "int v = lane < k ? 0 : __shfl_xor_sync(kFull, a, 1);",
        "if (ll && !__syncthreads_and(ok ? 1 : 0)) return;",
        "if (a || (__syncwarp(), b)) return;",
    ]
    for line in bad:
        assert guarded_collectives(line) == [(1, line)], line
    good = [
        "const unsigned same = __match_any_sync(kFull, e32);",
        "const bool first = valid && (same & m) == 0;",
        "if (!__all_sync(kFull, ok)) return;",
        "tok = __shfl_sync(kFull, hv, 0);  // valid && __any_sync(kFull, x) in a comment",
        "x = afdep::detail::f(__ballot_sync(kFull, p));",
        "/* a && __all_sync(kFull, b) */ y = 1;",
        "if (ll) {\n  if (!__syncthreads_and(ok ? 1 : 0)) return;\n}",
        "switch (f) {\n  case kA:\n    x = 1;\n}\n__syncthreads();",
    ]
    for line in good:
        assert guarded_collectives(line) == [], line
    # across a line break: reported on the collective's line
    text = "int x = 0;\nconst bool first = valid &&\n    (__match_any_sync(kFull, e) & m) == 0;\n"
    assert guarded_collectives(text) == [(3, "(__match_any_sync(kFull, e) & m) == 0;")]
    # a comment spanning lines keeps the numbering
    text = "/* a\n b */ x = 1;\nok = ok || __any_sync(kFull, p);"
    assert guarded_collectives(text) == [(3, "ok = ok || __any_sync(kFull, p);")]


def test_no_kernel_guards_a_warp_collective():
    files = sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh"))
    assert len(files) >= 3, files  # dispatch, combine, common at least
    found = {f.name: guarded_collectives(f.read_text()) for f in files}
    assert not any(found.values()), found
