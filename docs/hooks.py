"""mkdocs hook: the benchmark plot (written by benchmarks/run.py next to results.md)
becomes part of the site, at performance/results.png."""

from pathlib import Path

from mkdocs.structure.files import File

PLOT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "results.png"


def on_files(files, config):
    files.append(File.generated(config, "assets/results.png", abs_src_path=str(PLOT)))
    return files
