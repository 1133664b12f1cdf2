"""scripts/sass_spans.py on a synthetic `cuobjdump -sass` listing: kernels split by name, code
bytes, integer divisions, and each %globaltimer read with the bytes and notable instructions
since the previous."""

from tests.helpers.scripts import load_script

LISTING = """
	code for sm_90a
		Function : _ZN5afdep44_GLOBAL__N__359a11ab_11_dispatch_cu_63705c8615dispatch_kernelENS_6LayoutENS_12DispatchArgsE
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/                   ACQBULK ;                              /* 0x000000000000782e */
        /*0020*/                   CS2R R4, SR_GLOBALTIMERLO ;            /* 0x0000000000047805 */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0040*/               @P0 CALL.REL.NOINC 0x100 ;                 /* 0x0000000000007944 */
        /*0050*/                   IADD3 R0, R1, 0x1, RZ ;                /* 0x0000000101007810 */
        /*0060*/              @!P1 CS2R R6, SR_GLOBALTIMERLO ;            /* 0x0000000000069805 */
        /*0070*/                   I2F.RP R8, R2 ;                        /* 0x0000000200087306 */
        /*0080*/               @P2 I2F.U32.RP R9, R3 ;                    /* 0x0000000300097306 */
        /*0090*/                   I2FP.F32.S32 R10, R4 ;                 /* 0x00000004000a7245 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
		Function : _ZN5afdep40_GLOBAL__N__d9fbcfff_8_probe_cu_2b8747a612stamp_kernelEPm
        /*0000*/                   CS2R R2, SR_GLOBALTIMERLO ;            /* 0x0000000000027805 */
        /*0010*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def _tool():
    return load_script("sass_spans")


def test_kernels_code_bytes_and_stamp_spans():
    tool = _tool()
    kernels = tool.parse_sass(LISTING)
    assert [tool.short_name(k) for k in kernels] == ["dispatch_kernel", "stamp_kernel"]
    d = tool.spans(next(iter(kernels.values())))
    assert d["bytes"] == 0xb0
    assert d["divisions"] == 2  # I2F.RP and I2F.U32.RP start one each; I2FP is a conversion
    assert tool.spans(list(kernels.values())[1])["divisions"] == 0
    assert [(s["offset"], s["bytes"], s["instructions"]) for s in d["stamps"]] == [
        (0x20, 0x20, 2), (0x60, 0x40, 3)]
    assert d["stamps"][0]["notable"] == ["ACQBULK"]
    assert d["stamps"][1]["notable"] == ["BAR.SYNC.DEFER_BLOCKING", "CALL.REL.NOINC"]


def test_main_reads_a_saved_listing(tmp_path, capsys):
    f = tmp_path / "sass.txt"
    f.write_text(LISTING)
    assert _tool().main(["--sass", str(f), "--kernel", "dispatch"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("dispatch_kernel: 176 bytes of code, 2 integer divisions, "
                                   "2 %globaltimer reads")
    assert "stamp_kernel" not in out
    assert "+     64 B (    3 instructions) BAR.SYNC.DEFER_BLOCKING, CALL.REL.NOINC" in out


def test_short_name_keeps_the_kernel_form():
    tool = _tool()
    assert tool.short_name("_ZN5afdep44_GLOBAL__N__359a11ab_11_dispatch_cu_63705c8615dispatch_"
                           "kernelILi2EEEvNS_6LayoutENS_12DispatchArgsE") == "dispatch_kernel<2>"
    assert tool.short_name("_ZN5afdep40_GLOBAL__N__d9fbcfff_8_probe_cu_2b8747a612stamp_kernelEPm"
                           ) == "stamp_kernel"
    # combine_kernel<form, kSpread>: the spread instantiation named, the other as before
    pre = "_ZN5afdep43_GLOBAL__N__0e19ca8f_10_combine_cu_cdb2156f14combine_kernel"
    post = "EEvNS_6LayoutENS_11CombineArgsE"
    assert tool.short_name(pre + "ILi5ELb1E" + post) == "combine_kernel<5, true>"
    assert tool.short_name(pre + "ILi11ELb0E" + post) == "combine_kernel<11>"
    # a third template argument (AFDEP_SHUFFLE_MATCH's instantiations): bools up to the last true
    assert tool.short_name(pre + "ILi1ELb0ELb1E" + post) == "combine_kernel<1, false, true>"
    assert tool.short_name(pre + "ILi2ELb1ELb0E" + post) == "combine_kernel<2, true>"
    assert tool.short_name(pre + "ILi6ELb0ELb0E" + post) == "combine_kernel<6>"


RESOURCES = """
Fatbin elf code:
================
arch = sm_90a
identifier = /work/main/csrc/kernels/dispatch.cu

Resource usage:
 Common:
  GLOBAL:346 CONSTANT[4]:48
 Function _ZN5afdep44_GLOBAL__N__359a11ab_11_dispatch_cu_63705c8615dispatch_kernelENS_6LayoutENS_12DispatchArgsE:
  REG:70 STACK:40 SHARED:1648 LOCAL:0 CONSTANT[0]:1328 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN5afdep40_GLOBAL__N__d9fbcfff_8_probe_cu_2b8747a612stamp_kernelEPm:
  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_resources_parsed_per_kernel():
    res = _tool().parse_resources(RESOURCES)
    assert len(res) == 2  # the "Common:" block names no kernel
    d = next(v for k, v in res.items() if "dispatch_kernel" in k)
    assert d == {"REG": 70, "STACK": 40, "SHARED": 1648, "LOCAL": 0}
    assert next(v for k, v in res.items() if "stamp_kernel" in k)["REG"] == 8


def test_main_prints_registers_from_a_saved_resource_listing(tmp_path, capsys):
    f, r = tmp_path / "sass.txt", tmp_path / "res.txt"
    f.write_text(LISTING)
    r.write_text(RESOURCES)
    assert _tool().main(["--sass", str(f), "--resources", str(r)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("dispatch_kernel: 176 bytes of code, 2 integer divisions, "
                        "2 %globaltimer reads, 70 registers a thread, 40 B stack")
    assert lines[-3] == ("stamp_kernel: 32 bytes of code, 0 integer divisions, "
                         "1 %globaltimer reads, 8 registers a thread, 0 B stack")
    # the listing's constant reads are all below the parameter block
    assert lines[-1] == "  parameter lines read: 0 (line@first instruction: ); 0 indexed reads"


def test_form_names_come_from_the_kernels_enum(tmp_path, capsys):
    """The template argument is named from KernelForm (csrc/include/afdep/forms.h), read at run
    time: the listing's header line says which form a kernel is."""
    tool = _tool()
    names = tool.form_names()
    assert names[0] == "kGeneric" and names[2] == "kSmallRecv" and names[6] == "kUnitExpRecv"
    try:  # the extension exports the same list (what the transports' last_forms report)
        from torch_afdep import _cuda
    except ImportError:
        _cuda = None
    if _cuda is not None:
        assert names == {v: k for k, v in _cuda.KERNEL_FORMS.items()}
    assert tool.form_names(str(tmp_path / "absent.cuh")) == {}
    f = tmp_path / "sass.txt"
    f.write_text(LISTING.replace("dispatch_kernelENS_6", "dispatch_kernelILi2EEEvNS_6"))
    assert tool.main(["--sass", str(f), "--kernel", "kSmallRecv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dispatch_kernel<2> kSmallRecv: 176 bytes of code"), out[0]
    assert not any("stamp_kernel" in line for line in out)


def test_against_an_old_listing_names_each_instantiation(tmp_path, capsys):
    """--against: per instantiation SAME (instructions equal one for one, offsets and the file
    hash in the mangled name aside), DIFF, NEW or GONE, then the counts of each."""
    tool = _tool()
    old_text = LISTING.replace("dispatch_kernelENS_6", "dispatch_kernelILi2ELb1EEEvNS_6")
    # the new build: another file hash, the dispatch form changed by one instruction, the
    # stamp kernel as before, and a ping kernel the old one lacked
    ping = ("\t\tFunction : _ZN5afdep40_GLOBAL__N__d9fbcfff_8_probe_cu_2b8747a611ping_kernelEPm\n"
            "        /*0000*/                   CS2R R3, SR_GLOBALTIMERLO ;\n"
            "        /*0010*/                   EXIT ;\n")
    new_text = (old_text.replace("359a11ab", "0badf00d")
                .replace("IADD3 R0, R1, 0x1, RZ", "IADD3 R0, R1, 0x2, RZ") + ping)
    old, new = tool.parse_sass(old_text), tool.parse_sass(new_text)
    rows = tool.compare(old, new)
    assert rows == [("DIFF", "dispatch_kernel<2, true>", 11, 11), ("SAME", "stamp_kernel", 2, 2),
                    ("NEW", "ping_kernel", 0, 2)], rows
    assert tool.compare(new, old)[-1] == ("GONE", "ping_kernel", 2, 0)
    assert tool.compare(old, old) == [("SAME", n, c, c) for _, n, c, _ in tool.compare(old, old)]
    f_old, f_new = tmp_path / "old.txt", tmp_path / "new.txt"
    f_old.write_text(old_text)
    f_new.write_text(new_text)
    assert tool.main(["--sass", str(f_new), "--against", str(f_old)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "DIFF dispatch_kernel<2, true> kSmallRecv: 11 -> 11 instructions", out
    assert out[-1] == "SAME 1, DIFF 1, NEW 1, GONE 0", out
    assert tool.main(["--sass", str(f_new), "--against", str(f_old), "--kernel", "stamp"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "SAME stamp_kernel: 2 -> 2 instructions", "SAME 1, DIFF 0, NEW 0, GONE 0"]


PARAMS = """
\t\tFunction : _ZN5afdep44_GLOBAL__N__359a11ab_11_dispatch_cu_63705c8615dispatch_kernelENS_6LayoutENS_12DispatchArgsE
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   LDC.U8 R2, c[0x0][0x2f1] ;             /* 0x0000bc40ff027b82 */
        /*0020*/                   ULDC.64 UR4, c[0x0][0x3f0] ;           /* 0x0000fc0000047ab9 */
        /*0030*/                   ULDC.64 UR8, c[0x0][0x208] ;           /* 0x0000820000087ab9 */
        /*0040*/                   LDC R3, c[0x0][0x2c0] ;                /* 0x0000b000ff037b82 */
        /*0050*/              @!P0 LDC.64 R4, c[0x0][R10+0x210] ;         /* 0x000084000a048b82 */
        /*0060*/                   IMAD R5, R3, c[0x0][0x3f8], RZ ;       /* 0x0000fe0003057a24 */
        /*0070*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_parameter_lines_in_order_of_first_read():
    tool = _tool()
    insns = next(iter(tool.parse_sass(PARAMS).values()))
    pl = tool.param_lines(insns)
    # 0x28 is below the parameter block; 0x2f1 and 0x2c0 share the line at 0x2c0, 0x3f0 and
    # 0x3f8 the line at 0x3c0 (first read by instruction 2); the descriptor's 0x208 is at 0x200
    assert pl["lines"] == [(0x2c0, 1), (0x3c0, 2), (0x200, 3)]
    assert pl["indexed"] == 1


def test_listing_prints_parameter_lines(tmp_path, capsys):
    tool = _tool()
    f = tmp_path / "k.sass"
    f.write_text(PARAMS)
    assert tool.main(["--sass", str(f)]) == 0
    out = capsys.readouterr().out
    assert "parameter lines read: 3 (line@first instruction: 0x2c0@1, 0x3c0@2, 0x200@3); " \
           "1 indexed reads" in out, out
