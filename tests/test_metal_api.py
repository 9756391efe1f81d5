"""csrc/metal/*.mm checked against Apple's own table of the Metal API, not against our stubs.

tests/test_metal_host.py type-checks the Objective-C++ with clang against the hand-written
declarations of tools/mslsim/objc/stubs, which can agree with a mistake. Here every selector
(with its receiver's class or protocol, where the file's declarations tell it), property, class,
protocol, C function (with its argument count) and enum constant (with its value, and its enum
type where it is passed or compared) that the .mm files use must be in Apple's metal-cpp headers,
which Apple generates from the real Objective-C headers. The stubs are held to the same table:
their enum values must be Apple's and their selectors must exist.

The table comes from the PyPI sdist of pymetal-cpp (pinned, hash-checked), downloaded by pip on
first use into the pytest cache (.pytest_cache/d/metal-cpp) or $KRNL_METAL_CPP (an unpacked
metal-cpp tree, or the folder to cache the download in); nothing of it is in this repository.
Without it the tests skip with the reason, except with CI=true, where they fail: CI must run them.

Availability, against the oldest SDK the build supports (the macOS 14.0 SDK of Xcode 15): the
stubs' API_AVAILABLE annotations and SDK guards must be those of Apple's MacOSX14.0.sdk headers,
as tools/metal_api/sdk14_availability.txt records them (derived by tools/metal_api/sdk.py from a
public mirror of those headers, named in the file; committed, as CI reaches no GitHub). What that
SDK lacks exists in the macOS 15 SDK's metal-cpp (pymetal-cpp's 367.x, the table above) and sits
under `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000` in the stubs, so that tests/test_metal_host.py,
compiling device.mm against the stubs as each SDK at the deployment target, fails on a use of it
without a compile-time guard or an @available check.

Whatever could not be checked is listed (test_unchecked_items_are_listed prints it and raises
one warning per reason). The plants below show that the same checking code reports each kind of
mistake it exists for. The reader and the checks live in tools/metal_api/.
"""
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from metal_api import apple, check, sdk  # noqa: E402
from metal_api.objc import Source  # noqa: E402

MM_FILES = sorted((ROOT / "csrc" / "metal").glob("*.mm"))
DEVICE_MM = ROOT / "csrc" / "metal" / "device.mm"
STUBS = ROOT / "tools" / "mslsim" / "objc" / "stubs"


class MetalApiUnchecked(UserWarning):
    """Something the Metal API check could not verify (listed, with the reason)."""


@pytest.fixture(scope="session")
def table(request):
    # the pytest cache (.pytest_cache/d/metal-cpp); a temporary folder under -p no:cacheprovider
    store = getattr(request.config, "cache", None)
    cache = store.mkdir("metal-cpp") if store is not None else Path(tempfile.gettempdir()) / "krnl-metal-cpp"
    try:
        tree = apple.locate(Path(cache))
    except apple.Unavailable as e:
        why = f"Apple's Metal API table ({apple.PACKAGE}=={apple.VERSION} from PyPI) unavailable: {e}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI=true, where this check must run", pytrace=False)
        pytest.skip(why)
    return apple.Table(tree)


@pytest.fixture(scope="session")
def mm_reports(table):
    return {p.name: check.check_source(p.read_text(), p.name, table) for p in MM_FILES}


@pytest.fixture(scope="session")
def stub_report(table):
    return check.check_stubs(STUBS, table)


def _listing(errors):
    return "\n".join(str(e) for e in errors)


# ---------------------------------------------------------------------------------------------
# the real files
# ---------------------------------------------------------------------------------------------
def test_metal_cpp_table_is_complete_enough(table):
    # A truncated or unexpected download must not pass as "nothing wrong found".
    assert table.version != "unknown"
    assert len(table.selectors) > 1000 and len(table.constants) > 500
    for name in ("MTLDevice", "MTLCommandBuffer", "MTLComputeCommandEncoder", "NSObject", "NSString"):
        assert table.chain(name), name
    assert [t.name for t in table.chain("MTLComputeCommandEncoder")][:2] == ["MTLComputeCommandEncoder",
                                                                             "MTLCommandEncoder"]


def test_mm_files_found():
    assert MM_FILES, "no csrc/metal/*.mm"


@pytest.mark.parametrize("mm", MM_FILES, ids=[p.name for p in MM_FILES])
def test_mm_uses_only_apple_api(mm_reports, mm):
    r = mm_reports[mm.name]
    assert not r.errors, "Metal API use that Apple's table contradicts:\n" + _listing(r.errors)
    assert r.checked["message"] > 0, "no message send found: the reader is broken"


def test_every_message_send_is_checked(mm_reports, table):
    # Each send found is either verified on its receiver's type or listed with the reason; and
    # every `[x y` / `[x y:` in the text is one the reader found (a reader that misses sends
    # would pass everything).
    for mm in MM_FILES:
        src = Source(mm.read_text(), mm.name, table)
        r = mm_reports[mm.name]
        verified = r.checked["message"] + r.checked["message (NSObject basic)"]
        listed = [u for u in r.unchecked if u.item.startswith(("[", "-[", "+["))]
        assert verified + len(listed) == len(src.messages), (mm.name, verified, len(listed), len(src.messages))
        found = {(src.toks[m.parts[0].name_tok].line, m.parts[0].name) for m in src.messages.values()}
        code = _code_only(mm.read_text())
        # `[x sel]`, `[x.y sel:`, `[a->b sel:` and `[[...] sel]`, independently of the reader
        simple = re.compile(r"\[\s*[A-Za-z_]\w*(?:\s*(?:\.|->)\s*\w+)*\s+([A-Za-z_]\w*)\s*[]:]")
        nested = re.compile(r"\]\s+([A-Za-z_]\w*)\s*[]:]")
        for n, text in enumerate(code.splitlines(), 1):
            for hit in list(simple.finditer(text)) + list(nested.finditer(text)):
                assert (n, hit.group(1)) in found, f"{mm.name}:{n}: send of {hit.group(1)} not read"


def _code_only(text):
    # comments and string literals blanked, line numbers kept
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', blank, text, flags=re.S)


@pytest.mark.parametrize("section", ["enum", "interface", "function"])
def test_stubs_agree_with_apple(stub_report, section):
    # enum: every constant's value and enum type is Apple's; interface: every selector the stubs
    # declare exists on that protocol/class (or a base) with Apple's enum parameter types;
    # function: the C functions exist with Apple's parameter counts.
    errors = [e for e in stub_report.errors if e.kind == section]
    assert not errors, f"tools/mslsim/objc/stubs disagree with Apple's table ({section}):\n" + _listing(errors)
    counted = {"enum": "stub enum value", "interface": "stub selector", "function": "stub function"}[section]
    assert stub_report.checked[counted] > 0, f"no {counted} found in the stubs: the reader is broken"


def test_unchecked_items_are_listed(mm_reports, stub_report, table, capsys):
    by_reason = defaultdict(list)
    for r in list(mm_reports.values()) + [stub_report]:
        for u in r.unchecked:
            assert u.reason, u
            by_reason[u.reason].append(f"{u.file}:{u.line} {u.item}" if u.line else f"{u.file} {u.item}")
    checked = sum((r.checked for r in list(mm_reports.values()) + [stub_report]), start=Counter())
    consts = sorted({text for r in mm_reports.values() for kind, _, text, _ in r.uses if kind == "enum constant"})
    lines = [f"Metal API check against metal-cpp {table.version} ({apple.PACKAGE} {apple.VERSION}): "
             + ", ".join(f"{n} {k}" for k, n in sorted(checked.items())),
             f"enum constants used, with Apple's values: {'; '.join(consts)}",
             "not checked (with the reason):"]
    for reason, items in sorted(by_reason.items()):
        lines.append(f"  - {reason}: {'; '.join(items)}")
        warnings.warn(MetalApiUnchecked(f"not checked: {reason}: {'; '.join(items)}"))
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------
# the reader, on a made-up file with every construct it must follow
# ---------------------------------------------------------------------------------------------
SAMPLE = r"""
class K {
 public:
  void f(id<MTLCommandQueue> q) {
    id<MTLCommandBuffer> b = [q commandBuffer];
    [b addCompletedHandler:^(id<MTLCommandBuffer> done) {
      if ([done status] == MTLCommandBufferStatusError) log([[done error] localizedDescription]);
    }];
    [[b computeCommandEncoder] endEncoding];
    if (@available(macOS 14.0, *)) opts_.languageVersion = MTLLanguageVersion3_1;
    opts_.fastMathEnabled = NO;
    NSString* s = [NSString stringWithUTF8String:"x"];
    auto lib = [dev_ newLibraryWithSource:s options:opts_ error:nil];
    id<MTLFunction> fn = [lib newFunctionWithName:s];
    for (auto& [k, v] : m_) [v waitUntilCompleted];
    auto it = m_.find(1);
    [it->second commit];
    [v_.back() commit];
    const char* n = dev_.name.UTF8String;
    id<MTLBuffer> buf = [dev_ newBufferWithLength:16 options:MTLResourceStorageModeShared | MTLResourceHazardTrackingModeUntracked];
    for (id<MTLDevice> d in MTLCopyAllDevices()) [d name];
    x = flag ? [b error] : nil;
    y = cond[1];
    [this->dev_ newBufferWithLength:flag ? 16 : 32 options:MTLResourceStorageModePrivate];
    const NSUInteger c = (NSUInteger)[[dev_ name] length];
    run([&](id<MTLCommandBuffer> cb2) { [cb2 commit]; });
    MTLResourceOptions o = MTLResourceStorageModeShared | MTLResourceCPUCacheModeWriteCombined;
    NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();
    id<MTLDevice> first = all[0];
    id<MTLComputeCommandEncoder> enc = [b computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    [enc dispatchThreadgroups:MTLSizeMake(1, 1, 1) threadsPerThreadgroup:MTLSizeMake(32, 1, 1)];
  }
  id<MTLDevice> dev_;
  MTLCompileOptions* opts_ = [[MTLCompileOptions alloc] init];
  std::map<int, id<MTLCommandBuffer>> m_;
  std::vector<id<MTLCommandBuffer>> v_;
};
void g(id<MTLBuffer> b) { [b contents]; }  // this b is a buffer, not the command buffer above
"""


def test_reader_follows_objective_c(table):
    r = check.check_source(SAMPLE, "sample.mm", table)
    assert not r.errors, _listing(r.errors)
    sends = sorted((line, text) for kind, line, text, _ in r.uses if kind.startswith("message"))
    assert sends == sorted([
        (5, "-[MTLCommandQueue commandBuffer]"),
        (6, "-[MTLCommandBuffer addCompletedHandler:]"),
        (7, "-[MTLCommandBuffer status]"), (7, "-[MTLCommandBuffer error]"), (7, "-[NSError localizedDescription]"),
        (9, "-[MTLCommandBuffer computeCommandEncoder]"), (9, "-[MTLComputeCommandEncoder endEncoding]"),
        (13, "-[MTLDevice newLibraryWithSource:options:error:]"),
        (14, "-[MTLLibrary newFunctionWithName:]"),
        (15, "-[MTLCommandBuffer waitUntilCompleted]"),
        (17, "-[MTLCommandBuffer commit]"), (18, "-[MTLCommandBuffer commit]"),
        (20, "-[MTLDevice newBufferWithLength:options:]"),
        (21, "-[MTLDevice name]"),
        (22, "-[MTLCommandBuffer error]"),
        (24, "-[MTLDevice newBufferWithLength:options:]"),
        (25, "-[MTLDevice name]"), (25, "-[NSString length]"),
        (26, "-[MTLCommandBuffer commit]"),
        (30, "-[MTLCommandBuffer computeCommandEncoderWithDispatchType:]"),
        (31, "-[MTLComputeCommandEncoder dispatchThreadgroups:threadsPerThreadgroup:]"),
        (34, "+[MTLCompileOptions alloc]"), (34, "-[MTLCompileOptions init]"),
        (38, "-[MTLBuffer contents]"),
    ]), sends
    props = sorted((line, text) for kind, line, text, _ in r.uses if kind.startswith("property"))
    assert props == [(10, "MTLCompileOptions.languageVersion -> setLanguageVersion:"),
                     (11, "MTLCompileOptions.fastMathEnabled -> setFastMathEnabled:"),
                     (19, "MTLDevice.name -> name"), (19, "NSString.UTF8String -> UTF8String")], props
    kinds = {(kind, text) for kind, _, text, _ in r.uses}
    assert ("block", "addCompletedHandler: addCompletedHandler: block of 1 parameters") in kinds
    assert ("function", "MTLCopyAllDevices/0") in kinds
    assert ("enum argument", "MTLCommandBufferStatusError as MTLCommandBufferStatus") in kinds
    assert ("enum argument", "MTLResourceHazardTrackingModeUntracked as MTLResourceOptions") in kinds
    assert ("enum argument", "MTLLanguageVersion3_1 as MTLLanguageVersion") in kinds
    assert ("@available", "macOS 14.0, *") in kinds
    assert ("enum argument", "MTLResourceCPUCacheModeWriteCombined as MTLResourceOptions") in kinds
    # NSString's stringWithUTF8String: is outside metal-cpp's Foundation subset: listed, not failed
    assert any("stringWithUTF8String:" in u.item for u in r.unchecked)
    # messages the syntax sends without spelling them are listed
    assert {(u.line, u.item) for u in r.unchecked} >= {(21, "for (... in ...)"), (29, "all[...]")}, r.unchecked
    assert not [u for u in r.unchecked if "receiver type not determined" in u.reason], r.unchecked


# ---------------------------------------------------------------------------------------------
# known to bite: copies of device.mm and of the stubs with a planted mistake
# ---------------------------------------------------------------------------------------------
def _subject(table, usable):
    """device.mm and its reading, or SAMPLE's where device.mm (being rewritten) no longer has
    what a plant needs: each plant still bites somewhere."""
    text = DEVICE_MM.read_text()
    src = Source(text, "device.mm", table)
    if usable(src):
        return text, src
    return SAMPLE, Source(SAMPLE, "sample.mm", table)


def _resolved(src, table, pred=lambda m, t: True):
    """Sends whose receiver resolves to a Metal type on which Apple's table has the selector."""
    out = []
    for m in sorted(src.messages.values(), key=lambda m: m.open):
        t = src.receiver_type(m)
        if t is not None and t.kind == "objc" and t.name.startswith("MTL") and table.lookup(t.name, m.selector, t.meta):
            if pred(m, t):
                out.append((m, t))
    return out


def _edit(text, src, a, b, new):
    """text with tokens [a, b) replaced by `new`."""
    return text[:src.toks[a].start] + new + text[src.toks[b - 1].end:]


def _bites(text, line, *words, table):
    r = check.check_source(text, "device_bad.mm", table)
    hits = [e for e in r.errors if e.line == line and all(w in e.message for w in words)]
    assert hits, f"the plant at line {line} ({words}) was not reported; errors:\n{_listing(r.errors)}"


def test_bites_misspelt_selector(table):
    text, src = _subject(table, lambda src: _resolved(src, table))
    sends = _resolved(src, table)
    m, _ = next(((m, t) for m, t in sends if len(m.parts[0].name) >= 8), sends[0])
    name = m.parts[0].name
    for cut in range(len(name) // 2, len(name)):
        wrong = name[:cut] + name[cut + 1:]
        sel = m.selector.replace(name, wrong, 1)
        if sel not in table.selectors:
            break
    k = m.parts[0].name_tok
    _bites(_edit(text, src, k, k + 1, wrong), m.line, sel, table=table)


def test_bites_selector_sent_to_the_wrong_protocol(table):
    # The encoder's declaration made a command buffer: its dispatch is then sent to a protocol
    # that has no such method, which only receiver typing from declarations can see.
    def declared_encoder(src):
        def pred(m, t):
            r = src.toks[m.receiver[0]]
            d = src.declaration(r.text, m.receiver[0]) if m.receiver[1] - m.receiver[0] == 1 else None
            return (t.name == "MTLComputeCommandEncoder" and d is not None and d.type is not None
                    and src.toks[d.type_tok].text == "id" and not table.lookup("MTLCommandBuffer", m.selector, False))
        return pred

    text, src = _subject(table, lambda src: _resolved(src, table, declared_encoder(src)))
    cands = _resolved(src, table, declared_encoder(src))
    m, _ = next(((m, t) for m, t in cands if m.selector == "dispatchThreadgroups:threadsPerThreadgroup:"), cands[0])
    d = src.declaration(src.toks[m.receiver[0]].text, m.receiver[0])
    k = d.type_tok + 2
    assert src.toks[k].text == "MTLComputeCommandEncoder"
    _bites(_edit(text, src, k, k + 1, "MTLCommandBuffer"), m.line, m.selector, "MTLCommandBuffer", table=table)


def test_bites_selector_part_dropped(table):
    def shortened_missing(m, t):
        short = "".join(p.name + ":" for p in m.parts[:-1])
        return len(m.parts) >= 2 and not table.lookup(t.name, short, t.meta)

    text, src = _subject(table, lambda src: _resolved(src, table, shortened_missing))
    m, _ = _resolved(src, table, shortened_missing)[0]
    last, before = m.parts[-1], m.parts[-2]
    bad = text[:src.toks[before.arg[1] - 1].end] + text[src.toks[last.arg[1] - 1].end:]
    _bites(bad, m.line, "".join(p.name + ":" for p in m.parts[:-1]), table=table)


def test_bites_extra_argument(table):
    keyword = lambda m, t: m.parts[0].arg is not None  # noqa: E731
    text, src = _subject(table, lambda src: _resolved(src, table, keyword))
    m, _ = _resolved(src, table, keyword)[0]
    end = src.toks[m.parts[0].arg[1] - 1].end
    _bites(text[:end] + ", 0" + text[end:], m.line, "comma-separated", table=table)


def test_bites_c_function_argument_count(table):
    def calls_of(src):
        return [i for i, t in enumerate(src.toks) if t.text in table.functions and src.tok(i + 1).text == "("]

    text, src = _subject(table, calls_of)
    calls = calls_of(src)
    with_args = [i for i in calls if src.match[i + 1] > i + 2]
    if with_args:
        i = with_args[0]
        close = src.match[i + 1]
        commas = [a for a, b in src.top(i + 2, close) if src.toks[a].text == ","]
        cut = src.toks[commas[-1]].start if commas else src.toks[i + 2].start
        bad = text[:cut] + text[src.toks[close].start:]
    else:
        i = calls[0]
        bad = text[:src.toks[i + 1].end] + "nullptr" + text[src.toks[i + 1].end:]
    _bites(bad, src.toks[i].line, src.toks[i].text, "argument", table=table)


def test_bites_nonexistent_enum_constant(table):
    def uses_of(src):
        return [i for i, t in enumerate(src.toks)
                if t.text in table.constants and src.tok(i - 1).text not in (".", "::")]

    text, src = _subject(table, uses_of)
    i = uses_of(src)[0]
    name = src.toks[i].text
    wrong = re.sub(r"\d+$", "99", name) if name[-1].isdigit() else name[:-1]
    if wrong in table.constants or table.known_type(wrong):
        wrong = name + "X"
    _bites(_edit(text, src, i, i + 1, wrong), src.toks[i].line, wrong, "not in Apple's Metal API", table=table)


def test_bites_enum_constant_of_another_enum(table):
    def enum_args(src):
        return [(m, p) for m, t in _resolved(src, table) for p in m.parts
                if p.arg is not None and p.arg[1] - p.arg[0] == 1 and src.toks[p.arg[0]].text in table.constants]

    text, src = _subject(table, enum_args)
    m, p = enum_args(src)[0]
    enum = table.constants[src.toks[p.arg[0]].text][0]
    wrong = "MTLDataTypeBool" if enum != "MTLDataType" else "MTLDispatchTypeConcurrent"
    _bites(_edit(text, src, p.arg[0], p.arg[1], wrong), m.line, wrong, "passes", table=table)


def test_bites_misspelt_property(table):
    def property_lines(src):
        r = check.check_source(src.text, src.name, table)
        return [line for kind, line, _, _ in r.uses if kind.startswith("property")]

    text, src = _subject(table, property_lines)
    used = property_lines(src)
    d = next(i for i, t in enumerate(src.toks) if t.text == "." and t.line == used[0] and
             src.tok(i + 1).kind == "id" and src.expr_type(src.operand_before(i), i) is not None)
    name = src.toks[d + 1].text
    _bites(_edit(text, src, d + 1, d + 2, name[:-1]), used[0], name[:-1], "no property", table=table)


def _stub_copy(tmp_path):
    dst = tmp_path / "stubs"
    shutil.copytree(STUBS, dst)
    return dst


def _stub_bites(stubs, *words, table):
    r = check.check_stubs(stubs, table)
    hits = [e for e in r.errors if all(w in e.message for w in words)]
    assert hits, f"the stub plant ({words}) was not reported; errors:\n{_listing(r.errors)}"


def test_bites_wrong_enum_value_in_a_stub(tmp_path, table):
    stubs = _stub_copy(tmp_path)
    metal = stubs / "Metal" / "Metal.h"
    text = metal.read_text()
    m = next(m for m in re.finditer(r"\b(MTL\w+)\s*=\s*([^,}\n]+)", text) if m.group(1) in table.constants)
    metal.write_text(text[:m.start(2)] + f"({m.group(2).strip()}) + 1" + text[m.end(2):])
    _stub_bites(stubs, m.group(1), "Apple's value", table=table)


def test_bites_misspelt_selector_in_a_stub(tmp_path, table):
    stubs = _stub_copy(tmp_path)
    metal = stubs / "Metal" / "Metal.h"
    text = metal.read_text()
    m = next(m for m in re.finditer(r"^[-+]\s*\([^)]*\)\s*([a-z]\w+)", text, re.M)
             if m.group(1)[:-1] + ":" not in table.selectors and m.group(1)[:-1] not in table.selectors)
    metal.write_text(text[:m.end(1) - 1] + text[m.end(1):])
    _stub_bites(stubs, m.group(1)[:-1], "the stub declares", table=table)


# ---------------------------------------------------------------------------------------------
# availability: the stubs against Apple's macOS 14.0 SDK (no download: the table is committed)
# ---------------------------------------------------------------------------------------------
def test_sdk_table_covers_the_stubs_and_names_its_source():
    table = sdk.load_table()
    text = sdk.TABLE.read_text()
    assert "MacOSX14.0.sdk" in text and "13b69291228b5fd1553496c6db10c957a9f0c96a" in text
    assert f"# oldest-sdk {sdk.OLDEST_SDK}" in text
    # facts the issue rests on: 3.2 and mathMode are not in the 14.0 SDK; 3.1 is, from macOS 14
    assert table["enum MTLLanguageVersion3_2"] == "absent" and table["property MTLCompileOptions.mathMode"] == "absent"
    assert table["enum MTLLanguageVersion3_1"] == "14.0" and table["property MTLCompileOptions.fastMathEnabled"] == "10.11"
    assert set(sdk.stub_symbols(STUBS)) == set(table), "run python tools/metal_api/sdk.py on the SDK headers"


def test_stub_availability_is_the_sdks():
    errors = sdk.check_stubs(STUBS, sdk.load_table())
    assert not errors, "tools/mslsim/objc/stubs disagree with the macOS 14.0 SDK:\n" + "\n".join(errors)


def test_sdk_reader_inherits_and_guards():
    # the reader, on a header in Apple's style: a member's annotation, else its type's
    h = """
typedef NS_ENUM(NSUInteger, E) {
    E1 = 1,
    E2 API_AVAILABLE(macos(15.0), ios(18.0)) = 2,
    E3 API_DEPRECATED("x", macos(10.11, 13.0)) = 3,
} API_AVAILABLE(macos(10.12), ios(9.0));
MTL_EXPORT API_AVAILABLE(macos(10.11), ios(8.0))
@interface C : NSObject <NSCopying>
@property (readwrite, nonatomic) BOOL p API_DEPRECATED("Use q instead", macos(10.11, 15.0), ios(8.0, 18.0));
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
@property (readwrite, nonatomic) E q API_AVAILABLE(macos(15.0), ios(18.0));
#endif
- (nullable id <P>)newThingWithA:(NSString *)a b:(nullable C *)b error:(__autoreleasing NSError **)e;
@end
MTL_EXTERN NSArray <id<P>> *MTLMakeAll(void) API_AVAILABLE(macos(10.11)) API_UNAVAILABLE(ios) NS_RETURNS_RETAINED;
"""
    got = {k: (d.introduced, d.sdk_guard) for k, d in sdk.read(h).items()}
    assert got == {"type E": ("10.12", 0), "enum E1": ("10.12", 0), "enum E2": ("15.0", 0), "enum E3": ("10.11", 0),
                   "type C": ("10.11", 0), "property C.p": ("10.11", 0), "property C.q": ("15.0", 150000),
                   "method C -newThingWithA:b:error:": ("10.11", 0), "function MTLMakeAll": ("10.11", 0)}, got


@pytest.mark.parametrize("plant", ["unguarded", "annotation"])
def test_bites_stub_availability(tmp_path, plant):
    # a stub that declares macOS 15's language version without the SDK guard (so that the macOS 14
    # SDK build check would pass a use of it), or drops an annotation Apple's SDK has
    stubs = _stub_copy(tmp_path)
    metal = stubs / "Metal" / "Metal.h"
    text = metal.read_text()
    if plant == "unguarded":
        m = re.search(r"#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000\n(\s*MTLLanguageVersion3_2[^\n]*\n)#endif\n", text)
        metal.write_text(text[:m.start()] + m.group(1) + text[m.end():])
        want = ("MTLLanguageVersion3_2", "without `#if __MAC_OS_X_VERSION_MAX_ALLOWED")
    else:
        metal.write_text(text.replace("MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0))", "MTLLanguageVersion3_1", 1))
        want = ("MTLLanguageVersion3_1", "from macOS 14.0")
    errors = sdk.check_stubs(stubs, sdk.load_table())
    assert any(all(w in e for w in want) for e in errors), errors
