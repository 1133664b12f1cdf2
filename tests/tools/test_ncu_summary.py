"""scripts/ncu_summary.py on synthetic ncu exports: roles from the lockstep JSON's pids or from
the grids, per-kernel durations past the warm-up launches, stall fractions per sampled result
(a templated kernel's doubled source blocks taken once)."""

import csv
import json
import os

from tests.helpers.scripts import load_script

DISPATCH = "void unnamed>::dispatch_kernel<{}>(Layout, DispatchArgs)"
COMBINE = "void unnamed>::combine_kernel<{}>(Layout, CombineArgs)"


def _tool():
    return load_script("ncu_summary")


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


def _raw(tmp, cell, cc, launches):
    head = ["ID", "Process ID", "Kernel Name", "Grid Size", "gpu__time_duration.sum",
            "smsp__inst_executed.sum"]
    rows = [head, [""] * 4 + ["us", "inst"]]
    for i, (pid, name, grid, us) in enumerate(launches):
        rows.append([str(i), pid, name, grid, f"{us:,.2f}", "1,000"])
    _write(os.path.join(tmp, f"dur-{cell}-cc{cc}.csv"), rows)


def test_durations_roles_and_medians(tmp_path):
    tool = _tool()
    tmp = str(tmp_path)
    # Attention pid 10 (dispatch on 24 CTAs), FFN pid 11 (receive on 66); the first two
    # launches of each kernel are warm-up and left out of the median
    launches = []
    for k, us in enumerate([50.0, 40.0, 5.0, 6.0, 7.0]):
        launches += [("10", DISPATCH.format(1), "(24, 1, 1)", us),
                     ("11", DISPATCH.format(2), "(66, 1, 1)", us + 1),
                     ("11", COMBINE.format(1), "(66, 1, 1)", us + 2),
                     ("10", COMBINE.format(2), "(66, 1, 1)", us + 3)]
    _raw(tmp, "tokens-T1", "none", launches)
    doc = tool.summarize(tmp, "tokens-T1")
    rows = {r["role"]: r for r in doc["durations"]["cache_control_none"]}
    assert sorted(rows) == ["A collect", "A dispatch", "F receive", "F reply"]
    assert rows["A dispatch"]["duration_median_us"] == 6.0
    assert rows["F reply"]["duration_median_us"] == 8.0
    assert rows["A dispatch"]["form"] == "1" and rows["A dispatch"]["launches"] == 5
    # the lockstep JSON's pids win over the grids (here it swaps the roles)
    with open(os.path.join(tmp, "dur-tokens-T1-ccnone.json"), "w") as f:
        json.dump({"ranks": [{"role": "ffn", "pid": 10}, {"role": "attention", "pid": 11}]}, f)
    rows = {r["role"]: r for r in tool.summarize(tmp, "tokens-T1")["durations"]["cache_control_none"]}
    assert rows["F receive"]["pid"] == "10"


def test_sampling_fractions_and_doubled_blocks(tmp_path):
    tool = _tool()
    tmp = str(tmp_path)
    det = [["ID", "Process ID", "Kernel Name", "Grid Size", "Metric Name"],
           ["0", "11", DISPATCH.format(2), "(66, 1, 1)", "x"],
           ["0", "11", DISPATCH.format(2), "(66, 1, 1)", "y"],
           ["1", "10", DISPATCH.format(1), "(24, 1, 1)", "x"]]
    _write(os.path.join(tmp, "samp-c-details.csv"), det)
    head = ["Address", "Source", "Instructions Executed", "stall_no_inst", "stall_barrier",
            "stall_no_inst (Not Issued)"]
    src = []
    for name, a, b in [(DISPATCH.format(2), 3, 1), (DISPATCH.format(2), 3, 1),
                       (DISPATCH.format(1), 0, 4), (DISPATCH.format(1), 0, 4)]:
        src += [["Kernel Name", name], head, ["0x10", "NOP", "8", str(a), str(b), "99"]]
    _write(os.path.join(tmp, "samp-c-source.csv"), src)
    got = tool.summarize(tmp, "c")["sampling"]
    assert [s["role"] for s in got] == ["F receive", "A dispatch"]
    assert got[0]["stall_fraction"] == {"no_inst": 0.75, "barrier": 0.25}
    assert got[1]["stall_fraction"]["barrier"] == 1.0 and got[1]["samples"] == 4


def test_hot_instructions_and_timer_spans(tmp_path):
    tool = _tool()
    tmp = str(tmp_path)
    _write(os.path.join(tmp, "samp-c-details.csv"),
           [["ID", "Process ID", "Kernel Name", "Grid Size"],
            ["0", "11", COMBINE.format(1), "(66, 1, 1)"]])
    head = ["Address", "Source", "Instructions Executed", "stall_long_sb", "stall_barrier",
            "stall_long_sb (Not Issued)"]
    # rows out of address order; two %globaltimer reads split the code into three spans
    rows = [["0x40", "LDG.E R4, desc[UR6][R2.64]", "66", "30", "0", "500"],
            ["0x00", "LDC R1, c[0x0][0x28]", "66", "2", "0", "0"],
            ["0x20", "CS2R R2, SR_GLOBALTIMERLO", "66", "0", "0", "0"],
            ["0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", "66", "0", "8", "0"],
            ["0x50", "CS2R R6, SR_GLOBALTIMERLO", "66", "0", "0", "0"],
            ["0x60", "EXIT", "66", "0", "0", "0"],
            ["0x10", "NOP", "66", "0", "0", "0"]]
    _write(os.path.join(tmp, "samp-c-source.csv"), [["Kernel Name", COMBINE.format(1)], head] + rows)
    (got,) = tool.summarize(tmp, "c")["sampling"]
    assert got["samples"] == 40
    # hottest first; rows without samples left out; the not-issued column is not a reason
    assert [h["address"] for h in got["hot"]] == ["0x40", "0x30", "0x00"]
    assert got["hot"][0] == {"address": "0x40", "sass": "LDG.E R4, desc[UR6][R2.64]",
                             "fraction": 0.75, "stalls": {"long_sb": 30}}
    assert [(s["start"], s["instructions"], s["fraction"]) for s in got["spans"]] == [
        ("0x00", 2, 0.05), ("0x20", 3, 0.95), ("0x50", 2, 0.0)]
