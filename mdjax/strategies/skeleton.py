"""`skeleton_fill`: every stubbed function of a Python source filled in parallel.

A stub is a function (or method) whose body is only its docstring. The source is
cut after each stub's docstring into chunks; chunk j is the source from the end of
stub j - 1's docstring to the end of stub j's (the text after the last stub is not
needed). `mdjax.strategies.base.layout_chains` lays the chunks out as a chain of
segments with one branch after each, so body j is decoded seeing the source up to
its own docstring only, over one shared cache: it equals greedy decoding of the
tokens of chunks 0..j alone, and all bodies advance in the same passes (the
code model's skeleton-of-thought)::

    def f(x):               chunk 0 ........ branch 0 fills f
        \"\"\"Doc of f.\"\"\"
    def g(y):               chunk 1 ........ branch 1 fills g (sees chunks 0, 1)
        \"\"\"Doc of g.\"\"\"

`assemble` puts each generated body back after its docstring, cut at the first
line that is not indented deeper than its `def`.
"""

from __future__ import annotations

import ast

from mdjax.errors import MdjaxError


def stubs(source: str) -> list[tuple[int, int]]:
  """(offset just after the docstring, indentation of the `def`) of every function
  whose body is only a docstring, in source order."""
  try:
    tree = ast.parse(source)
  except SyntaxError as e:
    raise MdjaxError(f"the skeleton is not valid Python: {e}") from None
  lines = source.splitlines(keepends=True)
  line_starts = [0]
  for line in lines:
    line_starts.append(line_starts[-1] + len(line))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) == 1:
      doc = node.body[0]
      if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(
          doc.value.value, str):
        end_line = lines[doc.end_lineno - 1].encode()[:doc.end_col_offset].decode()  # bytes
        found.append((line_starts[doc.end_lineno - 1] + len(end_line), node.col_offset))
  return sorted(found)


def chunks(source: str) -> list[str]:
  """The source cut after every stub's docstring (the tail after the last one dropped)."""
  points = [offset for offset, _ in stubs(source)]
  if not points:
    raise MdjaxError("the skeleton has no function whose body is only a docstring to fill")
  return [source[a:b] for a, b in zip([0] + points[:-1], points)]


def body(text: str, indent: int) -> str:
  """`text` cut before its first non-empty line indented `indent` columns or less
  (the code after the function), trailing blank lines dropped."""
  lines = text.split("\n")
  kept = lines[:1]
  for line in lines[1:]:
    if line.strip() and len(line) - len(line.lstrip()) <= indent:
      break
    kept.append(line)
  return "\n".join(kept).rstrip()


def assemble(source: str, bodies: list[str]) -> str:
  """The source with body j (generated text) inserted after stub j's docstring."""
  points = stubs(source)
  if len(bodies) != len(points):
    raise MdjaxError(f"{len(bodies)} bodies for {len(points)} stubs")
  pieces, last = [], 0
  for (offset, indent), text in zip(points, bodies):
    pieces += [source[last:offset], body(text, indent)]
    last = offset
  return "".join(pieces + [source[last:]])
