import dataclasses
import json
import logging
import tracemalloc

import pytest

from minisparse.config.schema import DataConfig
from minisparse.data.datasets import (DataError, PromptSampler, check_data, load_prompts,
                                       max_line_bytes)
from minisparse.data.left_out import NO_LABEL, NO_PROMPT, NOT_FINITE, NOT_JSON, NOT_UTF8, TOO_LONG
from minisparse.data.synthetic import synthetic_rows
from minisparse.models.tiny import build_tokenizer

QWEN_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
               "Find $x$ if $2x + 3 = 11$.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_string_and_message_prompts(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": QWEN_PROMPT, "label": "4"},
        "",
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is $1/2 + 1/4$?"}], "label": "\\frac{3}{4}"},
        {"prompt": "Compute 7 * 6.", "label": 42},
        {"prompt": "Half of 3?", "label": 1.5},
    ])
    rows = load_prompts(DataConfig(path=path), tok)
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert [r.label for r in rows] == ["4", "\\frac{3}{4}", "42", "1.5"]
    assert rows[0].prompt_text == QWEN_PROMPT  # already templated: used as is
    assert rows[0].prompt_ids == tok(QWEN_PROMPT)["input_ids"]
    assert rows[1].prompt_text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                   "What is $1/2 + 1/4$?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(rows[1].prompt_ids) == rows[1].prompt_text
    assert rows[2].prompt_text == "Compute 7 * 6."


def test_a_rows_other_keys_travel_with_it(tmp_path, tok):
    """Keys besides prompt and label reach a reward plug-in as metadata."""
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "a", "answer": "1", "tests": ["x"], "source": "s"},
        {"question": "b", "answer": "2"},
    ])
    rows = load_prompts(DataConfig(path=path, input_key="question", label_key="answer"), tok)
    assert [r.extra for r in rows] == [{"tests": ["x"], "source": "s"}, {}]


def test_apply_chat_template_wraps_strings(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "What is 2+2?", "a": "4"}])
    cfg = DataConfig(path=path, input_key="q", label_key="a", apply_chat_template=True)
    (row,) = load_prompts(cfg, tok)
    assert row.prompt_text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_long_prompts_dropped_and_counted(tmp_path, tok, caplog):
    rows = [{"prompt": "short one", "label": "1"},
            {"prompt": "a much longer prompt " * 40, "label": "2"},
            {"prompt": "also short", "label": "3"}]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), max_prompt_len=20)
    stats = {}
    with caplog.at_level(logging.WARNING):
        kept = load_prompts(cfg, tok, stats=stats)
    assert [r.label for r in kept] == ["1", "3"] and [r.index for r in kept] == [0, 2]
    assert stats == {"rows": 3, "kept": 2, "left_out": 0, "dropped_too_long": 1}
    assert (f"dropped 1 of 3 prompts longer than max_prompt_len=20 tokens (first: "
            f"{cfg.path}:2)") in caplog.text
    with pytest.raises(DataError) as info:
        load_prompts(dataclasses.replace(cfg, max_prompt_len=1), tok)
    assert str(info.value) == (f"{cfg.path}: no usable prompts: all 3 usable rows are longer "
                               f"than max_prompt_len=1 tokens")


@pytest.mark.parametrize("line,message", [
    ('[1, 2]', "d.jsonl:2: expected a JSON object, got list"),
    ('{"question": "x", "label": "1"}', "d.jsonl:2: missing key 'prompt' (keys present: label, question)"),
    ('{"prompt": "x"}', "missing key 'label' (keys present: prompt)"),
    ('{"question": "x", "label": ""}', "d.jsonl:2: missing key 'prompt'"),
    ('{"prompt": [{"role": "user"}], "label": "1"}', "message 0 must be an object with string 'role'"),
    ('{"prompt": ["hi"], "label": "1"}', "message 0 must be an object"),
    ('{"prompt": 5, "label": "1"}', "prompt must be a string or a list of messages, got int"),
    ('{"prompt": "x", "label": ["1", "2"]}', "label must be a string or a number, got list"),
    ('{"prompt": "x", "label": true}', "got bool"),
])
def test_rows_that_do_not_fit_the_keys_stop_the_run(tmp_path, tok, line, message):
    """A missing key or a prompt or label of another type: the data.* settings are wrong,
    not one row. The same message from the tokenizer-free check a run makes before its
    model loads as from loading the prompts."""
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "fine", "label": "0"}', line])
    for read in (lambda cfg: load_prompts(cfg, tok), check_data):
        with pytest.raises(DataError) as info:
            read(DataConfig(path=path))
        assert message in str(info.value)


UNUSABLE = [  # (line, why it is left out, what data.strict stops with)
    ('{"prompt": "x", "label": ""}', NO_LABEL, "label is empty ('')"),
    ('{"prompt": "x", "label": "  "}', NO_LABEL, "label is empty ('  ')"),
    ('{"prompt": "x", "label": null}', NO_LABEL, "label is empty (None)"),
    ('{"prompt": "x", "label": NaN}', NOT_FINITE, "label is nan, not a finite number"),
    ('{"prompt": "x", "label": "nan"}', NOT_FINITE, "label is 'nan', not a number"),
    ('{"prompt": "x", "label": Infinity}', NOT_FINITE, "label is inf, not a finite number"),
    ('{"prompt": "x", "label": -Infinity}', NOT_FINITE, "label is -inf, not a finite number"),
    ('{"prompt": "   ", "label": "1"}', NO_PROMPT, "empty prompt"),
    ('{"prompt": null, "label": "1"}', NO_PROMPT, "empty prompt"),
    ('{"prompt": [], "label": "1"}', NO_PROMPT, "empty prompt (an empty message list)"),
    ('{"prompt": [{"role": "user", "content": " "}], "label": "1"}', NO_PROMPT,
     "empty prompt (all message contents are blank)"),
    ('{"prompt": "x", "label": "1"', NOT_JSON, "invalid JSON (Expecting ',' delimiter)"),
]


@pytest.mark.parametrize("line,reason,message", UNUSABLE)
def test_rows_no_run_can_train_on_are_left_out_and_counted(tmp_path, tok, line, reason,
                                                            message):
    """Left out, counted by reason with the first file:line, the rows around them kept;
    data.strict stops at the row instead, with the line it names."""
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "label": "0"}', line,
                                              '{"prompt": "b", "label": "2"}'])
    left_out = check_data(DataConfig(path=path))
    assert (left_out.rows, left_out.usable, dict(left_out.counts)) == (3, 2, {reason: 1})
    assert left_out.line() == (f"data: 1 of 3 rows left out (cannot be trained on): 1 "
                               f"{reason} (first: {path}:2); data.strict=true stops at such "
                               f"a row instead")
    stats = {}
    rows = load_prompts(DataConfig(path=path), tok, stats=stats)
    assert [(r.label, r.index) for r in rows] == [("0", 0), ("2", 2)]
    assert stats == {"rows": 3, "kept": 2, "left_out": 1, "dropped_too_long": 0}
    for read in (lambda cfg: load_prompts(cfg, tok), check_data):
        with pytest.raises(DataError) as info:
            read(DataConfig(path=path, strict=True))
        assert str(info.value) == f"{path}:2: {message}"


def test_left_out_rows_are_counted_by_reason_in_the_order_met(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": ""}\n{"prompt": "b", "label": "1"}\n'
                     b'{"prompt": "caf\xe9", "label": "1"}\n{"prompt": "c", "label": " "}\n'
                     b'{"prompt": "d", "label": NaN}\n')
    left_out = check_data(DataConfig(path=str(path)))
    assert (left_out.rows, left_out.usable) == (5, 1)
    assert left_out.reasons() == (f"2 {NO_LABEL} (first: {path}:1), 1 {NOT_UTF8} ({path}:3), "
                                  f"1 {NOT_FINITE} ({path}:5)")
    assert left_out.metrics() == {"data/rows": 5.0, "data/rows_left_out": 4.0}


def test_check_data_counts_rows_and_refuses_a_file_without_usable_rows(tmp_path):
    rows = [{"prompt": "a", "label": "1"}, "", {"q": [{"role": "user", "content": "b"}], "a": 2}]
    path = write_jsonl(tmp_path / "d.jsonl", rows[:2])
    assert (check_data(DataConfig(path=path)).rows, check_data(DataConfig(path=path)).line()) \
        == (1, None)
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"q": "a", "a": "1"}, rows[2]])
    assert check_data(DataConfig(path=mixed, input_key="q", label_key="a")).usable == 2
    assert check_data(DataConfig(path="synthetic", synthetic_size=7)).usable == 7
    for empty in (["", "  "], []):
        path = write_jsonl(tmp_path / "e.jsonl", empty)
        with pytest.raises(DataError, match=r"e.jsonl: no rows \(empty file\)"):
            check_data(DataConfig(path=path))
    path = write_jsonl(tmp_path / "u.jsonl", ['{"prompt": "a", "label": ""}', "{"])
    with pytest.raises(DataError) as info:
        check_data(DataConfig(path=path))
    assert str(info.value) == (f"{path}: no usable rows: all 2 left out (1 {NO_LABEL} "
                               f"(first: {path}:1), 1 {NOT_JSON} ({path}:2))")


def test_unreadable_and_empty_files(tmp_path, tok):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError) as info:
        load_prompts(DataConfig(path=missing), tok)
    assert str(info.value) == f"data.path: no such file: {missing}"  # no download to offer
    known = tmp_path / "simplelr_qwen_level3to5.jsonl"
    with pytest.raises(DataError) as info:
        load_prompts(DataConfig(path=str(known)), tok)
    assert str(info.value) == (
        f"data.path: no such file: {known}; fetch it with: python -m minisparse.download "
        f"--dataset simplelr_qwen_level3to5 --out {tmp_path}/")
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(DataError) as info:
        load_prompts(DataConfig(path=str(tmp_path / "folder.jsonl")), tok)
    assert str(info.value) == (f"data.path: {tmp_path / 'folder.jsonl'} is a folder; give "
                               f"the JSONL file; it holds no .jsonl file")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(DataError, match=f"bin.jsonl: no usable rows: all 1 left out \\(1 "
                                        f"{NOT_UTF8}"):
        load_prompts(DataConfig(path=str(tmp_path / "bin.jsonl")), tok)
    with pytest.raises(DataError, match="no rows"):
        load_prompts(DataConfig(path=write_jsonl(tmp_path / "e.jsonl", ["", ""])), tok)


def test_a_folder_as_data_path_names_the_files_in_it(tmp_path, tok):
    """A directory said "no such file"; it is there, and the file wanted is in it."""
    for name in ("train.jsonl", "test.jsonl", "notes.txt"):
        (tmp_path / name).write_text("")
    with pytest.raises(DataError) as info:
        check_data(DataConfig(path=str(tmp_path)))
    assert str(info.value) == (f"data.path: {tmp_path} is a folder; give the JSONL file; "
                               f"the .jsonl files in it: test.jsonl, train.jsonl")


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path, tok):
    """Editors on Windows start UTF-8 files with one; the first row was left out as not
    valid JSON."""
    rows = [{"prompt": "What is 1+1?", "label": "2"}, {"prompt": "What is 2+2?", "label": "4"}]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    left_out = check_data(DataConfig(path=str(path)))
    assert (left_out.rows, left_out.total) == (2, 0)
    assert [r.label for r in load_prompts(DataConfig(path=str(path)), tok)] == ["2", "4"]
    path.write_bytes(b'{"prompt": "x", "label": "1"}\n\xef\xbb\xbf{"prompt": "y", "label": 2}\n')
    left_out = check_data(DataConfig(path=str(path)))  # past line 1 it is not a mark
    assert left_out.counts == {NOT_JSON: 1} and left_out.first[NOT_JSON] == f"{path}:2"


def test_bytes_that_are_not_utf8_are_named_with_their_line(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "fine", "label": "0"}\n{"prompt": "caf\xe9", "label": "1"}\n')
    assert check_data(DataConfig(path=str(path))).first == {NOT_UTF8: f"{path}:2"}
    for read in (lambda cfg: load_prompts(cfg, tok), check_data):
        with pytest.raises(DataError) as info:
            read(DataConfig(path=str(path), strict=True))
        assert str(info.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at byte 16 of the line)"


class OnlyShortText:
    """The tokenizer, failing at once on a text too long for any prompt that fits: the
    loader tokenized a 40 MB line whole (103 s, 9.8 GB) only to drop it as too long."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def __call__(self, text: str, **kwargs):
        assert len(text) < max_line_bytes(DataConfig()), "a huge line reached the tokenizer"
        return self.tok(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


def test_a_huge_line_is_left_out_unread_naming_its_line(tmp_path, tok):
    """A 40 MB line is read past in pieces, never decoded, parsed or tokenized whole:
    the Python memory it costs stays a few MB, and it is left out and counted, its line
    named; data.strict leaves it out too, as it drops prompts over max_prompt_len."""
    path = tmp_path / "d.jsonl"
    with path.open("wb") as f:
        f.write(b'{"prompt": "short", "label": "1"}\n{"prompt": "')
        f.write(b"x" * (40 << 20))
        f.write(b'", "label": "2"}\n{"prompt": "also short", "label": "3"}\n')
    cfg, stats = DataConfig(path=str(path)), {}
    tracemalloc.start()
    try:
        left_out = check_data(cfg)
        kept = load_prompts(cfg, OnlyShortText(tok), stats=stats)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert [r.label for r in kept] == ["1", "3"] and [r.index for r in kept] == [0, 2]
    assert stats == {"rows": 3, "kept": 2, "left_out": 1, "dropped_too_long": 0}
    assert left_out.reasons() == f"1 {TOO_LONG} (first: {path}:2)"
    strict = dataclasses.replace(cfg, strict=True)
    assert check_data(strict).first == {TOO_LONG: f"{path}:2"}
    assert [r.label for r in load_prompts(strict, OnlyShortText(tok))] == ["1", "3"]


def test_the_line_bound_leaves_room_for_metadata(tmp_path, tok):
    """max_line_bytes: 64 bytes a prompt token and 1 MiB for the label and other keys; a
    line of exactly the bound is read, one byte more is not."""
    cfg = DataConfig(max_prompt_len=8)
    bound = max_line_bytes(cfg)
    assert bound == 64 * 8 + (1 << 20)
    head, tail = '{"prompt": "hi", "label": "1", "tests": "', '"}'
    tests = bound - len(head) - len(tail)
    path = write_jsonl(tmp_path / "d.jsonl", [head + "t" * n + tail for n in (tests, tests + 1)])
    (row,) = load_prompts(DataConfig(path=path, max_prompt_len=8), tok)
    assert row.index == 0 and len(row.extra["tests"]) == tests


def test_template_failure_is_a_data_error(tmp_path, tok):
    no_template = build_tokenizer()
    no_template.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "x"}],
                                              "label": "1"}])
    with pytest.raises(DataError, match="d.jsonl:1: chat template failed"):
        load_prompts(DataConfig(path=path), no_template)


def test_synthetic_source(tok):
    rows = load_prompts(DataConfig(path="synthetic", synthetic_size=10), tok)
    expected = synthetic_rows(10, 0)
    assert [r.label for r in rows] == [e["label"] for e in expected]
    assert rows[3].prompt_text == expected[3]["prompt"]


def test_sampler_epochs_are_seeded_permutations():
    s = PromptSampler(num_rows=10, batch_size=4, seed=7)
    batches = [s.next_batch() for _ in range(5)]  # 20 draws = exactly 2 epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:] and flat[:10] != list(range(10))
    assert s.epoch == 1 and s.offset == 10
    again = PromptSampler(num_rows=10, batch_size=4, seed=7)
    assert [again.next_batch() for _ in range(5)] == batches
    other = PromptSampler(num_rows=10, batch_size=4, seed=8)
    assert [other.next_batch() for _ in range(5)] != batches


def test_sampler_without_shuffle_keeps_file_order():
    s = PromptSampler(num_rows=5, batch_size=3, seed=0, shuffle=False)
    assert [s.next_batch() for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_sampler_batch_larger_than_dataset():
    s = PromptSampler(num_rows=3, batch_size=7, seed=1)
    batch = s.next_batch()
    assert len(batch) == 7 and sorted(batch[:3]) == [0, 1, 2] and s.epoch == 2


def test_sampler_ranks_split_the_global_batch():
    ranks = [PromptSampler(20, 8, seed=3, rank=r, world_size=4) for r in range(4)]
    single = PromptSampler(20, 8, seed=3)
    for _ in range(4):
        shares = [r.next_batch() for r in ranks]
        assert all(len(s) == 2 for s in shares)
        assert [i for s in shares for i in s] == single.next_batch()
    with pytest.raises(ValueError, match="split evenly"):
        PromptSampler(20, 6, seed=0, rank=0, world_size=4)


def test_sampler_resume_continues_identically():
    s = PromptSampler(num_rows=9, batch_size=4, seed=11)
    for _ in range(3):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    expected = [s.next_batch() for _ in range(4)]
    resumed = PromptSampler(num_rows=9, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == expected
    with pytest.raises(ValueError, match="num_rows=9"):
        PromptSampler(num_rows=10, batch_size=4, seed=11).load_state_dict(state)


def test_real_training_files_load(shared_data, tok, tmp_path):
    """The head of each real file (copied to tmp only, to keep the test fast)."""
    loaded = {}
    for name in ("simplelr_qwen_level3to5", "simplelr_level3to5"):
        with open(shared_data / "train" / f"{name}.jsonl", encoding="utf-8") as handle:
            head = [next(handle) for _ in range(200)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(head), encoding="utf-8")
        loaded[name] = load_prompts(DataConfig(path=str(path), max_prompt_len=100_000), tok)
    qwen, llama = loaded["simplelr_qwen_level3to5"], loaded["simplelr_level3to5"]
    assert len(qwen) == len(llama) == 200
    assert qwen[0].prompt_text.startswith("<|im_start|>system")
    assert llama[0].prompt_text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert llama[0].prompt_text.endswith("<|im_start|>assistant\n")
    assert [r.label for r in qwen] == [r.label for r in llama]


def test_synthetic_difficulty_keys(tok):
    """data.synthetic_* reach the generated rows."""
    from minisparse.data.synthetic import Difficulty

    cfg = DataConfig(path="synthetic", synthetic_size=20, synthetic_max_operand=5,
                     synthetic_operators=["-"], synthetic_operations=2)
    rows = load_prompts(cfg, tok)
    expected = synthetic_rows(20, 0, Difficulty(5, ("-",), 2))
    assert [r.prompt_text for r in rows] == [e["prompt"] for e in expected]
    assert all(r.prompt_text.count(" - ") == 2 for r in rows)
