"""minisparse/data/prompts.py: the prompt a model sees for an evaluation question, and that
the templates repeat the training rows' turns exactly."""
import pytest

from minisparse.data.prompts import prompt_text, prompt_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    from minisparse.models.tiny import build_tokenizer

    return build_tokenizer()


def test_boxed_prompt(tokenizer):
    text = prompt_text(tokenizer, "What is 2+2?", "boxed")
    assert text == ("What is 2+2? Please reason step by step, and put your final answer "
                    "within \\boxed{}.\n\n")
    assert tokenizer.decode(prompt_token_ids(tokenizer, "What is 2+2?", "boxed")) == text


def test_chat_prompt_matches_training_format(tokenizer):
    # The layout of simplelr_qwen_level3to5.jsonl's prompts (own question).
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "What is 2+2?\nPlease reason step by step, and put your final answer within "
        "\\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt_text(tokenizer, "What is 2+2?", "chat") == expected
    ids = prompt_token_ids(tokenizer, "What is 2+2?", "chat")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == expected


def test_user_prompt_is_the_synthetic_training_row(tokenizer):
    """--prompt-template user renders a question exactly as a data.path=synthetic row
    with apply_chat_template reaches the model during training."""
    from minisparse.config.schema import DataConfig
    from minisparse.data.datasets import load_prompts

    row = load_prompts(DataConfig(path="synthetic", synthetic_size=1,
                                  apply_chat_template=True), tokenizer)[0]
    question = row.prompt_text.split("user\n")[1].split(" Please reason")[0]
    assert question.startswith("What is $") and question.endswith("$?")
    assert prompt_text(tokenizer, question, "user") == row.prompt_text
    assert prompt_token_ids(tokenizer, question, "user") == row.prompt_ids
