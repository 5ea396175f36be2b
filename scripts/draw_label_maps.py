"""How the real labelled set's maps were drawn and rendered for labelling (run once per batch; kept for the record).

    .venv/bin/python scripts/draw_label_maps.py /tmp/label-sheets        # batch 1, ids 0-71
    .venv/bin/python scripts/draw_label_maps.py /tmp/label-sheets-2 2    # batch 2, ids 72-123
    .venv/bin/python scripts/draw_label_maps.py /tmp/label-sheets-3 3    # batch 3, ids 124-171
    .venv/bin/python scripts/draw_label_maps.py /tmp/label-sheets-4 4    # batch 4, ids 172-217

writes ``candidates.tsv`` (id, layer, head, text, pair; the label column empty) and sheets of four
maps per PNG (``sheet_00.png`` ...), drawn with ``figures.draw_map`` with the main diagonal marked
by a thin red line (batch 1's second labelling pass and batch 2; batch 1's first pass had no
guide). Only maps are drawn, never the classifier's labels. See README.md beside this file.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import attnscope
from attnscope.analysis.figures import grid_figure
from attnscope.data import brown_pairs, brown_sentences

SEED = 2019  # the year of Kovaleva et al., Clark et al. and Vig
RANDOM_SINGLES = RANDOM_PAIRS = 24
CHOSEN_SINGLES = CHOSEN_PAIRS = 12
# heads that looked distinct on the seed pair ("I went to the store." / "At the store, I bought fresh
# strawberries."), viewed before any labelling; they only widen the variety of maps drawn
CHOSEN_HEADS = [(0, 2), (0, 5), (0, 0), (0, 7), (1, 8), (1, 4), (1, 9), (2, 11), (2, 8), (2, 1), (2, 9), (3, 8),
                (4, 9), (5, 11), (5, 10), (3, 4), (4, 5), (0, 3), (2, 0), (1, 7), (5, 3), (4, 6), (0, 8), (1, 11)]
MAX_SINGLE_WORDS, MAX_PAIR_WORDS = 22, 30

# batch 2 (held out): random maps plus new inputs for the heads whose batch-1 map a person labelled
# as a rare class (block, next/previous word, same word, vertical, heterogeneous) or whose note saw a
# self line; the classifier's output played no part in choosing them
SEED_2 = 2020
FIRST_ID_2 = 72
RANDOM_SINGLES_2 = RANDOM_PAIRS_2 = 12
RARE_HEADS_2 = [(4, 6), (1, 8), (0, 5), (0, 2), (0, 8), (5, 1), (5, 6), (3, 11), (5, 10), (5, 9), (1, 7), (0, 4),
                (1, 1), (2, 9)]


def words(text: str) -> int:
    return len(text.split())


def draw() -> list[tuple[int, int, str, str]]:
    """(layer, head, text, pair) for every map to label, in id order."""
    rng = random.Random(SEED)
    singles = [s for s in brown_sentences() if 8 <= words(s) <= MAX_SINGLE_WORDS]
    pairs = [p for p in brown_pairs() if words(p[0]) + words(p[1]) <= MAX_PAIR_WORDS]
    rng.shuffle(singles)
    rng.shuffle(pairs)
    chosen = list(CHOSEN_HEADS)
    rng.shuffle(chosen)
    drawn = []
    for index in range(RANDOM_SINGLES + CHOSEN_SINGLES):
        layer, head = (rng.randrange(6), rng.randrange(12)) if index < RANDOM_SINGLES else chosen.pop()
        drawn.append((layer, head, singles[index], ""))
    for index in range(RANDOM_PAIRS + CHOSEN_PAIRS):
        layer, head = (rng.randrange(6), rng.randrange(12)) if index < RANDOM_PAIRS else chosen.pop()
        drawn.append((layer, head, *pairs[index]))
    return drawn


def lower_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 1]


def repeats_a_word(text: str, pair: str) -> bool:
    """A single sentence with a word twice, or a pair with a word in both sentences (lower-cased)."""
    if not pair:
        found = lower_words(text)
        return len(set(found)) < len(found)
    return bool(set(lower_words(text)) & set(lower_words(pair)))


def draw_later(used: set[tuple[str, str]], seed: int, n_singles: int, n_pairs: int,
               rare_heads: list[tuple[int, int]], kinds: tuple[str, ...]) -> list[tuple[int, int, str, str]]:
    """A later batch: (layer, head, text, pair) on inputs not in ``used``.

    ``n_singles`` random single sentences and ``n_pairs`` random pairs with a random head each; then
    each head of ``rare_heads`` on one input per entry of ``kinds`` ("single" or "pair"), inputs that
    repeat a word (so that same-word attention can show), in that order.
    """
    rng = random.Random(seed)
    singles = [(s, "") for s in brown_sentences() if 8 <= words(s) <= MAX_SINGLE_WORDS and (s, "") not in used]
    pairs = [p for p in brown_pairs() if words(p[0]) + words(p[1]) <= MAX_PAIR_WORDS and p not in used]
    rng.shuffle(singles)
    rng.shuffle(pairs)
    drawn = []
    for pool, count in ((singles, n_singles), (pairs, n_pairs)):
        for _ in range(count):
            drawn.append((rng.randrange(6), rng.randrange(12), *pool.pop()))
    repeating = {"single": [item for item in singles if repeats_a_word(*item)],
                 "pair": [item for item in pairs if repeats_a_word(*item)]}
    for layer, head in rare_heads:
        drawn.extend((layer, head, *repeating[kind].pop()) for kind in kinds)
    return drawn


def inputs_of(drawn: list[tuple[int, int, str, str]]) -> set[tuple[str, str]]:
    return {(text, pair) for _, _, text, pair in drawn}


def draw_second() -> list[tuple[int, int, str, str]]:
    """Batch 2, ids from FIRST_ID_2, on inputs batch 1 did not use: 12 random single sentences and
    12 random pairs, then each head of RARE_HEADS_2 on one single sentence and one pair."""
    return draw_later(inputs_of(draw()), SEED_2, RANDOM_SINGLES_2, RANDOM_PAIRS_2, RARE_HEADS_2, ("single", "pair"))


# batch 3 (held out): the rare classes had 1-5 maps each, too few for a per-class score; so each head
# whose batch-1 or batch-2 map a person labelled block, diagonal, next_word, same_word,
# same_word_other_sentence or vertical gets new inputs that repeat a word, plus random maps
SEED_3 = 2021
FIRST_ID_3 = 124
RANDOM_SINGLES_3, RANDOM_PAIRS_3 = 6, 12
RARE_HEADS_3 = [(4, 6), (1, 1), (1, 8), (0, 8), (0, 0), (2, 9), (3, 11), (5, 6), (5, 1), (5, 2)]


def draw_third() -> list[tuple[int, int, str, str]]:
    """Batch 3, ids from FIRST_ID_3, on inputs batches 1-2 did not use: 6 random single sentences
    and 12 random pairs, then each head of RARE_HEADS_3 on two pairs and one single sentence."""
    return draw_later(inputs_of(draw() + draw_second()), SEED_3, RANDOM_SINGLES_3, RANDOM_PAIRS_3, RARE_HEADS_3,
                      ("pair", "pair", "single"))


# batch 4 (held out): batch 3 had been scored with the current rules; the diagonal class still had a
# single map, so 1-1 (the only head the labeller had labelled diagonal) gets two turns
SEED_4 = 2022
FIRST_ID_4 = 172
RANDOM_SINGLES_4 = RANDOM_PAIRS_4 = 8
RARE_HEADS_4 = [(1, 1), (1, 1), (4, 6), (1, 8), (0, 5), (0, 2), (1, 2), (0, 8), (0, 0), (2, 9), (3, 11), (5, 6),
                (5, 1), (5, 2), (5, 7)]


def draw_fourth() -> list[tuple[int, int, str, str]]:
    """Batch 4, ids from FIRST_ID_4, on inputs batches 1-3 did not use: 8 random single sentences and
    8 random pairs, then each head of RARE_HEADS_4 on one single sentence and one pair."""
    used = inputs_of(draw() + draw_second() + draw_third())
    return draw_later(used, SEED_4, RANDOM_SINGLES_4, RANDOM_PAIRS_4, RARE_HEADS_4, ("single", "pair"))


BATCHES = {1: (draw, 0), 2: (draw_second, FIRST_ID_2), 3: (draw_third, FIRST_ID_3), 4: (draw_fourth, FIRST_ID_4)}


def main(out: Path, batch: int = 1, guide: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    drawer, first_id = BATCHES[batch]
    drawn = drawer()
    model = attnscope.load_model("minilm")
    records = list(attnscope.extract_corpus(model, [(t, p or None) for _, _, t, p in drawn], progress=False))
    with open(out / "candidates.tsv", "w") as handle:  # plain TAB-separated fields; texts hold no TAB
        handle.write("id\tlayer\thead\tlabel\ttext\tpair\tnote\n")
        handle.writelines(f"{index}\t{layer}\t{head}\t\t{text}\t{pair}\t\n"
                          for index, (layer, head, text, pair) in enumerate(drawn, start=first_id))
    for sheet in range(0, len(drawn), 4):
        maps = [(records[i].attention[drawn[i][0], drawn[i][1]], records[i].tokens,
                 f"#{first_id + i}  layer {drawn[i][0]} head {drawn[i][1]}") for i in range(sheet, min(sheet + 4, len(drawn)))]
        grid_figure(maps, diagonal_guide=guide).savefig(out / f"sheet_{sheet // 4:02d}.png", dpi=55)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
