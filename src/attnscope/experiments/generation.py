"""Interventions during generation: the same text generated intact and changed, side by side.

A :class:`GenerationChanges` names what to change (heads ablated, attention corrupted to a
pattern, sublayers skipped); :func:`compare_generations` generates greedily twice, once intact
and once with the changes active at every step, and says where the two texts part.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..capture.generate import generate
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..records.generation import GenerationRecord
from .interventions import ablate_heads, check_layers_and_heads, corrupt_attention, pattern_names, skip_sublayers


@dataclass(frozen=True)
class GenerationChanges:
    """What to change while generating (layers and heads 0-indexed).

    ``ablate``: ``{layer: [head, ...]}`` heads whose output is zeroed (None: every head of the layer);
    ``corrupt``: a pattern name (``uniform``, ``beginning``, ``end``, ``previous``) replacing attention at
    ``corrupt_layers``/``corrupt_heads`` (None: all); ``skip_attention``/``skip_ffn``: layers whose
    attention or feed-forward sublayer adds nothing to the residual stream.
    """

    ablate: Mapping[int, Sequence[int] | None] = field(default_factory=dict)
    corrupt: str | None = None
    corrupt_layers: Sequence[int] | None = None
    corrupt_heads: Sequence[int] | None = None
    skip_attention: Sequence[int] = ()
    skip_ffn: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.corrupt is not None and self.corrupt not in pattern_names():
            raise AttnscopeError(f"unknown attention pattern {self.corrupt!r}; choose from {', '.join(pattern_names())}")

    @property
    def empty(self) -> bool:
        return not (self.ablate or self.corrupt or self.skip_attention or self.skip_ffn)

    def describe(self) -> str:
        """One line naming every change, e.g. ``ablate 3:4,7; uniform attention at layers 0-5``."""
        parts = [f"ablate {layer}:{'all' if heads is None else ','.join(map(str, heads))}"
                 for layer, heads in self.ablate.items()]
        if self.corrupt:
            where = f" at layers {_numbers(self.corrupt_layers)}" if self.corrupt_layers is not None else ""
            heads = f" heads {_numbers(self.corrupt_heads)}" if self.corrupt_heads is not None else ""
            parts.append(f"{self.corrupt} attention{where}{heads}")
        if self.skip_attention:
            parts.append(f"skip attention of layers {_numbers(self.skip_attention)}")
        if self.skip_ffn:
            parts.append(f"skip feed-forward of layers {_numbers(self.skip_ffn)}")
        return "; ".join(parts)

    def check(self, loaded: LoadedModel) -> None:
        """Refuse a layer or head ``loaded`` does not have (one line naming the option), before any
        generation: an intervention on a layer that does not exist would change nothing, silently."""
        ablated_heads = [head for heads in self.ablate.values() for head in heads or ()]
        check_layers_and_heads(loaded, self.ablate, ablated_heads, options=("--ablate", "--ablate"))
        check_layers_and_heads(loaded, self.corrupt_layers, self.corrupt_heads)
        check_layers_and_heads(loaded, self.skip_attention, options=("--skip-attention", ""))
        check_layers_and_heads(loaded, self.skip_ffn, options=("--skip-ffn", ""))

    @contextmanager
    def active(self, loaded: LoadedModel) -> Iterator[None]:
        """Every change at once, for the forward passes run inside the block (removed on exit)."""
        with ExitStack() as stack:
            if self.ablate:
                stack.enter_context(ablate_heads(self.ablate, kind="self"))
            if self.corrupt:
                stack.enter_context(corrupt_attention(self.corrupt, layers=self.corrupt_layers,
                                                      heads=self.corrupt_heads, kinds=["self"]))
            if self.skip_attention or self.skip_ffn:
                stack.enter_context(skip_sublayers(loaded, attention=self.skip_attention, ffn=self.skip_ffn))
            yield


def _numbers(numbers: Sequence[int] | None) -> str:
    return ",".join(map(str, numbers or ()))


@dataclass(frozen=True)
class GenerationComparison:
    """The intact and the changed generation of one prompt; ``parted_at``: the first step (0-indexed
    generated token) where they differ, None if they never do."""

    intact: GenerationRecord
    changed: GenerationRecord
    changes: GenerationChanges

    @property
    def parted_at(self) -> int | None:
        ours, theirs = self.intact.generated_tokens, self.changed.generated_tokens
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                return step
        return None if len(ours) == len(theirs) else min(len(ours), len(theirs))

    def to_json(self) -> dict[str, Any]:
        step = self.parted_at
        return {"changes": self.changes.describe(), "intact": self.intact.generated_text,
                "changed": self.changed.generated_text, "parted_at": step,
                "intact_token": _token_at(self.intact, step), "changed_token": _token_at(self.changed, step)}


def _token_at(record: GenerationRecord, step: int | None) -> str | None:
    return None if step is None or step >= record.n_steps else record.generated_tokens[step]


def compare_generations(loaded: LoadedModel, prompt: str, changes: GenerationChanges,
                        **options: Any) -> GenerationComparison:
    """Generate ``prompt`` intact, then with ``changes`` active at every step (same options, greedy
    unless ``do_sample`` with the same seed); ``options`` go to :func:`attnscope.generate`."""
    if changes.empty:
        raise AttnscopeError("nothing to change: give --ablate, --corrupt, --skip-attention or --skip-ffn")
    changes.check(loaded)
    intact = generate(loaded, prompt, **options)
    with changes.active(loaded):
        changed = generate(loaded, prompt, changes=changes.describe(), **options)
    return GenerationComparison(intact, changed, changes)
