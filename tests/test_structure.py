"""The package's structure (docs/DESIGN.md §3): one home per concern, no import cycles, layering kept, and a test
file named after every module.

Reads the source with ``ast`` (imports nothing), so these run in milliseconds.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "pdm_jax")


def _modules() -> dict:
    """Dotted module name -> parsed AST of every module of the package."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                with open(path, encoding="utf-8") as fh:
                    out[name] = ast.parse(fh.read(), filename=path)
    return out


MODULES = _modules()


def _imports(name: str, tree) -> set:
    """Package modules imported by ``name`` (module level and inside functions alike)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = name.split(".")[: -node.level] if not name.endswith("__init__") else name.split(".")
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def _graph() -> dict:
    # Package __init__ modules only re-export: edges into them are not dependencies of substance.
    inits = {n for n in MODULES if os.path.exists(os.path.join(ROOT, *n.split("."), "__init__.py"))}
    return {n: {m for m in _imports(n, t) if m not in inits} for n, t in MODULES.items() if n not in inits}


def test_no_import_cycles():
    graph = _graph()
    state, cycles = {}, []

    def visit(v, stack):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                cycles.append(stack[stack.index(w):] + [w])
            elif w not in state:
                visit(w, stack)
        stack.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("importer", ["pdm_jax.dry_run", "pdm_jax.analysis.alignment", "pdm_jax.analysis.callback",
                                      "pdm_jax.analysis.report", "pdm_jax.analysis.run", "pdm_jax.config",
                                      "pdm_jax.rl.loss", "pdm_jax.rl.train_step", "pdm_jax.rl.chunked_loss"])
def test_planner_analysis_and_math_do_not_import_the_loop(importer):
    assert "pdm_jax.trainer" not in _imports(importer, MODULES[importer])


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


#: docs/DESIGN.md §3's layers, lowest first: a module imports only its own layer and those below (the longest
#: matching prefix places a module). Package ``__init__`` modules only re-export and are not placed.
LAYERS = (
    ("pdm_jax.rollout", "pdm_jax.models", "pdm_jax.sharding"),
    ("pdm_jax.rl",),
    ("pdm_jax.distributed", "pdm_jax.per_host", "pdm_jax.checkpointing", "pdm_jax.workdir", "pdm_jax.metrics",
     "pdm_jax.profiling", "pdm_jax.data", "pdm_jax.text", "pdm_jax.evaluation", "pdm_jax.host_memory", "pdm_jax.aot",
     "pdm_jax.rewards", "pdm_jax.warm_start",
     "pdm_jax.wandb_log"),
    ("pdm_jax.sampler",),
    ("pdm_jax.config", "pdm_jax.config_reference", "pdm_jax.sections"),
    ("pdm_jax.rollouts", "pdm_jax.callbacks"),
    ("pdm_jax.trainer", "pdm_jax.run_spec", "pdm_jax.dry_run", "pdm_jax.analysis"),
    ("pdm_jax.train", "pdm_jax.dry_run_fit", "pdm_jax.analysis.run", "pdm_jax.analysis.report",
     "pdm_jax.analysis.__main__"),
)


def _layer(name: str):
    placed = [(len(p), i) for i, layer in enumerate(LAYERS) for p in layer if _in(name, p)]
    return max(placed)[1] if placed else None


def test_imports_point_down_the_layers():
    """No import from a lower layer to a higher one (the service never imports the trainer's side, the config
    never the rollouts' clients, nothing the trainer), and every module has its layer."""
    graph = _graph()
    unplaced = sorted(n for n in graph if _layer(n) is None)
    assert not unplaced, f"modules in no layer of LAYERS (docs/DESIGN.md §3): {unplaced}"
    up = [f"{n} (layer {_layer(n) + 1}) -> {m} (layer {_layer(m) + 1})"
          for n, deps in sorted(graph.items()) for m in sorted(deps) if _layer(m) > _layer(n)]
    assert not up, up


def test_the_service_imports_nothing_of_the_trainers_side():
    """``pdm_jax.sampler`` (the rollout service) never imports the trainer's side, the update or the config."""
    trainer_side = ("pdm_jax.rollouts", "pdm_jax.rl", "pdm_jax.trainer", "pdm_jax.config", "pdm_jax.train",
                    "pdm_jax.dry_run", "pdm_jax.evaluation", "pdm_jax.checkpointing", "pdm_jax.analysis")
    bad = [f"{n} -> {m}" for n, t in MODULES.items() if _in(n, "pdm_jax.sampler")
           for m in _imports(n, t) if any(_in(m, p) for p in trainer_side)]
    assert not bad, bad


def test_the_pure_update_imports_no_io():
    """``pdm_jax.rl`` imports itself, the models, sharding and the numpy rollout contract; no I/O library."""
    allowed = ("pdm_jax.rl", "pdm_jax.models", "pdm_jax.sharding", "pdm_jax.rollout")
    io_libraries = {"orbax", "ml_collections", "requests", "httpx", "fastapi", "uvicorn", "msgpack", "json",
                    "os", "subprocess", "socket", "tensorboardX", "datasets"}
    bad = []
    for n, t in MODULES.items():
        if not _in(n, "pdm_jax.rl"):
            continue
        bad += [f"{n} -> {m}" for m in _imports(n, t) if not any(_in(m, p) for p in allowed)]
        for node in ast.walk(t):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{n} -> {x}" for x in names if x.split(".")[0] in io_libraries]
    assert not bad, bad


def test_the_rollout_contract_is_numpy_only():
    """``pdm_jax.rollout`` imports numpy and the standard library only (the service and the wire codec read it)."""
    tree = MODULES["pdm_jax.rollout"]
    top = {(a.name if isinstance(node, ast.Import) else node.module).split(".")[0]
           for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
           for a in (node.names if isinstance(node, ast.Import) else [node])}
    assert top <= {"numpy", "dataclasses", "typing", "__future__"}, top


def test_wire_field_names_only_in_wire_py():
    wire_names = {"max_tokens", "prompt_index", "stop_token_ids", "choices", "top_logprobs", "finish_reason_wire"}
    offenders = []
    for name, tree in MODULES.items():
        if name == "pdm_jax.sampler.wire":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in wire_names:
                offenders.append(f"{name}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def _config_sections() -> set:
    """The schema's sections: every ``c.<name> = ml_collections.ConfigDict()`` of `pdm_jax.config.get_base_config`."""
    fn = next(n for n in MODULES["pdm_jax.config"].body if getattr(n, "name", None) == "get_base_config")
    return {t.attr for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and getattr(n.value.func, "attr", None) == "ConfigDict" for t in n.targets
            if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "c"}


def _reads_the_config(tree, sections: set) -> list:
    """Where a module imports ml_collections or reads a run config: ``<config-like name>.<section>`` (``config.rl``,
    ``cfg.sampler``, ``self.config.model``, ``c.trust_region``) or ``.get("<section>")``."""
    def config_like(v) -> str:
        name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""
        return name if "config" in name.lower() or name in ("cfg", "c") else ""

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] == "ml_collections"]
        elif isinstance(node, ast.Attribute) and node.attr in sections and config_like(node.value):
            found.append(f"{node.lineno}: {config_like(node.value)}.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in sections \
                and config_like(node.func.value):
            found.append(f"{node.lineno}: {config_like(node.func.value)}.get({node.args[0].value!r})")
    return found


#: The modules that may import ml_collections or read the run ConfigDict (issue 60): the command line, the schema and
#: its parser, `run_spec` (the one reader: everything else takes its typed records) and the reference generator.
CONFIG_EDGES = {"pdm_jax.train", "pdm_jax.config", "pdm_jax.run_spec", "pdm_jax.config_reference"}


def test_only_the_edges_read_the_config():
    """Outside `CONFIG_EDGES` no module imports ml_collections or reads a section of the run config (the trainer,
    metrics, the analysis callback, the per-host code and the dry run take `pdm_jax.run_spec.RunSpec`'s records)."""
    sections = _config_sections()
    assert {"rl", "sampler", "model", "trust_region", "multihost"} <= sections, sections
    readers = {name: hits for name, tree in MODULES.items() if (hits := _reads_the_config(tree, sections))}
    outside = {name: hits[:3] for name, hits in readers.items() if name not in CONFIG_EDGES}
    assert not outside, f"modules reading the run config outside the edges: {outside}"
    unused = CONFIG_EDGES - set(readers)
    assert not unused, f"edges that no longer read the config (drop them): {unused}"


def test_trainer_is_small():
    with open(os.path.join(PKG, "trainer.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 550


def test_no_long_function_without_a_reason():
    """No function body over 80 lines (docstring excluded) unless its docstring says why it is long."""
    long = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                n = node.end_lineno - node.lineno + 1
                if doc:
                    n -= node.body[0].end_lineno - node.body[0].lineno + 1
                if n > 80 and "long on purpose" not in doc.lower():
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long


MAX_PARAMS = 8
#: Engine-path functions allowed more than `MAX_PARAMS` parameters, each with its reason.
MANY_PARAMS = {
    # Entry points whose keywords are the settings a caller changes one at a time (each documented in its docstring):
    "pdm_jax.sampler.quantize.prepare_sampler_params": "the quantization, dtype, sharding, checks and weight noise",
    "pdm_jax.rollouts.vllm_client.__init__": "the vLLM client's address, model, paths and retry settings",
    "pdm_jax.sampler.vllm_fake.__init__": "a test double of a vLLM server: its served limits",
}


def test_engine_path_functions_take_few_parameters():
    """No function of the sampler or the rollouts takes more than `MAX_PARAMS` parameters (positional and
    keyword-only, ``self`` / ``cls`` not counted) outside `MANY_PARAMS`: settings travel as records (`EngineSpec`,
    the batching programs' `ContinuousShape` / `StaticShape` and their array records)."""
    many = set()
    for name, tree in MODULES.items():
        if not _in(name, "pdm_jax.sampler") and not _in(name, "pdm_jax.rollouts"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                if len(params) > MAX_PARAMS:
                    many.add(f"{name}.{node.name}")
    assert many <= set(MANY_PARAMS), sorted(many - set(MANY_PARAMS))
    assert set(MANY_PARAMS) <= many, f"allowed but no longer long (drop them): {sorted(set(MANY_PARAMS) - many)}"


def test_one_log_ratio_clamp():
    """LOG_RATIO_CLAMP is assigned once (trust_region) and 20.0 is not hard-coded as a clamp elsewhere."""
    assigned = [name for name, tree in MODULES.items() for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LOG_RATIO_CLAMP"
                                                        for t in node.targets)]
    assert assigned == ["pdm_jax.rl.trust_region"]
    for name in ("pdm_jax.rl.loss", "pdm_jax.rl.objectives", "pdm_jax.rl.train_step", "pdm_jax.rl.chunked_loss"):
        consts = [n.value for n in ast.walk(MODULES[name]) if isinstance(n, ast.Constant)]
        assert 20.0 not in consts, name


# ---- the tests mirror the modules (issue 27) -------------------------------------------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))

#: Modules tested only through another module's test file: module -> the test file that covers it. Keep it short:
#: a module with tests of its own gets its own file (then its entry here fails the test below).
TESTED_ELSEWHERE = {
    # The RL-phase hook interface: a base class whose two hooks do nothing. Its one implementation,
    # AlignmentCallback, runs through a Trainer there (hooks called once per optimizer step, training unchanged).
    "pdm_jax/callbacks.py": "test_analysis_callback.py",
    # vLLM's route and field names (constants only): the requests built from them are compared with vLLM's
    # documented request and response shapes there, and the fake server answers on the same routes.
    "pdm_jax/sampler/vllm_api.py": "test_rollouts_vllm_client.py",
}


def _package_modules() -> list:
    """Every module file of the package as ``pdm_jax/<pkg>/<mod>.py`` (``__init__`` and ``__main__`` left out)."""
    return sorted(os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/") for d, _, files in os.walk(PKG)
                  for f in files if f.endswith(".py") and f not in ("__init__.py", "__main__.py"))


def _test_files_for(module: str) -> set:
    """The accepted names: ``test_<pkg>_<mod>.py`` (``test_<mod>.py`` for a root module) or ``test_<mod>.py``."""
    parts = module[: -len(".py")].split("/")[1:]
    return {f"test_{'_'.join(parts)}.py", f"test_{parts[-1]}.py"}


def test_every_module_has_a_test_file():
    """``pdm_jax/<mod>.py`` has ``tests/test_<mod>.py``; ``pdm_jax/<pkg>/<mod>.py`` has ``tests/test_<pkg>_<mod>.py``
    or ``tests/test_<mod>.py``; the rest are in `TESTED_ELSEWHERE`, whose entries name existing modules without a
    file of their own and existing covering files."""
    modules, tests = _package_modules(), set(os.listdir(TESTS))
    assert len(modules) > 50 and "pdm_jax/rollouts/supervisor.py" in modules
    missing = [m for m in modules if m not in TESTED_ELSEWHERE and not _test_files_for(m) & tests]
    assert not missing, "modules without a test file named after them: " + "; ".join(
        f"{m} (tests/" + " or tests/".join(sorted(_test_files_for(m))) + ")" for m in missing)
    for module, covering in TESTED_ELSEWHERE.items():
        assert module in modules, f"TESTED_ELSEWHERE names {module}, which is not a module of the package"
        assert covering in tests, f"TESTED_ELSEWHERE: {module} is said to be covered by tests/{covering}, absent"
        assert not _test_files_for(module) & tests, f"{module} has its own test file: drop it from TESTED_ELSEWHERE"


# ---- prose and lint (issue 60) ---------------------------------------------------------------------------------

#: The package's docstring/comment lines per code line (scripts/prose_ratio.py) may not rise above this bound: a
#: module docstring says what the module is and its contract; measurements and history live in docs/ and git.
PROSE_RATIO_MAX = 0.40
#: The share of the package's lines longer than pyproject.toml's [tool.ruff] line-length.
LONG_LINE_SHARE_MAX = 0.02


def _prose_ratio():
    import importlib.util
    spec = importlib.util.spec_from_file_location("prose_ratio", os.path.join(ROOT, "scripts", "prose_ratio.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prose_ratio_counts_docstrings_and_comment_lines():
    source = ('"""Module\n\ndocstring."""\n\n# a comment line\nx = 1  # a trailing comment is code\n\n\n'
              'def f():\n    """One line."""\n    return "# not a comment"\n')
    prose, code, lines = _prose_ratio().count(source)
    assert (prose, code, len(lines)) == (5, 3, 11)


def test_prose_per_code_line_and_long_lines_stay_bounded():
    pr = _prose_ratio()
    m = pr.measure([PKG], pr.line_length())
    assert m["ratio"] <= PROSE_RATIO_MAX, (
        f"pdm_jax has {m['ratio']:.3f} docstring/comment lines per code line, above {PROSE_RATIO_MAX} "
        f"(python scripts/prose_ratio.py lists the files with the most)")
    assert m["long_share"] <= LONG_LINE_SHARE_MAX, m["long_share"]


def test_ruff_passes():
    """``python -m ruff check .`` (configured in pyproject.toml; .ci/run runs it too), where ruff is installed."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
