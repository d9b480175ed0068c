"""The syntax of Paddle's AOA statements: files, tokens, one statement's parts.

PaddlePaddle/Paddle (paddlepaddle 3.3.1): python/paddle/distributed/flex_checkpoint/aoa/lexer.py
(tokens: `->`, `=`, `:`, `[`, `]`, `,`, numbers, quoted strings, identifiers
`[A-Za-z_][A-Za-z.$_*0-9^T]*`), parser.py (`VAR_LIST -> VAR_LIST [, ATTR = VALUE ...]`), the
array macro of macros.py (`NAME[a:b]` is `NAME_a, ..., NAME_{b-1}`) and the macro tags that stand
among the names (`fused_qkv`, `fused_qkv_old`, `fused_ffn`). A config is `{"aoa_statements":
[...]}` (JSON, what `load_state_dict(aoa_config=...)` takes) or a text file with one statement a
line (`#` starts a comment here). The meaning of a statement is `aoa`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridckpt.errors import FormatError, MappingError
from hybridckpt.io import json_text

_TOKEN = re.compile(
    r"(?P<RARROW>->)|(?P<EQUAL>=)|(?P<COLON>:)|(?P<LBRACKET>\[)|(?P<RBRACKET>\])|(?P<COMMA>,)"
    r"|(?P<NUMBER>\d+)|(?P<STRING>\"[^\"]*\"|'[^']*')|(?P<IDENT>[A-Za-z_][A-Za-z.$_*\d^T]*)"
    r"|(?P<SKIP>\s+)|(?P<BAD>.)"
)  # lexer.py Lexer.token_specification
_MARKERS = re.compile(
    r"\baxis\s*=|\^T\b|\$LAYER_ID|\$EXPERT_ID|,\s*fused_(?:qkv|qkv_old|ffn)\b|permute\s*=|dtype\s*="
)


@dataclass(frozen=True)
class Statement:
    origin: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.origin}:{self.line}: {self.text.strip()}"


# -- reading a file ---------------------------------------------------------------------------


def read_statements(path: str) -> list[Statement]:
    """The statements of an AOA config file: JSON (`{"aoa_statements": [...]}` or a list) or text."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MappingError(f"{path}: cannot read AOA config: {e}") from None
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            doc = json_text.loads(text, path)
        except FormatError as e:  # malformed, or nested past the depth limit
            raise MappingError(str(e)) from None
        items = doc.get("aoa_statements") if isinstance(doc, dict) else doc
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise MappingError(f"{path}: aoa_statements must be a list of strings")
        return [Statement(path, i, s) for i, s in enumerate(items, 1) if s.strip()]
    out = []
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append(Statement(path, i, line))
    return out


def is_aoa_file(path: str) -> bool:
    """An AOA config: `.aoa`, JSON holding `aoa_statements`, or text using AOA's syntax."""
    if path.endswith(".aoa"):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError):
        return False
    if text.lstrip().startswith("{"):
        return '"aoa_statements"' in text
    return bool(_MARKERS.search(text)) and not re.search(r"->[^\n#]*:\s*[a-z_]+", text)


# -- one statement ----------------------------------------------------------------------------


def tokens(st: Statement) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(st.text):
        kind = m.lastgroup
        if kind == "BAD":
            raise MappingError(f"{st.where()}: unexpected character {m.group()!r}")
        if kind != "SKIP":
            out.append((kind, m.group()))
    # array macro: NAME[a:b] -> NAME_a, ..., NAME_{b-1}
    res, i = [], 0
    while i < len(out):
        if out[i][0] == "LBRACKET":
            kinds = [k for k, _ in out[i : i + 5]]
            if kinds != ["LBRACKET", "NUMBER", "COLON", "NUMBER", "RBRACKET"] or not res:
                raise MappingError(f"{st.where()}: an array must be NAME[START:END]")
            name = res.pop()[1]
            a, b = int(out[i + 1][1]), int(out[i + 3][1])
            for j in range(a, b):
                res += [("IDENT", f"{name}_{j}"), ("COMMA", ",")]
            res.pop()
            i += 5
        else:
            res.append(out[i])
            i += 1
    return res


TAGS = ("fused_qkv", "fused_qkv_old", "fused_ffn")


def parse(st: Statement):
    """(left names, right names, attributes, macro tag) of a statement."""
    toks = tokens(st)
    kinds = [k for k, _ in toks]
    if kinds.count("RARROW") != 1:
        raise MappingError(f"{st.where()}: expected one '->'")
    arrow = kinds.index("RARROW")
    left, right, attrs, tag = [], [], {}, None
    for k, v in toks[:arrow]:
        if k == "IDENT":
            left.append(v)
        elif k != "COMMA":
            raise MappingError(f"{st.where()}: unexpected {v!r} before '->'")
    rest = toks[arrow + 1 :]
    i = 0
    while i < len(rest):
        k, v = rest[i]
        if (
            k == "IDENT"
            and i + 2 < len(rest) + 1
            and i + 1 < len(rest)
            and rest[i + 1][0] == "EQUAL"
        ):
            if i + 2 >= len(rest) or rest[i + 2][0] not in ("NUMBER", "STRING"):
                raise MappingError(f"{st.where()}: attribute {v} needs a number or a string")
            val = rest[i + 2][1]
            attrs[v] = int(val) if rest[i + 2][0] == "NUMBER" else val[1:-1]
            i += 3
        elif k == "IDENT" and v in TAGS:
            tag = v
            i += 1
        elif k == "IDENT":
            if attrs or tag:
                raise MappingError(f"{st.where()}: name {v!r} after the attributes")
            right.append(v)
            i += 1
        elif k == "COMMA":
            i += 1
        else:
            raise MappingError(f"{st.where()}: unexpected {v!r} after '->'")
    if not left or not right:
        raise MappingError(f"{st.where()}: a statement needs names on both sides of '->'")
    return left, right, attrs, tag
