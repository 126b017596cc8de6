"""The README and the manual in docs/ name only what exists, and stay a front door and a manual.

Every ``stapo_megatron.…`` dotted name resolves (an importable module, or an attribute of the longest
importable prefix), every ``make`` target is in the Makefile, every ``stapo-…`` command is a console
script of setup.py, every ``nemo-run launch/….py`` file and every repository path written in code
exists, and every relative link points at a file. The README stays under `README_MAX_LINES` lines;
no page cites the project's issue numbers or a path outside the repository. A few facts the pages
state are checked against the code they describe.
"""

import functools
import glob
import importlib
import importlib.util
import os
import re

import pytest

from tests.helpers import REPO_DIR

README_MAX_LINES = 250
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO_DIR) for p in glob.glob(os.path.join(REPO_DIR, "docs", "*.md")))
TOP_DIRS = ("stapo_megatron", "tests", "scripts", "examples", "benchmarks", "launch", "docs", "requirements",
            "conversion")
WINGS = tuple(sorted(d for d in os.listdir(os.path.join(REPO_DIR, "stapo_megatron"))
                     if os.path.isdir(os.path.join(REPO_DIR, "stapo_megatron", d)) and not d.startswith("_")))


def read(path):
    with open(os.path.join(REPO_DIR, path), encoding="utf-8") as f:
        return f.read()


def code_of(text):
    """The text of the page's fenced blocks and inline code spans, where commands and names are written."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M).replace("``", "`")
    return fenced + re.findall(r"`([^`\n]+)`", rest) + re.findall(r"^    (\S.*)$", rest, re.M)


def expand_braces(word):
    """``launch/stapo_{1p7b,8b}.py`` -> both names (one brace group)."""
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [word[:m.start()] + alt + word[m.end():] for alt in m.group(1).split(",")]


@functools.lru_cache(maxsize=None)
def _import(module):
    """The module, None when ``module`` is not a module, or "optional" when it exists but needs a
    package this machine lacks (vLLM, transformer-engine: the name is then checked by its file)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return None  # this prefix is not a module
        if importlib.util.find_spec(module) is not None and not (e.name or "").startswith("stapo_megatron"):
            return "optional"
        raise


def resolves(dotted):
    """Whether ``stapo_megatron.a.b.c`` is a module or an attribute of its longest importable prefix
    (a trailing ``*`` matches any attribute with that prefix)."""
    star = dotted.endswith("*")
    parts = dotted.rstrip("*").split(".")
    for i in range(len(parts), 0, -1):
        module = _import(".".join(parts[:i]))
        if module is None:
            continue
        if module == "optional":
            return True
        obj = module
        for j, attr in enumerate(parts[i:], start=i):
            if star and j == len(parts) - 1:
                return any(name.startswith(attr) for name in dir(obj))
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_readme_is_a_front_door():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the manual's pages are in docs/"
    assert "docs/README.md" in read("README.md")


@pytest.mark.parametrize("page", PAGES)
def test_pages_speak_of_the_project_only(page):
    text = read(page)
    cited = re.findall(r"(?i)\bissues?\s+#?\d+|\(issue\b", text)
    assert not cited, f"{page} cites the project's issues: {cited}"
    assert "../shared" not in text, f"{page} names a path outside the repository"


def test_dotted_names_resolve():
    names = {}
    for page in PAGES:
        for name in re.findall(r"(?<![\w./-])stapo_megatron(?:\.[A-Za-z_]\w*)+\*?", read(page)):
            names.setdefault(name, page)
    missing = sorted(f"{page}: {name}" for name, page in names.items() if not resolves(name))
    assert names and not missing, "names that do not resolve:\n" + "\n".join(missing)


def makefile_targets():
    text = read("Makefile")
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M))


def test_make_targets_exist():
    targets = makefile_targets()
    assert {"demo", "test"} <= targets
    missing = sorted({f"{page}: make {t}" for page in PAGES for code in code_of(read(page))
                      for t in re.findall(r"(?<![\w-])make\s+([a-z][\w-]*)", code) if t not in targets})
    assert not missing, "make targets the Makefile does not have:\n" + "\n".join(missing)


def console_scripts():
    setup = read("setup.py")
    block = re.search(r'"console_scripts":\s*\[(.*?)\]', setup, re.S).group(1)
    return set(re.findall(r'"([\w-]+)=[\w.]+:\w+"', block)), re.search(r'name="([\w-]+)"', setup).group(1)


def test_commands_are_console_scripts():
    scripts, distribution = console_scripts()
    assert {"nemo-run", "stapo-convert", "stapo-eval", "stapo-plot", "stapo-doctor"} <= scripts
    missing = sorted({f"{page}: {c}" for page in PAGES for code in code_of(read(page))
                      for c in re.findall(r"(?<![\w/.:-])(stapo-[a-z]+(?:-[a-z]+)*)(?![\w:-])", code)
                      if c not in scripts | {distribution}})
    assert not missing, "commands setup.py does not install:\n" + "\n".join(missing)


def test_launch_files_exist():
    files = {(page, f) for page in PAGES for word in re.findall(r"nemo-run\s+(launch/\S+?\.py)\b", read(page))
             for f in expand_braces(word)}
    missing = sorted(f"{page}: {f}" for page, f in files if not os.path.isfile(os.path.join(REPO_DIR, f)))
    assert files and not missing, "launch files that do not exist:\n" + "\n".join(missing)


FILE_SUFFIXES = (".py", ".md", ".txt", ".sh", ".yaml", ".png", ".json", ".jsonl", ".ini", ".cfg")


def repo_paths(code):
    """The repository files and folders written in a code span or block: ``tests/x/test_y.py``,
    ``mcore/ops.py`` (a wing of the package), ``launch/``, and ``recipes/memory.memory_estimate``
    (a module and a name in it: the module's file); ``::test`` suffixes dropped. Words without a
    file suffix or a trailing slash (``eval/samples``, a metric) are not paths."""
    for word in re.split(r"[\s`'\"();=\[\]]+|,(?![^{]*\})", code):
        word = word.split("::")[0].rstrip(".:")
        if "<" in word or "*" in word or "$" in word or "/" not in word:
            continue
        if not re.match(r"^(%s)/[\w./{},-]*$" % "|".join(TOP_DIRS + WINGS), word):
            continue
        base = os.path.basename(word)
        if "." in base and not base.endswith(FILE_SUFFIXES):  # module.name
            word = word[:len(word) - len(base)] + base.split(".")[0] + ".py"
        elif not (word.endswith("/") or base.endswith(FILE_SUFFIXES)):
            continue
        yield from expand_braces(word)


def test_repository_paths_exist():
    missing = set()
    for page in PAGES:
        for code in code_of(read(page)):
            for path in repo_paths(code):
                if not any(os.path.exists(os.path.join(REPO_DIR, root, path)) for root in ("", "stapo_megatron")):
                    missing.add(f"{page}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(missing))


def test_relative_links_point_at_files():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(page)):
            if not re.match(r"^[a-z]+:", target) and not os.path.exists(
                    os.path.join(REPO_DIR, os.path.dirname(page), target)):
                missing.append(f"{page}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_the_docs_name_the_sleep_level_the_trainer_uses():
    levels = set(re.findall(r"sleep_level=(\d)", read(os.path.join("stapo_megatron", "serve", "server.py"))))
    assert levels == {"2"}, levels
    said = set(re.findall(r"sleep(?:s)?\s*\(?\s*(?:at\s+)?level\s+(\d)", " ".join(read(p) for p in PAGES)))
    assert said == levels, said


def test_the_config_reference_says_which_ratio_icepop_bounds():
    row = next(line for line in read(os.path.join("docs", "config-reference.md")).splitlines()
               if line.startswith("| `loss.rollout_correction.mode`"))
    assert "rho = pi_old/pi_rollout is outside [token_lower, token_upper]" in row
    assert "rho itself is bounded" in row and "verl's code bounds 1/rho = pi_rollout/pi_old" in row
    # and the code bounds that ratio: delta = log pi_old - log pi_rollout, flagged outside the bounds
    code = read(os.path.join("stapo_megatron", "method", "rollout_correction.py"))
    assert "return old_logprob.to(dtype) - rollout_logprob.to(dtype)" in code
    assert "_outside(delta_BS, config.token_lower, config.token_upper)" in code


def _jobs_at_4h(size):
    """Jobs a paper recipe's 3,000 steps need in 4 h jobs (`launch.timing`'s estimate)."""
    from stapo_megatron.launch.entry import build_config
    from stapo_megatron.recipes import paper, step_time

    cfg = build_config(size, check_paths=False)[0]
    step = step_time.estimate_step_time(paper.ARCHITECTURES[size], paper.layout_for(size, cfg), cfg)
    return step_time.jobs_needed(cfg.steps, step, 4 * 3600, step_time.signal_seconds(step))


def test_the_launching_page_job_counts_are_the_estimates():
    """The range of jobs per paper recipe at 4 h that docs/launching.md gives is what the dry runs
    print, and so is the 14B's retry budget (its jobs less one, plus the failure allowance)."""
    jobs = {size: _jobs_at_4h(size) for size in ("qwen3_1p7b", "qwen3_8b", "qwen3_14b", "qwen3_30b_a3b")}
    text = " ".join(read(os.path.join("docs", "launching.md")).split())
    assert f"every paper recipe with 4 h jobs: {min(jobs.values())}-{max(jobs.values())}," in text, jobs
    assert f"`stapo_8b_32k` ~{round(_jobs_at_4h('qwen3_8b_32k'), -1)}," in text
    from stapo_megatron.launch.timing import FAILURE_RETRIES

    retries = jobs["qwen3_14b"] - 1 + FAILURE_RETRIES
    assert f"plus {FAILURE_RETRIES} for failures ({retries} at 14B: {jobs['qwen3_14b']} jobs of 4 h" in text


@pytest.mark.parametrize("page, block", [
    ("README.md", "demo-summary"),             # examples/demo_seeds.py
    ("docs/results.md", "demo-seeds"),         # examples/demo_seeds.py
    ("docs/results.md", "compare"),            # stapo_megatron.runlog.compare (make compare)
    ("docs/results.md", "demo-moe"),           # examples/demo_moe.py
    ("docs/results.md", "demo-qwen35"),        # examples/demo_qwen35.py
    ("docs/recipes.md", "memory-table"),       # scripts/memory_table.py
    ("docs/launching.md", "cpu-paper-trial"),  # read by tests/launch/test_entry.py
])
def test_generated_blocks_have_their_markers(page, block):
    """Each script that writes a block finds its markers once, in the page it writes to."""
    text = read(page)
    assert text.count(f"<!-- {block}:begin -->") == 1 and text.count(f"<!-- {block}:end -->") == 1, (page, block)
    assert text.index(f"<!-- {block}:begin -->") < text.index(f"<!-- {block}:end -->")
