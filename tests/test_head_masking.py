"""Each head score checked by masking: the sink + window restriction equals a hand-masked eager attention
(grouped heads, a sliding window, learned sinks), a planted head that does the task is found by top-k masking
and not by random heads, the metrics count the tokens they say, and masking leaves the model as it was.
Layers and heads are 0-indexed."""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.capture.attention import intervene
from attnscope.errors import AttnscopeError
from attnscope.experiments.head_masking import (
    AblationMasking,
    FunctionMetric,
    WindowMasking,
    check_heads,
    check_score,
)
from attnscope.experiments.interventions import SinkWindow
from attnscope.experiments.metrics import (
    DocumentLoss,
    LanguageModelTask,
    RepeatedHalfLoss,
    Task,
    float64_logsumexp,
    token_batches,
)
from attnscope.experiments.random_tokens import repeated_random_tokens

from .tiny_architectures import VOCAB, build_folder

REFERENCE = "headmask_reference"  # transformers' eager attention of the family, with a hand-built per-head mask
SINK, WINDOW = 1, 2
RESTRICTED: dict[int, list[int]] = {0: [1], 1: [0, 3]}  # per layer: query heads (a KV group's heads one by one)
LENGTH = 14


# ---- the restriction against a hand-masked eager attention -----------------------------------------------------
def hand_masked_attention(module, query, key, value, attention_mask, **kwargs):
    """The family's own ``eager_attention_forward`` with the heads of :data:`RESTRICTED` at this layer shown only
    keys ``j < SINK`` or ``i - WINDOW < j <= i`` (query ``i``), on top of the model's mask (causal, window)."""
    family = importlib.import_module(type(module).__module__)
    heads = RESTRICTED.get(module.layer_idx)
    if heads:
        n_queries, n_keys = query.shape[2], key.shape[2]
        mask = attention_mask[:, :, :, :n_keys]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
        mask = mask.expand(mask.shape[0], query.shape[1], n_queries, n_keys).clone()  # [batch, head, q_pos, k_pos]
        for i in range(n_queries):
            position = n_keys - n_queries + i
            for j in range(n_keys):
                if not (j < SINK or position - WINDOW < j <= position):
                    mask[:, heads, i, j] = torch.finfo(query.dtype).min
        attention_mask = mask
    return family.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AttentionInterface, AutoConfig
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from attnscope.models.loading import _auto_class

    AttentionInterface.register(REFERENCE, hand_masked_attention)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    config = AutoConfig.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _auto_class(config).from_pretrained(folder, attn_implementation=REFERENCE).eval()
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt_oss"])
def test_sink_window_equals_a_hand_masked_eager_attention(model_type, tmp_path):
    folder = build_folder(model_type, tmp_path / model_type)
    loaded = load_model(str(folder))
    ids = torch.from_numpy(np.random.default_rng(0).integers(1000, 2000, size=(2, LENGTH)))
    with torch.inference_mode():
        intact = loaded.model(input_ids=ids).logits.float()
        with intervene(SinkWindow(RESTRICTED, SINK, WINDOW)):
            restricted = loaded.model(input_ids=ids).logits.float()
    reference = reference_logits(folder, ids)
    assert (restricted - reference).abs().max() <= 1e-5
    assert (intact - reference).abs().max() > 1e-3  # the restriction changes the model: the test can fail


def test_the_key_mask_keeps_the_sink_and_the_recent_keys_of_the_chosen_heads_only():
    """Query 9 restricted to sink 1 + window 2 keeps keys 0, 8 and 9; head 0, not chosen, keeps every key (the
    model's own mask, causal or windowed, is added in the attention function: the test above)."""
    from attnscope.models.adapters import AttentionSite

    site = AttentionSite(name="layers.0.self_attn", kind="self", layer=0, causal=True, out_proj=None)
    mask = SinkWindow({0: [1]}, 1, 2).key_mask(site, 2, 10, 10, torch.device("cpu"))
    assert mask is not None and mask.shape == (1, 2, 10, 10)
    assert mask[0, 1, 9].nonzero().ravel().tolist() == [0, 8, 9]  # the sink key and the two most recent
    assert bool(mask[0, 0].all())
    with pytest.raises(AttnscopeError, match="window >= 1"):
        SinkWindow({0: [1]}, 1, 0)


# ---- a planted head ---------------------------------------------------------------------------------------
PLANTED = (1, 1)  # the head that copies the payload (layer 1, query head 1: key/value head 0, shared with head 0)
PAYLOADS = range(1, 8)  # token ids the planted head copies
FILLERS = range(8, 16)
FLAG, BIAS = 16, 17  # residual dimensions: "this token is a payload", and a constant


def planted_model(folder):
    """A tiny Llama (2 layers, 4 query heads, 2 key/value heads, no MLP) in which head ``PLANTED`` attends from
    every token to the payload token (its key reads the payload flag, its query a constant) and writes the
    payload's identity to the residual, which the LM head reads: it predicts the payload at every later position.
    Every other head is small and random."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=16,
                                      tie_word_embeddings=False, bos_token_id=101, eos_token_id=102, pad_token_id=0,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, BIAS] = 1.0
        for token in [*PAYLOADS, *FILLERS]:
            embed[token, token] = 1.0
        embed[list(PAYLOADS), FLAG] = 1.0
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
        attention = model.model.layers[PLANTED[0]].self_attn
        head = slice(8 * PLANTED[1], 8 * PLANTED[1] + 8)
        attention.q_proj.weight[head] = 0.0
        attention.q_proj.weight[8 * PLANTED[1] + 3, BIAS] = 8.0  # the slowest rotary pair: position barely turns it
        attention.k_proj.weight[0:8] = 0.0
        attention.k_proj.weight[3, FLAG] = 8.0
        attention.v_proj.weight[0:8] = 0.0
        for token in PAYLOADS:
            attention.v_proj.weight[token - 1, token] = 1.0
        attention.o_proj.weight[:, head] = 0.0
        for token in PAYLOADS:
            attention.o_proj.weight[token, 8 * PLANTED[1] + token - 1] = 20.0
        model.lm_head.weight.zero_()
        for token in range(16):
            model.lm_head.weight[token, token] = 10.0
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_minilm()).save_pretrained(folder)
    return folder


def resolve_minilm():
    from attnscope.models.loading import resolve_source

    return resolve_source("minilm")


def payload_ids(n: int, length: int = 12, seed: int = 0) -> torch.Tensor:
    """``[n, length]``: fillers, a payload at position 2 and again at the end (what the last prediction must copy)."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(list(FILLERS), size=(n, length))
    ids[:, 2] = ids[:, -1] = rng.choice(list(PAYLOADS), size=n)
    return torch.from_numpy(ids).long()


class PayloadLoss(LanguageModelTask):
    name = "payload-loss"

    def __init__(self, loaded, ids: torch.Tensor) -> None:
        scored = torch.zeros(len(ids), ids.shape[1] - 1, dtype=torch.bool)
        scored[:, -1] = True  # only the prediction of the repeated payload
        Task.__init__(self, loaded, token_batches(ids, scored, 8, loaded.input_device))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    loaded = load_model(str(planted_model(tmp_path_factory.mktemp("planted"))))
    return loaded, PayloadLoss(loaded, payload_ids(24))


def planted_scores() -> np.ndarray:
    scores = np.random.default_rng(1).random((2, 4)) * 0.5
    scores[PLANTED] = 1.0
    return scores


def test_masking_the_planted_head_breaks_the_task_and_random_heads_mostly_do_not(planted):
    loaded, task = planted
    check = check_heads(loaded, planted_scores(), task, ks=(1, 2), draws=5, n_resamples=200)
    assert check.baseline < 0.1  # the intact model copies the payload
    assert check.sets["top 1"] == [PLANTED]
    rows = {(row["k"], row["heads"]): row for row in check.summary()}
    assert rows[1, "top"]["change"] > 10 and rows[1, "top"]["ci_low"] > 10
    for k in (1, 2):
        random = rows[k, "random"]
        for heads, change in zip(random["sets"], random["set_changes"]):
            assert (change > 10) == (PLANTED in heads)  # only a draw that holds the planted head breaks it
        assert rows[k, "top - random"]["change"] == pytest.approx(rows[k, "top"]["change"] - random["change"])
    frame = check.to_frame()
    assert set(frame["heads"]) == {"top", "random", "top - random"} and len(frame) == 6


def test_the_planted_heads_group_partner_is_masked_alone(planted):
    """Zero-ablating query head 0, which shares the planted head's key/value head, leaves the task intact."""
    loaded, task = planted
    scores = np.zeros((2, 4))
    scores[1, 0] = 1.0
    check = check_heads(loaded, scores, task, ks=(1,), draws=1, n_resamples=0)
    assert abs(check.summary()[0]["change"]) < 0.5


def test_restricting_the_planted_head_hides_the_payload_unless_the_sinks_hold_it(planted):
    loaded, task = planted
    scores = planted_scores()
    hidden = check_heads(loaded, scores, task, masking=WindowMasking(sink=1, window=4), ks=(1,), draws=1,
                         n_resamples=0, least=True)
    kept = check_heads(loaded, scores, task, masking=WindowMasking(sink=3, window=4), ks=(1,), draws=1,
                       n_resamples=0)
    assert hidden.summary()[0]["change"] > 10  # the payload (position 2) is outside sink 1 + the last 4 keys
    assert abs(kept.summary()[0]["change"]) < 1e-4  # the first 3 keys hold it
    assert {row["heads"] for row in hidden.summary()} == {"top", "bottom", "random", "top - random",
                                                         "bottom - random"}


def test_a_function_metric_fills_the_needle_slot(planted):
    """A metric measured by a function of the model (as needle trials will be): the last prediction's accuracy."""
    loaded, _ = planted
    ids = payload_ids(12, seed=3)

    def correct(model) -> np.ndarray:
        logits = model.model(input_ids=ids[:, :-1]).logits[:, -1]
        return (logits.argmax(-1) == ids[:, -1]).numpy()

    check = check_heads(loaded, planted_scores(), FunctionMetric(loaded, correct, "accuracy"), ks=(1,), draws=2,
                        n_resamples=100)
    assert check.baseline == 1.0 and check.summary()[0]["change"] == -1.0


def test_masking_leaves_the_model_as_it_was(planted):
    loaded, task = planted
    ids = payload_ids(4, seed=5)
    with torch.inference_mode():
        before = loaded.model(input_ids=ids).logits.clone()
    check = check_heads(loaded, planted_scores(), task, ks=(1, 3), draws=5, n_resamples=0)
    check_heads(loaded, planted_scores(), task, masking=WindowMasking(sink=1, window=2), ks=(1,), draws=1,
                n_resamples=0)
    with torch.inference_mode():
        after = loaded.model(input_ids=ids).logits
    assert torch.equal(before, after)
    np.testing.assert_array_equal(check.base, task.evaluate_all(loaded))  # the intact run is the model's own


def test_bad_input_is_one_line_before_the_model_runs(planted):
    loaded, task = planted
    with pytest.raises(AttnscopeError, match=r"\[layer, head\] = \(2, 4\)"):
        check_heads(loaded, np.zeros((3, 4)), task)
    with pytest.raises(AttnscopeError, match="each k must be within 1..8"):
        check_heads(loaded, np.zeros((2, 4)), task, ks=(9,))
    with pytest.raises(AttnscopeError, match="unknown attention pattern"):
        check_heads(loaded, np.zeros((2, 4)), task, masking=AblationMasking("nonsense"), ks=(1,))
    with pytest.raises(AttnscopeError, match="no masking check"):
        check_score(loaded, "nonsense", np.zeros((2, 4)))
    with pytest.raises(AttnscopeError, match="window >= 1"):
        check_score(loaded, "streaming", np.zeros((2, 4)), masking_options={"sink": 4, "window": 0})


# ---- the metrics count what they say -----------------------------------------------------------------------
def direct_loss(loaded, ids: torch.Tensor, first: int) -> float:
    """Mean cross-entropy of the predictions of tokens ``first..`` (0-indexed positions of ``ids``)."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits.double()
    return float(torch.nn.functional.cross_entropy(logits[:, first - 1 : -1].flatten(0, 1), ids[:, first:].ravel()))


def test_the_repeated_half_loss_counts_the_repeat_but_its_first_token(planted):
    loaded, _ = planted
    task = RepeatedHalfLoss(loaded, length=6, n=5, seed=2, batch_size=2)
    ids = torch.tensor(repeated_random_tokens(loaded, 6, sequences=5, seed=2))  # ([bos]) + half + half
    first = ids.shape[1] - 6 + 1  # the repeat's second token
    assert float(task.summarise(task.evaluate_all(loaded))) == pytest.approx(direct_loss(loaded, ids, first), abs=1e-9)


def test_the_chunked_float64_normalizer_equals_one_whole_logsumexp():
    rows = torch.randn(45, 300, generator=torch.Generator().manual_seed(0)) * 20
    whole = rows.double().logsumexp(-1)
    for chunk in (1, 7, 45, 256):  # chunks that divide the rows, leave a remainder, and exceed them
        assert torch.equal(float64_logsumexp(rows, chunk), whole)


def test_the_document_loss_counts_the_predictions_past_skip(planted):
    loaded, _ = planted
    task = DocumentLoss(loaded, names=["moby-dick-001"], length=40, n=2, skip=10)
    ids = torch.cat([batch.inputs["input_ids"] for batch in task.batches])
    assert ids.shape == (2, 40)
    assert float(task.summarise(task.evaluate_all(loaded))) == pytest.approx(direct_loss(loaded, ids, 11), abs=1e-9)
    with pytest.raises(AttnscopeError, match="the documents hold only"):
        DocumentLoss(loaded, names=["moby-dick-001"], length=loaded.max_length, n=100)
    with pytest.raises(AttnscopeError, match="pieces must be"):
        DocumentLoss(loaded, length=loaded.max_length + 1)
