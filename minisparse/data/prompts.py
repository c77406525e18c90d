"""The prompt a model sees for an evaluation question (eval.prompt_template): the paper's
"boxed" instruction after the question without a chat template, the training set's chat
turn ("chat"), or a data.path=synthetic row's user turn ("user"); a training file's row
keeps its own prompt."""
from __future__ import annotations

from typing import Any

from minisparse.config.schema import ConfigError, PromptTemplate, choices
from minisparse.data.benchmarks import Problem
from minisparse.data.datasets import render_prompt
from minisparse.data.synthetic import user_prompt

# The paper's default prompt: the question, this instruction, no chat template.
BOXED_INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}.\n\n"
# The training set's turn (simplelr_qwen_level3to5.jsonl), doubled braces as published:
# the model saw exactly this during RL, so the chat template repeats it verbatim.
CHAT_SYSTEM = "You are a helpful assistant."
CHAT_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."
PROMPT_TEMPLATES = choices(PromptTemplate)


def check_prompt_template(tokenizer: Any, template: str) -> None:
    """Fail before generation when the template is unknown or the tokenizer cannot do it."""
    if template not in PROMPT_TEMPLATES:
        raise ConfigError(f"unknown prompt template '{template}'; use one of {PROMPT_TEMPLATES}")
    if template in ("chat", "user") and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template; use --prompt-template boxed")


def prompt_text(tokenizer: Any, question: str, template: str) -> str:
    """The prompt string the model sees for one question."""
    if template == "boxed":
        return question + BOXED_INSTRUCTION
    if template == "user":  # a training row of data.path=synthetic with apply_chat_template
        return tokenizer.apply_chat_template([{"role": "user", "content": user_prompt(question)}],
                                             tokenize=False, add_generation_prompt=True)
    messages = [
        {"role": "system", "content": CHAT_SYSTEM},
        {"role": "user", "content": question + CHAT_INSTRUCTION},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer: Any, question: str, template: str) -> list[int]:
    """Token ids; special tokens (BOS) are added only where the chat template has none."""
    text = prompt_text(tokenizer, question, template)
    return list(tokenizer.encode(text, add_special_tokens=template == "boxed"))


def problem_prompt_ids(tokenizer: Any, problem: Problem, template: str) -> list[int]:
    """A training file's row keeps its own prompt; a benchmark's question takes the template."""
    if problem.prompt is not None:
        return render_prompt(problem.prompt, tokenizer)
    return prompt_token_ids(tokenizer, problem.question, template)
