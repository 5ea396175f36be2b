"""How the labelled SmolLM2 maps for the ``sink`` class were drawn (run once; kept for the record).

    PYTHONPATH=src .venv/bin/python scripts/draw_sink_label_maps.py /tmp/sink-sheets

writes ``candidates.tsv`` (id, layer, head, text; the label column empty) and sheets of four maps
per PNG, drawn with ``figures.grid_figure`` (the main diagonal marked by a thin red line). Only maps
are drawn, never the classifier's labels; they were labelled by looking, as README.md beside this
file describes (section "SmolLM2 sink maps").
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 2023  # the year of Xiao et al.'s attention sinks
N_MAPS = 32
N_LAYERS, N_HEADS = 30, 9  # SmolLM2-135M
MIN_WORDS, MAX_WORDS = 8, 18


def draw() -> list[tuple[int, int, str]]:
    """(layer, head, text) for every map to label, in id order: random single Brown sentences, random heads."""
    from attnscope.data import brown_sentences

    rng = random.Random(SEED)
    sentences = [s for s in brown_sentences() if MIN_WORDS <= len(s.split()) <= MAX_WORDS]
    rng.shuffle(sentences)
    return [(rng.randrange(N_LAYERS), rng.randrange(N_HEADS), sentences[i]) for i in range(N_MAPS)]


def main(out: Path) -> None:
    from attnscope import extract, load_model
    from attnscope.analysis.figures import grid_figure

    out.mkdir(parents=True, exist_ok=True)
    model = load_model("smollm2")
    drawn = draw()
    lines = ["id\tlayer\thead\ttext"]
    maps = []
    for index, (layer, head, text) in enumerate(drawn):
        record = extract(model, text)
        maps.append((record.attention[layer, head], record.tokens, f"map {index}"))
        lines.append(f"{index}\t{layer}\t{head}\t{text}")
    (out / "candidates.tsv").write_text("\n".join(lines) + "\n")
    for sheet in range(0, len(maps), 4):
        grid_figure(maps[sheet : sheet + 4], columns=2, diagonal_guide=True).savefig(out / f"sheet_{sheet // 4:02d}.png",
                                                                                       dpi=70)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
