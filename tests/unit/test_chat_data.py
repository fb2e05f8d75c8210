"""The self-distillation prompts and their resumable answer file (tools/chat_data, tools/chat_prompts)."""

from __future__ import annotations

import json

import pytest
import torch

from tools.chat_data import _done, work_items
from tools.chat_prompts import HELDOUT_TOPICS, TEMPLATES, TRAINING_TOPICS, heldout_prompts, training_prompts


def test_held_out_prompts_name_no_training_topic_and_training_prompts_are_distinct_and_seeded():
    assert not set(HELDOUT_TOPICS) & set(TRAINING_TOPICS)
    training = training_prompts(2000)
    assert len(set(training)) == 2000 and training == training_prompts(2000)
    assert training[:800] == training_prompts(800)  # a larger run extends a smaller one: resumable
    assert training_prompts(50, seed=1) != training[:50]
    renderings = {template.format(topic=topic): topic for template in TEMPLATES
                  for topic in HELDOUT_TOPICS + TRAINING_TOPICS}
    assert all(renderings[prompt] in HELDOUT_TOPICS for prompt in heldout_prompts())  # each on a held-out topic
    assert not set(heldout_prompts()) & set(training_prompts(len(renderings)))


def test_a_rerun_keeps_complete_records_and_drops_a_torn_last_line(tmp_path):
    out = tmp_path / "chat.jsonl"
    assert _done(out) == set()
    records = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in (1, 2)]
    records[1]["answer"] = 3  # a second answer to the same prompt is another record
    out.write_text("".join(json.dumps(record) + "\n" for record in records) + '{"conversations": [{"fr')
    assert _done(out) == {("q1", 0), ("q2", 3)}
    assert out.read_text().count("\n") == 2 and out.read_text().endswith("}\n")  # the torn line is gone


def test_every_prompt_gets_its_first_answer_before_any_second_and_later_answers_are_sampled():
    prompts = training_prompts(40)
    items = work_items(prompts, answers=3, sampled=0.5, seed=0)
    assert [(p, i) for p, i, _ in items] == [(p, i) for i in range(3) for p in prompts]
    first = [sample for _, i, sample in items if i == 0]
    assert 5 < sum(first) < 35  # the --sampled share, seeded
    assert first == [sample for _, _, sample in work_items(prompts, answers=1, sampled=0.5, seed=0)]
    assert all(sample for _, i, sample in items if i > 0)
    assert not any(sample for _, _, sample in work_items(prompts, answers=1, sampled=0.0, seed=0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA device")
def test_asking_for_a_gpu_where_there_is_none_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from tools.chat_data import main

    result = CliRunner().invoke(main, ["--target", str(tmp_path), "--out", str(tmp_path / "chat.jsonl"),
                                       "--device", "cuda"])
    assert result.exit_code == 2 and "torch sees no CUDA device" in result.output
    assert not (tmp_path / "chat.jsonl").exists()


def test_an_out_file_of_another_kind_is_refused_not_appended_to(tmp_path):
    """--out pointing at the held-out prompts ({"prompt": ...} lines) died in KeyError: 'conversations'."""
    import click

    out = tmp_path / "heldout.jsonl"
    out.write_text('{"prompt": "Tell me about tides."}\n')
    with pytest.raises(click.ClickException, match="heldout.jsonl:1 is not a record this tool writes"):
        _done(out)
    assert out.read_text() == '{"prompt": "Tell me about tides."}\n'


def test_heldout_rewrites_its_own_file_but_never_a_file_of_answers(tmp_path):
    """--heldout --out chat.jsonl replaced the answers in chat.jsonl with 24 prompt lines, silently."""
    from click.testing import CliRunner

    from tools.chat_data import main

    answers = tmp_path / "chat.jsonl"
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    answers.write_text(json.dumps(record) + "\n")
    result = CliRunner().invoke(main, ["--heldout", "--out", str(answers)])
    assert result.exit_code == 1 and "chat.jsonl:1 is not a held-out prompt line" in result.output
    assert json.loads(answers.read_text()) == record
    prompts = tmp_path / "heldout.jsonl"
    for _ in range(2):  # a rerun of the training script writes the same file again
        result = CliRunner().invoke(main, ["--heldout", "--out", str(prompts)])
        assert result.exit_code == 0, result.output
    assert [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()] == heldout_prompts()
