"""mkdocs hooks: the committed benchmark results become pages of the site.

The tables and pictures stay where the benchmarks write them
(``benchmarks/results/*.md`` and ``*.png``); this hook adds them to the site under
``results/`` and lists every results page in the navigation (section "Results",
titled by its first heading), so a new benchmark's page needs no edit here. Pages
link to them as ``../benchmarks/results/NAME`` (a link that also works on GitHub);
the hook rewrites that prefix to ``results/`` before mkdocs checks the links, so
``mkdocs build --strict`` validates them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

_ROOT = Path(__file__).resolve().parent.parent
_RESULTS = _ROOT / "benchmarks" / "results"
_PREFIX = "../benchmarks/results/"
_SECTION = "Results"


def _results(suffixes: tuple[str, ...]) -> list[Path]:
    return [p for p in sorted(_RESULTS.iterdir()) if p.suffix in suffixes]


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _fill(nav: list) -> bool:
    """Put the results pages into the (first) ``Results`` section of ``nav``."""
    for item in nav:
        if isinstance(item, dict):
            for key, value in item.items():
                if key == _SECTION:
                    item[key] = [{_title(p): f"results/{p.name}"} for p in _results((".md",))]
                    return True
                if isinstance(value, list) and _fill(value):
                    return True
    return False


def on_config(config):
    if config["nav"] is not None:
        _fill(config["nav"])
    return config


def on_files(files, config):
    for path in _results((".md", ".png")):
        files.append(File(f"results/{path.name}", src_dir=str(_RESULTS.parent),
                          dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("results/"):
        return markdown
    return markdown.replace(_PREFIX, "results/")
