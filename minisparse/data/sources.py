"""The training sets that `python -m minisparse.download --dataset NAME` knows by name:
which hub file each comes from, which columns hold its prompt and its answer, and how a
prompt is rewritten on the way to the {prompt, label} JSONL that data/datasets.py reads.

slime's quick-start sets (zhuzilin/dapo-math-17k and zhuzilin/aime-2024: one JSONL file
each, `prompt` and `label`) are the default sources of dapo_math_17k and aime_2024; the
originals of the DAPO authors (BytedTsinghua-SIA/..., parquet, the prompt as chat
messages and the answer in reward_model.ground_truth) are read as well. Both carry DAPO's
instruction to end with a line "Answer: ...", which minisparse's grader does not read (it
reads the last \\boxed{}, data/reward.py): the problem is kept and the instruction replaced
by the one the generated and evaluation prompts use. The originals repeat each problem
(DAPO-Math-17k holds about 100 copies of each), so repeated rows are dropped.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minisparse.data.synthetic import user_prompt

SIMPLERL_HUB = "hkust-nlp/SimpleRL-Zoo-Data"
PROMPT_FIELDS = ("prompt", "question", "problem", "input", "instruction")
LABEL_FIELDS = ("label", "answer", "gt_answer", "final_answer", "ground_truth",
                "reward_model.ground_truth")

DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response "
             "should be of the form Answer: $Answer (without quotes) where $Answer is the "
             "answer to the problem.\n\n")
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


@dataclass(frozen=True)
class HubFile:
    repo: str  # hub dataset id
    path: str  # the file inside it; {split} is filled in

    def file(self, split: str) -> str:
        return self.path.format(split=split)


@dataclass(frozen=True)
class Source:
    """One named training set: files[0] is read unless --source names another."""
    name: str
    files: tuple[HubFile, ...]
    prompt_fields: tuple[str, ...] = PROMPT_FIELDS  # the first present is read
    label_fields: tuple[str, ...] = LABEL_FIELDS  # dotted: a nested field
    prompt: Callable[[Any], Any] | None = None  # rewrites a row's prompt; None: as it is
    dedupe: bool = False  # drop rows whose prompt and label repeat an earlier row's
    about: str = ""

    def hub_file(self, repo: str | None) -> HubFile:
        """The file to read from `repo` (None: the default source); a repo this set does
        not name is taken as a mirror of the default's layout."""
        if repo is None:
            return self.files[0]
        known = [f for f in self.files if f.repo == repo]
        return known[0] if known else HubFile(repo, self.files[0].path)


def _user_text(messages: list) -> str:
    """The last user message of a chat prompt (DAPO's originals hold just that one)."""
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise ValueError(f"prompt holds no user message with text: {messages!r:.120}")
    return users[-1]


def boxed_prompt(prompt: Any) -> str:
    """A DAPO prompt (its text, or its chat messages) as the problem followed by the
    instruction to box the final answer; text without DAPO's instruction is taken whole."""
    text = prompt if isinstance(prompt, str) else _user_text(list(prompt))
    if text.startswith(DAPO_HEAD) and text.endswith(DAPO_TAIL):
        text = text[len(DAPO_HEAD):-len(DAPO_TAIL)]
    return user_prompt(text.strip())


def simplerl(name: str, repo: str = SIMPLERL_HUB, about: str = "") -> Source:
    """A SimpleRL-Zoo subset (one folder per subset, holding SPLIT.parquet), or the same
    layout in another hub dataset; the prompt is kept as it is."""
    return Source(name, (HubFile(repo, f"{name}/{{split}}.parquet"),), about=about)


def _dapo(name: str, slime: HubFile, original: HubFile, about: str) -> Source:
    return Source(name, (slime, original), prompt_fields=("prompt",),
                  label_fields=("label", "reward_model.ground_truth"), prompt=boxed_prompt,
                  dedupe=True, about=about)


SOURCES: dict[str, Source] = {
    "dapo_math_17k": _dapo(
        "dapo_math_17k", HubFile("zhuzilin/dapo-math-17k", "dapo-math-17k.jsonl"),
        HubFile("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"),
        "DAPO's 17k math problems, integer answers (slime's training set)"),
    "aime_2024": _dapo(
        "aime_2024", HubFile("zhuzilin/aime-2024", "aime-2024.jsonl"),
        HubFile("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"),
        "AIME 2024's 30 problems (slime's evaluation set)"),
    "simplelr_qwen_level3to5": simplerl("simplelr_qwen_level3to5",
                                        about="the paper's set, Qwen template applied"),
    "simplelr_level3to5": simplerl("simplelr_level3to5", about="the same, chat messages"),
}


def find_source(name: str) -> Source | None:
    """The named set; any other simplelr_* name is a SimpleRL-Zoo subset too."""
    if name in SOURCES:
        return SOURCES[name]
    return simplerl(name) if name.startswith("simplelr_") else None


def known_sources() -> str:
    """One line per named set, for --help and for an unknown name."""
    lines = [f"  {name:24} {s.files[0].repo}: {s.about}" for name, s in SOURCES.items()]
    lines.append(f"  {'simplelr_*':24} any other subset of {SIMPLERL_HUB}")
    return "\n".join(lines)
