"""The package's floors: no module imports a higher floor, and no modules import each
other in a loop, counting every import (a function's own, and those only a type checker
reads), so that each floor can be read, tested and replaced without those above it.

    floor                     modules                                   never imports
    the forward pass          mdjax.models, cache, topology, sharding,  mdjax.checkpoints
                              step
    everything but train      mdjax.* (but mdjax.train)                 mdjax.train
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPUTING = ("mdjax.models", "mdjax.cache", "mdjax.topology", "mdjax.sharding", "mdjax.step")


def module_name(path: pathlib.Path) -> str:
  name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
  return name.removesuffix(".__init__")


MODULES = {module_name(p): p for p in (ROOT / "mdjax").rglob("*.py")}


def imports(name: str) -> set[str]:
  """The mdjax modules `name` imports anywhere in its file."""
  found = set()
  for node in ast.walk(ast.parse(MODULES[name].read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mdjax"):
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        found.add(full if full in MODULES else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name in MODULES)
  return found - {name, "mdjax"}


GRAPH = {name: imports(name) for name in MODULES}


def within(name: str, packages) -> bool:
  return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_forward_pass_imports_no_checkpoint_reader():
  upward = sorted(f"{name} -> {target}" for name in MODULES if within(name, COMPUTING)
                  for target in GRAPH[name] if within(target, ("mdjax.checkpoints",)))
  assert upward == []


def test_nothing_below_the_trainers_imports_them():
  upward = sorted(f"{name} -> {target}" for name in MODULES
                  if not within(name, ("mdjax.train",))
                  for target in GRAPH[name] if within(target, ("mdjax.train",)))
  assert upward == []


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected groups of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while not group or group[-1] != v:
        group.append(stack.pop())
        on_stack.discard(group[-1])
      if len(group) > 1:
        groups.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return groups


def test_no_modules_import_each_other_in_a_loop():
  assert loops(GRAPH) == []


def test_the_loop_finder_finds_a_loop():
  assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def experiment_imports(path: pathlib.Path) -> set[str]:
  """The `experiments` modules the file at `path` imports (`from experiments[.x] import y`
  and `import experiments.x`), those that exist as files."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
      names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.startswith("experiments")]
    found.update(n for n in names if (ROOT / (n.replace(".", "/") + ".py")).exists())
  return found


def defined_flags(module: str) -> set[str]:
  """The absl flags `module` defines at import: `flags.DEFINE_*("name", ...)` anywhere
  outside a function."""
  tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
  found = set()
  for statement in tree.body:
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
      continue
    for node in ast.walk(statement):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.startswith("DEFINE") and node.args
          and isinstance(node.args[0], ast.Constant)):
        found.add(node.args[0].value)
  return found


def test_the_experiments_tests_import_define_each_flag_once():
  """A test worker imports every test file it is handed: two imported experiments (and
  what they import in turn) that define one flag name stop the second file's collection
  (absl's DuplicateFlagError). A test imports a script's flag-free parts instead."""
  seen, todo = set(), set()
  for path in (ROOT / "tests").rglob("test_*.py"):
    todo |= experiment_imports(path)
  while todo:
    module = todo.pop()
    seen.add(module)
    todo |= experiment_imports(ROOT / (module.replace(".", "/") + ".py")) - seen
  owners = {}
  for module in sorted(seen):
    for flag in defined_flags(module):
      owners.setdefault(flag, []).append(module)
  assert {flag: mods for flag, mods in owners.items() if len(mods) > 1} == {}
