"""A reader of Objective-C++ sources (csrc/metal/*.mm) good enough to list what they use of the
Metal and Foundation APIs, with the receiver's type where the file says it.

Not a compiler: it tokenizes, finds message sends (nested, multi-part, class messages), property
dot syntax, C function calls, enum constants and ObjC type names, and types receivers from the
declarations it can read (members, locals, parameters, block parameters, `auto` from a message
or an ObjC function, structured bindings and element access of std::map/vector of ObjC objects,
casts). Whatever it cannot type is reported as such, never guessed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = {
    "alignas", "alignof", "and", "asm", "auto", "bool", "break", "case", "catch", "char", "class", "const",
    "constexpr", "const_cast", "continue", "decltype", "default", "delete", "do", "double", "dynamic_cast",
    "else", "enum", "explicit", "extern", "false", "float", "for", "friend", "goto", "if", "inline", "int",
    "long", "mutable", "namespace", "new", "noexcept", "not", "nullptr", "operator", "or", "private",
    "protected", "public", "register", "reinterpret_cast", "return", "short", "signed", "sizeof", "static",
    "static_assert", "static_cast", "struct", "switch", "template", "this", "throw", "true", "try", "typedef",
    "typeid", "typename", "union", "unsigned", "using", "virtual", "void", "volatile", "while", "override",
    "final", "in", "co_return", "co_yield", "co_await",
}
QUALIFIERS = {"const", "volatile", "static", "__strong", "__weak", "__autoreleasing", "__unsafe_unretained",
              "__block", "_Nullable", "_Nonnull", "_Null_unspecified", "nullable", "nonnull", "__kindof",
              "__bridge", "__bridge_transfer", "__bridge_retained", "constexpr", "inline", "thread_local",
              "mutable"}
CONTAINERS = {"map": "map", "unordered_map": "map", "multimap": "map", "vector": "vec", "deque": "vec",
              "list": "vec", "array": "vec", "pair": "pair", "optional": "opt", "set": "vec",
              "unordered_set": "vec", "span": "vec"}
OBJC_NAME = re.compile(r"(MTL|NS)[A-Z]\w*$")

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\f\v]+|\n)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<str>@?(?:u8|[uUL])?R"(?P<delim>[^()\\ ]{0,16})\(.*?\)(?P=delim)"|@?(?:u8|[uUL])?"(?:\\.|[^"\\\n])*")
  | (?P<chr>(?:u8|[uUL])?'(?:\\.|[^'\\\n])+')
  | (?P<num>\.?\d(?:[\w.]|'(?=\w)|[eEpP][+-])*)
  | (?P<id>[A-Za-z_$][\w$]*)
  | (?P<at>@[A-Za-z_]\w*|@)
  | (?P<punct>\.\.\.|<<=|->\*|::|->|\+\+|--|<<|&&|\|\||==|!=|<=|>=|\+=|-=|\*=|/=|%=|&=|\|=|\^=|\.\*|[^\s])
""", re.X | re.S)


@dataclass
class Tok:
    kind: str   # id num str chr at punct
    text: str
    start: int  # offsets in the source
    end: int
    line: int


def tokenize(src: str) -> list:
    """Tokens of src without comments and preprocessor lines (their code is not API use; both
    branches of an #if are read)."""
    toks, i, line, bol = [], 0, 1, True
    n = len(src)
    while i < n:
        if bol:
            m = re.match(r"[ \t]*#", src[i:i + 200])
            if m:  # a directive, with its continuation lines
                j = i
                while True:
                    e = src.find("\n", j)
                    if e < 0:
                        e = n
                        break
                    # a block comment in a directive may span lines
                    seg = src[j:e]
                    if seg.rstrip().endswith("\\") or seg.count("/*") > seg.count("*/"):
                        j = e + 1
                        line += 1
                        continue
                    break
                i = e
                continue
        m = _TOKEN.match(src, i)
        if not m:
            raise SyntaxError(f"line {line}: cannot tokenize {src[i:i + 20]!r}")
        kind, text = m.lastgroup, m.group(0)
        if m.group("str") is not None:
            kind = "str"
        if kind in ("ws", "comment"):
            if "\n" in text:
                line += text.count("\n")
                bol = kind == "ws" or bol
            i = m.end()
            continue
        bol = False
        toks.append(Tok(kind, text, m.start(), m.end(), line))
        line += text.count("\n")
        i = m.end()
    return toks


# ---------------------------------------------------------------------------------------------
# types as the reader sees them
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class T:
    kind: str                 # objc (object), id (untyped object), enum, map, vec, pair, iter, opt, auto
    name: str = ""            # objc: class/protocol name; enum: enum name
    meta: bool = False        # objc: the class itself (class messages)
    args: tuple = ()          # containers: element types; objc: generic arguments
    protocol: bool = False    # objc: spelled id<P>
    also: tuple = ()          # objc: the further protocols of id<P, Q>

    def __str__(self):
        if self.kind == "objc":
            s = f"id<{self.name}>" if self.protocol else f"{self.name}*"
            return f"{self.name} (class)" if self.meta else s
        if self.kind in ("map", "vec", "pair", "iter", "opt"):
            return f"{self.kind}<{', '.join(str(a) for a in self.args)}>"
        return self.name or self.kind


@dataclass
class Decl:
    name: str
    tok: int                  # index of the name token
    type_tok: int             # index of the token that spells the type (for plants and messages)
    scope: tuple              # [first, last] token indices where the name is visible
    type: T | None = None
    init: tuple | None = None  # (kind, a, b): "=" expr or ":" range expr, for auto
    binding: int = -1         # structured binding: position in [a, b, ...]
    width: int = 0            # structured binding: how many names


@dataclass
class Part:
    name: str
    name_tok: int
    arg: tuple | None         # token range [a, b) of the argument


@dataclass
class Message:
    open: int
    close: int
    receiver: tuple           # token range
    parts: list
    line: int

    @property
    def selector(self) -> str:
        if len(self.parts) == 1 and self.parts[0].arg is None:
            return self.parts[0].name
        return "".join(p.name + ":" for p in self.parts)


class Source:
    """One Objective-C++ file, tokenized, with its bracket structure, declarations and sends."""

    def __init__(self, text: str, name: str = "<mm>", table=None):
        self.text, self.name, self.table = text, name, table
        self.toks = tokenize(text)
        self.match = self._brackets()
        self.parent = self._parents()
        self.class_body = {i for i, t in enumerate(self.toks) if t.text == "{" and self._is_class_body(i)}
        self.messages = {}
        for i, t in enumerate(self.toks):
            if t.text == "[" and self._expression_start(i):
                m = self._message(i)
                if m is not None:
                    self.messages[i] = m
        self.functions = {}   # local function name -> return type token range
        self.decls = {}       # name -> [Decl]
        self._declarations()
        self._resolving = set()

    # -----------------------------------------------------------------------------------------
    # structure
    # -----------------------------------------------------------------------------------------
    def _brackets(self) -> dict:
        pairs, stack = {}, []
        close = {")": "(", "]": "[", "}": "{"}
        for i, t in enumerate(self.toks):
            if t.kind != "punct":
                continue
            if t.text in "([{":
                stack.append(i)
            elif t.text in close:
                if not stack or self.toks[stack[-1]].text != close[t.text]:
                    raise SyntaxError(f"{self.name}:{t.line}: unbalanced {t.text!r}")
                o = stack.pop()
                pairs[o] = i
                pairs[i] = o
        if stack:
            raise SyntaxError(f"{self.name}:{self.toks[stack[-1]].line}: unclosed {self.toks[stack[-1]].text!r}")
        return pairs

    def _parents(self) -> list:
        """For each token, the index of the innermost bracket that encloses it (-1: none)."""
        out, stack = [], []
        for i, t in enumerate(self.toks):
            if t.kind == "punct" and t.text in ")]}":
                stack.pop()
            out.append(stack[-1] if stack else -1)
            if t.kind == "punct" and t.text in "([{":
                stack.append(i)
        return out

    def _is_class_body(self, i: int) -> bool:
        j = i - 1
        while j >= 0 and self.toks[j].text not in (";", "{", "}", ")", "]", "="):
            if self.toks[j].text in ("class", "struct", "union"):
                return True
            j -= 1
        return False

    def tok(self, i: int) -> Tok | None:
        return self.toks[i] if 0 <= i < len(self.toks) else None

    def text_of(self, a: int, b: int) -> str:
        if a >= b:
            return ""
        return self.text[self.toks[a].start:self.toks[b - 1].end]

    def _expr_end(self, t: Tok | None) -> bool:
        """Whether t can end an operand (so an identifier after it starts a selector)."""
        if t is None:
            return False
        if t.kind == "id":
            return t.text not in KEYWORDS or t.text in ("this", "true", "false", "nullptr")
        return t.kind in ("num", "str", "chr") or t.text in (")", "]")

    def _expression_start(self, i: int) -> bool:
        """Whether the [ at i may open a message. Anything but an @[ array literal: a subscript,
        lambda capture or attribute never has the message form (an identifier right after a
        complete operand), so _message() tells them apart, wherever the [ stands (after
        `if (...)`, a cast, `return`, ...)."""
        p = self.tok(i - 1)
        return p is None or p.text != "@"

    def top(self, a: int, b: int) -> list:
        """The items of [a, b) at bracket depth 0: (first, past-last) token index pairs, a bracket
        group counting as one item."""
        out, i = [], a
        while i < b:
            t = self.toks[i]
            if t.kind == "punct" and t.text in "([{":
                out.append((i, self.match[i] + 1))
                i = self.match[i] + 1
            else:
                out.append((i, i + 1))
                i += 1
        return out

    def _message(self, i: int) -> Message | None:
        j = self.match[i]
        items = self.top(i + 1, j)
        if len(items) < 2:
            return None
        for k in range(1, len(items)):
            first = self.toks[items[k][0]]
            after_operand = self._expr_end(self.toks[items[k - 1][1] - 1])
            if first.kind != "id" or items[k][1] - items[k][0] != 1 or not after_operand:
                continue
            parts = self._parts(items[k:])
            if parts is not None:
                return Message(i, j, (i + 1, items[k][0]), parts, self.toks[i].line)
        return None

    def _parts(self, items: list):
        toks = self.toks
        if len(items) == 1:
            return [Part(toks[items[0][0]].text, items[0][0], None)]
        if not (len(items) >= 3 and toks[items[1][0]].text == ":"):
            return None
        parts, k = [], 0
        while k < len(items):
            name_t = toks[items[k][0]]
            if not (name_t.kind == "id" and k + 1 < len(items) and toks[items[k + 1][0]].text == ":"):
                return None
            a = k + 2
            e = a
            # the argument runs to the next `name:` whose name follows an operand (not `? x :`)
            while e < len(items):
                t = toks[items[e][0]]
                if (t.kind == "id" and e + 1 < len(items) and toks[items[e + 1][0]].text == ":"
                        and e > a and self._expr_end(toks[items[e - 1][1] - 1])):
                    break
                e += 1
            if e == a:
                return None
            parts.append(Part(name_t.text, items[k][0], (items[a][0], items[e - 1][1])))
            k = e
        return parts

    # -----------------------------------------------------------------------------------------
    # declarations
    # -----------------------------------------------------------------------------------------
    def _type_at(self, i: int):
        """A type spelled at token i: (T, index past it) or None. Knows id<P>, id, Class*
        (ObjC class names), std containers of those, and auto."""
        t = self.tok(i)
        if t is None or t.kind != "id":
            return None
        if t.text == "id":
            n = self.tok(i + 1)
            if n is not None and n.text == "<":
                names, k = [], i + 2
                while self.tok(k) is not None and self.tok(k).kind == "id":
                    names.append(self.tok(k).text)
                    if self.tok(k + 1) is not None and self.tok(k + 1).text == ",":
                        k += 2
                        continue
                    break
                if not names or self.tok(k + 1) is None or self.tok(k + 1).text not in (">", ">>"):
                    return None
                return T("objc", names[0], protocol=True, also=tuple(names[1:])), k + 2
            return T("id"), i + 1
        if OBJC_NAME.match(t.text) and self.table is not None and self._is_object_name(t.text):
            k, generic = i + 1, ()
            if self.tok(k) is not None and self.tok(k).text == "<":
                g = self._angle(k)
                if g is None:
                    return None
                inner = self._type_at(k + 1)
                generic = (inner[0],) if inner else ()
                k = g + 1
            return T("objc", t.text, args=generic), k
        if t.text == "std" and self.tok(i + 1) is not None and self.tok(i + 1).text == "::":
            c = self.tok(i + 2)
            if c is not None and c.text in CONTAINERS and self.tok(i + 3) is not None and self.tok(i + 3).text == "<":
                close = self._angle(i + 3)
                if close is None:
                    return None
                args, k = [], i + 4
                for a, b in self._angle_args(i + 3, close):
                    inner = self._type_at(a)
                    args.append(inner[0] if inner and inner[1] == b else None)
                return T(CONTAINERS[c.text], args=tuple(args)), close + 1
            return None
        if t.text == "auto":
            return T("auto"), i + 1
        return None

    def _is_object_name(self, name: str) -> bool:
        tb = self.table
        return (name in tb.classes or name in tb.protocols
                or (name in tb.types and tb.types[name].base is not None) or name == "NSObject"
                or (name not in tb.enums and name not in tb.type_names and name not in tb.constants
                    and name not in tb.functions))

    def _angle(self, i: int):
        """Index of the > closing the < at i (template arguments; >> counts twice)."""
        depth, k = 0, i
        while k < len(self.toks):
            t = self.toks[k]
            if t.text == "<":
                depth += 1
            elif t.text == ">":
                depth -= 1
            elif t.text == ">>":
                depth -= 2
                if depth <= 0:
                    return k
            elif t.text in (";", "{", "}") or t.text in "([" and t.kind == "punct":
                if t.text in "([":
                    k = self.match[k]
                else:
                    return None
            if depth == 0:
                return k
            k += 1
        return None

    def _angle_args(self, i: int, close: int) -> list:
        out, depth, a = [], 0, i + 1
        for k in range(i + 1, close):
            t = self.toks[k]
            if t.text == "<":
                depth += 1
            elif t.text == ">":
                depth -= 1
            elif t.text == "," and depth == 0:
                out.append((a, k))
                a = k + 1
        out.append((a, close))
        return out

    def _scope(self, n: int) -> tuple:
        o = self.parent[n]
        if o < 0:
            return n, len(self.toks)
        ot = self.toks[o].text
        if ot == "{":
            return (o, self.match[o]) if o in self.class_body else (n, self.match[o])
        if ot == "(":
            k = self.match[o] + 1
            while k < len(self.toks):
                t = self.toks[k]
                if t.text == "{":
                    return n, self.match[k]
                if t.text == ";" or t.text == "}":
                    return n, k
                if t.text in "([" and t.kind == "punct":
                    # a range-for's statement may itself be a message or a call: it ends at `;`
                    k = self.match[k]
                k += 1
            return n, len(self.toks)
        return n, self.match[o]

    def _declarations(self) -> None:
        toks = self.toks
        i = 0
        while i < len(toks):
            got = self._type_at(i)
            prev = self.tok(i - 1)
            if got is None or (prev is not None and prev.text in ("::", ".", "->")):
                i += 1
                continue
            ty, k = got
            if self._method_parameter(i, ty, k):
                i = k
                continue
            while self.tok(k) is not None and self.tok(k).text in QUALIFIERS:
                k += 1
            stars = 0
            while self.tok(k) is not None and self.tok(k).text in ("*", "&", "&&", "const") or (
                    self.tok(k) is not None and self.tok(k).text in QUALIFIERS):
                stars += self.tok(k).text == "*"
                k += 1
            name = self.tok(k)
            if ty.kind == "auto" and name is not None and name.text == "[":
                self._binding(i, k)
                i = self.match[k] + 1
                continue
            if name is None or name.kind != "id" or name.text in KEYWORDS:
                i += 1
                continue
            after = self.tok(k + 1)
            if after is None or after.text not in ("=", ";", ",", ")", "{", ":", "in", "[", "("):
                i += 1
                continue
            if ty.kind == "objc" and not ty.protocol:
                # ObjC class objects are held by pointer; NSError** is an out parameter
                ty = ty if stars == 1 else None
            elif ty.kind in ("objc", "id"):
                ty = ty if stars == 0 else None
            if after.text == "(" and self._is_function(k + 1):
                self.functions[name.text] = ty
                i = k + 1
                continue
            d = Decl(name.text, k, i, self._scope(k), ty)
            if ty is not None and ty.kind == "auto":
                d.type = None
                if after.text in ("=", ":"):
                    d.init = (after.text, k + 2, self._expr_stop(k + 2))
            self.decls.setdefault(name.text, []).append(d)
            i = k + 1

    def _method_parameter(self, i: int, ty: T, k: int) -> bool:
        """An Objective-C method's parameter, `part:(T)name`: declared for the method's body."""
        if not (self.tok(i - 1) is not None and self.tok(i - 1).text == "(" and self.tok(i - 2) is not None
                and self.tok(i - 2).text == ":"):
            return False
        close = self.match[i - 1]
        name = self.tok(close + 1)
        if name is None or name.kind != "id":
            return False
        stars = sum(self.toks[j].text == "*" for j in range(k, close))
        if ty.kind == "objc" and not ty.protocol:
            ty = ty if stars == 1 else None
        elif ty.kind in ("objc", "id"):
            ty = ty if stars == 0 else None
        # the body is the first { after the selector, unless a ; ends a mere declaration first
        j, end = close + 2, len(self.toks)
        while j < len(self.toks):
            t = self.toks[j]
            if t.text == "{":
                end = self.match[j]
                break
            if t.text in (";", "}", "@end"):
                end = j
                break
            j = self.match[j] + 1 if t.text in "([" and t.kind == "punct" else j + 1
        self.decls.setdefault(name.text, []).append(Decl(name.text, close + 1, i, (close + 1, end), ty))
        return True

    def _is_function(self, p: int) -> bool:
        o = self.parent[p]
        if o >= 0 and (self.toks[o].text != "{" or o not in self.class_body):
            return False  # a call-style initialisation inside a function body
        nxt = self.tok(self.match[p] + 1)
        return nxt is not None and nxt.text in ("{", ";", "const", "override", "final", "noexcept", "->")

    def _expr_stop(self, a: int) -> int:
        k = a
        while k < len(self.toks):
            t = self.toks[k]
            if t.kind == "punct" and t.text in "([{":
                k = self.match[k] + 1
                continue
            if t.text in (";", ",", ")", "]", "}"):
                return k
            k += 1
        return k

    def _binding(self, auto_tok: int, lb: int) -> None:
        names = [(a, self.toks[a].text) for a, b in self.top(lb + 1, self.match[lb]) if self.toks[a].kind == "id"]
        after = self.tok(self.match[lb] + 1)
        init = None
        if after is not None and after.text in ("=", ":"):
            s = self.match[lb] + 2
            init = (after.text, s, self._expr_stop(s))
        for pos, (k, n) in enumerate(names):
            self.decls.setdefault(n, []).append(
                Decl(n, k, auto_tok, self._scope(lb), None, init, pos, len(names)))

    def declaration(self, name: str, at: int) -> Decl | None:
        """The declaration of `name` visible at token `at`: the innermost scope wins."""
        best = None
        for d in self.decls.get(name, ()):
            a, b = d.scope
            if a <= at <= b and (best is None or (b - a, -d.tok) < (best.scope[1] - best.scope[0], -best.tok)):
                best = d
        return best

    def decl_type(self, d: Decl):
        if d.type is not None or d.init is None:
            return d.type
        key = id(d)
        if key in self._resolving:
            return None
        self._resolving.add(key)
        try:
            kind, a, b = d.init
            t = self.expr_type(a, b)
            if kind == ":":
                t = element(t)
            if d.binding >= 0:
                if t is not None and t.kind == "pair" and d.width == 2:
                    t = t.args[d.binding]
                else:
                    t = None
            return t
        finally:
            self._resolving.discard(key)

    # -----------------------------------------------------------------------------------------
    # expression types
    # -----------------------------------------------------------------------------------------
    def expr_type(self, a: int, b: int):
        """Type of the expression [a, b), where the reader can tell; None otherwise."""
        while a < b and self.toks[a].text == "(" and self.match[a] == b - 1:
            a, b = a + 1, b - 1
        if a >= b:
            return None
        t0 = self.toks[a]
        derefs = 0
        while a < b and self.toks[a].text in ("*", "&") and self.toks[a].kind == "punct":
            derefs += self.toks[a].text == "*"
            a += 1
        if a >= b:
            return None
        t0 = self.toks[a]
        # a C-style cast to an object type
        if t0.text == "(" and self.match[a] < b - 1:
            k = a + 1
            while self.tok(k).text in QUALIFIERS:
                k += 1
            got = self._type_at(k)
            if got is not None:
                ty, e = got
                while self.tok(e).text in QUALIFIERS or self.tok(e).text == "*":
                    e += 1
                if e == self.match[a]:
                    return ty if ty.kind in ("objc", "id") else None
            return None
        cur, k = self._primary(a, b)
        if k is None:
            return None
        while k < b and cur is not None:
            t = self.toks[k]
            if t.text in (".", "->") and k + 1 < b and self.toks[k + 1].kind == "id":
                member = self.toks[k + 1].text
                call = k + 2 < b and self.toks[k + 2].text == "("
                nxt = self.match[k + 2] + 1 if call else k + 2
                if t.text == "->" and cur.kind == "iter":
                    cur = element(cur.args[0])
                if cur is None:
                    return None
                cur = self._member(cur, member, call)
                k = nxt
            elif t.text == "[":
                cur = element(cur) if cur.kind != "objc" else (cur.args[0] if cur.args else T("id"))
                k = self.match[k] + 1
            else:
                return None
        for _ in range(derefs):
            cur = deref(cur)
        return cur

    def _primary(self, a: int, b: int):
        t = self.toks[a]
        if t.text == "[" and a in self.messages:
            return self.message_type(self.messages[a]), self.match[a] + 1
        if t.text == "(":
            return self.expr_type(a + 1, self.match[a]), self.match[a] + 1
        if t.kind != "id":
            return None, None
        if t.text in ("static_cast", "reinterpret_cast", "const_cast", "dynamic_cast") and self.tok(a + 1).text == "<":
            close = self._angle(a + 1)
            got = self._type_at(a + 2)
            if close is None or self.tok(close + 1).text != "(":
                return None, None
            return (got[0] if got else None), self.match[close + 1] + 1
        if t.text == "this" and self.tok(a + 1) is not None and self.tok(a + 1).text == "->" and \
                self.tok(a + 2) is not None and self.tok(a + 2).kind == "id":
            d = self.declaration(self.toks[a + 2].text, a)
            return (self.decl_type(d) if d is not None else None), a + 3
        # skip a namespace qualification (std::max, krnl::x)
        k = a
        while self.tok(k + 1) is not None and self.tok(k + 1).text == "::" and self.tok(k + 2) is not None:
            k += 2
        name = self.toks[k].text
        nxt = self.tok(k + 1)
        if nxt is not None and nxt.text == "(" and k + 1 < b:
            end = self.match[k + 1] + 1
            if self.table is not None and name in self.table.functions:
                return self._cpp_type(self.table.functions[name].ret), end
            if name in self.functions:
                return self.functions[name], end
            return None, end
        d = self.declaration(name, a)
        if d is not None:
            return self.decl_type(d), k + 1
        if self.table is not None and OBJC_NAME.match(name) and self.table.known_type(name):
            return T("objc", name, meta=True), k + 1
        return None, k + 1

    def _member(self, cur: T, member: str, call: bool):
        if cur.kind in ("map", "vec", "opt"):
            if member in ("back", "front", "at", "value", "top"):
                return element(cur)
            if member in ("find", "begin", "end", "lower_bound", "upper_bound", "rbegin", "rend", "cbegin"):
                return T("iter", args=(cur,))
            return None
        if cur.kind == "pair":
            return {"first": cur.args[0], "second": cur.args[1]}.get(member)
        if cur.kind == "objc" and not call and not cur.meta:
            s = self.property(cur, member)
            return self.result_type(s, cur) if s else None
        return None

    def _cpp_type(self, ret: str, hint: str = "MTL"):
        tb = self.table
        if tb is None:
            return None
        got = tb.objc_of_cpp(ret, hint)
        if got is None:
            return None
        name, ptr = got
        if name in tb.enums:
            return T("enum", name) if ptr == 0 else None
        if ptr == 1 and (name in tb.types and tb.types[name].base is not None or name == "NSObject"):
            return T("objc", name, protocol=name in tb.protocols)
        return None

    def property(self, ty: T, name: str, setter: bool = False):
        """The Send behind `obj.name` (getter) or `obj.name = v` (setter), by Apple's C++ method
        of that name (how metal-cpp maps a property: name() and setName(v)); None if none."""
        tb = self.table
        if tb is None:
            return None
        cpp, sel, n = (("set" + name[:1].upper() + name[1:], "set" + name[:1].upper() + name[1:] + ":", 1) if setter
                       else (name, name, 0))
        found = tb.method_named(ty.name, cpp, n)
        if found is None:  # metal-cpp renamed the method (NS::String::utf8String sends UTF8String)
            found = next((s for s in tb.lookup(ty.name, sel, False) if len(s.method.params) == n), None)
        return found

    def result_type(self, send, recv: T):
        """Type of what a send returns: the receiver's own class for NSObject's templated
        alloc/init (instancetype), else the C++ return type mapped back to ObjC."""
        if send is None:
            return None
        if "_Class" in send.method.ret:
            return T("objc", recv.name, protocol=recv.protocol)
        return self._cpp_type(send.method.ret, "NS" if send.method.owner.startswith("NS") else "MTL")

    def receiver_type(self, m: Message):
        a, b = m.receiver
        if b - a == 1 and self.toks[a].kind == "id" and self.declaration(self.toks[a].text, a) is None:
            name = self.toks[a].text
            if name in ("self", "super"):
                return None
            if OBJC_NAME.match(name):
                return T("objc", name, meta=True)
        return self.expr_type(a, b)

    def message_type(self, m: Message):
        key = ("msg", m.open)
        if key in self._resolving:
            return None
        self._resolving.add(key)
        try:
            recv = self.receiver_type(m)
            if recv is None or recv.kind != "objc" or self.table is None:
                return None
            sends = [s for n in (recv.name,) + recv.also for s in self.table.lookup(n, m.selector, recv.meta)]
            if not sends:
                return None
            if m.selector in ("objectAtIndex:", "firstObject", "lastObject", "objectAtIndexedSubscript:"):
                return recv.args[0] if recv.args else T("id")
            return self.result_type(sends[0], recv)
        finally:
            self._resolving.discard(key)

    def operand_before(self, k: int) -> int:
        """First token of the postfix expression (a.b[i].c(), [msg].x, f(y)->z) that ends just
        before token k; k itself when there is none."""
        j, start, need = k - 1, k, True
        while j >= 0:
            t = self.toks[j]
            if t.text == "]" and self.match[j] in self.messages:
                start = j = self.match[j]
            elif t.text in (")", "]"):
                o = self.match[j]
                p = self.tok(o - 1)
                start = o
                if p is not None and (p.kind == "id" and p.text not in KEYWORDS or p.text in (")", "]")):
                    j = o - 1  # a call or subscript: its callee precedes it
                    continue
                j = o
            elif t.kind == "id" and need:
                start = j
            else:
                break
            p = self.tok(j - 1)
            if p is not None and p.text in (".", "->", "::"):
                j -= 2
                need = True
                continue
            break
        return start

    def operand_after(self, k: int) -> int:
        """Index past the postfix expression that starts at token k."""
        t = self.tok(k)
        if t is None:
            return k
        if t.text in "([" and t.kind == "punct":
            j = self.match[k] + 1
        elif t.kind in ("id", "num", "str", "chr"):
            j = k + 1
        else:
            return k
        while self.tok(j) is not None:
            t = self.toks[j]
            if t.text in (".", "->", "::") and self.tok(j + 1) is not None and self.tok(j + 1).kind == "id":
                j += 2
            elif t.text in "([" and t.kind == "punct":
                j = self.match[j] + 1
            else:
                break
        return j


def element(t):
    if t is None:
        return None
    if t.kind == "map":
        return T("pair", args=t.args)
    if t.kind in ("vec", "opt"):
        return t.args[0] if t.args else None
    if t.kind == "objc" and t.args:  # NSArray<E> in fast enumeration / subscripts
        return t.args[0]
    return None


def deref(t):
    if t is None:
        return None
    if t.kind == "iter":
        return element(t.args[0])
    return None
