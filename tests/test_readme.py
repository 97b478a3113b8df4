"""README.md quotes no result that the committed files do not hold, and says how old the ones it quotes are.

Checked: the sections between ``<!-- readme_tables: NAME -->`` markers, which `bench/readme_tables.py`
generates (the tune transcript and preset, the "Measured on 2 x H200" table and prose, the search
benchmark, the service load).  Every number in them outside code spans (commands, file names, configs,
commit hashes) is read back from the README here and must be the value its claim points to in a committed
result file, printed at the precision shown; every fenced block must be a committed file, verbatim.  Not
checked: the rest of the README (the introduction's TE figures, dated there as measured before this
project; design constants such as the 2 ms alignment sleep).
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from bench import readme_tables

REPO = Path(__file__).resolve().parents[1]
SECTION = re.compile(r"<!-- readme_tables: (\w+) -->\n(.*?)<!-- /readme_tables: \1 -->", re.S)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```\n", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)*(?:\+[A-Za-z0-9.]+)?(?:%|x(?!\w))?(?!\w)(?!\.\d)")
"""A number not part of a name (h8192, fc1_fprop): 0.723, 92.9%, 1.10x, a version such as 2.11.0+cu130."""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module", autouse=True)
def in_a_checkout() -> None:
    try:
        git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the git history: results are dated against it")


def readme() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


@cache
def result(file: str) -> object:
    return json.loads((REPO / file).read_text(encoding="utf-8"))


def pointed(file: str, pointer: str) -> object:
    data = result(file)
    for part in pointer.split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        data = data[int(key)] if isinstance(data, list) else data[key]  # type: ignore[index,call-overload]
    return data


def shown(value: object, token: str) -> str:
    """``value`` printed the way ``token`` is: as many decimals, as a percentage or a ratio."""
    number = token.rstrip("%x")
    decimals = len(number.split(".")[1]) if "." in number else 0
    scaled = 100 * float(value) if token.endswith("%") else float(value)  # type: ignore[arg-type]
    return f"{scaled:.{decimals}f}" + token[len(number) :]


def wrong_figure(claim: readme_tables.Claim, token: str) -> str | None:
    """Why ``token`` is not what the committed file holds at ``claim``; None when it is."""
    if claim.kind == "match":
        found = re.search(claim.pointer, (REPO / claim.file).read_text(encoding="utf-8"))
        held = found.group(1) if found else None
    else:
        value = pointed(claim.file, claim.pointer)
        if claim.kind == "count":
            held = str(len(value))  # type: ignore[arg-type]
        elif claim.kind == "text":
            held = str(value)
        else:
            held = shown(value, token)
    return None if held == token else f"{token} is not {claim.file}{claim.pointer or ''} ({held})"


def committed(file: str) -> bool:
    try:
        git("ls-files", "--error-unmatch", file)
        return not git("diff", "HEAD", "--name-only", "--", file)
    except subprocess.CalledProcessError:
        return False


def problems(text: str) -> list[str]:
    """Everything wrong with the generated sections of ``text`` (a README), each problem one line."""
    made = readme_tables.sections()
    bodies = dict(SECTION.findall(text))
    found = [f"{name}: no such section in README.md" for name in made if name not in bodies]
    for name, body in bodies.items():
        claims = made[name][1] if name in made else []
        files = [c for c in claims if c.kind == "file"]
        quoted = FENCE.findall(body)
        for i, block in enumerate(quoted):
            real = (REPO / files[i].file).read_text(encoding="utf-8") if i < len(files) else None
            if real is None or block.rstrip("\n") != real.rstrip("\n"):
                found.append(f"{name}: quoted block {i + 1} is not the committed file it stands for")
        figures = [c for c in claims if c.kind != "file"]
        tokens = NUMBER.findall(CODE.sub(" ", FENCE.sub(" ", body)))
        for i, token in enumerate(tokens):
            if i >= len(figures) or figures[i].text != token:
                held = f"; the results hold {figures[i].text} there" if i < len(figures) else ""
                found.append(f"{name}: number {i + 1}, {token}, has no committed result behind it{held}")
                break
            if (why := wrong_figure(figures[i], token)) is not None:
                found.append(f"{name}: {why}")
        if len(tokens) < len(figures):
            found.append(f"{name}: {len(figures) - len(tokens)} figures of the results are missing from README.md")
        found += [f"{name}: {c.file} is not committed as it is" for c in claims if not committed(c.file)]
    return found


def test_every_number_in_the_generated_sections_is_held_by_a_committed_result() -> None:
    assert problems(readme()) == []


def test_the_generated_sections_are_up_to_date() -> None:
    assert readme_tables.rewrite(readme(), readme_tables.sections()) == readme(), "run python bench/readme_tables.py"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("92.9%", "93.9%"),  # a figure typed over
        ("at the median and", "at the median (over 2 runs) and"),  # a figure no result holds
        ("qkv_dgrad:\n  method: bulk", "qkv_dgrad:\n  method: pipeline"),  # a quoted file edited
    ],
    ids=["changed", "added", "quoted"],
)
def test_the_check_fails_on_a_figure_that_no_committed_result_holds(old: str, new: str) -> None:
    text = readme()
    assert old in text
    assert problems(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("section", "file", "code"),
    [
        ("measured", readme_tables.OVERLAP, readme_tables.RUNTIME),
        ("search", readme_tables.SEARCH_RESULT, readme_tables.SEARCH),
        ("service", readme_tables.SERVICE_RESULT, readme_tables.SERVICE),
    ],
)
def test_a_result_says_which_commit_it_is_from_and_whether_the_code_changed_since(
    section: str, file: str, code: tuple[str, ...]
) -> None:
    body = " ".join(dict(SECTION.findall(readme()))[section].split())  # as read, not as wrapped
    data = json.loads((REPO / file).read_text(encoding="utf-8"))
    commit = next((data[k]["commit"] for k in ("environment", "env", "source") if data.get(k, {}).get("commit")), None)
    if commit is None:
        assert f"Undated: `{Path(file).name}` records no commit" in body
        return
    changed = git("rev-list", f"{commit}..HEAD", "--", *code)
    wanted = f"Measured at commit `{commit[:7]}`" + (", before later changes to" if changed else ";")
    assert wanted in body
