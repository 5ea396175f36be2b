"""Needle-in-a-haystack trials and the retrieval score (issue 48, Wu et al. 2024).

* the rule on hand-built steps: distinct needle positions whose token the head's top key held while it was generated;
* a hand-built two-layer GPT-2 whose induction head copies the needle scores 1, its silent (uniform) heads 0;
* the score from attnscope's decode-step rows equals the rule applied to transformers' eager ``output_attentions=True``
  rows of the whole generated sequence, teacher-forced (a tiny random Llama with grouped heads, and the planted model);
* haystacks: the needle at a sentence boundary at the stated depth, the context's length in tokens;
* bad input refused with one error before the model runs;
* the registered head score ``retrieval`` (``head_scores``) equals the rule on eager rows, per query head and per KV
  group, its needle settings checked before any task runs; its masking check (needle accuracy) breaks when the planted
  copy circuit is masked and only then.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import attnscope
from attnscope import HeadScoreSettings, head_scores
from attnscope.analysis.retrieval import retrieval_hits, retrieval_score, top_keys_of_rows
from attnscope.data import Needle, document, needle, needles
from attnscope.errors import AttnscopeError
from attnscope.experiments.head_functions import check_bounds
from attnscope.experiments.head_masking import check_score
from attnscope.experiments.needles import (
    DEFAULT_DOCUMENT,
    NeedlePrompt,
    hide_needle,
    needle_prompt,
    needle_trials,
    run_trial,
    token_spans,
)
from attnscope.models.loading import resolve_source

from .conftest import VOCAB
from .test_generate import eager_attention
from .test_routes import zeroed_gpt2


# ---- the rule on hand-built steps --------------------------------------------------------------------------------
def test_the_rule_counts_distinct_needle_tokens_whose_copy_was_generated():
    # prompt: positions 0..5, the needle at 2..4 holding tokens 7 8 9; the model generates 7 8 8 9
    ids = [1, 2, 7, 8, 9, 3, 7, 8, 8, 9]
    top = np.array([  # [step, layer=1, head=4]
        [2, 2, 0, 3],  # step 0 generates 7: head 0 copies it from 2; head 1 too; head 2 looks outside; head 3 at 8
        [3, 0, 3, 3],  # step 1 generates 8: head 0 and heads 2, 3 copy from 3
        [3, 0, 3, 6],  # step 2 generates 8 again: head 0 copies position 3 again (counted once); head 3 looks at 6,
        #                which holds 7 and lies outside the needle
        [4, 4, 1, 2],  # step 3 generates 9: heads 0 and 1 copy from 4; head 3's key 2 holds 7, not 9
    ])[:, None, :]
    hits = retrieval_hits(top, ids, 6, (2, 5))
    assert hits[0].tolist() == [[True, True, True], [True, False, True], [False, True, False], [False, True, False]]
    assert retrieval_score(top, ids, 6, (2, 5))[0].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 1 / 3])


def test_the_rule_refuses_a_needle_outside_the_prompt():
    with pytest.raises(AttnscopeError, match="needle span"):
        retrieval_score(np.zeros((1, 1, 1), dtype=np.int64), [1, 2, 3], 2, (1, 3))


# ---- a planted copy head -------------------------------------------------------------------------------------------
TOKENS, POSITIONS, PREV, OUT = 0, 8, 72, 80  # where each kind of information lives in the 128-wide residual stream
N_POSITIONS, SHARP, WRITE = 64, 4.0, 0.2
SEP = 102
NEEDLE = "b c d e f"  # the minilm tokenizer's 1038..1042
PLANTED_IDS = (SEP, 1038, 1039, 1040, 1041, 1042)  # token PLANTED_IDS[s] is the unit vector of dimension TOKENS + s
PLANTED_TEXT = "the sea was calm and the ship sailed on. [SEP] b c d e f and then the wind rose over the water. " \
               "what came after the mark?"  # the tokenizer adds a last [SEP]: the copy head reads the needle after it


def planted_gpt2(folder):
    """Two layers, two heads each, every weight 0 but the norms' gains, the planted tokens' embeddings and positions.
    Layer 0 head 0 attends to the previous position and writes its token into PREV; layer 1 head 0 (the copy head)
    attends to the position whose PREV holds its own token and writes that position's token into OUT, which the
    unembedding reads: after "[SEP] b c d e f ... [SEP]" the model copies "b c d e f" one token a step, its top key
    always the needle token it is generating. Heads 1 of both layers are silent: uniform attention."""
    import transformers

    model = zeroed_gpt2(n_embd=128, vocab_size=VOCAB, n_positions=N_POSITIONS, tie_word_embeddings=False)
    d = model.config.n_embd
    with torch.no_grad():
        model.transformer.wpe.weight[:, POSITIONS : POSITIONS + N_POSITIONS] = torch.eye(N_POSITIONS)
        previous, copy = (block.attn for block in model.transformer.h)
        for p in range(1, N_POSITIONS):  # a query at p looks for key p - 1 (head 0: columns 0..63 of each block)
            previous.c_attn.weight[POSITIONS + p, p - 1] = SHARP
        for p in range(N_POSITIONS):
            previous.c_attn.weight[POSITIONS + p, d + p] = 1.0
        for slot, token in enumerate(PLANTED_IDS):
            model.transformer.wte.weight[token, TOKENS + slot] = 1.0
            previous.c_attn.weight[TOKENS + slot, 2 * d + slot] = 1.0  # value: the token
            previous.c_proj.weight[slot, PREV + slot] = WRITE
            copy.c_attn.weight[TOKENS + slot, slot] = SHARP  # query: my token
            copy.c_attn.weight[PREV + slot, d + slot] = 1.0  # key: the token before you
            copy.c_attn.weight[TOKENS + slot, 2 * d + slot] = 1.0  # value: your token
            copy.c_proj.weight[slot, OUT + slot] = WRITE
            model.lm_head.weight[token, OUT + slot] = 1.0
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


def planted_prompt(loaded) -> NeedlePrompt:
    ids = attnscope.capture.generate.prompt_ids(loaded, PLANTED_TEXT, chat=False)
    start = PLANTED_TEXT.index(NEEDLE)
    [span] = token_spans(loaded, PLANTED_TEXT, False, ids, [(start, start + len(NEEDLE))])
    item = Needle("planted", "sentence", NEEDLE, "what came after the mark?", "", NEEDLE)
    return NeedlePrompt(item, "planted", len(ids), 0.5, "plain", PLANTED_TEXT, tuple(ids), span, span, len(ids), 0.5)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return attnscope.load_model(str(planted_gpt2(tmp_path_factory.mktemp("planted-copy"))))


def test_a_planted_copy_head_scores_1_and_uniform_heads_0(planted):
    prompt = planted_prompt(planted)
    assert [prompt.ids[i] for i in range(*prompt.needle_span)] == list(PLANTED_IDS[1:])
    trial = run_trial(planted, prompt, max_new_tokens=8)
    assert trial.answer.startswith(NEEDLE) and trial.counted  # the circuit copies the needle
    assert trial.scores[1, 0] == 1.0  # every needle token retrieved by the copy head
    assert trial.scores[0, 1] == 0.0 and trial.scores[1, 1] == 0.0  # the silent heads' top key is position 0
    assert trial.scores[0, 0] == 0.0  # the previous-token head looks at the text generated so far


# ---- equal to eager attention, teacher-forced --------------------------------------------------------------------
def eager_top_keys(loaded, token_ids: np.ndarray, n_prompt: int) -> np.ndarray:
    """The argmax key of transformers' eager rows that chose each generated token, ``[step, layer, head]``: one
    forward pass over the whole sequence, teacher-forced, ``output_attentions=True``."""
    rows = eager_attention(loaded, token_ids)  # [layer, head, q_pos, k_pos]
    return top_keys_of_rows([rows[:, :, position] for position in range(n_prompt - 1, len(token_ids) - 1)])


def perturbed_llama(folder):
    """The tiny Llama of the shared fixtures (6 query heads, 2 key/value heads) with weights drawn N(0, 0.3): peaked
    rows, so that their argmax is no near-tie."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=37, vocab_size=VOCAB, pad_token_id=0, bos_token_id=101,
                                      eos_token_id=102, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return attnscope.load_model(str(perturbed_llama(tmp_path_factory.mktemp("needle-llama"))))


def test_scores_from_recorded_rows_equal_the_rule_on_eager_rows(llama, planted):
    prompt = needle_prompt(llama, "passkey-1", length=120, depth=0.5)
    trial = run_trial(llama, prompt, max_new_tokens=6)
    eager = eager_top_keys(llama, trial.token_ids, len(prompt.ids))
    assert trial.top_keys.shape == (len(trial.token_ids) - len(prompt.ids), 3, 6)  # per query head
    np.testing.assert_array_equal(trial.top_keys, eager)
    np.testing.assert_array_equal(trial.scores, retrieval_score(eager, trial.token_ids, len(prompt.ids),
                                                                prompt.answer_span))
    copy = run_trial(planted, planted_prompt(planted), max_new_tokens=8)
    planted_eager = eager_top_keys(planted, copy.token_ids, len(copy.prompt.ids))
    np.testing.assert_array_equal(copy.top_keys, planted_eager)
    np.testing.assert_array_equal(copy.scores, retrieval_score(planted_eager, copy.token_ids, len(copy.prompt.ids),
                                                               copy.prompt.answer_span))


# ---- haystacks -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_the_needle_sits_at_a_sentence_boundary_at_the_stated_depth(llama, depth):
    tokenizer = llama.tokenizer
    item = needle("sentence-1")
    prompt = needle_prompt(llama, item, length=300, depth=depth)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    context = prompt.text.split("\n\n")[1]
    before, found, after = context.partition(item.text)
    assert found and count(context) == prompt.context_tokens
    assert 300 - 3 <= prompt.context_tokens <= 300  # the stated length, to the few tokens the joins change
    assert before == "" or re.search(r"[.!?][\"')\]]* $", before)  # after a sentence's end (or first)
    assert after == "" or after.startswith(" ") and not after[1].islower()  # before a sentence's start (or last)
    haystack = (before + after[1:]) if before else after[1:]
    assert document(DEFAULT_DOCUMENT).startswith(haystack.rstrip())  # the document's start, cut
    assert prompt.placed_depth == pytest.approx(count(before) / count(haystack), abs=2 / count(haystack))
    longest_sentence = max(count(s) for s in re.split(r"(?<=[.!?]) ", haystack))
    assert abs(prompt.placed_depth - depth) <= longest_sentence / count(haystack)
    def located(span: tuple[int, int]) -> str:
        return tokenizer.decode(list(prompt.ids[slice(*span)])).replace(" ", "")

    assert located(prompt.needle_span) == item.text.lower().replace(" ", "")  # the span is the needle, all of it
    assert located(prompt.answer_span) == "pumpernickel."  # the part the answer copies: from the answer on
    assert prompt.answer_span[1] == prompt.needle_span[1]


def test_shipped_needles_are_well_formed():
    items = needles()
    assert len({item.id for item in items}) == len(items) == 8
    for item in items:
        assert item.answer in item.text and item.question and item.text.startswith(item.answer_prefix)
        assert item.answer not in "".join(document(name) for name in ("sotu-1946-harry-s-truman", "moby-dick-001"))
    assert {item.kind for item in items} == {"pass key", "sentence"}


# ---- bad input -----------------------------------------------------------------------------------------------------
@contextmanager
def forward_counter(loaded) -> Iterator[list[int]]:
    """A list that grows by one each time the model runs forward, while the block runs."""
    calls: list[int] = []
    handle = loaded.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@pytest.mark.parametrize(("options", "message"), [
    ({"depths": [1.5]}, "depth must be between 0 and 1"),
    ({"depths": [-0.1]}, "depth must be between 0 and 1"),
    ({"lengths": [8]}, r"the needle is \d+ tokens, as long as the haystack of 8 tokens or longer"),
    ({"lengths": [100_000]}, "more than .* limit of 512 tokens"),
    ({"lengths": [480]}, "prompt tokens .* more than .* limit of 512 tokens"),  # the question pushes it past
    ({"needles": ["passkey-9"], "lengths": [200]}, "no shipped needle 'passkey-9'"),
    ({"form": "poem", "lengths": [200]}, "unknown prompt form 'poem'"),
    ({"document_name": "no-such-text", "lengths": [200]}, "no shipped document 'no-such-text'"),
])
def test_bad_input_is_refused_before_the_model_runs(llama, options, message):
    with forward_counter(llama) as calls, pytest.raises(AttnscopeError, match=message):
        needle_trials(llama, **options)
    assert not calls


def test_a_document_shorter_than_the_haystack_is_refused(llama):
    with pytest.raises(AttnscopeError, match=r"the document has \d+ tokens, fewer than the \d+ a haystack of 100"):
        hide_needle(llama.tokenizer, "One sentence. Two sentences.", "The key is 5.", 100, 0.5)


def test_a_generation_past_the_memory_is_refused_with_its_estimate(llama, monkeypatch):
    monkeypatch.setattr("attnscope.capture.plan.available_memory", lambda: 2**20)
    with forward_counter(llama) as calls, pytest.raises(AttnscopeError, match=r"generating \d+ tokens with .* needs about"):
        needle_trials(llama, lengths=[200])
    assert not calls


def test_an_encoder_is_refused(tiny_model_dir):
    bert = attnscope.load_model(str(tiny_model_dir("bert")))
    with pytest.raises(AttnscopeError, match="not a decoder-only language model"):
        needle_trials(bert)


@pytest.mark.parametrize("form", ["chat", "plain"])
def test_the_needle_is_located_in_a_real_tokenizer_and_its_chat_template(smollm2, form):
    prompt = needle_prompt(smollm2, "passkey-2", length=400, depth=0.5, form=form)
    decode = smollm2.tokenizer.decode
    assert decode(list(prompt.ids[slice(*prompt.needle_span)])).strip() == "The secret pass key is 3622173."
    assert decode(list(prompt.ids[slice(*prompt.answer_span)])).strip() == "3622173."
    assert decode(list(prompt.ids)).startswith("<|im_start|>") == (form == "chat")  # the template wraps the chat form


# ---- the registered score and its masking check ------------------------------------------------------------------
NEEDLE_GRID = HeadScoreSettings(needles=("passkey-1", "sentence-1"), needle_lengths=(160,), needle_depths=(0.5,),
                                needle_new_tokens=14)


def eager_greedy_answer(loaded, prompt_ids: tuple[int, ...], max_new_tokens: int) -> np.ndarray:
    """transformers' own greedy generation (eager attention) from ``prompt_ids``: the whole sequence."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        model.set_attn_implementation(previous)
    return out[0].numpy()


def test_the_registered_retrieval_score_equals_the_rule_on_eager_rows_per_head_and_kv_group(smollm2):
    """head_scores(["retrieval"]) on SmolLM2 against the rule applied to transformers' eager greedy answers and their
    eager rows (teacher-forced), averaged over the answered trials: SmolLM2 answers the pass key and not the sentence
    at 160 tokens, so the mean must leave the sentence out."""
    found = head_scores(smollm2, ["retrieval"], NEEDLE_GRID)
    expected = []
    for needle_id in NEEDLE_GRID.needles:
        prompt = needle_prompt(smollm2, needle_id, length=160, depth=0.5)
        token_ids = eager_greedy_answer(smollm2, prompt.ids, NEEDLE_GRID.needle_new_tokens)
        n_prompt = len(prompt.ids)
        answer = smollm2.tokenizer.decode(token_ids[n_prompt:].tolist(), skip_special_tokens=True)
        if prompt.needle.answer in answer:
            eager = eager_top_keys(smollm2, token_ids, n_prompt)
            expected.append(retrieval_score(eager, token_ids, n_prompt, prompt.answer_span))
    assert len(expected) == 1  # the pass key is answered, the sentence not
    reference = expected[0]  # [layer, head]
    assert reference.max() > 0.5  # some head copies most of the pass key: the comparison has teeth
    np.testing.assert_array_equal(found.scores["retrieval"], reference)
    groups = found.to_frame("kv_head")  # 9 query heads over 3 KV heads: groups of 3 adjacent heads
    np.testing.assert_array_equal(groups["retrieval_max"], reference.reshape(30, 3, 3).max(-1).ravel())
    np.testing.assert_allclose(groups["retrieval_mean"], reference.reshape(30, 3, 3).mean(-1).ravel())
    assert found.settings["needle_lengths"] == (160,) and found.n_kv_heads == 3


@pytest.mark.parametrize(("settings", "message"), [
    (HeadScoreSettings(needle_depths=(1.5,), needle_lengths=(200,)), "depth must be between 0 and 1"),
    (HeadScoreSettings(needles=("passkey-9",), needle_lengths=(200,)), "no shipped needle 'passkey-9'"),
    (HeadScoreSettings(needle_lengths=(8,)), "as long as the haystack"),
    (HeadScoreSettings(needle_lengths=(100_000,)), "more than .* limit of 512 tokens"),
    (HeadScoreSettings(needle_lengths=(200,), needle_document="no-such-text"), "no shipped document"),
    (HeadScoreSettings(needle_lengths=(200,), needle_form="poem"), "unknown prompt form"),
    (HeadScoreSettings(needles=(), needle_lengths=(200,)), "at least one length, one depth and one needle"),
])
def test_needle_settings_are_refused_before_any_task_runs(llama, settings, message):
    with forward_counter(llama) as calls, pytest.raises(AttnscopeError, match=message) as refused:
        head_scores(llama, ["induction", "retrieval"], settings)  # induction's task would run first
    assert not calls and "\n" not in str(refused.value)


@pytest.mark.parametrize(("settings", "message"), [
    (HeadScoreSettings(needle_depths=(0.5, -0.1)), "depth must be between 0 and 1"),
    (HeadScoreSettings(needles=("passkey-1", "nope")), "no shipped needle 'nope'"),
    (HeadScoreSettings(needle_document="no-such-text"), "no shipped document"),
    (HeadScoreSettings(needle_form="poem"), "unknown prompt form"),
    (HeadScoreSettings(needle_lengths=(0,)), "positive number of tokens"),
    (HeadScoreSettings(needle_new_tokens=0), "at least 1 token"),
])
def test_needle_bounds_need_no_model(settings, message):
    """What the command checks before it loads a model (check_bounds)."""
    with pytest.raises(AttnscopeError, match=message):
        check_bounds(["retrieval"], settings)
    check_bounds(["induction"], settings)  # only the scores asked for are checked


def test_masking_the_planted_copy_circuit_breaks_the_needle_and_random_heads_only_when_they_hold_it(planted):
    """The copy head (1, 0) scores retrieval 1 and is the top head; masking it loses the answer. Random single heads
    lose it exactly when they are part of the circuit (the copy head or the previous-token head (0, 0) it reads)."""
    prompt = planted_prompt(planted)
    scores = run_trial(planted, prompt, max_new_tokens=8).scores
    check = check_score(planted, "retrieval", scores, ks=(1,), draws=5, n_resamples=0,
                        metric_options={"prompts": [prompt], "max_new_tokens": 8})
    assert check.metric == "needle accuracy" and check.baseline == 1.0
    assert check.sets["top 1"] == [(1, 0)]
    rows = {row["heads"]: row for row in check.summary()}
    assert rows["top"]["change"] == -1.0
    for heads, change in zip(rows["random"]["sets"], rows["random"]["set_changes"]):
        assert change == (-1.0 if {(0, 0), (1, 0)} & set(heads) else 0.0)
    assert any(change == 0.0 for change in rows["random"]["set_changes"])  # some draw misses the circuit
    again = run_trial(planted, prompt, max_new_tokens=8)  # masking left the model as it was
    assert again.counted and again.answer == run_trial(planted, prompt, max_new_tokens=8).answer
