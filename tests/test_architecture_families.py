"""The architecture families (``attnscope.models.architectures``): each module holds its rows and bridges, the
registry lists every module, no model type or bridged class belongs to two families, and a family's bridge is
built with capture's one attention function."""

from __future__ import annotations

import pkgutil
from collections import Counter

import torch
from torch import nn

from attnscope.capture import bridges
from attnscope.capture.attention import attnscope_attention
from attnscope.models import architectures
from attnscope.models.adapters import Adapter
from attnscope.models.architectures.bridging import attend

SHARED = {"bridging", "generic"}  # what the families share, and the types in no family: not families


def test_every_module_of_the_package_is_a_listed_family():
    modules = {info.name for info in pkgutil.iter_modules(architectures.__path__)}
    listed = {family.__name__.rsplit(".", 1)[1] for family in architectures.FAMILIES}
    assert modules - SHARED == listed
    for family in architectures.FAMILIES:
        assert all(isinstance(row, Adapter) for row in family.ADAPTERS), family.__name__
        assert isinstance(family.BRIDGES, dict), family.__name__


def test_no_model_type_or_bridged_class_belongs_to_two_families():
    types = Counter(t for family in architectures.FAMILIES for row in family.ADAPTERS for t in row.model_types)
    classes = Counter(name for family in architectures.FAMILIES for name in family.BRIDGES)
    assert [t for t, n in types.items() if n > 1] == []
    assert [c for c, n in classes.items() if n > 1] == []
    assert len(architectures.BRIDGES) == sum(len(family.BRIDGES) for family in architectures.FAMILIES)


def test_a_model_type_in_no_family_is_read_from_the_model():
    assert architectures.adapter_for("no such type").generic
    assert architectures.adapter_for("no such type", is_encoder_decoder=True).generic
    assert architectures.adapter_for("gemma3_text").family == "gemma3"


class _Inline(nn.Module):
    """An attention module that computes attention itself (what a bridge stands in for)."""


class _Bridge(nn.Module):
    """A bridge as a family writes one: keeps the attention function it is given and calls it through ``attend``."""

    def __init__(self, original: nn.Module, attention) -> None:
        super().__init__()
        self.attnscope_attention = attention
        self.is_causal = False

    def forward(self, q, k, v):
        return attend(self, q, k, v, None, scaling=q.shape[-1] ** -0.5)


def test_a_familys_bridge_is_built_with_captures_attention_function(monkeypatch):
    monkeypatch.setitem(architectures.BRIDGES, "_Inline", _Bridge)
    model = nn.Sequential(nn.Identity(), _Inline())
    model.config = None
    assert bridges.install_bridges(model) == 1
    bridge = model[1]
    assert isinstance(bridge, _Bridge) and bridge.attnscope_attention is attnscope_attention
    q, k, v = torch.randn(3, 1, 2, 5, 4, generator=torch.Generator().manual_seed(0)).unbind(0)
    output, _ = bridge(q, k, v)  # outside a capture: plain softmax attention, [batch, q_pos, head, d_head]
    expected = torch.softmax(q @ k.transpose(2, 3) / 2.0, dim=-1) @ v
    torch.testing.assert_close(output, expected.transpose(1, 2))
