"""mkdocs hooks: the committed benchmark results become pages of the site.

The tables and pictures stay where the benchmarks write them
(``benchmarks/results/*.md`` and ``*.png``); this hook adds them to the site under
``results/``. Pages link to them as ``../benchmarks/results/NAME`` (a link that also
works on GitHub); the hook rewrites that prefix to ``results/`` before mkdocs checks
the links, so ``mkdocs build --strict`` validates them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

_ROOT = Path(__file__).resolve().parent.parent
_RESULTS = _ROOT / "benchmarks" / "results"
_PREFIX = "../benchmarks/results/"


def on_files(files, config):
    for path in sorted(_RESULTS.iterdir()):
        if path.suffix in (".md", ".png"):
            files.append(File(f"results/{path.name}", src_dir=str(_RESULTS.parent),
                              dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("results/"):
        return markdown
    return markdown.replace(_PREFIX, "results/")
