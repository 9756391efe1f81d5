"""The checks: an Objective-C++ source, and the hand-written stubs, against Apple's table.

Each check returns a Report: errors (a use that Apple's table contradicts, or that it lacks
although it covers that part of the API) and unchecked items (what the table or this reader
cannot decide, each with the reason), plus a count of what was verified.

Coverage rule: metal-cpp wraps the whole Metal API, so a Metal name, selector or constant that
it lacks is an error. Its Foundation part wraps only what Metal programs commonly need, so a
Foundation name or selector it lacks is listed as unchecked, not failed.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .apple import Table, evaluate
from .objc import OBJC_NAME, QUALIFIERS, Source, tokenize

# Apple's variadic selectors (a C varargs list after the last part); metal-cpp wraps none, so
# their extra arguments are listed, not counted.
VARIADIC = {"stringWithFormat:", "initWithFormat:", "localizedStringWithFormat:", "arrayWithObjects:",
            "dictionaryWithObjectsAndKeys:", "setWithObjects:", "stringByAppendingFormat:"}
# NSObject is both Foundation's root class and a protocol; metal-cpp lists only the class.
BOTH = {"NSObject"}
# NSObject basics metal-cpp does not wrap (its NS::Object has alloc and init, not +new, which is
# alloc then init): accepted by name, and counted as such.
NSOBJECT_BASICS = {("+", "new")}
FOUNDATION_GAP = "not wrapped by metal-cpp's Foundation part (a subset of Foundation): cannot be checked"
PLATFORMS = {"macOS", "iOS", "tvOS", "watchOS", "visionOS", "xrOS", "macCatalyst", "*",
             "macOSApplicationExtension", "iOSApplicationExtension"}


@dataclass
class Finding:
    file: str
    line: int
    message: str
    kind: str = ""   # stubs: "enum", "interface" (selectors, protocols, classes) or "function"

    def __str__(self):
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class Unchecked:
    file: str
    line: int
    item: str
    reason: str

    def __str__(self):
        return f"{self.file}:{self.line}: {self.item}: {self.reason}"


@dataclass
class Report:
    errors: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)
    checked: Counter = field(default_factory=Counter)
    uses: list = field(default_factory=list)   # (kind, line, text, detail) of what was verified

    def extend(self, other: "Report") -> None:
        self.errors += other.errors
        self.unchecked += other.unchecked
        self.checked.update(other.checked)
        self.uses += other.uses


def _foundation(name: str) -> bool:
    return name.startswith("NS")


def _describe_chain(table: Table, name: str) -> str:
    return " < ".join(t.name for t in table.chain(name)) or name


class _MM:
    """The checks of one .mm file."""

    def __init__(self, text: str, name: str, table: Table):
        self.table, self.name = table, name
        self.r = Report()
        try:
            self.src = Source(text, name, table)
        except SyntaxError as e:
            self.src = None
            self.r.errors.append(Finding(name, 0, f"could not be read: {e}"))

    def err(self, line, msg):
        self.r.errors.append(Finding(self.name, line, msg))

    def skip(self, line, item, reason):
        self.r.unchecked.append(Unchecked(self.name, line, item, reason))

    def ok(self, kind, line, text, **detail):
        self.r.checked[kind] += 1
        self.r.uses.append((kind, line, text, detail))

    def run(self) -> Report:
        if self.src is None:
            return self.r
        self.meta_names = set()   # tokens that are selector parts or property names
        for m in sorted(self.src.messages.values(), key=lambda m: m.open):
            self.message(m)
        self.properties()
        self.functions()
        self.identifiers()
        self.comparisons()
        self.casts()
        self.available()
        self.skip(0, "non-enum argument types",
                  "pointer, integer, struct and object argument types are not compared with Apple's signatures "
                  "(the clang check against the stubs does that; only enum arguments and block parameters are "
                  "compared here)")
        self.implicit()
        return self.r

    def implicit(self):
        """Syntax that sends messages the file does not spell: listed, not checked."""
        src = self.src
        for i, t in enumerate(src.toks):
            if t.text == "in" and src.parent[i] >= 0 and src.tok(src.parent[i] - 1).text == "for":
                self.skip(t.line, "for (... in ...)", "fast enumeration sends countByEnumeratingWithState:objects:"
                                                     "count:, which is not checked")
            elif t.text == "[" and i not in src.messages and i > 0 and src.toks[i - 1].text != "@":
                start = src.operand_before(i)
                ty = src.expr_type(start, i) if start < i else None
                if ty is not None and ty.kind == "objc":
                    self.skip(t.line, f"{src.text_of(start, i)}[...]", "object subscripting sends "
                              "objectAtIndexedSubscript: or objectForKeyedSubscript:, which is not checked")
            elif t.kind == "at" and t.text == "@" and src.tok(i + 1) is not None and src.tok(i + 1).text in "[{(":
                self.skip(t.line, f"@{src.tok(i + 1).text}...", "a boxed or collection literal sends Foundation "
                                                                "messages, which are not checked")

    # -----------------------------------------------------------------------------------------
    def message(self, m):
        src, tb = self.src, self.table
        sel = m.selector
        recv_text = src.text_of(*m.receiver)
        written = f"[{recv_text} {sel}]"
        self.meta_names |= {p.name_tok for p in m.parts}
        # one argument per selector part (a top-level comma is a second argument)
        for k, p in enumerate(m.parts):
            if p.arg is None:
                continue
            commas = [a for a, b in src.top(*p.arg) if src.toks[a].text == ","]
            if commas:
                if k == len(m.parts) - 1 and sel in VARIADIC:
                    self.skip(m.line, f"variadic arguments of {written}", "not counted (metal-cpp wraps no "
                                                                            "variadic selector)")
                else:
                    self.err(m.line, f"{written}: its {p.name}: part is given {len(commas) + 1} comma-separated "
                                     f"arguments; a selector part takes exactly one ({sel} takes {len(m.parts)})")
        recv = src.receiver_type(m)
        if recv is None or recv.kind != "objc":
            where = ", ".join(tb.senders(sel)[:6]) or "no type"
            if sel in tb.selectors:
                self.skip(m.line, written, f"receiver type not determined from the file's declarations; the selector "
                                           f"exists in Apple's table (sent to {where})")
            else:
                self.err(m.line, f"{written}: selector {sel} is not in Apple's table (metal-cpp {tb.version}), and "
                                 "the receiver's type could not be determined either")
            return
        name, meta = recv.name, recv.meta
        if not tb.known_type(name):
            if _foundation(name):
                self.skip(m.line, written, FOUNDATION_GAP)
            # a Metal name unknown to Apple is reported by identifiers()
            return
        sends = [s for n in (name,) + recv.also for s in tb.lookup(n, sel, meta)]
        sign = "+" if meta else "-"
        if not sends and (sign, sel) in NSOBJECT_BASICS and "NSObject" in [t.name for t in tb.chain(name)]:
            self.ok("message (NSObject basic)", m.line, f"{sign}[{name} {sel}]")
            return
        if not sends:
            if _foundation(name):
                self.skip(m.line, f"{sign}[{name} {sel}]", FOUNDATION_GAP)
                return
            others = tb.senders(sel)
            self.err(m.line, f"{written}: Apple's table has no {'class' if meta else 'instance'} message {sel} for "
                             f"{name} or its bases ({_describe_chain(tb, name)}); "
                             + (f"{sel} is sent to: {', '.join(others)}" if others else
                                f"{sel} is not a selector of Apple's table at all"))
            return
        self.ok("message", m.line, f"{sign}[{name} {sel}]", owner=sends[0].method.owner, args=len(m.parts)
                if m.parts[0].arg is not None else 0)
        self.enum_args(m, sends, written)
        self.block_args(m, sends, written)

    def _params(self, sends, nparts):
        return [s.method.params for s in sends if len(s.method.params) == nparts]

    def enum_args(self, m, sends, written):
        for k, p in enumerate(m.parts):
            if p.arg is None:
                continue
            consts = self.constants_in(*p.arg)
            if not consts:
                continue
            expected = {self.param_enum(params[k]) for params in self._params(sends, len(m.parts))}
            expected.discard(None)
            self.check_enum_use(m.line, f"{written}, {p.name}:", consts, expected)

    def block_args(self, m, sends, written):
        src = self.src
        for k, p in enumerate(m.parts):
            if p.arg is None or src.toks[p.arg[0]].text != "^":
                continue
            ours = self.block_params(p.arg[0])
            if ours is None:
                continue
            for params in self._params(sends, len(m.parts)):
                theirs = self.apple_block(params[k])
                if theirs is None:
                    continue
                if len(theirs) != len(ours):
                    self.err(m.line, f"{written}: the block for {p.name}: takes {len(ours)} parameters; Apple's "
                                     f"block type {params[k]!r} takes {len(theirs)}")
                    return
                for a, (mine, apple) in enumerate(zip(ours, theirs)):
                    if mine is not None and mine.kind == "objc" and apple is not None and mine.name != apple:
                        self.err(m.line, f"{written}: block parameter {a + 1} is declared {mine}; Apple's block "
                                         f"type passes {apple}")
                self.ok("block", m.line, f"{m.selector} {p.name}: block of {len(ours)} parameters")
                return
            self.skip(m.line, f"{written} block", "Apple's parameter type for the block could not be read")

    def block_params(self, caret: int):
        src = self.src
        k = caret + 1
        while src.tok(k) is not None and src.tok(k).kind == "id" and src.tok(k).text != "(":
            k += 1  # a return type
        t = src.tok(k)
        if t is None:
            return None
        if t.text == "{":
            return []
        if t.text != "(":
            return None
        out = []
        for a, b in self._split(k + 1, src.match[k]):
            if b - a == 1 and src.toks[a].text == "void":
                continue
            got = src._type_at(a)
            out.append(got[0] if got and got[0].kind == "objc" else None)
        return out

    def _split(self, a, b):
        out, start = [], a
        for x, y in self.src.top(a, b):
            if self.src.toks[x].text == ",":
                out.append((start, x))
                start = y
        if start < b:
            out.append((start, b))
        return out

    def apple_block(self, param: str):
        tb = self.table
        text = re.sub(r"\bconst\b", "", param).strip()
        m = re.fullmatch(r"(?:(MTL|NS)::)?(\w+)(?:\s+\w+)?", text)
        if m:
            alias = (m.group(1) or "MTL") + m.group(2)
            text = tb.usings.get(alias, "")
        m = re.search(r"\(\s*\^\s*\w*\s*\)\s*\((.*)\)\s*$", text)
        if not m:
            return None
        out = []
        for p in [x.strip() for x in m.group(1).split(",") if x.strip() and x.strip() != "void"]:
            p = re.sub(r"(\*|\s)\s*\w+$", r"\1", p) if re.search(r"[\w*]\s+\w+$|\*\s*\w+$", p) else p
            got = tb.objc_of_cpp(p.strip())
            out.append(got[0] if got and got[1] == 1 else None)
        return out

    def param_enum(self, param: str):
        text = re.sub(r"\bconst\b", "", param).strip()
        text = re.sub(r"\s+\w+$", "", text)  # the parameter's name
        got = self.table.objc_of_cpp(text)
        return got[0] if got and got[1] == 0 and got[0] in self.table.enums else None

    def constants_in(self, a: int, b: int):
        """The enum constants of [a, b) when it is a constant expression of them (A, A | B,
        (A)); else []."""
        toks = self.src.toks[a:b]
        names = [t.text for t in toks if t.kind == "id"]
        if not names or any(n not in self.table.constants for n in names):
            return []
        if any(t.kind == "punct" and t.text not in ("|", "(", ")") for t in toks):
            return []
        return names

    def check_enum_use(self, line, where, consts, expected):
        tb = self.table
        for c in consts:
            enum, value = tb.constants[c]
            if expected and enum not in expected:
                self.err(line, f"{where} passes {c} (a {enum}) where Apple's signature takes "
                               f"{' or '.join(sorted(expected))}")
            elif expected:
                self.ok("enum argument", line, f"{c} as {enum}")

    # -----------------------------------------------------------------------------------------
    def properties(self):
        src, tb = self.src, self.table
        for d, t in enumerate(src.toks):
            if t.text != "." or src.tok(d + 1) is None or src.tok(d + 1).kind != "id":
                continue
            prev = src.tok(d - 1)
            if prev is None or not (prev.kind == "id" or prev.text in (")", "]")):
                continue
            start = src.operand_before(d)
            if start >= d:
                continue
            ty = src.expr_type(start, d)
            if ty is None or ty.kind != "objc":
                continue
            name = src.toks[d + 1].text
            self.meta_names.add(d + 1)
            op = src.tok(d + 2)
            written = f"{src.text_of(start, d)}.{name}"
            setter = op is not None and op.text == "="
            compound = op is not None and op.kind == "punct" and op.text.endswith("=") and op.text not in (
                "==", "!=", "<=", ">=", "=")
            if ty.meta:
                sends = tb.lookup(ty.name, name, True)
                if sends:
                    self.ok("class property", t.line, f"{ty.name}.{name}")
                elif _foundation(ty.name):
                    self.skip(t.line, written, FOUNDATION_GAP)
                else:
                    self.err(t.line, f"{written}: Apple's table has no class property {name} on {ty.name}")
                continue
            if not tb.known_type(ty.name):
                continue
            for role in (["set"] if setter else ["get", "set"] if compound else ["get"]):
                s = src.property(ty, name, setter=role == "set")
                if s is None:
                    if _foundation(ty.name):
                        self.skip(t.line, written, FOUNDATION_GAP)
                        break
                    what = f"a setter set{name[:1].upper()}{name[1:]}:" if role == "set" else "a getter"
                    self.err(t.line, f"{written}{' = ...' if role == 'set' else ''}: {ty.name} (or its bases: "
                                     f"{_describe_chain(tb, ty.name)}) has no property {name} with {what} in "
                                     f"Apple's table")
                    break
                self.ok("property " + role, t.line, f"{ty.name}.{name} -> {s.selector}")
                if role == "set" and setter:
                    stop = src._expr_stop(d + 3)
                    consts = self.constants_in(d + 3, stop)
                    if consts:
                        expected = {self.param_enum(s.method.params[0])} - {None}
                        self.check_enum_use(t.line, f"{written} =", consts, expected)

    # -----------------------------------------------------------------------------------------
    def functions(self):
        src, tb = self.src, self.table
        for i, t in enumerate(src.toks):
            if t.kind != "id" or t.text not in tb.functions:
                continue
            p = src.tok(i - 1)
            if p is not None and p.text in (".", "->", "::"):
                continue
            f = tb.functions[t.text]
            nxt = src.tok(i + 1)
            if nxt is None or nxt.text != "(":
                self.skip(t.line, t.text, "named but not called: its use is not checked")
                continue
            n = len(self._split(i + 2, src.match[i + 1]))
            if n == 1 and src.match[i + 1] == i + 3 and src.toks[i + 2].text == "void":
                n = 0
            if n != f.nparams:
                self.err(t.line, f"{t.text}(...) is called with {n} argument{'s' * (n != 1)}; Apple's {f.cpp} takes "
                                 f"{f.nparams}")
            else:
                self.ok("function", t.line, f"{t.text}/{n}")

    # -----------------------------------------------------------------------------------------
    def identifiers(self):
        src, tb = self.src, self.table
        local = set(src.decls) | set(src.functions)
        seen_const = set()
        for i, t in enumerate(src.toks):
            if t.kind != "id" or not OBJC_NAME.match(t.text) or i in self.meta_names or t.text in local:
                continue
            p = src.tok(i - 1)
            if p is not None and p.text in (".", "->", "::"):
                continue
            n = t.text
            if n in tb.constants:
                enum, value = tb.constants[n]
                self.ok("enum constant", t.line, f"{n} = {value} ({enum})")
                seen_const.add(n)
            elif n in tb.functions or n in tb.string_constants:
                pass  # calls are checked by functions()
            elif tb.known_type(n) or n in tb.enums or n in tb.type_names:
                self.type_use(i, n)
            elif _foundation(n):
                self.skip(t.line, n, FOUNDATION_GAP)
            elif re.search(r"(Domain|Key|Notification|Name)$", n) and src.tok(i + 1) is not None and \
                    src.tok(i + 1).text not in ("(", "*"):
                # metal-cpp leaves out some of Metal's global NSString constants
                # (MTLCommandBufferErrorDomain): a name of that form is listed, not failed
                self.skip(t.line, n, "looks like a Metal NSString constant; metal-cpp wraps only some of them")
            else:
                near = [c for c in list(tb.constants) + list(tb.types) if c[:12] == n[:12]][:4]
                self.err(t.line, f"{n} is not in Apple's Metal API (metal-cpp {tb.version}): no class, protocol, "
                                 f"type, enum constant or function of that name"
                                 + (f" (similar: {', '.join(near)})" if near else ""))

    def type_use(self, i, n):
        src, tb = self.src, self.table
        t = src.toks[i]
        p, pp, nx = src.tok(i - 1), src.tok(i - 2), src.tok(i + 1)
        in_id = p is not None and (p.text == "<" and pp is not None and pp.text == "id" or
                                   p.text == "," and self._in_protocol_list(i))
        if in_id:
            if n in tb.protocols or n in BOTH:
                self.ok("protocol", t.line, n)
            elif n in tb.classes:
                self.err(t.line, f"id<{n}>: {n} is a class in Apple's table, not a protocol (spell it {n}*)")
            elif n in tb.types:
                self.ok("protocol", t.line, n)
                self.skip(t.line, f"id<{n}>", "metal-cpp wraps it but does not list it as a protocol or a class")
            else:
                self.err(t.line, f"id<{n}>: {n} is not a protocol of Apple's table")
            return
        if nx is not None and nx.text == "*" and n in tb.protocols and n not in tb.classes and n not in BOTH:
            self.err(t.line, f"{n}*: {n} is a protocol in Apple's table, not a class (spell it id<{n}>)")
            return
        self.ok("type", t.line, n)

    def _in_protocol_list(self, i):
        src = self.src
        k = i - 1
        while k >= 1 and src.toks[k].text == "," and src.toks[k - 1].kind == "id":
            k -= 2
        return src.toks[k].text == "<" and k >= 1 and src.toks[k - 1].text == "id"

    # -----------------------------------------------------------------------------------------
    def comparisons(self):
        src = self.src
        for c, t in enumerate(src.toks):
            if t.text not in ("==", "!="):
                continue
            left = src.operand_before(c)
            right = src.operand_after(c + 1)
            for (a, b), (x, y) in (((left, c), (c + 1, right)), ((c + 1, right), (left, c))):
                consts = self.constants_in(x, y)
                if not consts or a >= b:
                    continue
                ty = src.expr_type(a, b)
                if ty is not None and ty.kind == "enum":
                    self.check_enum_use(t.line, f"{src.text_of(a, b)} {t.text}", consts, {ty.name})

    def casts(self):
        src, tb = self.src, self.table
        for i, t in enumerate(src.toks):
            if t.kind != "id" or t.text not in tb.enums:
                continue
            p, nx = src.tok(i - 1), src.tok(i + 1)
            # a variable of the enum type initialised with constants: they must be of that enum
            if nx is not None and nx.kind == "id" and src.tok(i + 2) is not None and src.tok(i + 2).text in ("=", "{"):
                a = i + 3
                b = src.match[i + 2] if src.toks[i + 2].text == "{" else src._expr_stop(a)
                consts = self.constants_in(a, b)
                if consts:
                    self.check_enum_use(t.line, f"{t.text} {nx.text} =", consts, {t.text})
                continue
            rng = None
            if p is not None and p.text == "(" and nx is not None and nx.text == ")" and src.match[i - 1] == i + 1:
                rng = (i + 2, src.operand_after(i + 2))
            elif nx is not None and nx.text == "(" and (p is None or p.text not in ("(",)):
                rng = (i + 2, src.match[i + 1])
            elif p is not None and p.text == "<" and src.tok(i - 2) is not None and \
                    src.tok(i - 2).text == "static_cast" and nx is not None and nx.text == ">":
                rng = (i + 3, src.match[i + 2]) if src.tok(i + 2).text == "(" else None
            if rng is None or rng[0] >= rng[1]:
                continue
            expr = src.text_of(*rng)
            try:
                names = {k: v for k, (_, v) in tb.constants.items()}
                value = evaluate(expr, names)
            except (ValueError, SyntaxError, KeyError, TypeError):
                self.skip(t.line, f"({t.text}){expr}", "cast of a value known only at run time: not checked")
                continue
            e = tb.enums[t.text]
            if e.options:
                allbits = 0
                for v in e.values.values():
                    allbits |= v
                good = value & ~allbits == 0
            else:
                good = value in e.values.values()
            if not good:
                self.err(t.line, f"({t.text}){expr} = {value} is not a value of Apple's {t.text}")
            else:
                self.ok("enum value", t.line, f"({t.text}){expr} = {value}")

    def available(self):
        src = self.src
        for i, t in enumerate(src.toks):
            if t.text not in ("@available", "__builtin_available"):
                continue
            if src.tok(i + 1) is None or src.tok(i + 1).text != "(":
                self.err(t.line, "@available without its platform list")
                continue
            spec = src.text_of(i + 2, src.match[i + 1])
            for part in [x.strip() for x in spec.split(",")]:
                plat = part.split()[0] if part else ""
                if plat not in PLATFORMS:
                    self.err(t.line, f"@available({spec}): unknown platform {plat!r}")
            self.ok("@available", t.line, spec)
            self.skip(t.line, f"@available({spec})", "availability is not checked here (metal-cpp carries no "
                                                     "API_AVAILABLE attributes): tests/test_metal_host.py compiles "
                                                     "the file per SDK against the stubs' annotations")


def check_source(text: str, name: str, table: Table) -> Report:
    return _MM(text, name, table).run()


# ---------------------------------------------------------------------------------------------
# the hand-written stubs (tools/mslsim/objc/stubs)
# ---------------------------------------------------------------------------------------------
_UNDERLYING = {"NSUInteger": "NS::UInteger", "NSInteger": "NS::Integer", "uint64_t": "std::uint64_t",
               "int64_t": "std::int64_t", "uint32_t": "std::uint32_t", "int32_t": "std::int32_t"}


class _Stubs:
    def __init__(self, table: Table):
        self.table = table
        self.r = Report()
        self.section = ""

    def err(self, f, line, msg):
        self.r.errors.append(Finding(f, line, msg, self.section))

    def skip(self, f, line, item, reason):
        self.r.unchecked.append(Unchecked(f, line, item, reason))

    def ok(self, kind, line, text):
        self.r.checked[kind] += 1
        self.r.uses.append((kind, line, text, {}))

    def file(self, path: Path, label: str):
        text = path.read_text()
        try:
            toks = tokenize(text)
        except SyntaxError as e:
            self.err(label, 0, f"could not be read: {e}")
            return
        self.section = "enum"
        self.enums(toks, label)
        self.section = "interface"
        self.interfaces(toks, label)
        self.section = "function"
        self.c_functions(toks, label)

    # typedef NS_ENUM(T, Name) { A = v, B, ... };
    def enums(self, toks, f):
        tb = self.table
        for i, t in enumerate(toks):
            if t.text not in ("NS_ENUM", "NS_OPTIONS") or i + 5 >= len(toks) or toks[i + 1].text != "(":
                continue
            if toks[i - 1].text != "typedef":
                continue
            under, name = toks[i + 2].text, toks[i + 4].text
            k = i + 6
            if toks[k].text != "{":
                continue
            end = k + 1
            depth = 1
            while depth:
                depth += {"{": 1, "}": -1}.get(toks[end].text, 0)
                end += 1
            body = text_between(toks, k + 1, end - 1)
            e = tb.enums.get(name)
            if e is None:
                self.err(f, t.line, f"{t.text}({under}, {name}): Apple's table has no enum {name}")
                continue
            want = _UNDERLYING.get(under, under)
            if want != e.underlying and not e.underlying.endswith("::" + want.split("::")[-1]):
                self.err(f, t.line, f"{name}: the stub's underlying type is {under}; Apple's is {e.underlying}")
            if (t.text == "NS_OPTIONS") != e.options:
                self.err(f, t.line, f"{name}: the stub declares {t.text}; Apple's is "
                                    f"{'an options (bit mask) type' if e.options else 'a plain enum'}")
            names, nxt = {}, 0
            for item in _items(body):
                n, _, expr = item.partition("=")
                n = n.split()[0] if n.strip() else ""  # the name, without API_AVAILABLE(...) after it
                try:
                    v = evaluate(expr, names) if expr.strip() else nxt
                except (ValueError, SyntaxError) as ex:
                    self.err(f, t.line, f"{n}: value {expr.strip()!r} could not be evaluated ({ex})")
                    continue
                names[n], nxt = v, v + 1
                line = t.line + body[:body.find(n)].count("\n") if n in body else t.line
                if n not in tb.constants:
                    self.err(f, line, f"{n} (in the stub's {name}) is not an enum constant of Apple's table")
                    continue
                enum, apple = tb.constants[n]
                if enum != name:
                    self.err(f, line, f"{n}: the stub puts it in {name}; Apple's enum is {enum}")
                if apple != v:
                    self.err(f, line, f"{n} = {v} in the stub; Apple's value is {apple}")
                else:
                    self.ok("stub enum value", line, f"{n} = {v}")

    # @protocol / @interface blocks with methods and properties
    def interfaces(self, toks, f):
        tb = self.table
        i = 0
        while i < len(toks):
            t = toks[i]
            if t.text not in ("@protocol", "@interface") or i + 1 >= len(toks):
                i += 1
                continue
            name = toks[i + 1].text
            if toks[i + 2].text in (";", ","):  # a forward declaration
                i += 2
                continue
            end = next(k for k in range(i, len(toks)) if toks[k].text == "@end")
            kind = "protocol" if t.text == "@protocol" else "class"
            self.kind(f, t.line, name, kind)
            bases = self.bases(toks, i + 2, kind)
            for b in bases:
                chain = [x.name for x in tb.chain(name)]
                if b != "NSObject" and tb.known_type(name) and b not in chain:
                    self.err(f, t.line, f"{t.text} {name}: the stub derives it from {b}; in Apple's table its "
                                        f"bases are {' < '.join(chain)}")
            k = i + 2
            while k < end:
                x = toks[k]
                if x.text in ("-", "+") and toks[k + 1].text == "(":
                    k = self.method(toks, k, name, f)
                elif x.text == "@property":
                    k = self.prop(toks, k, name, f)
                else:
                    k += 1
            i = end + 1

    def kind(self, f, line, name, kind):
        tb = self.table
        if name in BOTH:
            self.ok("stub type", line, name)
        elif kind == "protocol" and name in tb.classes and name not in tb.protocols:
            self.err(f, line, f"@protocol {name}: Apple's {name} is a class")
        elif kind == "class" and name in tb.protocols and name not in tb.classes:
            self.err(f, line, f"@interface {name}: Apple's {name} is a protocol")
        elif not tb.known_type(name):
            if _foundation(name):
                self.skip(f, line, name, FOUNDATION_GAP)
            else:
                self.err(f, line, f"{name} is not a class or protocol of Apple's table")

    def bases(self, toks, k, kind):
        out = []
        if kind == "class" and toks[k].text == "<":  # generics: NSArray<ObjectType>
            while toks[k].text != ">":
                k += 1
            k += 1
        if kind == "class" and toks[k].text == ":":
            out.append(toks[k + 1].text)
            k += 2
        if toks[k].text == "<":
            k += 1
            while toks[k].text != ">":
                if toks[k].kind == "id":
                    out.append(toks[k].text)
                k += 1
        return out

    def method(self, toks, k, owner, f):
        meta = toks[k].text == "+"
        line = toks[k].line
        k = _close(toks, k + 1) + 1
        parts, ptypes = [], []
        while toks[k].kind == "id" and toks[k].text not in ("NS_SWIFT_NAME", "API_AVAILABLE", "__attribute__"):
            parts.append(toks[k].text)
            if toks[k + 1].text != ":":
                break
            k += 2
            if toks[k].text == "(":
                c = _close(toks, k)
                ptypes.append(text_between(toks, k + 1, c))
                k = c + 1
            if toks[k].kind == "id":
                k += 1  # the parameter's name
            if toks[k].text == ",":  # varargs
                break
        sel = parts[0] if len(parts) == 1 and not ptypes else "".join(p + ":" for p in parts)
        while toks[k].text != ";":
            k += 1
        self.selector(f, line, owner, sel, meta, ptypes)
        return k + 1

    def prop(self, toks, k, owner, f):
        line = toks[k].line
        attrs = []
        k += 1
        if toks[k].text == "(":
            c = _close(toks, k)
            attrs = [x.strip() for x in text_between(toks, k + 1, c).split(",")]
            k = c + 1
        start = k
        while toks[k].text != ";":
            k += 1
        end = k
        if toks[end - 1].text == ")" and toks[start].text != ")":  # API_AVAILABLE(...) after the name
            depth = 0
            while True:
                end -= 1
                depth += {")": 1, "(": -1}.get(toks[end].text, 0)
                if depth == 0:
                    break
            end -= 1
        name = toks[end - 1].text
        ptype = text_between(toks, start, end - 1)
        getter = next((a.split("=", 1)[1].strip() for a in attrs if a.startswith("getter")), name)
        self.selector(f, line, owner, getter, False, [], ret=ptype)
        if "readonly" not in attrs:
            setter = next((a.split("=", 1)[1].strip() for a in attrs if a.startswith("setter")),
                          f"set{name[:1].upper()}{name[1:]}:")
            self.selector(f, line, owner, setter, False, [ptype])
        return k + 1

    def selector(self, f, line, owner, sel, meta, ptypes, ret=None):
        tb = self.table
        sign = "+" if meta else "-"
        sends = tb.lookup(owner, sel, meta)
        if not sends and (sign, sel) in NSOBJECT_BASICS and "NSObject" in [t.name for t in tb.chain(owner)]:
            self.ok("stub selector (NSObject basic)", line, f"{sign}[{owner} {sel}]")
            return
        if not sends:
            if _foundation(owner):
                self.skip(f, line, f"{sign}[{owner} {sel}]", FOUNDATION_GAP)
                return
            others = tb.senders(sel)
            self.err(f, line, f"the stub declares {sign}[{owner} {sel}]; Apple's table has no such "
                              f"{'class' if meta else 'instance'} message for {owner} or its bases "
                              f"({_describe_chain(tb, owner)})"
                              + (f"; {sel} is sent to: {', '.join(others)}" if others else
                                 "; no type of Apple's table has that selector"))
            return
        self.ok("stub selector", line, f"{sign}[{owner} {sel}]")
        # enum-typed parameters and properties must name Apple's enum
        cands = [s for s in sends if len(s.method.params) == len(ptypes)]
        for a, pt in enumerate(ptypes):
            mine = _enum_name(pt, tb)
            if mine is None:
                continue
            theirs = {_apple_enum(s.method.params[a], tb) for s in cands} - {None}
            if theirs and mine not in theirs:
                self.err(f, line, f"{sign}[{owner} {sel}]: parameter {a + 1} is {mine} in the stub; Apple's is "
                                  f"{' or '.join(sorted(theirs))}")
        if ret is not None:
            mine = _enum_name(ret, tb)
            theirs = {_apple_enum(s.method.ret, tb) for s in sends} - {None}
            if mine is not None and theirs and mine not in theirs:
                self.err(f, line, f"{sign}[{owner} {sel}]: the stub's property type is {mine}; Apple's is "
                                  f"{' or '.join(sorted(theirs))}")

    def c_functions(self, toks, f):
        tb = self.table
        for i, t in enumerate(toks):
            if t.kind != "id" or not OBJC_NAME.match(t.text) or i + 1 >= len(toks) or toks[i + 1].text != "(":
                continue
            # a declaration: a return type (a word or a *) just before the name
            if not (toks[i - 1].kind == "id" or toks[i - 1].text == "*"):
                continue
            c = _close(toks, i + 1)
            after = toks[c + 1].text if c + 1 < len(toks) else ""
            if after not in (";", "{"):
                continue
            params = [p for p in _items(text_between(toks, i + 2, c)) if p and p != "void"]
            fn = tb.functions.get(t.text)
            if fn is None:
                if _foundation(t.text):
                    self.skip(f, t.line, t.text, FOUNDATION_GAP)
                else:
                    self.err(f, t.line, f"the stub declares {t.text}(), which Apple's table does not have")
                continue
            if len(params) != fn.nparams:
                self.err(f, t.line, f"the stub declares {t.text} with {len(params)} parameters; Apple's {fn.cpp} "
                                    f"takes {fn.nparams}")
            else:
                self.ok("stub function", t.line, f"{t.text}/{len(params)}")


def _close(toks, k):
    depth = 0
    for j in range(k, len(toks)):
        if toks[j].text == "(":
            depth += 1
        elif toks[j].text == ")":
            depth -= 1
            if depth == 0:
                return j
    raise SyntaxError("unbalanced (")


def text_between(toks, a, b):
    return " ".join(t.text for t in toks[a:b])


def _items(body: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return [x for x in out if x]


def _enum_name(text: str, tb: Table):
    words = [w for w in re.findall(r"\w+", text) if w not in QUALIFIERS]
    hits = [w for w in words if w in tb.enums]
    return hits[0] if hits and "*" not in text else None


def _apple_enum(cpp: str, tb: Table):
    text = re.sub(r"\bconst\b", "", cpp).strip()
    text = re.sub(r"\s+\w+$", "", text) if re.search(r"[\w>]\s+\w+$", text) else text
    got = tb.objc_of_cpp(text)
    return got[0] if got and got[1] == 0 and got[0] in tb.enums else None


def check_stubs(stubs: Path, table: Table) -> Report:
    s = _Stubs(table)
    for path in sorted(Path(stubs).rglob("*.h")):
        s.file(path, str(path.relative_to(Path(stubs).parent)))
    s.skip(str(Path(stubs).name), 0, "struct layouts and typedefs of the stubs",
           "not compared (only enum values, selectors, enum-typed parameters and C function arities are)")
    return s.r
