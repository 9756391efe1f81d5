"""Which macOS SDK declares a Metal/Foundation symbol, and from which macOS it is available.

Reads Objective-C headers written in Apple's style (the SDK's own, and the clang stubs of
tools/mslsim/objc/stubs, which follow it) into {symbol: Decl}. A symbol is named by kind:

    enum MTLLanguageVersion3_1          an enum constant
    type MTLCompileOptions              a class, protocol, NS_ENUM/NS_OPTIONS type or struct typedef
    method MTLDevice -newCommandQueue   a method, with its class or protocol (categories fold in)
    property MTLCompileOptions.mathMode a property
    function MTLCreateSystemDefaultDevice

Decl.introduced is the macOS version of its API_AVAILABLE / API_DEPRECATED annotation, or of the
enclosing declaration's where it has none (Apple annotates a member only where it is newer than
its type), or "" where neither says. Decl.sdk_guard is the SDK version (150000 for 15.0) of an
enclosing `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= N` block (the stubs' compile-time guard), or 0.

The table Apple's macOS 14.0 SDK gives for the stubs' symbols is committed as
sdk14_availability.txt; `python tools/metal_api/sdk.py HEADERS` writes it again (see TABLE_SOURCE).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "sdk14_availability.txt"
# The oldest SDK the build supports (Xcode 15.0, the macos-14 runners) and where its headers were read.
OLDEST_SDK = "14.0"
TABLE_SOURCE = ("Apple's MacOSX14.0.sdk headers (Metal.framework, Foundation.framework, usr/include/objc) as "
                "mirrored by github.com/hexops/xcode-frameworks at commit 13b69291228b5fd1553496c6db10c957a9f0c96a, "
                "whose update.sh copied them from Xcode's MacOSX14.0.sdk")
# Header folders of an SDK (or of that mirror), relative to its root.
SDK_DIRS = ("System/Library/Frameworks/Metal.framework/Headers", "System/Library/Frameworks/Foundation.framework/Headers",
            "usr/include/objc", "Frameworks/Metal.framework/Headers", "Frameworks/Foundation.framework/Headers",
            "include/objc")


@dataclass
class Decl:
    introduced: str   # "15.0", or "" where no annotation says
    sdk_guard: int    # 150000 under `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000`, else 0
    file: str
    line: int


def version_key(v: str) -> tuple:
    return tuple(int(x) for x in v.split(".")) if v else (0,)


_MACOS = re.compile(r"\bmacos\s*\(\s*([\d.]+)")
_UNAVAILABLE = re.compile(r"\bAPI_UNAVAILABLE\s*\([^)]*\bmacos\b")
# Apple's annotation and declaration macros (upper case, optionally with balanced arguments):
# removed before names are read. BOOL and the like are upper case too, but never a name we read.
_MACRO = re.compile(r"\b[A-Z][A-Z0-9_]{2,}\b(?:\s*\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\))?")


def introduced(text: str) -> str | None:
    """The macOS version an annotation in `text` gives (API_AVAILABLE(macos(15.0)) -> "15.0";
    API_DEPRECATED(..., macos(10.11, 15.0)) -> "10.11"), "never" for API_UNAVAILABLE(macos), or None."""
    if _UNAVAILABLE.search(text):
        return "never"
    m = _MACOS.search(text)
    if m:
        return m.group(1)
    m = re.search(r"\b__attribute__\s*\(\(\s*availability\s*\(\s*macos\s*,\s*introduced\s*=\s*([\d.]+)", text)
    return m.group(1) if m else None


def _blank(m):
    return re.sub(r"[^\n]", " ", m.group(0))


def _guards(text: str) -> list:
    """(start, end, N) of each `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= N` ... `#endif` block."""
    out, stack = [], []
    for m in re.finditer(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|elif|else|endif)\b([^\n]*)", text, re.M):
        kind, rest = m.group(1), m.group(2)
        if kind.startswith("if"):
            g = re.search(r"__MAC_OS_X_VERSION_MAX_ALLOWED\s*>=\s*(\d+)", rest) if kind == "if" else None
            stack.append((m.end(), int(g.group(1)) if g else 0))
        elif kind in ("elif", "else") and stack:
            start, n = stack.pop()
            if n:
                out.append((start, m.start(), n))
            stack.append((m.end(), 0))
        elif kind == "endif" and stack:
            start, n = stack.pop()
            if n:
                out.append((start, m.start(), n))
    return out


def read(text: str, name: str = "") -> dict:
    """{symbol: Decl} of one header."""
    guards = _guards(text)
    code = re.sub(r"/\*.*?\*/|//[^\n]*", _blank, text, flags=re.S)
    code = re.sub(r"^[ \t]*#[^\n]*(?:\\\n[^\n]*)*", _blank, code, flags=re.M)
    out = {}

    def guard_at(pos):
        return max([n for a, b, n in guards if a <= pos < b], default=0)

    def add(sym, pos, own, outer=""):
        v = own if own is not None else outer
        if sym not in out:
            out[sym] = Decl(v or "", guard_at(pos), name, code.count("\n", 0, pos) + 1)

    # enums: typedef NS_ENUM(T, Name) { ... } annotation;
    for m in re.finditer(r"\btypedef\s+NS_(?:ENUM|OPTIONS|CLOSED_ENUM)\s*\(\s*\w+\s*,\s*(\w+)\s*\)\s*\{", code):
        close = code.index("}", m.end())
        tail = code[close:code.index(";", close)]
        own = introduced(tail)
        add(f"type {m.group(1)}", m.start(), own)
        pos = m.end()
        for item in _top_split(code[m.end():close]):
            words = re.match(r"\s*(\w+)", item)
            if words:
                add(f"enum {words.group(1)}", pos + words.start(1), introduced(item.split("=")[0]), own or "")
            pos += len(item) + 1
    # struct typedefs: typedef struct { ... } MTLSize;
    for m in re.finditer(r"\btypedef\s+struct\s*(?:\w+\s*)*\{[^{}]*\}\s*(\w+)([^;]*);", code):
        add(f"type {m.group(1)}", m.start(), introduced(m.group(2)))
    # classes, protocols and their members (categories: @interface NSString (Extras))
    for m in re.finditer(r"@(interface|protocol)\s+(\w+)\b", code):
        after = code[m.end():m.end() + 2].lstrip()
        if m.group(1) == "protocol" and re.match(r"\s*[;,]", code[m.end():]):
            continue  # a forward declaration
        if m.group(1) == "interface" and re.match(r"\s*;", code[m.end():]):
            continue
        owner = m.group(2)
        end = code.index("@end", m.end())
        line_start = code.rfind("\n", 0, m.start())
        prefix = code[code.rfind("\n", 0, line_start) + 1:m.start()]  # the annotation line(s) before it
        category = re.match(r"\s*\(", code[m.end():])
        own = introduced(prefix) if not category else None
        if not category:
            add(f"type {owner}", m.start(), own)
        outer = out[f"type {owner}"].introduced if f"type {owner}" in out else ""
        del after
        body_start = code.index("\n", m.end())
        pos = body_start
        for stmt in code[body_start:end].split(";"):
            s = stmt.strip()
            at = pos + (len(stmt) - len(stmt.lstrip()))
            pos += len(stmt) + 1
            if s.startswith(("-", "+")):
                sel = _selector(s)
                if sel:
                    add(f"method {owner} {s[0]}{sel}", at, introduced(s), outer)
            elif s.startswith("@property"):
                prop = _property(s)
                if prop:
                    add(f"property {owner}.{prop}", at, introduced(s), outer)
    # C functions: a declaration at file level (after ; { or }) whose name is MTL.../NS...
    flat = code.replace("@end", ";end")  # so that a function right after an @end starts a statement
    for m in re.finditer(r"(?:^|(?<=[;{}]))([^;{}()@=]*?)\b((?:MTL|NS)[A-Z]\w*)\s*\(([^;{}]*?)\)([^;{}]*)[;{]", flat):
        pre = m.group(1)
        if re.search(r"\b(typedef|return)\b", pre) or not re.search(r"[\w*]\s*$", pre):
            continue
        add(f"function {m.group(2)}", m.start(2), introduced(m.group(4)) or introduced(pre))
    return out


def _top_split(body: str) -> list:
    """body split at the commas outside parentheses (an annotation's own commas stay inside)."""
    out, depth, cur = [], 0, ""
    for ch in body:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def _selector(stmt: str) -> str | None:
    s = _MACRO.sub(" ", stmt[1:])
    s = re.sub(r"^\s*\((?:[^()]|\([^()]*\))*\)", " ", s)  # the return type
    flat, depth = "", 0
    for ch in s:  # parameter types out
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            flat += ch
    parts = re.findall(r"(\w+)\s*:", flat)
    if parts:
        return "".join(p + ":" for p in parts)
    w = re.match(r"\s*(\w+)", flat)
    return w.group(1) if w else None


def _property(stmt: str) -> str | None:
    s = re.sub(r"^@property\s*(\([^)]*\))?", " ", stmt)
    s = _MACRO.sub(" ", s)
    words = re.findall(r"\w+", s)
    return words[-1] if words else None


def read_tree(dirs) -> dict:
    out = {}
    for d in dirs:
        for h in sorted(Path(d).glob("*.h")):
            for sym, decl in read(h.read_text(errors="replace"), h.name).items():
                out.setdefault(sym, decl)
    return out


def stub_symbols(stubs: Path) -> dict:
    return read_tree([stubs / "Foundation", stubs / "Metal"])


def load_table(path: Path = TABLE) -> dict:
    """{symbol: introduced or "absent"} from the committed table."""
    out = {}
    for ln in path.read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            sym, _, v = ln.rpartition(" ")
            out[sym] = v
    return out


# Annotations the stubs must carry exactly: those from macOS 13 on (older API predates every
# macOS that can run krnl; the stubs may leave it unannotated).
RECENT = "13.0"


def check_stubs(stubs: Path, table: dict) -> list:
    """Where the stubs' availability disagrees with the table (one line each): a symbol the
    oldest SDK lacks must sit under `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= N` (N above it) and,
    where annotated, be introduced after it; one it has must not be SDK-guarded, and must carry
    the SDK's annotation where that is recent."""
    oldest = version_key(OLDEST_SDK)
    errors = []
    for sym, d in sorted(stub_symbols(stubs).items()):
        where = f"{d.file}:{d.line}: {sym}"
        if sym not in table:
            errors.append(f"{where}: not in {TABLE.name}; run python tools/metal_api/sdk.py on a MacOSX{OLDEST_SDK}.sdk")
            continue
        sdk = table[sym]
        if sdk == "absent":
            need = oldest[0] * 10000 + (oldest[1] if len(oldest) > 1 else 0) * 100
            if d.sdk_guard <= need:
                errors.append(f"{where}: the macOS {OLDEST_SDK} SDK lacks it, but the stub declares it "
                              f"without `#if __MAC_OS_X_VERSION_MAX_ALLOWED >= N` (N > {need})")
            if d.introduced and version_key(d.introduced) <= oldest:
                errors.append(f"{where}: the macOS {OLDEST_SDK} SDK lacks it, yet the stub says it is "
                              f"available from macOS {d.introduced}")
            continue
        if d.sdk_guard:
            errors.append(f"{where}: the macOS {OLDEST_SDK} SDK declares it; the stub hides it under an SDK guard")
        if sdk != "-" and version_key(sdk) >= version_key(RECENT) and d.introduced != sdk:
            errors.append(f"{where}: Apple's SDK makes it available from macOS {sdk}; the stub says "
                          f"{d.introduced or 'nothing'} (write API_AVAILABLE(macos({sdk})))")
        elif d.introduced and sdk != "-" and d.introduced != sdk:
            errors.append(f"{where}: the stub says macOS {d.introduced}; Apple's SDK says {sdk}")
    return errors


def write_table(sdk_root: Path, stubs: Path, path: Path = TABLE) -> None:
    dirs = [sdk_root / d for d in SDK_DIRS if (sdk_root / d).is_dir()]
    if not any(d.name == "Headers" and d.parent.name == "Metal.framework" for d in dirs):
        raise SystemExit(f"{sdk_root}: no Metal.framework/Headers under it (give the SDK's root)")
    sdk = read_tree(dirs)
    lines = [f"# The macOS availability of each symbol tools/mslsim/objc/stubs declare, in {TABLE_SOURCE}.",
             "# Facts only (a name, and the macOS version its API_AVAILABLE annotation gives, inherited from the",
             "# enclosing declaration where it has none; '-' where no annotation says; 'absent' where that SDK",
             "# does not declare it). Written by: python tools/metal_api/sdk.py SDK_ROOT (after a stub changes).",
             f"# oldest-sdk {OLDEST_SDK}"]
    for sym in sorted(stub_symbols(stubs)):
        d = sdk.get(sym)
        lines.append(f"{sym} {'absent' if d is None else d.introduced or '-'}")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/metal_api/sdk.py SDK_ROOT  (a MacOSX14.0.sdk, or a mirror of its headers)")
    write_table(Path(sys.argv[1]), HERE.parents[1] / "tools" / "mslsim" / "objc" / "stubs")
    print(f"wrote {TABLE}")
