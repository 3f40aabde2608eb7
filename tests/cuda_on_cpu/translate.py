"""Copy flashspark's CUDA sources for the cuda_on_cpu layer, rewriting the two constructs that
are not C++ into calls of its runtime; everything else stays byte for byte.

    kernel<<<grid, block, smem, stream>>>(args)  ->  ::cuda_on_cpu::launch(kernel, grid, block, smem, stream)(args)
    extern __shared__ T name[];                  ->  T* name = ::cuda_on_cpu::dynamic_shared<T>();
    __shared__ DECL name;                        ->  static DECL name; ::cuda_on_cpu::shared_static(&name, sizeof(name));

A __shared__ variable becomes a function-local static: blocks run one after another, so one
storage serves every block, and the runtime poisons it when each block first reaches it.

    python translate.py OUT_DIR SOURCE=NAME...   (NAME: the path under OUT_DIR, e.g. include/flashspark/cuda/verify.cuh)

A .cu file (a launcher instantiation unit) is written as NAME.cpp, for the host compiler.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# a kernel name with template arguments, themselves templates at most one level deep
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<(?:[^<>;(){}]|<[^<>;(){}]*>)*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")


def code_only(text: str) -> str:
    """`text` with comments and string / character literals blanked (same length), so that a
    word in a comment is never rewritten."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def shared_declarations(code: str):
    """(start, end, declaration, name) of every `__shared__ DECL name;` in blanked code; end is
    the position of its ';' (a union's body may hold ';' of its own)."""
    for m in re.finditer(r"\b__shared__\b", code):
        depth, k = 0, m.end()
        while k < len(code):
            depth += code[k] == "{"
            depth -= code[k] == "}"
            if code[k] == ";" and depth == 0:
                break
            k += 1
        decl = code[m.end() : k].strip()
        name = re.search(r"(\w+)\s*(\[[^\]]*\]\s*)*$", decl)
        if not name:
            raise SystemExit(f"translate.py: cannot find the name in __shared__ {decl!r}")
        yield m.start(), k, decl, name.group(1)


def translate(text: str) -> str:
    edits = []  # (start, end, replacement) over the original text, found in its blanked twin
    code = code_only(text)
    for m in EXTERN_SHARED.finditer(code):
        edits.append(
            (m.start(), m.end(), f"{m.group(1)}* {m.group(2)} = ::cuda_on_cpu::dynamic_shared<{m.group(1)}>();")
        )
    taken = [(a, b) for a, b, _ in edits]
    for a, b, decl, name in shared_declarations(code):
        if any(x <= a < y for x, y in taken):
            continue
        edits.append((a, b, f"static {decl}; ::cuda_on_cpu::shared_static(&{name}, sizeof({name}))"))
    for m in LAUNCH.finditer(code):
        edits.append((m.start(), m.end(), f"::cuda_on_cpu::launch({m.group(1)}, {m.group(2).strip()})("))
    out, i = [], 0
    for a, b, rep in sorted(edits):
        out += [text[i:a], rep]
        i = b
    return "".join(out) + text[i:]


def main(argv: list[str]) -> int:
    dst = Path(argv[0])
    for pair in argv[1:]:
        source, f = pair.split("=", 1)
        text = Path(source).read_text()
        new = translate(text)
        if "<<<" in code_only(new) or re.search(r"\b__shared__\b", code_only(new)):
            raise SystemExit(f"translate.py: {f} keeps a launch or __shared__ it could not rewrite")
        out = dst / (f + ".cpp" if f.endswith(".cu") else f)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.is_file() or out.read_text() != new:  # untouched outputs keep their timestamps
            out.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
