"""MkDocs hook: the results pages show the studies' own PNGs from bench/results/, served
as img/<name>.png, so the figures are never copied into docs/ and cannot go stale."""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"img/{png.name}", abs_src_path=str(png)))
    return files
